"""Steps 2-3: queue order and plan choice."""
from __future__ import annotations

import math
from operator import attrgetter, itemgetter

from scheduler.types import JobRequest

from .config import Choice, Ordering
from .profile import Profile
from .records import Cand, GpuCounts, Menu, Pick, Queued

INF = math.inf


def order_queue(pending: list[tuple[JobRequest, Menu]], now: float, cfg: Ordering,
                movers: dict | None = None) -> list[Queued]:
    """Shortest predicted remaining work first (GPU-seconds of the job's cheapest plan), divided
    by ``1 + wait / aging_s`` so waiting jobs climb and none starves; jobs with no plan are left
    out. Ties: earlier submission, then job id. ``movers`` (job id -> (run, remaining s,
    remaining steps)): runs that compete for a faster plan, keyed the same way."""
    keyed = []
    for jid, (run, _, steps) in (movers or {}).items():
        req = run.rj.request
        wait = max(0.0, now - req.submit_s)
        keyed.append(Queued(run.menu.work * steps / (1.0 + wait / cfg.aging_s), req.submit_s, jid, req, run.menu))
    for job, menu in pending:
        if not menu.queue:
            continue
        work = menu.work * max(job.steps_left, 0)
        wait = max(0.0, now - job.submit_s)
        keyed.append(Queued(work / (1.0 + wait / cfg.aging_s), job.submit_s, job.job_id, job, menu))
    keyed.sort(key=_ORDER)
    return keyed


_ORDER = itemgetter(0, 1, 2)              # Queued's (key, submit_s, job_id)


def lightly_loaded(queue: list[Queued], free: GpuCounts, cfg: Choice) -> bool:
    """Every waiting job's smallest plan fits the free GPUs ``idle_factor`` times over: GPUs
    would sit idle, so jobs take their fastest immediate plan rather than the cheapest."""
    if cfg.idle_factor <= 0:
        return False
    have = sum(free.values())
    need = 0
    for q in queue:
        need += q.menu.least
        if need * cfg.idle_factor > have:
            return False                  # (the sum only grows: no need to read the rest)
    return True


def idle_menu(menu: Menu, free: GpuCounts, per_node: GpuCounts, cfg: Choice) -> list[Cand]:
    """The job's idle-GPU plans (down to ``idle_min_efficiency``) within its 90%-efficiency
    plans, one node, or ``idle_share`` of a type's free GPUs, whichever is most. Without the
    share, the first jobs of a burst arriving at an idle cluster took whole types at 70%
    efficiency and the rest of the burst queued behind them (1,024-GPU cluster, 3 seeds:
    against Sia itp05 +4.6% -> +3.1%, itp01 +9.7% -> +9.1%, itp03 +0.1% -> -0.4%)."""
    if cfg.idle_share >= 1:
        return menu.wide
    top = menu.top
    return [c for c in menu.wide
            if c.gpus <= max(top.get(c.gpu_type, 0), per_node.get(c.gpu_type, 0), cfg.idle_share * free.get(c.gpu_type, 0))]


def wait_weight(menu: list[Cand], steps: int, free: GpuCounts, cfg: Choice) -> float:
    """Step 3a, distrust of predicted waits (``Choice.wait_inflation``, ``Choice.short_s``): the
    factor ``choose`` multiplies a waiting plan's predicted wait by. A predicted start is
    optimistic: shorter jobs arriving later overtake a waiting job (SRPT order), and its
    reservation moves back. Measured (jobs that chose to wait, truth seed 0): the realised
    first start came 1.27-1.49x the predicted wait later on four training blocks and 1.6-1.9x
    on the Sia-like cluster07 window. So a job that can finish soon on GPUs free now counts
    its wait ``1 + wait_inflation`` times; the factor is 1 for jobs whose immediate plans all
    run longer than ``short_s``: a long run started now on slow GPUs holds them through the
    next burst (ungated, itp01 on the small cluster went from -18% to +34% against Sia)."""
    if cfg.wait_inflation <= 0:
        return 1.0
    short = cfg.short_s / max(steps, 1)
    for c in menu:
        if c.step_s <= short and free.get(c.gpu_type, 0) >= c.gpus:
            return 1.0 + cfg.wait_inflation
    return 1.0


def waited_start(prof: Profile, n: int, now: float, free: int) -> float:
    """When a plan of ``n`` GPUs that cannot start now would start on ``prof``'s type: its
    availability profile's start (``profile_start``), and no earlier than the jobs already
    queued for the type let it (``backlog_start``). INF: never."""
    start = profile_start(prof, n, now, free)
    if start == INF:
        return INF
    queued = backlog_start(prof, now)
    return queued if queued is not None and queued > start else start


def profile_start(prof: Profile, n: int, now: float, free: int) -> float:
    """``waited_start`` read off the availability profile alone: from when on ``n`` GPUs stay
    free, at least a second away (a release due now is not placeable this instant). INF: never."""
    start = prof.wait_start(n, now, free)
    return now + 1.0 if start <= now else start


def backlog_start(prof: Profile, now: float) -> float | None:
    """The earliest start the work queued for ``prof``'s type without a reservation allows
    (fluid estimate: its GPUs first finish the running work, then the queued work); None
    without queued work."""
    return now + (prof.busy_gs + prof.backlog) / prof.total if prof.backlog else None


def choose(menu: list[Cand], steps: int, profiles: dict[str, Profile], free: GpuCounts, now: float,
           cfg: Choice, deep: bool = False, fastest: bool = False, wait_w: float = 1.0,
           launch_s: float = 0.0) -> Pick | None:
    """The plan with the earliest predicted completion (start read off the type's availability
    profile + duration); among plans within ``tolerance`` of it, the one using the fewest
    GPU-seconds (leaving GPUs to the jobs behind). ``fastest`` (idle GPUs: nothing to leave them
    to): the soonest-finishing plan that starts now, if within tolerance. ``deep``: give up as
    soon as waiting clearly beats the fastest immediate start (such a job does nothing this
    round). ``wait_w`` (``wait_weight``): how much a predicted wait counts. ``launch_s``
    (``Choice.count_launch``): the start-up every plan pays before training, part of its
    duration, so a wide plan's GPU-seconds include its GPUs' idle launch. None when no plan can
    ever start."""
    tol1 = 1.0 + cfg.tolerance
    best_rel = lim = INF
    options = []                      # (relative completion, GPU-seconds, cand, start, duration)
    any_now = False
    # called once per queued job per round (the policy's hottest loop): lookups bound locally
    prof_of, free_of = profiles.get, free.get
    for c in menu:                    # fastest first
        step_s, n, g, _ = c
        dur = step_s * steps + launch_s
        if dur > lim:
            break                     # even starting now this plan is not within tolerance
        prof = prof_of(g)
        if prof is None:
            continue
        f = free_of(g, 0)
        if f >= n and (not prof.res or prof.fits_now(n, dur, now, f)):
            start = now
            rel = dur
            any_now = True
        else:
            start = waited_start(prof, n, now, f)
            if start == INF:
                continue
            rel = (start - now) * wait_w + dur
        options.append((rel, n * dur, c, start, dur))
        if rel < best_rel:
            best_rel = rel
            lim = rel * tol1
    if not options or (deep and not any_now):
        return None
    pick = None
    if fastest:
        for o in options:
            if o[3] <= now and (pick is None or o[0] < pick[0] or (o[0] == pick[0] and o[1] < pick[1])):
                pick = o
        if pick is not None and pick[0] <= lim:
            return Pick(pick[2], pick[3], pick[4])
        pick = None
    for o in options:
        if o[0] <= lim and (pick is None or o[1] < pick[1] or (o[1] == pick[1] and o[0] < pick[0])):
            pick = o
    return Pick(pick[2], pick[3], pick[4])


class DeepBound:
    """Step 3 deep in the queue, without ``choose`` for every job. Past the lookahead with every
    reservation taken, ``choose(..., deep=True)`` gives a job nothing unless a plan that starts
    now comes before its loop stops; on a busy cluster that is almost never (~770 of ~900 calls
    a round in ``bench/live_round.py``, ~750 of ~950 at 5% churn, each trying ~30 plans).
    ``gives_nothing`` answers that question exactly, cheaply:

    * a plan can start now with ``steps`` steps when its GPUs are free and ``now + step_s x
      steps + launch_s`` is within its type's ``Profile.horizon``, so per menu the most steps
      any of its plans could start now with is one number: a job with more steps gets nothing.
      The number errs high by ``SLACK_S`` of run time (float rounding in its division is far
      below that), so it only ever rules out jobs ``choose`` gives nothing;
    * otherwise ``choose``'s loop is replayed with what it reads off the profiles computed once
      per menu (each plan's horizon, and the start it would wait for, which does not depend on
      the job's steps), the same float operations in the same order: same answer.

    What is computed per menu is kept while the free GPUs and every profile's releases and
    reservations are unchanged: the free counts are compared, and the sum of the profiles'
    versions grows with every release or reservation added (a version is never reused), so a
    change is always seen. The queued backlogs, which grow with almost every job deep in the
    queue, are not part of what is kept: the start a plan would wait for is kept without them
    and ``waited_start``'s backlog rule is applied to it when it is read (the same float
    operations in the same order)."""

    SLACK_S = 1e-3

    def __init__(self, profiles: dict[str, Profile], free: GpuCounts, now: float, cfg: Choice,
                 launch_s: float = 0.0) -> None:
        self.profiles, self.free, self.now, self.cfg, self.launch_s = profiles, free, now, cfg, launch_s
        self._state: tuple | None = None
        # id(menu) -> [menu, the most steps a plan could start now with, per plan (step s,
        # horizon, start it would wait for before the backlog rule, GPU type) or None until
        # needed], for ``_state``
        self._kept: dict[int, list] = {}
        self._backlogs: tuple | None = None
        self._queued: dict[str, float] = {}   # GPU type -> waited_start's backlog bound, for _backlogs

    def gives_nothing(self, menu: Menu, steps: float) -> bool:
        """True when ``choose(menu.queue, steps, ..., deep=True)`` (with its ``wait_weight``)
        returns None."""
        profiles = self.profiles.values()
        state = (sum(map(_VERSION, profiles)), tuple(self.free.values()))
        if state != self._state:
            self._state = state
            self._kept.clear()
        kept = self._kept.get(id(menu))
        if kept is None or kept[0] is not menu:
            kept = self._kept[id(menu)] = [menu, self._most_steps(menu.queue), None]
        if steps > kept[1]:
            return True                   # no plan of the menu can start now
        if kept[2] is None:
            kept[2] = self._plans(menu.queue)
        backlogs = tuple(map(_BACKLOG, profiles))
        if backlogs != self._backlogs:
            self._backlogs = backlogs
            now = self.now
            self._queued = {g: backlog_start(p, now) for g, p in self.profiles.items() if p.backlog}
        return not self._reaches_now(kept[2], steps, wait_weight(menu.queue, steps, self.free, self.cfg))

    def _most_steps(self, cands: list[Cand]) -> float:
        most = -INF
        now, launch_s = self.now, self.launch_s
        prof_of, free_of = self.profiles.get, self.free.get
        for step_s, n, g, _ in cands:
            prof = prof_of(g)
            if prof is None:
                continue
            end = prof.horizon(n, now, free_of(g, 0))
            if end == -INF:
                continue
            if end == INF or step_s <= 0:
                return INF
            most = max(most, (end - now - launch_s + self.SLACK_S) / step_s)
        return most

    def _plans(self, cands: list[Cand]) -> list[tuple[float, float, float, str]]:
        """Per plan, in menu order: (step s, horizon, the start it would wait for before
        ``waited_start``'s backlog rule, GPU type)."""
        plans = []
        now = self.now
        prof_of, free_of = self.profiles.get, self.free.get
        for step_s, n, g, _ in cands:
            prof = prof_of(g)
            if prof is None:              # choose skips it, after its stop test
                plans.append((step_s, -INF, INF, g))
                continue
            f = free_of(g, 0)
            plans.append((step_s, prof.horizon(n, now, f), profile_start(prof, n, now, f), g))
        return plans

    def _reaches_now(self, plans: list[tuple[float, float, float, str]], steps: float, wait_w: float) -> bool:
        """``choose``'s loop (deep): does a plan that starts now come before the loop stops?"""
        now, launch_s, tol1 = self.now, self.launch_s, 1.0 + self.cfg.tolerance
        queued = self._queued
        best = lim = INF
        for step_s, end, start, g in plans:
            dur = step_s * steps + launch_s
            if dur > lim:
                return False
            if now + dur <= end:
                return True
            if start == INF:
                continue
            if queued:                    # waited_start's backlog rule (backlog_start)
                q = queued.get(g)
                if q is not None and q > start:
                    start = q
            rel = (start - now) * wait_w + dur
            if rel < best:
                best = rel
                lim = rel * tol1
        return False


_VERSION = attrgetter("version")
_BACKLOG = attrgetter("backlog")


def start_now(menu: list[Cand], steps: int, profiles: dict[str, Profile], free: GpuCounts, now: float) -> Pick | None:
    """The fastest plan of ``menu`` that can start now on free GPUs without delaying any
    reservation (a stopgap for a job whose chosen plan starts later), or None."""
    for c in menu:                    # fastest first
        f = free.get(c.gpu_type, 0)
        if f < c.gpus:
            continue
        prof = profiles.get(c.gpu_type)
        dur = c.step_s * steps
        if prof is not None and (not prof.res or prof.fits_now(c.gpus, dur, now, f)):
            return Pick(c, now, dur)
    return None


def stopgap_pays(pick: Pick, stop: Pick, move_cost_s: float, now: float) -> bool:
    """Start on ``stop`` now rather than wait for ``pick``: the progress made until ``pick``'s
    start, in ``pick``'s time, exceeds the restart that moving onto it then costs (or the
    stopgap alone finishes no later than waiting)."""
    wait = pick.start - now
    return stop.dur <= wait + pick.dur or wait * pick.dur > move_cost_s * stop.dur


def stopgap_ends_in_time(pick: Pick, stop: Pick, now: float, within: float) -> bool:
    """The stopgap run ends within ``within`` x the predicted wait for ``pick`` (0: no bound).
    Predicted waits run long (later, shorter jobs overtake; ``wait_weight``), so such a stopgap
    most likely ends before the job's own plan frees and gives its slow GPUs back before the next
    burst; a longer one would hold them for as long as the job stays at the back of the queue."""
    return within <= 0 or stop.dur <= within * (pick.start - now)
