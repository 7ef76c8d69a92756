"""Helpers shared by the peer baselines (fifo-user, gavel, sia, tiresias).

Policies must not mutate the ``ClusterState`` they are given: each round works on a private
``scheduler.placement.FreeIndex`` and picks GPUs with the same best-fit placement code as the
live scheduler (``place_best_fit``: exact node, least-remaining node, greedy multi-node).
"""
from __future__ import annotations

from estimator.plan import Plan
from scheduler.placement import FreeIndex, Placement
from scheduler.types import ClusterState, Decision, JobRequest, RunningJob


def free_index(state: ClusterState) -> FreeIndex:
    """A round's private working copy of the free GPUs (the shared placement index)."""
    return FreeIndex(state.nodes)


def take(free: FreeIndex, plan: Plan) -> Placement | None:
    """Best-fit GPUs for ``plan`` (tensor-parallel groups inside a node), taken from ``free``;
    None when they are not free now."""
    placement = free.place_best_fit(plan.gpu_type, plan.gpus, granule=plan.tp)
    if placement is not None:
        free.commit(placement)
    return placement


def plan_at_count(job: JobRequest, gpu_type: str, gpus: int, *, at_least: bool = True) -> Plan | None:
    """The fastest of ``job.plans`` with ``gpus`` GPUs of ``gpu_type``; with ``at_least``, the
    fastest at the smallest count >= ``gpus`` when that exact count has no plan."""
    best: Plan | None = None
    for p in job.plans:
        if p.gpu_type != gpu_type or p.gpus < gpus or (not at_least and p.gpus != gpus):
            continue
        if best is None or (p.gpus, p.step_time_s) < (best.gpus, best.step_time_s):
            best = p
    return best


def plan_for_request(job: JobRequest, gpu_type: str, gpus: int) -> Plan | None:
    """The plan a user-fixed GPU count gets on ``gpu_type``: the fastest at ``gpus`` (or the next
    count up that has a plan); if the type cannot offer that many, the fastest at the largest
    count it offers (a user asking for 64 GPUs of a type the cluster has 16 of gets 16)."""
    plan = plan_at_count(job, gpu_type, gpus)
    if plan is None:
        on_type = [p for p in job.plans if p.gpu_type == gpu_type]
        if on_type:
            top = max(p.gpus for p in on_type)
            plan = min((p for p in on_type if p.gpus == top), key=lambda p: p.step_time_s)
    return plan


def forget_plans_like(job: JobRequest, failed: Plan) -> JobRequest:
    """After an out-of-memory failure, a profiling scheduler (Sia, Gavel's measured throughput
    table, Tiresias' profiler) knows that this much memory does not fit this GPU type: drop the
    failed plan and every plan of that type predicted to need at least as much."""
    job.restarts += 1
    job.plans = [p for p in job.plans
                 if not (p.gpu_type == failed.gpu_type and p.device_used_gib >= failed.device_used_gib)]
    return job


def gpu_types(state: ClusterState) -> list[str]:
    seen: dict[str, None] = {}
    for n in state.nodes:
        seen.setdefault(n.gpu_type, None)
    return list(seen)


def realise(state: ClusterState, running: dict[str, RunningJob],
            targets: list[tuple[JobRequest, Plan | None]]) -> list[Decision]:
    """Turn a round-based policy's target allocation into decisions (Gavel's and Sia's
    mechanism after the LP / ILP).

    ``targets``: every active job with the plan it should run this round, or None. A running
    job whose target keeps its (GPU type, count) keeps its GPUs; one with no target is preempted;
    one that moves is preempted only if its new configuration can actually be placed, otherwise
    it stays where it is if nobody took its GPUs (never preempted into a placement that fails:
    that would livelock a job between rounds). New placements are made largest first.
    """
    free = free_index(state)
    out: list[Decision] = []
    moves: list[tuple[JobRequest, Plan, RunningJob | None]] = []
    for job, plan in targets:
        r = running.get(job.job_id)
        if r is None:
            if plan is not None:
                moves.append((job, plan, None))
            continue
        if plan is None:
            out.append(Decision(job.job_id, None, {}, action="preempt"))
            free.release(r.placement)
        elif (plan.gpu_type, plan.gpus) != (r.plan.gpu_type, r.plan.gpus):
            free.release(r.placement)
            moves.append((job, plan, r))
    moves.sort(key=lambda m: -m[1].gpus)
    placed: dict[str, Placement] = {}
    for job, plan, _ in moves:
        placement = take(free, plan)
        if placement is not None:
            placed[job.job_id] = placement
    for job, plan, r in moves:
        if r is not None and job.job_id not in placed:
            if all(set(devs) <= set(free.free[nid]) for nid, devs in r.placement.items()):
                free.commit(r.placement)         # stay put this round
                continue
            out.append(Decision(job.job_id, None, {}, action="preempt"))
        elif r is not None:
            out.append(Decision(job.job_id, None, {}, action="preempt"))
        if job.job_id in placed:
            out.append(Decision(job.job_id, plan, placed[job.job_id]))
    return out
