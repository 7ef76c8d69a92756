"""Run a job's training on an allocation, keeping the ledger in step: lease heartbeats while it
runs, a new allocation when an out-of-memory fallback needs other GPUs, the measurement next to
the prediction at the end, and every GPU released whatever happens.

Called in-process by the submit flow's `train` task (embedded default) and by the
`train_on_pool` flow that pool workers run: one implementation for both."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Callable

from estimator.home import frenzy_home
from estimator.job import TrainingJob
from estimator.plan import Plan

from frenzy_flows.results import Assignment, predicted_figures


def runs_dir() -> Path:
    return frenzy_home() / "runs"


def run_allocated_training(job: TrainingJob, job_id: str, plan: Plan, assignment: Assignment, *,
                           ledger_url: str | None, log: Callable[[str], None],
                           inventory: dict[str, int] | None = None,
                           on_step: Callable[[int, int, float], None] | None = None,
                           fallbacks=None):
    """Train ``job`` on ``assignment``; returns ``trainer.runner.TrainResult``. ``fallbacks``:
    the out-of-memory fallback plans to try (default: the trainer's own ladder)."""
    from ledger import Ledger
    from trainer.resume import prepare_run_dir
    from trainer.runner import run_training

    ledger = Ledger(ledger_url)
    current = {"alloc_id": assignment.allocation_id, "plan": plan, "devices": assignment.devices,
               "first": True}
    leases = contextlib.ExitStack()

    def acquire(p: Plan) -> list[str]:
        if current["first"] and p == current["plan"]:
            current["first"] = False
        else:
            release()
            alloc = ledger.allocate_best_fit(job_id, p)
            if alloc is None:
                raise RuntimeError(f"no free GPUs for fallback plan {p.short()}")
            current.update(alloc_id=str(alloc.id), plan=p, devices=list(alloc.devices))
            log(f"fallback allocation {alloc.id}: {p.short()} on {alloc.placement}")
        leases.enter_context(ledger.lease(current["alloc_id"]))
        return list(current["devices"])

    def release() -> None:
        leases.close()
        if current["alloc_id"]:
            ledger.release(current["alloc_id"])

    try:
        run_dir = prepare_run_dir(job, job_id, runs_dir())  # a resubmission continues its last checkpoint
        run_dir.mkdir(parents=True, exist_ok=True)
        result = run_training(job, plan, run_dir=run_dir, acquire=acquire, release=release, log=log,
                              on_step=on_step, inventory=inventory,
                              deadline_s=job.deadline_s, fallbacks=fallbacks)
        final = result.final_plan
        try:
            ledger.record_measurement(job_id, current["alloc_id"], final.gpu_type, final,
                                      predicted=predicted_figures(final),
                                      measured=result.measured.model_dump())
        except Exception as err:       # the ledger down at the end: the training still happened
            log(f"frenzy: measurement not recorded ({type(err).__name__}: {str(err)[:200]})")
        return result
    finally:
        try:
            release()
        except Exception as err:       # never replaces the result or the error; the lease runs out
            log(f"frenzy: could not release the allocation ({type(err).__name__}: {str(err)[:200]}); "
                f"its lease runs out on its own")
