"""Step 7: elastic growth of runs onto GPUs nobody waits for."""
from __future__ import annotations

import math

from scheduler.placement import FreeIndex
from scheduler.types import Decision

from .config import FrenzyConfig
from .gate import base_gpu_s
from .profile import Profile, expected_end
from .records import GpuCounts, Run
from .resize import restart_cost, steps_left

INF = math.inf


def grow_runs(runs: dict[str, Run], idx: FreeIndex, now: float, per_node: GpuCounts, cfg: FrenzyConfig,
              touched: set[str], waiting: dict[str, Profile] | None = None) -> list[Decision]:
    """Nothing waits and GPUs sit idle: checkpoint-restart runs (the longest remaining first)
    on a faster plan when the predicted remaining time, restart and checkpoint restore
    included, drops by at least ``min_gain`` of it (and ``min_s``). Plans may go down to the
    growth efficiency floors (lower for runs with ``long_s`` or more left).

    ``waiting`` (jobs wait; their availability profiles, reservations included): only moves to
    a faster plan of the run's queue menu (>= 90% efficiency) that delay no reservation."""
    gc = cfg.growth
    out: list[Decision] = []
    if not any(idx.total.values()):
        return out
    cands = []
    for run in runs.values():
        rj = run.rj
        if not rj.placement or rj.job_id in touched or rj.resizes >= gc.max_resizes_per_job:
            continue
        rem = expected_end(rj, now, cfg.backfill) - now
        if rem == INF or rem < gc.min_s:
            continue
        cands.append((rem, run))
    cands.sort(key=lambda x: -x[0])
    for rem, run in cands[:gc.max_per_round]:
        rj = run.rj
        steps = steps_left(run, rem, now, cfg.restart.launch_s)
        target = rem - max(gc.min_gain * rem, gc.min_s)
        floor = gc.long_min_efficiency if rem >= gc.long_s else gc.min_efficiency
        menu = run.menu.grow if waiting is None else run.menu.queue
        base = base_gpu_s(menu)
        idx.release(rj.placement)
        placed = None
        for step_s, n, g, plan in menu:                 # fastest first
            dur = step_s * steps + restart_cost(run.ckpt_gb, g, n, per_node, cfg.restart)
            if dur > target:
                continue
            if idx.free_gpus(g) < n or plan == rj.plan or base[g] < floor * n * step_s:
                continue
            if waiting is not None:
                prof = waiting.get(g)
                if prof is None or (prof.res and not prof.fits_now(n, dur, now, idx.free_gpus(g))):
                    continue
            placed = idx.place_compact(g, n, plan.tp)
            if placed is not None:
                break
        if placed is None:
            idx.commit(rj.placement)
            continue
        idx.commit(placed)
        if waiting is not None:
            waiting[g].add_release(now + dur, n)
        out.append(Decision(job_id=rj.job_id, plan=None, placement={}, action="preempt", reason="grow"))
        out.append(Decision(job_id=rj.job_id, plan=plan, placement=placed, reason="grow"))
        if not any(idx.total.values()):
            break
    return out
