"""``tiresias``: two-dimensional least-attained-service (Gu et al., NSDI'19), discretised.

Priority is the service a job has attained in GPU-seconds (GPUs x time run), without any
knowledge of job duration. Jobs sit in ``len(QUEUE_LIMITS_GPU_S) + 1`` queues by attained
service; FIFO (by submission) inside a queue; a waiting job preempts running jobs of strictly
lower queues when it cannot otherwise start; a job that has waited longer than
``STARVE_FACTOR`` times its run time so far is promoted to the top queue.

Heterogeneity-agnostic: a job uses the GPU count its author asked for, on whichever GPU type
has the most free GPUs (GPU speed is ignored; memory feasibility comes from the job's plans,
i.e. the profiler knows what fits).
"""
from __future__ import annotations

from estimator.plan import Plan
from scheduler.placement import FreeIndex
from scheduler.types import ClusterState, Decision, JobRequest, Policy

from .baseline_common import free_index, take, forget_plans_like, gpu_types, plan_for_request

QUEUE_LIMITS_GPU_S = (3_600.0, 36_000.0)   # 1 and 10 GPU-hours of attained service
STARVE_FACTOR = 2.0


class Tiresias(Policy):
    name = "tiresias"
    restarts_runs = True

    def __init__(self) -> None:
        self._reqs: dict[str, JobRequest] = {}       # running jobs, as last seen pending
        self._stopped_at: dict[str, float] = {}      # when a job last stopped running

    def _queue(self, attained: float, waited: float, ran: float) -> int:
        if ran > 0 and waited > STARVE_FACTOR * ran:
            return 0
        q = 0
        for limit in QUEUE_LIMITS_GPU_S:
            if attained >= limit:
                q += 1
        return q

    def _plans(self, job: JobRequest, free: FreeIndex, types: list[str]) -> list[Plan]:
        want = job.requested_gpus or 1
        cands = [p for p in (plan_for_request(job, t, want) for t in types) if p is not None]
        return sorted(cands, key=lambda p: -free.free_gpus(p.gpu_type))   # type-blind: most free first

    def schedule(self, pending: list[JobRequest], state: ClusterState, now: float) -> list[Decision]:
        free = free_index(state)
        types = gpu_types(state)
        running = {r.job_id: r for r in state.running}
        for jid in list(self._reqs):
            if jid not in running:
                self._reqs.pop(jid)
        # running jobs' priorities, lowest priority first (preemption victims)
        victims = []
        for r in running.values():
            req = self._reqs.get(r.job_id)
            attained = (req.attained_gpu_s if req else 0.0) + r.plan.gpus * (now - r.start_s)
            q = self._queue(attained, 0.0, 0.0)
            victims.append((q, r.start_s, r))
        victims.sort(key=lambda v: (-v[0], -v[1]))
        out: list[Decision] = []
        preempted: set[str] = set()

        def prio(j: JobRequest):
            waited = now - self._stopped_at.get(j.job_id, j.submit_s)
            ran = j.attained_gpu_s / max(1, j.requested_gpus or 1)
            return (self._queue(j.attained_gpu_s, waited, ran), j.submit_s, j.job_id)

        for job in sorted(pending, key=prio):
            q = prio(job)[0]
            plans = self._plans(job, free, types)
            placed = None
            for plan in plans:
                placement = take(free, plan)
                if placement is not None:
                    placed = (plan, placement)
                    break
            if placed is None:
                for plan in plans:       # preempt strictly lower queues on this plan's type
                    cand = [v for v in victims if v[0] > q and v[2].job_id not in preempted
                            and v[2].plan.gpu_type == plan.gpu_type]
                    if sum(v[2].plan.gpus for v in cand) + free.free_gpus(plan.gpu_type) < plan.gpus:
                        continue
                    chosen = []
                    for v in cand:
                        free.release(v[2].placement)
                        chosen.append(v[2])
                        placement = take(free, plan)
                        if placement is not None:
                            placed = (plan, placement)
                            break
                    if placed is None:   # undo the trial
                        for r in chosen:
                            free.commit(r.placement)
                        continue
                    for r in chosen:
                        preempted.add(r.job_id)
                        self._stopped_at[r.job_id] = now
                        out.append(Decision(r.job_id, None, {}, action="preempt"))
                    break
            if placed is not None:
                plan, placement = placed
                out.append(Decision(job.job_id, plan, placement))
                self._reqs[job.job_id] = job
        return out

    def on_oom(self, job: JobRequest, plan: Plan) -> JobRequest:
        return forget_plans_like(job, plan)
