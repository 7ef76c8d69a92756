"""The live scheduler's round loop: when to run a cluster-wide round, over any source of truth.

``scheduler.round.run_round`` is the round itself (the simulator's engine calls it too). This
loop decides when it runs, with the same rules as the simulator (``wants_tick``,
``next_round_s``): on every arrival and completion (a change of the source's ``version``), on
the round boundary for round-based policies, and on a tick while jobs wait (or, for a policy
that grows runs, while GPUs sit idle). The clock and the source are injected, so the loop is
pure and testable with a fake clock; the live source is the ledger (``frenzy_scheduler``).

    loop = RoundLoop(policy, source, clock=time.time, tick_s=30.0)
    while leading():
        loop.step()            # reads the source, maybe runs a round and applies it
        sleep(poll_s)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Protocol

from scheduler.round import RoundResult, next_round_s, run_round, wants_tick
from scheduler.types import ClusterState, JobRequest, Policy


@dataclass(slots=True)
class Snapshot:
    """What a round needs, read at one moment: the pending jobs, the cluster (free GPUs and the
    running jobs with their requests), and a ``version`` that changes whenever a job arrives,
    starts, ends or is re-queued."""

    pending: list[JobRequest]
    state: ClusterState
    version: Hashable


class RoundSource(Protocol):
    """The loop's source of truth (the ledger live; a fake in tests)."""

    def snapshot(self) -> Snapshot: ...

    def apply(self, result: RoundResult, now: float) -> None:
        """Act on every decision of ``result`` (stops first, then starts)."""

    def reap(self) -> None:
        """Free what died: expired GPU leases, jobs nobody waits for (may do nothing)."""


class RoundLoop:
    """Decides when rounds run and runs them (module docstring). ``reap_s``: how often the
    source's ``reap`` runs (before the snapshot it reads; None: never)."""

    def __init__(self, policy: Policy, source: RoundSource, *, clock: Callable[[], float],
                 tick_s: float, reap_s: float | None = None,
                 on_round: Callable[[RoundResult, Snapshot, float], None] | None = None):
        if not tick_s > 0:
            raise ValueError("tick_s must be > 0")
        self.policy, self.source, self.clock, self.tick_s = policy, source, clock, float(tick_s)
        self.reap_s = reap_s
        self.on_round = on_round
        self.rounds = 0
        self._version: Hashable = object()      # never equal: the first step is a change
        self._due: float | None = None           # when the next tick or round boundary is due
        self._last_reap: float | None = None

    def step(self) -> RoundResult | None:
        """One look at the source; returns the round's result when a round ran."""
        now = self.clock()
        if self.reap_s is not None and (self._last_reap is None or now - self._last_reap >= self.reap_s):
            self.source.reap()
            self._last_reap = now
        snap = self.source.snapshot()
        changed = snap.version != self._version
        self._version = snap.version
        due = self._due is not None and now >= self._due
        if due:
            self._due = None
        policy = self.policy
        running = len(snap.state.running)
        any_free = any(n.free for n in snap.state.nodes)
        result = None
        if policy.round_s is not None:
            if due:
                result = self._round(snap, now)
                if snap.pending or running:
                    self._due = next_round_s(policy, now, self.tick_s, after_round=True)
            elif changed and self._due is None:
                self._due = next_round_s(policy, now, self.tick_s, after_round=False)
        else:
            wants = wants_tick(policy, pending=len(snap.pending), running=running, any_free=any_free)
            if snap.pending or running:
                if changed or (due and wants and any_free):
                    result = self._round(snap, now)
            if self._due is None and wants:
                self._due = next_round_s(policy, now, self.tick_s, after_round=True)
        return result

    def next_due(self) -> float | None:
        """When the next tick or round boundary is due (None: only a change starts a round)."""
        return self._due

    def _round(self, snap: Snapshot, now: float) -> RoundResult:
        result = run_round(self.policy, snap.pending, snap.state, now)
        self.rounds += 1
        self.source.apply(result, now)
        if self.on_round is not None:
            self.on_round(result, snap, now)
        return result
