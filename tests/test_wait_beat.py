"""A submission waiting for GPUs reads its queue row every poll and writes its heartbeat only
every few polls (``WAIT_BEAT_S``), beating at once so a fresh wait is alive from its start."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from frenzy_flows import training


class CountingQueue:
    """A queue row that stays pending for ``polls`` looks, then ends (the wait then raises)."""

    def __init__(self, polls: int):
        self.polls, self.calls = polls, []

    def _row(self):
        state = "pending" if len(self.calls) < self.polls else "failed"
        return SimpleNamespace(state=state, allocation_id=None, allocation={}, wait_reason="",
                               error="given up")

    def touch(self, job_id, **kw):
        self.calls.append("touch")
        assert kw.get("plans") is False             # a waiting job needs no candidate plans
        return self._row()

    def get(self, job_id, **kw):
        self.calls.append("get")
        assert kw.get("plans") is False
        return self._row()


def test_a_waiting_submission_beats_every_few_polls(monkeypatch):
    monkeypatch.setattr(training, "WAIT_POLL_S", 0.01)
    monkeypatch.setattr(training, "WAIT_BEAT_S", 0.1)
    q = CountingQueue(polls=40)
    with pytest.raises(RuntimeError, match="ended failed"):
        training.wait_for_allocation(q, "j", timeout_s=60, log=lambda s: None)
    assert q.calls[0] == "touch"                    # alive from the first look
    beats = q.calls.count("touch")
    assert 2 <= beats <= len(q.calls) // 3, q.calls   # ~every 10th poll, never every poll
