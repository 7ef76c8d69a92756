"""Leases run on the database's clock, and a lost lease is visible to the run that held it.

A submitter whose clock runs 301 s ahead must not expire a healthy 300 s lease (it did when
``expire_leases`` took the caller's ``now``); a heartbeat on a lease that already ran out is
refused and frees the GPUs; ``Ledger.lease`` marks its state lost when the ledger says so or
when no renewal succeeded for a whole lease. SQLite and (with FRENZY_TEST_POSTGRES_URL)
PostgreSQL through the ``ledger`` fixture."""
import time

import pytest
from sqlalchemy.exc import OperationalError

from ledger import LeaseLost, core

from .test_ledger_basic import A, ledger  # noqa: F401  (the two-database fixture)


def test_a_fast_caller_clock_does_not_expire_a_healthy_lease(ledger, monkeypatch):  # noqa: F811
    alive = ledger.allocate("alive", A(2), {"a100-0": [0, 1]})             # 300 s lease
    with pytest.warns(DeprecationWarning):
        assert ledger.expire_leases(now=time.time() + 301) == []
    real = time.time
    monkeypatch.setattr(core.time, "time", lambda: real() + 301)          # this host 301 s ahead
    assert ledger.expire_leases() == []
    assert ledger.lease_valid(alive.id) is True
    monkeypatch.setattr(core.time, "time", lambda: real() - 3600)         # or an hour behind
    ledger.heartbeat(alive.id, lease_s=0.3)
    monkeypatch.undo()
    assert ledger.allocation(alive.id).status == "active"
    assert ledger.allocation(alive.id).lease_expires_at == pytest.approx(time.time() + 0.3, abs=2.0)
    time.sleep(0.5)
    assert ledger.lease_valid(alive.id) is False                          # ran out, not yet reaped
    assert ledger.expire_leases() == [alive.id]


def test_heartbeat_after_expiry_is_refused_and_frees_the_gpus(ledger):  # noqa: F811
    a = ledger.allocate("late", A(4), {"a100-1": [0, 1, 2, 3]}, lease_s=0.2)
    time.sleep(0.4)
    with pytest.raises(LeaseLost, match="lease ran out"):
        ledger.heartbeat(a.id)
    assert ledger.allocation(a.id).status == "expired"
    assert {n.node_id: n.free for n in ledger.cluster_state().nodes}["a100-1"] == [0, 1, 2, 3]
    with pytest.raises(LeaseLost):
        ledger.heartbeat(a.id)


def test_lease_state_turns_lost_when_the_ledger_frees_the_allocation(ledger):  # noqa: F811
    a = ledger.allocate("fenced", A(1), {"a100-0": [3]}, lease_s=5.0)
    with ledger.lease(a.id, every_s=0.05, lease_s=5.0) as state:
        time.sleep(0.15)
        assert not state.lost and state["beats"] >= 1
        state.check()                                   # no-op while held
        ledger.release(a.id)                            # e.g. another process reaped it
        deadline = time.monotonic() + 3.0
        while not state.lost and time.monotonic() < deadline:
            time.sleep(0.02)
        assert state.lost
        with pytest.raises(LeaseLost, match="released"):
            state.check()


def test_lease_state_turns_lost_when_the_database_stays_unreachable(ledger, monkeypatch):  # noqa: F811
    a = ledger.allocate("cut-off", A(1), {"a100-0": [2]}, lease_s=0.5)
    real = ledger.heartbeat
    calls = {"n": 0}

    def flaky(alloc_id, lease_s=core.DEFAULT_LEASE_S):
        calls["n"] += 1
        if calls["n"] == 1:
            return real(alloc_id, lease_s)
        raise OperationalError("SELECT 1", {}, Exception("connection refused"))

    monkeypatch.setattr(ledger, "heartbeat", flaky)
    with ledger.lease(a.id, every_s=0.05, lease_s=0.5) as state:
        time.sleep(0.2)
        assert not state.lost                           # a short outage is tolerated
        time.sleep(0.6)
        assert state.lost
        with pytest.raises(LeaseLost, match="not renewed"):
            state.check()
