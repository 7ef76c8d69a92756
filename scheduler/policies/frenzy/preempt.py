"""Step 6: a head-of-queue job that would wait long preempts or shrinks runs, sparingly."""
from __future__ import annotations

import math

from scheduler.placement import FreeIndex, placement_gpus
from scheduler.types import ClusterState, Decision, JobRequest

from .choose import choose
from .config import FrenzyConfig
from .profile import Profile, expected_end
from .records import Cand, GpuCounts, Menu, Pick, Run, Waiter
from .resize import restart_cost, shrink_to_fit, steps_left

INF = math.inf
Eligible = dict[str, list[tuple[float, object, float]]]   # gpu_type -> (remaining s, RunningJob, ratio):
                                                          # movers first, then longest remaining first
Shrinkable = list[tuple[Run, float, float]]         # (run, remaining s, remaining steps), runs order
Got = tuple[list[Decision], set[str], Pick | None]  # decisions, runs stopped, what the job got
NOTHING: Got = ([], set(), None)


def preemptible(state: ClusterState, now: float, node_type: dict[str, str], cfg: FrenzyConfig,
                first: set[str] = frozenset()) -> Eligible:
    """Runs a waiter may preempt, per GPU type, longest remaining first: past their grace
    period, preempted fewer than ``max_per_job`` times (``JobRequest.preemptions``), with a
    known end. ``first`` (``Stopgap.yield_first``): runs listed before the others, preemptible
    for any waiter with less work than they have left (ratio 1)."""
    eligible: Eligible = {}
    for rj in state.running:
        times = rj.request.preemptions if rj.request is not None else 0
        if not rj.placement or now - rj.start_s < cfg.preempt.grace_s or times >= cfg.preempt.max_per_job:
            continue
        remaining = expected_end(rj, now, cfg.backfill) - now
        if remaining == INF:
            continue                         # unknown end (live run without a step count)
        g = node_type.get(next(iter(rj.placement)), "")
        mover = rj.job_id in first
        eligible.setdefault(g, []).append((remaining, rj, min(1.0, cfg.preempt.ratio) if mover else cfg.preempt.ratio))
    for v in eligible.values():
        v.sort(key=lambda x: (x[2], -x[0]))
    return eligible


def preempt_for(job: JobRequest, menu: Menu, pick: Pick, eligible: Eligible, idx: FreeIndex, now: float,
                cfg: FrenzyConfig, skip: set[str]) -> Got:
    """Shortest-remaining-first with preemption, sparingly: when a job near the head of the
    queue would wait long while runs with far more remaining work (``ratio`` x) hold GPUs it
    could use, checkpoint-preempt them (the longest first) so it starts now, on whichever GPU
    type completes it soonest."""
    pc = cfg.preempt
    wait_rel = pick.start - now + pick.dur
    if pick.start - now < pc.min_wait_s or not eligible:
        return NOTHING
    best = None                                  # (duration, cand, victims)
    steps = max(job.steps_left, 1)
    for c in menu.queue:
        d = c.step_s * steps
        if d * (1.0 + cfg.choice.tolerance) + pc.min_wait_s > wait_rel or (best and d >= best[0]):
            continue                             # not clearly better than waiting
        need = d + pc.min_wait_s
        chosen, freed = [], idx.free_gpus(c.gpu_type)
        for remaining, rj, ratio in eligible.get(c.gpu_type, ()):
            if freed >= c.gpus:
                break
            if remaining <= ratio * need:
                if ratio < pc.ratio:
                    continue                     # a mover too close to its end: the others next
                break                            # longest first: the rest have less left
            if rj.job_id in skip:
                continue
            chosen.append(rj)
            freed += placement_gpus(rj.placement)
        if freed >= c.gpus and chosen:
            best = (d, c, chosen)
    if best is None:
        return NOTHING
    d, c, chosen = best
    for rj in chosen:
        idx.release(rj.placement)
    placement = idx.place_compact(c.gpu_type, c.gpus, c.plan.tp)
    if placement is None:
        for rj in chosen:
            idx.commit(rj.placement)
        return NOTHING
    idx.commit(placement)
    why = f"preempted for {job.job_id}"
    out = [Decision(job_id=rj.job_id, plan=None, placement={}, action="preempt", reason=why) for rj in chosen]
    out.append(Decision(job_id=job.job_id, plan=c.plan, placement=placement, reason="start after preemption"))
    return out, {rj.job_id for rj in chosen}, Pick(c, now, d)


def shrinkable(runs: dict[str, Run], now: float, cfg: FrenzyConfig) -> Shrinkable:
    """Runs a waiter may shrink, in ``runs`` order: placed, past the shrink grace period, under
    the re-size cap, with a known end; each with its remaining seconds and steps (what
    ``shrink_for`` reads of a run does not depend on the waiter: computed once a round)."""
    sc = cfg.shrink
    out = []
    for run in runs.values():
        rj = run.rj
        if not rj.placement or now - rj.start_s < sc.grace_s or rj.resizes >= cfg.growth.max_resizes_per_job:
            continue
        rem = expected_end(rj, now, cfg.backfill) - now
        if rem == INF:
            continue
        out.append((run, rem, steps_left(run, rem, now, cfg.restart.launch_s)))
    return out


def shrink_for(job: JobRequest, menu: Menu, pick: Pick, shrinkable_runs: Shrinkable,
               idx: FreeIndex, now: float, per_node: GpuCounts, cfg: FrenzyConfig, skip: set[str],
               ends: dict[str, float]) -> Got:
    """A job near the head would wait: restart one run of a type on fewer GPUs of that type (a
    checkpoint restart, as Sia's re-sizing) when that lets the waiter start now and the
    waiter's predicted time saved exceeds the run's predicted time lost (restart and restore
    included) by ``gain``. ``shrinkable_runs``: ``shrinkable``'s list for this round."""
    sc = cfg.shrink
    wait_rel = pick.start - now + pick.dur
    if pick.start - now < sc.min_wait_s:
        return NOTHING
    steps = max(job.steps_left, 1)
    gains: dict[str, list[tuple[Cand, float, float]]] = {}   # type -> (cand, duration, gain), menu order
    for c in menu.queue:
        d = c.step_s * steps
        gain = wait_rel - d
        if gain > 0:
            gains.setdefault(c.gpu_type, []).append((c, d, gain))
    if not gains:
        return NOTHING
    best = None                                   # (net gain, cand, d, run, run's cand, run's duration)
    for run, rem, vsteps in shrinkable_runs:
        g = run.gpu_type
        mine = gains.get(g)
        if mine is None:
            continue
        rj = run.rj
        if rj.job_id in skip:
            continue
        m = rj.plan.gpus
        free = idx.free_gpus(g)
        for c, d, gain in mine:
            if c.gpus > free + m - 1:
                continue
            for vc in run.menu.grow:                 # the run's fastest plan that leaves n free
                if vc.gpu_type != g or vc.gpus >= m or vc.gpus + c.gpus > free + m:
                    continue
                vdur = vc.step_s * vsteps + restart_cost(run.ckpt_gb, g, vc.gpus, per_node, cfg.restart)
                net = gain - sc.gain * (vdur - rem)
                if net > 0 and (best is None or net > best[0]):
                    best = (net, c, d, run, vc, vdur)
                break
    if best is None:
        return NOTHING
    _, c, d, run, vc, vdur = best
    moved = shrink_to_fit(idx, run, vc, job, c, "shrink")
    if not moved:
        return NOTHING
    ends[run.rj.job_id] = now + vdur
    return moved, {run.rj.job_id}, Pick(c, now, d)


def yield_for(waiting: list[Waiter], runs: dict[str, Run], idx: FreeIndex, profiles: dict[str, Profile],
              now: float, per_node: GpuCounts, cfg: FrenzyConfig, touched: set[str]) -> list[Decision]:
    """Step 6b, runs yield (``Preemption.yields``): a run that would finish no later from another
    GPU type's queue (a job started on a slow type while the fast one was busy) gives its GPUs
    to a waiter that would otherwise wait, and goes back to the queue, checkpoint-preempted.
    Its predicted completion there: its best plan on another type, the start read off that
    type's profile with the wait counted ``1 + Choice.wait_inflation`` times as step 3a does
    (predicted waits ran 1.3-1.9x short), plus a restart; it yields only when that is no later
    than its current predicted end. Allowing runs that lose some time when the waiter gains
    ``Shrink.gain`` x as much cost 1.4% on itp03 / large-4type and 1.2% on cluster04's round
    world (docs/benchmarks.md). The waiter takes the run whose GPUs save it the most; a run
    yields at most once per round, never in its grace period or beyond ``Preemption.max_per_job``,
    and the waiter's run must not outlast it where its type holds reservations (they counted
    on its GPUs)."""
    pc = cfg.preempt
    distrust = 1.0 + cfg.choice.wait_inflation     # the run's wait on the other type, as step 3a counts it
    victims: dict[str, list[tuple[float, float, Run]]] = {}   # type -> (loss s, end, run), least loss first
    for run in runs.values():
        rj = run.rj
        req = rj.request
        if (not rj.placement or rj.job_id in touched or now - rj.start_s < pc.grace_s
                or req.preemptions >= pc.max_per_job):
            continue
        rem = expected_end(rj, now, cfg.backfill) - now
        if rem == INF:
            continue
        steps = max(1, int(steps_left(run, rem, now, cfg.restart.launch_s)))
        others = [c for c in run.menu.queue if c.gpu_type != run.gpu_type]
        alt = choose(others, steps, profiles, idx.total, now, cfg.choice, wait_w=distrust) if others else None
        if alt is None:
            continue
        c = alt.cand
        back = (max(alt.start, now) - now) * distrust + alt.dur
        loss = back + restart_cost(run.ckpt_gb, c.gpu_type, c.gpus, per_node, cfg.restart) - rem
        if loss <= 0:
            victims.setdefault(run.gpu_type, []).append((loss, now + rem, run))
    if not victims:
        return []
    for v in victims.values():
        v.sort(key=lambda x: x[0])
    out: list[Decision] = []
    gone: set[str] = set()
    for w in waiting:
        if w.start - now < pc.min_wait_s:
            continue
        steps = max(w.job.steps_left, 1)
        end_w = w.start + w.dur
        best = None                               # (waiter's time saved, its cand, run)
        for c in w.menu.queue:
            d = c.step_s * steps
            gain = end_w - (now + d)
            if gain <= 0:
                continue
            free = idx.free_gpus(c.gpu_type)
            prof = profiles.get(c.gpu_type)
            for loss, end, run in victims.get(c.gpu_type, ()):
                if run.rj.job_id in gone or free + run.rj.plan.gpus < c.gpus:
                    continue
                if prof is not None and prof.res and now + d > end:
                    continue
                if best is None or gain > best[0]:
                    best = (gain, c, run)
                break                             # least loss first: the others lose more
        if best is None:
            continue
        _, c, run = best
        rj = run.rj
        idx.release(rj.placement)
        place = idx.place_compact(c.gpu_type, c.gpus, c.plan.tp)
        if place is None:
            idx.commit(rj.placement)
            continue
        idx.commit(place)
        gone.add(rj.job_id)
        out += [Decision(job_id=rj.job_id, plan=None, placement={}, action="preempt", reason=f"yield for {w.job.job_id}"),
                Decision(job_id=w.job.job_id, plan=c.plan, placement=place, reason="start after yield")]
    return out
