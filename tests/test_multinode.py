"""Multi-node training on one machine: two runners (and, with Prefect, two process workers on
two work queues of one pool) stand for two nodes of one CPU pool (``nodes: 2, gpus_per_node:
1``). Their launch is ``accelerate launch --num_machines 2 --machine_rank r`` with the address
and port node 0 published in the ledger; the losses must match a one-node run of the same
ranks. Plus the rendezvous record and the gang's failure logic, without processes."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from estimator.plan import Plan
from tests.test_parallel_plans import MATCH, job, plan, weights  # noqa: F401  (weights: a fixture)


# ------------------------------------------------------------------------------- pure pieces
def test_launch_files_of_a_node_name_the_machines_and_deepspeeds_standard_launcher(weights, tmp_path):
    from trainer.launch_config import accelerate_config, accelerate_file, write_launch_files

    p = plan(2, zero=2)
    acc = accelerate_config(p, num_machines=2, machine_rank=1, main_address="10.0.0.7", main_port=29511, cpu=True)
    assert (acc["num_machines"], acc["machine_rank"], acc["num_processes"]) == (2, 1, 2)
    assert (acc["main_process_ip"], acc["main_process_port"]) == ("10.0.0.7", 29511)
    assert acc["deepspeed_config"]["deepspeed_multinode_launcher"] == "standard"
    assert "deepspeed_multinode_launcher" not in accelerate_config(p, cpu=True)["deepspeed_config"]
    # two nodes share one run folder: each has its own Accelerate file
    paths = [write_launch_files(tmp_path, p, job(weights), num_machines=2, machine_rank=r,
                                main_address="10.0.0.7", main_port=29511) for r in (0, 1)]
    assert [x.accelerate.name for x in paths] == [accelerate_file(2, 0), accelerate_file(2, 1)]
    assert accelerate_file() == "accelerate.yaml"
    import yaml
    assert [yaml.safe_load(x.accelerate.read_text())["machine_rank"] for x in paths] == [0, 1]


def test_node_env_dials_node_0_and_keeps_loopback_only_for_a_loopback_node_0():
    from trainer.launcher import launch_env

    far = launch_env(["0"], cpu=True, base={}, main_address="10.0.0.7")
    assert far["MASTER_ADDR"] == "10.0.0.7" and far["FRENZY_C10D_BIND"] == "10.0.0.7"
    assert "GLOO_SOCKET_IFNAME" not in far
    near = launch_env(["0"], cpu=True, base={}, main_address="127.0.0.1")
    assert near["GLOO_SOCKET_IFNAME"] == "lo"
    assert launch_env(["0", "1"], cpu=True, base={})["MASTER_ADDR"] == "127.0.0.1"


def test_rendezvous_waits_for_node_0_and_is_bounded(tmp_path):
    from ledger import Ledger
    from ledger.gang import Gang, RendezvousTimeout

    gang = Gang(Ledger(f"sqlite:///{tmp_path / 'l.db'}"))
    got = {}
    waiter = threading.Thread(target=lambda: got.update(ep=gang.wait_rendezvous("g1", 20, poll_s=0.05)))
    gang.join("g1", 1, "job-a", "p-1")
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()                   # nothing published yet: node 1 waits
    gang.join("g1", 0, "job-a", "p-0")
    gang.publish("g1", "10.0.0.7", 29511)
    waiter.join(10)
    assert got["ep"] == ("10.0.0.7", 29511)
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeout, match="did not publish its address within 0 s"):
        gang.wait_rendezvous("g2", 0.3, poll_s=0.05)
    assert time.monotonic() - t0 < 5
    gang.join("g3", 0, "job-a", "p-0")
    gang.finish("g3", 0, "failed", "OSError: no free port")
    with pytest.raises(RendezvousTimeout, match="failed before it published.*no free port"):
        gang.wait_rendezvous("g3", 30)          # at once, not after 30 s


def test_a_node_whose_heartbeat_runs_out_or_that_failed_is_lost(tmp_path, monkeypatch):
    from ledger import Ledger
    from ledger import gang as gang_mod

    gang = gang_mod.Gang(Ledger(f"sqlite:///{tmp_path / 'l.db'}"))
    for r in range(3):
        gang.join("g", r, "job-a", f"p-{r}")
    assert gang.lost("g", 3) == {}
    gang.finish("g", 2, "failed", "RuntimeError: gloo connection reset")
    assert set(gang.lost("g", 3)) == {2} and "gloo connection reset" in gang.lost("g", 3)[2]
    # the heartbeat's lifetime a site (or a test) may set: never under two beats
    assert gang_mod.node_alive_s(None) == gang_mod.node_alive_s("") == gang_mod.node_alive_s("x") == 30.0
    assert gang_mod.node_alive_s("10") == 10.0 and gang_mod.node_alive_s("nan") == 30.0
    assert gang_mod.node_alive_s("0") == 2 * gang_mod.NODE_BEAT_S
    monkeypatch.setattr(gang_mod, "NODE_ALIVE_S", -1.0)     # a beat that is already out of date
    gang.beat("g", 1)
    gang.finish("g", 0, "done")                             # done: never lost, beat or not
    lost = gang.lost("g", 3)
    assert set(lost) == {1, 2} and "stopped answering" in lost[1]


def test_a_node_out_of_memory_is_lost_and_its_launch_counts_up_to_the_checkpoint(tmp_path):
    """The dispatcher's view of a launch that ran out of memory: the node's row (``oom``, lost
    at once, node 0's stops the rendezvous) and what the launch adds to the result: the node's
    own record of the attempt, node 0's losses up to the checkpoint the relaunch resumes from."""
    import json

    from ledger import Ledger
    from ledger.gang import Gang, RendezvousTimeout

    from frenzy_flows.gang import _oom_segment
    from trainer.checkpoints import MARKER, checkpoint_path

    gang = Gang(Ledger(f"sqlite:///{tmp_path / 'l.db'}"))
    gang.join("g", 0, "job-a", "p-0")
    gang.join("g", 1, "job-a", "p-1")
    gang.finish("g", 1, "oom", "OutOfMemoryError: CUDA out of memory")
    assert gang.lost("g", 2) == {1: "node 1 (p-1) ran out of memory: OutOfMemoryError: CUDA out of memory"}
    gang.finish("g", 0, "oom", "OutOfMemoryError: CUDA out of memory")
    with pytest.raises(RendezvousTimeout, match="failed before it published.*out of memory"):
        gang.wait_rendezvous("g", 30)

    run, p = tmp_path / "run", plan(2)
    ck = checkpoint_path(run, 2)
    ck.mkdir(parents=True)
    (ck / MARKER).write_text("{}")
    (run / "attempt-3.log").write_text("".join(f'FRENZY_STEP {{"step": {s}, "loss": {5 - s / 10}}}\n' for s in (2, 3))
                                       + 'FRENZY_STEP {"step": 4, "lo')      # cut short by the kill
    mine = {"plan": p.model_dump(mode="json"), "outcome": "oom", "number": 3, "resumed_from_step": 1,
            "error": "OutOfMemoryError: at step 4", "devices": ["0"], "duration_s": 2.5}
    (run / "attempts-node1.json").write_text(json.dumps([mine]))
    seg = _oom_segment(run, p, 3, {1: "OutOfMemoryError: row", 0: "OutOfMemoryError: row 0"})
    assert (seg["status"], seg["losses"]) == ("failed", [4.8])     # step 2 only: step 3 is redone
    assert seg["attempts"][0] == {**mine, "plan": seg["attempts"][0]["plan"]} and seg["error"] == mine["error"]
    assert seg["checkpoint_dir"] == str(ck)
    # another launch's record is not this one's: what the dispatcher knows instead
    seg = _oom_segment(run, p, 4, {1: "OutOfMemoryError: row"})
    assert [(a["number"], a["outcome"], a["error"]) for a in seg["attempts"]] == [(4, "oom", "OutOfMemoryError: row")]
    assert seg["losses"] == []                             # launch 4 logged nothing


def _state(name: str):
    final = name in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
    return SimpleNamespace(name=name, message="boom" if name == "FAILED" else "", is_final=lambda: final,
                           is_completed=lambda: name == "COMPLETED")


def test_node_0s_beat_carries_the_gangs_progress(tmp_path):
    from ledger import Ledger
    from ledger.gang import Gang

    gang = Gang(Ledger(f"sqlite:///{tmp_path / 'l.db'}"))
    gang.join("g", 0, "job-a", "p-0")
    gang.join("g", 1, "job-a", "p-1")
    assert [n.step for n in gang.nodes("g")] == [0, 0]       # nothing done yet
    gang.beat("g", 0, step=7)
    gang.beat("g", 1)                                       # a node that reports no step keeps its own
    gang.beat("g", 0)                                       # nor does a beat without one reset node 0's
    nodes = gang.nodes("g")
    assert [n.step for n in nodes] == [7, 0]
    assert gang.lost("g", 2, nodes) == gang.lost("g", 2) == {}     # the rows the caller read serve


def test_the_dispatchers_poll_reports_node_0s_step_on_the_jobs_queue_row(tmp_path):
    """The path of a gang's progress to the scheduler: node 0's beat, the dispatcher's one read
    of the gang's rows, its queue heartbeat."""
    from ledger import Ledger
    from ledger.gang import Gang
    from ledger.queue import JobQueue

    from frenzy_flows.gang import poll_nodes
    from frenzy_flows.training import REQUEST_POLL_S, RequestWatcher

    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    gang, queue = Gang(ledger), JobQueue(ledger)
    queue.enqueue("job-a", "job-a", {"name": "job-a"}, [plan(2)], steps=60)
    gang.join("g", 0, "job-a", "p-0")
    gang.join("g", 1, "job-a", "p-1")
    gang.beat("g", 0, step=12)
    with RequestWatcher(queue, "job-a", tmp_path, lambda _m: None) as watcher:
        assert poll_nodes(gang, "g", 2, watcher) == {} and watcher.step == 12
        end = time.monotonic() + 10 * REQUEST_POLL_S
        while queue.get("job-a").steps_done != 12 and time.monotonic() < end:
            time.sleep(0.05)
    assert queue.get("job-a").steps_done == 12
    gang.finish("g", 1, "failed", "boom")
    watcher.step = 3                         # each read takes node 0's step from its row again
    assert 1 in poll_nodes(gang, "g", 2, watcher) and watcher.step == 12


def test_watch_gang_stops_at_the_first_failed_or_lost_node_and_completes_only_with_all():
    from frenzy_flows.gang import watch_gang

    far = time.monotonic() + 60
    seq = iter([["RUNNING", "RUNNING"], ["COMPLETED", "RUNNING"], ["COMPLETED", "COMPLETED"]])
    ok, why = watch_gang(lambda: [_state(s) for s in next(seq)], lambda: {}, deadline=far, poll_s=0,
                         sleep=lambda _s: None)
    assert (ok, why) == (True, "")
    ok, why = watch_gang(lambda: [_state("RUNNING"), _state("FAILED")], lambda: {}, deadline=far, poll_s=0)
    assert not ok and why.startswith("node 1's flow run ended FAILED") and "boom" in why
    beats = []
    ok, why = watch_gang(lambda: [_state("RUNNING"), _state("RUNNING")],
                         lambda: {1: "node 1 (p-1) stopped answering 31 s ago (its worker is gone)"} if beats else {},
                         deadline=far, poll_s=0, beat=lambda: beats.append(1), sleep=lambda _s: None)
    assert not ok and "its worker is gone" in why and beats == [1]
    ok, why = watch_gang(lambda: [_state("RUNNING")], lambda: {}, deadline=time.monotonic() - 1, poll_s=0)
    assert not ok and "deadline" in why


def test_gang_nodes_are_in_node_order():
    from frenzy_flows.gang import gang_nodes

    assert gang_nodes({"p-10": [0], "p-2": [0], "p-0": [1]}) == ["p-0", "p-2", "p-10"]


# ------------------------------------------------------------------------------- real launches
def train_as_nodes(j, p: Plan, run_dir: Path, ledger_url: str, nodes: int = 2):
    """``nodes`` runners in threads of this process, as the gang's node flow runs would run
    them: node 0 publishes its rendezvous in the ledger, the others wait for it."""
    from ledger import Ledger
    from ledger.gang import Gang

    from frenzy_flows.gang import node_endpoint
    from trainer.runner import NodeRole, run_training

    gang = Gang(Ledger(ledger_url))
    per = p.gpus // nodes
    results, logs = {}, {r: [] for r in range(nodes)}

    def one(r: int) -> None:
        gang.join("g-test", r, "job-mn", f"cpu2-{r}")
        role = NodeRole(machine_rank=r, num_machines=nodes, endpoint=node_endpoint(gang, "g-test", r, "127.0.0.1", 60))
        try:
            results[r] = run_training(j, p, run_dir=run_dir, acquire=lambda _q: [f"cpu{i}" for i in range(per)],
                                      release=lambda: None, log=logs[r].append, backoff_s=0.1, grace_s=5,
                                      max_transient_retries=0, fallbacks=iter(()), node=role)
        except BaseException as err:            # shown by the assertion below
            results[r] = err

    threads = [threading.Thread(target=one, args=(r,)) for r in range(nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    for r in range(nodes):
        res = results.get(r)
        assert getattr(res, "status", None) == "completed", f"node {r}: {res!r}\n" + "\n".join(logs[r][-40:])
    return results, logs


@pytest.fixture(scope="module")
def one_node(weights, tmp_path_factory):
    """The one-node run of the two ranks (job(weights) on plan(2)) that every two-node launch of
    the same job must reproduce: trained once for the module."""
    from tests.test_parallel_plans import train

    res, _ = train(job(weights), plan(2), tmp_path_factory.mktemp("one-node") / "run")
    return res


@pytest.mark.slow
def test_two_nodes_of_one_process_match_one_node_of_two(weights, one_node, tmp_path):
    from tests.test_parallel_plans import assert_matches

    results, logs = train_as_nodes(job(weights), plan(2), tmp_path / "two-nodes", f"sqlite:///{tmp_path / 'l.db'}")
    assert results[1].losses == []                           # only node 0's rank 0 reports
    assert_matches(results[0].losses, one_node.losses)
    assert any("as node 1 of 2 (rendezvous 127.0.0.1:" in line for line in logs[1])
    run = tmp_path / "two-nodes"
    assert (run / "accelerate-node0.yaml").is_file() and (run / "accelerate-node1.yaml").is_file()
    assert (run / "attempt-1.log").is_file() and (run / "attempt-1-node1.log").is_file()


@pytest.mark.slow
def test_a_two_node_checkpoint_resumes_on_one_node(weights, one_node, tmp_path):
    """Re-plan 2 nodes -> 1: two steps as two nodes of one process each, then the same job
    (same global batch) goes on on one node, under two processes and under one: its step 3
    equals step 3 of a one-node run of two processes (plain data-parallel states hold full
    tensors: the optimizer state comes along, a full resume)."""
    from tests.test_parallel_plans import _resume_under, assert_matches

    results, _ = train_as_nodes(job(weights, train_steps=2), plan(2), tmp_path / "two-nodes",
                                f"sqlite:///{tmp_path / 'l.db'}")
    assert_matches(results[0].losses, one_node.losses[:2])
    ck = Path(results[0].checkpoint_dir)
    for p, name in ((plan(2), "to-one-node"), (plan(1), "to-one-process")):
        moved, lines = _resume_under(ck, job(weights), p, tmp_path / name)
        assert any(line.startswith("FRENZY_RESUME") and '"mode": "full"' in line for line in lines), name
        assert len(moved.losses) == 1 and moved.final_plan.global_batch == 4
        assert_matches(moved.losses, one_node.losses[2:])


# ------------------------------------------------------------------------------- through Prefect
ROOT = Path(__file__).resolve().parent.parent


def _cluster(pool: str) -> dict:
    """One CPU pool of two nodes of one process each (both this machine: the workers say their
    address is loopback through FRENZY_NODE_ADDRESS, as the cluster file's addresses are distinct)."""
    return {"pools": [{"name": pool, "gpu": "CPU", "nodes": 2, "gpus_per_node": 1}]}


def _worker(pool: str, queue: str, **extra_env: str):
    import os
    import subprocess
    import sys

    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_WORKER_QUERY_SECONDS": "1",
           "PYTHONPATH": str(ROOT), "FRENZY_NODE_ADDRESS": "127.0.0.1", **extra_env}
    return subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool,
                             "--work-queue", queue, "--type", "process"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _vanish(proc) -> None:
    """The node goes away: its worker and everything it started, SIGKILLed."""
    import psutil

    tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
    for p in tree:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _stop(proc) -> str:
    if proc.poll() is None:
        _vanish(proc)
    return proc.communicate(timeout=30)[0][-4000:]


def _gang_setup(pool: str, tmp_path: Path, j, p: Plan):
    from deployments.pools import sync_pools
    from ledger import Ledger
    from scheduler.cluster import cluster_from_dict

    from frenzy_flows.results import Assignment

    report = sync_pools(_cluster(pool), control_pool=False, log=lambda *_: None)
    assert report.queues[pool] == [f"{pool}-0", f"{pool}-1"]
    ledger = Ledger()            # FRENZY_HOME's: the one the workers' flow runs open too
    ledger.sync_cluster(cluster_from_dict(_cluster(pool)))
    alloc = ledger.allocate(f"job-{pool}", p, {f"{pool}-0": [0], f"{pool}-1": [0]})
    return ledger, Assignment.from_allocation(alloc, p)


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_a_gang_of_two_workers_on_two_node_queues_matches_one_node(weights, one_node, tmp_path, monkeypatch):
    import uuid

    from frenzy_flows.gang import dispatch_gang
    from tests.test_parallel_plans import assert_matches

    monkeypatch.setenv("FRENZY_SHARED_RUNS", str(tmp_path / "shared"))
    pool = f"mn-{uuid.uuid4().hex[:6]}"
    j, p = job(weights), plan(2)
    ledger, assignment = _gang_setup(pool, tmp_path, j, p)
    workers = [_worker(pool, f"{pool}-{r}") for r in (0, 1)]
    try:
        out = dispatch_gang(j, p, assignment, job_id=f"job-{pool}", timeout_s=600, poll_s=0.5)
    finally:
        logs = [_stop(w) for w in workers]
    assert out["status"] == "completed", logs
    run = tmp_path / "shared" / f"job-{pool}"
    assert out["run_dir"] == str(run.resolve())
    assert (run / "attempt-1-node1.log").is_file()       # node 1 trained in the same shared folder
    # the gang's measurement beside its prediction, for calibration, as a one-node run records
    m = [m for m in ledger.measurements("CPU") if m.job_id == f"job-{pool}"]
    assert len(m) == 1 and m[0].alloc_id == assignment.allocation_id
    assert_matches(out["losses"], one_node.losses)


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_a_one_node_run_of_a_multi_node_pool_goes_to_its_nodes_queue_or_is_refused():
    """Any node's worker polls the pool's default queue and would train on its own devices of
    the placement's numbers: a one-node run goes to its node's queue, and a node without one
    (the cluster grew since the last sync) is refused naming the fix, never sent anywhere."""
    import uuid

    from deployments.pools import sync_pools
    from estimator.errors import FrenzyInputError

    from frenzy_flows.dispatch import node_work_queue

    pool = f"nq-{uuid.uuid4().hex[:6]}"
    sync_pools(_cluster(pool), control_pool=False, log=lambda *_: None)
    assert node_work_queue(pool, {f"{pool}-1": [0]}) == f"{pool}-1"
    assert node_work_queue(pool, {f"{pool}-0": [0], f"{pool}-1": [0]}) is None     # a gang: per node
    with pytest.raises(FrenzyInputError, match=f"no.*{pool}-5.*frenzy pools sync"):
        node_work_queue(pool, {f"{pool}-5": [0]})
    one = f"n1-{uuid.uuid4().hex[:6]}"
    sync_pools({"pools": [{"name": one, "gpu": "CPU", "nodes": 1, "gpus_per_node": 1}]}, control_pool=False,
               log=lambda *_: None)
    assert node_work_queue(one, {f"{one}-0": [0]}) is None                          # its default queue


def _dispatch_in_thread(j, p: Plan, assignment, job_id: str) -> tuple[threading.Thread, dict]:
    """``dispatch_gang`` in a thread, as the submit flow runs it; its result or error in the dict."""
    from frenzy_flows.gang import dispatch_gang

    out: dict = {}

    def go():
        try:
            out["result"] = dispatch_gang(j, p, assignment, job_id=job_id, timeout_s=900, poll_s=0.5)
        except BaseException as err:          # shown by the assertion that reads it
            out["error"] = err

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t, out


def _completed(t: threading.Thread, out: dict, workers: list) -> dict:
    """Wait for the dispatch thread, stop the workers, and return its result, which completed."""
    try:
        t.join(600)
    finally:
        logs = [_stop(w) for w in workers]
    assert not t.is_alive()
    assert "error" not in out, f"{out.get('error')!r}\n" + "\n".join(logs)
    assert out["result"]["status"] == "completed"
    return out["result"]


def _checkpoints(log: Path) -> list[int]:
    """The steps node 0 saved so far (its attempt log, which may end in a half-written line)."""
    import json

    out = []
    for line in log.read_text().splitlines() if log.is_file() else []:
        if line.startswith("FRENZY_CHECKPOINT "):
            try:
                out.append(int(json.loads(line.split(" ", 1)[1])["step"]))
            except ValueError:
                pass
    return out


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_a_node_whose_worker_vanishes_stops_the_gang_frees_its_gpus_and_it_resumes(weights, tmp_path, monkeypatch):
    import uuid

    from deployments.pools import gpu_limit_name
    from ledger import gang as gang_mod
    from prefect import get_client

    monkeypatch.setenv("FRENZY_SHARED_RUNS", str(tmp_path / "shared"))
    # the nodes' heartbeats live 10 s (3 beats) instead of 30 s: the vanished node is found
    # lost, and the gang stopped, 20 s sooner; the dispatcher here reads the same lifetime
    alive = {gang_mod.NODE_ALIVE_ENV: "10"}
    monkeypatch.setattr(gang_mod, "NODE_ALIVE_S", 10.0)
    pool = f"mv-{uuid.uuid4().hex[:6]}"
    # 30 steps: node 1 vanishes after the checkpoint of step 4, long before the last step
    j, p = job(weights, train_steps=30, seq_len=128, checkpoint_every=2), plan(2)
    ledger, assignment = _gang_setup(pool, tmp_path, j, p)
    first_alloc = assignment.allocation_id
    run = tmp_path / "shared" / f"job-{pool}"
    workers = [_worker(pool, f"{pool}-{r}", **alive) for r in (0, 1)]
    t, out = _dispatch_in_thread(j, p, assignment, f"job-{pool}")
    killed_at = None
    end = time.monotonic() + 400
    while time.monotonic() < end and killed_at is None and t.is_alive():
        steps = _checkpoints(run / "attempt-1.log")
        if steps and max(steps) >= 4:
            killed_at = max(steps)
            _vanish(workers[1])               # node 1's machine goes away mid-run
        time.sleep(0.1)
    assert killed_at is not None, "the run ended before node 1 could be killed: " + str(out)
    # the gang stopped and freed its GPUs: the first allocation is released
    end = time.monotonic() + 200
    while time.monotonic() < end and ledger.allocation(first_alloc).status == "active":
        time.sleep(0.5)
    assert ledger.allocation(first_alloc).status == "released"
    workers.append(_worker(pool, f"{pool}-1", **alive))      # node 1 comes back
    res = _completed(t, out, workers)
    assert res["attempts"][0]["resumed_from_step"] >= killed_at - 2 > 0      # from a checkpoint, not step 0
    assert len(res["losses"]) == j.train_steps - res["attempts"][0]["resumed_from_step"]
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(gpu_limit_name(pool)).active_slots == 0


def _steps(log: Path) -> int:
    """How many steps node 0 has logged so far."""
    return sum(line.startswith("FRENZY_STEP ") for line in log.read_text().splitlines()) if log.is_file() else 0


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_the_scheduler_shrinks_a_gang_onto_one_node_and_it_resumes_with_the_same_losses(weights, tmp_path, monkeypatch):
    """A shrink request for a 2-node run: every node stops after the same step with a
    checkpoint, the gang's GPUs go back, the job takes its target (node 0 only) and resumes
    there as one run sent to node 0's work queue, with the same global batch: the loss sequence
    is that of an uninterrupted run."""
    import uuid

    from ledger.queue import JobQueue

    from tests.test_parallel_plans import assert_matches, train

    monkeypatch.setenv("FRENZY_SHARED_RUNS", str(tmp_path / "shared"))
    pool = f"ms-{uuid.uuid4().hex[:6]}"
    job_id = f"job-{pool}"
    steps = 150        # the request lands within a second or two of step 3, well before the end
    j, p, target = job(weights, train_steps=steps, seq_len=128, checkpoint_every=1000), plan(2), plan(1)
    ledger, assignment = _gang_setup(pool, tmp_path, j, p)
    queue = JobQueue(ledger)
    queue.enqueue(job_id, job_id, {"name": job_id}, [p, target], steps=steps)
    assert queue.mark_started(job_id, assignment.model_dump(mode="json"))
    log0 = tmp_path / "shared" / job_id / "attempt-1.log"
    workers = [_worker(pool, f"{pool}-{r}") for r in (0, 1)]
    t, out = _dispatch_in_thread(j, p, assignment, job_id)
    rid = None
    end = time.monotonic() + 400
    while time.monotonic() < end and rid is None and t.is_alive():
        if _steps(log0) >= 3:
            rid = queue.request(job_id, "shrink", plan=target, placement={f"{pool}-0": [0]},
                                reason="a test shrink")
        time.sleep(0.1)
    assert rid is not None, "the run ended before the shrink request: " + str(out)
    res = _completed(t, out, workers)
    assert res["assignment"]["placement"] == {f"{pool}-0": [0]}        # where it ended, not where it began
    first, last = res["attempts"][0], res["attempts"][-1]
    assert (first["plan"]["gpus"], last["plan"]["gpus"]) == (2, 1)
    assert 0 < last["resumed_from_step"] < steps                       # from the stop's checkpoint
    assert res["final_plan"]["gpus"] == 1
    row = queue.get(job_id)
    assert row.request.get("id") == rid and row.allocation["placement"] == {f"{pool}-0": [0]}
    assert ledger.allocation(assignment.allocation_id).status == "released"
    reference, _ = train(j, target, tmp_path / "one-process")
    assert_matches(res["losses"], reference.losses)


@pytest.mark.slow
@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_a_gang_that_runs_out_of_memory_falls_back_and_resumes_with_the_same_losses(weights, one_node, tmp_path,
                                                                                    monkeypatch):
    """Every rank of both nodes runs out of memory at step 3 (the rehearsal fires on the first
    launch only): the gang stops, its allocation goes back, the ladder's next plan (same two
    GPUs, more activation checkpointing) is placed across both nodes again and the gang
    resumes from the step-2 checkpoint; the losses are those of an uninterrupted run."""
    import uuid

    from deployments.pools import gpu_limit_name
    from prefect import get_client

    from frenzy_flows.gang import dispatch_gang
    from frenzy_flows.lifetime import allocation_lifetime
    from tests.test_parallel_plans import assert_matches

    monkeypatch.setenv("FRENZY_SHARED_RUNS", str(tmp_path / "shared"))
    pool = f"mo-{uuid.uuid4().hex[:6]}"
    job_id = f"job-{pool}"
    j, p = job(weights), plan(2)              # 3 steps, a checkpoint every step: one_node's job
    ledger, assignment = _gang_setup(pool, tmp_path, j, p)
    workers = [_worker(pool, f"{pool}-{r}", FRENZY_INJECT_OOM_AT_STEP="3") for r in (0, 1)]
    try:
        with allocation_lifetime(None, job_id):        # as the submit flow ends every allocation of the job
            out = dispatch_gang(j, p, assignment, job_id=job_id, timeout_s=600, poll_s=0.5,
                                inventory={"CPU": 2})
            held = [a.id for a in ledger.allocations() if a.job_id == job_id]
    finally:
        logs = [_stop(w) for w in workers]
    assert out["status"] == "completed", logs
    oom, ok = out["attempts"]
    assert (oom["outcome"], oom["number"], oom["resumed_from_step"]) == ("oom", 1, 0)
    assert "OutOfMemoryError" in oom["error"] and "FRENZY_INJECT_OOM_AT_STEP=3" in oom["error"]
    assert (ok["outcome"], ok["number"], ok["resumed_from_step"]) == ("ok", 2, 2)
    fb = Plan.model_validate(ok["plan"])
    assert fb.act_ckpt != p.act_ckpt and (fb.gpus, fb.global_batch) == (2, p.global_batch)
    assert out["final_plan"]["act_ckpt"] == fb.act_ckpt
    # the fallback took GPUs of its own on both nodes, the first allocation went back at the OOM
    new = out["assignment"]
    assert new["allocation_id"] != assignment.allocation_id and sorted(new["placement"]) == [f"{pool}-0", f"{pool}-1"]
    assert ledger.allocation(assignment.allocation_id).status == "released"
    assert held == [new["allocation_id"]]
    assert [a for a in ledger.allocations() if a.job_id == job_id] == []
    run = tmp_path / "shared" / job_id
    assert (run / "attempt-2.log").is_file() and (run / "attempt-2-node1.log").is_file()   # launch 2's own logs
    assert_matches(out["losses"], one_node.losses)          # steps 1-2 of launch 1, step 3 of launch 2
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(gpu_limit_name(pool)).active_slots == 0


def test_nodes_writing_the_same_launch_file_at_once_never_rename_each_others_away(tmp_path):
    """The nodes of a gang write the same spec into one shared folder; two writers with one pid
    (threads of one process here, two hosts on shared storage in a real gang) once used the same
    temporary name, and one renamed the other's file away (FileNotFoundError)."""
    from estimator.home import write_atomic

    target, errors = tmp_path / "train_spec.json", []

    def writer(r: int) -> None:
        for i in range(300):
            try:
                write_atomic(target, f'{{"node": {r}, "i": {i}}}')
            except OSError as err:
                errors.append(err)

    threads = [threading.Thread(target=writer, args=(r,)) for r in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and json.loads(target.read_text())["i"] == 299
    assert [p.name for p in tmp_path.iterdir()] == ["train_spec.json"]     # no temporary left


@pytest.mark.slow
def test_a_node_launcher_waiting_for_its_rendezvous_stops_when_its_runner_is_gone(weights, tmp_path):
    """Node 1 of 2 launched while node 0 never comes (its runner failed at once): the launcher
    waits in torch's rendezvous, with no ranks yet; when the process that started it dies hard,
    the launcher stops too instead of waiting out the rendezvous timeout (15 min seen)."""
    import socket
    import subprocess

    import psutil

    from trainer.launch_config import write_launch_files
    from trainer.launcher import launch_env
    from trainer.runner import launch_command

    with socket.socket() as s:            # a port nobody listens on: node 0 never comes
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    paths = write_launch_files(tmp_path, plan(2), job(weights), num_machines=2, machine_rank=1,
                               main_address="127.0.0.1", main_port=port, cpu=True)
    runner = subprocess.Popen(["sleep", "600"])             # stands for the node's runner
    env = launch_env(["cpu0"], cpu=True, main_address="127.0.0.1")
    env["FRENZY_PARENT_PID"] = str(runner.pid)
    launcher = subprocess.Popen(launch_command(paths), env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        time.sleep(8)                                       # in its rendezvous by now
        assert launcher.poll() is None, launcher.stdout.read()[-3000:]
        runner.kill()
        runner.wait()
        out, _ = launcher.communicate(timeout=30)
        assert "is gone; stopping this launcher" in out, out[-3000:]
    finally:
        for p in (launcher, runner):
            if p.poll() is None:
                for c in psutil.Process(p.pid).children(recursive=True) + [psutil.Process(p.pid)]:
                    c.kill()
                p.wait()
