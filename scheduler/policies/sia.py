"""``sia``: Sia-style goodput optimisation (Jayaram Subramanya et al., SOSP'23).

Every ``round_s`` (60 s, the paper's round) an ILP (``scipy.optimize.milp``, HiGHS) chooses for
every active job at most one configuration (GPU type, GPU count): counts are powers of two up
to a node, then whole nodes (Sia's configuration set). A configuration's goodput is the job's
predicted steps/s on its fastest plan there (global batch fixed, so statistical efficiency is
constant and goodput = throughput), normalised by the job's goodput on its smallest
configuration (on heterogeneous types: its least-goodput configuration, so every ``G >= 1``).
The objective follows Sia's p-norm form with ``p = -0.5``: each allocated job contributes
``LAMBDA_N - G^p`` (``LAMBDA_N`` = 1.1 rewards giving every job something before speeding any
one up; ``-G^p`` favours more goodput with diminishing returns); a running job that keeps its
configuration earns ``RESTART_PENALTY`` (Sia's lambda_a, scaled to these units: any change,
including losing the GPUs, gives it up, so ties never make jobs swap places every round);
in the simulator the change also costs a checkpoint-restore delay (the start-up delay).
Capacity: ``sum count x <= GPUs`` per type. Jobs keeping their configuration keep their GPUs.

Feasibility. Real Sia profiles every new job (a few batch sizes on one GPU of each type) before
it schedules it, so it never runs a configuration that does not fit in memory. ``sia`` knows the
same from the estimator: its configurations are the plans that pass the memory gate every
policy here shares (``frenzy.gate.memory_gate``: predicted use x 1.35 + 0.5 GiB fits), and
``profile_s`` (default 0) delays a new job's first round as profiling would. ``sia-noprofile``
is the earlier baseline: every plan the estimator enumerates, tight ones included, learning
what does not fit only from out-of-memory crashes (150-230 per bench workload).
"""
from __future__ import annotations

from estimator.plan import Plan
from scheduler.placement import gpu_memory_gib
from scheduler.types import ClusterState, Decision, JobRequest, Policy

from .baseline_common import forget_plans_like, gpu_types, realise
from .frenzy.config import MemoryGate
from .frenzy.gate import memory_gate

ROUND_S = 60.0
P_NORM = -0.5
LAMBDA_N = 1.1
RESTART_PENALTY = 0.05
TIME_LIMIT_S = 30.0


def config_counts(gpus_per_node: int, capacity: int) -> list[int]:
    """Sia's configuration set on one type: 1, 2, 4, ... up to a node, then whole nodes."""
    counts, c = [], 1
    while c < gpus_per_node and c <= capacity:
        counts.append(c)
        c *= 2
    n = gpus_per_node
    while n <= capacity:
        counts.append(n)
        n += gpus_per_node
    return counts


class Sia(Policy):
    name = "sia"
    restarts_runs = True
    round_s = ROUND_S

    def __init__(self, round_s: float = ROUND_S, *, profiled: bool = True, profile_s: float = 0.0,
                 memory: MemoryGate | None = None) -> None:
        self.round_s = round_s
        self.profiled = profiled          # configurations limited to what fits (profiling)
        self.profile_s = profile_s        # a new job's profiling delay before its first round
        self.memory = memory or MemoryGate()
        self._fits: dict[int, tuple[list[Plan], int, list[Plan]]] = {}   # id(plans) -> plans that fit
        self._mem_state: ClusterState | None = None
        self._reqs: dict[str, JobRequest] = {}
        # The ILP's inputs are the jobs, their plans, their current configurations and the
        # capacities; when none changed since the last solve its answer cannot change either.
        self._last_key: tuple | None = None
        self._last_choice: dict[str, Plan] = {}
        self.solves = 0
        self.round_was_cached = False   # the simulator leaves such rounds out of sched_ms

    def feasible(self, job: JobRequest) -> list[Plan]:
        """The job's plans that fit in memory, as profiling shows (cached per plan list)."""
        if not self.profiled:
            return job.plans
        hit = self._fits.get(id(job.plans))
        if hit is not None and hit[0] is job.plans and hit[1] == len(job.plans):
            return hit[2]
        state = self._mem_state
        fits = memory_gate(job.plans, lambda t: gpu_memory_gib(state, t), self.memory)
        self._fits[id(job.plans)] = (job.plans, len(job.plans), fits)
        return fits

    def configs(self, job: JobRequest, counts: dict[str, set[int]]) -> list[Plan]:
        """The job's fastest plan per Sia configuration (type, count) it can run in."""
        best: dict[tuple[str, int], Plan] = {}
        for p in self.feasible(job):
            if p.gpus not in counts.get(p.gpu_type, ()):
                continue
            key = (p.gpu_type, p.gpus)
            if key not in best or p.step_time_s < best[key].step_time_s:
                best[key] = p
        return list(best.values())

    def solve(self, jobs: list[JobRequest], state: ClusterState, current: dict[str, tuple[str, int]]):
        """Returns {job index: chosen plan}."""
        types = gpu_types(state)
        capacity = {t: 0 for t in types}
        per_node = {t: 0 for t in types}
        for n in state.nodes:
            capacity[n.gpu_type] += n.gpus
            per_node[n.gpu_type] = max(per_node[n.gpu_type], n.gpus)
        key = (tuple((j.job_id, id(j.plans), len(j.plans), current.get(j.job_id)) for j in jobs),
               tuple(sorted(capacity.items())))
        self.round_was_cached = key == self._last_key
        if self.round_was_cached:
            return {i: self._last_choice[j.job_id] for i, j in enumerate(jobs) if j.job_id in self._last_choice}
        chosen = self._solve(jobs, types, capacity, per_node, current)
        self.solves += 1
        self._last_key = key
        self._last_choice = {jobs[i].job_id: p for i, p in chosen.items()}
        return chosen

    def _solve(self, jobs, types, capacity, per_node, current) -> dict[int, Plan]:
        # numpy/scipy are imported lazily: the policy registry is imported by the live submit flow.
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        counts = {t: set(config_counts(per_node[t], capacity[t])) for t in types}
        var_job, var_plan, util = [], [], []
        for j, job in enumerate(jobs):
            cfgs = self.configs(job, counts)
            if not cfgs:
                continue
            base = min(1.0 / p.step_time_s for p in cfgs)     # the job's least-goodput configuration
            cur = current.get(job.job_id)
            for p in cfgs:
                g = (1.0 / p.step_time_s) / base                # >= 1
                u = LAMBDA_N - g ** P_NORM                      # in [LAMBDA_N - 1, LAMBDA_N)
                if cur is not None and cur == (p.gpu_type, p.gpus):
                    u += RESTART_PENALTY                        # any change (even to none) pays it
                var_job.append(j)
                var_plan.append(p)
                util.append(u)
        if not var_plan:
            return {}
        nv = len(var_plan)
        job_rows = {j: r for r, j in enumerate(sorted(set(var_job)))}
        t_rows = {t: len(job_rows) + i for i, t in enumerate(types)}
        rows = [job_rows[j] for j in var_job] + [t_rows[p.gpu_type] for p in var_plan]
        cols = list(range(nv)) * 2
        vals = [1.0] * nv + [float(p.gpus) for p in var_plan]
        a = coo_matrix((vals, (rows, cols)), shape=(len(job_rows) + len(types), nv)).tocsr()
        ub = np.concatenate([np.ones(len(job_rows)), [capacity[t] for t in types]])
        res = milp(-np.asarray(util), constraints=LinearConstraint(a, -np.inf, ub),
                   integrality=np.ones(nv), bounds=Bounds(0, 1),
                   options={"time_limit": TIME_LIMIT_S, "disp": False})
        if res.x is None:
            return {}
        return {var_job[i]: var_plan[i] for i in range(nv) if res.x[i] > 0.5}

    def schedule(self, pending: list[JobRequest], state: ClusterState, now: float) -> list[Decision]:
        running = {r.job_id: r for r in state.running}
        if self._mem_state is None or self._mem_state.gpu_memory_gib != (state.gpu_memory_gib or {}):
            self._mem_state = ClusterState(nodes=[], gpu_memory_gib=dict(state.gpu_memory_gib or {}))
            self._fits.clear()
        if len(self._fits) > 2 * (len(pending) + len(running)) + 256:
            self._fits.clear()
        self._reqs = {jid: req for jid, req in self._reqs.items() if jid in running}
        for r in state.running:               # runs carry their request (live: other instances' runs)
            if r.job_id not in self._reqs and r.request is not None:
                self._reqs[r.job_id] = r.request
        profiled = [j for j in pending if now >= j.submit_s + self.profile_s]
        jobs = [self._reqs[jid] for jid in running if jid in self._reqs] + profiled
        if not jobs:
            self.round_was_cached = True
            return []
        current = {jid: (r.plan.gpu_type, r.plan.gpus) for jid, r in running.items()}
        chosen = self.solve(jobs, state, current)
        out = realise(state, running, [(job, chosen.get(j)) for j, job in enumerate(jobs)])
        by_id = {job.job_id: job for job in jobs}
        for d in out:
            if d.action == "start":
                self._reqs[d.job_id] = by_id[d.job_id]
        return out

    def on_oom(self, job: JobRequest, plan: Plan) -> JobRequest:
        return forget_plans_like(job, plan)


class SiaNoProfile(Sia):
    """``sia`` without profiling: runs any plan the estimator enumerates, learns from OOMs."""

    name = "sia-noprofile"

    def __init__(self, round_s: float = ROUND_S) -> None:
        super().__init__(round_s, profiled=False)
