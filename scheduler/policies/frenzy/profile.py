"""The availability profile of one GPU type (steps 3-5: plan choice, backfilling, queued load)."""
from __future__ import annotations

import bisect
import math
from itertools import accumulate, count

from scheduler.placement import placement_gpus
from scheduler.types import ClusterState, RunningJob

from .config import Backfill

INF = math.inf
_CHANGES = count(1)             # profile versions, unique across profiles (``Profile.version``)


class Profile:
    """Availability of one GPU type over time: free now, predicted releases, reservations.

    Without reservations free GPUs only grow with time, so the earliest start for n GPUs is a
    bisection on the cumulative releases. With reservations the profile is rebuilt (lazily,
    O(releases) in C-level loops) into prefix minima (can n GPUs start now and stay free for
    the job's duration: backfilling) and suffix minima (from when on are n GPUs free for good).

    ``version`` changes with every release or reservation added (a number no other profile
    has had): what is derived from a profile's releases and reservations may be kept while
    its version is the same. ``backlog`` and ``busy_gs`` are plain fields, outside it.
    """

    __slots__ = ("times", "counts", "cum", "dirty", "res", "total", "backlog", "busy_gs", "version", "_ev", "_pre",
                 "_suf", "_built_for", "_memo", "_horizons")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []
        self.cum: list[int] = []
        self.dirty = True
        self.res: list[tuple[float, float, int]] = []   # (start, end, gpus)
        self.total = 0                                  # GPUs of this type in the cluster
        self.backlog = 0.0                              # GPU-seconds queued without a reservation
        self.busy_gs = 0.0                              # GPU-seconds running jobs still hold
        self._ev: list[float] = []
        self._pre: list[int] = []
        self._suf: list[int] = []
        self._built_for: tuple | None = None
        self._memo: dict[tuple[int, int], float] = {}
        self._horizons: dict[tuple[int, int], float] = {}
        self.version = next(_CHANGES)

    def set_releases(self, times: list[float], counts: list[int]) -> None:
        """The running jobs' predicted releases, sorted by time (replacing any)."""
        self.times, self.counts = times, counts
        self._changed()

    def add_release(self, t: float, n: int) -> None:
        i = bisect.bisect_right(self.times, t)
        self.times.insert(i, t)
        self.counts.insert(i, n)
        self._changed()

    def reserve(self, start: float, end: float, n: int) -> None:
        self.res.append((start, end, n))
        self._changed()

    def _changed(self) -> None:
        self.dirty = True
        self._built_for = None
        self._memo.clear()
        self._horizons.clear()
        self.version = next(_CHANGES)

    def _cumulative(self) -> list[int]:
        if self.dirty:
            self.cum = list(accumulate(self.counts))
            self.dirty = False
        return self.cum

    def _build(self, now: float, free_now: int) -> None:
        key = (now, free_now)
        if self._built_for == key:
            return
        events = list(zip(self.times, self.counts))
        for r0, r1, m in self.res:
            events.append((r0, -m))
            events.append((r1, m))
        events.sort(key=lambda e: (e[0], -e[1]))        # releases before reservations at a tie
        self._ev = [now] + [t for t, _ in events]
        free = list(accumulate([free_now] + [d for _, d in events]))
        self._pre = list(accumulate(free, min))
        self._suf = list(accumulate(reversed(free), min))[::-1]
        self._built_for = key

    def fits_now(self, n: int, dur: float, now: float, free_now: int) -> bool:
        """Can n GPUs start now and stay free for ``dur`` s without breaking a reservation?"""
        if free_now < n:
            return False
        if not self.res:
            return True
        self._build(now, free_now)
        j = bisect.bisect_left(self._ev, now + dur)       # events strictly inside the run
        return self._pre[max(0, j - 1)] >= n

    def horizon(self, n: int, now: float, free_now: int) -> float:
        """The latest end of a run of n GPUs started now that breaks no reservation:
        ``fits_now(n, dur, now, free_now)`` is ``now + dur <= horizon(n, now, free_now)``
        (inf without reservations; -inf when fewer than n GPUs are free)."""
        if free_now < n:
            return -INF
        if not self.res:
            return INF
        key = (n, free_now)
        hit = self._horizons.get(key)
        if hit is not None:
            return hit
        self._build(now, free_now)
        pre = self._pre                                   # non-increasing; pre[0] = free_now >= n
        k = bisect.bisect_left(pre, -n, key=lambda v: -v - 1)   # the first event leaving < n free
        h = self._horizons[key] = INF if k >= len(pre) else self._ev[k]
        return h

    def wait_start(self, n: int, now: float, free_now: int) -> float:
        """From when on n GPUs stay free for good (memoised until the profile changes)."""
        key = (n, free_now)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        if n > self.total:
            t = INF
        elif not self.res:
            if free_now >= n:
                t = now
            else:
                cum = self._cumulative()
                i = bisect.bisect_left(cum, n - free_now)
                t = INF if i >= len(cum) else max(now, self.times[i])
        else:
            self._build(now, free_now)
            i = bisect.bisect_left(self._suf, n)
            t = INF if i >= len(self._suf) else max(now, self._ev[i])
        self._memo[key] = t
        return t

    def earliest(self, n: int, dur: float, now: float, free_now: int) -> float:
        """The earliest start >= now at which n GPUs stay free for ``dur`` seconds (a start
        in a gap between reservations is found only for "now": backfilling)."""
        if self.fits_now(n, dur, now, free_now):
            return now
        return self.wait_start(n, now, free_now)


def expected_end(rj: RunningJob, now: float, cfg: Backfill) -> float:
    """When a run is expected to free its GPUs: its predicted end; an overdue run (slower than
    predicted) ends soon, but not now; an unknown end (NaN) is never counted on."""
    end = rj.expected_end_s
    if end != end:
        return INF
    if end <= now:
        return now + max(cfg.overdue_min_s, cfg.overdue_fraction * max(0.0, end - rj.start_s))
    return end


def build_profiles(state: ClusterState, now: float, node_type: dict[str, str], cfg: Backfill,
                   skip: set[str] = frozenset()) -> dict[str, Profile]:
    """One availability profile per GPU type from the running jobs' predicted ends."""
    profiles: dict[str, Profile] = {}
    for n in state.nodes:
        prof = profiles.get(n.gpu_type)
        if prof is None:
            prof = profiles[n.gpu_type] = Profile()
        prof.total += n.gpus
    releases: dict[str, list[tuple[float, int]]] = {}
    for rj in state.running:
        if not rj.placement or rj.job_id in skip:
            continue
        t = node_type.get(next(iter(rj.placement)), rj.plan.gpu_type if rj.plan else None)
        if t in profiles:
            releases.setdefault(t, []).append((expected_end(rj, now, cfg), placement_gpus(rj.placement)))
    for t, rel in releases.items():
        rel.sort()
        prof = profiles[t]
        prof.set_releases([x for x, _ in rel], [n for _, n in rel])
        # GPU-seconds the running jobs still hold: queued work starts only after them
        prof.busy_gs = sum(n * (x - now) for x, n in rel if x < INF)
    return profiles
