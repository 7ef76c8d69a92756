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
   cannot start now, the job waits for it rather than starting now on something worse. Plans
   must keep ``min_efficiency`` (90%) parallel efficiency vs the fewest GPUs of their type;
   when the cluster is lightly loaded (the waiting jobs' smallest plans need at most
   1 / ``idle_factor`` of the free GPUs), jobs instead take their fastest plan that can start
   now, down to ``idle_min_efficiency`` (70%): those GPUs would otherwise sit idle. Beyond its
   queue-efficient (90%) plan such a job takes at most one node or ``idle_share`` (half) of a
   type's free GPUs, whichever is more, so the next arrival of a burst still finds some.
4. Backfill. Jobs that must wait get a reservation (the first ``max_reservations`` of them, in
   priority order), and later jobs start now only where they do not delay any reservation:
   conservative backfilling over the profile.
5. Queued load. Beyond the reservations, a waiting job still adds its GPU-seconds to its GPU
   type's queue, and later jobs see that type's wait grow (running + queued work / GPUs): a
   burst spreads over the slower types instead of all waiting for the fastest one.
6. Preemption, sparingly. A job near the head of the queue that would wait more than 5 min
   may checkpoint-preempt runs with over 4x its remaining work (never in their first 5 min,
   at most twice per job) when that lets it start now: shortest-remaining-first where it pays.
   Failing that, it may shrink one running job onto fewer GPUs of its type (a checkpoint
   restart) when its predicted time saved is 1.5x what that job loses.
7. Elastic growth (Sia-like, but only when it pays). When no job is left waiting after the
   round, running jobs (longest remaining first) restart on a faster plan on the idle GPUs if
   their predicted remaining time, restart and checkpoint restore included, drops by >= 10%
   and >= 2 min; at most 16 times per job (growths and shrinks together). Growth may go down to
   40% parallel efficiency, 25% for runs with 30 min or more left (first starts: 70% when
   idle, 90% otherwise): GPUs nobody waits for cost nothing, and grown GPUs are lent (step 8).
8. Recall. After the round, each waiting job (wait > 1 min) may take back GPUs lent to a run
   beyond that run's 90%-efficiency plan, the run shrinking to a smaller plan of its menu (not
   below that one), when the waiter's predicted gain exceeds the run's loss. The loss counts
   only while the waiter runs (the run grows back afterwards) plus two restarts, and runs with
   less than 15 min left are left alone (they free their GPUs soon anyway).
9. Placement. Fewest nodes, best fit (``FreeIndex.place_compact``); tensor-parallel groups
   inside one node.

Live (the submit flow), preempt decisions (and so shrinks, recalls and growths) are not acted
on; the start that depended on them then meets a ledger conflict and re-plans, so nothing
breaks. Pass ``preemption=False`` (and ``recall=False``, ``grow=False``) to turn them off.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from itertools import accumulate

from estimator.plan import Plan
from scheduler.placement import FreeIndex, gpu_memory_gib, placement_gpus
from scheduler.restart import checkpoint_move_s
from scheduler.types import ClusterState, Decision, JobRequest, Policy

INF = math.inf

# Named defaults (constructor arguments override them).
SAFETY_MARGIN_GIB = 0.5     # CUDA context jitter, allocator slack beyond the prediction
MEM_HEADROOM = 0.35         # predicted x 1.35 must fit: covers a +3 sigma estimator error at 10%
                            # lognormal error; Fujii et al. 2024 saw no OOM below 80% predicted use
FALLBACK_SLACK = 0.05       # without safe plans: those within 5% of the job's roomiest one
AGING_S = 4 * 3600.0        # a job waiting this long has its work key halved
TOLERANCE = 0.10            # plans within 10% of the earliest completion count as equally fast
MAX_RESERVATIONS = 8        # head-of-line jobs that hold a reservation per round
OVERDUE_MIN_S = 300.0       # a running job past its predicted end is expected to need at least
OVERDUE_FRACTION = 0.2      # max(5 min, 20% of its predicted run time) more
MIN_EFFICIENCY = 0.9         # a bigger GPU count must keep >= 90% parallel efficiency vs the
                            # fewest GPUs of that type (wasting more is never worth it in a queue)
PREEMPT_MIN_WAIT_S = 300.0  # preempt only for a head job that would otherwise wait > 5 min
PREEMPT_RATIO = 4.0         # ... for GPUs held by jobs with > 4x its (duration + 5 min) left
PREEMPT_GRACE_S = 300.0     # never preempt a run in its first 5 min (restart costs, thrashing)
MAX_PREEMPTIONS_PER_JOB = 2
PREEMPT_HEADS = 4           # jobs at the head of the queue that may preempt, per round
IDLE_FACTOR = 2.0           # waiting jobs' fewest GPUs x this <= free GPUs: "lightly loaded"
IDLE_MIN_EFFICIENCY = 0.7   # ... when they would take idle GPUs: restarts onto faster plans, and
                            # the fastest plan when lightly loaded
IDLE_SHARE = 0.5            # ... on at most one node or this share of a type's free GPUs (beyond
                            # its 90% plan)
GROW_MIN_GAIN = 0.1         # restart a run on a faster plan only if its remaining time drops >= 10%
GROW_MIN_S = 120.0          # ... and by >= 2 min
MAX_GROWS_PER_JOB = 16      # (a re-size must pay for its restart: this only stops pathologies)
GROW_MIN_EFFICIENCY = 0.4   # ... onto plans down to 40% parallel efficiency: idle GPUs are free, and
                            # a job that grew wide shrinks back (a checkpoint restart) for waiters
GROW_LONG_S = 1800.0        # ... and runs with >= 30 min left down to 25%: their restarts (growing,
GROW_LONG_MIN_EFFICIENCY = 0.25   # recalled, growing back) are small against what width saves them
RECALL_MIN_WAIT_S = 60.0    # a waiter recalls lent GPUs only when it would wait > 1 min ...
RECALL_MIN_LEFT_S = 900.0   # ... from runs with >= 15 min left
GROW_MAX_PER_ROUND = 8
SHRINK_MIN_WAIT_S = 300.0   # shrink a run for a head job that would wait > 5 min ...
SHRINK_GRACE_S = 300.0      # ... never a run in its first 5 min ...
SHRINK_GAIN = 1.5           # ... and only when the waiter gains 1.5x what the shrunk run loses
SIMPLER_WITHIN = 0.01       # per GPU count, a simpler plan within 1% of the fastest is preferred
RESTART_S = 60.0            # launch + model build of a (re)start
CKPT_GBS = 2.0              # checkpoint write / read bandwidth per node spanned (GB/s)
LOOKAHEAD = 128             # jobs whose waiting choice is tracked (as queued load per GPU type);
                            # deeper jobs are only tried for an immediate start


@dataclass(slots=True)
class _Cand:
    plan: Plan
    gpu_type: str
    gpus: int
    step_s: float


class _Profile:
    """Availability of one GPU type over time: free now, predicted releases, reservations.

    Without reservations free GPUs only grow with time, so the earliest start for n GPUs is a
    bisection on the cumulative releases. With reservations the profile is rebuilt (lazily,
    O(releases) in C-level loops) into prefix minima (can n GPUs start now and stay free for
    the job's duration: backfilling) and suffix minima (from when on are n GPUs free for good).
    """

    __slots__ = ("times", "counts", "cum", "dirty", "res", "total", "backlog", "busy_gs", "_ev", "_pre", "_suf",
                 "_built_for", "_memo")

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

    def add_release(self, t: float, n: int) -> None:
        i = bisect.bisect_right(self.times, t)
        self.times.insert(i, t)
        self.counts.insert(i, n)
        self.dirty = True
        self._built_for = None
        self._memo.clear()

    def reserve(self, start: float, end: float, n: int) -> None:
        self.res.append((start, end, n))
        self._built_for = None
        self._memo.clear()

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


def _expected_end(rj, now: float) -> float:
    end = rj.expected_end_s
    if end != end:                                   # NaN: unknown, never counted on
        return INF
    if end <= now:
        # overdue (ran slower than predicted): it ends soon, but not now
        return now + max(OVERDUE_MIN_S, OVERDUE_FRACTION * max(0.0, end - rj.start_s))
    return end


def _base_gpu_s(menu: list[tuple]) -> dict[str, float]:
    """Per GPU type, GPU-seconds per step of the menu's fewest-GPU plan there (the reference of
    parallel efficiency)."""
    fewest: dict[str, tuple[int, float]] = {}
    for step_s, n, g, _ in menu:
        if g not in fewest or n < fewest[g][0]:
            fewest[g] = (n, n * step_s)
    return {g: v[1] for g, v in fewest.items()}


def _shrink_to_fit(idx: FreeIndex, run, run_cand: _Cand, job: JobRequest, cand: _Cand) -> list[Decision]:
    """Restart ``run`` on ``run_cand`` (fewer GPUs) and start ``job`` on ``cand`` in what that
    frees: the three decisions, or [] with ``idx`` unchanged when either does not place."""
    idx.release(run.placement)
    run_place = idx.place_compact(run_cand.gpu_type, run_cand.gpus, run_cand.plan.tp)
    if run_place is not None:
        idx.commit(run_place)
        place = idx.place_compact(cand.gpu_type, cand.gpus, cand.plan.tp)
        if place is not None:
            idx.commit(place)
            return [Decision(job_id=run.job_id, plan=None, placement={}, action="preempt"),
                    Decision(job_id=run.job_id, plan=run_cand.plan, placement=run_place),
                    Decision(job_id=job.job_id, plan=cand.plan, placement=place)]
        idx.release(run_place)
    idx.commit(run.placement)
    return []


def _complexity(p: Plan) -> tuple:
    """Fewer moving parts first: no model parallelism, no offload, lower ZeRO stage, no
    activation recomputation."""
    return (p.tp * p.pp * p.cp > 1, p.offload != "none", p.zero, p.act_ckpt != "none")


class FrenzyPolicy(Policy):
    name = "frenzy"
    grows_runs = True
    restarts_runs = True

    def __init__(self, *, safety_margin_gib: float = SAFETY_MARGIN_GIB, mem_headroom: float = MEM_HEADROOM,
                 aging_s: float = AGING_S, tolerance: float = TOLERANCE,
                 max_reservations: int = MAX_RESERVATIONS, lookahead: int = LOOKAHEAD,
                 min_efficiency: float = MIN_EFFICIENCY, preemption: bool = True,
                 preempt_min_wait_s: float = PREEMPT_MIN_WAIT_S, preempt_ratio: float = PREEMPT_RATIO,
                 preempt_grace_s: float = PREEMPT_GRACE_S,
                 max_preemptions_per_job: int = MAX_PREEMPTIONS_PER_JOB,
                 preempt_heads: int = PREEMPT_HEADS, idle_factor: float = IDLE_FACTOR,
                 idle_min_efficiency: float = IDLE_MIN_EFFICIENCY, idle_share: float = IDLE_SHARE,
                 grow: bool = True,
                 grow_min_gain: float = GROW_MIN_GAIN, grow_min_s: float = GROW_MIN_S,
                 grow_min_efficiency: float = GROW_MIN_EFFICIENCY, grow_long_s: float = GROW_LONG_S,
                 grow_long_min_efficiency: float = GROW_LONG_MIN_EFFICIENCY, recall: bool = True,
                 recall_min_wait_s: float = RECALL_MIN_WAIT_S, recall_min_left_s: float = RECALL_MIN_LEFT_S,
                 max_grows_per_job: int = MAX_GROWS_PER_JOB, grow_max_per_round: int = GROW_MAX_PER_ROUND,
                 restart_s: float = RESTART_S, ckpt_gbs: float = CKPT_GBS, shrink: bool = True,
                 shrink_min_wait_s: float = SHRINK_MIN_WAIT_S, shrink_grace_s: float = SHRINK_GRACE_S,
                 shrink_gain: float = SHRINK_GAIN) -> None:
        self.idle_factor = idle_factor
        self.idle_min_efficiency = idle_min_efficiency
        self.idle_share = idle_share
        self.shrink = shrink
        self.shrink_min_wait_s = shrink_min_wait_s
        self.shrink_grace_s = shrink_grace_s
        self.shrink_gain = shrink_gain
        self.grow = grow
        self.grow_min_gain = grow_min_gain
        self.grow_min_efficiency = grow_min_efficiency
        self.grow_long_s = grow_long_s
        self.grow_long_min_efficiency = grow_long_min_efficiency
        self.recall = recall
        self.recall_min_wait_s = recall_min_wait_s
        self.recall_min_left_s = recall_min_left_s
        self.grow_min_s = grow_min_s
        self.max_grows_per_job = max_grows_per_job
        self.grow_max_per_round = grow_max_per_round
        self.restart_s = restart_s
        self.ckpt_gbs = ckpt_gbs
        self._run_tuples: dict[str, list[tuple]] = {}   # running job -> its plan menu
        self._ckpt_gb: dict[str, float] = {}            # running job -> checkpoint size (GB)
        self._lent_above: dict[str, dict[str, int]] = {}  # running job -> per type, GPUs beyond
                                                          # which its GPUs are lent (its 90% plan)
        self._per_node: dict[str, int] = {}             # gpu_type -> GPUs per node
        self._grown: dict[str, int] = {}
        self.safety_margin_gib = safety_margin_gib
        self.mem_headroom = mem_headroom
        self.aging_s = aging_s
        self.tolerance = tolerance
        self.max_reservations = max_reservations
        self.lookahead = lookahead
        self.min_efficiency = min_efficiency
        self.trace: list[tuple] | None = None   # set to [] to record each round's choices
        self.preemption = preemption
        self.preempt_min_wait_s = preempt_min_wait_s
        self.preempt_ratio = preempt_ratio
        self.preempt_grace_s = preempt_grace_s
        self.max_preemptions_per_job = max_preemptions_per_job
        self.preempt_heads = preempt_heads
        self._preempted: dict[str, int] = {}    # job -> times preempted
        self._eligible: dict | None = None       # this round's preemptible runs per GPU type
        self._cache: dict[str, tuple[tuple, list[_Cand]]] = {}
        self._oom_frac: dict[str, float] = {}   # job -> predicted/capacity of a plan that OOMed
        self._oom_plans: dict[str, list[Plan]] = {}
        self._min_gpus: dict[str, list[tuple[str, int]]] = {}
        self._work: dict[str, float] = {}       # job -> GPU-seconds per step of its cheapest plan
        self._tuples: dict[str, list[tuple]] = {}   # job -> (step_s, gpus, gpu_type, cand), hot loop
        self._wide: dict[str, list[tuple]] = {}     # the same under the idle efficiency cap
        self._grow_menu: dict[str, list[tuple]] = {}   # ... and under the growth efficiency cap
        self._top: dict[str, dict[str, int]] = {}   # job -> per type, most GPUs of its 90% plans
        self._by_plans: dict[int, tuple] = {}   # id(plan list) -> (list, len, cands, mins, tops, work, wide, grow)
        self._mem_key: tuple = ()
        self._mem: dict[str, float] = {}        # gpu_type -> memory, from the last round's state

    # --- per-job candidates -------------------------------------------------------------
    def candidates(self, job: JobRequest, state: ClusterState) -> list[_Cand]:
        """The job's memory-safe plans, per GPU type only those a bigger count makes faster,
        fastest first. Cached per job, and per plan list (jobs of one shape share it)."""
        key = (id(job.plans), len(job.plans), job.restarts)
        hit = self._cache.get(job.job_id)
        if hit is not None and hit[0] == key:
            return hit[1]
        oom_frac = self._oom_frac.get(job.job_id, INF)
        shared = None
        if oom_frac == INF:
            shared = self._by_plans.get(id(job.plans))
            if shared is not None and (shared[0] is not job.plans or shared[1] != len(job.plans)):
                shared = None
        if shared is not None:
            cands, mins, tops, work, wide, grow = shared[2:]
        else:
            cands, mins, tops, work, wide, grow = self._build_candidates(job, state, oom_frac)
            if oom_frac == INF:
                self._by_plans[id(job.plans)] = (job.plans, len(job.plans), cands, mins, tops, work, wide, grow)
        self._min_gpus[job.job_id] = mins
        self._top[job.job_id] = tops
        self._work[job.job_id] = work
        self._tuples[job.job_id] = [(c.step_s, c.gpus, c.gpu_type, c) for c in cands]
        self._wide[job.job_id] = wide
        self._grow_menu[job.job_id] = grow
        self._cache[job.job_id] = (key, cands)
        return cands

    def _build_candidates(self, job: JobRequest, state: ClusterState, oom_frac: float):
        chosen = self._gate(job.plans, state, oom_frac)
        if not chosen and oom_frac < INF:            # nothing roomier exists: try the rest anyway
            failed = self._oom_plans.get(job.job_id, ())
            chosen = self._gate([p for p in job.plans if p not in failed], state, INF)
        by_type: dict[str, list[Plan]] = {}
        for p in chosen:
            by_type.setdefault(p.gpu_type, []).append(p)
        for ps in by_type.values():
            ps.sort(key=lambda p: (p.gpus, p.step_time_s))
        cands, wide, grow = self._pareto(by_type, (self.min_efficiency, self.idle_min_efficiency,
                                                   min(self.grow_min_efficiency, self.grow_long_min_efficiency)))
        mins: dict[str, int] = {}
        tops: dict[str, int] = {}                     # most GPUs of a 90%-efficiency plan per type
        for c in cands:
            mins[c.gpu_type] = min(mins.get(c.gpu_type, c.gpus), c.gpus)
            tops[c.gpu_type] = max(tops.get(c.gpu_type, 0), c.gpus)
        work = min((c.gpus * c.step_s for c in cands), default=INF)
        return (cands, list(mins.items()), tops, work, [(c.step_s, c.gpus, c.gpu_type, c) for c in wide],
                [(c.step_s, c.gpus, c.gpu_type, c) for c in grow])

    @staticmethod
    def _pareto(by_type: dict[str, list[Plan]], floors: tuple[float, ...]) -> list[list[_Cand]]:
        """Per GPU type the plans a bigger count makes faster, while parallel efficiency vs the
        fewest GPUs of that type stays >= the floor; one list per floor, fastest first (one
        pass: each list is a per-type prefix of the list at the lowest floor)."""
        lowest = min(floors)
        out: list[list[_Cand]] = [[] for _ in floors]
        for t, ps in by_type.items():
            best = INF
            base_gpu_s = None                             # GPU-seconds per step at the fewest GPUs
            open_ = [True] * len(floors)                  # a floor's chain ends at its first miss
            last_n = 0
            for i, p in enumerate(ps):                    # Pareto: more GPUs only if faster
                if p.gpus != last_n and p.step_time_s < best - 1e-12:
                    # one plan per count: the simplest within SIMPLER_WITHIN of its fastest one
                    # (a 0.2% predicted edge is noise in the throughput model)
                    last_n = p.gpus
                    j = i + 1
                    near = p.step_time_s * (1.0 + SIMPLER_WITHIN)
                    while j < len(ps) and ps[j].gpus == p.gpus and ps[j].step_time_s <= near:
                        if ps[j].step_time_s < best - 1e-12 and _complexity(ps[j]) < _complexity(p):
                            p = ps[j]
                        j += 1
                    gpu_s = p.gpus * p.step_time_s
                    if base_gpu_s is None:
                        base_gpu_s = gpu_s
                    elif base_gpu_s < lowest * gpu_s:
                        break                             # more GPUs than any speed-up is worth
                    c = _Cand(p, t, p.gpus, p.step_time_s)
                    for k, f in enumerate(floors):
                        if open_[k] and base_gpu_s >= f * gpu_s:
                            out[k].append(c)
                        else:
                            open_[k] = False
                    best = p.step_time_s
        for cands in out:
            cands.sort(key=lambda c: (c.step_s, c.gpus))
        return out

    def _gate(self, plans: list[Plan], state: ClusterState, oom_frac: float) -> list[Plan]:
        safe, fallback = [], []
        mems: dict[str, float] = {}
        for p in plans:
            mem = mems.get(p.gpu_type)
            if mem is None:
                mem = mems[p.gpu_type] = gpu_memory_gib(state, p.gpu_type)
            if p.device_used_gib / mem >= oom_frac:
                continue                                  # as tight as a plan that already OOMed
            if p.device_used_gib * (1.0 + self.mem_headroom) + self.safety_margin_gib <= mem:
                safe.append(p)
            elif p.device_used_gib + self.safety_margin_gib <= mem:
                fallback.append((p.device_used_gib / mem, p))
        if safe or not fallback:
            return safe
        # no plan with headroom anywhere: only the roomiest ones (least likely to OOM)
        least = min(r for r, _ in fallback)
        return [p for r, p in fallback if r <= least + FALLBACK_SLACK]

    # --- the round ------------------------------------------------------------------------
    @staticmethod
    def _profiles(state: ClusterState, now: float, node_type: dict[str, str],
                  skip: set[str] = frozenset()) -> dict[str, _Profile]:
        """One availability profile per GPU type from the running jobs' predicted ends."""
        profiles: dict[str, _Profile] = {}
        for n in state.nodes:
            profiles.setdefault(n.gpu_type, _Profile()).total += n.gpus
        releases: dict[str, list[tuple[float, int]]] = {}
        for rj in state.running:
            if not rj.placement or rj.job_id in skip:
                continue
            t = node_type.get(next(iter(rj.placement)), rj.plan.gpu_type if rj.plan else None)
            if t in profiles:
                releases.setdefault(t, []).append((_expected_end(rj, now), placement_gpus(rj.placement)))
        for t, rel in releases.items():
            rel.sort()
            prof = profiles[t]
            prof.times = [x for x, _ in rel]
            prof.counts = [n for _, n in rel]
            # GPU-seconds the running jobs still hold: queued work starts only after them
            prof.busy_gs = sum(n * (x - now) for x, n in rel if x < INF)
        return profiles

    def _choose(self, tuples: list[tuple], steps: int, profiles: dict[str, _Profile], total: dict[str, int],
                now: float, deep: bool = False, fastest: bool = False):
        """(candidate, start, duration) with the earliest predicted completion (within the
        tolerance: the fewest GPU-seconds), or None. ``deep``: give up as soon as waiting
        clearly beats the fastest immediate start (such a job does nothing this round)."""
        tol1 = 1.0 + self.tolerance
        best_rel = lim = INF
        options = []                      # (relative completion, GPU-seconds, cand, start, duration)
        for step_s, n, g, c in tuples:    # fastest first
            dur = step_s * steps
            if dur > lim:
                break                     # even starting now this plan is not within tolerance
            prof = profiles.get(g)
            if prof is None:
                continue
            f = total.get(g, 0)
            if f >= n and (not prof.res or prof.fits_now(n, dur, now, f)):
                start = now
                rel = dur
            else:
                start = prof.wait_start(n, now, f)
                if start == INF:
                    continue
                if start <= now:
                    start = now + 1.0     # not placeable this instant (a release due now)
                if prof.backlog:          # jobs ahead already queue for this type (fluid estimate:
                    # the type's GPUs first finish the running work, then the queued work)
                    queued = now + (prof.busy_gs + prof.backlog) / prof.total
                    if queued > start:
                        start = queued
                rel = start - now + dur
            options.append((rel, n * dur, c, start, dur))
            if rel < best_rel:
                best_rel = rel
                lim = rel * tol1
        if not options or (deep and all(o[3] > now for o in options)):
            return None
        pick = None
        if fastest:                       # idle GPUs: nothing to leave them to, finish soonest
            for o in options:
                if o[3] <= now and (pick is None or o[0] < pick[0] or (o[0] == pick[0] and o[1] < pick[1])):
                    pick = o
            if pick is not None and pick[0] <= lim:
                return pick[2], pick[3], pick[4]
            pick = None
        for o in options:
            if o[0] <= lim and (pick is None or o[1] < pick[1] or (o[1] == pick[1] and o[0] < pick[0])):
                pick = o
        return pick[2], pick[3], pick[4]

    def _preempt_for(self, job: JobRequest, choice, state: ClusterState, idx: FreeIndex, now: float,
                     node_type: dict[str, str], skip: set[str]) -> tuple[list[Decision], set[str], tuple | None]:
        """Shortest-remaining-first with preemption, sparingly: when a job near the head of the
        queue would wait long while jobs with far more remaining work hold GPUs it could use,
        checkpoint-preempt them (the longest first) so it starts now, on whichever GPU type
        completes it soonest. Returns (decisions: preempts + its start, preempted ids, the
        (cand, start, duration) it got), or ([], set(), None) when not worth it."""
        _, start, dur = choice
        wait_rel = start - now + dur
        if start - now < self.preempt_min_wait_s:
            return [], set(), None
        best = None                                  # (duration, cand, victims)
        eligible = self._eligible
        if eligible is None:                         # once per round: victims by type, longest first
            eligible = {}
            for rj in state.running:
                if (not rj.placement or now - rj.start_s < self.preempt_grace_s
                        or self._preempted.get(rj.job_id, 0) >= self.max_preemptions_per_job):
                    continue
                remaining = _expected_end(rj, now) - now
                if remaining == INF:
                    continue                         # unknown end (live run without a step count)
                g = node_type.get(next(iter(rj.placement)), "")
                eligible.setdefault(g, []).append((remaining, rj))
            for v in eligible.values():
                v.sort(key=lambda x: -x[0])
            self._eligible = eligible
        if not eligible:
            return [], set(), None
        steps = max(job.steps_left, 1)
        for step_s, n, g, c in self._tuples[job.job_id]:
            d = step_s * steps
            if d * (1.0 + self.tolerance) + self.preempt_min_wait_s > wait_rel or (best and d >= best[0]):
                continue                             # not clearly better than waiting
            need = self.preempt_ratio * (d + self.preempt_min_wait_s)
            chosen, freed = [], idx.free_gpus(g)
            for remaining, rj in eligible.get(g, ()):
                if freed >= n or remaining <= need:
                    break
                if rj.job_id in skip:
                    continue
                chosen.append(rj)
                freed += placement_gpus(rj.placement)
            if freed >= n and chosen:
                best = (d, c, chosen)
        if best is None:
            return [], set(), None
        d, c, chosen = best
        for rj in chosen:
            idx.release(rj.placement)
        placement = idx.place_compact(c.gpu_type, c.gpus, c.plan.tp)
        if placement is None:
            for rj in chosen:
                idx.commit(rj.placement)
            return [], set(), None
        idx.commit(placement)
        out = [Decision(job_id=rj.job_id, plan=None, placement={}, action="preempt") for rj in chosen]
        for rj in chosen:
            self._preempted[rj.job_id] = self._preempted.get(rj.job_id, 0) + 1
        out.append(Decision(job_id=job.job_id, plan=c.plan, placement=placement))
        return out, {rj.job_id for rj in chosen}, (c, now, d)

    def schedule(self, pending: list[JobRequest], state: ClusterState, now: float) -> list[Decision]:
        idx = FreeIndex(state.nodes)
        self._mem.update(state.gpu_memory_gib or {})
        mem_key = tuple(sorted((state.gpu_memory_gib or {}).items()))
        if mem_key != self._mem_key:          # another cluster: the memory gate changes
            self._mem_key = mem_key
            self._by_plans.clear()
            self._cache.clear()
        node_type = {n.node_id: n.gpu_type for n in state.nodes}
        for n in state.nodes:
            if self._per_node.get(n.gpu_type, 0) < n.gpus:
                self._per_node[n.gpu_type] = n.gpus
        profiles = self._profiles(state, now, node_type)

        live = {j.job_id for j in pending}
        for jid in [k for k in self._cache if k not in live]:
            del self._cache[jid]
            self._min_gpus.pop(jid, None)
            self._work.pop(jid, None)
            self._tuples.pop(jid, None)
            self._wide.pop(jid, None)
            self._grow_menu.pop(jid, None)
            self._top.pop(jid, None)
        if len(self._by_plans) > 2 * len(pending) + 256:   # live: plan lists of finished jobs
            keep = {id(j.plans) for j in pending}
            self._by_plans = {k: v for k, v in self._by_plans.items() if k in keep}

        # order: shortest remaining work first, with aging
        keyed = []
        for job in pending:
            cands = self.candidates(job, state)
            if not cands:
                continue
            work = self._work[job.job_id] * max(job.steps_left, 0)
            wait = max(0.0, now - job.submit_s)
            keyed.append((work / (1.0 + wait / self.aging_s), job.submit_s, job.job_id, job, cands))
        keyed.sort(key=lambda k: k[:3])

        out: list[Decision] = []
        reservations = 0
        total = idx.total
        all_keyed = keyed                 # jobs started by preemption leave ``keyed`` below
        if self.preemption and keyed:
            self._eligible = None
            preempted: set[str] = set()
            started: set[str] = set()
            ends: dict[str, float] = {}           # predicted end of each start decided so far
            for _, _, _, head, _ in keyed[:self.preempt_heads]:
                choice = self._choose(self._tuples[head.job_id], max(head.steps_left, 1), profiles, total, now)
                if choice is None or choice[1] <= now:
                    continue
                pre, victims, got = self._preempt_for(head, choice, state, idx, now, node_type, preempted)
                if not pre and self.shrink:
                    pre, victims, got = self._shrink_for(head, choice, state, idx, now, node_type,
                                                         preempted, ends)
                if pre:
                    out.extend(pre)
                    preempted |= victims
                    started.add(head.job_id)
                    ends[head.job_id] = now + got[2]
                    profiles = self._profiles(state, now, node_type, skip=preempted)
                    for d in out:
                        if d.action == "start":
                            profiles[d.plan.gpu_type].add_release(ends[d.job_id], d.plan.gpus)
            if started:
                keyed = [k for k in keyed if k[3].job_id not in started]
        depth = 0
        lookahead = self.lookahead
        # lightly loaded: every waiting job's smallest plan fits the free GPUs several times over,
        # so GPUs would sit idle; jobs then take their fastest immediate plan, not the cheapest
        fastest = False
        if self.idle_factor > 0:
            free_all = sum(total.values())
            need = sum(min((n for _, n in self._min_gpus[k[3].job_id]), default=0) for k in keyed)
            fastest = need * self.idle_factor <= free_all
        waiting: list[tuple[JobRequest, float, float]] = []   # (job, start, duration) not started
        for _, _, _, job, cands in keyed:
            depth += 1
            if reservations >= self.max_reservations:
                if not any(total.values()):
                    break                 # nothing free and no reservations left: round is over
                if depth > lookahead and not any(total.get(t, 0) >= n for t, n in self._min_gpus[job.job_id]):
                    continue              # deep in the queue and nothing it could start now
            deep = depth > lookahead and reservations >= self.max_reservations
            tuples = self._idle_menu(job.job_id, total) if fastest else self._tuples[job.job_id]
            choice = self._choose(tuples, max(job.steps_left, 1), profiles, total, now, deep, fastest)
            if choice is None:
                continue
            c, start, dur = choice
            if self.trace is not None:    # why each job got what it got (debugging, reports)
                self.trace.append((job.job_id, c.gpu_type, c.gpus, start - now, dur, depth))
            if start <= now:
                placement = idx.place_compact(c.gpu_type, c.gpus, c.plan.tp)
                if placement is not None:
                    idx.commit(placement)
                    profiles[c.gpu_type].add_release(now + dur, c.gpus)
                    out.append(Decision(job_id=job.job_id, plan=c.plan, placement=placement))
                    continue
                # enough GPUs but fragmented across nodes: wait like a blocked job
            if self.recall and len(waiting) < lookahead:
                waiting.append((job, start, dur))
            if reservations < self.max_reservations:
                s0 = max(start, now)
                profiles[c.gpu_type].reserve(s0, s0 + dur, c.gpus)
                reservations += 1
            else:
                # no exact reservation left: the job still queues for this type, so later
                # jobs see that type as busier (their waits grow by its GPU-seconds / capacity)
                profiles[c.gpu_type].backlog += c.gpus * dur
        if waiting:
            out.extend(self._recall(waiting, state, idx, now, node_type, {d.job_id for d in out}))
        if self.grow:
            touched = {d.job_id for d in out}
            self._remember_runs(state, all_keyed, touched)
            if all(k[3].job_id in touched for k in keyed):     # nothing waits
                out.extend(self._grow_runs(state, idx, now, touched))
        return out

    def _idle_menu(self, job_id: str, free: dict[str, int]) -> list[tuple]:
        """The job's idle-GPU plans (down to ``idle_min_efficiency``) within its 90%-efficiency
        plans, one node, or ``idle_share`` of a type's free GPUs, whichever is most. Without the
        share, the first jobs of a burst arriving at an idle cluster took whole types at 70%
        efficiency and the rest of the burst queued behind them (1,024-GPU cluster, 3 seeds:
        against Sia itp05 +4.6% -> +3.1%, itp01 +9.7% -> +9.1%, itp03 +0.1% -> -0.4%)."""
        if self.idle_share >= 1:
            return self._wide[job_id]
        top = self._top[job_id]
        return [t for t in self._wide[job_id]
                if t[1] <= max(top.get(t[2], 0), self._per_node.get(t[2], 0), self.idle_share * free.get(t[2], 0))]

    def _remember_runs(self, state: ClusterState, keyed: list, touched: set[str]) -> None:
        """Keep the plan menu of the jobs starting now (a running job's request is gone), and
        forget jobs that no longer run."""
        for k in keyed:
            jid = k[3].job_id
            if jid in touched:
                self._run_tuples[jid] = self._grow_menu[jid]
                self._lent_above[jid] = self._top[jid]
                # checkpoint size; unknown (0): at most the 1-GPU-equivalent footprint of the
                # job's smallest plan (pessimistic)
                self._ckpt_gb[jid] = k[3].checkpoint_gb or 1.074 * min(
                    (c.gpus * c.plan.device_used_gib for c in k[4]), default=0.0)
        if len(self._run_tuples) > len(state.running) + len(touched) + 64:
            alive = {rj.job_id for rj in state.running} | touched
            self._run_tuples = {j: v for j, v in self._run_tuples.items() if j in alive}
            self._ckpt_gb = {j: v for j, v in self._ckpt_gb.items() if j in alive}
            self._lent_above = {j: v for j, v in self._lent_above.items() if j in alive}

    def _restart_cost(self, job_id: str, gpu_type: str, gpus: int) -> float:
        """Predicted cost of restarting a run on ``gpus`` GPUs of ``gpu_type``: launch plus its
        checkpoint's save and restore over the nodes a compact placement spans (the formula the
        simulator charges)."""
        nodes = -(-gpus // max(1, self._per_node.get(gpu_type, 1)))
        return self.restart_s + checkpoint_move_s(self._ckpt_gb.get(job_id, 0.0), nodes, self.ckpt_gbs)

    def _recall(self, waiting: list[tuple], state: ClusterState, idx: FreeIndex, now: float,
                node_type: dict[str, str], touched: set[str]) -> list[Decision]:
        """Jobs still wait after the round while runs hold GPUs lent to them beyond their
        90%-efficiency plan (idle starts, growth): shrink such a run to a smaller plan of its
        menu, not below that plan, so a waiter starts now, when the waiter's predicted gain
        beats the run's loss. The run is expected to grow back once the waiter is done, so the
        loss is its slowdown while the waiter runs plus two restarts (or its whole predicted
        loss, if smaller). Each run gives GPUs back at most once per round."""
        lent: dict[str, list] = {}
        for rj in state.running:
            above = self._lent_above.get(rj.job_id)
            if above is None or not rj.placement or rj.job_id in touched:
                continue
            g = node_type.get(next(iter(rj.placement)), "")
            if rj.plan.gpus > above.get(g, 0) and _expected_end(rj, now) - now >= self.recall_min_left_s:
                lent.setdefault(g, []).append(rj)
        out: list[Decision] = []
        if not lent:
            return out
        recalled: set[str] = set()
        for job, start, dur in waiting:
            if start - now < self.recall_min_wait_s:
                continue
            wait_rel = start - now + dur
            steps = max(job.steps_left, 1)
            best = None                               # (net gain, waiter cand, run, run's cand)
            for step_s, n, g, c in self._tuples[job.job_id]:
                gain = wait_rel - step_s * steps
                if gain <= 0:
                    continue
                free = idx.free_gpus(g)
                for rj in lent.get(g, ()):
                    m, floor = rj.plan.gpus, self._lent_above[rj.job_id].get(g, 0)
                    if rj.job_id in recalled or free + m - floor < n:
                        continue
                    rem = _expected_end(rj, now) - now
                    ready = max(0.0, rj.start_s + self.restart_s - now)
                    vsteps = max(1.0, (rem - ready) / max(rj.plan.step_time_s, 1e-9))
                    for vstep, vn, vg, vc in self._run_tuples[rj.job_id]:    # fastest first
                        if vg != g or vn >= m or vn < floor or vn + n > free + m:
                            continue
                        cost = self._restart_cost(rj.job_id, vg, vn)
                        loss = min(vstep * vsteps + cost - rem,
                                   step_s * steps * (1.0 - rj.plan.step_time_s / vstep) + 2.0 * cost)
                        if gain > loss and (best is None or gain - loss > best[0]):
                            best = (gain - loss, c, rj, vc)
                        break
            if best is None:
                continue
            _, c, rj, vc = best
            moved = _shrink_to_fit(idx, rj, vc, job, c)
            if moved:
                recalled.add(rj.job_id)
                out += moved
        return out

    def _shrink_for(self, job: JobRequest, choice, state: ClusterState, idx: FreeIndex, now: float,
                    node_type: dict[str, str], skip: set[str], ends: dict[str, float]):
        """A job near the head would wait: restart one running job of a type on fewer GPUs of
        that type (a checkpoint restart, as Sia's re-sizing) when that lets the waiter start now
        and the waiter's predicted time saved exceeds the running job's predicted time lost
        (restart and restore included) by ``shrink_gain``. Returns like ``_preempt_for``."""
        _, start, dur = choice
        wait_rel = start - now + dur
        if start - now < self.shrink_min_wait_s:
            return [], set(), None
        steps = max(job.steps_left, 1)
        best = None                                   # (net gain, cand, d, victim, vcand, vdur)
        for rj in state.running:
            vt = self._run_tuples.get(rj.job_id)
            if (vt is None or not rj.placement or rj.job_id in skip or now - rj.start_s < self.shrink_grace_s
                    or self._grown.get(rj.job_id, 0) >= self.max_grows_per_job):
                continue
            rem = _expected_end(rj, now) - now
            if rem == INF:
                continue
            g = node_type.get(next(iter(rj.placement)), "")
            m = rj.plan.gpus
            free = idx.free_gpus(g)
            vsteps = max(1.0, (rem - max(0.0, rj.start_s + self.restart_s - now)) / max(rj.plan.step_time_s, 1e-9))
            for step_s, n, tg, c in self._tuples[job.job_id]:
                if tg != g or n > free + m - 1:
                    continue
                d = step_s * steps
                gain = wait_rel - d
                if gain <= 0:
                    continue
                for vstep, vn, vg, vc in vt:             # the victim's fastest plan that leaves n free
                    if vg != g or vn >= m or vn + n > free + m:
                        continue
                    vdur = vstep * vsteps + self._restart_cost(rj.job_id, vg, vn)
                    net = gain - self.shrink_gain * (vdur - rem)
                    if net > 0 and (best is None or net > best[0]):
                        best = (net, c, d, rj, vc, vdur)
                    break
        if best is None:
            return [], set(), None
        _, c, d, rj, vc, vdur = best
        moved = _shrink_to_fit(idx, rj, vc, job, c)
        if not moved:
            return [], set(), None
        self._grown[rj.job_id] = self._grown.get(rj.job_id, 0) + 1
        ends[rj.job_id] = now + vdur
        return moved, {rj.job_id}, (c, now, d)

    def _grow_runs(self, state: ClusterState, idx: FreeIndex, now: float, touched: set[str]) -> list[Decision]:
        """Nothing waits and GPUs sit idle: checkpoint-restart running jobs (the longest
        remaining first) on a faster plan when the predicted remaining time, restart and
        checkpoint restore included, drops by at least ``grow_min_gain`` of it (and 2 min)."""
        out: list[Decision] = []
        if not any(idx.total.values()):
            return out
        runs = []
        for rj in state.running:
            tuples = self._run_tuples.get(rj.job_id)
            if (tuples is None or not rj.placement or rj.job_id in touched
                    or self._grown.get(rj.job_id, 0) >= self.max_grows_per_job):
                continue
            rem = _expected_end(rj, now) - now
            if rem == INF or rem < self.grow_min_s:
                continue
            runs.append((rem, rj, tuples))
        runs.sort(key=lambda x: -x[0])
        for rem, rj, tuples in runs[:self.grow_max_per_round]:
            ready = rj.start_s + self.restart_s
            steps = max(1.0, (rem - max(0.0, ready - now)) / max(rj.plan.step_time_s, 1e-9))
            target = rem - max(self.grow_min_gain * rem, self.grow_min_s)
            floor = self.grow_long_min_efficiency if rem >= self.grow_long_s else self.grow_min_efficiency
            base = _base_gpu_s(tuples)
            idx.release(rj.placement)
            placed = None
            for step_s, n, g, c in tuples:                # fastest first
                dur = step_s * steps + self._restart_cost(rj.job_id, g, n)
                if dur > target:
                    continue
                if idx.free_gpus(g) < n or c.plan == rj.plan or base[g] < floor * n * step_s:
                    continue
                placed = idx.place_compact(g, n, c.plan.tp)
                if placed is not None:
                    break
            if placed is None:
                idx.commit(rj.placement)
                continue
            idx.commit(placed)
            self._grown[rj.job_id] = self._grown.get(rj.job_id, 0) + 1
            out.append(Decision(job_id=rj.job_id, plan=None, placement={}, action="preempt"))
            out.append(Decision(job_id=rj.job_id, plan=c.plan, placement=placed))
            if not any(idx.total.values()):
                break
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
