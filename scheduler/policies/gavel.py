"""``gavel``: Gavel's heterogeneity-aware max-sum-throughput policy (Narayanan et al., OSDI'20).

Every ``round_s`` (360 s, the paper's round) an LP over the fraction of time ``X[j,k]`` each
active job ``j`` spends on each GPU type ``k`` maximises the sum of normalised effective
throughputs ``sum_jk T[j,k] X[j,k]`` subject to ``sum_k X[j,k] <= 1`` (a job runs on at most
one type at a time) and ``sum_j scale[j,k] X[j,k] <= GPUs[k]`` (capacity), solved with SciPy's
HiGHS (``scipy.optimize.linprog``). ``T[j,k]`` is the job's predicted steps/s on type ``k`` at
its author's GPU count (Gavel keeps the user's scale factor), divided by its best over types;
0 where no plan fits (memory). Gavel's round-based mechanism then realises ``X``: (job, type)
pairs are taken in decreasing priority ``X[j,k] / share[j,k]`` (``share`` = fraction of the
job's lifetime it actually received on ``k``; never-served pairs first) while capacity lasts.
Jobs that keep their type keep their GPUs; jobs that lose them are preempted (checkpoint) and
pay the restart delay when they run again.
"""
from __future__ import annotations

from estimator.plan import Plan
from scheduler.types import ClusterState, Decision, JobRequest, Policy

from .baseline_common import forget_plans_like, gpu_types, plan_for_request, realise

ROUND_S = 360.0


class Gavel(Policy):
    name = "gavel"
    restarts_runs = True
    round_s = ROUND_S

    def __init__(self, round_s: float = ROUND_S) -> None:
        self.round_s = round_s
        self._reqs: dict[str, JobRequest] = {}
        self._time_on: dict[tuple[str, str], float] = {}    # (job, type) -> seconds received
        self._last_round: float | None = None
        self._last_running: dict[str, str] = {}             # job -> type during the last round

    def _credit(self, now: float) -> None:
        if self._last_round is not None:
            dt = now - self._last_round
            for jid, t in self._last_running.items():
                self._time_on[(jid, t)] = self._time_on.get((jid, t), 0.0) + dt
        self._last_round = now

    def allocation(self, jobs: list[JobRequest], types: list[str], capacity: dict[str, int]):
        """Solve the LP; returns (X [jobs x types], plans [jobs][types] or None)."""
        # numpy/scipy are imported here, not at module level: the live submit flow imports the
        # policy registry and must not pay for them unless Gavel actually solves a round.
        import numpy as np
        from scipy.optimize import linprog
        from scipy.sparse import coo_matrix

        nj, nk = len(jobs), len(types)
        plans: list[list[Plan | None]] = []
        tput = np.zeros((nj, nk))
        scale = np.zeros((nj, nk))
        for j, job in enumerate(jobs):
            row = [plan_for_request(job, t, job.requested_gpus or 1) for t in types]
            plans.append(row)
            for k, p in enumerate(row):
                if p is not None and p.gpus <= capacity[types[k]]:
                    tput[j, k] = 1.0 / p.step_time_s
                    scale[j, k] = p.gpus
        best = tput.max(axis=1, keepdims=True)
        best[best == 0] = 1.0
        norm = tput / best
        # variables x[j*nk + k]; maximise => minimise the negative
        c = -norm.ravel()
        rows, cols, vals = [], [], []
        for j in range(nj):                       # sum_k x[j,k] <= 1
            for k in range(nk):
                rows.append(j); cols.append(j * nk + k); vals.append(1.0)
        for k in range(nk):                       # sum_j scale x[j,k] <= capacity
            for j in range(nj):
                if scale[j, k]:
                    rows.append(nj + k); cols.append(j * nk + k); vals.append(scale[j, k])
        a = coo_matrix((vals, (rows, cols)), shape=(nj + nk, nj * nk)).tocsr()
        b = np.concatenate([np.ones(nj), [capacity[t] for t in types]])
        bounds = np.zeros((nj * nk, 2))
        bounds[:, 1] = (norm.ravel() > 0).astype(float)      # infeasible pairs pinned to 0
        res = linprog(c, A_ub=a, b_ub=b, bounds=bounds, method="highs")
        x = res.x.reshape(nj, nk) if res.status == 0 else np.zeros((nj, nk))
        return x, plans

    def schedule(self, pending: list[JobRequest], state: ClusterState, now: float) -> list[Decision]:
        self._credit(now)
        running = {r.job_id: r for r in state.running}
        self._reqs = {jid: req for jid, req in self._reqs.items() if jid in running}
        jobs = [self._reqs[jid] for jid in running if jid in self._reqs] + list(pending)
        types = gpu_types(state)
        capacity = {t: 0 for t in types}
        for n in state.nodes:
            capacity[n.gpu_type] += n.gpus
        out: list[Decision] = []
        if not jobs:
            self._last_running = {}
            return out
        x, plans = self.allocation(jobs, types, capacity)
        # Gavel's mechanism: priority = allocation / share received so far
        pairs = []
        for j, job in enumerate(jobs):
            life = max(1e-9, now - job.submit_s)
            for k, t in enumerate(types):
                if x[j, k] <= 1e-6:
                    continue
                share = self._time_on.get((job.job_id, t), 0.0) / life
                prio = x[j, k] / share if share > 0 else float("inf")
                pairs.append((-prio, -x[j, k], job.submit_s, j, k))
        pairs.sort()
        left = dict(capacity)
        chosen: dict[int, int] = {}
        for _, _, _, j, k in pairs:
            if j in chosen:
                continue
            p = plans[j][k]
            if p.gpus <= left[types[k]]:
                chosen[j] = k
                left[types[k]] -= p.gpus
        # keep jobs that stay on their configuration, preempt the others, place the new ones
        out = realise(state, running, [(job, plans[j][chosen[j]] if j in chosen else None)
                                       for j, job in enumerate(jobs)])
        by_id = {job.job_id: job for job in jobs}
        for d in out:
            if d.action == "start":
                self._reqs[d.job_id] = by_id[d.job_id]
        preempted = {d.job_id for d in out if d.action == "preempt"}
        self._last_running = {r.job_id: r.plan.gpu_type for r in state.running if r.job_id not in preempted}
        self._last_running.update({d.job_id: d.plan.gpu_type for d in out if d.action == "start"})
        return out

    def on_oom(self, job: JobRequest, plan: Plan) -> JobRequest:
        return forget_plans_like(job, plan)
