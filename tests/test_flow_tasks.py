"""Pieces of the submit flow that need no Prefect server."""
from __future__ import annotations


def test_live_policy_never_restarts_running_jobs():
    from frenzy_flows.tasks import live_policy
    from scheduler.policies import get_policy

    sim = get_policy("frenzy")
    live = live_policy("frenzy")
    assert (sim.preemption, sim.grow, sim.shrink) == (True, True, True)
    assert (live.preemption, live.grow, live.shrink) == (False, False, False)
    # policies without those knobs are built as they are
    assert type(live_policy("frenzy-paper")).__name__ == type(get_policy("frenzy-paper")).__name__
