"""`frenzy-submit`: the flow a user runs from the UI, a schedule, or Python. They hand in a job;
it estimates, selects GPU types among the registered pools, assigns GPUs on the ledger, and
trains."""
from __future__ import annotations

import time
from typing import Annotated

from prefect import flow, get_run_logger, task
from prefect.runtime import flow_run
from pydantic import SecretStr

from blocks.cluster import GPUCluster
from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.plan import Plan
from estimator.plans import DEFAULT_SAFETY_MARGIN_GIB, estimate_plan
from scheduler.discover import cluster_or_local, is_control_machine_pool

from frenzy_flows import artifacts, dispatch, events
from frenzy_flows.form import RunForm
from frenzy_flows.hub import fetch_hub_models
from frenzy_flows.lifetime import allocation_lifetime
from frenzy_flows.results import Assignment, SubmitResult, predicted_figures, training_fields, with_placed_nodes
from frenzy_flows.tasks import (as_secret, enqueue, estimate_memory, load_settings, new_job_id,
                                secret_value, select_resources, wait_for_gpus, with_site_defaults)
from frenzy_flows.train_flow import train_on_pool
from frenzy_flows.training import merge_results


async def _registered_pools() -> list[str]:
    from prefect import get_client

    async with get_client() as client:
        return [p.name for p in await client.read_work_pools()]


@task(name="train")
def train(job: TrainingJob, job_id: str, plan: Plan, assignment: Assignment,
          ledger_url: SecretStr | None, inventory: dict[str, int], settings: str | None = None,
          own_pool: bool = False, worker_wait_s: float = 3600.0, first_attempt: int = 1) -> dict:
    """Train on the assignment: on the pool's workers when any are online; in-process as the
    same `frenzy-train` flow (a subflow) only when the pool is the control machine's own
    (``own_pool``, `scheduler.discover.is_control_machine_pool`). Any other pool without a
    worker is waited for up to ``worker_wait_s`` (the queue and the log say so, with the command
    that starts one), keeping the allocation's lease; then `dispatch.NoWorkerError`, and the
    submit flow releases the GPUs. Either way the train flow holds the pool's `gpu:<pool>` slots
    for each allocation it trains on, so Prefect's count of busy GPUs follows the ledger's.
    ``first_attempt``: the number of the first launch (a run handed on from another pool's
    train flow goes on counting)."""
    pool, url = assignment.pool, secret_value(ledger_url)
    if not dispatch.has_workers(pool):
        if own_pool:            # the train flow holds the pool's slots for each allocation it trains on
            return train_on_pool(job, plan, assignment=assignment, job_id=job_id,
                                 ledger_url=ledger_url, inventory=inventory, settings=settings,
                                 first_attempt=first_attempt)
        _wait_for_worker(pool, job_id, assignment, url, worker_wait_s)
    if len(assignment.placement) > 1:       # one flow run per node, trained as a gang
        from frenzy_flows.gang import dispatch_gang

        dispatch._logger().info("dispatching to work pool %s as a gang of %d nodes", pool, len(assignment.placement))
        return dispatch_gang(job, plan, assignment, job_id=job_id, ledger_url=url, settings=settings,
                             timeout_s=dispatch.dispatch_timeout(job.deadline_s), inventory=inventory,
                             first_attempt=first_attempt)
    dispatch._logger().info("dispatching to work pool %s", pool)
    return dispatch.dispatch_to_pool(job, plan, assignment, job_id=job_id, settings=settings,
                                     timeout_s=dispatch.dispatch_timeout(job.deadline_s), ledger_url=url,
                                     first_attempt=first_attempt)


def _wait_for_worker(pool: str, job_id: str, assignment: Assignment, ledger_url: str | None,
                     timeout_s: float) -> None:
    """Wait for a worker of ``pool`` with the job's GPUs held (their lease renewed, the queue row
    beaten and showing what it waits for)."""
    from ledger import Ledger
    from ledger.queue import JobQueue

    ledger = Ledger(ledger_url)
    queue = JobQueue(ledger)

    def beat() -> bool:
        row = queue.touch(job_id)
        return row is None or row.state == "running"     # a job without a queue row: nobody ends it

    import contextlib

    held = ledger.lease(assignment.allocation_id) if assignment.allocation_id else contextlib.nullcontext()
    with held:
        queue.note(job_id, dispatch.start_worker_hint(pool))
        try:
            dispatch.wait_for_worker(pool, timeout_s, beat=beat)
        finally:
            queue.note(job_id, "")


def requeued_by_scheduler(queue, job_id: str, allocation_id: str) -> bool:
    """The scheduler cancelled the job's run on ``allocation_id`` and queued the job again
    (``JobQueue.cancel_run``; it may already hold its next allocation)."""
    row = queue.get(job_id)
    return (row is not None and row.request_state == "cancelled" and row.state in ("pending", "running")
            and row.allocation_id != allocation_id)


@flow(name="frenzy-submit", log_prints=False)
def submit_training(job: Annotated[TrainingJob, RunForm()],
                    cluster: Annotated[GPUCluster | str | None, RunForm()] = None,
                    policy: Annotated[str | None, RunForm()] = None,
                    safety_margin_gib: Annotated[float | None, RunForm()] = None,
                    ledger_url: Annotated[SecretStr | None, RunForm()] = None,
                    wait_timeout_s: float = 3600.0, settings: Annotated[str | None, RunForm()] = None,
                    dry_run: bool = False, embedded_scheduler: bool = True,
                    plan_filter: Annotated[str | None, RunForm()] = None) -> SubmitResult | dict:
    """Train a job without naming a GPU: estimate its memory, pick GPU type and count, assign
    GPUs on the ledger and train.

    Args:
        job: The training job: model, data, sequence length, global batch and steps (the
            fields of a job YAML such as examples/tiny-job.yaml).
        cluster: The GPUs to schedule on: a `GPUCluster` block, or the path of a cluster YAML
            on the control worker's disk. Empty: the GPUs NVML finds on the control worker,
            else a local CPU pool.
        policy: Scheduling policy (frenzy, sia, gavel, tiresias, ...). Empty: the settings
            block's, else frenzy.
        safety_margin_gib: GPU memory (GiB) kept free beyond the predicted peak. Empty: the
            settings block's, else 1 GiB.
        ledger_url: SQLAlchemy URL of the GPU ledger. Typed here, it is stored with the
            run's parameters (masked only in a Python call): a URL with a password belongs
            in the settings block, which is encrypted. Empty: the settings block's, else env
            FRENZY_LEDGER_URL, else SQLite under FRENZY_HOME.
        wait_timeout_s: Seconds to wait for free GPUs before the run fails, and then for a
            worker of the assigned pool when it has none online (the control machine's own
            pool trains in this process instead).
        settings: Name of a `FrenzySettings` block: its ledger URL, safety margin, policy and
            out-of-memory fallback order apply where this form leaves them empty, its default
            precision and optimizer where the job leaves them unset.
        dry_run: Only report what would launch (GPU type, count, plan, memory, predicted step
            time and duration, pool and worker) as the `frenzy-dry-run` artifact; no GPU is
            assigned, nothing is written to the ledger, nothing trains.
        embedded_scheduler: Start a scheduler in this process that stands by while another
            (`frenzy scheduler`) leads and takes over when none does. Off: the job waits for
            the site's scheduler.
        plan_filter: Knobs the plan must have, comma-separated (``tp=2``, ``offload=optimizer,zero=2``,
            ``nodes=2``; `estimator.plan_filter`). Empty: every feasible plan is a candidate.

    The job goes into the ledger's queue; the cluster's scheduler places it, and may later
    re-size or preempt its run. ``wait_timeout_s`` bounds each wait for GPUs.
    """
    from ledger import Ledger
    from ledger.queue import JobQueue
    from prefect.utilities.asyncutils import run_coro_as_sync
    from scheduler.policies import policy_factory

    from trainer import allowlist
    from trainer.pretrained import check_job
    from trainer.tracking import with_tracking_default

    log = get_run_logger()
    site = load_settings(settings)
    allowlist.configure_from(site)       # the site's data roots and entry-point modules
    job = with_tracking_default(with_site_defaults(job, site), site)
    if site is not None and site.fetch_models:        # the Hub models it names, into this machine's cache
        fetch_hub_models(job, token=site.hf_token_value(), log=log.info)
    check_job(job)              # starting point, LoRA targets, QLoRA support: before any GPU is taken
    # the URL may hold a password: it stays a SecretStr in every task and subflow parameter
    # (Prefect stores those masked) and is unwrapped only where the ledger connects
    ledger_secret = as_secret(ledger_url) or (site.ledger_url if site else None)
    policy = policy or (site.policy if site else "frenzy")
    policy_factory(policy)      # an unknown policy name: one line, before anything is queued
    if safety_margin_gib is None:
        safety_margin_gib = (site.safety_margin_gib if site and site.safety_margin_gib is not None
                             else DEFAULT_SAFETY_MARGIN_GIB)
    topology = cluster.to_cluster() if isinstance(cluster, GPUCluster) else cluster_or_local(cluster)
    if dry_run:              # before the ledger: a dry run writes nothing
        from frenzy_flows.dryrun import dry_run_in_flow
        return dry_run_in_flow(job, topology, safety_margin_gib=safety_margin_gib, policy=policy,
                               plan_filter=plan_filter)
    Ledger(secret_value(ledger_secret)).sync_cluster(topology)
    job_id = new_job_id(job)

    plans_by_type = estimate_memory(job, topology, safety_margin_gib, plan_filter)
    gpus = topology.gpu_catalog()

    registered = run_coro_as_sync(_registered_pools())
    candidates = select_resources(job, plans_by_type, topology, registered)
    queue = JobQueue(Ledger(secret_value(ledger_secret)))
    enqueue(job, job_id, candidates, ledger_secret, policy=policy, embedded_scheduler=embedded_scheduler)
    status, error, trained = "failed", "ended before training", {}
    try:
        # from the grant to the end of the run, every allocation of the job is released on the way out
        with allocation_lifetime(secret_value(ledger_secret), job_id, log=log.warning):
            assignment = wait_for_gpus(job, job_id, ledger_secret, wait_timeout_s=wait_timeout_s)
            chosen, first_placement = assignment.plan, assignment.placement
            # the candidates the scheduler chose among (a type without a registered pool, or
            # whose plans cannot launch, was never one: shown, it read as "faster, not taken")
            artifacts.plans_table(candidates, chosen, steps=job.steps,
                                  pool_notes=dispatch.pool_notes(topology))
            artifacts.memory_breakdown(estimate_plan(job, chosen, gpus=gpus), chosen)   # the chosen plan's
            events.placed(job.name, chosen, assignment, job_id=job_id)
            parts: list[dict] = []        # the run's earlier parts: handed on (TrainResult.handoff) or cancelled
            started = time.monotonic()
            while True:
                try:
                    part = job
                    if parts and job.deadline_s is not None:   # one deadline for every part of the run
                        part = job.model_copy(update={"deadline_s": max(1.0, job.deadline_s - (time.monotonic() - started))})
                    trained = train(part, job_id, assignment.plan, assignment, ledger_secret, topology.inventory(),
                                    settings, own_pool=is_control_machine_pool(topology, assignment.pool),
                                    worker_wait_s=wait_timeout_s,
                                    first_attempt=1 + sum(len(p.get("attempts") or []) for p in parts))
                    if trained.get("handoff"):
                        # the scheduler moved the run to another pool's or node's GPUs: its train
                        # flow stopped with a checkpoint and left them held; launch it there
                        parts.append(trained)
                        assignment = Assignment.model_validate(trained["handoff"])
                        log.info("the run goes on on pool %s (%s, %s) from its checkpoint", assignment.pool,
                                 assignment.plan.short(), assignment.placement)
                        continue
                    if parts:
                        trained = merge_results([*parts, trained])
                        parts = []
                    # the trainer reports a run that ran out of fallbacks or time; it does not raise
                    ok = trained.get("status") in ("completed", "stopped")
                    status, error = (trained["status"], None) if ok else ("failed", trained.get("error") or trained.get("status"))
                    if status == "stopped":        # the queue says why and where, as the result does
                        stop = trained.get("stop") or {}
                        error = f"stopped at step {stop.get('step', '?')}: {stop.get('reason') or 'on request'}"
                except FrenzyInputError as err:
                    error = str(err)
                    raise
                except Exception as err:  # the run failed for good: report it, GPUs already released
                    if not requeued_by_scheduler(queue, job_id, assignment.allocation_id):
                        log.error("training failed: %s", err)
                    trained, status, error = {}, "failed", str(err)
                if not requeued_by_scheduler(queue, job_id, assignment.allocation_id):
                    break
                # the scheduler cancelled the run (it did not answer a request in time) and queued
                # the job again: wait for its next allocation; the launch resumes the checkpoint,
                # and what this part reported (its steps up to there, its launches) counts
                if trained.get("attempts"):
                    parts.append(trained)
                log.warning("the scheduler cancelled the run (%s); waiting for GPUs to resume from the last "
                            "checkpoint", (queue.get(job_id).wait_reason or "no answer in time"))
                assignment = wait_for_gpus(job, job_id, ledger_secret, wait_timeout_s=wait_timeout_s)
    finally:
        queue.finish(job_id, {"failed": "failed", "stopped": "stopped"}.get(status, "done"), error=error or "")

    chosen = with_placed_nodes(chosen, first_placement)   # the plans as they ran: on their placement's nodes
    if trained.get("assignment"):       # the run moved (a re-size, a fallback): where it ended
        assignment = Assignment.model_validate(trained["assignment"])
    final = Plan.model_validate(trained["final_plan"]) if trained.get("final_plan") else chosen
    final = with_placed_nodes(final, assignment.placement)       # the JSON's plan.nodes
    assignment = assignment.model_copy(update={"plan": with_placed_nodes(assignment.plan, assignment.placement)})
    measured = trained.get("measured", {})
    artifacts.summary(final, predicted_figures(final), measured, trained)
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
