"""The live scheduler over the ledger: queue order, leadership between two processes, re-size
requests (SQLite, and PostgreSQL when FRENZY_TEST_POSTGRES_URL is set)."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from estimator.plan import Plan
from ledger import Ledger
from ledger.queue import JobQueue, Leadership, LeadershipLost, LeaseFence
from scheduler.cluster import parse_cluster
from scheduler.loop import RoundLoop, Snapshot
from scheduler.round import RoundResult
from scheduler.types import ClusterState, JobRequest, Node

from tests.test_ledger_basic import drop_schema, pg_schema_url

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = parse_cluster("pools:\n  - {name: a100, gpu: A100-80GB, nodes: 1, gpus_per_node: 2}\n")


def plans(step_s: float = 1.0) -> list[Plan]:
    return [Plan(gpu_type="A100-80GB", gpus=g, dp=g, micro_batch=8 // g, device_used_gib=10.0,
                 step_time_s=step_s / g) for g in (2, 1)]


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    base = os.environ.get("FRENZY_TEST_POSTGRES_URL")
    if not base:
        pytest.skip("FRENZY_TEST_POSTGRES_URL is not set: PostgreSQL tests need a server")
    u, schema = pg_schema_url(base)
    yield u
    drop_schema(base, schema)


def ledger_with_cluster(url: str) -> Ledger:
    led = Ledger(url)
    led.sync_cluster(CLUSTER)
    return led


def service(led, policy="frenzy", **kw):
    from frenzy_scheduler.service import SchedulerService
    return SchedulerService(led, policy, ttl_s=kw.pop("ttl_s", 5.0), **kw)


def test_queue_runs_jobs_in_submission_order_and_says_why_they_wait(url):
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    for name in ("first", "second", "third"):
        q.enqueue(name, name, {"name": name}, plans(), steps=100)
        time.sleep(0.01)                       # distinct submission times on the database clock
    svc = service(led)
    svc.step()
    rows = {j.job_id: j for j in q.jobs()}
    assert rows["first"].state == "running" and rows["first"].allocation["placement"] == {"a100-0": [0, 1]}
    assert rows["second"].state == rows["third"].state == "pending"
    assert rows["second"].wait_reason and rows["second"].wait_gpu_type == "A100-80GB"
    assert rows["second"].predicted_start_s < rows["third"].predicted_start_s
    # the first run ends: its GPUs free, the second (not the third) starts
    led.release(rows["first"].allocation_id)
    q.finish("first", "done")
    svc.step()
    rows = {j.job_id: j for j in q.jobs(("pending", "running", "done"))}
    assert rows["second"].state == "running" and rows["third"].state == "pending"
    assert sum(1 for a in led.allocations() if a.status == "active") == 1


def test_queue_tells_how_ended_jobs_ended(url):
    """`frenzy queue --all` said "running" of every ended job, and a run stopped at step 331 of
    3,000 (Ctrl-C, with a checkpoint) was "done"."""
    from frenzy_scheduler.source import queue_table
    from ledger.queue import ENDED

    led = ledger_with_cluster(url)
    q = JobQueue(led)
    for name in ("ok", "bad", "halt"):
        led.submit_job(name, name, {"name": name})
        q.enqueue(name, name, {"name": name}, plans(), steps=100)
    q.finish("ok", "done", steps_done=100)
    q.finish("bad", "failed", error="RuntimeError: out of memory")
    q.finish("halt", "stopped", error="stopped at step 31: interrupted (SIGINT)", steps_done=31)
    rows = {r["job"]: r for r in queue_table(q.jobs(ENDED, plans=False), time.time())}
    assert {j: r["state"] for j, r in rows.items()} == {"ok": "done", "bad": "failed", "halt": "stopped"}
    assert rows["ok"]["why"] == "trained to its last step"
    assert rows["bad"]["why"] == "RuntimeError: out of memory"
    assert rows["halt"]["why"].startswith("stopped at step 31") and rows["halt"]["steps"] == "31/100"
    with pytest.raises(ValueError):
        q.finish("ok", "paused")
    from sqlmodel import select

    from ledger.tables import JobRow
    with led._tx() as s:                       # the jobs table's rows end with their queue rows
        assert {r.job_id: r.status for r in s.exec(select(JobRow)).all()} == {
            "ok": "done", "bad": "failed", "halt": "stopped"}


def test_the_runs_watcher_outlives_a_database_error_and_still_acknowledges(url, tmp_path, monkeypatch):
    """One failed acknowledgement (a failover, a lock timeout) ended the watcher thread: the
    heartbeats stopped (the job was reaped as failed while stopping), the request was never
    acknowledged (the run was cancelled as overdue) and the lease fence was gone."""
    from sqlalchemy.exc import OperationalError

    from frenzy_flows import training

    monkeypatch.setattr(training, "REQUEST_POLL_S", 0.05)
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("j", "j", {"name": "j"}, plans(), steps=10)
    service(led).step()
    rid = q.request("j", "shrink", plan=plans()[1], placement={"a100-0": [0]})
    assert rid and q.get("j").request_state == "pending"
    real_ack, failures, said = q.ack_request, [], []

    def flaky_ack(job_id, request_id):
        if not failures:
            failures.append(request_id)
            raise OperationalError("UPDATE queue_jobs", {}, Exception("database is locked"))
        return real_ack(job_id, request_id)

    monkeypatch.setattr(q, "ack_request", flaky_ack)
    with training.RequestWatcher(q, "j", tmp_path, said.append) as watcher:
        end = time.monotonic() + 10
        while q.get("j").request_state != "acked" and time.monotonic() < end:
            time.sleep(0.05)
        assert watcher._thread.is_alive()
        watcher.step = 7
        while q.get("j").steps_done != 7 and time.monotonic() < end:
            time.sleep(0.05)
    assert failures == [rid] and q.get("j").request_state == "acked" and q.get("j").steps_done == 7
    assert any("database is locked" in m for m in said)
    from trainer import control
    stop = control.read_request(tmp_path)          # forwarded to the run once, as a stop at a step
    assert stop is not None and stop["request_id"] == rid and stop["action"] == "stop"


def test_a_run_that_answers_at_the_deadline_is_not_cancelled(url):
    """The overdue list is read, then the run answers: the scheduler cancelled its flow run
    through Prefect before the ledger's atomic check said the run had answered, and killed it."""
    from frenzy_scheduler.source import LedgerSource

    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("j", "j", {"name": "j"}, plans(), steps=10)
    service(led).step()
    q.attach_run("j", "flow-run-1")
    rid = q.request("j", "preempt", reason="a test preemption")
    seen_overdue = q.get("j")                          # what reap() read as overdue
    assert q.ack_request("j", rid)
    led.release(seen_overdue.allocation_id)
    q.requeue("j", steps_done=4, preempted=True, reason="preempted")      # the run answered
    cancelled = []
    src = LedgerSource(led, cancel=lambda run, why: cancelled.append(run) or True)
    src._cancel_overdue(seen_overdue)
    assert cancelled == [] and src.counts["cancelled"] == 0
    assert q.get("j").state == "pending" and q.get("j").request_state == "done"


def test_a_restarted_runs_answer_counts_after_an_earlier_run_was_cancelled(url):
    """A cancelled run marks the row "cancelled" so its late answers are ignored; that mark
    outlived the job's restart, and the new run's own requeue (a gang that lost a node) was
    ignored too: the row stayed running on a released allocation."""
    from frenzy_scheduler.source import assignment_json

    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("j", "j", {"name": "j"}, plans(), steps=10)
    svc = service(led)
    svc.step()
    first = q.get("j").allocation_id
    rid = q.request("j", "preempt", reason="a test preemption")
    assert q.cancel_run("j", rid, "requeued: no answer in time")
    svc.step()                                        # placed again
    second = q.get("j")
    assert second.state == "running" and second.allocation_id != first and second.request_state == "cancelled"
    q.requeue("j", steps_done=3, preempted=False, reason="late", allocation_id=first)   # the old run: ignored
    assert q.get("j").state == "running"
    led.release(second.allocation_id)
    q.requeue("j", steps_done=3, preempted=False, reason="gang failed", allocation_id=second.allocation_id)
    assert q.get("j").state == "pending" and q.get("j").allocation_id is None
    # an out-of-memory fallback's allocation is the row's: a cancellation frees the GPUs the run holds
    svc.step()
    third = q.get("j")
    led.release(third.allocation_id)
    fb = led.allocate_best_fit("j", plans()[1])
    assert q.moved("j", assignment_json(fb, plans()[1]))
    assert q.get("j").allocation_id == fb.id
    rid = q.request("j", "preempt", reason="again")
    assert q.cancel_run("j", rid, "requeued: no answer in time")
    assert led.allocation(fb.id).status == "released"


def test_rounds_run_on_the_databases_clock(url, monkeypatch):
    """Submissions, starts and leases are stamped by the database's clock; rounds ran on the
    scheduler host's, so a host whose clock was off shifted grace periods, aging and the
    predicted starts `frenzy queue` shows by its error."""
    led = ledger_with_cluster(url)
    svc = service(led)
    monkeypatch.setattr(svc.source.queue, "now", lambda: time.time() + 1000.0)   # a host 1,000 s behind
    svc.step()
    assert svc.leading and abs(svc.loop.clock() - (time.time() + 1000.0)) < 5.0
    monkeypatch.undo()
    JobQueue(led).enqueue("a", "a", {"name": "a"}, plans(), steps=10)
    JobQueue(led).enqueue("b", "b", {"name": "b"}, plans(), steps=10)
    svc._renew_at = 0.0
    svc.step()                               # re-measured: no skew here
    assert abs(svc.db_clock() - time.time()) < 5.0
    waiting = JobQueue(led).get("b")
    assert waiting.state == "pending" and waiting.predicted_start_s is not None
    assert abs(waiting.predicted_start_s - JobQueue(led).now()) < 3600


def test_resize_request_for_a_finished_job_is_ignored_and_logged(url, caplog):
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("j", "j", {"name": "j"}, plans(), steps=10)
    service(led).step()
    job = q.get("j")
    assert job.state == "running"
    rid = q.request("j", "shrink", plan=plans()[1], placement={"a100-0": [0]})
    assert rid and q.get("j").request_state == "pending"
    led.release(job.allocation_id)
    q.finish("j", "done")
    assert q.get("j").request_state == "ignored"          # the open request dies with the job
    with caplog.at_level(logging.INFO, logger="frenzy.queue"):
        assert q.request("j", "grow", plan=plans()[0], placement={"a100-0": [0, 1]}) is None
    assert "ignored grow request for job j: it is done" in caplog.text
    assert q.get("j").state == "done" and q.get("j").request["id"] == rid
    # the run answering the old request late, or the reaper, change nothing either
    assert not q.ack_request("j", rid)
    assert not q.resized("j", rid, {"allocation_id": "x", "plan": {}}, steps_done=5)
    assert not q.cancel_run("j", rid, "late")
    assert q.reap()["overdue"] == [] and q.get("j").state == "done"


def test_preempt_request_reaches_the_run_and_requeues_it(url):
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("j", "j", {"name": "j"}, plans(), steps=10)
    service(led).step()
    job = q.get("j")
    rid = q.request("j", "preempt", reason="test")
    seen = q.touch("j", steps_done=4)                       # the run's heartbeat sees it
    assert seen.open_request and seen.request["id"] == rid and seen.request["kind"] == "preempt"
    assert q.ack_request("j", rid) and not q.ack_request("j", "another")
    led.release(job.allocation_id)
    q.requeue("j", steps_done=4, preempted=True)
    back = q.get("j")
    assert (back.state, back.preemptions, back.steps_done, back.request_state) == ("pending", 1, 4, "done")
    # the scheduler places it again with the steps it has left, and counts the preemption
    from frenzy_scheduler.source import LedgerSource
    snap = LedgerSource(led).snapshot()
    assert [(r.job_id, r.steps_left, r.preemptions) for r in snap.pending] == [("j", 6, 1)]


def test_reaper_frees_a_dead_runs_gpus_and_gives_up_its_job(url):
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("j", "j", {"name": "j"}, plans(), steps=10, alive_s=0.2)
    svc = service(led, lease_s=0.2)
    svc.step()
    assert q.get("j").state == "running"
    time.sleep(0.5)                                         # nobody renews the lease or the row
    svc.source.reap()
    assert q.get("j").state == "failed" and "reaped" in q.get("j").error
    assert not [a for a in led.allocations() if a.status == "active"]


class FakeSource:
    def __init__(self):
        self.pending = [JobRequest("a", 0.0, plans(), 10)]
        self.nodes = [Node("n0", "p", "A100-80GB", 2, [0, 1])]
        self.rounds = 0
        self.version = 1

    def snapshot(self):
        return Snapshot(self.pending, ClusterState(nodes=self.nodes), self.version)

    def apply(self, result: RoundResult, now: float):
        self.rounds += 1

    def reap(self):
        pass


def test_loop_rounds_on_change_and_on_tick_only():
    from scheduler.policies import get_policy
    clock = {"t": 0.0}
    src = FakeSource()
    src.nodes[0].free = []                                   # nothing can start: the job waits
    loop = RoundLoop(get_policy("fifo-user"), src, clock=lambda: clock["t"], tick_s=10.0)
    loop.step()
    assert src.rounds == 1 and loop.next_due() == 10.0       # a change (the arrival) and a tick queued
    clock["t"] = 5.0
    loop.step()
    assert src.rounds == 1                                  # no change, tick not due
    src.nodes[0].free = [0, 1]
    clock["t"] = 10.0
    loop.step()
    assert src.rounds == 2                                  # the version did not change: the tick ran it


LEADER_SCRIPT = textwrap.dedent("""
    import json, sys, time
    from frenzy_scheduler.service import SchedulerService
    url, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
    svc = SchedulerService(url, "frenzy", holder=name, ttl_s=2.0, poll_s=0.1)
    apply = svc.source.apply
    def logged(result, now):
        with open(out, "a") as fh:
            fh.write(json.dumps({"who": name, "t": time.time(), "leading": svc._fence(),
                                 "starts": [d.job_id for d in result.starts]}) + "\\n")
        apply(result, now)
    svc.source.apply = logged
    open(out + "." + name + ".up", "w").close()           # imports done: standing by from here on
    svc.run(max_s=60)
""")


def test_second_scheduler_stands_by_and_takes_over_when_the_first_dies(url, tmp_path):
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    script = tmp_path / "leader.py"
    script.write_text(LEADER_SCRIPT)
    out = tmp_path / "rounds.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    lead = Leadership(led, "observer", ttl_s=1.0)

    def spawn(name):
        return subprocess.Popen([sys.executable, str(script), url, name, str(out)], env=env, cwd=ROOT)

    def wait_holder(name, within_s):
        end = time.time() + within_s
        while time.time() < end:
            cur = lead.current()
            if cur and cur["holder"] == name and not cur["expired"]:
                return time.time()
            time.sleep(0.05)
        raise AssertionError(f"{name} did not lead within {within_s} s: {lead.current()}")

    a = spawn("A")
    b = None
    try:
        wait_holder("A", 30)
        b = spawn("B")
        up = Path(f"{out}.B.up")                            # B is up and standing by (its start-up, which
        end = time.time() + 30                              # a loaded machine stretches, is not the takeover)
        while not up.exists() and time.time() < end:
            time.sleep(0.05)
        assert up.exists()
        time.sleep(0.5)                                     # B's first polls see A's lease
        q.enqueue("j1", "j1", {"name": "j1"}, plans(), steps=10)
        end = time.time() + 10
        while q.get("j1").state != "running" and time.time() < end:
            time.sleep(0.05)
        assert q.get("j1").state == "running"
        assert lead.current()["holder"] == "A"
        a.send_signal(signal.SIGKILL)
        a.wait()
        died = time.time()
        took = wait_holder("B", 2.0 + 2.0)                  # the TTL, plus B's poll
        assert took - died <= 2.0 + 1.0
        led.release(q.get("j1").allocation_id)
        q.finish("j1", "done")
        q.enqueue("j2", "j2", {"name": "j2"}, plans(), steps=10)
        end = time.time() + 10
        while q.get("j2").state != "running" and time.time() < end:
            time.sleep(0.05)
        assert q.get("j2").state == "running"
    finally:
        for p in (a, b):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    rounds = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(r["leading"] for r in rounds)
    by_b = [r for r in rounds if r["who"] == "B"]
    assert by_b and all(r["t"] > died for r in by_b)        # B never acted while A led
    assert any("j1" in r["starts"] for r in rounds if r["who"] == "A")
    assert any("j2" in r["starts"] for r in by_b)


def test_a_stalled_leaders_round_writes_nothing_once_a_standby_took_over(url, monkeypatch):
    """The monotonic fence is checked before a round is applied; a leader that stalls after that
    check (a pause, a hung connection) past its lease while a standby takes over wrote its old
    round anyway. Every scheduler write now checks the lease's holder and epoch in its own
    transaction: the stale round starts nothing, and the leader steps down."""
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    a = service(led, holder="A", ttl_s=1.0)
    a.step()
    assert a.leading and a.source.queue.fence == LeaseFence("scheduler", "A", 1)
    real_apply = a.source.apply

    def stalled(result, now):
        monkeypatch.setattr(a.source, "apply", real_apply)    # once
        time.sleep(1.3)                                 # past A's 1 s lease...
        assert Leadership(led, "B", ttl_s=60.0).acquire()   # ...a standby takes over
        real_apply(result, now)

    monkeypatch.setattr(a.source, "apply", stalled)
    monkeypatch.setattr(a.source, "fence", lambda: True)    # the stall came after the fence's check
    q.enqueue("j", "j", {"name": "j"}, plans(), steps=10)
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("frenzy.scheduler").addHandler(handler)      # (Prefect's first import
    try:                                                             # resets the root's handlers)
        a.step()
    finally:
        logging.getLogger("frenzy.scheduler").removeHandler(handler)
    assert any("leadership lost during a round" in m and "held by B at epoch 2" in m for m in seen), seen
    assert q.get("j").state == "pending" and not [x for x in led.allocations() if x.status == "active"]
    assert not a.leading and a.loop is None
    a.step()
    assert not a.leading                                  # B leads
    Leadership(led, "B", ttl_s=60.0).release()
    time.sleep(a.poll_s)                                  # a standby asks again a poll later
    a.step()                                              # leading again is a takeover: a fresh loop,
    assert a.leading and a.takeovers == 2                 # whose first round places the job at once
    assert q.get("j").state == "running"
    # each fenced write: a request of the stale epoch is refused before it reads anything
    with pytest.raises(LeadershipLost):
        JobQueue(led, fence=LeaseFence("scheduler", "A", 1)).request("j", "preempt")
    assert JobQueue(led, fence=LeaseFence("scheduler", "A", 3)).request("j", "preempt")   # A's epoch now


def test_frenzy_queue_prints_pending_jobs_with_predicted_start_and_reason(url, capsys):
    from frenzy_cli.main import main
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    for name in ("a", "b"):
        q.enqueue(name, name, {"name": name}, plans(), steps=100)
        time.sleep(0.01)
    service(led).step()
    assert main(["queue", "--ledger", url, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = {r["job"]: r for r in doc["jobs"]}
    assert rows["a"]["state"] == "running" and (rows["a"]["gpu_type"], rows["a"]["gpus"]) == ("A100-80GB", 2)
    b = rows["b"]
    assert b["state"] == "pending" and b["why"] and b["gpu_type"] == "A100-80GB"
    assert b["predicted_start_in_s"] is not None and b["predicted_start_in_s"] > 0


def test_a_wait_with_no_scheduler_times_out_saying_what_it_waited_for(url):
    from frenzy_flows.training import wait_for_allocation
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("lonely", "lonely", {"name": "lonely"}, plans(), steps=10)
    with pytest.raises(TimeoutError, match="none holds the leadership: start `frenzy scheduler`"):
        wait_for_allocation(q, "lonely", timeout_s=0.3, log=lambda s: None)
    assert q.get("lonely").state == "failed"                 # given up: no later start for nobody


def test_scheduler_flags_are_checked_before_anything_starts(capsys):
    from frenzy_cli.main import main
    assert main(["scheduler", "--tick-s", "-1"]) == 2
    assert "tick-s: must be a finite number >= 1" in capsys.readouterr().err
    assert main(["scheduler", "--tick-s", "1e-9"]) == 2      # a round a second at the finest
    assert "tick-s: must be a finite number >= 1" in capsys.readouterr().err
    assert main(["scheduler", "--policy", "nope"]) == 2
    assert "unknown policy 'nope'" in capsys.readouterr().err


def test_a_run_that_does_not_answer_in_time_is_cancelled_and_its_job_requeued(url, monkeypatch):
    import ledger.queue as lq
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("j", "j", {"name": "j"}, plans(), steps=10)
    cancelled = []
    svc = service(led)
    svc.source.cancel = lambda fr, msg: cancelled.append((fr, msg)) or True
    svc.step()
    first = q.get("j").allocation_id
    q.attach_run("j", "flow-run-1")
    rid = q.request("j", "preempt")
    svc.source.reap()
    assert q.get("j").request_state == "pending" and not cancelled       # young: left alone
    assert q.ack_request("j", rid)
    monkeypatch.setattr(lq, "REQUEST_ACK_S", 0.0)
    time.sleep(0.05)
    svc.source.reap()
    # acknowledged: the run gets its stop allowance (two steps, its checkpoint, a margin) on top
    assert q.get("j").request_state == "acked" and not cancelled
    monkeypatch.setattr(lq, "STOP_MARGIN_S", 0.0)
    monkeypatch.setattr(lq, "STOP_STEPS", 0.0)
    svc.source.reap()
    assert cancelled and cancelled[0][0] == "flow-run-1" and "did not stop after acknowledging" in cancelled[0][1]
    job = q.get("j")
    assert (job.state, job.request_state, job.allocation_id, job.flow_run_id) == ("pending", "cancelled", None, None)
    assert (job.restarts, job.preemptions) == (1, 1)
    assert led.allocation(first).status == "released" and not led.holders()
    # the old run answering late changes nothing; the job is placed again and resumes
    assert not q.resized("j", rid, {"allocation_id": "x", "plan": {}}, steps_done=3)
    q.requeue("j", steps_done=3, preempted=True)
    assert (q.get("j").restarts, q.get("j").steps_done) == (1, 0)
    svc.step()
    job = q.get("j")
    assert job.state == "running" and job.allocation_id not in (None, first)
    q.requeue("j", steps_done=3, preempted=True)          # still late after the new start
    assert q.get("j").state == "running" and q.get("j").allocation_id == job.allocation_id


def test_round_decisions_become_requests_events_and_reservations(url):
    from frenzy_scheduler.source import LedgerSource
    from scheduler.round import check_decisions
    from scheduler.types import Decision
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("big", "big", {"name": "big"}, plans(), steps=100)
    events = []
    src = LedgerSource(led, publish=lambda kind, payload: events.append((kind, payload)))
    snap = src.snapshot()
    src.apply(check_decisions("t", [Decision("big", plans()[0], {"a100-0": [0, 1]})], snap.pending, snap.state), 0.0)
    assert [k for k, _ in events] == ["started"] and events[0][1]["plan"]["gpus"] == 2
    # a shrink: the policy stops the run and restarts it on one GPU in the same round
    snap = src.snapshot()
    assert [r.job_id for r in snap.state.running] == ["big"] and snap.state.running[0].request.steps_left == 100
    shrink = [Decision("big", None, {}, action="preempt", reason="shrink"),
              Decision("big", plans()[1], {"a100-0": [1]}, reason="shrink")]
    src.apply(check_decisions("t", shrink, snap.pending, snap.state), 0.0)
    kind, payload = events[-1]
    assert kind == "resized" and payload["kind"] == "shrink"
    assert (payload["from_plan"]["gpus"], payload["to_plan"]["gpus"], payload["placement"]) == (2, 1, {"a100-0": [1]})
    row = q.get("big")
    assert row.request["kind"] == "shrink" and row.request_state == "pending"
    # while the request is open the run is offered to no policy, its target GPU to no other job
    q.enqueue("small", "small", {"name": "small"}, plans(), steps=5)
    led.release(row.allocation_id)                           # the run stopped and let its GPUs go
    snap = src.snapshot()
    assert snap.state.running == [] and [r.job_id for r in snap.pending] == ["small"]
    assert snap.state.nodes[0].free == [0]


def test_a_runs_start_reason_reaches_the_next_rounds_as_its_running_jobs_reason(url):
    """A stopgap start is recorded on the job's queue row (``start_reason``), so the live rounds
    hand the run to the policy as a stopgap (``RunningJob.reason``), as the simulator does; the
    run's out-of-memory fallback onto another allocation keeps it (the same start, a safer plan),
    a re-size clears it."""
    from frenzy_scheduler.source import LedgerSource, assignment_json
    from scheduler.round import check_decisions
    from scheduler.types import Decision
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("s", "s", {"name": "s"}, plans(), steps=50)
    src = LedgerSource(led)
    snap = src.snapshot()
    src.apply(check_decisions("t", [Decision("s", plans()[1], {"a100-0": [0]}, reason="stopgap")],
                              snap.pending, snap.state), 0.0)
    assert [(r.job_id, r.reason) for r in src.snapshot().state.running] == [("s", "stopgap")]
    row = q.get("s")
    assert row.start_reason == "stopgap"
    assert LedgerSource(led).snapshot().state.running[0].reason == "stopgap"   # a new scheduler reads it too
    led.release(row.allocation_id)
    moved = led.allocate_best_fit("s", plans()[0])
    assert q.moved("s", assignment_json(moved, plans()[0]))
    assert [(r.job_id, r.reason) for r in src.snapshot().state.running] == [("s", "stopgap")]
    assert q.resized("s", "no-request", assignment_json(moved, plans()[0]), steps_done=5,
                     allocation_id=str(moved.id))
    assert [(r.job_id, r.reason) for r in src.snapshot().state.running] == [("s", "")]


def test_a_recall_is_a_preempt_request_published_as_recalled(url):
    from frenzy_scheduler.source import LedgerSource
    from scheduler.round import check_decisions
    from scheduler.types import Decision
    led = ledger_with_cluster(url)
    JobQueue(led).enqueue("r", "r", {"name": "r"}, plans(), steps=10)
    events = []
    src = LedgerSource(led, publish=lambda kind, payload: events.append((kind, payload)))
    service(led).step()
    snap = src.snapshot()
    src.apply(check_decisions("t", [Decision("r", None, {}, action="preempt", reason="recall")],
                              snap.pending, snap.state), 0.0)
    assert [k for k, _ in events] == ["recalled"] and events[0][1]["from_plan"]["gpus"] == 2
    assert JobQueue(led).get("r").request["kind"] == "preempt"


def test_a_runs_predicted_end_stays_its_start_plus_the_steps_it_had_left_then(url):
    """Heartbeats move steps_done on; the predicted end stays started_at + the steps left when
    the run started times its step time (the simulator's prediction), not started_at + what is
    left now, which would slide earlier than the run's real end as it progresses."""
    from frenzy_scheduler.source import LedgerSource
    from scheduler.round import check_decisions
    from scheduler.types import Decision
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("run", "run", {"name": "run"}, plans(), steps=100)
    src = LedgerSource(led)
    snap = src.snapshot()
    src.apply(check_decisions("t", [Decision("run", plans()[1], {"a100-0": [0]})], snap.pending, snap.state), 0.0)
    rj = src.snapshot().state.running[0]
    started = q.get("run").started_at
    assert rj.expected_end_s - started == pytest.approx(100 * 1.0)
    q.touch("run", steps_done=60)                     # the run's heartbeat, 60 steps on
    rj = src.snapshot().state.running[0]
    assert rj.request.steps_left == 40
    assert rj.expected_end_s - started == pytest.approx(100 * 1.0)


def test_a_long_lived_sources_snapshot_equals_a_fresh_ones_after_every_change(url):
    """The source keeps the mirror's nodes and runs between rounds (replacing, never changing
    them): after starts, a grow request whose target GPU is held back, the request closing
    without any GPU row changing, progress and a release, its snapshot is a fresh source's."""
    from frenzy_scheduler.source import LedgerSource
    from scheduler.round import check_decisions
    from scheduler.types import Decision
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    q.enqueue("a", "a", {"name": "a"}, plans(), steps=100)
    q.enqueue("b", "b", {"name": "b"}, plans(), steps=50)
    src = LedgerSource(led)

    def same() -> Snapshot:
        snap, fresh = src.snapshot(), LedgerSource(Ledger(url)).snapshot()
        assert (snap.pending, snap.state) == (fresh.pending, fresh.state)
        return snap

    snap = same()
    src.apply(check_decisions("t", [Decision("a", plans()[1], {"a100-0": [0]})], snap.pending, snap.state), 0.0)
    snap = same()
    assert snap.state.nodes[0].free == [1] and [r.job_id for r in snap.state.running] == ["a"]
    rid = q.request("a", "grow", plan=plans()[0], placement={"a100-0": [0, 1]})
    snap = same()
    assert snap.state.nodes[0].free == [] and snap.state.running == []     # GPU 1 held for the grow
    q.finish("a", "done")                     # the request closes (ignored); no GPU row changes
    assert q.get("a").request_state == "ignored" and rid
    snap = same()
    assert snap.state.nodes[0].free == [1]    # a node changed in place would still hold GPU 1 back
    led.release(next(aid for aid, a in src.mirror.allocs.items() if a.job_id == "a"))
    snap = same()
    assert snap.state.nodes[0].free == [0, 1] and [j.job_id for j in snap.pending] == ["b"]


def test_set_waits_writes_changed_answers_of_pending_jobs_only(url):
    """One statement on PostgreSQL, one per row on SQLite: the same rows change either way."""
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    for j in ("p1", "p2", "run"):
        q.enqueue(j, j, {"name": j}, plans(), steps=10)
    q.start_all([("run", plans()[1], {"a100-0": [0]})], lease_s=60.0, assignment=lambda a, p: {"allocation_id": a.id})
    w = {"p1": {"predicted_start_s": 1000.0, "gpu_type": "A100-80GB", "gpus": 2, "reason": "reserved"},
         "p2": {"predicted_start_s": float("inf"), "gpu_type": None, "gpus": 0, "reason": "no plan fits"},
         "run": {"predicted_start_s": 5.0, "gpu_type": "A100-80GB", "gpus": 1, "reason": "not pending"}}
    assert q.set_waits(w) == 2
    rows = {j.job_id: j for j in q.jobs(plans=False)}
    assert (rows["p1"].predicted_start_s, rows["p1"].wait_gpu_type, rows["p1"].wait_gpus, rows["p1"].wait_reason) == (
        1000.0, "A100-80GB", 2, "reserved")
    assert (rows["p2"].predicted_start_s, rows["p2"].wait_gpu_type, rows["p2"].wait_reason) == (None, None, "no plan fits")
    assert rows["run"].wait_reason == "" and rows["run"].predicted_start_s is None
    # a start moved by less than the resolution is not rewritten; the same through known rows
    w["p1"]["predicted_start_s"] = 1000.5
    assert q.set_waits(w) == 0 and q.set_waits(w, known=rows) == 0
    w["p1"]["predicted_start_s"], w["p2"]["reason"] = 2000.0, "other"
    assert q.set_waits(w, known=rows) == 2
    rows = {j.job_id: j for j in q.jobs(plans=False)}
    assert rows["p1"].predicted_start_s == 2000.0 and rows["p2"].wait_reason == "other"


def test_start_all_skips_only_the_starts_that_cannot_go_ahead(url):
    """One batch (one statement per kind on PostgreSQL): a start on a GPU another allocation
    holds, one on a GPU an earlier start of the batch took and one of a job that is not pending
    are skipped, each saying why; the others start, their rows carrying the assignment."""
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    for j in ("a", "b", "c", "d"):
        q.enqueue(j, j, {"name": j}, plans(), steps=10)
    other = led.allocate_best_fit("outsider", Plan(gpu_type="A100-80GB", gpus=1, dp=1))
    held = other.placement["a100-0"][0]
    free = 1 - held
    q.finish("d", "failed", "gone")
    one = plans()[1]
    got = q.start_all([("a", one, {"a100-0": [held]}), ("b", one, {"a100-0": [free]}),
                       ("c", one, {"a100-0": [free]}), ("d", one, {"a100-0": [free]})],
                      lease_s=60.0, assignment=lambda a, p: {"allocation_id": a.id, "plan": p.model_dump(mode="json"),
                                                             "placement": a.placement})
    why = {j: w for j, _, w in got}
    assert "held by allocation" in why["a"] and why["b"] == "" and "of this round" in why["c"]
    assert "no longer pending" in why["d"]
    rows = {j.job_id: j for j in q.jobs(plans=False)}
    b = rows["b"]
    assert b.state == "running" and b.allocation == {"allocation_id": b.allocation_id, "plan": one.model_dump(mode="json"),
                                                     "placement": {"a100-0": [free]}}
    assert rows["a"].state == rows["c"].state == "pending" and rows["a"].allocation_id is None
    assert {n: sorted(r.placement["a100-0"]) for n, r in ((r.job_id, r) for r in led.cluster_state().running)} == {
        "outsider": [held], "b": [free]}


def test_start_all_writes_the_rounds_wait_answers_in_its_transaction(url):
    """The round's starts and its wait answers in one commit; without starts the answers still
    go through ``set_waits``, and a failed start transaction leaves the answers unwritten."""
    led = ledger_with_cluster(url)
    q = JobQueue(led)
    for j in ("p1", "p2", "run"):
        q.enqueue(j, j, {"name": j}, plans(), steps=10)
    known = {j.job_id: j for j in q.jobs(plans=False)}
    w = {"p1": {"predicted_start_s": 1000.0, "gpu_type": "A100-80GB", "gpus": 2, "reason": "reserved"}}
    got = q.start_all([("run", plans()[1], {"a100-0": [0]})], lease_s=60.0,
                      assignment=lambda a, p: {"allocation_id": a.id}, waits=w, known=known)
    assert got[0][2] == ""
    rows = {j.job_id: j for j in q.jobs(plans=False)}
    assert rows["run"].state == "running" and rows["p1"].wait_reason == "reserved"
    assert q.start_all([], lease_s=60.0, assignment=lambda a, p: {},
                       waits={"p2": {**w["p1"], "reason": "later"}}, known=rows) == []
    assert {j.job_id: j for j in q.jobs(plans=False)}["p2"].wait_reason == "later"

    def broken(a, p):
        raise RuntimeError("assignment failed")
    with pytest.raises(RuntimeError):
        q.start_all([("p2", plans()[1], {"a100-0": [1]})], lease_s=60.0, assignment=broken,
                    waits={"p1": {**w["p1"], "reason": "never written"}}, known=rows)
    rows = {j.job_id: j for j in q.jobs(plans=False)}
    assert rows["p1"].wait_reason == "reserved" and rows["p2"].state == "pending"


def test_a_dead_pooled_connection_is_replaced_and_a_refresh_reads_on(monkeypatch):
    """PostgreSQL: a pooled connection whose server process died is pinged and replaced when
    it was idle ``_FRESH_S`` or longer; within that window the first statement fails and the
    pool is renewed, and the mirror's read tries once more on a fresh connection."""
    base = os.environ.get("FRENZY_TEST_POSTGRES_URL")
    if not base:
        pytest.skip("FRENZY_TEST_POSTGRES_URL is not set: PostgreSQL tests need a server")
    from sqlalchemy import create_engine, text
    from sqlalchemy.exc import OperationalError
    import ledger.core as core
    from ledger.mirror import LedgerMirror
    u, schema = pg_schema_url(base)
    admin = create_engine(base, isolation_level="AUTOCOMMIT")
    try:
        led = ledger_with_cluster(u)

        def kill_pooled() -> None:         # only this ledger's own connection(s), by pid
            with led._read() as s:
                pid = s.execute(text("SELECT pg_backend_pid()")).scalar_one()
            with admin.connect() as c:
                c.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})

        mirror = LedgerMirror(led)
        mirror.refresh()
        monkeypatch.setattr(core, "_FRESH_S", 0.0)      # every returned connection counts as idle
        kill_pooled()
        with led._read() as s:
            assert s.execute(text("SELECT 1")).scalar_one() == 1
        monkeypatch.setattr(core, "_FRESH_S", 3600.0)   # none is pinged
        kill_pooled()
        with pytest.raises(OperationalError):
            with led._read() as s:
                s.execute(text("SELECT 1"))
        with led._read() as s:
            assert s.execute(text("SELECT 1")).scalar_one() == 1
        JobQueue(led).enqueue("j", "j", {"name": "j"}, plans(), steps=10)
        kill_pooled()
        mirror.refresh()
        assert "j" in mirror.jobs and mirror.full_reads == 1
    finally:
        admin.dispose()
        drop_schema(base, schema)
