"""``frenzy``: our heterogeneity-aware assignment. One pass over the pending jobs per round,
no solver; per job O(plans x log running jobs).

1. Memory gate. A plan is *safe* when its predicted ``device_used_gib`` times (1 + headroom)
   plus a fixed margin fits the card; only when a job has no safe plan anywhere does it fall
   back to plans that fit with the margin alone (never to a plan that does not fit: a job that
   only fits 80 GB cards waits for them instead of dying of OOM on 24 GB cards).
2. Order. Shortest predicted remaining work first (GPU-seconds of the job's cheapest plan),
   divided by ``1 + wait / aging_s`` so waiting jobs climb and none starves.
3. Plan choice. For every candidate (GPU type, count) the earliest start is read off an
   availability profile per GPU type: the GPUs free now plus the predicted ends of running jobs
   (and of jobs started earlier in this round), minus reservations. The job takes the plan with
   the earliest predicted completion (start + duration); among plans within ``tolerance`` of
   it, the one using the fewest GPU-seconds (leaving GPUs to the jobs behind it). If that plan
   cannot start now, the job waits for it rather than starting now on something worse.
4. Backfill. Jobs that must wait get a reservation (the first ``max_reservations`` of them, in
   priority order), and later jobs start now only where they do not delay any reservation:
   conservative backfilling over the profile.
5. Placement. Fewest nodes, best fit (``FreeIndex.place_compact``); tensor-parallel groups
   inside one node.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from itertools import accumulate

from estimator.plan import Plan
from scheduler.placement import FreeIndex, gpu_memory_gib
from scheduler.types import ClusterState, Decision, JobRequest, Policy

INF = math.inf

# Named defaults (constructor arguments override them).
SAFETY_MARGIN_GIB = 0.5     # CUDA context jitter, allocator slack beyond the prediction
MEM_HEADROOM = 0.35         # predicted x 1.35 must fit: covers a +3 sigma estimator error at 10%
                            # lognormal error; Fujii et al. 2024 saw no OOM below 80% predicted use
AGING_S = 4 * 3600.0        # a job waiting this long has its work key halved
TOLERANCE = 0.10            # plans within 10% of the earliest completion count as equally fast
MAX_RESERVATIONS = 8        # head-of-line jobs that hold a reservation per round


@dataclass(slots=True)
class _Cand:
    plan: Plan
    gpu_type: str
    gpus: int
    step_s: float


class _Profile:
    """Availability of one GPU type over time: free now, predicted releases, reservations."""

    __slots__ = ("times", "counts", "cum", "dirty", "res", "total")

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []
        self.cum: list[int] = []
        self.dirty = True
        self.res: list[tuple[float, float, int]] = []   # (start, end, gpus)
        self.total = 0                                  # GPUs of this type in the cluster

    def add_release(self, t: float, n: int) -> None:
        i = bisect.bisect_right(self.times, t)
        self.times.insert(i, t)
        self.counts.insert(i, n)
        self.dirty = True

    def _cumulative(self) -> list[int]:
        if self.dirty:
            self.cum = list(accumulate(self.counts))
            self.dirty = False
        return self.cum

    def base(self, t: float, free_now: int) -> int:
        """GPUs free at time t, ignoring reservations (nondecreasing in t)."""
        i = bisect.bisect_right(self.times, t)
        return free_now + (self._cumulative()[i - 1] if i else 0)

    def fits(self, start: float, dur: float, n: int, free_now: int) -> bool:
        """Are n GPUs free throughout [start, start + dur), honouring reservations?"""
        end = start + dur
        checks = [start] + [r0 for r0, _, _ in self.res if start < r0 < end]
        for t in checks:
            reserved = sum(m for r0, r1, m in self.res if r0 <= t < r1)
            if self.base(t, free_now) - reserved < n:
                return False
        return True

    def earliest(self, n: int, dur: float, now: float, free_now: int) -> float:
        """The earliest start >= now at which n GPUs stay free for ``dur`` seconds."""
        if n > self.total:
            return INF
        if free_now >= n:
            t = now
        else:
            cum = self._cumulative()
            i = bisect.bisect_left(cum, n - free_now)
            if i >= len(cum):
                return INF
            t = max(now, self.times[i])
        if not self.res:
            return t
        candidates = sorted({t, *(x for x in self.times if x > t), *(r1 for _, r1, _ in self.res if r1 > t)})
        for c in candidates:
            if c == INF:
                break
            if self.fits(c, dur, n, free_now):
                return c
        return INF


class FrenzyPolicy(Policy):
    name = "frenzy"

    def __init__(self, *, safety_margin_gib: float = SAFETY_MARGIN_GIB, mem_headroom: float = MEM_HEADROOM,
                 aging_s: float = AGING_S, tolerance: float = TOLERANCE,
                 max_reservations: int = MAX_RESERVATIONS) -> None:
        self.safety_margin_gib = safety_margin_gib
        self.mem_headroom = mem_headroom
        self.aging_s = aging_s
        self.tolerance = tolerance
        self.max_reservations = max_reservations
        self._cache: dict[str, tuple[tuple, list[_Cand]]] = {}
        self._oom_frac: dict[str, float] = {}   # job -> predicted/capacity of a plan that OOMed
        self._oom_plans: dict[str, list[Plan]] = {}
        self._mem: dict[str, float] = {}        # gpu_type -> memory, from the last round's state

    # --- per-job candidates -------------------------------------------------------------
    def candidates(self, job: JobRequest, state: ClusterState) -> list[_Cand]:
        """The job's memory-safe plans, per GPU type only those a bigger count makes faster."""
        key = (id(job.plans), len(job.plans), job.restarts)
        hit = self._cache.get(job.job_id)
        if hit is not None and hit[0] == key:
            return hit[1]
        oom_frac = self._oom_frac.get(job.job_id, INF)
        chosen = self._gate(job.plans, state, oom_frac)
        if not chosen and oom_frac < INF:            # nothing roomier exists: try the rest anyway
            failed = self._oom_plans.get(job.job_id, ())
            chosen = self._gate([p for p in job.plans if p not in failed], state, INF)
        by_type: dict[str, list[Plan]] = {}
        for p in chosen:
            by_type.setdefault(p.gpu_type, []).append(p)
        cands: list[_Cand] = []
        for t, ps in by_type.items():
            ps.sort(key=lambda p: (p.gpus, p.step_time_s))
            best = INF
            for p in ps:                                  # Pareto: more GPUs only if faster
                if p.step_time_s < best - 1e-12:
                    cands.append(_Cand(p, t, p.gpus, p.step_time_s))
                    best = p.step_time_s
        self._cache[job.job_id] = (key, cands)
        return cands

    def _gate(self, plans: list[Plan], state: ClusterState, oom_frac: float) -> list[Plan]:
        safe, fallback = [], []
        for p in plans:
            mem = gpu_memory_gib(state, p.gpu_type)
            if p.device_used_gib / mem >= oom_frac:
                continue                                  # as tight as a plan that already OOMed
            if p.device_used_gib * (1.0 + self.mem_headroom) + self.safety_margin_gib <= mem:
                safe.append(p)
            elif p.device_used_gib + self.safety_margin_gib <= mem:
                fallback.append(p)
        return safe or fallback

    # --- the round ------------------------------------------------------------------------
    def schedule(self, pending: list[JobRequest], state: ClusterState, now: float) -> list[Decision]:
        idx = FreeIndex(state.nodes)
        self._mem.update(state.gpu_memory_gib or {})
        node_type = {n.node_id: n.gpu_type for n in state.nodes}
        profiles: dict[str, _Profile] = {}
        for n in state.nodes:
            profiles.setdefault(n.gpu_type, _Profile()).total += n.gpus
        for rj in state.running:
            if not rj.placement:
                continue
            t = node_type.get(next(iter(rj.placement)), rj.plan.gpu_type if rj.plan else None)
            prof = profiles.get(t)
            if prof is not None:
                end = rj.expected_end_s
                prof.add_release(max(end, now) if end == end else INF,   # NaN -> never
                                 sum(len(v) for v in rj.placement.values()))

        live = {j.job_id for j in pending}
        for jid in [k for k in self._cache if k not in live]:
            del self._cache[jid]

        # order: shortest remaining work first, with aging
        keyed = []
        for job in pending:
            cands = self.candidates(job, state)
            if not cands:
                continue
            work = min(c.gpus * c.step_s for c in cands) * max(job.steps_left, 0)
            wait = max(0.0, now - job.submit_s)
            keyed.append((work / (1.0 + wait / self.aging_s), job.submit_s, job.job_id, job, cands))
        keyed.sort(key=lambda k: k[:3])

        out: list[Decision] = []
        reservations = 0
        for _, _, _, job, cands in keyed:
            can_now = any(idx.total.get(c.gpu_type, 0) >= c.gpus for c in cands)
            if not can_now and reservations >= self.max_reservations:
                if not any(idx.total.values()):
                    break                 # nothing free and no reservations left: round is over
                continue
            steps = max(job.steps_left, 1)
            best = None                   # (relative completion, cand, start, duration)
            options = []
            for c in cands:
                prof = profiles.get(c.gpu_type)
                if prof is None:
                    continue
                dur = c.step_s * steps
                start = prof.earliest(c.gpus, dur, now, idx.total.get(c.gpu_type, 0))
                if start == INF:
                    continue
                rel = (start - now) + dur
                options.append((rel, c, start, dur))
                if best is None or rel < best[0]:
                    best = (rel, c, start, dur)
            if best is None:
                continue
            limit = best[0] * (1.0 + self.tolerance)
            pick = min((o for o in options if o[0] <= limit),
                       key=lambda o: (o[1].gpus * o[3], o[0], o[1].gpu_type))
            rel, c, start, dur = pick
            if start <= now:
                placement = idx.place_compact(c.gpu_type, c.gpus, c.plan.tp)
                if placement is not None:
                    idx.commit(placement)
                    profiles[c.gpu_type].add_release(now + dur, c.gpus)
                    out.append(Decision(job_id=job.job_id, plan=c.plan, placement=placement))
                    continue
                # enough GPUs but fragmented across nodes: wait like a blocked job
            if reservations < self.max_reservations:
                s = max(start, now)
                profiles[c.gpu_type].res.append((s, s + dur, c.gpus))
                reservations += 1
        return out

    def on_oom(self, job: JobRequest, plan: Plan) -> JobRequest:
        """The estimate was too low for this job: from now on only plans with more headroom
        than the one that failed (tighter ones would fail too; the error is per job)."""
        job.restarts += 1
        mem = gpu_memory_gib(ClusterState(nodes=[], gpu_memory_gib=self._mem), plan.gpu_type)
        if 0 < mem < INF:
            frac = plan.device_used_gib / mem
            self._oom_frac[job.job_id] = min(self._oom_frac.get(job.job_id, INF), frac)
        self._oom_plans.setdefault(job.job_id, []).append(plan)
        self._cache.pop(job.job_id, None)
        return job
