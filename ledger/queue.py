"""The live scheduler's side of the ledger: the job queue, leadership, and the re-size / stop
requests a scheduler makes of running jobs.

* A submission ``enqueue``s its job (the TrainingJob, its candidate plans, its step count) and
  waits until the scheduler has placed it: the row turns ``running`` with an allocation.
* Exactly one scheduler acts at a time: ``Leadership`` holds a lease row whose expiry is taken
  from the database's clock (``db_now``), so a caller whose clock runs ahead cannot steal it;
  a standby takes over once the lease has run out. The scheduler's writes are fenced by the
  lease's epoch (``JobQueue.fence``): each checks, in its own transaction, that its scheduler
  still holds the lease it acted under, so one that stalled past its lease (a pause, a hung
  connection) cannot write a round it computed before a standby took over.
* The scheduler asks a running job to re-size or stop by writing a request on its row; the run's
  heartbeat reads it (``touch``), stops the training at a step boundary, and reports back
  (``ack_request``, ``resized``, ``requeue``). A request for a job that is no longer running is
  ignored and logged, never an error.

Uses the ledger's own transactions (``Ledger._tx``: SQLite ``BEGIN IMMEDIATE``, PostgreSQL row
locks), so every change here is one transaction.
"""
from __future__ import annotations

import json
import logging
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
import math
from typing import Any, Callable, Iterator

from sqlalchemy import bindparam, exists, or_, text, update
from sqlalchemy.orm import defer
from sqlmodel import Session, select

from estimator.plan import Plan

from .core import Ledger, db_now
from .tables import AllocationRow, JobRow, QueueJobRow, SchedulerLeaseRow

log = logging.getLogger("frenzy.queue")

# How long a submitter's heartbeat keeps its queue row alive. Its watcher beats every second
# (training.REQUEST_POLL_S); 60 s survives a minute of database or process stalls before the
# reaper gives the job up.
DEFAULT_ALIVE_S = 60.0
ACTIVE = ("pending", "running")
# how a job ends: trained to its last step, failed, or stopped on request (Ctrl-C, `frenzy stop`)
# with a checkpoint to resume from
ENDED = ("done", "failed", "stopped")
# A run's watcher forwards a request within a second (training.REQUEST_POLL_S); one not taken
# up in two minutes (a database stall of a minute survives) belongs to a run that stopped
# watching. Such a run, or one that acknowledged but did not stop in ``stop_allowance_s``, is
# cancelled through Prefect by the scheduler, its GPUs freed and its job queued again
# (``JobQueue.overdue``, ``cancel_run``): it resumes from its last checkpoint.
REQUEST_ACK_S = 120.0
# After the acknowledgement the run finishes the step it is in, writes a checkpoint and lets
# its GPUs go: allowed STOP_STEPS of its plan's step time (the step in flight and one of
# slack), its checkpoint at CHECKPOINT_WRITE_GBPS (a conservative shared-filesystem write
# rate, serialisation included: 8 GB at 0.2 GB/s is 40 s), plus STOP_MARGIN_S for process
# teardown (NCCL, data loaders: seconds).
STOP_STEPS = 2.0
CHECKPOINT_WRITE_GBPS = 0.2
STOP_MARGIN_S = 60.0
# A waiting job's predicted start is rewritten when it moves by more than this: the queue view
# shows it to the second, and a round must not rewrite a thousand rows for sub-second drift.
PREDICTION_RESOLUTION_S = 1.0


class LeadershipLost(RuntimeError):
    """A scheduler's write found that its scheduler no longer holds the lease it acted under
    (another took over, or the lease ran out): the write's transaction is rolled back."""


@dataclass(frozen=True, slots=True)
class LeaseFence:
    """The lease a scheduler acts under: the lease row ``name`` held by ``holder`` at ``epoch``
    (``Leadership.fence()``)."""

    name: str
    holder: str
    epoch: int


# The lease row, shared-locked on PostgreSQL: a takeover (``Leadership.acquire``, FOR UPDATE)
# waits for the fenced write's commit, so the write lands entirely before the new epoch or not
# at all. SQLite's writers are serialised by BEGIN IMMEDIATE.
_FENCE_SQL = {
    "postgresql": text("SELECT holder, epoch, expires_at >= EXTRACT(EPOCH FROM clock_timestamp()) "
                       "FROM scheduler_lease WHERE name = :name FOR SHARE"),
    "sqlite": text("SELECT holder, epoch, expires_at >= (julianday('now') - 2440587.5) * 86400.0 "
                   "FROM scheduler_lease WHERE name = :name"),
}


@dataclass(slots=True)
class QueueJob:
    """A read-only view of a queue row."""

    job_id: str
    name: str
    job: dict[str, Any]
    plans: list[Plan] | None            # None: read without them (``JobQueue.jobs(plans=False)``)
    state: str
    submitted_at: float
    steps_total: int
    steps_done: int
    model: str
    checkpoint_gb: float
    attained_gpu_s: float
    restarts: int
    preemptions: int
    resizes: int
    allocation_id: str | None
    allocation: dict[str, Any]
    started_at: float | None
    predicted_start_s: float | None
    wait_gpu_type: str | None
    wait_gpus: int | None
    wait_reason: str
    request: dict[str, Any] = field(default_factory=dict)
    request_state: str = ""
    error: str = ""
    ended_at: float | None = None
    flow_run_id: str | None = None
    start_reason: str = ""              # why the scheduler started the current run (QueueJobRow)

    @classmethod
    def of(cls, r: Any, *, plans: bool = True) -> "QueueJob":
        """From a ``QueueJobRow`` or a row of its columns (``plans``: parse the plans column,
        which the row must then hold)."""
        return cls(job_id=r.job_id, name=r.name, job=dict(r.job or {}),
                   plans=[Plan.model_validate(p) for p in (r.plans or [])] if plans else None, state=r.state,
                   submitted_at=r.submitted_at, steps_total=r.steps_total, steps_done=r.steps_done,
                   model=r.model, checkpoint_gb=r.checkpoint_gb, attained_gpu_s=r.attained_gpu_s,
                   restarts=r.restarts, preemptions=r.preemptions, resizes=r.resizes,
                   allocation_id=r.allocation_id, allocation=dict(r.allocation or {}),
                   started_at=r.started_at, predicted_start_s=r.predicted_start_s,
                   wait_gpu_type=r.wait_gpu_type, wait_gpus=r.wait_gpus, wait_reason=r.wait_reason,
                   request=dict(r.request or {}), request_state=r.request_state, error=r.error,
                   ended_at=r.ended_at, flow_run_id=r.flow_run_id, start_reason=r.start_reason or "")

    @property
    def open_request(self) -> bool:
        """A re-size or stop the scheduler asked for and the run has not finished acting on."""
        return bool(self.request) and self.request_state in ("pending", "acked")


class JobQueue:
    """The queue tables of ``ledger`` (a ``Ledger`` or its URL)."""

    def __init__(self, ledger: Ledger | str | None = None, *, fence: LeaseFence | None = None):
        self.ledger = ledger if isinstance(ledger, Ledger) else Ledger(ledger)
        # the scheduler's queue: the lease its writes (requests, starts, wait answers,
        # cancellations) are fenced by; None for submitters and runs, whose writes are their own
        self.fence = fence

    @contextmanager
    def _fenced_tx(self) -> Iterator[Session]:
        """A writing transaction of the scheduler's: it first raises ``LeadershipLost``
        (rolling back) unless ``fence``'s holder still holds its lease at its epoch, unexpired
        by the database's clock; without a ``fence``, a plain one."""
        with self.ledger._tx() as s:
            if self.fence is not None:
                self._check_fence(s, self.fence)
            yield s

    def _check_fence(self, s: Session, f: LeaseFence) -> None:
        row = s.execute(_FENCE_SQL["postgresql" if self.ledger.is_postgres else "sqlite"],
                        {"name": f.name}).first()
        if row is not None and (row[0], row[1]) == (f.holder, f.epoch) and row[2]:
            return
        now = ("gone" if row is None else "run out" if (row[0], row[1]) == (f.holder, f.epoch)
               else f"held by {row[0]} at epoch {row[1]}")
        raise LeadershipLost(f"{f.holder} acted under lease {f.name!r} epoch {f.epoch}, which is {now}")

    # --- submitter side -------------------------------------------------------------------
    def enqueue(self, job_id: str, name: str, job: dict[str, Any], plans: list[Plan], *, steps: int,
                model: str = "", checkpoint_gb: float = 0.0, alive_s: float = DEFAULT_ALIVE_S) -> QueueJob:
        """Add a pending job (also recorded as a ledger job with its plans, so its allocations
        carry a predicted end). Idempotent for the same ``job_id``."""
        self.ledger.submit_job(job_id, name, {**job, "train_steps": steps})
        self.ledger.record_plans(job_id, plans)
        with self.ledger._tx() as s:
            now = db_now(s)
            row = s.get(QueueJobRow, job_id)
            if row is None:
                row = QueueJobRow(job_id=job_id, name=name, job=dict(job),
                                  plans=[p.model_dump(mode="json") for p in plans], state="pending",
                                  submitted_at=now, steps_total=int(steps), model=model,
                                  checkpoint_gb=float(checkpoint_gb), alive_until=now + alive_s,
                                  updated_at=now)
                s.add(row)
                s.flush()
            return QueueJob.of(row)

    def touch(self, job_id: str, *, steps_done: int | None = None,
              alive_s: float = DEFAULT_ALIVE_S, plans: bool = True) -> QueueJob | None:
        """The submitter's (or its run's) heartbeat: keeps the row alive, records progress, and
        returns the row (its state and any request; ``plans=False``: without its candidate
        plans, left unread). None for an unknown job."""
        with self.ledger._tx() as s:
            row = self._row(s, job_id, plans=plans)
            if row is None:
                return None
            now = db_now(s)
            row.alive_until = now + alive_s
            if steps_done is not None and steps_done > row.steps_done:
                row.steps_done = int(steps_done)
            row.updated_at = now
            return QueueJob.of(row, plans=plans)

    def note(self, job_id: str, reason: str) -> None:
        """What a placed job waits for before it trains (e.g. a worker of its pool), shown as
        its ``why`` in the queue; ``""`` clears it. Only a running row: a pending one's reason
        is the scheduler's (``set_waits``)."""
        with self.ledger._tx() as s:
            row = self._row(s, job_id, plans=False)
            if row is not None and row.state == "running":
                row.wait_reason, row.updated_at = reason[:200], db_now(s)

    def attach_run(self, job_id: str, flow_run_id: str | None) -> None:
        """Record the Prefect flow run that trains the job now (the one to cancel when it does
        not answer a request in time)."""
        with self.ledger._tx() as s:
            row = self._row(s, job_id, plans=False)
            if row is not None:
                row.flow_run_id, row.updated_at = flow_run_id, db_now(s)

    def ack_request(self, job_id: str, request_id: str) -> bool:
        """The run wrote the stop into its control file. False when the request is not the
        job's open one (superseded, or the job ended)."""
        with self.ledger._tx() as s:
            row = self._row(s, job_id)
            if row is None or row.request.get("id") != request_id or row.request_state != "pending":
                return False
            row.request_state = "acked"
            row.updated_at = db_now(s)
            return True

    def resized(self, job_id: str, request_id: str, assignment: dict[str, Any], steps_done: int,
                allocation_id: str | None = None) -> bool:
        """The run stopped for a re-size and holds its new allocation (``assignment``: the
        flow's Assignment as JSON). False, and nothing changes, when the scheduler cancelled
        the run meanwhile (``cancel_run``): the caller lets the new allocation go."""
        with self._run_ended(job_id, steps_done, allocation_id) as (row, now):
            if row is None:
                return False
            row.allocation_id, row.allocation, row.started_at = assignment["allocation_id"], dict(assignment), now
            row.start_reason = ""                 # a re-size: the run is no longer what the start was
            row.resizes += 1
            if row.request.get("id") == request_id:
                row.request_state = "done"
            row.state, row.updated_at = "running", now
            return True

    def requeue(self, job_id: str, *, steps_done: int, preempted: bool, reason: str = "",
                allocation_id: str | None = None) -> None:
        """The run stopped and released its GPUs; the job waits for a new allocation
        (``preempted``: counted as a preemption, else a re-size whose target was taken).
        ``allocation_id``: the run's own (``_run_ended``)."""
        with self._run_ended(job_id, steps_done, allocation_id) as (row, now):
            if row is None:
                return
            row.state, row.allocation_id, row.allocation, row.started_at = "pending", None, {}, None
            row.preemptions += 1 if preempted else 0
            row.restarts += 1
            if row.request:
                row.request_state = "done"
            row.wait_reason, row.updated_at = reason, now

    def finish(self, job_id: str, state: str, error: str = "", steps_done: int | None = None) -> None:
        """The job ended (``ENDED``): ``done``, ``failed`` or ``stopped``; ``error``: why it failed
        or stopped. An open request is marked ignored."""
        if state not in ENDED:
            raise ValueError(f"a job ends {', '.join(ENDED)}, not {state!r}")
        with self.ledger._tx() as s:
            row = self._row(s, job_id)
            if row is None:
                return
            now = db_now(s)
            if row.state == "running":
                self._account(row, now)
            row.state, row.error, row.ended_at, row.updated_at = state, error[:500], now, now
            # the job's own row (placed when its GPUs were granted) ends with it
            s.execute(update(JobRow).where(JobRow.job_id == job_id).values(status=state))
            if steps_done is not None:
                row.steps_done = max(row.steps_done, int(steps_done))
            if row.request and row.request_state in ("pending", "acked"):
                row.request_state = "ignored"

    # --- scheduler side -------------------------------------------------------------------
    def mark_started(self, job_id: str, assignment: dict[str, Any]) -> bool:
        """The scheduler allocated GPUs to a pending job. False (nothing changes) when the job
        is no longer pending."""
        with self.ledger._tx() as s:
            row = self._row(s, job_id)
            if row is None or row.state != "pending":
                return False
            now = db_now(s)
            row.state, row.allocation_id, row.allocation = "running", assignment["allocation_id"], dict(assignment)
            row.started_at, row.updated_at, row.start_reason = now, now, ""
            row.wait_reason, row.predicted_start_s, row.wait_gpu_type, row.wait_gpus = "", None, None, None
            return True

    def request(self, job_id: str, kind: str, *, plan: Plan | None = None,
                placement: dict[str, list[int]] | None = None, reason: str = "") -> str | None:
        """Ask the run of ``job_id`` to stop at its next step boundary, then either move to
        ``plan`` on ``placement`` (``kind`` grow / shrink / move) or go back to the queue
        (``kind`` preempt). Returns the request id; None, with a log line, when the job is not
        running (finished, failed, already re-queued) or already has a request open."""
        if kind not in ("grow", "shrink", "move", "preempt"):
            raise ValueError(f"request kind must be grow, shrink, move or preempt, not {kind!r}")
        with self._fenced_tx() as s:
            row = self._row(s, job_id)
            if row is None or row.state != "running":
                log.info("ignored %s request for job %s: it is %s", kind, job_id,
                         row.state if row is not None else "unknown")
                return None
            if row.request and row.request_state in ("pending", "acked"):
                log.info("ignored %s request for job %s: request %s is still open", kind, job_id,
                         row.request.get("id"))
                return None
            rid = uuid.uuid4().hex[:12]
            row.request = {"id": rid, "kind": kind, "reason": reason or kind, "at": db_now(s),
                           "plan": plan.model_dump(mode="json") if plan is not None else None,
                           "placement": {k: list(v) for k, v in (placement or {}).items()}}
            row.request_state, row.updated_at = "pending", db_now(s)
            return rid

    def set_waits(self, waits: dict[str, dict[str, Any]], known: dict[str, Any] | None = None) -> int:
        """Record why each pending job waits: ``{job_id: {"predicted_start_s", "gpu_type",
        "gpus", "reason"}}`` (jobs left out keep their last answer). Only rows whose answer
        changed are written (a predicted start by more than ``PREDICTION_RESOLUTION_S``), in
        one statement; returns how many. ``known``: the rows as the caller last read them
        (``QueueJob``s by id, e.g. a ``LedgerMirror``'s), compared instead of reading them
        again; a job it does not hold as pending is left alone."""
        if not waits:
            return 0
        t = QueueJobRow.__table__
        if known is not None:       # nothing to read: a transaction only when something changed
            out = _wait_changes(waits, _pending_in(waits, known))
            if not out:
                return 0
        with self._fenced_tx() as s:
            if self.ledger.is_postgres:
                # advisory answers the next round rewrites: a commit need not wait for the WAL
                # flush (a server crash may lose the last ones, never anything else's writes)
                s.execute(text("SET LOCAL synchronous_commit TO OFF"))
            if known is None:
                out = _wait_changes(waits, s.execute(
                    select(t.c.job_id, t.c.predicted_start_s, t.c.wait_gpu_type, t.c.wait_gpus, t.c.wait_reason)
                    .where(t.c.job_id.in_(list(waits)), t.c.state == "pending")).all())
            self._write_waits(s, out)
            return len(out)

    def _write_waits(self, s: Session, out: list[dict[str, Any]]) -> None:
        """``_wait_changes``' rows, written in ``s`` (one statement on PostgreSQL)."""
        t = QueueJobRow.__table__
        if out and self.ledger.is_postgres:      # one statement for every row
            s.execute(_SET_WAITS_PG, {k: [r[c] for r in out] for k, c in _SET_WAITS_COLS.items()})
        elif out:
            s.execute(t.update().where(t.c.job_id == bindparam("b_id"), t.c.state == "pending")
                      .values(predicted_start_s=bindparam("predicted_start_s"),
                              wait_gpu_type=bindparam("wait_gpu_type"), wait_gpus=bindparam("wait_gpus"),
                              wait_reason=bindparam("wait_reason")), out)

    def start_all(self, starts: list[tuple[str, Plan, dict[str, list[int]]]], *, lease_s: float,
                  assignment: Callable[[Any, Plan], dict[str, Any]],
                  waits: dict[str, dict[str, Any]] | None = None,
                  known: dict[str, Any] | None = None,
                  reasons: dict[str, str] | None = None) -> list[tuple[str, Any, str]]:
        """Allocate and mark started every ``(job_id, plan, placement)`` in one transaction and
        a fixed number of statements (``Ledger.claim_many``; one commit per round instead of
        two per start). A start whose GPUs are taken, or whose job is no longer pending, is
        skipped alone. Returns ``(job_id, Allocation or None, why not)`` per start, in order.
        ``assignment(alloc, plan)``: the Assignment JSON the queue row records. ``waits`` and
        ``known``: as ``set_waits``'s, written in the same transaction when there are starts
        and ``known`` is given (the round's writes in one commit), else by ``set_waits``.
        ``reasons``: job id -> why the scheduler starts it (``QueueJobRow.start_reason``)."""
        out: list[tuple[str, Any, str]] = []
        if not starts:
            self.set_waits(waits or {}, known=known)
            return out
        t = QueueJobRow.__table__
        with self._fenced_tx() as s:
            now = db_now(s)
            ids = sorted({j for j, _, _ in starts})
            state = dict(s.execute(self.ledger._locked(select(t.c.job_id, t.c.state).where(t.c.job_id.in_(ids))
                                                       .order_by(t.c.job_id))).all())
            ok, seen = [], set()
            for job_id, plan, placement in starts:
                st = state.get(job_id)
                if st != "pending" or job_id in seen:
                    out.append((job_id, None, f"the job is {st or 'unknown'}, no longer pending"))
                    continue
                seen.add(job_id)
                ok.append((job_id, plan, placement))
                out.append((job_id, None, ""))
            claimed = iter(self.ledger.claim_many(s, ok, lease_s, now))
            rows = []
            for i, (job_id, _, why) in enumerate(out):
                if why:
                    continue
                got = next(claimed)
                if isinstance(got, str):
                    out[i] = (job_id, None, got)
                    continue
                a = assignment(got, got.plan)
                rows.append({"b_id": job_id, "allocation_id": a["allocation_id"], "allocation": dict(a),
                             "start_reason": (reasons or {}).get(job_id, "")})
                out[i] = (job_id, got, "")
            if rows and self.ledger.is_postgres:     # one statement for every start (rows locked above)
                s.execute(_START_PG, {"ids": [r["b_id"] for r in rows], "allocs": [r["allocation_id"] for r in rows],
                                      "assignments": [json.dumps(r["allocation"]) for r in rows],
                                      "reasons": [r["start_reason"] for r in rows], "now": now})
            elif rows:
                s.execute(t.update().where(t.c.job_id == bindparam("b_id"))
                          .values(state="running", allocation_id=bindparam("allocation_id"),
                                  allocation=bindparam("allocation"), start_reason=bindparam("start_reason"),
                                  started_at=now, updated_at=now,
                                  wait_reason="", predicted_start_s=None, wait_gpu_type=None, wait_gpus=None), rows)
            if waits and known is not None:
                self._write_waits(s, _wait_changes(waits, _pending_in(waits, known)))
        if waits and known is None:
            self.set_waits(waits)
        return out

    def reap(self) -> dict[str, list]:
        """Free expired GPU leases and give up jobs nobody waits for any more: a running job
        whose allocation expired (its run stopped renewing), a job whose submitter stopped
        beating. Returns ``{"leases": [...], "jobs": [...], "overdue": [QueueJob...]}``,
        ``overdue`` the running jobs whose run did not answer a request in time (``_overdue``;
        the scheduler cancels them, ``cancel_run``)."""
        expired = self.ledger.expire_leases()
        gone: list[str] = []
        overdue: list[QueueJob] = []
        with self.ledger._tx() as s:
            now = db_now(s)
            # the plans column stays unread: only rows that change become ORM objects
            t = QueueJobRow.__table__
            cols = select(t.c.job_id).where(t.c.state.in_(ACTIVE), or_(
                t.c.alive_until < now, t.c.request_state.in_(("pending", "acked")), exists().where(
                    AllocationRow.id == t.c.allocation_id, AllocationRow.status == "expired")))
            ids = [r.job_id for r in s.execute(cols).all()]
            rows = s.exec(select(QueueJobRow).options(defer(QueueJobRow.plans))
                          .where(QueueJobRow.job_id.in_(ids))).all() if ids else []
            alloc_ids = [r.allocation_id for r in rows if r.allocation_id]
            status = {a.id: a.status for a in s.exec(select(AllocationRow).where(
                AllocationRow.id.in_(alloc_ids))).all()} if alloc_ids else {}
            for r in rows:
                why = ""
                if r.alive_until < now:
                    why = "its submitter stopped sending heartbeats"
                elif r.state == "running" and status.get(r.allocation_id) == "expired":
                    why = "its run stopped renewing its GPU lease"
                elif r.state == "running" and self._overdue(r, now):
                    overdue.append(QueueJob.of(r, plans=False))
                if why:
                    r.state, r.error, r.ended_at, r.updated_at = "failed", f"reaped: {why}", now, now
                    if r.request and r.request_state in ("pending", "acked"):
                        r.request_state = "ignored"
                    gone.append(r.job_id)
        return {"leases": list(expired), "jobs": gone, "overdue": overdue}

    @staticmethod
    def stop_allowance_s(row: QueueJobRow | QueueJob) -> float:
        """How long an acknowledged stop may take (the constants' comment)."""
        plan = (row.allocation or {}).get("plan") or {}
        step = float(plan.get("step_time_s") or 0.0)
        return STOP_STEPS * step + float(row.checkpoint_gb or 0.0) / CHECKPOINT_WRITE_GBPS + STOP_MARGIN_S

    def _overdue(self, r: QueueJobRow, now: float) -> bool:
        """The run has not answered its open request in time: not acknowledged within
        ``REQUEST_ACK_S``, or acknowledged but not stopped within ``stop_allowance_s`` more."""
        at = r.request.get("at") if r.request else None
        if at is None or r.request_state not in ("pending", "acked"):
            return False
        limit = REQUEST_ACK_S + (self.stop_allowance_s(r) if r.request_state == "acked" else 0.0)
        return now - float(at) > limit

    def moved(self, job_id: str, assignment: dict[str, Any]) -> bool:
        """The running job's run moved to another allocation without a request (an
        out-of-memory fallback): the row names it, so a cancellation frees the GPUs the run
        holds and the queue shows where it runs. False when the job is not running. The
        start's reason stays: the fallback is a safer plan of the same start, in the same pool
        (a stopgap that fell back is still a stopgap, free to move up to its own plan)."""
        with self.ledger._tx() as s:
            row = self._row(s, job_id, plans=False)
            if row is None or row.state != "running":
                return False
            row.allocation_id, row.allocation = assignment["allocation_id"], dict(assignment)
            row.updated_at = db_now(s)
            return True

    def cancel_run(self, job_id: str, request_id: str, reason: str) -> bool:
        """The scheduler gave up on the run of ``job_id`` (it did not answer request
        ``request_id`` in time, and its flow run was cancelled): its GPUs are freed and the job
        waits in the queue again, counted as a preemption; its next launch resumes from its
        last checkpoint. False, and nothing changes, when the run answered meanwhile."""
        with self._fenced_tx() as s:
            row = self._row(s, job_id, plans=False)
            if (row is None or row.state != "running" or row.request.get("id") != request_id
                    or row.request_state not in ("pending", "acked")):
                return False
            now = db_now(s)
            if row.allocation_id:
                alloc = s.exec(self.ledger._locked(select(AllocationRow).where(
                    AllocationRow.id == row.allocation_id))).first()
                if alloc is not None and alloc.status == "active":
                    self.ledger._free(s, [alloc], "released", now)
            self._account(row, now)
            row.state, row.allocation_id, row.allocation, row.started_at = "pending", None, {}, None
            row.preemptions += 1
            row.restarts += 1
            row.request_state, row.flow_run_id = "cancelled", None
            row.wait_reason, row.updated_at = reason[:200], now
            return True

    # --- views ----------------------------------------------------------------------------
    def get(self, job_id: str, *, plans: bool = True) -> QueueJob | None:
        """The row of ``job_id`` (``plans=False``: without its candidate plans), None if unknown;
        a read: it beats nothing."""
        with self.ledger._read() as s:
            if plans:
                row = s.get(QueueJobRow, job_id)
            else:
                row = s.exec(select(QueueJobRow).options(defer(QueueJobRow.plans))
                             .where(QueueJobRow.job_id == job_id)).first()
            return QueueJob.of(row, plans=plans) if row is not None else None

    def jobs(self, states: tuple[str, ...] = ACTIVE, *, plans: bool = True) -> list[QueueJob]:
        """Jobs in ``states``, oldest submission first. ``plans=False`` leaves the candidate
        plans unread (``QueueJob.plans`` None)."""
        t = QueueJobRow.__table__
        cols = [c for c in t.c if plans or c.name != "plans"]
        with self.ledger._read() as s:
            stmt = select(*cols).where(t.c.state.in_(list(states))).order_by(t.c.submitted_at, t.c.job_id)
            return [QueueJob.of(r, plans=plans) for r in s.execute(stmt).all()]

    def now(self) -> float:
        with self.ledger._read() as s:
            return db_now(s)

    # --- helpers --------------------------------------------------------------------------
    def _row(self, s: Session, job_id: str, *, plans: bool = True) -> QueueJobRow | None:
        stmt = select(QueueJobRow).where(QueueJobRow.job_id == job_id)
        if not plans:
            stmt = stmt.options(defer(QueueJobRow.plans))
        if self.ledger.is_postgres:
            stmt = stmt.with_for_update()
        return s.exec(stmt).first()

    @contextmanager
    def _run_ended(self, job_id: str, steps_done: int,
                   allocation_id: str | None = None) -> Iterator[tuple[QueueJobRow | None, float]]:
        """A transaction on the row of a job whose run just stopped: its service accounted,
        its progress recorded; yields (row, database time). The row is None, and nothing is
        recorded, for an unknown job and for a run the queue no longer counts: its job ended,
        or the scheduler cancelled it (``cancel_run``; it may run again on new GPUs by now).
        ``allocation_id``: the answering run's own allocation: when it is the row's, the run is
        the job's current one, and a cancellation of an earlier run of the job (its request
        state still "cancelled") does not silence it."""
        with self.ledger._tx() as s:
            row = self._row(s, job_id, plans=False)
            now = db_now(s)
            current = allocation_id is not None and row is not None and row.allocation_id == allocation_id
            if row is not None and (row.state != "running" or (row.request_state == "cancelled" and not current)):
                log.info("late answer from a run of job %s ignored: the job is %s%s", job_id, row.state,
                         " (its run was cancelled)" if row.request_state == "cancelled" else "")
                row = None
            if row is not None:
                self._account(row, now)
                row.steps_done = max(row.steps_done, int(steps_done))
            yield row, now

    @staticmethod
    def _account(row: QueueJobRow, now: float) -> None:
        """Add the GPU-seconds of the run that just ended to the job's attained service."""
        if row.started_at is not None and row.allocation:
            gpus = int((row.allocation.get("plan") or {}).get("gpus") or 0)
            row.attained_gpu_s += gpus * max(0.0, now - row.started_at)


# ``start_all``'s queue rows in one UPDATE on PostgreSQL (the assignments as JSON text)
_START_PG = text(
    "UPDATE queue_jobs AS q SET state = 'running', allocation_id = v.a, allocation = v.j, start_reason = v.r, "
    "started_at = :now, updated_at = :now, wait_reason = '', predicted_start_s = NULL, wait_gpu_type = NULL, "
    "wait_gpus = NULL FROM unnest(CAST(:ids AS varchar[]), CAST(:allocs AS varchar[]), CAST(:assignments AS json[]), "
    "CAST(:reasons AS varchar[])) AS v(id, a, j, r) "
    "WHERE q.job_id = v.id")
# ``set_waits``' rows in one UPDATE on PostgreSQL (arrays of the column values, unnested)
_SET_WAITS_COLS = {"ids": "b_id", "starts": "predicted_start_s", "types": "wait_gpu_type", "gpus": "wait_gpus",
                   "reasons": "wait_reason"}
_SET_WAITS_PG = text(
    "UPDATE queue_jobs AS q SET predicted_start_s = v.s, wait_gpu_type = v.t, wait_gpus = v.g, wait_reason = v.r "
    "FROM unnest(CAST(:ids AS varchar[]), CAST(:starts AS double precision[]), CAST(:types AS varchar[]), "
    "CAST(:gpus AS integer[]), CAST(:reasons AS varchar[])) AS v(id, s, t, g, r) "
    "WHERE q.job_id = v.id AND q.state = 'pending'")


def _pending_in(waits: dict[str, Any], known: dict[str, Any]) -> list[Any]:
    """The rows of ``known`` that are pending jobs named in ``waits``."""
    return [j for j in map(known.get, waits) if j is not None and j.state == "pending"]


def _wait_changes(waits: dict[str, dict[str, Any]], old: list[Any]) -> list[dict[str, Any]]:
    """``set_waits``' rows to write: the answers in ``waits`` that differ from ``old`` (rows with
    ``job_id``, ``predicted_start_s``, ``wait_gpu_type``, ``wait_gpus``, ``wait_reason``)."""
    out = []
    for r in old:
        w = waits[r.job_id]
        p = w.get("predicted_start_s")
        p = p if p is not None and math.isfinite(p) else None
        new = (p, w.get("gpu_type"), w.get("gpus"), str(w.get("reason") or "")[:200])
        same_p = (p is None) == (r.predicted_start_s is None) and (
            p is None or abs(p - r.predicted_start_s) < PREDICTION_RESOLUTION_S)
        if same_p and new[1:] == (r.wait_gpu_type, r.wait_gpus, r.wait_reason):
            continue
        out.append({"b_id": r.job_id, "predicted_start_s": new[0], "wait_gpu_type": new[1],
                    "wait_gpus": new[2], "wait_reason": new[3]})
    return out


class Leadership:
    """The scheduler lease ``name`` in ``ledger``, tried for by ``holder``.

    ``acquire()`` takes the lease when it is free or expired (by the database's clock) and
    renews it when ``holder`` has it; it returns whether ``holder`` leads now. A scheduler acts
    only while it leads, and renews well inside ``ttl_s``."""

    def __init__(self, ledger: Ledger | str | None, holder: str, ttl_s: float, name: str = "scheduler"):
        if not ttl_s > 0:
            raise ValueError("ttl_s must be > 0")
        self.ledger = ledger if isinstance(ledger, Ledger) else Ledger(ledger)
        self.holder, self.ttl_s, self.name = holder, float(ttl_s), name
        self.epoch: int | None = None

    def acquire(self) -> bool:
        with self.ledger._tx() as s:
            now = db_now(s)
            stmt = select(SchedulerLeaseRow).where(SchedulerLeaseRow.name == self.name)
            if self.ledger.is_postgres:
                # the row may not exist yet: serialise its first insert too
                s.execute(text("SELECT pg_advisory_xact_lock(7346022)"))
                stmt = stmt.with_for_update()
            row = s.exec(stmt).first()
            if row is None:
                row = SchedulerLeaseRow(name=self.name, holder=self.holder, epoch=1,
                                        expires_at=now + self.ttl_s, acquired_at=now)
                s.add(row)
            elif row.holder == self.holder and row.expires_at >= now:
                row.expires_at = now + self.ttl_s
            elif row.expires_at < now:
                row.holder, row.epoch, row.acquired_at = self.holder, row.epoch + 1, now
                row.expires_at = now + self.ttl_s
            else:
                self.epoch = None
                return False
            self.epoch = row.epoch
            return True

    def leads(self) -> bool:
        """Whether ``holder`` holds an unexpired lease now (read only)."""
        info = self.current()
        return info is not None and info["holder"] == self.holder and not info["expired"]

    def current(self) -> dict[str, Any] | None:
        """``{"holder", "epoch", "expires_in_s", "expired"}`` of the lease, or None."""
        with self.ledger._read() as s:
            row = s.get(SchedulerLeaseRow, self.name)
            if row is None:
                return None
            left = row.expires_at - db_now(s)
            return {"holder": row.holder, "epoch": row.epoch, "expires_in_s": left, "expired": left < 0}

    def fence(self) -> LeaseFence | None:
        """The lease as last acquired (``JobQueue.fence``), None before the first."""
        return None if self.epoch is None else LeaseFence(self.name, self.holder, self.epoch)

    def release(self) -> None:
        """Give the lease up at once (a clean shutdown), so a standby need not wait the TTL."""
        with self.ledger._tx() as s:
            row = s.get(SchedulerLeaseRow, self.name)
            if row is not None and row.holder == self.holder:
                row.expires_at = db_now(s) - 1.0
        self.epoch = None
