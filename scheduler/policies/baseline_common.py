"""Helpers shared by the peer baselines (fifo-user, gavel, sia, tiresias).

Policies must not mutate the ``ClusterState`` they are given: each round works on a private
``scheduler.placement.FreeIndex`` and picks GPUs with the same best-fit placement code as the
live scheduler (``place_best_fit``: exact node, least-remaining node, greedy multi-node).
"""
from __future__ import annotations

from estimator.plan import Plan
from scheduler.placement import FreeIndex, Placement
from scheduler.types import ClusterState, JobRequest


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
