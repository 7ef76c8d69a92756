"""``fifo-user``: the status quo. Each job runs on the GPU type and count its author asked for,
first come first served, no backfill: the head of the queue waits until its GPUs are free and
everyone behind it waits too. An out-of-memory run is resubmitted with twice the GPUs, as a
user would do.

The author's plan is the fastest plan the estimator knows at exactly the requested type and
count (a competent user). If the cluster has fewer GPUs of that type than requested (or none
fits at that count), the smallest count above it on that type is used; if the type has no plan
at all, the request is impossible and the job is skipped rather than blocking the queue forever.
"""
from __future__ import annotations

from estimator.plan import Plan
from scheduler.types import ClusterState, Decision, JobRequest, Policy

from .baseline_common import free_index, plan_for_request, take


def user_plan(job: JobRequest) -> Plan | None:
    gtype = job.requested_gpu_type
    want = job.requested_gpus or 1
    if gtype is None:
        return None
    return plan_for_request(job, gtype, want)


class FifoUser(Policy):
    name = "fifo-user"

    def schedule(self, pending: list[JobRequest], state: ClusterState, now: float) -> list[Decision]:
        free = free_index(state)
        out: list[Decision] = []
        for job in sorted(pending, key=lambda j: (j.submit_s, j.job_id)):
            plan = user_plan(job)
            if plan is None:
                continue            # impossible request: never runnable, must not block the queue
            placement = take(free, plan)
            if placement is None:
                break               # FCFS without backfill
            out.append(Decision(job.job_id, plan, placement))
        return out

    def on_oom(self, job: JobRequest, plan: Plan) -> JobRequest:
        job.restarts += 1
        job.requested_gpu_type = plan.gpu_type
        job.requested_gpus = 2 * plan.gpus
        return job
