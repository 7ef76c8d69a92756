"""The GPU ledger: who holds which GPU, under a lease, in one transactional database.

SQLite (default, WAL mode): every writing transaction starts with ``BEGIN IMMEDIATE``, which
takes the database's write lock up front, so two submitters can never both read a GPU as free
and both claim it. PostgreSQL: the rows to claim are locked with ``SELECT ... FOR UPDATE``
(explicit placements, in id order so concurrent claims cannot deadlock) or
``FOR UPDATE SKIP LOCKED`` (best fit: GPUs another transaction is claiming right now are
skipped, not waited for). Either way the claim is one transaction: on any error nothing changes.

Every allocation holds a lease (``lease_expires_at``) that a heartbeat renews while the run is
alive; ``expire_leases`` frees the GPUs of runs that stopped renewing (a crashed process).
"""
from __future__ import annotations

import os
import random
import threading
import time
import uuid
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from pydantic import BaseModel, ConfigDict
from sqlalchemy import bindparam, create_engine, event, insert, text, update
from sqlalchemy.engine import Engine
from sqlalchemy.exc import InvalidatePoolError, OperationalError
from sqlmodel import Session, select

from estimator.errors import FrenzyInputError
from estimator.home import frenzy_home
from estimator.job import steps_for_tokens
from estimator.plan import Plan
from scheduler.placement import FreeIndex
from scheduler.types import ClusterState, Node

from .migrations import LedgerSchemaError, ensure_schema
from .tables import AllocationRow, GpuRow, JobRow, MeasurementRow, NodeRow, PlanRow, PoolRow

DEFAULT_LEASE_S = 300.0


# Each retry follows a claim that another transaction committed on a GPU we had chosen, so
# every failed attempt is someone else's success; 50 covers 50 racing claims on one GPU type
# (the concurrency test's load) before the request reports "not free now".
_BEST_FIT_ATTEMPTS = 50


class _Taken(Exception):
    """A GPU chosen for a best-fit claim was claimed concurrently (roll back and choose again)."""


class LedgerConflict(RuntimeError):
    """The GPUs asked for are held by another allocation (nothing was changed)."""


class LeaseLost(RuntimeError):
    """The allocation is no longer active (released, or its lease expired and its GPUs were freed)."""


class LeaseState(dict):
    """What ``Ledger.lease`` knows about its lease: ``["beats"]`` renewals so far, ``["error"]``
    the last error, ``lost`` (cheap, no database access) whether the run must stop."""

    def __init__(self, alloc_id: str):
        super().__init__(error=None, beats=0)
        self.alloc_id = alloc_id
        self._lost = threading.Event()

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def mark_lost(self, err: LeaseLost) -> None:
        self["error"] = err
        self._lost.set()

    def check(self) -> None:
        """Raise ``LeaseLost`` (with the reason) when the lease is lost."""
        if self._lost.is_set():
            raise self["error"] if isinstance(self["error"], LeaseLost) else LeaseLost(self.alloc_id)


class LedgerUnavailable(RuntimeError):
    """The ledger's database could not be reached, even after retrying with backoff."""


class LedgerGone(RuntimeError):
    """The SQLite ledger file was deleted or replaced while this process used it: writing on
    would start an empty ledger in which every GPU looks free."""


# Retry delays for the writes that end a run (release, measurement): 0.5+1+2+4 = 7.5 s covers a
# PostgreSQL restart or failover (seconds); a longer outage is reported, and the lease then
# frees the GPUs by itself within one TTL.
_END_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0)


class Allocation(BaseModel):
    """GPUs held by one job. ``devices`` is the flat list for ``CUDA_VISIBLE_DEVICES`` on a
    single node (``"0"``, ``"1"``...); on several nodes its entries are ``"<node>:<index>"``."""

    model_config = ConfigDict(frozen=True)

    id: str
    job_id: str
    pool: str
    gpu_type: str
    plan: Plan
    placement: dict[str, list[int]]
    devices: list[str]
    status: str = "active"
    created_at: float = 0.0
    lease_expires_at: float = 0.0
    expected_end_at: float | None = None


class Measurement(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    job_id: str
    alloc_id: str | None
    gpu_type: str
    plan: dict[str, Any]
    predicted: dict[str, Any]
    measured: dict[str, Any]
    predicted_device_used_gib: float | None = None
    measured_device_used_gib: float | None = None
    predicted_reserved_peak_gib: float | None = None
    measured_reserved_peak_gib: float | None = None
    predicted_step_time_s: float | None = None
    measured_step_time_s: float | None = None
    tokens_per_s: float | None = None
    created_at: float = 0.0


def default_ledger_file() -> Path:
    """The SQLite ledger used when FRENZY_LEDGER_URL is not set."""
    return (frenzy_home() / "ledger.db").resolve()


def default_url() -> str:
    url = os.environ.get("FRENZY_LEDGER_URL")
    if url:
        return url
    return f"sqlite:///{default_ledger_file()}"


def check_url_arg(field: str, url: str | None) -> None:
    """A ledger URL given as a command-line argument must hold no password: arguments show in
    ``ps`` and shell history. Passwords go in FRENZY_LEDGER_URL or a FrenzySettings block."""
    if not url:
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        password = make_url(_normalise(url)).password
    except ArgumentError:
        raise FrenzyInputError(field, "is not an SQLAlchemy URL (e.g. postgresql+psycopg://host/db)") from None
    if password:
        raise FrenzyInputError(field, "holds a password, which would show in `ps` and shell history: "
                                      "set FRENZY_LEDGER_URL or the ledger_url of a FrenzySettings block "
                                      "(--settings) instead")


def open_existing(field: str, url: str | None) -> "Ledger":
    """The ledger a command that only reads it opens (``frenzy queue``, ``frenzy calibrate``):
    one that exists, or one line naming ``field`` (the flag or FRENZY_LEDGER_URL) and why, never
    a driver's traceback. A SQLite file that is not there is not made: a mistyped path would
    read as an empty ledger (and a dry run would have written one)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, SQLAlchemyError

    raw = url or default_url()
    try:
        parsed = make_url(_normalise(raw))
    except ArgumentError:
        raise FrenzyInputError(field, "is not an SQLAlchemy URL (e.g. postgresql+psycopg://host/db or "
                                      "sqlite:///path/ledger.db)") from None
    shown = parsed.render_as_string(hide_password=True)
    if parsed.get_backend_name() == "sqlite":
        db = parsed.database or ""
        if not db or db == ":memory:":
            raise FrenzyInputError(field, f"{shown}: names no ledger file")
        if Path(db).is_dir():
            raise FrenzyInputError(field, f"{db} is a folder, not a ledger file")
        if not Path(db).is_file():
            raise FrenzyInputError(field, f"no ledger at {db} (nothing has run with it: `frenzy run`, "
                                          "`frenzy scheduler` and `frenzy pools sync` make it)")
    try:
        return Ledger(raw)
    except (SQLAlchemyError, LedgerSchemaError, ModuleNotFoundError, OSError) as err:
        first = (str(getattr(err, "orig", None) or err).strip().splitlines() or [type(err).__name__])[0]
        raise FrenzyInputError(field, f"cannot open the ledger at {shown}: {first}") from None


def ledger_field(arg: str | None, flag: str = "--ledger") -> str:
    """The name a ledger URL error gives: the flag, the environment variable, or the default."""
    return flag if arg else "FRENZY_LEDGER_URL" if os.environ.get("FRENZY_LEDGER_URL") else "ledger"


def db_now(s: Session) -> float:
    """The database server's clock, Unix seconds: every lease time is written and compared in
    this one clock, so submitters' skewed clocks cannot expire or extend anyone's lease.
    (SQLite runs in-process: its clock is this host's, shared by every user of the file.)"""
    if s.get_bind().dialect.name == "postgresql":
        # the time now, not the transaction's start (now()/CURRENT_TIMESTAMP): a claim that
        # waited on a row lock must read a time after the release it waited for
        q = "SELECT EXTRACT(EPOCH FROM clock_timestamp())"
    else:   # julianday('now') has millisecond resolution; 2440587.5 is the Julian day of 1970-01-01
        q = "SELECT (julianday('now') - 2440587.5) * 86400.0"
    return float(s.execute(text(q)).scalar_one())


def _normalise(url: str) -> str:
    # plain postgresql:// means psycopg2 to SQLAlchemy; the project ships psycopg (3)
    if url.startswith("postgresql://") or url.startswith("postgres://"):
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


_ENGINES: dict[tuple[int, str], tuple[Engine, Engine]] = {}
_FILES: dict[str, tuple[Path, tuple[int, int]]] = {}     # SQLite URL -> (file, (st_dev, st_ino)) at open
_ENGINES_LOCK = threading.Lock()


def _engines(url: str) -> tuple[Engine, Engine]:
    """(write engine, read engine) for ``url``, one pair per process; the schema is brought to
    the newest revision on first use (``ledger.migrations``)."""
    key = (os.getpid(), url)
    with _ENGINES_LOCK:
        hit = _ENGINES.get(key)
        if hit is not None:
            return hit
        if url.startswith("sqlite"):
            path = url.split("///", 1)[1] if "///" in url else ""
            if path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            write = _sqlite_engine(url, immediate=True)
            read = _sqlite_engine(url, immediate=False)
        else:
            write = _pinged(create_engine(url, pool_size=10, max_overflow=60, pool_use_lifo=True))
            read = write
        ensure_schema(write, read)
        if url.startswith("sqlite") and path and path != ":memory:":
            st = os.stat(path)
            _FILES[url] = (Path(path), (st.st_dev, st.st_ino))
        _ENGINES[key] = (write, read)
        return write, read


# A pooled PostgreSQL connection returned less than this ago is handed out without a ping (a
# round trip, ~0.1-1 ms on a loaded host, per transaction): the scheduler's loop polls every
# 0.5 s and runs 2 transactions a round, so its connection stays under it, and a connection
# idle longer (a server restart, a failover, an idle timeout in between) is pinged and replaced
# as before. A connection that died within the window fails its first statement instead; the
# pool then replaces every connection it holds (SQLAlchemy invalidates the whole pool on a
# disconnect), and the caller's retry (a round: the next poll; a run's end: ``_retrying``) runs
# on a fresh one. A ping never promised more: the server can die right after it.
_FRESH_S = 1.0


def _pinged(eng: Engine) -> Engine:
    """``eng`` (``pool_pre_ping`` off) with a ping on checkout of every connection returned
    ``_FRESH_S`` or longer ago: a dead one is replaced before use."""
    @event.listens_for(eng, "checkin")
    def _returned(_dbapi_conn, record):
        record.info["returned_at"] = time.monotonic()

    @event.listens_for(eng, "checkout")
    def _check(dbapi_conn, record, _proxy):
        at = record.info.get("returned_at")       # None: a connection made just now
        if at is None or time.monotonic() - at < _FRESH_S:
            return
        try:
            eng.dialect.do_ping(dbapi_conn)
        except eng.dialect.loaded_dbapi.Error as err:
            if not eng.dialect.is_disconnect(err, dbapi_conn, None):
                raise
            # as pool_pre_ping does: every pooled connection made before now is replaced, and
            # the pool connects afresh for this checkout
            raise InvalidatePoolError(str(err)) from err

    return eng


def _sqlite_engine(url: str, *, immediate: bool) -> Engine:
    eng = create_engine(url, connect_args={"check_same_thread": False, "timeout": 60},
                        pool_size=10, max_overflow=60)

    @event.listens_for(eng, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None          # we issue BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @event.listens_for(eng, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

    return eng


# ``claim_many``'s GPU claims in one UPDATE on PostgreSQL (ids and allocations as arrays); a GPU
# already held is not claimed, and the row count tells
_CLAIM_PG = text("UPDATE gpus AS g SET alloc_id = v.a FROM unnest(CAST(:ids AS integer[]), CAST(:allocs AS varchar[])) "
                 "AS v(id, a) WHERE g.id = v.id AND g.alloc_id IS NULL")


def _devices(placement: dict[str, list[int]]) -> list[str]:
    if len(placement) == 1:
        return [str(d) for d in next(iter(placement.values()))]
    return [f"{n}:{d}" for n, ds in placement.items() for d in ds]


def _allocation(row: AllocationRow) -> Allocation:
    placement = {n: list(v) for n, v in row.placement.items()}
    return Allocation(id=row.id, job_id=row.job_id, pool=row.pool, gpu_type=row.gpu_type,
                      plan=Plan.model_validate(row.plan), placement=placement, devices=_devices(placement),
                      status=row.status, created_at=row.created_at, lease_expires_at=row.lease_expires_at,
                      expected_end_at=row.expected_end_at)


def _steps_of(spec: dict[str, Any]) -> int | None:
    for k in ("steps", "train_steps"):
        if isinstance(spec.get(k), int):
            return spec[k]
    tok, gb, seq = spec.get("train_tokens"), spec.get("global_batch"), spec.get("seq_len")
    if all(isinstance(v, int) and v > 0 for v in (tok, gb, seq)):
        return steps_for_tokens(tok, gb, seq)
    return None


class Ledger:
    """The GPU ledger at ``url`` (default: env FRENZY_LEDGER_URL, else
    ``sqlite:///$FRENZY_HOME/ledger.db`` with FRENZY_HOME defaulting to ``./.frenzy``)."""

    def __init__(self, url: str | None = None):
        self.url = _normalise(url or default_url())
        self._write_engine, self._read_engine = _engines(self.url)
        self.is_postgres = self._write_engine.dialect.name == "postgresql"
        self._mirror = None                            # cluster_state's rows (ledger.mirror)

    # --- sessions -------------------------------------------------------------------------
    def _check_file(self) -> None:
        """SQLite: the file opened is still the one at its path (cheap: one stat)."""
        known = _FILES.get(self.url)
        if known is None:
            return
        path, ident = known
        try:
            st = os.stat(path)
            now = (st.st_dev, st.st_ino)
        except FileNotFoundError:
            now = None
        if now != ident:
            raise LedgerGone(f"the ledger file {path} was {'deleted' if now is None else 'replaced'} while in use; "
                             "refusing to go on (an empty ledger would show every GPU free): restore it "
                             "and restart")

    def _retrying(self, what: str, fn, *args, **kwargs):
        """``fn(*args, **kwargs)``, retried on a lost database connection with backoff; then
        ``LedgerUnavailable`` naming ``what``. For the writes that end a run."""
        for delay in (*_END_RETRY_DELAYS_S, None):
            try:
                return fn(*args, **kwargs)
            except OperationalError as err:
                if not (self.is_postgres or err.connection_invalidated):
                    raise       # SQLite: a lock wait already took busy_timeout; retrying only waits longer
                if delay is None:
                    raise LedgerUnavailable(f"{what}: the ledger's database is unreachable after "
                                            f"{sum(_END_RETRY_DELAYS_S):.1f} s of retries "
                                            f"({str(err.orig or err).splitlines()[0]})") from err
                time.sleep(delay)

    @contextmanager
    def _tx(self) -> Iterator[Session]:
        """A writing transaction (SQLite: BEGIN IMMEDIATE). Commits on success, else rolls back."""
        self._check_file()
        with Session(self._write_engine, expire_on_commit=False) as s:
            with s.begin():
                yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        self._check_file()
        with Session(self._read_engine, expire_on_commit=False) as s:
            with s.begin():
                yield s

    def _db_now(self, s: Session) -> float:
        return db_now(s)

    def _locked(self, stmt, *, skip_locked: bool = False):
        return stmt.with_for_update(skip_locked=skip_locked) if self.is_postgres else stmt

    # --- topology -------------------------------------------------------------------------
    def sync_cluster(self, cluster, *, prune: bool = False) -> list[str]:
        """Make the ledger's rows for ``cluster``'s pools (a ``scheduler.cluster.Cluster``)
        match it. Idempotent; never touches who holds a GPU. A shared ledger holds many
        clusters: pools the cluster does not name are left as they are, unless ``prune``, which
        deactivates them (``frenzy pools sync --prune``). Nodes and GPUs a named pool no longer
        has become inactive. Returns the names of the pools this call deactivated."""
        with self._tx() as s:
            if self.is_postgres:    # concurrent syncs insert the same rows: serialise them
                s.execute(text("SELECT pg_advisory_xact_lock(7346021)"))
            pools = {p.name: p for p in s.exec(select(PoolRow)).all()}
            names = {p.name for p in cluster.pools}
            # only the rows of the pools this sync owns (all of them when pruning)
            nodes = {n.node_id: n for n in s.exec(select(NodeRow)).all() if prune or n.pool in names}
            gpus = {(g.node_id, g.device_index): g for g in s.exec(select(GpuRow)).all()
                    if prune or g.pool in names or g.node_id in nodes}
            want_pools, want_nodes, want_gpus = set(), set(), set()
            for p in cluster.pools:
                g = cluster.gpu(p.gpu)
                vals = dict(gpu_type=p.gpu, nodes=p.nodes, gpus_per_node=p.gpus_per_node,
                            inter_node_gbps=cluster.inter_node_gbps(p.name), gpu_memory_gib=g.memory_gib,
                            intra_link=g.intra_link, active=True)
                row = pools.get(p.name)
                if row is None:
                    s.add(PoolRow(name=p.name, **vals))
                else:
                    for k, v in vals.items():
                        setattr(row, k, v)
                want_pools.add(p.name)
            s.flush()
            for p in cluster.pools:
                for i, nid in enumerate(p.node_ids()):
                    addr = p.addresses[i] if p.addresses else None
                    row = nodes.get(nid)
                    if row is None:
                        s.add(NodeRow(node_id=nid, pool=p.name, idx=i, address=addr, active=True))
                    else:
                        row.pool, row.idx, row.address, row.active = p.name, i, addr, True
                    want_nodes.add(nid)
            s.flush()
            for p in cluster.pools:
                for nid in p.node_ids():
                    for d in p.device_indices():
                        row = gpus.get((nid, d))
                        if row is None:
                            s.add(GpuRow(node_id=nid, device_index=d, pool=p.name, gpu_type=p.gpu, active=True))
                        else:
                            row.pool, row.gpu_type, row.active = p.name, p.gpu, True
                        want_gpus.add((nid, d))
            pruned = []
            if prune:
                for name, row in pools.items():
                    if name not in want_pools and row.active:
                        row.active = False
                        pruned.append(name)
            for nid, row in nodes.items():
                if nid not in want_nodes:
                    row.active = False
            for key, row in gpus.items():
                if key not in want_gpus:
                    row.active = False
            return sorted(pruned)

    def remove_pools(self, names: list[str]) -> list[str]:
        """Deactivate the named pools with their nodes and GPUs (GPUs held now stay held until
        released; nothing new is placed there). Returns the names that were active. A name the
        ledger does not know is an error (nothing changes)."""
        with self._tx() as s:
            rows = {p.name: p for p in s.exec(select(PoolRow).where(PoolRow.name.in_(list(names)))).all()}
            unknown = sorted(set(names) - set(rows))
            if unknown:
                raise FrenzyInputError("pool", f"the ledger has no pool {', '.join(unknown)}")
            removed = sorted(n for n, r in rows.items() if r.active)
            for r in rows.values():
                r.active = False
            s.execute(update(NodeRow).where(NodeRow.pool.in_(list(names))).values(active=False)
                      .execution_options(synchronize_session=False))
            s.execute(update(GpuRow).where(GpuRow.pool.in_(list(names))).values(active=False)
                      .execution_options(synchronize_session=False))
            return removed

    # --- jobs and plans -------------------------------------------------------------------
    def submit_job(self, job_id: str, name: str, spec: dict[str, Any]) -> None:
        """Record a submitted job (idempotent: a second call updates name and spec)."""
        with self._tx() as s:
            row = s.get(JobRow, job_id)
            if row is None:
                s.add(JobRow(job_id=job_id, name=name, spec=dict(spec), steps=_steps_of(spec),
                             submitted_at=time.time()))
            else:
                row.name, row.spec, row.steps = name, dict(spec), _steps_of(spec)

    def record_plans(self, job_id: str, plans: list[Plan]) -> None:
        """Store the job's candidate plans, in rank order (replacing earlier ones)."""
        with self._tx() as s:
            self._ensure_job(s, job_id)
            for old in s.exec(select(PlanRow).where(PlanRow.job_id == job_id)).all():
                s.delete(old)
            for rank, p in enumerate(plans):
                s.add(PlanRow(job_id=job_id, rank=rank, gpu_type=p.gpu_type, gpus=p.gpus,
                              device_used_gib=p.device_used_gib, step_time_s=p.step_time_s,
                              plan=p.model_dump(mode="json")))

    def plans(self, job_id: str) -> list[Plan]:
        with self._read() as s:
            rows = s.exec(select(PlanRow).where(PlanRow.job_id == job_id).order_by(PlanRow.rank)).all()
            return [Plan.model_validate(r.plan) for r in rows]

    def _ensure_job(self, s: Session, job_id: str) -> JobRow:
        row = s.get(JobRow, job_id)
        if row is None:
            row = JobRow(job_id=job_id, name=job_id, spec={}, submitted_at=time.time())
            s.add(row)
            s.flush()
        return row

    # --- allocation -----------------------------------------------------------------------
    def allocate(self, job_id: str, plan: Plan, placement: dict[str, list[int]],
                 lease_s: float = DEFAULT_LEASE_S) -> Allocation:
        """Claim exactly ``placement`` (node -> device indices) for ``job_id`` running ``plan``.

        Atomic: raises ``FrenzyInputError`` for a GPU the ledger does not know (or of another
        type, or a placement that does not match the plan) and ``LedgerConflict`` when any of
        the GPUs is held; in both cases nothing changes."""
        with self._tx() as s:
            return self.allocate_in(s, job_id, plan, placement, lease_s)

    def allocate_in(self, s: Session, job_id: str, plan: Plan, placement: dict[str, list[int]],
                    lease_s: float = DEFAULT_LEASE_S, now: float | None = None) -> Allocation:
        """``allocate`` inside the caller's writing transaction ``s`` (the live scheduler
        claims every start of a round in one transaction, each under a savepoint). ``now``:
        the database time the caller already read in ``s``."""
        wanted = self._check_placement(plan, placement)
        stmt = (select(GpuRow).where(GpuRow.node_id.in_(list(placement)))
                .order_by(GpuRow.id))
        rows = {(g.node_id, g.device_index): g for g in s.exec(self._locked(stmt)).all()}
        chosen = []
        for key in wanted:
            g = rows.get(key)
            if g is None or not g.active:
                raise FrenzyInputError("placement", f"unknown GPU {key[0]}:{key[1]} (not in the ledger's cluster)")
            if g.gpu_type != plan.gpu_type:
                raise FrenzyInputError("placement", f"GPU {key[0]}:{key[1]} is a {g.gpu_type}, "
                                                    f"the plan needs {plan.gpu_type}")
            if g.alloc_id is not None:
                raise LedgerConflict(f"GPU {key[0]}:{key[1]} is held by allocation {g.alloc_id}")
            chosen.append(g)
        return self._claim(s, job_id, plan, placement, chosen, lease_s, now=now)

    def claim_many(self, s: Session, starts: list[tuple[str, Plan, dict[str, list[int]]]], lease_s: float,
                   now: float) -> list[Allocation | str]:
        """``allocate`` for many starts inside the caller's writing transaction ``s``, in a
        fixed number of statements (the live scheduler's round: one start is ~8 round trips
        alone). Every GPU row of the named nodes is locked first (PostgreSQL ``FOR UPDATE`` in
        id order, as ``allocate``), so the checks below hold until commit. Per start, in order:
        its ``Allocation``, or why it cannot start (unknown or inactive GPU, another type, held
        by an allocation or by an earlier start of this batch); the others go ahead."""
        out: list[Allocation | str] = []
        if not starts:
            return out
        nodes = sorted({n for _, _, pl in starts for n in pl})
        rows = s.execute(self._locked(select(GpuRow.id, GpuRow.node_id, GpuRow.device_index, GpuRow.gpu_type,
                                             GpuRow.pool, GpuRow.active, GpuRow.alloc_id)
                                      .where(GpuRow.node_id.in_(nodes)).order_by(GpuRow.id))).all()
        gpus = {(r.node_id, r.device_index): r for r in rows}
        job_ids = sorted({j for j, _, _ in starts})
        steps = dict(s.execute(select(JobRow.job_id, JobRow.steps).where(JobRow.job_id.in_(job_ids))).all())
        taken: set[int] = set()
        allocs, claims = [], []
        for job_id, plan, placement in starts:
            try:
                wanted = self._check_placement(plan, placement)
            except FrenzyInputError as err:
                out.append(str(err))
                continue
            chosen, why = [], ""
            for key in wanted:
                g = gpus.get(key)
                if g is None or not g.active:
                    why = f"unknown GPU {key[0]}:{key[1]} (not in the ledger's cluster)"
                elif g.gpu_type != plan.gpu_type:
                    why = f"GPU {key[0]}:{key[1]} is a {g.gpu_type}, the plan needs {plan.gpu_type}"
                elif g.alloc_id is not None or g.id in taken:
                    why = f"GPU {key[0]}:{key[1]} is held by allocation {g.alloc_id or 'of this round'}"
                if why:
                    break
                chosen.append(g)
            if why:
                out.append(why)
                continue
            if job_id not in steps:
                steps[job_id] = self._ensure_job(s, job_id).steps
            job_steps = steps[job_id]
            counts: dict[str, int] = {}
            for g in chosen:
                counts[g.pool] = counts.get(g.pool, 0) + 1
            alloc_id = uuid.uuid4().hex
            pl = {n: sorted(int(d) for d in ds) for n, ds in placement.items()}
            row = dict(id=alloc_id, job_id=job_id, pool=max(counts, key=lambda k: (counts[k], k)),
                       gpu_type=plan.gpu_type, plan=plan.model_dump(mode="json"), placement=pl, status="active",
                       created_at=now, lease_expires_at=now + lease_s, ended_at=None,
                       expected_end_at=(now + plan.step_time_s * job_steps if job_steps and plan.step_time_s > 0
                                        else None))
            allocs.append(row)
            claims.extend({"b_gpu": g.id, "b_alloc": alloc_id} for g in chosen)
            taken.update(g.id for g in chosen)
            out.append(Allocation(id=alloc_id, job_id=job_id, pool=row["pool"], gpu_type=plan.gpu_type, plan=plan,
                                  placement=pl, devices=_devices(pl), created_at=now,
                                  lease_expires_at=row["lease_expires_at"], expected_end_at=row["expected_end_at"]))
        if allocs:
            s.execute(insert(AllocationRow.__table__), allocs)
            t = GpuRow.__table__
            # the guard that makes double booking impossible even if a caller skipped the locks
            if self.is_postgres:            # one statement for every GPU
                res = s.execute(_CLAIM_PG, {"ids": [c["b_gpu"] for c in claims],
                                            "allocs": [c["b_alloc"] for c in claims]})
            else:
                res = s.execute(t.update().where(t.c.id == bindparam("b_gpu"), t.c.alloc_id == None)  # noqa: E711
                                .values(alloc_id=bindparam("b_alloc")), claims)
            if res.rowcount not in (-1, len(claims)):
                raise LedgerConflict("a GPU was claimed concurrently")
            s.execute(update(JobRow).where(JobRow.job_id.in_(sorted({a["job_id"] for a in allocs})))
                      .values(status="placed").execution_options(synchronize_session=False))
        return out

    def allocate_best_fit(self, job_id: str, plan: Plan, lease_s: float = DEFAULT_LEASE_S,
                          pool: str | None = None, node: str | None = None) -> Allocation | None:
        """Choose free GPUs of ``plan.gpu_type`` (fewest nodes, best fit: the placement code
        the policies use), on ``pool`` only when given, on ``node`` only when given, and claim
        them atomically; None when they are not free now.

        The free GPUs are read without locks; only the chosen rows are locked (PostgreSQL:
        ``FOR UPDATE`` in id order). If a concurrent claim took one of them first, the
        transaction rolls back and the choice is made again from the new free set, so
        simultaneous requests get every free GPU instead of skipping each other's rows."""
        for attempt in range(_BEST_FIT_ATTEMPTS):
            try:
                with self._tx() as s:
                    return self._best_fit_once(s, job_id, plan, lease_s, pool, node)
            except _Taken:
                # another claim committed on a chosen GPU: it made progress, we re-choose
                time.sleep(random.uniform(0, 0.002 * (attempt + 1)))
        return None

    def _best_fit_once(self, s: Session, job_id: str, plan: Plan, lease_s: float,
                       pool: str | None = None, node: str | None = None) -> Allocation | None:
        stmt = select(GpuRow).where(GpuRow.gpu_type == plan.gpu_type, GpuRow.active == True,  # noqa: E712
                                    GpuRow.alloc_id == None)  # noqa: E711
        if pool is not None:
            stmt = stmt.where(GpuRow.pool == pool)
        if node is not None:
            stmt = stmt.where(GpuRow.node_id == node)
        stmt = stmt.order_by(GpuRow.id)
        free_rows = s.exec(stmt).all()
        if len(free_rows) < plan.gpus:
            return None
        size = {p.name: p.gpus_per_node for p in s.exec(select(PoolRow)).all()}
        by_node: dict[str, list[GpuRow]] = {}
        for g in free_rows:
            by_node.setdefault(g.node_id, []).append(g)
        nodes = [Node(node_id=n, pool=rs[0].pool, gpu_type=plan.gpu_type,
                      gpus=size.get(rs[0].pool, len(rs)), free=sorted(r.device_index for r in rs))
                 for n, rs in by_node.items()]
        nodes.sort(key=lambda n: _node_order(n.node_id))
        placement = FreeIndex(nodes).place_compact(plan.gpu_type, plan.gpus, plan.tp)
        if placement is None:
            return None
        index = {(g.node_id, g.device_index): g for g in free_rows}
        chosen = [index[(n, d)] for n, ds in placement.items() for d in ds]
        if self.is_postgres:
            # lock just these rows (waiting for a concurrent claim to finish) and re-read them
            ids = sorted(g.id for g in chosen)
            latest = s.execute(select(GpuRow.alloc_id, GpuRow.active).where(GpuRow.id.in_(ids))
                               .order_by(GpuRow.id).with_for_update()).all()
            if any(alloc is not None or not active for alloc, active in latest):
                raise _Taken()
        try:
            return self._claim(s, job_id, plan, placement, chosen, lease_s)
        except LedgerConflict:
            raise _Taken() from None

    def _check_placement(self, plan: Plan, placement: dict[str, list[int]]) -> list[tuple[str, int]]:
        if not placement or not all(isinstance(v, (list, tuple)) and v for v in placement.values()):
            raise FrenzyInputError("placement", "must map each node id to a non-empty list of device indices")
        wanted = [(n, int(d)) for n, ds in placement.items() for d in ds]
        if len(set(wanted)) != len(wanted):
            raise FrenzyInputError("placement", "names a GPU twice")
        if len(wanted) != plan.gpus:
            raise FrenzyInputError("placement", f"has {len(wanted)} GPUs, the plan needs {plan.gpus}")
        return wanted

    def _claim(self, s: Session, job_id: str, plan: Plan, placement: dict[str, list[int]],
               rows: list[GpuRow], lease_s: float, now: float | None = None) -> Allocation:
        job = self._ensure_job(s, job_id)
        now = self._db_now(s) if now is None else now
        alloc_id = uuid.uuid4().hex
        ids = [g.id for g in rows]
        counts: dict[str, int] = {}
        for g in rows:
            counts[g.pool] = counts.get(g.pool, 0) + 1
        pool = max(counts, key=lambda k: (counts[k], k))
        expected = now + plan.step_time_s * job.steps if job.steps and plan.step_time_s > 0 else None
        placement = {n: sorted(int(d) for d in ds) for n, ds in placement.items()}
        row = AllocationRow(id=alloc_id, job_id=job_id, pool=pool, gpu_type=plan.gpu_type,
                            plan=plan.model_dump(mode="json"), placement=placement, status="active",
                            created_at=now, lease_expires_at=now + lease_s, expected_end_at=expected)
        s.add(row)
        s.flush()
        # the guard that makes double booking impossible even if a caller skipped the locks
        res = s.execute(update(GpuRow).where(GpuRow.id.in_(ids), GpuRow.alloc_id == None)  # noqa: E711
                        .values(alloc_id=alloc_id).execution_options(synchronize_session=False))
        if res.rowcount != len(ids):
            raise LedgerConflict("a GPU was claimed concurrently")
        job.status = "placed"
        return _allocation(row)

    def heartbeat(self, alloc_id: str, lease_s: float = DEFAULT_LEASE_S) -> float:
        """Renew the lease by ``lease_s`` from the database's clock; returns the new expiry
        (Unix seconds, database clock). Raises ``LeaseLost`` when the allocation is no longer
        active, or when its lease already ran out (then it is expired here and its GPUs freed:
        a lease past its expiry may already be someone else's, so it is never revived)."""
        with self._tx() as s:
            row = s.exec(self._locked(select(AllocationRow).where(AllocationRow.id == alloc_id))).first()
            if row is None:
                raise FrenzyInputError("alloc_id", f"unknown allocation {alloc_id!r}")
            if row.status != "active":
                raise LeaseLost(f"allocation {alloc_id} is {row.status}")
            now = self._db_now(s)
            if row.lease_expires_at <= now:
                self._free(s, [row], "expired", now)
                lost = f"allocation {alloc_id}: lease ran out {now - row.lease_expires_at:.1f} s ago (database clock)"
            else:
                row.lease_expires_at = now + lease_s
                return row.lease_expires_at
        raise LeaseLost(lost)

    def lease_valid(self, alloc_id: str) -> bool:
        """True while the allocation is active and its lease has not run out by the database's
        clock (one indexed read; no lock). A run that gets False must stop: its GPUs may be
        another job's."""
        with self._read() as s:
            row = s.get(AllocationRow, alloc_id)
            if row is None:
                raise FrenzyInputError("alloc_id", f"unknown allocation {alloc_id!r}")
            return row.status == "active" and row.lease_expires_at > self._db_now(s)

    def release(self, alloc_id: str) -> bool:
        """Free the allocation's GPUs. Idempotent: True if this call released it, False if it
        was already released or expired. An unknown id is an error (nothing changes). A lost
        database connection is retried with backoff, then ``LedgerUnavailable`` (the caller
        reports it; the lease, no longer renewed, frees the GPUs within one TTL)."""
        return self._retrying(f"release of allocation {alloc_id}", self._release, alloc_id)

    def _release(self, alloc_id: str) -> bool:
        with self._tx() as s:
            row = s.exec(self._locked(select(AllocationRow).where(AllocationRow.id == alloc_id))).first()
            if row is None:
                raise FrenzyInputError("alloc_id", f"unknown allocation {alloc_id!r}")
            if row.status != "active":
                return False
            self._free(s, [row], "released")
            return True

    def expire_leases(self, now: float | None = None) -> list[str]:
        """Free the GPUs of every allocation whose lease ran out by the database's clock;
        returns their ids. ``now`` is ignored (kept for old callers): a caller's clock may be
        skewed, and one running ahead must not expire healthy leases."""
        if now is not None:
            warnings.warn("Ledger.expire_leases(now=...) is ignored: leases expire by the database's clock",
                          DeprecationWarning, stacklevel=2)
        with self._tx() as s:
            now = self._db_now(s)
            stmt = select(AllocationRow).where(AllocationRow.status == "active",
                                               AllocationRow.lease_expires_at < now)
            rows = s.exec(self._locked(stmt, skip_locked=True)).all()
            if rows:
                self._free(s, rows, "expired", now)
            return [r.id for r in rows]

    def _free(self, s: Session, rows: list[AllocationRow], status: str, now: float | None = None) -> None:
        ids = [r.id for r in rows]
        if self.is_postgres:
            # lock the GPU rows in id order first, as allocate does: no lock-order deadlocks
            s.exec(select(GpuRow.id).where(GpuRow.alloc_id.in_(ids)).order_by(GpuRow.id).with_for_update()).all()
        s.execute(update(GpuRow).where(GpuRow.alloc_id.in_(ids)).values(alloc_id=None)
                  .execution_options(synchronize_session=False))
        now = self._db_now(s) if now is None else now
        for r in rows:
            r.status = status
            r.ended_at = now

    def allocation(self, alloc_id: str) -> Allocation:
        with self._read() as s:
            row = s.get(AllocationRow, alloc_id)
            if row is None:
                raise FrenzyInputError("alloc_id", f"unknown allocation {alloc_id!r}")
            return _allocation(row)

    def allocations(self, *, active_only: bool = True) -> list[Allocation]:
        with self._read() as s:
            stmt = select(AllocationRow)
            if active_only:
                stmt = stmt.where(AllocationRow.status == "active")
            return [_allocation(r) for r in s.exec(stmt.order_by(AllocationRow.created_at)).all()]

    @contextmanager
    def lease(self, alloc_id: str, every_s: float | None = None, lease_s: float = DEFAULT_LEASE_S):
        """Renew the lease from a background thread while the block runs (every ``every_s``,
        default a third of the lease). Yields a ``LeaseState``: check ``state.lost`` (or call
        ``state.check()``, which raises ``LeaseLost``) at every step boundary and stop when set.
        It is set when the ledger says the lease is gone, and also when no renewal succeeded
        for ``lease_s`` (database unreachable: the lease has run out by now, its GPUs may be
        reassigned). Stops on exit; does not release (callers do)."""
        every = every_s if every_s is not None else max(0.05, lease_s / 3.0)
        stop = threading.Event()
        state = LeaseState(alloc_id)

        def beat() -> None:
            last_ok = time.monotonic()
            while not stop.wait(every):
                try:
                    self.heartbeat(alloc_id, lease_s)
                    state["beats"] += 1
                    last_ok = time.monotonic()
                except LeaseLost as e:
                    state.mark_lost(e)
                    return
                except Exception as e:  # a transient database error: try again next period
                    state["error"] = e
                    if time.monotonic() - last_ok >= lease_s:
                        state.mark_lost(LeaseLost(f"allocation {alloc_id}: lease not renewed for "
                                                  f"{time.monotonic() - last_ok:.0f} s ({type(e).__name__}: {e})"))
                        return

        self.heartbeat(alloc_id, lease_s)
        t = threading.Thread(target=beat, name=f"frenzy-lease-{alloc_id[:8]}", daemon=True)
        t.start()
        try:
            yield state
        finally:
            stop.set()
            t.join(timeout=max(5.0, every * 2))

    # --- views ----------------------------------------------------------------------------
    def cluster_state(self) -> ClusterState:
        """Free GPUs per node and the running allocations, as the policies see them: this
        handle's mirror of the rows (``ledger.mirror``), refreshed with the rows that changed
        since the last call (the first call reads them all)."""
        if self._mirror is None:
            from .mirror import LedgerMirror
            self._mirror = LedgerMirror(self, queue=False)
        with self._mirror.lock:
            self._mirror.refresh()
            return self._mirror.cluster_state()

    def holders(self) -> dict[tuple[str, int], str]:
        """(node, device) -> allocation id, for every held GPU."""
        with self._read() as s:
            return {(g.node_id, g.device_index): g.alloc_id
                    for g in s.exec(select(GpuRow).where(GpuRow.alloc_id != None)).all()}  # noqa: E711

    # --- measurements ---------------------------------------------------------------------
    def record_measurement(self, job_id: str, alloc_id: str | None, gpu_type: str, plan: Plan | dict,
                           predicted: dict[str, Any], measured: dict[str, Any]) -> int:
        """Store what a run measured next to what was predicted (for calibration). Retried like
        ``release``; ``LedgerUnavailable`` when the database stays unreachable."""
        return self._retrying(f"measurement of job {job_id}", self._record_measurement, job_id, alloc_id,
                              gpu_type, plan, predicted, measured)

    def _record_measurement(self, job_id: str, alloc_id: str | None, gpu_type: str, plan: Plan | dict,
                            predicted: dict[str, Any], measured: dict[str, Any]) -> int:
        pd = plan.model_dump(mode="json") if isinstance(plan, BaseModel) else dict(plan)

        def num(d: dict[str, Any], *keys: str) -> float | None:
            for k in keys:
                v = d.get(k)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    return float(v)
            return None

        with self._tx() as s:
            row = MeasurementRow(
                job_id=job_id, alloc_id=alloc_id, gpu_type=gpu_type, plan=pd,
                predicted=_jsonable(predicted), measured=_jsonable(measured),
                predicted_device_used_gib=num(predicted, "device_used_gib"),
                measured_device_used_gib=num(measured, "device_used_gib", "nvml_used_gib"),
                predicted_reserved_peak_gib=num(predicted, "reserved_peak_gib"),
                measured_reserved_peak_gib=num(measured, "reserved_peak_gib"),
                predicted_step_time_s=num(predicted, "step_time_s"),
                measured_step_time_s=num(measured, "step_time_s"),
                tokens_per_s=num(measured, "tokens_per_s"), created_at=time.time())
            s.add(row)
            s.flush()
            return int(row.id)

    def measurements(self, gpu_type: str | None = None) -> list[Measurement]:
        with self._read() as s:
            stmt = select(MeasurementRow)
            if gpu_type is not None:
                stmt = stmt.where(MeasurementRow.gpu_type == gpu_type)
            return [Measurement.model_validate(r) for r in s.exec(stmt.order_by(MeasurementRow.id)).all()]


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    import json
    return json.loads(json.dumps(d, default=str))


def _node_order(node_id: str) -> tuple[str, int]:
    head, _, tail = node_id.rpartition("-")
    return (head, int(tail)) if tail.isdigit() else (node_id, 0)
