"""The discrete-event loop.

Events: a job arrives; a run ends (completion, or the out-of-memory crash of a run whose real
peak exceeds the GPU, ``startup_s`` after it started: the launcher dies, its allocation is
released, and the policy's own ``on_oom`` rule resubmits it); a periodic tick (event-driven
policies: every ``tick_s`` while jobs wait, so aging can act, and for a policy that
``grows_runs`` also while GPUs sit idle under running jobs) or a round (round-based policies:
every ``policy.round_s``, aligned to multiples of it, and only then).

Every start (first start, restart after preemption, retry after OOM) pays ``startup_s`` of
allocated-but-idle time: launch, model build. A preempted run keeps the optimizer steps it
completed: it checkpoints when preempted and restores when it starts again; a start that has
progress to restore pays the save and the restore of the training state
(``scheduler.restart``: 14 bytes per parameter, at ``ckpt_gbs_per_node`` GB/s per node spanned) on top of
``startup_s`` (the save is charged to the next start, so the preempted GPUs free at once), or,
where it was measured, ``SimConfig.restart_s`` instead. A run progresses at its real step time:
the throughput model's step time for the placement it got (nodes spanned, slowest inter-node
link among the pools it touches) times the measured ``step_ratio`` of its GPU type and count
(1 unless measured) times the job's noise factor (``truth.py``).

``SimConfig.world_round_s`` makes the world round-based, as Sia's simulator is (60 s): arrivals
are seen and finished runs free their GPUs only at round boundaries (a job's JCT still ends at
its last step).

Decisions are applied preempt-first; a decision that names GPUs that are not free, a node of
another GPU type, or the wrong number of GPUs is a policy bug and raises ``ValueError``.
"""
from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Any

from estimator.errors import FrenzyInputError, check_number
from scheduler.placement import nodes_spanned
from scheduler.restart import checkpoint_gb, checkpoint_move_s
from scheduler.round import MIN_TICK_S, next_round_s, run_round, wants_tick
from scheduler.types import ClusterState, Decision, JobRequest, Node, Policy, RunningJob

from .jobs import PlanBook, StepTimes, model_spec
from .metrics import SimResult, summarise
from .truth import memory_factor, step_factor

_END, _ARRIVE, _ROUND = 0, 1, 2


DAY_S = 86400.0      # start-up, tick, round and restart lengths: no real one lasts a day
MAX_NOISE = 2.0      # a lognormal sigma of 2: real within e^2 = 7.4x of predicted at one sigma
MAX_STEP_RATIO = 1e3  # a run 1,000x slower than predicted is a broken measurement, not a GPU


@dataclass(slots=True)
class SimConfig:
    seed: int = 0
    noise: float = 0.1
    startup_s: float = 60.0
    ckpt_gbs_per_node: float = 2.0   # checkpoint write / read bandwidth per node spanned (GB/s)
    tick_s: float = 300.0
    max_restarts: int = 8
    progress: bool = False
    idle_rounds_limit: int = 3   # stop when nothing runs, nothing arrives and rounds place nothing
    idle_s: float = 3600.0       # ... for this long too (a policy may hold jobs on purpose: sia's
                                 # profiling delay)
    # a round-based world (Sia's simulator: 60 s): arrivals are seen and finished runs free their
    # GPUs only at multiples of this; a job's JCT still ends when its last step does. None: events
    # happen when they happen
    world_round_s: float | None = None
    # What a real cluster measured (``bench/live_replay.py`` fills them from live runs; empty /
    # None: the model's figures). ``step_ratio``: measured step time / the throughput model's
    # prediction, per (GPU type, GPU count) -- the truth's step times only: policies still
    # predict with the model, as they do live. ``restart_s``: the allocated-but-idle time of a
    # start that restores a checkpoint (a re-size, a restart after preemption), measured from
    # the stop request to the first step on the new plan; None: ``startup_s`` plus the
    # checkpoint's save and restore (``scheduler.restart``)
    step_ratio: dict[tuple[str, int], float] = field(default_factory=dict)
    restart_s: float | None = None

    def __post_init__(self) -> None:
        """Finite, physical numbers, for Python callers as for `frenzy simulate`: NaN, inf or
        10^12 s made the event loop spin for ever, a sigma of 10^6 overflowed the truth's draw."""
        check_number("seed", self.seed, low_open=False, integer=True)
        check_number("noise", self.noise, low_open=False, high=MAX_NOISE, what="a lognormal sigma")
        check_number("startup_s", self.startup_s, low_open=False, high=DAY_S, what="seconds")
        check_number("ckpt_gbs_per_node", self.ckpt_gbs_per_node, what="GB/s")
        check_number("tick_s", self.tick_s, low=MIN_TICK_S, low_open=False, high=DAY_S, what="seconds")
        check_number("max_restarts", self.max_restarts, low_open=False, integer=True)
        check_number("idle_rounds_limit", self.idle_rounds_limit, low=1, low_open=False, integer=True)
        check_number("idle_s", self.idle_s, low_open=False, high=DAY_S, what="seconds")
        if self.world_round_s is not None:
            check_number("world_round_s", self.world_round_s, low=MIN_TICK_S, low_open=False, high=DAY_S,
                         what="seconds")
        if self.restart_s is not None:
            check_number("restart_s", self.restart_s, low_open=False, high=DAY_S, what="seconds")
        if not isinstance(self.step_ratio, dict):
            raise FrenzyInputError("step_ratio", f"must map (GPU type, GPU count) to a ratio, got {self.step_ratio!r}")
        for key, ratio in self.step_ratio.items():
            # measured / predicted step time: a NaN stalled the event loop, 0 or less trained in no time
            check_number(f"step_ratio[{key!r}]", ratio, high=MAX_STEP_RATIO, what="measured / predicted step time")


@dataclass(slots=True)
class SimCluster:
    """What the simulator needs to know about the cluster (built from ``scheduler.cluster``)."""

    nodes: list[Node]
    gpus: dict[str, Any]                      # gpu_type -> estimator.catalog.GPU
    inter_node_gbps: dict[str, float] = field(default_factory=dict)   # pool -> Gb/s
    host_ram_gib: dict[str, float] = field(default_factory=dict)      # gpu_type -> per node (GiB)

    @classmethod
    def from_cluster(cls, cluster) -> "SimCluster":
        state = cluster.initial_state()
        return cls(nodes=state.nodes, gpus=cluster.gpu_catalog(),
                   inter_node_gbps=dict(state.inter_node_gbps), host_ram_gib=cluster.host_ram_gib())

    @property
    def inventory(self) -> dict[str, int]:
        inv: dict[str, int] = {}
        for n in self.nodes:
            inv[n.gpu_type] = inv.get(n.gpu_type, 0) + n.gpus
        return inv

    @property
    def gpus_per_node(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for n in self.nodes:
            out[n.gpu_type] = max(out.get(n.gpu_type, 0), n.gpus)
        return out

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    def plan_book(self) -> PlanBook:
        """A plan cache for this cluster (share it between policies run on the same cluster)."""
        return PlanBook(self.inventory, self.gpus_per_node,
                        memory_gib={t: g.memory_gib for t, g in self.gpus.items()}, gpus=self.gpus,
                        host_ram_gib=self.host_ram_gib)


@dataclass(slots=True)
class _Run:
    plan: Any
    placement: dict[str, list[int]]
    start_s: float
    ready_s: float
    step_s: float
    end_s: float
    oom: bool
    token: int


@dataclass(slots=True)
class SimJob:
    wl: Any                          # scheduler.workload.WorkloadJob
    req: JobRequest
    steps_total: int
    mem_factor: float
    steps_done: float = 0.0
    state: str = "future"            # future | pending | running | done | failed | rejected
    first_start: float | None = None
    end_s: float | None = None
    run: _Run | None = None
    ooms: int = 0
    preemptions: int = 0
    starts: int = 0
    resizes: int = 0                 # restarts on another plan in the same round (grow, shrink, recall)


class Simulator:
    def __init__(self, jobs, cluster: SimCluster, policy: Policy, config: SimConfig | None = None,
                 plan_book: PlanBook | None = None, step_times: StepTimes | None = None):
        self.cfg = config or SimConfig()
        self.cluster = cluster
        self.policy = policy
        self.book = plan_book or cluster.plan_book()
        self.steps = step_times or StepTimes(cluster.gpus)
        self.nodes = {n.node_id: Node(n.node_id, n.pool, n.gpu_type, n.gpus, list(n.free), n.intra_link)
                      for n in cluster.nodes}
        self.state = ClusterState(nodes=list(self.nodes.values()),
                                  inter_node_gbps=dict(cluster.inter_node_gbps),
                                  gpu_memory_gib={t: g.memory_gib for t, g in cluster.gpus.items()})
        self.jobs: list[SimJob] = []
        self.by_id: dict[str, SimJob] = {}
        for wl in sorted(jobs, key=lambda w: w.submit_s):
            req = JobRequest(job_id=wl.job_id, submit_s=wl.submit_s, plans=[], steps_left=wl.steps,
                             requested_gpu_type=wl.requested_gpu_type, requested_gpus=wl.requested_gpus,
                             model=wl.model, checkpoint_gb=checkpoint_gb(model_spec(wl.model).params))
            sj = SimJob(wl=wl, req=req, steps_total=wl.steps,
                        mem_factor=memory_factor(self.cfg.seed, wl.job_id, self.cfg.noise))
            self.jobs.append(sj)
            self.by_id[wl.job_id] = sj
        self._index = {sj.wl.job_id: i for i, sj in enumerate(self.jobs)}
        self.pending: dict[str, SimJob] = {}
        self.running: dict[str, RunningJob] = {}
        self.heap: list[tuple[float, int, int, int, int]] = []
        self._seq = 0
        self._token = 0
        self.sched_ms: list[float] = []
        self.rounds = 0
        self.queue_series: list[tuple[float, int]] = []
        self.busy_gpu_s = 0.0
        self.last_release_s = 0.0          # a round-based world holds GPUs past the last step
        self.oom_events = 0
        self._finished = 0
        # work conservation: GPU-seconds per type left free while a pending job had a plan of
        # that type needing no more GPUs than were free (it could have used them)
        self.idle_waiting_gpu_s: dict[str, float] = {}
        self._idle_t = 0.0
        self._idle_now: dict[str, int] = {}
        self._fewest: dict[int, tuple[list, int, dict[str, int]]] = {}

    # ------------------------------------------------------------------ event plumbing
    def _push(self, t: float, kind: int, ji: int = -1, token: int = 0) -> None:
        self._seq += 1
        heapq.heappush(self.heap, (t, kind, self._seq, ji, token))

    def _world(self, t: float) -> float:
        """When the world lets an event at ``t`` be seen: the next round boundary, or ``t``."""
        r = self.cfg.world_round_s
        return t if not r else math.ceil(t / r - 1e-9) * r

    def run(self) -> SimResult:
        for i, sj in enumerate(self.jobs):
            self._push(self._world(sj.wl.submit_s), _ARRIVE, i)
        policy = self.policy
        round_based = policy.round_s is not None
        tick_s = self.cfg.tick_s
        round_queued = False
        tick_queued = False
        arrivals_left = len(self.jobs)
        idle_rounds = 0
        last_progress = 0.0
        bar = _progress(self.cfg.progress, len(self.jobs), self.policy.name)
        wall0 = time.perf_counter()
        try:
            while self.heap:
                t = self.heap[0][0]
                self._count_idle(t)
                changed = False
                round_due = False
                while self.heap and self.heap[0][0] <= t:
                    _, kind, _, ji, token = heapq.heappop(self.heap)
                    if kind == _ARRIVE:
                        arrivals_left -= 1
                        self._arrive(self.jobs[ji])
                        changed = True
                    elif kind == _END:
                        sj = self.jobs[ji]
                        if sj.run is None or sj.run.token != token:
                            continue                   # a preempted run's stale end
                        self._end(sj, t)
                        changed = True
                    else:
                        round_due = True
                        round_queued = tick_queued = False
                started = 0
                if round_based:
                    if round_due:
                        started = self._round(t)
                        if self.pending or self.running:
                            self._push(next_round_s(policy, t, tick_s, after_round=True), _ROUND)
                            round_queued = True
                    elif changed and not round_queued:
                        self._push(next_round_s(policy, t, tick_s, after_round=False), _ROUND)
                        round_queued = True
                else:
                    if changed or (round_due and self._wants_round() and self._any_free()):
                        started = self._round(t)
                    if not tick_queued and self._wants_round():
                        self._push(next_round_s(policy, t, tick_s, after_round=True), _ROUND)
                        tick_queued = True
                self._record_queue(t)
                self._see_idle(t)
                if bar is not None:
                    bar.update(self._finished)
                # nothing can ever change again: nothing runs, nothing arrives, rounds place nothing
                if changed or started:
                    last_progress = t
                if not self.running and arrivals_left == 0 and self.pending:
                    idle_rounds = 0 if started else idle_rounds + (1 if (round_due or changed) else 0)
                    if idle_rounds >= self.cfg.idle_rounds_limit and t - last_progress >= self.cfg.idle_s:
                        break
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - wall0
        return summarise(self, wall)

    # ------------------------------------------------------------------ handlers
    def _arrive(self, sj: SimJob) -> None:
        wl = sj.wl
        sj.req.plans = self.book.plans(wl.model, wl.seq_len, wl.global_batch)
        if not sj.req.plans:
            sj.state = "rejected"               # fits no GPU type of this cluster at any plan
            self._finished += 1
            return
        sj.state = "pending"
        self.pending[wl.job_id] = sj

    def _end(self, sj: SimJob, t: float) -> None:
        run = sj.run
        self._release(sj, t)
        if run.oom:
            self.oom_events += 1
            sj.ooms += 1
            sj.req = self.policy.on_oom(sj.req, run.plan)
            if sj.ooms > self.cfg.max_restarts or not sj.req.plans:
                sj.state = "failed"
                self._finished += 1
            else:
                sj.state = "pending"
                self.pending[sj.wl.job_id] = sj
            return
        sj.steps_done = sj.steps_total
        sj.req.steps_left = 0
        sj.state = "done"
        sj.end_s = min(t, run.end_s)          # the last step (a round-based world frees GPUs later)
        self._finished += 1

    def _release(self, sj: SimJob, t: float) -> None:
        run = sj.run
        for node_id, devs in run.placement.items():
            node = self.nodes[node_id]
            node.free = sorted(node.free + devs)
        gpus = run.plan.gpus
        self.busy_gpu_s += gpus * (t - run.start_s)
        self.last_release_s = max(self.last_release_s, t)
        sj.req.attained_gpu_s += gpus * (t - run.start_s)
        del self.running[sj.wl.job_id]
        sj.run = None

    def _preempt(self, d: Decision, t: float) -> None:
        sj = self.by_id[d.job_id]
        run = sj.run
        if not run.oom and t > run.ready_s:
            sj.steps_done = min(sj.steps_total, sj.steps_done + (t - run.ready_s) / run.step_s)
        sj.req.steps_left = max(1, math.ceil(sj.steps_total - sj.steps_done - 1e-9))
        self._release(sj, t)
        sj.preemptions += 1
        sj.state = "pending"
        self.pending[sj.wl.job_id] = sj

    def _start(self, d: Decision, t: float) -> None:
        """Start a checked decision (``scheduler.round`` validated it against the state)."""
        sj = self.by_id[d.job_id]
        plan = d.plan
        for node_id, devs in d.placement.items():
            node = self.nodes[node_id]
            used = set(devs)
            node.free = [i for i in node.free if i not in used]
        wl = sj.wl
        span = nodes_spanned(d.placement)
        gbps = None
        if span > 1:
            pools = {self.nodes[n].pool for n in d.placement}
            known = [self.state.inter_node_gbps[p] for p in pools if p in self.state.inter_node_gbps]
            gbps = min(known) if known else None
        predicted = self.steps.at(wl.model, wl.seq_len, plan, span, gbps)
        real_step = (predicted * self.cfg.step_ratio.get((plan.gpu_type, plan.gpus), 1.0)
                     * step_factor(self.cfg.seed, wl.job_id, plan.gpu_type, self.cfg.noise))
        capacity = self.cluster.gpus[plan.gpu_type].memory_gib
        oom = plan.device_used_gib * sj.mem_factor > capacity
        steps_left = max(0.0, sj.steps_total - sj.steps_done)
        ready = t + self.cfg.startup_s
        if sj.steps_done > 0:                      # save (at preemption) + restore a checkpoint
            ready = (t + self.cfg.restart_s if self.cfg.restart_s is not None else
                     ready + checkpoint_move_s(sj.req.checkpoint_gb, span, self.cfg.ckpt_gbs_per_node))
        end = ready if oom else ready + steps_left * real_step
        self._token += 1
        sj.run = _Run(plan=plan, placement={k: list(v) for k, v in d.placement.items()}, start_s=t,
                      ready_s=ready, step_s=real_step, end_s=end, oom=oom, token=self._token)
        sj.state = "running"
        sj.starts += 1
        if sj.first_start is None:
            sj.first_start = t
        del self.pending[wl.job_id]
        self.running[wl.job_id] = RunningJob(job_id=wl.job_id, plan=plan, placement=sj.run.placement,
                                             start_s=t, expected_end_s=ready + steps_left * predicted,
                                             request=sj.req, resizes=sj.resizes, reason=d.reason)
        self._push(self._world(end), _END, self._index[wl.job_id], self._token)

    def _wants_round(self) -> bool:
        return wants_tick(self.policy, pending=len(self.pending), running=len(self.running),
                          any_free=self._any_free())

    def _any_free(self) -> bool:
        return any(n.free for n in self.state.nodes)

    def _round(self, t: float) -> int:
        self.state.running = list(self.running.values())
        pending = [sj.req for sj in self.pending.values()]
        result = run_round(self.policy, pending, self.state, t)
        # a policy may answer a round whose inputs did not change from memory (sia's ILP):
        # such rounds say nothing about its cost per decision and are left out of sched_ms
        if not result.cached:
            self.sched_ms.append(result.policy_ms)
        self.rounds += 1
        for d in result.stops:
            self._preempt(d, t)
            if d.job_id not in result.resizes:
                self.by_id[d.job_id].req.preemptions += 1
        for d in result.starts:
            if d.job_id in result.resizes:
                self.by_id[d.job_id].resizes += 1
            self._start(d, t)
        return len(result.starts)

    def _count_idle(self, t: float) -> None:
        dt = t - self._idle_t
        if dt > 0:
            for g, n in self._idle_now.items():
                self.idle_waiting_gpu_s[g] = self.idle_waiting_gpu_s.get(g, 0.0) + n * dt
        self._idle_t = t

    def _see_idle(self, t: float) -> None:
        """Free GPUs per type that some pending job could have started on (a plan of that type
        needing no more GPUs than are free), from now until the next event."""
        self._idle_t = t
        self._idle_now = {}
        if not self.pending:
            return
        free: dict[str, int] = {}
        for n in self.state.nodes:
            if n.free:
                free[n.gpu_type] = free.get(n.gpu_type, 0) + len(n.free)
        if not free:
            return
        need: dict[str, int] = {}
        for sj in self.pending.values():
            for g, k in self._fewest_of(sj.req.plans).items():
                if k < need.get(g, 1 << 30):
                    need[g] = k
        self._idle_now = {g: f for g, f in free.items() if need.get(g, 1 << 30) <= f}

    def _fewest_of(self, plans: list) -> dict[str, int]:
        hit = self._fewest.get(id(plans))
        if hit is not None and hit[0] is plans and hit[1] == len(plans):
            return hit[2]
        fewest: dict[str, int] = {}
        for p in plans:
            if p.gpus < fewest.get(p.gpu_type, 1 << 30):
                fewest[p.gpu_type] = p.gpus
        self._fewest[id(plans)] = (plans, len(plans), fewest)
        return fewest

    def _record_queue(self, t: float) -> None:
        q = len(self.pending)
        if not self.queue_series or self.queue_series[-1][1] != q:
            self.queue_series.append((t, q))


def _progress(enabled: bool, total: int, label: str):
    if not enabled:
        return None
    return _Bar(total, label)


class _Bar:
    """A rich progress bar on stderr over finished jobs, refreshed at most ~10 times a second."""

    def __init__(self, total: int, label: str):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        self._p = Progress(TextColumn(f"simulating [bold]{label}[/]"), BarColumn(), MofNCompleteColumn(),
                           TextColumn("jobs"), TimeElapsedColumn(), console=Console(stderr=True),
                           transient=True)
        self._p.start()
        self._task = self._p.add_task(label, total=total)
        self._last = 0.0

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if now - self._last > 0.1:
            self._p.update(self._task, completed=done)
            self._last = now

    def close(self) -> None:
        self._p.stop()


def simulate(jobs, cluster, policy: "Policy | str", *, seed: int = 0, noise: float = 0.1,
             config: SimConfig | None = None, plan_book: PlanBook | None = None,
             step_times: StepTimes | None = None, progress: bool = False) -> SimResult:
    """Simulate ``jobs`` (``WorkloadJob`` rows) on ``cluster`` (a ``scheduler.cluster.Cluster``
    or a ``SimCluster``) under ``policy`` (a ``Policy`` or a registered name)."""
    if isinstance(policy, str):
        from scheduler.policies import get_policy
        policy = get_policy(policy)
    if not isinstance(cluster, SimCluster):
        cluster = SimCluster.from_cluster(cluster)
    cfg = config or SimConfig(seed=seed, noise=noise, progress=progress)
    return Simulator(jobs, cluster, policy, cfg, plan_book, step_times).run()
