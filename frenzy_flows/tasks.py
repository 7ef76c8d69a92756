"""The four stages of a submission, each a Prefect task:
estimate_memory -> select_resources -> assign -> train.

The logic lives in the pure core (estimator, scheduler) and the edges (ledger, trainer); these
tasks only wire it to Prefect: logging, artifacts, events, retries."""
from __future__ import annotations

import time
import uuid
from prefect import get_run_logger, task
from pydantic import SecretStr

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.models import resolve_model
from estimator.plan import Plan
from estimator.plans import plans_for_job
from scheduler.cluster import Cluster
from scheduler.policies import get_policy
from scheduler.restart import checkpoint_gb
from scheduler.types import JobRequest
from trainer.fallback import realisable

from frenzy_flows.results import Assignment


def fastest(plans_by_type: dict[str, list[Plan]]) -> Plan:
    return min((p for ps in plans_by_type.values() for p in ps), key=lambda p: p.step_time_s)


@task(name="estimate_memory")
def estimate_memory(job: TrainingJob, cluster: Cluster, safety_margin_gib: float) -> dict[str, list[Plan]]:
    """Per-GPU memory of every feasible plan on every GPU type of the cluster."""
    log = get_run_logger()
    plans = plans_for_job(job, cluster.inventory(), gpus_per_node=cluster.gpus_per_node(),
                          safety_margin_gib=safety_margin_gib, gpus=cluster.gpu_catalog())
    n = sum(len(v) for v in plans.values())
    log.info("estimated %d feasible plans over %d GPU types", n, len(plans))
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
    for gpu_type, plans in plans_by_type.items():
        if gpu_type not in by_type_pools:
            log.info("%s: no Prefect work pool registered for it", gpu_type)
            continue
        if job.allowed_gpu_types and gpu_type not in job.allowed_gpu_types:
            log.info("%s: not in the job's allowed_gpu_types", gpu_type)
            continue
        fit = [p for p in plans if job.max_gpus is None or p.gpus <= job.max_gpus]
        if not fit:
            log.info("%s: every feasible plan needs more than max_gpus=%s", gpu_type, job.max_gpus)
            continue
        # The trainer runs data parallel with ZeRO/offload; tp/pp/cp plans stay in the
        # estimate and the simulator but cannot be launched yet.
        runnable = [p for p in fit if realisable(p)]
        if not runnable:
            log.info("%s: only tensor/pipeline/context-parallel plans fit, which the trainer "
                     "cannot launch yet", gpu_type)
            continue
        kept[gpu_type] = runnable
    if not kept:
        raise FrenzyInputError(
            "job", "no registered GPU pool can run it under its constraints "
                   f"(registered pools: {', '.join(registered_pools) or 'none'}; "
                   f"GPU types that fit: {', '.join(plans_by_type) or 'none'})")
    log.info("selected GPU types: %s", ", ".join(f"{t} ({len(p)} plans)" for t, p in kept.items()))
    return kept


def live_policy(name: str):
    """The policy for one live submission. It sees running jobs it cannot stop (other flows'
    runs), so the knobs that restart running jobs (preemption, growth, shrinking) are switched
    off where a policy has them; the same policy class runs unchanged in the simulator."""
    import inspect

    from scheduler.policies import POLICIES

    factory = POLICIES.get(name)
    params = inspect.signature(factory).parameters if factory else {}
    return get_policy(name, **{k: False for k in ("preemption", "grow", "shrink") if k in params})


@task(name="assign")
def assign(job: TrainingJob, job_id: str, candidates: dict[str, list[Plan]], ledger_url: SecretStr | str | None,
           policy: str = "frenzy", wait_timeout_s: float = 3600.0, lease_s: float = 300.0) -> Assignment:
    """Ask the scheduling policy for a placement on the ledger's current free GPUs and record
    the allocation atomically. Waits (re-planning as leases expire and GPUs free up) when the
    policy prefers to wait for a better GPU type than to start now on a worse one."""
    from ledger import Ledger

    log = get_run_logger()
    ledger = Ledger(secret_value(ledger_url))
    pol = live_policy(policy)
    plans = [p for ps in candidates.values() for p in ps]
    # With the job's step count on record, its allocation carries a predicted end, so later
    # submitters' policies can plan their waits around this run.
    ledger.submit_job(job_id, job.name, {**job.model_dump(mode="json"), "train_steps": job.steps})
    ledger.record_plans(job_id, sorted(plans, key=lambda p: p.step_time_s))
    ckpt_gb = checkpoint_gb(resolve_model(job.model).params)
    submit_s = time.time()
    deadline = submit_s + wait_timeout_s
    delay = 1.0
    while True:
        ledger.expire_leases()
        state = ledger.cluster_state()
        request = JobRequest(job_id=job_id, submit_s=submit_s, plans=plans, steps_left=job.steps,
                             model=job.model if isinstance(job.model, str) else "custom",
                             checkpoint_gb=ckpt_gb)
        free = {(n.node_id, i) for n in state.nodes for i in n.free}
        for decision in pol.schedule([request], state, time.time()):
            if decision.action != "start" or decision.job_id != job_id:
                continue
            if any((node, i) not in free for node, ids in decision.placement.items() for i in ids):
                continue        # would need a running job stopped: wait for it to end instead
            try:
                alloc = ledger.allocate(job_id, decision.plan, decision.placement, lease_s=lease_s)
            except Exception as err:  # another submitter took a GPU between read and write
                log.info("placement raced with another submitter (%s); re-planning", err)
                break
            log.info("assigned %s on %s", decision.plan.short(), decision.placement)
            return Assignment.from_allocation(alloc, decision.plan)
        if time.time() > deadline:
            raise TimeoutError(f"no GPUs for job {job.name} within {wait_timeout_s:.0f} s")
        log.info("waiting for GPUs (%d running allocations); next look in %.0f s",
                 len(state.running), delay)
        time.sleep(delay)
        delay = min(delay * 2, 30.0)


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

