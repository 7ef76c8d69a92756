"""The stages of a submission, each a Prefect task:
estimate_memory -> select_resources -> enqueue -> assign (``wait_for_gpus``: the GPUs the
scheduler grants) here, then ``train`` (``frenzy_flows.flow``).

The logic lives in the pure core (estimator, scheduler) and the edges (ledger, trainer); these
tasks only wire it to Prefect: logging, artifacts, events, retries."""
from __future__ import annotations

import uuid
from prefect import get_run_logger, task
from pydantic import SecretStr

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.models import resolve_model
from estimator.plan import Plan
from estimator.plans import plans_for_job
from scheduler.cluster import Cluster
from scheduler.restart import checkpoint_gb
from trainer.fallback import launch_refusal, realisable

from frenzy_flows.results import Assignment


@task(name="estimate_memory")
def estimate_memory(job: TrainingJob, cluster: Cluster, safety_margin_gib: float,
                    plan_filter: str | None = None) -> dict[str, list[Plan]]:
    """Per-GPU memory of every feasible plan on every GPU type of the cluster; with
    ``plan_filter`` (``--plan`` knobs) of those that match it (a bad filter, a tp or cp the
    model's heads do not split into, or no match: one line naming it)."""
    from estimator.plan_filter import filter_plans, parse_plan_filter

    log = get_run_logger()
    flt = parse_plan_filter(plan_filter) if plan_filter else None
    plans = plans_for_job(job, cluster.inventory(), gpus_per_node=cluster.gpus_per_node(),
                          host_ram_gib=cluster.host_ram_gib(), plan_filter=flt,
                          safety_margin_gib=safety_margin_gib, gpus=cluster.gpu_catalog())
    plans = filter_plans(plans, flt, cluster.gpus_per_node())
    n = sum(len(v) for v in plans.values())
    log.info("estimated %d feasible plans over %d GPU types%s", n, len(plans),
             f" matching --plan {plan_filter!r}" if plan_filter else "")
    return plans


@task(name="select_resources")
def select_resources(job: TrainingJob, plans_by_type: dict[str, list[Plan]], cluster: Cluster,
                     registered_pools: list[str]) -> dict[str, list[Plan]]:
    """Keep the GPU types that have a registered Prefect work pool, satisfy the job's
    constraints and can hold the job; say why each other type was dropped."""
    log = get_run_logger()
    by_type_pools: dict[str, list[str]] = {}
    for pool in cluster.pools:
        if pool.name in registered_pools:
            by_type_pools.setdefault(pool.gpu, []).append(pool.name)
    kept: dict[str, list[Plan]] = {}
    dropped: dict[str, str] = {}            # GPU type -> why, for the one-line refusal
    for gpu_type, plans in plans_by_type.items():
        if gpu_type not in by_type_pools:
            dropped[gpu_type] = "no Prefect work pool registered for it"
        elif job.allowed_gpu_types and gpu_type not in job.allowed_gpu_types:
            dropped[gpu_type] = "not in the job's allowed_gpu_types"
        elif not plans:
            have = cluster.inventory().get(gpu_type, 0)
            if job.max_gpus:
                have = min(have, job.max_gpus)           # the planner looked no further
            dropped[gpu_type] = (f"no plan fits in memory on the {have} GPU{'s' if have != 1 else ''} "
                                 "of this type the cluster has" + (" (up to the job's max_gpus)" if job.max_gpus else ""))
        elif not (fit := [p for p in plans if job.max_gpus is None or p.gpus <= job.max_gpus]):
            dropped[gpu_type] = f"every feasible plan needs more than max_gpus={job.max_gpus}"
        elif not (runnable := [p for p in fit if realisable(p)]):
            # the planner marks each plan the trainer cannot launch with its reason
            dropped[gpu_type] = launch_refusal(fit)
        else:
            kept[gpu_type] = runnable
            continue
        log.info("%s: %s", gpu_type, dropped[gpu_type])
    if not kept:
        raise FrenzyInputError(
            "job", "no registered GPU pool can run it under its constraints: "
                   + "; ".join(f"{t}: {why}" for t, why in dropped.items())
                   + f" (registered pools: {', '.join(registered_pools) or 'none'})")
    log.info("selected GPU types: %s", ", ".join(f"{t} ({len(p)} plans)" for t, p in kept.items()))
    return kept


@task(name="enqueue")
def enqueue(job: TrainingJob, job_id: str, candidates: dict[str, list[Plan]], ledger_url: SecretStr | str | None,
            policy: str = "frenzy", embedded_scheduler: bool = True) -> str:
    """Put the job in the ledger's queue with its candidate plans (fastest first). With
    ``embedded_scheduler`` this process also runs a scheduler thread, which stands by while
    another scheduler (a site's ``frenzy scheduler``) leads: a laptop needs nothing else."""
    from ledger import Ledger
    from ledger.queue import JobQueue

    log = get_run_logger()
    ledger = Ledger(secret_value(ledger_url))
    plans = sorted((p for ps in candidates.values() for p in ps), key=lambda p: p.step_time_s)
    JobQueue(ledger).enqueue(job_id, job.name, job.model_dump(mode="json"), plans, steps=job.steps,
                             model=job.model if isinstance(job.model, str) else "custom",
                             checkpoint_gb=checkpoint_gb(resolve_model(job.model).params))
    if embedded_scheduler:
        from frenzy_scheduler import ensure_embedded_scheduler
        from frenzy_scheduler.publish import emit_decision, publish_queue

        svc = ensure_embedded_scheduler(secret_value(ledger_url), policy, publish=emit_decision, on_queue=publish_queue)
        log.info("queued %s with %d plans; embedded scheduler %s (%s)", job_id, len(plans),
                 svc.leadership.holder, "leading" if svc.leading else "starting or standing by")
    else:
        log.info("queued %s with %d plans; waiting for the site's scheduler", job_id, len(plans))
    return job_id


@task(name="assign")          # the stage that assigns the job its GPUs (the scheduler decides)
def wait_for_gpus(job: TrainingJob, job_id: str, ledger_url: SecretStr | str | None,
                  wait_timeout_s: float = 3600.0) -> Assignment:
    """Wait for the allocation the scheduler writes for the job (``wait_timeout_s``: then a
    TimeoutError that says what it waited for)."""
    from ledger import Ledger
    from ledger.queue import JobQueue

    from frenzy_flows.training import wait_for_allocation

    log = get_run_logger()
    assignment = wait_for_allocation(JobQueue(Ledger(secret_value(ledger_url))), job_id, timeout_s=wait_timeout_s,
                                     log=log.info, what=job.name)
    log.info("assigned %s on %s", assignment.plan.short(), assignment.placement)
    return assignment


def load_settings(name: str | None):
    """The `FrenzySettings` block called ``name`` (site defaults edited in the UI), or None."""
    if not name:
        return None
    from blocks import FrenzySettings

    return FrenzySettings.load(name)


def with_site_defaults(job: TrainingJob, site) -> TrainingJob:
    """The job with the `FrenzySettings` block's default precision and optimizer where the job
    itself does not set them (a field the submitter set always wins)."""
    if site is None:
        return job
    update = {field: value for field, value in (("precision", site.default_precision),
                                                ("optimizer", site.default_optimizer))
              if field not in job.model_fields_set}
    return job.model_copy(update=update) if update else job


def secret_value(value: SecretStr | str | None) -> str | None:
    """Ledger URLs may hold a password: flows take them as SecretStr and unwrap them only here."""
    return value.get_secret_value() if isinstance(value, SecretStr) else value


def as_secret(value: SecretStr | str | None) -> SecretStr | None:
    """A ledger URL as a SecretStr (what flow and task parameters carry), None when empty."""
    if isinstance(value, SecretStr):
        return value if value.get_secret_value() else None
    return SecretStr(value) if value else None


def new_job_id(job: TrainingJob) -> str:
    return f"{job.name}-{uuid.uuid4().hex[:8]}"

