"""Where a placed job trains: on its pool's workers, in this process only when the pool is the
control machine's own, and a pool without a worker is waited for (the queue says so) and then
refused with the command that starts one, never trained here and reported as its GPU type.
A plan for a GPU type that finds no GPU in the training program fails; it never runs on the CPU."""
from __future__ import annotations

import contextlib

import pytest

from estimator.job import TrainingJob
from estimator.plan import Plan
from scheduler.cluster import parse_cluster
from scheduler.discover import cpu_cluster, is_control_machine_pool

CLUSTER = parse_cluster("pools:\n"
                        "  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n"
                        "  - {name: h100, gpu: H100-80GB, nodes: 1, gpus_per_node: 2}\n"
                        "  - {name: far-cpu, gpu: CPU, nodes: 1, gpus_per_node: 2, addresses: [10.0.0.7]}\n"
                        "  - {name: cpus, gpu: CPU, nodes: 2, gpus_per_node: 2}\n")


def test_control_machine_pool_is_one_this_machine_really_has():
    here_cpu = cpu_cluster(2)
    assert is_control_machine_pool(CLUSTER, "cpu", here=here_cpu)
    assert not is_control_machine_pool(CLUSTER, "h100", here=here_cpu)      # the case
    assert not is_control_machine_pool(CLUSTER, "far-cpu", here=here_cpu)   # another machine's CPUs
    assert not is_control_machine_pool(CLUSTER, "cpus", here=here_cpu)      # two nodes: one is elsewhere
    here_h100 = parse_cluster("pools:\n  - {name: local-h100-80gb, gpu: H100-80GB, nodes: 1, gpus_per_node: 4}\n")
    assert is_control_machine_pool(CLUSTER, "h100", here=here_h100)
    here_one = parse_cluster("pools:\n  - {name: local-h100-80gb, gpu: H100-80GB, nodes: 1, gpus_per_node: 1}\n")
    assert not is_control_machine_pool(CLUSTER, "h100", here=here_one)      # fewer devices than the pool


@pytest.fixture
def placed(frenzy_home):
    """A job queued and placed on the h100 pool of a SQLite ledger, as the scheduler leaves it."""
    from frenzy_flows.results import Assignment
    from ledger import Ledger
    from ledger.queue import JobQueue

    ledger = Ledger()
    ledger.sync_cluster(CLUSTER)
    job = TrainingJob(name="route", model="gpt2-tiny", seq_len=16, global_batch=2, train_steps=1)
    plan = Plan(gpu_type="H100-80GB", gpus=1, dp=1, micro_batch=2, step_time_s=1.0)
    queue = JobQueue(ledger)
    queue.enqueue("route-1", job.name, job.model_dump(mode="json"), [plan], steps=1)
    alloc = ledger.allocate_best_fit("route-1", plan)
    assignment = Assignment.from_allocation(alloc, plan)
    assert queue.mark_started("route-1", assignment.model_dump(mode="json"))
    return job, plan, assignment, ledger, queue


def _route(monkeypatch, online, *, own_pool: bool):
    """The submit flow's train task with the Prefect calls replaced by recorders."""
    from frenzy_flows import dispatch, flow

    calls: list[str] = []
    monkeypatch.setattr(dispatch, "workers_online", online)
    monkeypatch.setattr(dispatch, "hold_gpu_slots", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(dispatch, "dispatch_to_pool", lambda *a, **k: calls.append("dispatched") or {"status": "completed"})
    monkeypatch.setattr(flow, "train_on_pool", lambda *a, **k: calls.append("in-process") or {"status": "completed"})
    monkeypatch.setattr(dispatch, "NO_WORKER_REPORT_EVERY_S", 0.0)
    return calls


def test_pool_without_worker_waits_says_so_then_fails_with_the_command(placed, monkeypatch, caplog):
    from frenzy_flows import dispatch, flow

    job, plan, assignment, ledger, queue = placed
    seen: list[str] = []

    def online(pool):
        seen.append(queue.get("route-1").wait_reason)
        return 0

    calls = _route(monkeypatch, online, own_pool=False)
    with pytest.raises(dispatch.NoWorkerError) as err:
        flow.train.fn(job, "route-1", plan, assignment, None, {"H100-80GB": 2}, None,
                      own_pool=False, worker_wait_s=0.6)
    assert calls == []                               # neither trained here nor dispatched
    msg = str(err.value)
    assert "\n" not in msg and "no worker of pool h100" in msg
    assert "`prefect worker start --pool h100`" in msg
    hint = "waiting for a worker of pool h100: start one with `prefect worker start --pool h100`"
    assert hint in seen                              # the queue said what it waited for
    assert hint in caplog.text                       # and so did the log
    assert queue.get("route-1").wait_reason == ""    # cleared once the wait ended
    assert ledger.lease_valid(assignment.allocation_id)   # held (and renewed) through the wait


def test_worker_that_comes_online_gets_the_run(placed, monkeypatch):
    from frenzy_flows import flow

    job, plan, assignment, _, _ = placed
    answers = iter([0, 0, 1])
    calls = _route(monkeypatch, lambda pool: next(answers, 1), own_pool=False)
    monkeypatch.setattr("frenzy_flows.dispatch.time.sleep", lambda s: None)
    out = flow.train.fn(job, "route-1", plan, assignment, None, {}, None, own_pool=False, worker_wait_s=60)
    assert out == {"status": "completed"} and calls == ["dispatched"]


def test_control_machine_pool_without_worker_trains_here(placed, monkeypatch):
    from frenzy_flows import flow

    job, plan, assignment, _, _ = placed
    calls = _route(monkeypatch, lambda pool: 0, own_pool=True)
    flow.train.fn(job, "route-1", plan, assignment, None, {}, None, own_pool=True, worker_wait_s=60)
    assert calls == ["in-process"]


def test_pool_with_a_worker_is_dispatched_even_when_it_is_the_control_machines(placed, monkeypatch):
    from frenzy_flows import flow

    job, plan, assignment, _, _ = placed
    calls = _route(monkeypatch, lambda pool: 1, own_pool=True)
    flow.train.fn(job, "route-1", plan, assignment, None, {}, None, own_pool=True)
    assert calls == ["dispatched"]


def test_gpu_plan_without_a_gpu_is_refused_by_the_training_program():
    from trainer.problems import InputProblem
    from trainer.train import check_device

    with pytest.raises(InputProblem, match=r"plan is for H100-80GB .*device=cpu"):
        check_device({"gpu_type": "H100-80GB"}, "cpu")
    check_device({"gpu_type": "H100-80GB"}, "cuda")
    check_device({"gpu_type": "CPU"}, "cpu")


@pytest.mark.slow
def test_gpu_plan_launched_on_a_machine_without_gpu_fails_not_ok(tmp_path):
    """The issue's `attempt 1: ok on H100-80GB` with `device=cpu` in the log: now a failure."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the plan would rightly run on it")
    from trainer.runner import run_training

    job = TrainingJob(model="gpt2-tiny", seq_len=16, global_batch=2, train_steps=2, precision="fp32")
    plan = Plan(gpu_type="H100-80GB", gpus=1, dp=1, micro_batch=2, precision="fp32")
    lines: list[str] = []
    res = run_training(job, plan, run_dir=tmp_path / "run", acquire=lambda p: ["0"], release=lambda: None,
                       log=lines.append, backoff_s=0.1, grace_s=5)
    assert res.status == "failed" and res.losses == []
    assert [a.outcome for a in res.attempts] == ["failed"]        # not retried: the same machine again
    assert "device=cpu" in res.error and "H100-80GB" in res.error
