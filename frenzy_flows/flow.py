"""`frenzy-submit`: the flow a user runs from the UI, a schedule, or Python. They hand in a job;
it estimates, selects GPU types among the registered pools, assigns GPUs on the ledger, and
trains."""
from __future__ import annotations

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run
from pydantic import SecretStr

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.plan import Plan
from estimator.plans import DEFAULT_SAFETY_MARGIN_GIB, estimate_plan
from scheduler.discover import cluster_or_local

from frenzy_flows import artifacts, dispatch, events
from frenzy_flows.lifetime import allocation_lifetime
from frenzy_flows.results import Assignment, SubmitResult, predicted_figures, training_fields
from frenzy_flows.tasks import (assign, estimate_memory, fastest, load_settings, new_job_id,
                                secret_value, select_resources, with_site_defaults)
from frenzy_flows.train_flow import train_on_pool


async def _registered_pools() -> list[str]:
    from prefect import get_client

    async with get_client() as client:
        return [p.name for p in await client.read_work_pools()]


@task(name="train")
def train(job: TrainingJob, job_id: str, plan: Plan, assignment: Assignment,
          ledger_url: str | None, inventory: dict[str, int], settings: str | None = None) -> dict:
    """Train on the assignment: on the pool's workers when any are online, else in-process as
    the same `frenzy-train` flow (a subflow). Either way the run holds the pool's `gpu:<pool>`
    slots, so Prefect's count of busy GPUs agrees with the ledger."""
    if dispatch.has_workers(assignment.pool):
        get_run_logger().info("dispatching to work pool %s", assignment.pool)
        return dispatch.dispatch_to_pool(job, plan, assignment, job_id=job_id, ledger_url=ledger_url,
                                         settings=settings, timeout_s=job.deadline_s)
    with dispatch.hold_gpu_slots(assignment.pool, plan.gpus, ledger_url=ledger_url):
        return train_on_pool(job, plan, assignment=assignment, job_id=job_id,
                             ledger_url=ledger_url, inventory=inventory, settings=settings)


@flow(name="frenzy-submit", log_prints=False)
def submit_training(job: TrainingJob, cluster: str | None = None, policy: str | None = None,
                    safety_margin_gib: float | None = None, ledger_url: SecretStr | None = None,
                    wait_timeout_s: float = 3600.0, settings: str | None = None) -> SubmitResult:
    """Train ``job`` without naming a GPU.

    ``cluster``: a cluster YAML path (pools per GPU type); default: the GPUs NVML finds here,
    or a local CPU pool. ``ledger_url``: SQLAlchemy URL of the GPU ledger (default: env
    FRENZY_LEDGER_URL, else SQLite under FRENZY_HOME, as `ledger.Ledger` decides).
    ``settings``: a `FrenzySettings` block name; its ledger URL, safety margin, policy and
    out-of-memory fallback order apply where the call leaves them unset, its default
    precision and optimizer where the job leaves them unset."""
    from ledger import Ledger
    from prefect.utilities.asyncutils import run_coro_as_sync

    from trainer import allowlist
    from trainer.pretrained import check_job
    from trainer.tracking import with_tracking_default

    log = get_run_logger()
    site = load_settings(settings)
    allowlist.configure_from(site)       # the site's data roots and entry-point modules
    job = with_tracking_default(with_site_defaults(job, site), site)
    check_job(job)              # starting point, LoRA targets, QLoRA support: before any GPU is taken
    ledger_url = secret_value(ledger_url) or (site.ledger_url_value() if site else None)
    policy = policy or (site.policy if site else "frenzy")
    if safety_margin_gib is None:
        safety_margin_gib = (site.safety_margin_gib if site and site.safety_margin_gib is not None
                             else DEFAULT_SAFETY_MARGIN_GIB)
    topology = cluster_or_local(cluster)
    Ledger(ledger_url).sync_cluster(topology)
    job_id = new_job_id(job)

    plans_by_type = estimate_memory(job, topology, safety_margin_gib)
    best = fastest(plans_by_type)
    gpus = topology.gpu_catalog()
    artifacts.memory_breakdown(estimate_plan(job, best, gpus=gpus), best)

    registered = run_coro_as_sync(_registered_pools())
    candidates = select_resources(job, plans_by_type, topology, registered)
    # from the grant to the end of the run, every allocation of the job is released on the way out
    with allocation_lifetime(ledger_url, job_id, log=log.warning):
        assignment = assign(job, job_id, candidates, ledger_url, policy=policy,
                            wait_timeout_s=wait_timeout_s)
        chosen = assignment.plan
        artifacts.plans_table(plans_by_type, chosen, steps=job.steps,
                              pool_notes=dispatch.pool_notes(topology))
        events.placed(job.name, chosen, assignment)

        try:
            trained = train(job, job_id, chosen, assignment, ledger_url, topology.inventory(), settings)
            # the trainer reports a run that ran out of fallbacks or time; it does not raise
            ok = trained.get("status") in ("completed", "stopped")
            status, error = (trained["status"], None) if ok else ("failed", trained.get("error") or trained.get("status"))
        except FrenzyInputError:
            raise
        except Exception as err:  # the run failed for good: report it, GPUs already released
            log.error("training failed: %s", err)
            trained, status, error = {}, "failed", str(err)

    final = Plan.model_validate(trained["final_plan"]) if trained.get("final_plan") else chosen
    measured = trained.get("measured", {})
    artifacts.summary(final, predicted_figures(final), measured)
    artifacts.training_record(trained)          # MLflow link and loss curve
    result = SubmitResult(
        status=status, job_id=job_id, job_name=job.name, plan=final, initial_plan=chosen,
        allocation=assignment, estimate=estimate_plan(job, final, gpus=gpus).model_dump(mode="json"),
        plans=plans_by_type, losses=trained.get("losses", []), attempts=trained.get("attempts", []),
        measured=measured, checkpoint_dir=trained.get("checkpoint_dir"),
        flow_run_id=str(flow_run.id) if flow_run.id else None, error=error, **training_fields(trained))
    if status == "failed":
        raise RuntimeError(f"job {job.name} failed: {error}")
    return result
