"""The submit flow under the session Prefect server: the four stages really run, the ledger
ends clean, the result carries what `frenzy run --json` promises."""
from __future__ import annotations

import pytest

from estimator.errors import DoesNotFitError, FrenzyInputError

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]

TINY = {"name": "flow-tiny", "model": "gpt2-tiny", "seq_len": 64, "global_batch": 8,
        "train_steps": 10, "precision": "fp32", "lr": 0.003, "checkpoint_every": 5}


@pytest.fixture
def cpu_cluster(tmp_path):
    path = tmp_path / "cpu.yaml"
    path.write_text("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")
    return str(path)


@pytest.fixture
def registered(cpu_cluster):
    from deployments.pools import sync_pools
    from scheduler.cluster import load_cluster

    sync_pools(load_cluster(cpu_cluster))
    return cpu_cluster


def test_submit_trains_and_releases(registered, frenzy_home):
    from frenzy_flows import submit_training
    from ledger import Ledger
    from ledger.tables import JobRow

    result = submit_training(job=TINY, cluster=registered)
    assert result.status == "completed"
    assert result.plan.gpu_type == "CPU"
    assert result.plan.global_batch == TINY["global_batch"]
    assert len(result.losses) == TINY["train_steps"]
    assert sum(result.losses[-2:]) < sum(result.losses[:2])
    assert result.estimate["device_used_gib"] == pytest.approx(result.plan.device_used_gib, abs=1e-3)
    assert set(result.estimate["breakdown_gib"]) >= {"weights", "gradients", "optimizer", "activations", "other"}
    assert "CPU" in result.plans and result.initial_plan in result.plans["CPU"]
    # the ledger: nothing left allocated, the measurement stored next to the prediction
    ledger = Ledger()
    state = ledger.cluster_state()
    assert state.running == []
    assert all(len(n.free) == n.gpus for n in state.nodes)
    rows = ledger.measurements(gpu_type="CPU")
    assert any(r.job_id == result.job_id for r in rows)
    with ledger._tx() as s:                                     # the job's row ended with it
        assert s.get(JobRow, result.job_id).status == "done"
    # the stages ran as Prefect tasks, in order
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[result.flow_run_id])))
    order = [t.name.rsplit("-", 1)[0] for t in sorted(runs, key=lambda t: t.expected_start_time)]
    stages = [n for n in order if n in ("estimate_memory", "select_resources", "assign", "train")]
    assert stages == ["estimate_memory", "select_resources", "assign", "train"], order


def test_unregistered_pool_is_reported(cpu_cluster, tmp_path, frenzy_home):
    from frenzy_flows import submit_training

    other = tmp_path / "other.yaml"
    other.write_text("pools:\n  - {name: nowhere-cpu, gpu: CPU, nodes: 1, gpus_per_node: 1}\n")
    with pytest.raises(FrenzyInputError, match="no registered GPU pool"):
        submit_training(job=TINY, cluster=str(other))


def test_job_that_fits_nowhere_names_closest_plan(registered, frenzy_home):
    from frenzy_flows import submit_training

    big = dict(TINY, model="llama-2-70b", seq_len=4096, global_batch=8)
    with pytest.raises(DoesNotFitError, match="closest plan"):
        submit_training(job=big, cluster=registered)


def test_injected_oom_falls_back_and_resumes(registered, frenzy_home, monkeypatch):
    from frenzy_flows import submit_training
    from ledger import Ledger

    monkeypatch.setenv("FRENZY_INJECT_OOM_AT_STEP", "7")
    result = submit_training(job=dict(TINY, name="flow-oom"), cluster=registered)
    assert result.status == "completed"
    outcomes = [a["outcome"] for a in result.attempts]
    assert outcomes[0] == "oom" and outcomes[-1] == "ok"
    second = result.attempts[1]
    assert second["resumed_from_step"] == 5          # the newest checkpoint before the OOM
    assert second["plan"] != result.attempts[0]["plan"]
    assert result.plan.global_batch == TINY["global_batch"]
    assert len(result.losses) == TINY["train_steps"]
    assert Ledger().cluster_state().running == []


def test_settings_block_supplies_the_ledger(registered, frenzy_home, tmp_path):
    from blocks import FrenzySettings
    from frenzy_flows import submit_training
    from ledger import Ledger

    url = f"sqlite:///{tmp_path}/site-ledger.db"
    FrenzySettings(ledger_url=url).save("site-ledger", overwrite=True)
    result = submit_training(job=dict(TINY, name="flow-site", train_steps=3), cluster=registered,
                             settings="site-ledger")
    assert result.status == "completed"
    assert any(r.job_id == result.job_id for r in Ledger(url).measurements())
    assert not any(r.job_id == result.job_id for r in Ledger().measurements())


def test_settings_block_supplies_default_precision_and_optimizer(registered, frenzy_home):
    from blocks import FrenzySettings
    from frenzy_flows import submit_training

    FrenzySettings(default_precision="fp32", default_optimizer="sgd").save("site-defaults", overwrite=True)
    job = {k: v for k, v in TINY.items() if k != "precision"}
    result = submit_training(job=dict(job, name="flow-defaults", train_steps=2), cluster=registered,
                             settings="site-defaults")
    assert result.status == "completed"
    assert (result.plan.precision, result.plan.optimizer) == ("fp32", "sgd")


def test_settings_fallback_order_can_forbid_fallbacks(registered, frenzy_home, monkeypatch):
    from blocks import FrenzySettings
    from frenzy_flows import submit_training
    from ledger import Ledger

    FrenzySettings(fallback_order=[]).save("no-fallbacks", overwrite=True)
    monkeypatch.setenv("FRENZY_INJECT_OOM_AT_STEP", "2")
    with pytest.raises(RuntimeError, match="out of memory"):
        submit_training(job=dict(TINY, name="flow-nofb"), cluster=registered, settings="no-fallbacks")
    assert Ledger().cluster_state().running == []          # the failed run released its GPUs


def test_a_run_moved_to_another_pool_is_launched_there_and_completes(tmp_path, frenzy_home, monkeypatch):
    """The scheduler moves a running job to another pool's GPUs (as a stopgap moving up to its
    faster type): the run's train flow stops with a checkpoint and hands the target back; the
    submit flow launches it on that pool (here the control machine's second CPU pool, trained
    in-process) and the job completes there, resumed from the checkpoint, every step once."""
    from deployments.pools import sync_pools
    from frenzy_flows import submit_training
    from ledger import Ledger
    from scheduler import policies
    from scheduler.cluster import load_cluster
    from scheduler.types import Decision, Policy

    path = tmp_path / "two.yaml"
    path.write_text("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n"
                    "  - {name: cpu-b, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")
    sync_pools(load_cluster(str(path)))
    steps = 400           # a few seconds of steps: a round sees the run mid-training

    class MoveOnce(Policy):
        # round-based, a round a second: nothing else starts one while the run holds its GPUs
        name, restarts_runs, round_s = "move-once", True, 1.0

        def __init__(self):
            self.moved = False

        def schedule(self, pending, state, now):
            free = {n.node_id: n.free for n in state.nodes}
            # a plain data-parallel plan: no DeepSpeed to import in each of the two launches
            out = [Decision(j.job_id, next(p for p in j.plans if p.gpus == 2 and p.zero == 0), {"cpu-0": [0, 1]})
                   for j in pending if len(free["cpu-0"]) == 2]
            for r in state.running:
                if not self.moved and r.request.steps_left < steps - 3:
                    self.moved = True
                    out += [Decision(r.job_id, None, {}, action="preempt", reason="stopgap"),
                            Decision(r.job_id, r.plan, {"cpu-b-0": [0, 1]}, reason="stopgap")]
            return out

    monkeypatch.setitem(policies.POLICIES, "move-once", MoveOnce)
    result = submit_training(job=dict(TINY, name="flow-moved", train_steps=steps, checkpoint_every=1000),
                             cluster=str(path), policy="move-once")
    assert result.status == "completed"
    assert result.allocation.pool == "cpu-b" and result.allocation.placement == {"cpu-b-0": [0, 1]}
    assert len(result.losses) == steps
    assert len(result.attempts) == 2 and 3 < result.attempts[1]["resumed_from_step"] < steps
    assert [a["number"] for a in result.attempts] == [1, 2]
    # handed on, not relaunched in place: a second `frenzy-train` run trained the rest
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["frenzy-train"])))
    parts = [r for r in runs if (r.parameters or {}).get("job_id") == result.job_id]
    assert len(parts) == 2
    ledger = Ledger()
    assert not [a for a in ledger.allocations() if a.status == "active"]


def test_a_part_the_scheduler_cancelled_still_counts_in_the_result(registered, frenzy_home, monkeypatch):
    """The scheduler cancels a run that stopped answering and queues the job again: the next
    part resumes from the checkpoint, and the cancelled part's steps and launches stay in the
    submission's result (they were dropped: the next part's attempts were numbered from 1 again)."""
    from estimator.plan import Plan
    from frenzy_flows import flow as submit_flow
    from frenzy_flows import submit_training
    from ledger import Ledger
    from ledger.queue import JobQueue
    from trainer.runner import Attempt, Measured, TrainResult

    calls = []

    def fake_train(job, job_id, plan, assignment, *args, first_attempt=1, **kw):
        calls.append(first_attempt)
        part = len(calls)
        done = 4 if part == 1 else job.steps
        start = 0 if part == 1 else 3                      # the second resumes from step 3's checkpoint
        res = TrainResult(status="failed" if part == 1 else "completed", losses=[10.0 - s for s in range(start, done)],
                          attempts=[Attempt(plan=plan, outcome="failed" if part == 1 else "ok",
                                            resumed_from_step=start, number=first_attempt)],
                          measured=Measured(), checkpoint_dir=None, final_plan=Plan.model_validate(plan.model_dump()),
                          error="cancelled" if part == 1 else None)
        if part == 1:               # what JobQueue.cancel_run leaves: the row pending, its run cancelled
            JobQueue(Ledger()).requeue(job_id, steps_done=3, preempted=True, reason="no answer in time",
                                       allocation_id=assignment.allocation_id)
        return {**res.model_dump(mode="json"), "assignment": assignment.model_dump(mode="json")}

    monkeypatch.setattr(submit_flow, "train", fake_train)
    seen = iter([True, False])
    monkeypatch.setattr(submit_flow, "requeued_by_scheduler", lambda *a: next(seen))
    result = submit_training(job=dict(TINY, name="flow-cancelled", train_steps=6), cluster=registered)
    assert result.status == "completed"
    assert calls == [1, 2]                                  # the next part goes on counting launches
    assert [a["number"] for a in result.attempts] == [1, 2]
    assert result.losses == [10.0, 9.0, 8.0, 7.0, 6.0, 5.0]   # steps 1-3 of the first part, 4-6 of the second
