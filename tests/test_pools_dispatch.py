"""Dispatch to a GPU pool: a real process worker picks the run up with the devices as job
variables; a pool without workers times out with a visible reason and the run is cancelled.
The pool's GPU slots are held by the training itself, for each allocation it trains on: a
preempted run waiting in the queue holds none.

The module is also the entrypoint of the stand-in training flow (`fake_train`) that the worker
runs, so keep its top-level imports light."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from prefect import flow

ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINT = "tests/test_pools_dispatch.py:fake_train"


@flow(name="frenzy-train-standin")   # no persist_result: the dispatcher asks for it
def fake_train(job: dict, plan: dict, assignment: dict | None = None, job_id: str | None = None) -> dict:
    """Reports what the pool's worker handed it, and the GPU slots busy while it runs."""
    from prefect import get_client

    pool = (assignment or {}).get("pool")
    with get_client(sync_client=True) as client:
        gcl = client.read_global_concurrency_limit_by_name(f"gpu:{pool}")
    return {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpu_type": os.environ.get("FRENZY_GPU_TYPE"),
            "num_processes": os.environ.get("FRENZY_NUM_PROCESSES"), "extra": os.environ.get("FRENZY_TEST_EXTRA"),
            "job_id": job_id, "job_name": job["name"], "plan_gpus": plan["gpus"],
            "allocation_id": (assignment or {}).get("allocation_id"), "slots_held": gcl.active_slots}


def _plan_and_job():
    from estimator.job import TrainingJob
    from estimator.plan import Plan

    job = TrainingJob(name="dispatch-test", model="gpt2-tiny", seq_len=16, global_batch=4, train_steps=2)
    return job, Plan(gpu_type="CPU", gpus=2, dp=2, micro_batch=2, grad_accum=1)


def _cluster(pool: str) -> dict:
    """One CPU pool of two devices, as a cluster file would hold it."""
    return {"pools": [{"name": pool, "gpu": "CPU", "nodes": 1, "gpus_per_node": 2}]}


def _sync(pool: str):
    from deployments.pools import sync_pools

    return sync_pools(_cluster(pool), entrypoint=ENTRYPOINT, control_pool=False, log=lambda *_: None)


def _slots(pool: str) -> int:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_global_concurrency_limit_by_name(f"gpu:{pool}").active_slots


def _runs(pool: str):
    from prefect import get_client
    from prefect.client.schemas.filters import WorkPoolFilter, WorkPoolFilterName

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[pool])))


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_dispatch_without_workers_times_out_visibly_cancels_the_run_and_frees_slots(caplog):
    from frenzy_flows import dispatch

    pool = f"nw-{uuid.uuid4().hex[:6]}"
    _sync(pool)
    assert dispatch.has_workers(pool) is False and dispatch.workers_online("no-such-pool") == 0
    job, plan = _plan_and_job()
    caplog.set_level("INFO", logger="frenzy.dispatch")
    with pytest.raises(dispatch.DispatchError, match="did not finish within 3"):
        dispatch.dispatch_to_pool(job, plan, {"pool": pool, "devices": ["0", "1"], "allocation_id": "x"},
                                  timeout_s=3, poll_s=0.3)
    assert f"pool '{pool}' has no workers online" in caplog.text
    from scheduler.cluster import cluster_from_dict
    cl = cluster_from_dict(_cluster(pool))
    assert dispatch.pool_notes(cl) == {"CPU": f"{pool}: no workers online"}
    assert f"prefect worker start --pool {pool}" in caplog.text
    runs = _runs(pool)
    assert len(runs) == 1 and runs[0].state.is_cancelled()
    assert runs[0].job_variables["gpu_ids"] == "0,1" and runs[0].job_variables["num_processes"] == 2
    assert _slots(pool) == 0


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_dispatch_to_an_unsynced_pool_names_the_fix():
    from estimator.errors import FrenzyInputError
    from frenzy_flows import dispatch

    job, plan = _plan_and_job()
    with pytest.raises(FrenzyInputError, match="frenzy pools sync"):
        dispatch.dispatch_to_pool(job, plan, {"pool": "never-synced", "devices": ["0"]}, timeout_s=5)


def test_job_variables_carry_devices_type_count_and_env(monkeypatch):
    from frenzy_flows.dispatch import job_variables

    job, plan = _plan_and_job()
    monkeypatch.delenv("FRENZY_HOME", raising=False)
    monkeypatch.delenv("FRENZY_SHARED_RUNS", raising=False)
    v = job_variables(plan, {"pool": "cpu", "devices": [0, 1]}, env={"A": "1"})
    assert v == {"gpu_type": "CPU", "num_processes": 2, "gpu_ids": "0,1",
                 "env": {"A": "1", "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true"}}
    monkeypatch.setenv("FRENZY_HOME", "rel/home")
    v = job_variables(plan, {"pool": "cpu"})     # no devices: the plan's GPU count, worker's own ids
    assert "gpu_ids" not in v and v["num_processes"] == 2
    assert v["env"]["FRENZY_HOME"] == os.path.abspath("rel/home")
    # every pool run (a gang's node, a one-node run) finds run folders on the shared storage
    monkeypatch.setenv("FRENZY_SHARED_RUNS", "/mnt/runs")
    assert job_variables(plan, {"pool": "cpu"})["env"]["FRENZY_SHARED_RUNS"] == "/mnt/runs"


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_dispatch_runs_on_a_real_worker_with_devices_and_leaves_the_slots_to_the_run():
    from prefect.settings import PREFECT_API_URL

    from frenzy_flows import dispatch

    pool = f"wk-{uuid.uuid4().hex[:6]}"
    _sync(pool)
    job, plan = _plan_and_job()
    out: dict = {}

    def run():
        try:
            out["result"] = dispatch.dispatch_to_pool(
                job, plan, {"pool": pool, "devices": ["1", "0"], "allocation_id": "alloc-9"},
                timeout_s=120, job_id="job-9", poll_s=0.5, env={"FRENZY_TEST_EXTRA": "yes"})
        except BaseException as err:  # surfaced by the assertion below
            out["error"] = err

    t = threading.Thread(target=run, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not _runs(pool) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _runs(pool), "dispatcher created no flow run"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_WORKER_QUERY_SECONDS": "1"}
    worker = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool,
                               "--run-once", "--type", "process"], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        t.join(120)
        assert not t.is_alive(), "dispatch did not return"
        from scheduler.cluster import cluster_from_dict
        cl = cluster_from_dict(_cluster(pool))
        assert dispatch.pool_notes(cl) == {"CPU": f"{pool}: 1 worker online"}
    finally:
        if worker.poll() is None:
            worker.kill()
        log = worker.communicate(timeout=30)[0]
    assert "error" not in out, f"{out.get('error')!r}\n{log[-3000:]}"
    r = out["result"]
    assert r["cuda"] == "1,0" and r["gpu_type"] == "CPU" and r["num_processes"] == "2"
    assert r["extra"] == "yes" and r["job_id"] == "job-9" and r["job_name"] == "dispatch-test"
    assert r["allocation_id"] == "alloc-9" and r["plan_gpus"] == 2
    assert r["slots_held"] == 0            # the dispatcher holds none: the train flow takes them
    assert _slots(pool) == 0


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_dispatch_refuses_a_pool_whose_gpu_limit_is_gone():
    from prefect import get_client

    from estimator.errors import FrenzyInputError
    from frenzy_flows import dispatch

    pool = f"ng-{uuid.uuid4().hex[:6]}"
    _sync(pool)
    with get_client(sync_client=True) as client:
        client.delete_global_concurrency_limit_by_name(f"gpu:{pool}")
    job, plan = _plan_and_job()
    with pytest.raises(FrenzyInputError, match=f"no concurrency limit 'gpu:{pool}'"):
        dispatch.dispatch_to_pool(job, plan, {"pool": pool, "devices": ["0"]}, timeout_s=5)
    assert _runs(pool) == []               # nothing was started


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_the_slot_wait_gives_up_clearly_when_the_slots_stay_busy():
    from prefect.concurrency.sync import concurrency

    from frenzy_flows import dispatch

    pool = f"bz-{uuid.uuid4().hex[:6]}"
    _sync(pool)
    with concurrency(f"gpu:{pool}", occupy=2, strict=True):      # another job holds both GPUs
        t0 = time.monotonic()
        with pytest.raises(dispatch.DispatchError, match=f"1 GPU slot\\(s\\) of gpu:{pool} did not free up"):
            with dispatch.hold_gpu_slots(pool, 1, timeout_s=2):
                pytest.fail("the block ran without its slot")
        assert 1.5 < time.monotonic() - t0 < 30
    assert _slots(pool) == 0


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_hold_gpu_slots_counts_in_prefect_and_frees_on_errors_of_the_block():
    from frenzy_flows import dispatch

    pool = f"hs-{uuid.uuid4().hex[:6]}"
    _sync(pool)
    with dispatch.hold_gpu_slots(pool, 2):
        assert _slots(pool) == 2
    assert _slots(pool) == 0
    with pytest.raises(TimeoutError, match="inside"):   # the block's own error, untranslated
        with dispatch.hold_gpu_slots(pool, 1):
            raise TimeoutError("inside the block")
    assert _slots(pool) == 0


def _leak(pool: str, n: int) -> None:
    """Mark ``n`` slots busy with no holder and no lease: what an embedded server killed with
    its holder leaves in its database."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    with get_client(sync_client=True) as client:
        client.update_global_concurrency_limit(f"gpu:{pool}", GlobalConcurrencyLimitUpdate(active_slots=n))


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_leaked_slots_are_reconciled_with_the_ledger_and_the_wait_says_so(frenzy_home, caplog):
    import logging

    from frenzy_flows import dispatch

    pool = f"lk-{uuid.uuid4().hex[:6]}"
    _sync(pool)
    _leak(pool, 2)                      # both slots "busy", the ledger holds nothing on the pool
    t0 = time.monotonic()
    with caplog.at_level(logging.INFO, logger="frenzy.dispatch"):
        with dispatch.hold_gpu_slots(pool, 1):
            took = time.monotonic() - t0
            assert _slots(pool) == 1
    assert _slots(pool) == 0
    assert dispatch.SLOT_RECONCILE_AFTER_S - 1 < took < dispatch.SLOT_RECONCILE_AFTER_S + 15
    text = caplog.text
    assert "freed 2 leaked slot(s)" in text and f"for 1 GPU slot(s) of gpu:{pool}" in text


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_reconcile_keeps_slots_the_ledger_holds(frenzy_home):
    from estimator.plan import Plan
    from ledger import Ledger
    from scheduler.cluster import cluster_from_dict

    from frenzy_flows import dispatch

    pool = f"rk-{uuid.uuid4().hex[:6]}"
    _sync(pool)
    ledger = Ledger()
    ledger.sync_cluster(cluster_from_dict(_cluster(pool)))
    alloc = ledger.allocate_best_fit("job-a", Plan(gpu_type="CPU", gpus=1, dp=1, micro_batch=2, grad_accum=1))
    assert alloc is not None and alloc.pool == pool
    _leak(pool, 2)
    assert dispatch.reconcile_gpu_slots(ledger, [pool]) == {pool: 1}
    assert _slots(pool) == 1            # the ledger's allocation keeps its slot
    ledger.release(alloc.id)
    assert dispatch.reconcile_gpu_slots(ledger, [pool]) == {pool: 1}
    assert _slots(pool) == 0
    assert dispatch.reconcile_gpu_slots(ledger, [pool, "no-such-pool"]) == {}
    # a waiter whose grant is on the ledger holds no slot for it yet: a slot leaked by a run
    # killed with its embedded server is freed for it (the grant kept it counted, and the
    # waiter timed out waiting for itself)
    mine = ledger.allocate_best_fit("job-b", Plan(gpu_type="CPU", gpus=2, dp=2, micro_batch=1, grad_accum=1))
    assert mine is not None and len(mine.devices) == 2
    _leak(pool, 1)
    assert dispatch.reconcile_gpu_slots(ledger, [pool]) == {}             # counted as the grant's
    assert dispatch.reconcile_gpu_slots(ledger, [pool], {pool: 2}) == {pool: 1}
    assert _slots(pool) == 0


def test_slot_waits_are_bounded_apart_from_the_job_deadline():
    from frenzy_flows import dispatch

    # a dead holder's lease runs out within the wait, and reconciling starts well before the end
    assert dispatch.SLOT_WAIT_S > dispatch.SLOT_LEASE_S > dispatch.SLOT_RECONCILE_AFTER_S > 0


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_a_runs_slots_follow_its_allocations_and_a_preempted_run_waiting_holds_none(tmp_path, frenzy_home):
    """A real (tiny) training holds 2 slots on its 2-GPU allocation; preempted, it waits in the
    queue holding none (the GPUs are someone else's to take, on the ledger and in Prefect);
    placed again on 1 GPU it holds 1; ended, 0."""
    from estimator.job import TrainingJob
    from estimator.plans import plans_for_job
    from ledger import Ledger
    from ledger.queue import JobQueue
    from scheduler.cluster import cluster_from_dict
    from trainer.fallback import realisable

    from frenzy_flows import dispatch
    from frenzy_flows.results import Assignment
    from frenzy_flows.training import run_allocated_training

    pool = f"fs-{uuid.uuid4().hex[:6]}"
    _sync(pool)
    cluster = cluster_from_dict(_cluster(pool))
    led = Ledger(f"sqlite:///{tmp_path / 'slots.db'}")
    led.sync_cluster(cluster)
    q = JobQueue(led)
    # about 5 ms a step here: 1,500 steps outlast the watcher's 1 s poll of the request many times over
    job = TrainingJob(name="slots", model="gpt2-tiny", seq_len=32, global_batch=4, train_steps=1500,
                      precision="fp32", checkpoint_every=1000)
    plans = [p for p in plans_for_job(job, cluster.inventory(), gpus_per_node=cluster.gpus_per_node(),
                                      gpus=cluster.gpu_catalog())["CPU"] if realisable(p)]
    two = next(p for p in plans if p.gpus == 2 and p.zero == 0 and p.act_ckpt == "none")
    one = next(p for p in plans if p.gpus == 1 and p.zero == 0 and p.act_ckpt == "none")
    node = next(cluster.nodes())[0]
    q.enqueue("s", "slots", job.model_dump(mode="json"), [two, one], steps=job.steps)
    alloc = led.allocate("s", two, {node: [0, 1]})
    first = Assignment.from_allocation(alloc, two)
    assert q.mark_started("s", first.model_dump(mode="json"))
    steps: list[int] = []
    seen: dict[str, int] = {}
    lines: list[str] = []
    out: dict = {}

    def on_step(step: int, total: int, loss: float) -> None:
        steps.append(step)

    def go():
        try:
            out["result"] = run_allocated_training(job, "s", two, first, ledger_url=led.url, log=lines.append,
                                                   on_step=on_step, wait_timeout_s=120,
                                                   slots=lambda p, n: dispatch.hold_gpu_slots(p, n, ledger_url=led.url))
        except BaseException as err:        # surfaced by the assertions below
            out["error"] = err

    t = threading.Thread(target=go, daemon=True)
    t.start()
    end = time.monotonic() + 180
    while len(steps) < 3 and time.monotonic() < end and t.is_alive():
        time.sleep(0.05)
    seen["training on 2"] = _slots(pool)
    assert q.request("s", "preempt", reason="test")
    while (q.get("s").state != "pending") and time.monotonic() < end and t.is_alive():
        time.sleep(0.1)
    assert q.get("s").state == "pending", (out, lines[-10:])
    seen["preempted, waiting"] = _slots(pool)
    again = led.allocate("s", one, {node: [1]})
    assert q.mark_started("s", Assignment.from_allocation(again, one).model_dump(mode="json"))
    n_before = len(steps)
    while len(steps) <= n_before + 2 and time.monotonic() < end and t.is_alive():
        time.sleep(0.05)
    seen["training on 1"] = _slots(pool)
    t.join(180)
    assert not t.is_alive() and "error" not in out, (out.get("error"), lines[-10:])
    seen["ended"] = _slots(pool)
    res = out["result"]
    assert res.status == "completed" and [a.plan.gpus for a in res.attempts] == [2, 1], lines[-10:]
    assert seen == {"training on 2": 2, "preempted, waiting": 0, "training on 1": 1, "ended": 0}


def test_the_dispatcher_beats_the_jobs_row_until_a_worker_starts_the_run(monkeypatch):
    """Between its placement and its run's own heartbeat the job's queue row was beaten by
    nobody: a worker slower than the alive window (60 s) to start the run got the running job
    reaped as failed. The dispatcher beats it while the run waits, and stops once it runs (a
    run that died Running must not be kept alive by its dispatcher)."""
    import types

    import prefect

    from frenzy_flows import dispatch

    states = iter(["SCHEDULED", "PENDING", "PENDING", "RUNNING", "RUNNING", "COMPLETED"])

    def state(name):
        return types.SimpleNamespace(name=name, is_final=lambda: name == "COMPLETED",
                                     is_scheduled=lambda: name == "SCHEDULED", is_pending=lambda: name == "PENDING")

    class Client:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def read_flow_run(self, _id):
            return types.SimpleNamespace(name="run", state=state(next(states)))

    clock = {"t": 0.0}
    monkeypatch.setattr(prefect, "get_client", lambda sync_client=True: Client())
    monkeypatch.setattr(dispatch, "workers_online", lambda pool: 1)
    monkeypatch.setattr(dispatch.time, "monotonic", lambda: clock["t"])
    monkeypatch.setattr(dispatch.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + dispatch.DISPATCH_BEAT_S))
    beats = []
    final = dispatch._wait("id", "pool", deadline=1e9, poll_s=dispatch.DISPATCH_BEAT_S,
                           beat=lambda: beats.append(clock["t"]))
    assert final.state.name == "COMPLETED"
    assert beats == [0.0, 10.0, 20.0]          # scheduled, pending, pending; none once it runs


def test_the_submitter_outwaits_the_runs_own_deadline_stop(monkeypatch):
    """The run keeps the job's deadline (a clean stop with a checkpoint and an export, its clock
    started once it runs); the submitter's clock starts at dispatch, and cancelling at the same
    deadline killed the ranks before the run could stop them."""
    from estimator.job import TrainingJob
    from estimator.plan import Plan

    from frenzy_flows import dispatch, flow
    from frenzy_flows.results import Assignment

    assert dispatch.dispatch_timeout(None) is None
    assert dispatch.DEADLINE_GRACE_S >= 2 * dispatch.SLOT_WAIT_S      # a start that waits for its slots too
    # what the submit flow's train step gives the dispatcher
    job = TrainingJob(model="gpt2-tiny", seq_len=16, global_batch=2, train_steps=2, deadline_s=3600.0)
    plan = Plan(gpu_type="CPU", gpus=1, dp=1, micro_batch=2, grad_accum=1)
    assignment = Assignment(allocation_id="a", plan=plan, pool="p", gpu_type="CPU", placement={"n": [0]})
    asked = {}
    monkeypatch.setattr(dispatch, "has_workers", lambda pool: True)
    monkeypatch.setattr(dispatch, "dispatch_to_pool", lambda *a, **kw: asked.update(kw) or {})
    flow.train.fn(job, "j", plan, assignment, None, {"CPU": 1})
    assert asked["timeout_s"] == 3600.0 + dispatch.DEADLINE_GRACE_S


def test_a_train_run_started_by_hand_takes_gpus_of_its_own_pool(tmp_path, monkeypatch):
    """`frenzy-train-<pool>` run from the UI without an assignment took free GPUs of the plan's
    type anywhere: another pool's, whose device numbers its worker then used."""
    from estimator.plan import Plan
    from ledger import Ledger
    from scheduler.cluster import parse_cluster

    from frenzy_flows.train_flow import _own_pool, hand_run_assignment

    led = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    led.sync_cluster(parse_cluster("pools:\n  - {name: aa, gpu: CPU, nodes: 1, gpus_per_node: 2}\n"
                                   "  - {name: bb, gpu: CPU, nodes: 1, gpus_per_node: 2}\n"))
    one = Plan(gpu_type="CPU", gpus=1, dp=1, micro_batch=1, grad_accum=1)
    monkeypatch.setenv("PREFECT__RUNTIME__DEPLOYMENT__NAME", "frenzy-train-bb")
    assert _own_pool() == "bb"
    # best fit alone would take pool aa's (listed first); three runs fill bb and then refuse
    assert [hand_run_assignment(led, f"j{i}", one).pool for i in range(2)] == ["bb", "bb"]
    with pytest.raises(RuntimeError, match="in pool 'bb'"):
        hand_run_assignment(led, "j2", one)
    monkeypatch.delenv("PREFECT__RUNTIME__DEPLOYMENT__NAME")
    assert _own_pool() is None


def test_the_dispatchers_beat_renews_the_allocations_lease_too(tmp_path):
    """Between the grant (or a handed-on run's hand-over) and the run's first launch nobody
    renewed the allocation's lease: a worker slow to start the run could see it run out. The
    dispatcher's beat renews it beside the queue row."""
    from ledger import Ledger
    from ledger.queue import JobQueue
    from scheduler.cluster import cluster_from_dict

    from frenzy_flows import dispatch

    led = Ledger(f"sqlite:///{tmp_path / 'beat.db'}")
    led.sync_cluster(cluster_from_dict(_cluster("beat")))
    job, plan = _plan_and_job()
    JobQueue(led).enqueue("b", "b", job.model_dump(mode="json"), [plan], steps=job.steps)
    alloc = led.allocate("b", plan, {"beat-0": [0, 1]}, lease_s=5.0)
    before = led.allocation(str(alloc.id)).lease_expires_at
    dispatch.queue_beat("b", led.url, str(alloc.id))()
    after = led.allocation(str(alloc.id)).lease_expires_at
    assert after - before > 200            # renewed by the default lease (300 s), not the 5 s granted
    dispatch.queue_beat("b", led.url)()    # without an allocation: the row only, the lease untouched
    assert led.allocation(str(alloc.id)).lease_expires_at == after
