"""An exact copy, in one process, of the ledger rows a scheduling round reads.

A round needs the cluster (pools, nodes, which GPUs are free, the active allocations) and the
active queue rows. Reading all of them every round costs ~4,000 rows for a 4,096-GPU cluster
with 1,600 active jobs (~65 ms on PostgreSQL); between two rounds a few dozen change. So the
mirror reads everything once and then, each ``refresh``, only the rows whose change marker
moved (``chg``, set by the database's triggers on every write of a column a round reads:
revision ``0005_change_markers``):

* PostgreSQL: ``chg`` is the writing transaction's id. The refresh runs in one REPEATABLE READ
  transaction and remembers its snapshot's ``xmin``: every transaction with a smaller id had
  finished, so its rows were read; the next refresh reads ``chg >= xmin``. Rows of transactions
  that were still running, or started later, are caught whatever their commit order (a few are
  read twice). A long-running writing transaction anywhere on the server holds ``xmin`` back:
  the refresh then re-reads every row changed since it began (still exact, only slower).
* SQLite: writers are serialised; ``chg`` is a counter bumped per written row, and the refresh
  remembers the counter its read transaction saw.

A DELETE on a mirrored table (the ledger never deletes these rows; resets do) moves
``ledger_changes.deletes``: the next refresh reads everything again.

``version`` grows whenever something a round reacts to changed: a job arrived, started, ended,
was re-queued or got / lost an open request, a node's free GPUs or the topology changed.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import Text, case, cast, select, text
from sqlalchemy.exc import OperationalError
from pydantic import TypeAdapter

from estimator.plan import Plan
from scheduler.types import ClusterState, Node, RunningJob

from .queue import ACTIVE, QueueJob
from .tables import AllocationRow, GpuRow, NodeRow, PoolRow, QueueJobRow

_PLAN_LIST = TypeAdapter(list[Plan])
# the queue columns a round reads: a ``QueueJob`` without what never changes once queued (``job``
# and ``plans``, ~80 KB a row: read once per job, ``static``), without the allocation JSON (the
# running plan comes from the allocation), and with ``request`` only while it is open
_SKIP = ("job", "plans", "allocation", "request")


@dataclass(slots=True)
class _Alloc:
    job_id: str
    placement: dict[str, list[int]]
    created_at: float
    expected_end_at: float | None
    plan: Plan


class LedgerMirror:
    """The rows of ``ledger`` a round reads (module docstring); ``queue``: also the active
    queue rows (``jobs``, ``QueueJob`` views) and each active job's plans and spec
    (``static``). Thread-safe: ``refresh`` and the views take one lock."""

    def __init__(self, ledger, *, queue: bool = True):
        self.ledger = ledger
        self.queue = queue
        self._job_cols = [f.name for f in fields(QueueJob) if f.name not in _SKIP]
        self._state_at = self._job_cols.index("state")
        self.lock = threading.RLock()
        self._mark: int | None = None          # read ``chg >= _mark`` next; None: read everything
        self._deletes: int | None = None
        self.version = 0
        self.full_reads = 0
        self._reset()

    def _reset(self) -> None:
        self.pools: dict[str, Any] = {}                      # name -> row
        self.nodes: dict[str, Any] = {}                      # node_id -> row
        self._gpu_node: dict[int, str] = {}                  # GPU id -> its node
        self._node_gpus: dict[str, dict[int, Any]] = {}      # node_id -> {GPU id: row}
        self._node_view: dict[str, tuple[int, list[int]]] = {}   # node_id -> (active GPUs, free devices)
        self._order: list[tuple[str, Any, Any]] | None = None    # (node_id, node row, pool row), round order
        self._pools: dict[str, Any] = {}                     # the active pools, by name
        self.allocs: dict[str, _Alloc] = {}                  # active allocations
        # ``cluster_state(shared=True)``'s objects, kept while their rows are unchanged
        self._node_objs: dict[str, Node] = {}                # node_id -> Node
        self._run_objs: dict[str, RunningJob] = {}           # allocation id -> RunningJob
        self.jobs: dict[str, Any] = {}                       # active queue rows (QueueJob)
        self.static: dict[str, tuple[list[Plan], dict[str, Any]]] = {}   # job_id -> (plans, spec)
        self._shared: dict[str, list[Plan]] = {}             # plans JSON -> its parsed list (shared)

    # --- reading ----------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Read what changed since the last refresh (everything the first time); True when
        ``version`` moved. A read on a connection that died since its last use (``ledger.core``
        pings only idle ones) is tried once more, on a fresh one: it changed nothing."""
        try:
            return self._refresh()
        except OperationalError as err:
            if not err.connection_invalidated:
                raise
            return self._refresh()

    def _refresh(self) -> bool:
        led = self.ledger
        with self.lock, led._read() as s:
            if led.is_postgres:
                s.connection(execution_options={"isolation_level": "REPEATABLE READ"})
                mark_q = "pg_snapshot_xmin(pg_current_snapshot())::text::bigint"
            else:
                mark_q = "counter + 1"
            # with the newest markers of the topology tables, which rarely change: their rows
            # are read only when one moved (an index look-up each, instead of a statement)
            row = s.execute(text(f"SELECT {mark_q}, deletes, (SELECT max(chg) FROM pools), "
                                 "(SELECT max(chg) FROM nodes) FROM ledger_changes WHERE id = 1")).first()
            mark, deletes = (int(row[0]), int(row[1])) if row is not None else (None, None)
            full = self._mark is None or deletes != self._deletes
            if full:
                self._reset()
                self.full_reads += 1
            since = None if full else self._mark

            def changed(stmt, table, newest=math.inf):
                """``stmt`` limited to the rows changed since the last refresh; None when
                ``newest``, the table's newest marker, shows there are none (None: no rows)."""
                if since is None:
                    return stmt
                return stmt.where(table.c.chg >= since) if newest is not None and newest >= since else None

            def rows(stmt):
                return [] if stmt is None else s.execute(stmt).all()

            newest = (math.inf, math.inf) if row is None else (row[2], row[3])
            pt, nt, gt, at, qt = (PoolRow.__table__, NodeRow.__table__, GpuRow.__table__,
                                  AllocationRow.__table__, QueueJobRow.__table__)
            pools = rows(changed(select(pt.c.name, pt.c.gpu_type, pt.c.inter_node_gbps, pt.c.gpu_memory_gib,
                                        pt.c.intra_link, pt.c.active), pt, newest[0]))
            nodes = rows(changed(select(nt.c.node_id, nt.c.pool, nt.c.idx, nt.c.active), nt, newest[1]))
            gpus = s.execute(changed(select(gt.c.id, gt.c.node_id, gt.c.device_index, gt.c.active, gt.c.alloc_id),
                                     gt)).all()
            alloc_cols = select(at.c.id, at.c.job_id, at.c.status, at.c.placement, at.c.created_at,
                                at.c.expected_end_at, at.c.plan)
            allocs = s.execute(alloc_cols.where(at.c.status == "active").order_by(at.c.created_at, at.c.id)
                               if since is None
                               else changed(alloc_cols, at)).all()
            jobs, static = [], []
            if self.queue:
                open_request = case((qt.c.request_state.in_(("pending", "acked")), qt.c.request), else_=None)
                job_cols = select(*[qt.c[n] for n in self._job_cols], open_request)
                jobs = s.execute(job_cols.where(qt.c.state.in_(ACTIVE)).order_by(qt.c.submitted_at, qt.c.job_id)
                                 if since is None else changed(job_cols, qt)).all()
                new = [r[0] for r in jobs if r[0] not in self.static and r[self._state_at] in ACTIVE]
                if new:
                    # the plans as text, parsed and validated in one pass by pydantic-core (half the
                    # time of json.loads then Plan.model_validate per plan)
                    static = s.execute(select(qt.c.job_id, cast(qt.c.plans, Text), qt.c.job)
                                       .where(qt.c.job_id.in_(new))).all()
        moved = self._apply(pools, nodes, gpus, allocs, jobs, static)
        self._mark, self._deletes = mark, deletes
        if moved or full:
            self.version += 1
        return moved or full

    def _apply(self, pools, nodes, gpus, allocs, jobs, static) -> bool:
        moved = False
        if pools or nodes:
            moved = True
            self._order = None
            self._node_objs.clear()
            self.pools.update((r.name, r) for r in pools)
            self.nodes.update((r.node_id, r) for r in nodes)
        touched: set[str] = set()
        for r in gpus:
            old = self._gpu_node.get(r.id)
            if old is not None and old != r.node_id:
                self._node_gpus[old].pop(r.id, None)
                touched.add(old)
            self._gpu_node[r.id] = r.node_id
            self._node_gpus.setdefault(r.node_id, {})[r.id] = r
            touched.add(r.node_id)
        for nid in touched:
            rows = self._node_gpus.get(nid, {}).values()
            view = (sum(1 for g in rows if g.active),
                    sorted(g.device_index for g in rows if g.active and g.alloc_id is None))
            if self._node_view.get(nid) != view:
                self._node_view[nid] = view
                self._node_objs.pop(nid, None)
                moved = True
        for r in allocs:
            if r.status != "active":
                moved |= self.allocs.pop(r.id, None) is not None
                self._run_objs.pop(r.id, None)
            elif r.id not in self.allocs:
                self.allocs[r.id] = _Alloc(r.job_id, {k: list(v) for k, v in (r.placement or {}).items()},
                                           r.created_at, r.expected_end_at, Plan.model_validate(r.plan))
                moved = True
        if jobs:
            moved |= self._apply_jobs(jobs, static)
        return moved

    def _apply_jobs(self, jobs, static) -> bool:
        names = self._job_cols
        for jid, plans_text, spec in static:
            plans = self._shared.get(plans_text) if plans_text else []
            if plans is None:
                # identical plan lists (jobs of one shape) share one parsed list: parsed once,
                # and the policies' per-list caches (menus) serve them all
                plans = self._shared[plans_text] = _PLAN_LIST.validate_json(plans_text)
            self.static[jid] = (plans, dict(spec or {}))
        moved = False
        for r in jobs:
            j = QueueJob(job={}, plans=None, allocation={}, request=r[-1] or {}, **dict(zip(names, r)))
            old = self.jobs.get(j.job_id)
            if j.state not in ACTIVE:
                if old is not None:
                    del self.jobs[j.job_id]
                    self.static.pop(j.job_id, None)
                    moved = True
                continue
            self.jobs[j.job_id] = j
            if old is None or (old.state, old.allocation_id, old.request_state) != (
                    j.state, j.allocation_id, j.request_state):
                moved = True
        if len(self._shared) > 2 * len(self.static) + 256:     # lists no active job uses any more
            used = {id(p) for p, _ in self.static.values()}
            self._shared = {k: v for k, v in self._shared.items() if id(v) in used}
        return moved

    # --- views ------------------------------------------------------------------------------
    def cluster_state(self, *, shared: bool = False) -> ClusterState:
        """Free GPUs per node and the running allocations, as the policies see them. New objects
        every call (a caller may change them), or with ``shared`` the same ``Node`` and
        ``RunningJob`` objects as the last call for the nodes and allocations whose rows did
        not change (the live scheduler's round: ~600 nodes and ~700 runs, a few of which change
        between rounds); a caller must then replace, never change, them."""
        with self.lock:
            if self._order is None:
                pools = {n: p for n, p in sorted(self.pools.items()) if p.active}
                rank = {n: i for i, n in enumerate(pools)}
                self._order = [(nid, n, pools[n.pool]) for nid, n in sorted(
                    ((nid, n) for nid, n in self.nodes.items() if n.active and n.pool in pools),
                    key=lambda x: (rank[x[1].pool], x[1].idx))]
                self._pools = pools
                self._node_objs.clear()
            empty = (0, [])
            view = self._node_view
            kept_nodes = self._node_objs if shared else {}
            nodes = []
            for nid, n, p in self._order:
                node = kept_nodes.get(nid)
                if node is None:
                    count, free = view.get(nid, empty)
                    node = Node(node_id=nid, pool=n.pool, gpu_type=p.gpu_type, gpus=count, free=list(free),
                                intra_link=p.intra_link)
                    if shared:
                        kept_nodes[nid] = node
                nodes.append(node)
            kept_runs = self._run_objs if shared else {}
            running = []
            for aid, a in self.allocs.items():
                rj = kept_runs.get(aid)
                if rj is None:
                    rj = RunningJob(job_id=a.job_id, plan=a.plan, placement={k: list(v) for k, v in a.placement.items()},
                                    start_s=a.created_at,
                                    expected_end_s=a.expected_end_at if a.expected_end_at is not None else math.inf)
                    if shared:
                        kept_runs[aid] = rj
                running.append(rj)
            pools = self._pools
            return ClusterState(nodes=nodes, running=running,
                                inter_node_gbps={p.name: p.inter_node_gbps for p in pools.values()},
                                gpu_memory_gib={p.gpu_type: p.gpu_memory_gib for p in pools.values()})
