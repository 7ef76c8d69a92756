"""Send a placed training job to its GPU pool's deployment and wait for it.

The submit flow has already chosen the plan and recorded the allocation in the ledger. Here we
check that the pool has its ``gpu:<pool>`` concurrency limit (the slots the training run holds
in Prefect's own accounting, `hold_gpu_slots`, taken by the run itself for each allocation it
trains on, so the count follows fallbacks, re-sizes and preemptions), start the pool's
``frenzy-train-<pool>`` deployment with the devices as job variables, and wait. A run that sits unclaimed because the pool has no workers online is reported in the
log with the command that fixes it, never waited on silently; on timeout, error or interrupt
the child run is cancelled (Prefect does not cascade cancellation to ``run_deployment`` runs).
"""
from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any, Callable, Mapping
from uuid import UUID

from estimator.errors import FrenzyInputError
from estimator.plan import Plan

from deployments.pools import gpu_limit_name, train_deployment_name

from .cancel import cancel_flow_run

NO_WORKER_REPORT_EVERY_S = 30.0


class DispatchError(RuntimeError):
    """The training run on the pool did not complete (failed, crashed, cancelled or timed out)."""

    def __init__(self, message: str, flow_run_id: UUID | None = None, state: str | None = None):
        super().__init__(message)
        self.flow_run_id = flow_run_id
        self.state = state


def _logger():
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("frenzy.dispatch")


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


# ---------------------------------------------------------------- workers

def workers_online(pool_name: str) -> int:
    """Workers polling ``pool_name`` now (0 when the pool does not exist)."""
    from prefect import get_client
    from prefect.client.schemas.filters import WorkerFilter, WorkerFilterStatus
    from prefect.exceptions import ObjectNotFound, PrefectHTTPStatusError

    with get_client(sync_client=True) as client:
        try:
            workers = client.read_workers_for_work_pool(
                pool_name, worker_filter=WorkerFilter(status=WorkerFilterStatus(any_=["ONLINE"])))
        except ObjectNotFound:
            return 0
        except PrefectHTTPStatusError as err:   # this endpoint answers a bare 404 for unknown pools
            if err.response.status_code == 404:
                return 0
            raise
    return len(workers)


def has_workers(pool_name: str) -> bool:
    """Whether any worker is online for ``pool_name``: the submit flow dispatches to the pool
    when true; else it trains in-process only on the control machine's own pool
    (``scheduler.discover.is_control_machine_pool``) and waits for a worker of any other."""
    return workers_online(pool_name) > 0


def start_worker_hint(pool_name: str) -> str:
    """The one line that says what a pool without workers waits for and how to fix it."""
    return f"waiting for a worker of pool {pool_name}: start one with `prefect worker start --pool {pool_name}`"


class NoWorkerError(DispatchError):
    """No worker of the assigned pool came online within the wait."""


def wait_for_worker(pool_name: str, timeout_s: float, *, poll_s: float = 2.0,
                    beat: Callable[[], bool] | None = None,
                    online: Callable[[str], int] | None = None) -> int:
    """Wait until a worker polls ``pool_name``; returns how many are online. Says what it waits
    for (``start_worker_hint``) at once and every ``NO_WORKER_REPORT_EVERY_S``. ``beat`` is
    called every poll (keep the allocation and the queue row alive); it returns False when the
    job ended meanwhile. ``NoWorkerError`` with the hint after ``timeout_s`` or a False beat."""
    online = online or workers_online
    log = _logger()
    end = time.monotonic() + max(0.0, timeout_s)
    last_report = -1e9
    while True:
        n = online(pool_name)
        if n > 0:
            log.info("pool %s has %d worker(s) online", pool_name, n)
            return n
        if beat is not None and beat() is False:
            raise NoWorkerError(f"the job ended while {start_worker_hint(pool_name)}")
        now = time.monotonic()
        if now >= end:
            raise NoWorkerError(f"no worker of pool {pool_name} came online within {timeout_s:.0f} s; "
                                f"start one with `prefect worker start --pool {pool_name}`")
        if now - last_report >= NO_WORKER_REPORT_EVERY_S:
            log.warning("%s (up to %.0f s more)", start_worker_hint(pool_name), end - now)
            last_report = now
        time.sleep(min(poll_s, max(0.05, end - now)))


def pool_notes(cluster: Any) -> dict[str, str]:
    """GPU type -> what its pools' workers look like now, for the plan table's ``pool`` column
    (``artifacts.plans_table(..., pool_notes=...)``), e.g. ``"a100: no workers online"``."""
    notes: dict[str, list[str]] = {}
    for pool in cluster.pools:
        n = workers_online(pool.name)
        notes.setdefault(pool.gpu, []).append(
            f"{pool.name}: {n} worker{'s' if n != 1 else ''} online" if n else f"{pool.name}: no workers online")
    return {gpu: "; ".join(v) for gpu, v in notes.items()}


# ---------------------------------------------------------------- job variables

def job_variables(plan: Plan, allocation: Any, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The pool template variables for one run: ``gpu_ids`` (becomes CUDA_VISIBLE_DEVICES),
    ``gpu_type``, ``num_processes`` and extra ``env`` (merged into the template's env)."""
    devices = _get(allocation, "devices") or []
    out: dict[str, Any] = {"gpu_type": plan.gpu_type, "num_processes": len(devices) or plan.gpus}
    if devices:
        out["gpu_ids"] = ",".join(str(d) for d in devices)
    # The dispatcher reads the train flow's return value from its persisted result, whatever
    # the flow's decorator says. (Remote workers need shared result storage for that.)
    extra = {"PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true", **(env or {})}
    if os.environ.get("FRENZY_HOME") and "FRENZY_HOME" not in extra:
        # a worker on this machine must find the same ledger and run folders
        extra["FRENZY_HOME"] = os.path.abspath(os.environ["FRENZY_HOME"])
    if os.environ.get("FRENZY_SHARED_RUNS") and "FRENZY_SHARED_RUNS" not in extra:
        # run folders on storage every node sees: a gang's nodes, and a run preempted or
        # relaunched on another node, find the same checkpoints (trainer.resume.shared_runs_root)
        extra["FRENZY_SHARED_RUNS"] = os.environ["FRENZY_SHARED_RUNS"]
    out["env"] = extra
    return out


def _assignment_dict(allocation: Any) -> dict[str, Any]:
    """The allocation as the train flow's ``assignment`` parameter (JSON)."""
    if hasattr(allocation, "model_dump"):
        d = allocation.model_dump(mode="json")
    elif isinstance(allocation, Mapping):
        d = dict(allocation)
    else:
        d = {k: getattr(allocation, k) for k in ("id", "pool", "gpu_type", "placement", "devices")
             if hasattr(allocation, k)}
    if "allocation_id" not in d and d.get("id") is not None:
        d["allocation_id"] = str(d.pop("id"))
    if "devices" in d:
        d["devices"] = [str(x) for x in d["devices"]]
    return d


def _job_dict(job: Any) -> dict[str, Any]:
    return job.model_dump(mode="json") if hasattr(job, "model_dump") else dict(job)


def find_train_deployment(pool: str) -> UUID:
    """The id of ``frenzy-train-<pool>``; a clear error when pools were never synced."""
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    name = train_deployment_name(pool)
    with get_client(sync_client=True) as client:
        found = client.read_deployments(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[name])))
    if not found:
        raise FrenzyInputError("pool", f"no deployment {name!r} on the Prefect server; run "
                                       f"`frenzy pools sync --cluster <file>` first")
    return found[0].id


# ---------------------------------------------------------------- GPU slots

# Slots are Prefect concurrency leases, renewed in the background while held: a holder that
# died stops renewing and a server's repossessor revokes the lease when it runs out. One minute:
# a renewal is one small request, and Prefect's count frees well before the ledger's own lease
# (300 s) would give the GPUs to someone else, so Prefect is never the one that blocks.
SLOT_LEASE_S = 60.0
# The slots mirror GPUs the ledger already granted, so a free slot is expected at once. What
# can still hold one: a dead holder's lease not yet revoked (one lease plus the repossessor's
# loop), or a count leaked where no lease is left to revoke (an embedded server, whose leases
# live in its memory, killed with its holder). After the first few seconds of waiting, the
# count is reconciled with the ledger; the whole wait is bounded by two leases plus 30 s.
SLOT_RECONCILE_AFTER_S = 5.0
SLOT_WAIT_S = 2 * SLOT_LEASE_S + 30.0
# A job's deadline is kept by its run (trainer.runner: a stop at a step boundary with a checkpoint
# and an export, its clock started when the run starts); the submitter, whose clock starts when it
# dispatches, waits this much longer before it cancels the run: a worker's poll, an image pull,
# the run's imports and set-up, and the clean stop's checkpoint and export. Without it the
# submitter cancelled first, and the ranks were killed instead of stopped.
DEADLINE_GRACE_S = 600.0


def dispatch_timeout(deadline_s: float | None) -> float | None:
    """How long the submitter waits for a run of a job with ``deadline_s``."""
    return None if deadline_s is None else deadline_s + DEADLINE_GRACE_S


# While a dispatched run waits for a worker to start it, its submitter beats the job's queue
# row this often: six beats within the queue's alive window (ledger.queue.DEFAULT_ALIVE_S, 60 s)
DISPATCH_BEAT_S = 10.0


def ledger_gpus_by_pool(ledger) -> dict[str, int]:
    """GPUs each pool's active ledger allocations hold (what Prefect's slots should count)."""
    held: dict[str, int] = {}
    for alloc in ledger.allocations(active_only=True):
        held[alloc.pool] = held.get(alloc.pool, 0) + max(1, len(alloc.devices))
    return held


def reconcile_gpu_slots(ledger, pools: list[str], waiting: Mapping[str, int] | None = None) -> dict[str, int]:
    """Lower each pool's ``gpu:<pool>`` busy count to what the ledger holds there, when it is
    higher (slots that leaked: no live holder, no lease left to expire); returns pool -> slots
    freed. ``waiting``: pool -> GPUs the caller holds on the ledger but not yet as slots (it is
    waiting for them), which no slot counts: without it, a waiter's own grant kept as many
    leaked slots alive and it waited for itself. Never raises a count: a holder between its
    ledger grant and its slots is normal. A holder that released on the ledger but not yet its
    slots may see the count undershoot by its own slots for that moment; Prefect floors a
    release at zero and the ledger still decides which GPUs are free."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    held = ledger_gpus_by_pool(ledger)
    freed: dict[str, int] = {}
    with get_client(sync_client=True) as client:
        for pool in pools:
            name = gpu_limit_name(pool)
            try:
                lim = client.read_global_concurrency_limit_by_name(name)
            except ObjectNotFound:
                continue
            want = min(max(0, held.get(pool, 0) - (waiting or {}).get(pool, 0)), lim.limit)
            if lim.active_slots > want:
                client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(active_slots=want))
                freed[pool] = lim.active_slots - want
                _logger().warning("%s counted %d busy slot(s) but the ledger holds %d GPU(s) there: freed %d "
                                  "leaked slot(s)", name, lim.active_slots, want, lim.active_slots - want)
    return freed


def _slot_count(name: str) -> str:
    from prefect import get_client

    try:
        with get_client(sync_client=True) as client:
            lim = client.read_global_concurrency_limit_by_name(name)
        return f"{lim.active_slots} of {lim.limit} busy"
    except Exception as err:           # only for the message
        return f"count unreadable: {type(err).__name__}"


def _no_limit(name: str) -> FrenzyInputError:
    return FrenzyInputError("pool", f"no concurrency limit {name!r}; run `frenzy pools sync --cluster <file>` first")


def require_gpu_limit(pool: str) -> None:
    """``FrenzyInputError`` when the pool has no ``gpu:<pool>`` limit: its train flow could not
    hold its slots, so nothing is started there."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    name = gpu_limit_name(pool)
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            raise _no_limit(name) from None


@contextlib.contextmanager
def hold_gpu_slots(pool: str, occupy: int, *, timeout_s: float | None = None,
                   ledger_url: str | None = None):
    """Hold ``occupy`` slots of the pool's ``gpu:<pool>`` limit (strict: a missing limit is an
    error) for the duration of the block, so Prefect's count of busy GPUs matches the ledger's.
    Used by the train flow around each allocation it trains on
    (`frenzy_flows.training.run_allocated_training`), and around each launch of a gang.

    The slots are a lease of ``SLOT_LEASE_S`` renewed while held; a renewal that fails (the API
    down) does not stop the training: the ledger's lease fences the GPUs. The wait for them is
    bounded by ``timeout_s`` (default ``SLOT_WAIT_S``, never the job's deadline); after
    ``SLOT_RECONCILE_AFTER_S`` leaked slots are freed against the ledger (``ledger_url``) and
    the wait says what it waits for. ``DispatchError`` when they do not come."""
    from prefect.concurrency.sync import concurrency

    name = gpu_limit_name(pool)
    total = SLOT_WAIT_S if timeout_s is None else float(timeout_s)
    log = _logger()
    log.info("taking %d GPU slot(s) of %s", occupy, name)

    def take(wait_s: float):
        cm = concurrency(name, occupy=occupy, strict=True, timeout_seconds=max(0.1, wait_s),
                         lease_duration=SLOT_LEASE_S, raise_on_lease_renewal_failure=False)
        cm.__enter__()
        return cm

    t0 = time.monotonic()
    try:   # entered by hand: only the acquisition's errors are translated, not the block's
        try:
            cm = take(min(total, SLOT_RECONCILE_AFTER_S))
        except TimeoutError:
            left = total - (time.monotonic() - t0)
            if left <= 0:
                raise
            from ledger import Ledger

            freed = reconcile_gpu_slots(Ledger(ledger_url), [pool], {pool: occupy}).get(pool, 0)
            log.warning("waiting up to %.0f s for %d GPU slot(s) of %s (%s%s): the ledger granted the "
                        "GPUs, so only a dead holder's lease still counts them", left, occupy, name,
                        _slot_count(name), f"; freed {freed} leaked" if freed else "")
            cm = take(left)
    except TimeoutError as err:
        raise DispatchError(f"{occupy} GPU slot(s) of {name} did not free up within {total:.0f} s "
                            f"({_slot_count(name)})") from err
    except Exception as err:
        if "must be created" in str(err):    # strict=True and no gpu:<pool> limit
            raise _no_limit(name) from err
        raise
    try:
        yield
    finally:
        cm.__exit__(None, None, None)


# ---------------------------------------------------------------- dispatch

def _wait(flow_run_id: UUID, pool: str, deadline: float, poll_s: float,
          beat: Callable[[], Any] | None = None):
    """Poll the run until final; explain a wait caused by a pool without workers. ``beat``: the
    job's queue heartbeat, called while the run waits for a worker to start it (the run beats
    for itself once it trains; beating for a run that is Running would hide one that died)."""
    from prefect import get_client

    log = _logger()
    last_report = last_beat = -1e9
    with get_client(sync_client=True) as client:
        while True:
            fr = client.read_flow_run(flow_run_id)
            state = fr.state
            if state is not None and state.is_final():
                return fr
            now = time.monotonic()
            if now >= deadline:
                return fr
            waiting = state is None or state.is_scheduled() or state.is_pending()
            if waiting and beat is not None and now - last_beat >= DISPATCH_BEAT_S:
                # the placed job's row would be reaped as dead after DEFAULT_ALIVE_S while a
                # worker polls, pulls an image or starts the run
                try:
                    beat()
                except Exception as err:       # a database hiccup: the next poll beats again
                    log.warning("queue heartbeat while the run starts failed: %s", err)
                last_beat = now
            if waiting and now - last_report >= NO_WORKER_REPORT_EVERY_S:
                n = workers_online(pool)
                if n == 0:
                    log.warning("waiting: pool %r has no workers online, so flow run %s stays %s; "
                                "start one with `prefect worker start --pool %s`",
                                pool, fr.name, state.name if state else "unscheduled", pool)
                else:
                    log.info("waiting for one of %d worker(s) of pool %r to pick up flow run %s",
                             n, pool, fr.name)
                last_report = now
            time.sleep(min(poll_s, max(0.05, deadline - now)))


def dispatch_to_pool(job: Any, plan: Plan, allocation: Any, *, timeout_s: float | None,
                     job_id: str | None = None, settings: str | None = None,
                     env: Mapping[str, str] | None = None,
                     poll_s: float = 2.0, first_attempt: int = 1, ledger_url: str | None = None) -> dict:
    """Run ``job`` with ``plan`` on ``allocation.pool`` through its ``frenzy-train-<pool>``
    deployment and return that flow's result (a dict; the train flow persists its result).

    ``allocation``: the submit flow's ``Assignment`` (or a ledger Allocation / dict with
    ``pool``, ``devices``, ``allocation_id`` or ``id``); it is passed on as the train flow's
    ``assignment`` parameter, with ``job`` and ``job_id``. ``timeout_s=None`` waits as long as
    it takes. ``settings``: the FrenzySettings block the train flow applies. The train flow
    holds ``concurrency("gpu:<pool>", occupy=<devices>, strict=True)`` for each allocation it
    trains on (not this dispatcher: a preempted run waiting for GPUs must hold none, a re-sized
    one its new count); here the limit is only required to exist before anything starts.
    Raises ``DispatchError`` when the run ends other than COMPLETED or outlives ``timeout_s``
    (the run is cancelled then), ``FrenzyInputError`` when the pool was never synced.
    ``first_attempt``: the number of the run's first launch (a gang relaunched on one node).
    ``ledger_url``: the ledger whose queue row of ``job_id`` this beats while the run waits for
    a worker to start it (``_wait``).
    """
    pool = _get(allocation, "pool")
    if not pool:
        raise FrenzyInputError("allocation.pool", "must name the work pool to dispatch to")
    deployment_id = find_train_deployment(pool)
    variables = job_variables(plan, allocation, env)
    job_d = _job_dict(job)
    assignment = _assignment_dict(allocation)
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
    queue = node_work_queue(pool, assignment.get("placement") or {})
    require_gpu_limit(pool)
    return _run_and_wait(deployment_id, pool, variables, timeout_s, deadline, poll_s,
                         {"job": job_d, "plan": plan.model_dump(mode="json"),
                          "assignment": assignment, "job_id": job_id,
                          # only when set: train flows deployed before it keep working
                          **({"settings": settings} if settings else {}),
                          **({"first_attempt": first_attempt} if first_attempt > 1 else {})}, queue,
                         beat=queue_beat(job_id, ledger_url, assignment.get("allocation_id")) if job_id else None)


def node_work_queue(pool: str, placement: Mapping[str, Any]) -> str | None:
    """The work queue a one-node placement must start on: its node's (``<pool>-<i>``) when the
    pool has one per node (``frenzy pools sync`` makes them for a pool of several nodes), since
    the devices of the placement are that node's and any other node's worker would train on
    its own devices of those numbers; None (the pool's default queue) for a one-node pool.
    ``FrenzyInputError`` when the pool has per-node queues but not this node's (the cluster
    grew since the last sync): the pool's default queue would let any node's worker take it."""
    if len(placement) != 1:
        return None
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    from deployments.pools import node_index, node_queue_name

    node = next(iter(placement))
    name = node_queue_name(pool, node_index(node))
    first = node_queue_name(pool, 0)        # a sync of a multi-node pool makes queues 0, 1, ...

    def exists(client, queue: str) -> bool:
        try:
            client.read_work_queue_by_name(queue, work_pool_name=pool)
            return True
        except ObjectNotFound:
            return False

    with get_client(sync_client=True) as client:
        if exists(client, name):
            return name
        if name != first and exists(client, first):
            raise FrenzyInputError("placement", f"work pool {pool!r} has per-node work queues but none for node "
                                                f"{node!r} ({name}); run `frenzy pools sync` with the cluster file")
    return None


def queue_beat(job_id: str, ledger_url: str | None = None,
               allocation_id: str | None = None) -> Callable[[], None]:
    """The heartbeat of ``job_id``'s queue row in the ledger at ``ledger_url`` (connected at
    the first beat), as its submitter beats it while it waits; with ``allocation_id``, that
    allocation's lease is renewed too (the run takes its lease over at its first launch: a
    slow worker, a handed-on run's next part, must not see it run out before)."""
    queue = None

    def beat() -> None:
        nonlocal queue
        if queue is None:
            from ledger import Ledger
            from ledger.queue import JobQueue

            queue = JobQueue(Ledger(ledger_url))
        queue.touch(job_id, plans=False)
        if allocation_id:
            queue.ledger.heartbeat(allocation_id)

    return beat


def _run_and_wait(deployment_id: UUID, pool: str, variables: dict[str, Any], timeout_s: float | None,
                  deadline: float, poll_s: float, parameters: dict[str, Any], queue: str | None = None,
                  beat: Callable[[], Any] | None = None) -> dict:
    """Start the pool's run (on the node's work ``queue`` when given) and wait for its result;
    cancel it when we stop waiting early."""
    from prefect.deployments import run_deployment

    log = _logger()
    job_name = parameters["job"].get("name", "job")
    flow_run_id = None
    try:
        fr = run_deployment(deployment_id, parameters=parameters, job_variables=variables, timeout=0,
                            tags=["frenzy", f"pool:{pool}", f"job:{job_name}"],
                            **({"work_queue_name": queue} if queue else {}))
        flow_run_id = fr.id
        log.info("dispatched job %s to pool %r as flow run %s (%s)", job_name, pool, fr.name,
                 ", ".join(f"{k}={v}" for k, v in variables.items() if k != "env"))
        final = _wait(fr.id, pool, deadline, poll_s, beat)
        state = final.state
        if state is None or not state.is_final():
            cancel_flow_run(fr.id, f"frenzy: no result within {timeout_s}s")
            raise DispatchError(f"training on pool {pool!r} did not finish within {timeout_s}s "
                                f"(flow run {final.name} was {state.name if state else 'unscheduled'}; cancelled)",
                                fr.id, state.name if state else None)
        if not state.is_completed():
            raise DispatchError(f"training on pool {pool!r} ended {state.name}: {state.message or ''}".rstrip(": "),
                                fr.id, state.name)
        try:
            result = state.result(raise_on_failure=True)
        except Exception as err:   # e.g. a remote worker whose result storage we cannot read
            raise DispatchError(f"training on pool {pool!r} completed but its result is unreadable here "
                                f"({type(err).__name__}: {err}); use shared result storage",
                                fr.id, state.name) from err
        return result if isinstance(result, dict) else {"result": result}
    except BaseException as err:
        if flow_run_id is not None and not isinstance(err, DispatchError):
            cancel_flow_run(flow_run_id, f"frenzy: dispatcher stopped ({type(err).__name__})")
        raise
