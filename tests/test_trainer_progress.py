"""Progress reporting never blocks training: the reader thread that drains the ranks' pipe hands
step updates to a bounded mailbox whose own thread calls the (Prefect, HTTP) progress update;
when that call hangs, updates are dropped and the reader keeps its pace."""
from __future__ import annotations

import io
import json
import sys
import textwrap
import threading
import time

from frenzy_flows import artifacts
from trainer.launcher import run_process_group
from trainer.runner import ON_STEP_QUEUE_MAX, Mailbox, _Listener

STEPS = 3000


def test_mailbox_drops_the_oldest_and_delivers_the_newest():
    release = threading.Event()
    got: list[int] = []

    def slow(step: int) -> None:
        release.wait()
        got.append(step)

    box = Mailbox(slow, maxsize=4)
    t0 = time.monotonic()
    for s in range(1, 1001):
        box.post(s)
    assert time.monotonic() - t0 < 1.0          # never waited on the hanging callee
    assert box.dropped >= 1000 - 4 - 1          # one is in the callee, four queued
    release.set()
    assert box.close(5.0)
    assert got[-1] == 1000 and len(got) <= 5


def test_mailbox_survives_a_failing_callee():
    calls = []

    def bad(x):
        calls.append(x)
        raise ConnectionError("API down")

    box = Mailbox(bad)
    for s in range(3):
        box.post(s)
    assert box.close(5.0)
    assert calls == [0, 1, 2] and box.failed == 3


def test_hanging_progress_api_does_not_slow_the_reader(monkeypatch):
    """A real child prints STEPS step lines as fast as it can; the progress artifact update over
    'HTTP' hangs (an API that is down); the child still finishes in about the time it takes with
    no progress reporting at all, and the reader saw every line."""
    hang = threading.Event()
    calls = []

    class HangingClient:              # the Prefect API client against a dead API
        def update_artifact(self, **kw):
            calls.append(kw)
            hang.wait(3600)

    monkeypatch.setattr(artifacts, "PROGRESS_MIN_INTERVAL_S", 0.0)
    handle = artifacts.ProgressHandle(artifact_id=None, total=STEPS, client=HangingClient())
    child = [sys.executable, "-c", textwrap.dedent(f"""
        import json
        for s in range(1, {STEPS} + 1):
            print("FRENZY_STEP " + json.dumps({{"step": s, "total": {STEPS}, "loss": 1.0}}), flush=True)
        """)]

    def run(on_step):
        losses: dict[int, float] = {}
        listener = _Listener(lambda line: None, on_step, losses, io.StringIO())
        t0 = time.monotonic()
        rc, _, _ = run_process_group(child, None, 120, listener)
        return rc, time.monotonic() - t0, losses

    rc0, baseline_s, _ = run(None)
    box = Mailbox(lambda s, t, loss: artifacts.progress_update(handle, s, t, loss))
    try:
        rc, took_s, losses = run(box.post)
    finally:
        hang.set()
        box.close(5.0)
    assert rc0 == 0 and rc == 0
    assert len(losses) == STEPS                 # the reader saw every step
    assert len(calls) >= 1                      # the update was attempted (and hung)
    assert box.dropped >= STEPS - ON_STEP_QUEUE_MAX - 1
    # with a synchronous update the child would still be blocked on its full pipe
    assert took_s < baseline_s + 5.0, (took_s, baseline_s)


def test_progress_updates_of_a_run_share_one_api_client(monkeypatch):
    """Every update of a run goes through one Prefect client (made at the first update, closed
    by ``progress_end``), not a new client per update."""
    made = []

    class Client:
        def __init__(self):
            self.updates, self.closed = [], False
            made.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.closed = True

        def update_artifact(self, *, artifact_id, artifact):
            self.updates.append((artifact_id, artifact.data, artifact.description))

    import prefect

    monkeypatch.setattr(prefect, "get_client", lambda sync_client=False: Client())
    monkeypatch.setattr(artifacts, "PROGRESS_MIN_INTERVAL_S", 0.0)
    handle = artifacts.ProgressHandle(artifact_id="a1", total=4)
    sent = [artifacts.progress_update(handle, s, 4, loss=1.0) for s in range(1, 5)]
    artifacts.progress_end(handle)
    assert sent == [True] * 4
    assert len(made) == 1 and made[0].closed
    assert [u[1] for u in made[0].updates] == [25.0, 50.0, 75.0, 100.0]
    assert made[0].updates[-1][2] == "training: step 4/4, loss 1.0000"
    artifacts.progress_end(handle)              # a second end, or one without updates: no-op
    artifacts.progress_end(None)
