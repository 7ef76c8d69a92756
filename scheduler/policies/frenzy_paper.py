"""``frenzy-paper``: the published heterogeneity-aware scheduler (HAS) of Frenzy (arXiv
2412.14479), as far as it is known (see the development notes, notes/frenzy-paper.md, sections 2.3 and 5.4).

* Plans (MARP): per GPU type the smallest GPU count whose predicted memory fits the card
  (the fastest such plan), ranked by predicted step time ("training efficiency").
* Stage 1: pending jobs in arrival order; for each, walk its plans in rank order and take the
  first one the cluster can serve now. A job with no servable plan stays queued and the walk
  goes on to the next job (no reservations, no preemption).
* Stage 2: best-fit placement (a node that fits exactly, else the node left with the least
  free GPUs, else a greedy multi-node fill).

The paper names no safety margin: a plan is servable when its predicted ``device_used_gib`` is
at most the GPU's memory. After an out-of-memory failure the job drops the plan that failed
and falls back to its next plan (the minimal sensible retry; the paper says nothing).
"""
from __future__ import annotations

from estimator.plan import Plan
from scheduler.placement import FreeIndex, gpu_memory_gib
from scheduler.types import ClusterState, Decision, JobRequest, Policy


class FrenzyPaperPolicy(Policy):
    name = "frenzy-paper"

    def __init__(self) -> None:
        self._cache: dict[str, tuple[int, int, list[Plan]]] = {}

    def marp_plans(self, job: JobRequest, state: ClusterState) -> list[Plan]:
        """Per GPU type the fewest GPUs that fit (fastest among those), fastest type first."""
        key = (id(job.plans), len(job.plans))
        hit = self._cache.get(job.job_id)
        if hit is not None and hit[:2] == key:
            return hit[2]
        best: dict[str, Plan] = {}
        for p in job.plans:
            if p.device_used_gib > gpu_memory_gib(state, p.gpu_type):
                continue
            cur = best.get(p.gpu_type)
            if cur is None or (p.gpus, p.step_time_s) < (cur.gpus, cur.step_time_s):
                best[p.gpu_type] = p
        ranked = sorted(best.values(), key=lambda p: (p.step_time_s, p.gpus, p.gpu_type))
        self._cache[job.job_id] = (key[0], key[1], ranked)
        return ranked

    def schedule(self, pending: list[JobRequest], state: ClusterState, now: float) -> list[Decision]:
        idx = FreeIndex(state.nodes)
        out: list[Decision] = []
        live = {j.job_id for j in pending}
        for jid in [k for k in self._cache if k not in live]:
            del self._cache[jid]
        for job in sorted(pending, key=lambda j: (j.submit_s, j.job_id)):
            if not any(idx.total.values()):
                break
            for plan in self.marp_plans(job, state):
                if idx.free_gpus(plan.gpu_type) < plan.gpus:
                    continue
                placement = idx.place_best_fit(plan.gpu_type, plan.gpus, plan.tp)
                if placement is None:
                    continue
                idx.commit(placement)
                out.append(Decision(job_id=job.job_id, plan=plan, placement=placement))
                break
        return out

    def on_oom(self, job: JobRequest, plan: Plan) -> JobRequest:
        job.restarts += 1
        rest = [p for p in job.plans if p != plan]
        if rest:
            job.plans = rest
        return job
