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
