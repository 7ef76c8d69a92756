"""Prefect events Frenzy emits, so automations can react to placements and OOM fallbacks.

Resource: ``frenzy.job.<job name>``, labelled ``frenzy.job_id`` where the job id is known (names
repeat across submissions; the scheduler's decisions carry the same label); related: the pool
(role ``work-pool``) and the GPU type (role ``gpu-type``). Inside a run Prefect adds the
flow/task run as related resources itself.
Resource labels are strings (Prefect's rule); structured details go in the payload.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Mapping

from estimator.plan import Plan

PLACED = "frenzy.job.placed"
OOM_FALLBACK = "frenzy.job.oom-fallback"


def _alloc_fields(allocation: Any) -> dict[str, Any]:
    """The parts of a ledger Allocation (or a dict with the same keys) worth publishing."""
    if allocation is None:
        return {}
    get = (allocation.get if isinstance(allocation, Mapping)
           else lambda k, d=None: getattr(allocation, k, d))
    out = {k: get(k) for k in ("allocation_id", "id", "pool", "gpu_type", "devices", "placement")}
    out = {k: v for k, v in out.items() if v is not None}
    if "id" in out:      # a ledger Allocation calls it id, the flow's Assignment allocation_id
        out.setdefault("allocation_id", str(out.pop("id")))
    return out


def job_resource(job_name: str, **labels: str) -> dict[str, str]:
    return {"prefect.resource.id": f"frenzy.job.{job_name}", "prefect.resource.name": job_name,
            **{k: str(v) for k, v in labels.items()}}


def _related(pool: str | None, gpu_type: str | None) -> list[dict[str, str]]:
    rel = []
    if pool:
        rel.append({"prefect.resource.id": f"frenzy.pool.{pool}", "prefect.resource.role": "work-pool",
                    "prefect.resource.name": pool})
    if gpu_type:
        rel.append({"prefect.resource.id": f"frenzy.gpu-type.{gpu_type}",
                    "prefect.resource.role": "gpu-type", "prefect.resource.name": gpu_type})
    return rel


def _id_label(job_id: str | None) -> dict[str, str]:
    return {"frenzy.job_id": job_id} if job_id else {}


def placed(job_name: str, plan: Plan, allocation: Any, *, job_id: str | None = None):
    """Emit ``frenzy.job.placed``: the job got ``allocation`` for ``plan``. Returns the Event."""
    from prefect.events import emit_event

    alloc = _alloc_fields(allocation)
    pool = alloc.get("pool")
    return emit_event(
        event=PLACED,
        resource=job_resource(job_name, **{"frenzy.gpu_type": plan.gpu_type, "frenzy.gpus": plan.gpus,
                                           **({"frenzy.pool": pool} if pool else {}), **_id_label(job_id)}),
        related=_related(pool, plan.gpu_type),
        payload={"plan": plan.model_dump(mode="json"), "allocation": alloc})


def oom_fallback(job_name: str, from_plan: Plan, to_plan: Plan | None, step: int, *,
                 job_id: str | None = None):
    """Emit ``frenzy.job.oom-fallback``: training ran out of memory at ``step`` on ``from_plan``
    and continues with ``to_plan`` (None: no fallback left). Returns the Event."""
    from prefect.events import emit_event

    return emit_event(
        event=OOM_FALLBACK,
        resource=job_resource(job_name, **{"frenzy.gpu_type": from_plan.gpu_type,
                                           "frenzy.to_gpu_type": to_plan.gpu_type if to_plan else "none",
                                           **_id_label(job_id)}),
        related=_related(None, from_plan.gpu_type),
        payload={"step": int(step), "from_plan": from_plan.model_dump(mode="json"),
                 "to_plan": to_plan.model_dump(mode="json") if to_plan else None})


def announced_fallbacks(job: Any, plan: Plan, *, inventory: dict[str, int] | None = None,
                        last_step: Callable[[], int] | None = None,
                        plans: Iterable[Plan] | None = None, job_id: str | None = None) -> Iterator[Plan]:
    """The out-of-memory fallback plans for ``plan`` (``trainer.fallback.fallback_plans`` unless
    ``plans`` is given), emitting ``frenzy.job.oom-fallback`` at the moment each one is taken,
    and once more with no target when none is left.

    Pass it as ``trainer.runner.run_training(..., fallbacks=...)``: the runner asks for the next
    plan exactly when an attempt ran out of memory. ``last_step`` returns the last step the run
    reported (e.g. tracked in the ``on_step`` hook)."""
    if plans is None:
        from trainer.fallback import fallback_plans
        plans = fallback_plans(job, plan, inventory=inventory)
    name = job.name if hasattr(job, "name") else str(job["name"])
    current = plan
    for nxt in plans:
        oom_fallback(name, current, nxt, last_step() if last_step else 0, job_id=job_id)
        yield nxt
        current = nxt
    oom_fallback(name, current, None, last_step() if last_step else 0, job_id=job_id)
