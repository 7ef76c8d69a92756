"""`train_on_pool`: the flow behind each `frenzy-train-<pool>` deployment. A worker of that
pool runs it with the devices the submit flow allocated (job variables set
CUDA_VISIBLE_DEVICES). Run directly (from the UI) without an allocation, it takes one itself
from the ledger, best fit on that pool's GPU type."""
from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

from prefect import flow, get_run_logger

from pydantic import SecretStr

from estimator.job import TrainingJob
from estimator.plan import Plan

from frenzy_flows import artifacts, dispatch
from frenzy_flows.hub import fetch_hub_models
from frenzy_flows.results import Assignment
from frenzy_flows.lifetime import allocation_lifetime
from frenzy_flows.tasks import load_settings, new_job_id, secret_value
from frenzy_flows.training import oom_fallbacks, run_allocated_training


@flow(name="frenzy-train")
def train_on_pool(job: TrainingJob, plan: Plan, assignment: Assignment | None = None,
                  job_id: str | None = None, ledger_url: SecretStr | None = None,
                  inventory: dict[str, int] | None = None, settings: str | None = None,
                  node: dict[str, Any] | None = None, first_attempt: int = 1) -> dict[str, Any]:
    """``inventory`` (GPU type -> count) widens the out-of-memory fallbacks to more GPUs and
    other GPU types; without it they stay on the plan's GPU type. ``settings``: a
    `FrenzySettings` block whose fallback order (and ledger URL, when none is given) apply.
    ``node``: this run is one node of a multi-node gang (``frenzy_flows.gang``: gang id, rank,
    nodes, node id, shared run folder, launch number); the dispatcher owns the allocation then.
    ``first_attempt``: the number of the first launch, when the run goes on from a gang's
    launches (a gang relaunched on one node)."""
    from trainer import allowlist
    from trainer.tracking import with_tracking_default

    log = get_run_logger()
    site = load_settings(settings)
    allowlist.configure_from(site)                  # the site's data roots and entry-point modules
    job = with_tracking_default(job, site)          # the settings block's MLflow server
    if site is not None and site.fetch_models:      # the Hub models it names, into this node's cache
        with _kept_alive(ledger_url, job_id, assignment):
            fetch_hub_models(job, token=site.hf_token_value(), log=log.info)
    ledger_url = secret_value(ledger_url) or (site.ledger_url_value() if site else None)
    job_id = job_id or new_job_id(job)
    if node is not None:
        from frenzy_flows.gang import train_node

        if assignment is None:
            raise ValueError("a gang node's run needs the gang's assignment")
        progress = artifacts.progress_start(job.steps) if int(node.get("rank", 0)) == 0 else None
        try:
            return train_node(job, plan, assignment, job_id, node, ledger_url=ledger_url, log=log.info,
                              on_step=(lambda step, total, loss: artifacts.progress_update(progress, step, total, loss))
                              if progress is not None else None)
        finally:
            artifacts.progress_end(progress)
    handed: set[str] = set()        # the allocation a handed-on run goes on from stays held
    with allocation_lifetime(ledger_url, job_id, log=log.warning, keep=handed):   # released however this ends
        out = _train(job, plan, assignment, job_id, ledger_url, inventory, site, log, first_attempt)
        if out.get("handoff"):
            handed.add(out["handoff"]["allocation_id"])
        return out


# while a node prepares (a download), its job's queue row is beaten this often (the row lives
# ledger.queue.DEFAULT_ALIVE_S, 60 s)
PREPARE_BEAT_S = 10.0


@contextmanager
def _kept_alive(ledger_url: str | None, job_id: str, assignment: Assignment | None) -> Iterator[None]:
    """The job's queue row beaten and its allocation's lease renewed while the block runs: the
    dispatcher beats the row only until the run starts, and the lease is the training's from
    its first launch on, so a download of minutes before it had the job reaped and its GPUs
    given away."""
    from ledger import Ledger

    beat = dispatch.queue_beat(job_id, ledger_url)
    stop = threading.Event()

    def beating() -> None:
        while not stop.wait(PREPARE_BEAT_S):
            try:
                beat()
            except Exception:            # a database hiccup: the next beat tries again
                pass

    t = threading.Thread(target=beating, name="frenzy-prepare-beat", daemon=True)
    t.start()
    try:
        alloc = assignment.allocation_id if assignment is not None else None
        with Ledger(ledger_url).lease(alloc) if alloc else nullcontext():
            yield
    finally:
        stop.set()
        t.join()


def hand_run_assignment(ledger, job_id: str, plan: Plan) -> Assignment:
    """GPUs for a train run started by hand (from the UI, without an assignment): of this
    deployment's own pool (any free ones of the plan's type could be another pool's, whose
    devices this worker would then use). ``RuntimeError`` when none are free."""
    pool = _own_pool()
    alloc = ledger.allocate_best_fit(job_id, plan, pool=pool)
    if alloc is None:
        raise RuntimeError(f"no free {plan.gpu_type} GPUs for {plan.short()}" + (f" in pool {pool!r}" if pool else ""))
    return Assignment.from_allocation(alloc, plan)


def _own_pool() -> str | None:
    """The pool of the ``frenzy-train-<pool>`` deployment this run belongs to; None outside one."""
    from deployments.pools import TRAIN_DEPLOYMENT_PREFIX

    try:
        from prefect.runtime import deployment

        name = deployment.name
    except Exception:              # no run context: a direct call
        return None
    return name[len(TRAIN_DEPLOYMENT_PREFIX):] if name and name.startswith(TRAIN_DEPLOYMENT_PREFIX) else None


def _train(job, plan, assignment, job_id, ledger_url, inventory, site, log, first_attempt=1) -> dict[str, Any]:
    from ledger import Ledger

    by_hand = assignment is None        # no submitter to hand the run on to
    if by_hand:
        assignment = hand_run_assignment(Ledger(ledger_url), job_id, plan)
    progress = artifacts.progress_start(job.steps)
    last = {"step": 0}

    def on_step(step: int, total: int, loss: float) -> None:
        last["step"] = step
        artifacts.progress_update(progress, step, total, loss)

    placed = [assignment]
    try:
        result = run_allocated_training(job, job_id, plan, assignment, ledger_url=ledger_url,
                                        log=log.info, inventory=inventory, on_step=on_step,
                                        fallbacks_for=lambda p: oom_fallbacks(job, p, inventory=inventory, site=site,
                                                                              last_step=lambda: last["step"],
                                                                              job_id=job_id),
                                        on_placed=placed.append,
                                        slots=lambda pool, gpus: dispatch.hold_gpu_slots(pool, gpus,
                                                                                         ledger_url=ledger_url),
                                        first_attempt=first_attempt)
    finally:
        artifacts.progress_end(progress)
    if result.handoff is not None and by_hand:
        log.warning("the run goes on only on GPUs this worker does not have (%s); a run started by hand "
                    "stops here with its checkpoint: submit the job to go on", result.handoff.get("placement"))
        result = result.model_copy(update={"handoff": None})
    # where the job ended (a fallback's or a re-size's allocation): the submit flow reports it
    return {**result.model_dump(mode="json"), "assignment": placed[-1].model_dump(mode="json")}
