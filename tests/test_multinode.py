"""Multi-node training on one machine: two runners (and, with Prefect, two process workers on
two work queues of one pool) stand for two nodes of one CPU pool (``nodes: 2, gpus_per_node:
1``). Their launch is ``accelerate launch --num_machines 2 --machine_rank r`` with the address
and port node 0 published in the ledger; the losses must match a one-node run of the same
ranks. Plus the rendezvous record and the gang's failure logic, without processes."""
from __future__ import annotations

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
    monkeypatch.setattr(gang_mod, "NODE_ALIVE_S", -1.0)     # a beat that is already out of date
    gang.beat("g", 1)
    gang.finish("g", 0, "done")                             # done: never lost, beat or not
    lost = gang.lost("g", 3)
    assert set(lost) == {1, 2} and "stopped answering" in lost[1]


def _state(name: str):
    final = name in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")
    return SimpleNamespace(name=name, message="boom" if name == "FAILED" else "", is_final=lambda: final,
                           is_completed=lambda: name == "COMPLETED")


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


@pytest.mark.slow
def test_two_nodes_of_one_process_match_one_node_of_two(weights, tmp_path):
    from tests.test_parallel_plans import assert_matches, train

    one_node, _ = train(job(weights), plan(2), tmp_path / "one-node")
    results, logs = train_as_nodes(job(weights), plan(2), tmp_path / "two-nodes", f"sqlite:///{tmp_path / 'l.db'}")
    assert results[1].losses == []                           # only node 0's rank 0 reports
    assert_matches(results[0].losses, one_node.losses)
    assert any("as node 1 of 2 (rendezvous 127.0.0.1:" in line for line in logs[1])
    run = tmp_path / "two-nodes"
    assert (run / "accelerate-node0.yaml").is_file() and (run / "accelerate-node1.yaml").is_file()
    assert (run / "attempt-1.log").is_file() and (run / "attempt-1-node1.log").is_file()
