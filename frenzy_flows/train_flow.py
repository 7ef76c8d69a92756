"""`train_on_pool`: the flow behind each `frenzy-train-<pool>` deployment. A worker of that
pool runs it with the devices the submit flow allocated (job variables set
CUDA_VISIBLE_DEVICES). Run directly (from the UI) without an allocation, it takes one itself
from the ledger, best fit on that pool's GPU type."""
from __future__ import annotations

import os
from typing import Any

from prefect import flow, get_run_logger

from estimator.job import TrainingJob
from estimator.plan import Plan

from . import artifacts
from .results import Assignment
from .tasks import new_job_id
from .training import run_allocated_training


@flow(name="frenzy-train")
def train_on_pool(job: TrainingJob, plan: Plan, assignment: Assignment | None = None,
                  job_id: str | None = None, ledger_url: str | None = None) -> dict[str, Any]:
    from ledger import Ledger

    log = get_run_logger()
    ledger_url = ledger_url or os.environ.get("FRENZY_LEDGER_URL")
    job_id = job_id or new_job_id(job)
    if assignment is None:
        alloc = Ledger(ledger_url).allocate_best_fit(job_id, plan)
        if alloc is None:
            raise RuntimeError(f"no free {plan.gpu_type} GPUs for {plan.short()}")
        assignment = Assignment(allocation_id=str(alloc.id), plan=plan, pool=alloc.pool,
                                gpu_type=alloc.gpu_type, placement=alloc.placement,
                                devices=list(alloc.devices))
    progress = artifacts.progress_start(job.steps)
    result = run_allocated_training(
        job, job_id, plan, assignment, ledger_url=ledger_url, log=log.info,
        on_step=lambda step, total, loss: artifacts.progress_update(progress, step, total, loss))
    return result.model_dump(mode="json")
