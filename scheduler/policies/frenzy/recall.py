"""Step 8: waiters take back GPUs lent to runs beyond their 90%-efficiency plan."""
from __future__ import annotations

from scheduler.placement import FreeIndex
from scheduler.types import Decision

from .config import FrenzyConfig
from .profile import expected_end
from .records import GpuCounts, Run, Waiter
from .resize import restart_cost, shrink_to_fit, steps_left


def lent_runs(runs: dict[str, Run], now: float, cfg: FrenzyConfig,
              touched: set[str]) -> dict[str, list[tuple[Run, float, float]]]:
    """Per GPU type, runs holding more GPUs than their menu's largest 90%-efficiency plan (from
    an idle start or growth), each with its predicted remaining seconds and steps (computed
    once per round, not once per waiter)."""
    lent: dict[str, list[tuple[Run, float, float]]] = {}
    for run in runs.values():
        rj = run.rj
        if not rj.placement or rj.job_id in touched:
            continue
        g = run.gpu_type
        if rj.plan.gpus > run.menu.top.get(g, 0):
            rem = expected_end(rj, now, cfg.backfill) - now
            lent.setdefault(g, []).append((run, rem, steps_left(run, rem, now, cfg.restart.launch_s)))
    return lent


def recall(waiting: list[Waiter], runs: dict[str, Run], idx: FreeIndex, now: float, per_node: GpuCounts,
           cfg: FrenzyConfig, touched: set[str]) -> list[Decision]:
    """Jobs still wait after the round while runs hold GPUs lent to them: shrink such a run to a
    smaller plan of its menu, not below its 90%-efficiency plan, so a waiter starts now, when
    the waiter's predicted gain beats the run's loss. A run keeps its lent GPUs when it is
    predicted to end before the waiter's predicted start and within ``Recall.min_left_s``: the
    waiter's start counts on them then; a run that outlasts the waiter's wait holds them past
    it. The run is expected to grow back once the waiter is done, so the loss is its slowdown while the waiter runs plus two restarts (or its
    whole predicted loss, if smaller). Each run gives GPUs back at most once per round."""
    lent = lent_runs(runs, now, cfg, touched)
    out: list[Decision] = []
    if not lent:
        return out
    recalled: set[str] = set()
    for w in waiting:
        if w.start - now < cfg.recall.min_wait_s:
            continue
        wait_rel = w.start - now + w.dur
        steps = max(w.job.steps_left, 1)
        best = None                               # (net gain, waiter cand, run, run's cand)
        for c in w.menu.queue:
            step_s, n, g, _ = c
            gain = wait_rel - step_s * steps
            if gain <= 0:
                continue
            free = idx.free_gpus(g)
            for run, rem, vsteps in lent.get(g, ()):
                rj = run.rj
                m, floor = rj.plan.gpus, run.menu.top.get(g, 0)
                if rj.job_id in recalled or free + m - floor < n:
                    continue
                if rem <= min(cfg.recall.min_left_s, w.start - now):
                    continue                       # it frees them in time for the waiter anyway
                for vc in run.menu.grow:           # fastest first
                    vstep, vn, vg, _ = vc
                    if vg != g or vn >= m or vn < floor or vn + n > free + m:
                        continue
                    cost = restart_cost(run.ckpt_gb, vg, vn, per_node, cfg.restart)
                    loss = min(vstep * vsteps + cost - rem,
                               step_s * steps * (1.0 - rj.plan.step_time_s / vstep) + 2.0 * cost)
                    if gain > loss and (best is None or gain - loss > best[0]):
                        best = (gain - loss, c, run, vc)
                    break
        if best is None:
            continue
        _, c, run, vc = best
        moved = shrink_to_fit(idx, run, vc, w.job, c, "recall")
        if moved:
            recalled.add(run.rj.job_id)
            out += moved
    return out
