"""A run that does not answer the scheduler's request in time is cancelled through Prefect
(a real flow run on the test server goes to Cancelling), its GPUs are freed in the ledger and its
job is queued again, to resume from its last checkpoint on its next allocation."""
from __future__ import annotations

import time

import pytest

from ledger.queue import JobQueue
from tests.test_live_scheduler import ledger_with_cluster, plans, service

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_server")]


def test_a_run_that_never_acknowledges_is_cancelled_through_prefect(tmp_path, monkeypatch):
    import ledger.queue as lq
    from prefect import flow, get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Running

    @flow(name="frenzy-test-stuck-run")
    def stuck_run():              # never runs: it stands for a training whose watcher is gone
        pass

    led = ledger_with_cluster(f"sqlite:///{tmp_path / 'ledger.db'}")
    q = JobQueue(led)
    q.enqueue("j", "j", {"name": "j"}, plans(), steps=10)
    svc = service(led, reap_s=0.01)          # the real canceller (frenzy_flows.cancel); reap every step
    svc.step()
    first = q.get("j").allocation_id
    with get_client(sync_client=True) as client:
        fr = client.create_flow_run(stuck_run, state=Running())
    q.attach_run("j", str(fr.id))
    rid = q.request("j", "preempt", reason="a test preemption")
    monkeypatch.setattr(lq, "REQUEST_ACK_S", 0.0)
    time.sleep(0.05)
    svc.step()                               # reaps (overdue: cancel, free, requeue), then a round
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(fr.id).state
    assert state.type == StateType.CANCELLING and "did not acknowledge the preempt request" in state.message
    assert led.allocation(first).status == "released"
    assert svc.source.counts["cancelled"] == 1
    job = q.get("j")
    assert job.request.get("id") == rid and job.request_state == "cancelled"
    assert (job.restarts, job.preemptions) == (1, 1)
    # the same round placed the requeued job again (the reap runs before the snapshot)
    assert job.state == "running" and job.allocation_id not in (None, first)


def test_cancel_flow_run_stops_a_running_run_through_its_worker_and_cancels_one_not_started():
    """Running -> Cancelling (its worker kills the process; Cancelled would leave it running),
    Scheduled -> Cancelled (no worker picks it up later), final -> left alone."""
    from prefect import flow, get_client
    from prefect.client.schemas.objects import StateType
    from prefect.states import Completed, Running, Scheduled

    from frenzy_flows.cancel import cancel_flow_run

    @flow(name="frenzy-test-cancel-target")
    def target():
        pass

    with get_client(sync_client=True) as client:
        runs = {s.type: client.create_flow_run(target, state=s) for s in (Running(), Scheduled(), Completed())}
    assert cancel_flow_run(runs[StateType.RUNNING].id, "stop: running") is True
    assert cancel_flow_run(str(runs[StateType.SCHEDULED].id), "stop: not started") is True
    assert cancel_flow_run(runs[StateType.COMPLETED].id, "stop: done") is False
    with get_client(sync_client=True) as client:
        after = {t: client.read_flow_run(fr.id).state for t, fr in runs.items()}
    assert after[StateType.RUNNING].type == StateType.CANCELLING and after[StateType.RUNNING].message == "stop: running"
    assert after[StateType.SCHEDULED].type == StateType.CANCELLED
    assert after[StateType.COMPLETED].type == StateType.COMPLETED
    # a run stuck in Cancelling (its worker vanished with it) is marked Cancelled
    assert cancel_flow_run(runs[StateType.RUNNING].id, "stop: gone") is True
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(runs[StateType.RUNNING].id).state.type == StateType.CANCELLED
