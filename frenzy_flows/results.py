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

    def trains_where(self, other: "Assignment") -> bool:
        """Whether a run launched for ``other`` lands where this one-node assignment's process
        trains: the same pool and its one node. Anything else (another pool: another GPU type's
        workers; another node: that node's work queue; several nodes: a gang) must be launched
        by the submit flow, not relaunched in this process on devices that are not its own."""
        return (other.pool == self.pool and len(self.placement) == 1
                and set(other.placement) == set(self.placement))


def with_placed_nodes(plan: Plan, placement: dict[str, list[int]]) -> Plan:
    """``plan`` with ``nodes`` = the nodes of its placement, as many as a gang starts flow runs
    (``gang.gang_nodes``): a scheduler that spreads a plan over more nodes than the planner
    counted reports the nodes it ran on. A placement not holding the plan's GPUs (the plan of a
    fallback to another count) leaves the plan as it is."""
    if not placement or sum(len(v) for v in placement.values()) != plan.gpus:
        return plan
    return plan.model_copy(update={"nodes": len(placement)})


def predicted_figures(plan: Plan) -> dict[str, float]:
    """What the estimator and throughput model predicted for ``plan``, as stored and shown
    next to the measurement."""
    return {"allocated_peak_gib": plan.allocated_peak_gib, "reserved_peak_gib": plan.reserved_peak_gib,
            "device_used_gib": plan.device_used_gib, "step_time_s": plan.step_time_s}


class SubmitResult(BaseModel):
    status: Literal["completed", "failed", "stopped"]      # stopped: a control-file stop (deadline, re-size)
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
    # what the trainer reports beyond losses (trainer.runner.TrainResult), see training_fields
    export_dir: str | None = None                # Hugging Face export: from_pretrained(export_dir)
    eval_losses: list[dict[str, Any]] = Field(default_factory=list)   # [{"step", "loss"}]
    trainable_params: int | None = None
    params: int | None = None
    optimizer_impl: str | None = None            # the optimizer implementation that ran (trainer.optim)
    stop: dict[str, Any] | None = None           # {"step", "reason", "request_id"} of a stopped run
    mlflow_run_id: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_url: str | None = None
    run_dir: str | None = None
    ledger_error: str | None = None              # the ledger was unreachable at the end (lease left to expire)


TRAINING_FIELDS = ("export_dir", "eval_losses", "trainable_params", "params", "optimizer_impl", "stop", "mlflow_run_id",
                   "mlflow_tracking_uri", "mlflow_url", "run_dir", "ledger_error")


def training_fields(trained: dict[str, Any]) -> dict[str, Any]:
    """The SubmitResult fields taken as they are from a TrainResult dump."""
    return {k: trained[k] for k in TRAINING_FIELDS if trained.get(k) is not None}
