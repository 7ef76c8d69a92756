"""Typed results the flows return (also the `frenzy run --json` document)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from estimator.plan import Plan


class Assignment(BaseModel):
    """Where the job runs: the ledger allocation behind it."""

    allocation_id: str
    plan: Plan                                   # the plan the policy placed
    pool: str
    gpu_type: str
    placement: dict[str, list[int]]
    devices: list[str] = Field(default_factory=list)

    @classmethod
    def from_allocation(cls, alloc, plan: Plan) -> "Assignment":
        """From a ledger ``Allocation`` of ``plan``."""
        return cls(allocation_id=str(alloc.id), plan=plan, pool=alloc.pool, gpu_type=alloc.gpu_type,
                   placement=alloc.placement, devices=list(alloc.devices))


def predicted_figures(plan: Plan) -> dict[str, float]:
    """What the estimator and throughput model predicted for ``plan``, as stored and shown
    next to the measurement."""
    return {"allocated_peak_gib": plan.allocated_peak_gib, "reserved_peak_gib": plan.reserved_peak_gib,
            "device_used_gib": plan.device_used_gib, "step_time_s": plan.step_time_s}


class SubmitResult(BaseModel):
    status: Literal["completed", "failed"]
    job_id: str
    job_name: str
    plan: Plan                                   # the plan the job finished on
    initial_plan: Plan                           # the plan assignment chose (differs after a fallback)
    allocation: Assignment
    estimate: dict[str, Any]                     # estimator.Estimate of `plan`, as a dict
    plans: dict[str, list[Plan]]                 # candidate plans per GPU type
    losses: list[float] = Field(default_factory=list)
    attempts: list[dict[str, Any]] = Field(default_factory=list)
    measured: dict[str, Any] = Field(default_factory=dict)
    checkpoint_dir: str | None = None
    flow_run_id: str | None = None
    error: str | None = None
