"""``FrenzyPolicy``: the round that runs the steps (package docstring) in order."""
from __future__ import annotations

import math

from estimator.plan import Plan
from scheduler.placement import FreeIndex, gpu_memory_gib
from scheduler.types import ClusterState, Decision, JobRequest, Policy, Wait

from .choose import (DeepBound, choose, idle_menu, lightly_loaded, order_queue, start_now, stopgap_ends_in_time,
                     stopgap_pays, wait_weight)
from .config import FrenzyConfig
from .gate import build_menu, memory_gate
from .grow import grow_runs
from .preempt import preempt_for, preemptible, shrink_for, shrinkable, yield_for
from .profile import build_profiles, expected_end
from .recall import recall
from .records import GpuCounts, Menu, Run, WaitNote, Waiter
from .resize import restart_cost, steps_left

INF = math.inf
STOPGAP = "stopgap"      # the reason of a stopgap start (Decision.reason -> RunningJob.reason)
CKPT_FOOTPRINT = 1.074      # unknown checkpoint size: at most the 1-GPU-equivalent footprint of the
                            # job's smallest plan (pessimistic; GiB -> GB)

# why a pending job waits (WaitNote.why -> the queue view's words)
WHY = {
    "no_fit": "no plan fits in memory on any GPU type of this cluster",
    "no_type": "no GPU type here has enough GPUs for any of its plans",
    "reserved": "reserved for {gpus}x{gpu_type} at {at}",
    "queued": "queued for {gpus}x{gpu_type} behind the reservations, expected at {at}",
    "backfill": "{gpus}x{gpu_type} free now, but starting would delay a reservation; reserved at {at}",
    "fragmented": "{gpus} {gpu_type} GPUs free but spread over nodes; waiting for a compact placement",
    "no_free": "no free GPUs of a type that fits (deep in the queue)",
}


class FrenzyPolicy(Policy):
    """Heterogeneity-aware assignment with backfilling, sparing preemption and elastic re-sizing.

    ``FrenzyPolicy(config)`` or, as the registry's ``get_policy("frenzy", **flat)``, with flat
    overrides (``config.FLAT``: e.g. ``grow=False``, ``aging_s=600``). The switches of the steps
    that restart runs are named parameters so a caller can see and turn them off."""

    name = "frenzy"
    grows_runs = True
    restarts_runs = True

    def __init__(self, config: FrenzyConfig | None = None, *, preemption: bool | None = None,
                 grow: bool | None = None, shrink: bool | None = None, recall: bool | None = None,
                 **overrides) -> None:
        switches = {k: v for k, v in (("preemption", preemption), ("grow", grow), ("shrink", shrink),
                                      ("recall", recall)) if v is not None}
        self.config = (config or FrenzyConfig()).with_overrides(**switches, **overrides)
        self.trace: list[tuple] | None = None   # set to [] to record each round's choices
        # caches (derived data, not notes on runs): plan list -> its menu, GPU memory per type
        self._menus: dict[int, tuple[list[Plan], int, Menu]] = {}
        self._mem_key: tuple = ()
        self._mem: dict[str, float] = {}
        self._state_mem = ClusterState(nodes=[])
        self._notes: list[WaitNote] = []       # the last round's waiting jobs (``waits``)
        self._now = 0.0

    # the switches, readable (the live submit flow checks them)
    preemption = property(lambda self: self.config.preempt.enabled)
    grow = property(lambda self: self.config.growth.enabled)
    shrink = property(lambda self: self.config.shrink.enabled)
    aging_s = property(lambda self: self.config.order.aging_s)

    # --- menus ----------------------------------------------------------------------------
    def menu(self, plans: list[Plan]) -> Menu:
        """The menu of a plan list (cached per list: jobs of one shape share it)."""
        hit = self._menus.get(id(plans))
        if hit is not None and hit[0] is plans and hit[1] == len(plans):
            return hit[2]
        cfg = self.config
        m = build_menu(plans, self._mem_of, cfg.memory, cfg.choice, cfg.growth)
        self._menus[id(plans)] = (plans, len(plans), m)
        return m

    def _mem_of(self, gpu_type: str) -> float:
        return gpu_memory_gib(self._state_mem, gpu_type)

    def _see_cluster(self, state: ClusterState, pending: list[JobRequest]) -> None:
        self._mem.update(state.gpu_memory_gib or {})
        mem_key = tuple(sorted((state.gpu_memory_gib or {}).items()))
        if mem_key != self._mem_key:          # another cluster: the memory gate changes
            self._mem_key = mem_key
            self._state_mem = ClusterState(nodes=[], gpu_memory_gib=dict(self._mem))
            self._menus.clear()
        if len(self._menus) > 2 * (len(pending) + len(state.running)) + 256:   # finished jobs' lists
            keep = {id(j.plans) for j in pending}
            keep |= {id(r.request.plans) for r in state.running if r.request is not None}
            self._menus = {k: v for k, v in self._menus.items() if k in keep}

    def _runs(self, state: ClusterState, node_type: dict[str, str]) -> dict[str, Run]:
        """The running jobs this policy can re-size: those whose request it knows."""
        runs = {}
        for rj in state.running:
            req = rj.request
            if req is None or not rj.placement:
                continue
            menu = self.menu(req.plans)
            g = node_type.get(next(iter(rj.placement)), "")
            runs[rj.job_id] = Run(rj, g, menu, req.checkpoint_gb or CKPT_FOOTPRINT * menu.footprint_gib)
        return runs

    # --- the round ------------------------------------------------------------------------
    def schedule(self, pending: list[JobRequest], state: ClusterState, now: float) -> list[Decision]:
        cfg = self.config
        idx = FreeIndex(state.nodes)
        self._see_cluster(state, pending)
        node_type = {n.node_id: n.gpu_type for n in state.nodes}
        per_node: GpuCounts = {}
        for n in state.nodes:
            if per_node.get(n.gpu_type, 0) < n.gpus:
                per_node[n.gpu_type] = n.gpus
        profiles = build_profiles(state, now, node_type, cfg.backfill)
        menus = [(job, self.menu(job.plans)) for job in pending]
        notes = self._notes = [WaitNote(j.job_id, INF, None, 0, "no_fit") for j, m in menus if not m.queue]
        runs = self._runs(state, node_type)
        movers = self._movers(runs, now) if cfg.stopgap.move_up else {}
        keyed = order_queue(menus, now, cfg.order, movers)

        out: list[Decision] = []
        total = idx.total
        # step 6: queued jobs (the tracked ones, in queue order) preempt or shrink runs when waiting
        # would cost them much
        if (cfg.preempt.enabled or cfg.shrink.enabled) and keyed:
            eligible = None                       # preemptible runs, computed when first needed
            shrinkable_runs = None                # shrinkable runs, likewise
            preempted: set[str] = set()
            started: set[str] = set()
            ends: dict[str, float] = {}           # predicted end of each start decided so far
            heads = cfg.backfill.lookahead if cfg.preempt.heads is None else cfg.preempt.heads
            for head in [k for k in keyed if k.job_id not in movers][:heads]:
                pick = choose(head.menu.queue, max(head.job.steps_left, 1), profiles, total, now, cfg.choice)
                if pick is None or pick.start <= now:
                    continue
                pre = []
                if cfg.preempt.enabled and pick.start - now >= cfg.preempt.min_wait_s:
                    if eligible is None:
                        eligible = preemptible(state, now, node_type, cfg,
                                               set(movers) if cfg.stopgap.yield_first else set())
                    pre, victims, got = preempt_for(head.job, head.menu, pick, eligible, idx, now, cfg, preempted)
                if not pre and cfg.shrink.enabled:
                    if shrinkable_runs is None:
                        shrinkable_runs = shrinkable(runs, now, cfg)
                    pre, victims, got = shrink_for(head.job, head.menu, pick, shrinkable_runs, idx, now, per_node,
                                                   cfg, preempted, ends)
                if pre:
                    out.extend(pre)
                    preempted |= victims
                    started.add(head.job_id)
                    ends[head.job_id] = now + got.dur
                    profiles = build_profiles(state, now, node_type, cfg.backfill, skip=preempted)
                    for d in out:
                        if d.action == "start":
                            profiles[d.plan.gpu_type].add_release(ends[d.job_id], d.plan.gpus)
            if started:                           # (a mover preempted for a head is no longer running)
                keyed = [k for k in keyed if k.job_id not in started and k.job_id not in preempted]

        # steps 3-5: plan choice, backfilling and queued load, in queue order
        bf = cfg.backfill
        launch = cfg.restart.launch_s if cfg.choice.count_launch else 0.0
        reservations = 0
        depth = 0
        fastest = lightly_loaded([k for k in keyed if k.job_id not in movers], total, cfg.choice)
        deep_bound = DeepBound(profiles, total, now, cfg.choice, launch)
        waiting: list[Waiter] = []
        for q in keyed:
            job, menu = q.job, q.menu
            if q.job_id in movers:
                moved, held = self._move_up(movers[q.job_id], profiles, idx, now, per_node,
                                            cfg.stopgap.reserve and reservations < bf.max_reservations)
                out.extend(moved)
                reservations += held
                continue
            depth += 1
            steps = max(job.steps_left, 1)
            deep = depth > bf.lookahead and reservations >= bf.max_reservations
            if reservations >= bf.max_reservations:
                if not any(total.values()):
                    notes.extend(WaitNote(k.job_id, INF, None, 0, "no_free") for k in keyed[depth - 1:])
                    break                 # nothing free and no reservations left: round is over
                # deep in the queue and nothing it could start now: no type has GPUs free for its
                # fewest, or (``DeepBound``, which covers that too) choose would give it nothing
                if deep and (deep_bound.gives_nothing(menu, steps) if not fastest
                             else not any(total.get(t, 0) >= n for t, n in menu.fewest)):
                    notes.append(WaitNote(job.job_id, INF, None, 0, "no_free"))
                    continue
            cands = idle_menu(menu, total, per_node, cfg.choice) if fastest else menu.queue
            pick = choose(cands, steps, profiles, total, now, cfg.choice, deep, fastest,
                          wait_weight(cands, steps, total, cfg.choice), launch)
            if pick is None:
                notes.append(WaitNote(job.job_id, INF, None, 0, "no_free" if deep else "no_type"))
                continue
            c, start, dur = pick
            if self.trace is not None:    # why each job got what it got (debugging, reports)
                self.trace.append((job.job_id, c.gpu_type, c.gpus, start - now, dur, depth))
            if start <= now:
                placement = idx.place_compact(c.gpu_type, c.gpus, c.plan.tp)
                if placement is not None:
                    idx.commit(placement)
                    profiles[c.gpu_type].add_release(now + dur, c.gpus)
                    out.append(Decision(job_id=job.job_id, plan=c.plan, placement=placement))
                    continue
                why = "fragmented"        # enough GPUs but spread across nodes: wait like a blocked job
            else:
                why = "backfill" if total.get(c.gpu_type, 0) >= c.gpus else "reserved"
            if len(waiting) < bf.lookahead:
                waiting.append(Waiter(job, start, dur, menu, pick, cands))
            if reservations < bf.max_reservations:
                s0 = max(start, now)
                profiles[c.gpu_type].reserve(s0, s0 + dur, c.gpus)
                reservations += 1
            else:
                # no exact reservation left: the job still queues for this type, so later
                # jobs see that type as busier (their waits grow by its GPU-seconds / capacity)
                profiles[c.gpu_type].backlog += c.gpus * dur
                why = "queued" if why == "reserved" else why
            notes.append(WaitNote(job.job_id, max(start, now), c.gpu_type, c.gpus, why))
        # step 3b: GPUs nobody chose stay idle no longer while a waiter could use them
        if cfg.stopgap.enabled and waiting and any(total.values()):
            out.extend(self._stopgaps(waiting, profiles, idx, now, per_node))
            started_now = {d.job_id for d in out}
            waiting = [w for w in waiting if w.job.job_id not in started_now]
            notes[:] = [n for n in notes if n.job_id not in started_now]
        # step 6b: runs that would finish about as soon on another type yield to waiters
        if cfg.preempt.yields and waiting:
            moved = yield_for(waiting, runs, idx, profiles, now, per_node, cfg, {d.job_id for d in out})
            if moved:
                out.extend(moved)
                started_now = {d.job_id for d in moved if d.action == "start"}
                waiting = [w for w in waiting if w.job.job_id not in started_now]
                notes[:] = [n for n in notes if n.job_id not in started_now]
        # step 8: waiters recall lent GPUs; step 7: nothing waits, runs grow onto idle GPUs
        if waiting and cfg.recall.enabled:
            out.extend(recall(waiting, runs, idx, now, per_node, cfg, {d.job_id for d in out}))
        if cfg.growth.enabled:
            touched = {d.job_id for d in out}
            if all(k.job_id in touched or k.job_id in movers for k in keyed):
                out.extend(grow_runs(runs, idx, now, per_node, cfg, touched))
            elif cfg.growth.while_waiting:
                out.extend(grow_runs(runs, idx, now, per_node, cfg, touched, profiles))
        self._now = now
        return out

    def _movers(self, runs: dict[str, Run], now: float) -> dict[str, tuple[Run, float, float]]:
        """Runs started as stopgaps (every run with ``Stopgap.move_up_any``) on a plan slower than
        their fastest queue plan by more than the growth gain, with time left: job id -> (run,
        remaining s, remaining steps)."""
        cfg = self.config
        anyone = cfg.stopgap.move_up_any
        out = {}
        for jid, run in runs.items():
            rj = run.rj
            if not (anyone or rj.reason == STOPGAP) or not run.menu.queue \
                    or rj.resizes >= cfg.growth.max_resizes_per_job:
                continue
            if run.menu.queue[0].step_s * (1.0 + cfg.growth.min_gain) >= rj.plan.step_time_s:
                continue
            rem = expected_end(rj, now, cfg.backfill) - now
            if rem == INF or rem < cfg.growth.min_s:
                continue
            out[jid] = (run, rem, steps_left(run, rem, now, cfg.restart.launch_s))
        return out

    def _move_up(self, mover: tuple[Run, float, float], profiles, idx: FreeIndex, now: float,
                 per_node: GpuCounts, reserve: bool = False) -> tuple[list[Decision], bool]:
        """A mover takes the plan it would choose if it were queued, when that plan starts now and
        its remaining time, restart included, drops by the growth gain. ``reserve``
        (``Stopgap.reserve``): when that plan starts later, the mover reserves it if moving then,
        with the steps it makes meanwhile, still gains as much. The decisions, and whether it
        holds a reservation."""
        cfg = self.config
        run, rem, steps = mover
        rj = run.rj
        pick = choose(run.menu.queue, max(1, int(steps)), profiles, idx.total, now, cfg.choice)
        if pick is None or pick.cand.plan == rj.plan:
            return [], False
        c = pick.cand
        cost = restart_cost(run.ckpt_gb, c.gpu_type, c.gpus, per_node, cfg.restart)
        need = max(cfg.growth.min_gain * rem, cfg.growth.min_s)
        if pick.start > now:
            if not reserve:
                return [], False
            wait = pick.start - now
            dur = c.step_s * max(1.0, steps - wait / max(rj.plan.step_time_s, 1e-9)) + cost
            if rem - (wait + dur) < need:
                return [], False
            profiles[c.gpu_type].reserve(pick.start, pick.start + dur, c.gpus)
            return [], True
        if rem - (pick.dur + cost) < need:
            return [], False
        placement = idx.place_compact(c.gpu_type, c.gpus, c.plan.tp)
        if placement is None:
            return [], False
        idx.commit(placement)
        idx.release(rj.placement)
        profiles[c.gpu_type].add_release(now + pick.dur + cost, c.gpus)
        return [Decision(job_id=rj.job_id, plan=None, placement={}, action="preempt", reason="move up"),
                Decision(job_id=rj.job_id, plan=c.plan, placement=placement, reason="move up")], False

    def _stopgaps(self, waiting: list[Waiter], profiles, idx: FreeIndex, now: float,
                  per_node: GpuCounts) -> list[Decision]:
        """After the queue pass, waiters in queue order start on GPUs left free (delaying no
        reservation) when ``choose.stopgap_pays``; growth later moves them up."""
        out = []
        total = idx.total
        for w in waiting:
            if not any(total.values()):
                break
            stop = start_now(w.cands, max(w.job.steps_left, 1), profiles, total, now)
            if stop is None:
                continue
            if not stopgap_ends_in_time(w.pick, stop, now, self.config.stopgap.end_within_wait):
                continue                  # (checked first: it needs no restart cost)
            ckpt = w.job.checkpoint_gb or CKPT_FOOTPRINT * w.menu.footprint_gib
            move = restart_cost(ckpt, w.pick.cand.gpu_type, w.pick.cand.gpus, per_node, self.config.restart)
            if not stopgap_pays(w.pick, stop, move, now):
                continue
            c = stop.cand
            placement = idx.place_compact(c.gpu_type, c.gpus, c.plan.tp)
            if placement is None:
                continue
            idx.commit(placement)
            profiles[c.gpu_type].add_release(now + stop.dur, c.gpus)
            out.append(Decision(job_id=w.job.job_id, plan=c.plan, placement=placement, reason=STOPGAP))
        return out

    def waits(self) -> dict[str, Wait]:
        """Why each pending job the last round did not start waits: its predicted start, the GPU
        type and count it waits for, and the reason in words (``WHY``)."""
        now = self._now
        out = {}
        said: dict[tuple, str] = {}           # the words, once per distinct answer (most are alike)
        for n in self._notes:
            at = "unknown" if n.start == INF else f"+{max(0.0, n.start - now) / 60:.0f} min"
            key = (n.why, n.gpus, n.gpu_type, at)
            reason = said.get(key)
            if reason is None:
                reason = said[key] = WHY[n.why].format(gpus=n.gpus, gpu_type=n.gpu_type, at=at)
            out[n.job_id] = Wait(job_id=n.job_id, predicted_start_s=n.start, gpu_type=n.gpu_type, gpus=n.gpus,
                                 reason=reason)
        return out

    def on_oom(self, job: JobRequest, plan: Plan) -> JobRequest:
        """The estimate was too low for this job (the error is per job): from now on only plans
        with more headroom than the one that failed, relative to their card; when none of those
        passes the memory gate, every plan but the failed one."""
        job.restarts += 1
        mem = self._mem_of(plan.gpu_type)
        if 0 < mem < INF:
            frac = plan.device_used_gib / mem
            roomier = [p for p in job.plans if p.device_used_gib / self._mem_of(p.gpu_type) < frac]
            if memory_gate(roomier, self._mem_of, self.config.memory):
                job.plans = roomier
                return job
        job.plans = [p for p in job.plans if p != plan]
        return job
