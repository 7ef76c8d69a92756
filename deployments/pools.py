"""Mirror a Frenzy cluster into Prefect: one work pool per cluster pool (one GPU type each),
a global concurrency limit ``gpu:<pool>`` holding one slot per GPU, and the pool's training
deployment ``frenzy-train-<pool>``; plus a small control pool for the submit flow.

``sync_pools`` is idempotent and all-or-nothing on bad input: it validates the whole cluster
and reads the server's current pools before it writes anything, so duplicate names, unknown
GPU types or a pool of the wrong type change nothing. One Prefect server can serve several
clusters: a sync touches only the pools its cluster names; Frenzy pools of other clusters are
removed only with ``prune=True`` (``frenzy pools sync --prune``).
"""
from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Literal

from estimator.errors import FrenzyInputError

from .templates import pool_template

PROJECT_DIR = Path(__file__).resolve().parent.parent
TRAIN_ENTRYPOINT = "frenzy_flows/train_flow.py:train_on_pool"
TRAIN_DEPLOYMENT_PREFIX = "frenzy-train-"
CONTROL_POOL = "frenzy"
POOL_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,62}$")
PoolType = Literal["process", "kubernetes"]


def train_deployment_name(pool: str) -> str:
    return f"{TRAIN_DEPLOYMENT_PREFIX}{pool}"


def gpu_limit_name(pool: str) -> str:
    return f"gpu:{pool}"


def node_queue_name(pool: str, index: int) -> str:
    """The work queue of node ``index`` of a multi-node pool: the node's id in the ledger
    (``scheduler.cluster.Pool.node_ids``). A worker started with ``--work-queue`` of that name is
    the node's; a gang sends each node's flow run there (``frenzy_flows.gang``)."""
    return f"{pool}-{index}"


def node_index(node_id: str) -> int:
    """``<pool>-<i>`` -> i (the node order of the pool): the inverse of ``node_queue_name``."""
    try:
        return int(node_id.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        raise FrenzyInputError("placement", f"node id {node_id!r} is not <pool>-<index>") from None


def node_queue_names(spec: "PoolSpec") -> list[str]:
    """A multi-node pool's per-node work queues (none for a one-node pool: its default queue)."""
    return [node_queue_name(spec.name, i) for i in range(spec.nodes)] if spec.nodes > 1 else []


@dataclass
class PoolSpec:
    """What Prefect should hold for one cluster pool."""

    name: str
    gpu_type: str
    gpus: int
    nodes: int
    gpus_per_node: int


@dataclass
class SyncReport:
    pool_type: str
    pools: dict[str, str] = field(default_factory=dict)        # name -> created | updated | unchanged
    limits: dict[str, int] = field(default_factory=dict)       # gcl name -> slots
    queues: dict[str, list[str]] = field(default_factory=dict) # pool -> its per-node work queues
    # pool -> per-node work queues of nodes it no longer has (the pool shrank, or is one node now)
    removed_queues: dict[str, list[str]] = field(default_factory=dict)
    deployments: dict[str, str] = field(default_factory=dict)  # deployment name -> id


# ---------------------------------------------------------------- validation (pure)

def pool_specs(cluster: Any) -> list[PoolSpec]:
    """The pools of a loaded cluster (``scheduler.cluster.Cluster`` or anything with ``.pools``
    of objects/dicts carrying name, gpu, nodes, gpus_per_node), validated for Prefect."""
    raw = cluster.pools if hasattr(cluster, "pools") else cluster["pools"]
    specs: list[PoolSpec] = []
    seen: set[str] = set()
    for i, p in enumerate(raw):
        get = p.get if isinstance(p, dict) else (lambda k, p=p: getattr(p, k, None))
        name, gpu = get("name"), get("gpu")
        nodes, per_node = int(get("nodes") or 0), int(get("gpus_per_node") or 0)
        where = f"pools[{i}].name"
        if not isinstance(name, str) or not POOL_NAME.match(name):
            raise FrenzyInputError(where, f"{name!r} is not a valid pool name (lowercase letters, digits, "
                                          f"'-', '_', '.'; at most 63 characters)")
        if name == CONTROL_POOL:
            raise FrenzyInputError(where, f"{name!r} is reserved for the submit flow's control pool")
        if name in seen:
            raise FrenzyInputError(where, f"duplicate pool name {name!r}")
        if nodes < 1 or per_node < 1:
            raise FrenzyInputError(f"pools[{i}]", "nodes and gpus_per_node must be at least 1")
        seen.add(name)
        specs.append(PoolSpec(name=name, gpu_type=str(gpu), gpus=nodes * per_node, nodes=nodes,
                              gpus_per_node=per_node))
    if not specs:
        raise FrenzyInputError("pools", "the cluster file lists no pools")
    return specs


# A pool's description is what the Prefect UI shows on its card (the Work Pools page), so it is a
# sentence a person reads. It is also how Frenzy knows its own pools again (``frenzy pools
# status``, ``sync --prune``): the sentence has a fixed shape that ``parse_pool_description``
# matches. Pools synced by older versions carry ``frenzy={json}`` instead; those still parse.
_DESCRIPTION = re.compile(r"^Frenzy GPU pool: (?P<gpus>\d+) x (?P<gpu_type>.+?) "
                          r"on (?P<nodes>\d+) nodes? of (?P<gpus_per_node>\d+)\.")
_LEGACY = "frenzy="
CONTROL_DESCRIPTION = (f"Frenzy control pool: runs frenzy-submit (estimate, plan, assignment, dispatch). "
                       f"Needs one worker, or every submission stays Scheduled: "
                       f"prefect worker start --pool {CONTROL_POOL}")


def pool_description(spec: PoolSpec) -> str:
    nodes = f"{spec.nodes} node{'s' if spec.nodes != 1 else ''}"
    if spec.nodes > 1:
        return (f"Frenzy GPU pool: {spec.gpus} x {spec.gpu_type} on {nodes} of {spec.gpus_per_node}. "
                f"Frenzy sends training runs here, one per node of a job; start one worker on each node i: "
                f"prefect worker start --pool {spec.name} --work-queue {spec.name}-<i>")
    return (f"Frenzy GPU pool: {spec.gpus} x {spec.gpu_type} on {nodes} of {spec.gpus_per_node}. "
            f"Frenzy sends training runs here; start one worker per node: "
            f"prefect worker start --pool {spec.name}")


def parse_pool_description(description: str | None) -> dict[str, Any] | None:
    """The GPU facts ``pool_description`` wrote, or None for a pool Frenzy does not manage."""
    if not description:
        return None
    m = _DESCRIPTION.match(description)
    if m:
        return {"gpu_type": m["gpu_type"], "gpus": int(m["gpus"]), "nodes": int(m["nodes"]),
                "gpus_per_node": int(m["gpus_per_node"])}
    if _LEGACY in description:
        try:
            return json.loads(description.split(_LEGACY, 1)[1])
        except ValueError:
            return None
    return None


# ---------------------------------------------------------------- sync

def _default_templates(client) -> dict[str, dict]:
    meta = client.read_worker_metadata()
    out = {"process": meta["prefect"]["process"]["default_base_job_configuration"]}
    k8s = meta.get("prefect-kubernetes", {}).get("kubernetes", {})
    if k8s.get("default_base_job_configuration"):
        out["kubernetes"] = k8s["default_base_job_configuration"]
    return out


def _train_flow_schema(entrypoint: str, project_dir: Path) -> tuple[str, dict]:
    """Flow name and parameter schema of the training flow, as `prefect deploy` derives them."""
    import os
    import sys

    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    cwd = os.getcwd()
    sys.path.insert(0, str(project_dir))
    os.chdir(project_dir)
    try:
        fl = load_flow_from_entrypoint(entrypoint)
    finally:
        os.chdir(cwd)
        sys.path.remove(str(project_dir))
    return fl.name, parameter_schema(fl).model_dump_for_openapi()


def sync_pools(cluster: Any, *, pool_type: PoolType = "process", entrypoint: str = TRAIN_ENTRYPOINT,
               project_dir: Path | str = PROJECT_DIR, control_pool: bool = True,
               log: Callable[[str], None] | None = None, prune: bool = False) -> SyncReport:
    """Create or update, for every pool of ``cluster``: the work pool (GPU template variables),
    the ``gpu:<pool>`` limit sized to its GPU count, and its ``frenzy-train-<pool>`` deployment.
    Idempotent. Bad input raises ``FrenzyInputError`` before anything changes. One line per
    pool goes to ``log`` (default: the ``frenzy.pools`` logger, never stdout). Pools the
    cluster does not name are left alone; with ``prune``, every other Frenzy GPU pool (a work
    pool whose description ``pool_description`` wrote) is deleted with its ``gpu:<pool>`` limit
    and training deployment (reported as ``removed``)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate, WorkPoolUpdate
    from prefect.exceptions import ObjectNotFound

    if pool_type not in ("process", "kubernetes"):
        raise FrenzyInputError("--type", f"must be process or kubernetes, not {pool_type!r}")
    log = log or logging.getLogger("frenzy.pools").info
    specs = pool_specs(cluster)
    _check_gpu_types(cluster, specs)
    project_dir = Path(project_dir).resolve()
    flow_name, schema = _train_flow_schema(entrypoint, project_dir)
    report = SyncReport(pool_type=pool_type)

    with get_client(sync_client=True) as client:
        templates = _default_templates(client)
        if pool_type not in templates:
            raise FrenzyInputError("--type", f"the Prefect server knows no {pool_type!r} worker template")
        existing = {}
        for spec in specs:           # read everything first: a wrong-type pool changes nothing
            try:
                wp = client.read_work_pool(spec.name)
            except ObjectNotFound:
                continue
            if wp.type != pool_type:
                raise FrenzyInputError("--type", f"work pool {spec.name!r} already exists with type "
                                                 f"{wp.type!r}; delete it (prefect work-pool delete "
                                                 f"{spec.name}) or sync with --type {wp.type}")
            existing[spec.name] = wp

        if control_pool:
            try:
                control = client.read_work_pool(CONTROL_POOL)
            except ObjectNotFound:
                client.create_work_pool(WorkPoolCreate(
                    name=CONTROL_POOL, type="process", base_job_template=templates["process"],
                    description=CONTROL_DESCRIPTION))
                report.pools[CONTROL_POOL] = "created"
            else:             # an older sync's wording: the UI card should say it needs a worker
                if control.description != CONTROL_DESCRIPTION:
                    client.update_work_pool(CONTROL_POOL, WorkPoolUpdate(description=CONTROL_DESCRIPTION))
                    report.pools[CONTROL_POOL] = "updated"

        flow_id = client.create_flow_from_name(flow_name)
        for spec in specs:
            template = pool_template(pool_type, templates[pool_type], spec.gpu_type, spec.gpus)
            desc = pool_description(spec)
            old = existing.get(spec.name)
            if old is None:
                client.create_work_pool(WorkPoolCreate(name=spec.name, type=pool_type,
                                                       base_job_template=template, description=desc))
                report.pools[spec.name] = "created"
            elif old.base_job_template != template or old.description != desc:
                client.update_work_pool(spec.name, WorkPoolUpdate(base_job_template=template, description=desc))
                report.pools[spec.name] = "updated"
            else:
                report.pools[spec.name] = "unchanged"

            for qname in node_queue_names(spec):
                _ensure_queue(client, spec.name, qname, spec.gpu_type)
            report.queues[spec.name] = node_queue_names(spec)
            dropped = _drop_stale_node_queues(client, spec, log)
            if dropped:
                report.removed_queues[spec.name] = dropped
            client.upsert_global_concurrency_limit_by_name(gpu_limit_name(spec.name), limit=spec.gpus)
            report.limits[gpu_limit_name(spec.name)] = spec.gpus

            dep_id = client.create_deployment(   # upsert on (flow, name)
                flow_id=flow_id, name=train_deployment_name(spec.name), work_pool_name=spec.name,
                entrypoint=entrypoint, parameter_openapi_schema=schema, enforce_parameter_schema=True,
                pull_steps=[{"prefect.deployments.steps.set_working_directory": {"directory": str(project_dir)}}],
                job_variables={"gpu_type": spec.gpu_type},
                tags=["frenzy", "frenzy-train", f"gpu:{spec.gpu_type}"],
                description=f"Frenzy training on pool {spec.name} ({spec.gpus} x {spec.gpu_type}).")
            report.deployments[train_deployment_name(spec.name)] = str(dep_id)
            log(f"pool {spec.name}: {report.pools[spec.name]} ({pool_type}, {spec.gpus} x {spec.gpu_type}); "
                f"limit {gpu_limit_name(spec.name)}={spec.gpus}; deployment {flow_name}/{train_deployment_name(spec.name)}"
                + (f"; work queues {', '.join(report.queues[spec.name])} (one per node)" if report.queues[spec.name] else ""))
        if prune:
            keep = {spec.name for spec in specs} | {CONTROL_POOL}
            for wp in client.read_work_pools():
                if wp.name in keep or parse_pool_description(wp.description) is None:
                    continue          # this cluster's, the control pool, or not Frenzy's
                _remove_pool(client, wp.name, flow_name)
                report.pools[wp.name] = "removed"
                log(f"pool {wp.name}: removed (not in this cluster; --prune)")
    return report


def _ensure_queue(client, pool: str, name: str, gpu_type: str) -> None:
    """Create the work queue ``name`` of ``pool`` unless it exists (idempotent)."""
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        client.read_work_queue_by_name(name, work_pool_name=pool)
        return
    except ObjectNotFound:
        pass
    try:
        client.create_work_queue(name=name, work_pool_name=pool,
                                 description=f"node {name} of pool {pool} ({gpu_type}): its worker runs "
                                             f"`prefect worker start --pool {pool} --work-queue {name}`")
    except ObjectAlreadyExists:       # a concurrent sync made it
        pass


def _drop_stale_node_queues(client, spec: PoolSpec, log: Callable[[str], None]) -> list[str]:
    """Delete the pool's per-node work queues (``<pool>-<i>``) of nodes it no longer has, so a
    worker still started on one sits on an empty queue rather than one that looks current; a
    queue that still holds a run not yet final is kept (its run's node is being drained) and
    said so. The pool's other queues (its default one, any a site made) are never touched.
    Returns the names deleted."""
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState,
                                                FlowRunFilterStateType, WorkPoolFilter,
                                                WorkPoolFilterName, WorkQueueFilter,
                                                WorkQueueFilterName)
    from prefect.client.schemas.objects import StateType

    keep = set(node_queue_names(spec))
    node_queue = re.compile(rf"^{re.escape(spec.name)}-\d+$")
    dropped = []
    for q in client.read_work_queues(work_pool_name=spec.name):
        if q.name in keep or not node_queue.match(q.name):
            continue
        live = client.read_flow_runs(
            work_pool_filter=WorkPoolFilter(name=WorkPoolFilterName(any_=[spec.name])),
            work_queue_filter=WorkQueueFilter(name=WorkQueueFilterName(any_=[q.name])),
            flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING, StateType.PAUSED,
                      StateType.CANCELLING]))), limit=1)
        if live:
            log(f"pool {spec.name}: work queue {q.name} kept (its node left the pool, but run "
                f"{live[0].name} on it has not ended); the next sync removes it")
            continue
        client.delete_work_queue_by_id(q.id)
        dropped.append(q.name)
        log(f"pool {spec.name}: work queue {q.name} removed (the pool has {spec.nodes} node"
            f"{'s' if spec.nodes != 1 else ''} now)")
    return dropped


def _remove_pool(client, name: str, flow_name: str) -> None:
    """Delete a Frenzy pool's training deployment, ``gpu:<pool>`` limit and work pool."""
    from prefect.exceptions import ObjectNotFound

    try:
        dep = client.read_deployment_by_name(f"{flow_name}/{train_deployment_name(name)}")
        client.delete_deployment(dep.id)
    except ObjectNotFound:
        pass
    try:
        client.delete_global_concurrency_limit_by_name(gpu_limit_name(name))
    except ObjectNotFound:
        pass
    client.delete_work_pool(name)


def _check_gpu_types(cluster: Any, specs: Iterable[PoolSpec]) -> None:
    """Every pool's GPU type must be in the catalog or the cluster's own ``gpu_types``."""
    from estimator.catalog import get_gpu

    extra = getattr(cluster, "gpu_types", None) or getattr(cluster, "extra_gpus", None) or None
    for i, spec in enumerate(specs):
        if extra and spec.gpu_type in extra:
            continue
        try:
            get_gpu(spec.gpu_type)
        except FrenzyInputError as err:
            raise FrenzyInputError(f"pools[{i}].gpu", err.rule) from None


# ---------------------------------------------------------------- status

@dataclass
class PoolStatus:
    name: str
    pool_type: str
    gpu_type: str
    gpus: int | None          # slots of gpu:<pool> (None: no limit, i.e. never synced)
    in_use: int | None        # slots held now
    queued: int               # flow runs scheduled to start by now or pending
    running: int
    workers_online: int
    state: str                # READY / NOT_READY / PAUSED


def pools_status(names: Iterable[str] | None = None) -> list[PoolStatus]:
    """Per Frenzy pool (or the named pools): GPUs, GPUs in use, queued and running runs, workers."""
    import datetime as dt

    from prefect import get_client
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterExpectedStartTime,
                                                FlowRunFilterState, FlowRunFilterStateType,
                                                WorkerFilter, WorkerFilterStatus, WorkPoolFilter,
                                                WorkPoolFilterName)
    from prefect.client.schemas.objects import StateType
    from prefect.exceptions import ObjectNotFound

    now = dt.datetime.now(dt.timezone.utc)
    out: list[PoolStatus] = []
    with get_client(sync_client=True) as client:
        pools = client.read_work_pools()
        wanted = set(names) if names else None
        for wp in sorted(pools, key=lambda p: p.name):
            facts = parse_pool_description(wp.description)
            if wanted is not None:
                if wp.name not in wanted:
                    continue
            elif facts is None and wp.name != CONTROL_POOL:
                continue          # not a Frenzy pool (the control pool runs the submit flow: listed)
            try:
                gcl = client.read_global_concurrency_limit_by_name(gpu_limit_name(wp.name))
                gpus, in_use = gcl.limit, gcl.active_slots
            except ObjectNotFound:
                gpus, in_use = None, None
            pool_filter = WorkPoolFilter(name=WorkPoolFilterName(any_=[wp.name]))

            def runs(state: StateType, **flow_run_filter: Any) -> int:
                return len(client.read_flow_runs(work_pool_filter=pool_filter, flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[state])), **flow_run_filter)))

            due = runs(StateType.SCHEDULED, expected_start_time=FlowRunFilterExpectedStartTime(before_=now))
            workers = client.read_workers_for_work_pool(
                wp.name, worker_filter=WorkerFilter(status=WorkerFilterStatus(any_=["ONLINE"])))
            out.append(PoolStatus(
                name=wp.name, pool_type=wp.type,
                gpu_type="control" if wp.name == CONTROL_POOL else (facts or {}).get("gpu_type", "-"),
                gpus=gpus, in_use=in_use, queued=due + runs(StateType.PENDING), running=runs(StateType.RUNNING),
                workers_online=len(workers), state=str(wp.status.value if wp.status else "NOT_READY")))
    if names:
        missing = set(names) - {s.name for s in out}
        if missing:
            raise FrenzyInputError("pool", f"no such work pool: {', '.join(sorted(missing))}")
    return out
