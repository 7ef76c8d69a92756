"""A live re-size of a real (tiny) training: the scheduler's request reaches the run through
its heartbeat, the training stops at a step boundary with a checkpoint, relaunches on the new
plan with the same global batch and resumes; the loss sequence equals an uninterrupted run's.

Both plans run without ZeRO: a ZeRO-2 (DeepSpeed) checkpoint resumed on a plain data-parallel
plan differed from the uninterrupted run by up to 0.17 in loss after the switch (measured with
this test, 120 steps), a trainer checkpoint matter outside the re-size path."""
from __future__ import annotations

import threading
import time

import pytest

pytestmark = [pytest.mark.slow]

TINY = {"name": "live-resize", "model": "gpt2-tiny", "seq_len": 64, "global_batch": 8,
        "train_steps": 120, "precision": "fp32", "lr": 0.003, "checkpoint_every": 1000}


TWO_POOLS = ("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n"
             "  - {name: cpu-b, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")


def _setup(tmp_path, name, steps=None, cluster_yaml=None):
    from estimator.job import TrainingJob
    from estimator.plans import plans_for_job
    from ledger import Ledger
    from ledger.queue import JobQueue
    from scheduler.cluster import parse_cluster
    from trainer.fallback import realisable

    cluster = parse_cluster(cluster_yaml or "pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")
    led = Ledger(f"sqlite:///{tmp_path / (name + '.db')}")
    led.sync_cluster(cluster)
    job = TrainingJob.model_validate({**TINY, "name": name, **({"train_steps": steps} if steps else {})})
    plans = [p for p in plans_for_job(job, cluster.inventory(), gpus_per_node=cluster.gpus_per_node(),
                                      gpus=cluster.gpu_catalog())["CPU"] if realisable(p)]
    one = next(p for p in plans if p.gpus == 1 and p.zero == 0 and p.act_ckpt == "none")
    two = next(p for p in plans if p.gpus == 2 and p.zero == 0 and p.act_ckpt == "none")
    return led, JobQueue(led), job, one, two


def _train(led, job, job_id, plan, placement, **kw):
    from frenzy_flows.results import Assignment
    from frenzy_flows.training import run_allocated_training

    alloc = led.allocate(job_id, plan, placement)
    from ledger.queue import JobQueue
    JobQueue(led).mark_started(job_id, {**Assignment.from_allocation(alloc, plan).model_dump(mode="json")})
    lines: list[str] = []
    steps: list[int] = []
    out: dict = {}

    def go():
        out["result"] = run_allocated_training(job, job_id, plan, Assignment.from_allocation(alloc, plan),
                                               ledger_url=led.url, log=lines.append,
                                               on_step=lambda s, t, loss: steps.append(s), **kw)
    t = threading.Thread(target=go)
    t.start()
    return t, out, steps, lines


def test_shrink_request_stops_relaunches_and_resumes_exactly(tmp_path, frenzy_home):
    led, q, job, one, two = _setup(tmp_path, "resize")
    # the reference: the same job, uninterrupted, on 2 ranks
    q.enqueue("ref", "ref", job.model_dump(mode="json"), [two, one], steps=job.steps)
    t, out, _, _ = _train(led, job.model_copy(update={"name": "ref"}), "ref", two, {"cpu-0": [0, 1]})
    t.join(300)
    ref = out["result"]
    assert ref.status == "completed" and len(ref.losses) == job.steps

    q.enqueue("j", "j", job.model_dump(mode="json"), [two, one], steps=job.steps)
    ladders: list = []              # the out-of-memory ladder follows the plan the run trains on
    t, out, steps, lines = _train(led, job.model_copy(update={"name": "j"}), "j", two, {"cpu-0": [0, 1]},
                                  fallbacks_for=lambda p: (ladders.append(p), iter(()))[1])
    end = time.time() + 240
    while len(steps) < 3 and time.time() < end:
        time.sleep(0.05)
    rid = q.request("j", "shrink", plan=one, placement={"cpu-0": [1]}, reason="test")
    assert rid
    t.join(300)
    res = out["result"]
    assert res.status == "completed", lines[-20:]
    assert res.final_plan.gpus == 1 and res.final_plan.global_batch == two.global_batch
    assert [a.plan.gpus for a in res.attempts] == [2, 1]
    assert [a.number for a in res.attempts] == [1, 2]          # the relaunch goes on counting
    assert res.attempts[1].resumed_from_step > 0
    assert len(res.losses) == job.steps
    assert res.losses == pytest.approx(ref.losses, rel=1e-4, abs=1e-5)
    assert [p.gpus for p in ladders] == [2, 1]
    row = q.get("j")
    assert (row.resizes, row.request_state, row.allocation["placement"]) == (1, "done", {"cpu-0": [1]})
    assert not [a for a in led.allocations() if a.status == "active"]


def test_a_move_to_another_pool_is_handed_to_the_submitter_and_resumes_there_exactly(tmp_path, frenzy_home):
    """A re-size whose target is another pool's GPUs (a stopgap moving up to its faster type)
    must not relaunch in this process, which would train on its own devices under that pool's
    name: the run stops with a checkpoint, its result is "stopped" with the target as
    ``handoff`` (held, not released), and a launch there (what the submit flow does) resumes it
    with the same losses as an uninterrupted run."""
    from frenzy_flows.lifetime import allocation_lifetime
    from frenzy_flows.results import Assignment
    from frenzy_flows.training import run_allocated_training

    led, q, job, one, two = _setup(tmp_path, "handoff", cluster_yaml=TWO_POOLS)
    q.enqueue("ref", "ref", job.model_dump(mode="json"), [two], steps=job.steps)
    t, out, _, _ = _train(led, job.model_copy(update={"name": "ref"}), "ref", two, {"cpu-0": [0, 1]})
    t.join(300)
    ref = out["result"]
    assert ref.status == "completed" and len(ref.losses) == job.steps

    q.enqueue("h", "h", job.model_dump(mode="json"), [two], steps=job.steps)
    handed: set[str] = set()
    with allocation_lifetime(led.url, "h", keep=handed):      # as the train flow wraps it
        t, out, steps, lines = _train(led, job.model_copy(update={"name": "h"}), "h", two, {"cpu-0": [0, 1]})
        end = time.time() + 240
        while len(steps) < 3 and time.time() < end:
            time.sleep(0.05)
        assert q.request("h", "move", plan=two, placement={"cpu-b-0": [0, 1]}, reason="stopgap moves up")
        t.join(300)
        if out["result"].handoff:
            handed.add(out["result"].handoff["allocation_id"])
    first = out["result"]
    assert first.status == "stopped" and first.handoff is not None, lines[-20:]
    there = Assignment.model_validate(first.handoff)
    assert (there.pool, there.placement) == ("cpu-b", {"cpu-b-0": [0, 1]})
    active = [a for a in led.allocations() if a.status == "active"]
    assert [str(a.id) for a in active] == [there.allocation_id]       # the target held, the old one freed
    assert any("handing it to its submitter" in line for line in lines)
    row = q.get("h")
    assert row.state == "running" and row.allocation["pool"] == "cpu-b"
    done = len(first.losses)
    assert 3 <= done < job.steps

    lines2: list[str] = []
    second = run_allocated_training(job.model_copy(update={"name": "h"}), "h", there.plan, there,
                                    ledger_url=led.url, log=lines2.append)
    assert second.status == "completed" and second.handoff is None, lines2[-20:]
    assert second.attempts[0].resumed_from_step == done
    assert first.losses + second.losses == pytest.approx(ref.losses, rel=1e-4, abs=1e-5)
    assert not [a for a in led.allocations() if a.status == "active"]


def test_an_oom_fallback_placed_on_another_pool_is_handed_on_not_launched_here(tmp_path, frenzy_home, monkeypatch):
    """An out-of-memory fallback whose GPUs the ledger finds only on another pool (this node's
    other GPU is another job's) is not launched in this process: the run stops at its newest
    checkpoint with the fallback's allocation as ``handoff``, and a launch there goes on from
    that step (numbered as the run's next attempt: the rehearsed failure fires on the first)."""
    from frenzy_flows.results import Assignment
    from frenzy_flows.training import run_allocated_training

    led, q, job, one, two = _setup(tmp_path, "oomaway", steps=12, cluster_yaml=TWO_POOLS)
    job = job.model_copy(update={"checkpoint_every": 5})
    other = led.allocate("other", one, {"cpu-0": [1]})          # this node's second GPU is taken
    q.enqueue("o", "o", job.model_dump(mode="json"), [one, two], steps=job.steps)
    monkeypatch.setenv("FRENZY_INJECT_OOM_AT_STEP", "7")
    t, out, _, lines = _train(led, job, "o", one, {"cpu-0": [0]}, fallbacks=iter([two]))
    t.join(300)
    first = out["result"]
    assert first.status == "stopped" and first.handoff is not None, lines[-20:]
    there = Assignment.model_validate(first.handoff)
    assert (there.pool, there.placement, there.plan.gpus) == ("cpu-b", {"cpu-b-0": [0, 1]}, 2)
    assert first.stop.step == 5 and len(first.losses) == 5          # the OOM attempt's steps 6-7 go
    assert [a.outcome for a in first.attempts] == ["oom"] and first.final_plan == one   # what ran here
    active = {str(a.id) for a in led.allocations() if a.status == "active"}
    assert active == {str(other.id), there.allocation_id}              # the fallback's GPUs held
    assert q.get("o").allocation_id == there.allocation_id             # and the queue row names them

    # the next part, as the submit flow launches it (the rehearsal stays set: it fires on attempt 1 only)
    second = run_allocated_training(job, "o", there.plan, there, ledger_url=led.url, log=lines.append,
                                    first_attempt=1 + len(first.attempts))
    assert second.status == "completed", lines[-20:]
    assert second.attempts[0].resumed_from_step == 5 and second.attempts[0].number == 2
    assert len(first.losses + second.losses) == job.steps


def test_a_policy_shrink_decided_in_a_round_reaches_the_live_run(tmp_path, frenzy_home):
    """The whole chain: scheduler round -> request on the queue row -> the run's watcher -> the
    control file -> stop, relaunch on the target -> the scheduler sees the re-sized run."""
    from frenzy_flows.training import run_allocated_training, wait_for_allocation
    from frenzy_scheduler.service import SchedulerService
    from scheduler.types import Decision, Policy

    # long enough (about 10 s of steps) for two watcher beats and a round to pass mid-training
    led, q, job, one, two = _setup(tmp_path, "policy", steps=600)

    class ShrinkOnce(Policy):
        # round-based (a round every second while jobs run): nothing else would start a round
        # while the one job runs and no GPU is idle
        name, restarts_runs, round_s = "shrink-once", True, 1.0

        def __init__(self):
            self.shrunk = False

        def schedule(self, pending, state, now):
            out = [Decision(j.job_id, two, {"cpu-0": [0, 1]}) for j in pending if len(state.nodes[0].free) == 2]
            for r in state.running:
                if not self.shrunk and r.plan.gpus == 2 and r.request.steps_left < job.steps - 3:
                    self.shrunk = True
                    out += [Decision(r.job_id, None, {}, action="preempt", reason="shrink"),
                            Decision(r.job_id, one, {"cpu-0": [1]}, reason="shrink")]
            return out

    svc = SchedulerService(led, ShrinkOnce(), ttl_s=10.0, poll_s=0.2)
    t = threading.Thread(target=svc.run, kwargs={"max_s": 240}, daemon=True)
    t.start()
    try:
        q.enqueue("p", "p", job.model_dump(mode="json"), [two, one], steps=job.steps)
        got = wait_for_allocation(q, "p", timeout_s=60, log=lambda s: None)
        assert got.plan.gpus == 2
        lines: list[str] = []
        res = run_allocated_training(job, "p", got.plan, got, ledger_url=led.url, log=lines.append)
    finally:
        svc.stop()
        t.join(10)
    assert res.status == "completed", lines[-20:]
    assert [a.plan.gpus for a in res.attempts] == [2, 1] and len(res.losses) == job.steps
    assert any("scheduler asks to shrink" in line for line in lines)
    row = q.get("p")
    assert (row.resizes, row.request_state, row.allocation["placement"]) == (1, "done", {"cpu-0": [1]})
    assert svc.source.counts["resized"] == 1


def test_a_resize_waiting_for_its_target_keeps_the_job_alive(monkeypatch):
    """A gang's watcher has stopped when it waits for its re-size target, and that wait
    (RESIZE_TAKE_S, 60 s) is as long as the queue's alive window: the job was reaped as failed
    while it waited. The wait beats the job's row now, every WAIT_BEAT_S."""
    from ledger.core import LedgerConflict

    from frenzy_flows import training

    clock = {"t": 0.0}
    monkeypatch.setattr(training.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(training.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + s))

    class Taken:
        def allocate(self, *a):
            raise LedgerConflict("device 0 of a100-0 is held")

    beats, said = [], []
    got = training._take(Taken(), "j", None, {"a100-0": [0]}, said.append, beat=lambda: beats.append(clock["t"]))
    assert got is None and "back to the queue" in said[-1]
    gaps = [b - a for a, b in zip([0.0] + beats, beats)]
    assert len(beats) >= training.RESIZE_TAKE_S / training.WAIT_BEAT_S - 1
    assert max(gaps) <= training.WAIT_BEAT_S + training.WAIT_POLL_S
