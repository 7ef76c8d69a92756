"""The live scheduler's side of the ledger: the job queue, leadership, and the re-size / stop
requests a scheduler makes of running jobs.

* A submission ``enqueue``s its job (the TrainingJob, its candidate plans, its step count) and
  waits until the scheduler has placed it: the row turns ``running`` with an allocation.
* Exactly one scheduler acts at a time: ``Leadership`` holds a lease row whose expiry is taken
  from the database's clock (``db_now``), so a caller whose clock runs ahead cannot steal it;
  a standby takes over once the lease has run out.
* The scheduler asks a running job to re-size or stop by writing a request on its row; the run's
  heartbeat reads it (``touch``), stops the training at a step boundary, and reports back
  (``ack_request``, ``resized``, ``requeue``). A request for a job that is no longer running is
  ignored and logged, never an error.

Uses the ledger's own transactions (``Ledger._tx``: SQLite ``BEGIN IMMEDIATE``, PostgreSQL row
locks), so every change here is one transaction.
"""
from __future__ import annotations

import logging
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

from sqlalchemy import text
from sqlmodel import Session, select

from estimator.plan import Plan

from .core import Ledger, db_now
from .tables import AllocationRow, QueueJobRow, SchedulerLeaseRow

log = logging.getLogger("frenzy.queue")

# How long a submitter's heartbeat keeps its queue row alive. Its watcher beats every second
# (training.REQUEST_POLL_S); 60 s survives a minute of database or process stalls before the
# reaper gives the job up.
DEFAULT_ALIVE_S = 60.0
ACTIVE = ("pending", "running")
# A run's watcher forwards a request within a second (training.REQUEST_POLL_S); one not taken
# up in two minutes belongs to a run that stopped watching: the request is withdrawn, so the
# job is offered to the policy again (and its GPUs are reaped once its lease runs out).
REQUEST_ACK_S = 120.0


@dataclass(slots=True)
class QueueJob:
    """A read-only view of a queue row."""

    job_id: str
    name: str
    job: dict[str, Any]
    plans: list[Plan]
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

    @classmethod
    def of(cls, r: QueueJobRow) -> "QueueJob":
        return cls(job_id=r.job_id, name=r.name, job=dict(r.job or {}),
                   plans=[Plan.model_validate(p) for p in (r.plans or [])], state=r.state,
                   submitted_at=r.submitted_at, steps_total=r.steps_total, steps_done=r.steps_done,
                   model=r.model, checkpoint_gb=r.checkpoint_gb, attained_gpu_s=r.attained_gpu_s,
                   restarts=r.restarts, preemptions=r.preemptions, resizes=r.resizes,
                   allocation_id=r.allocation_id, allocation=dict(r.allocation or {}),
                   started_at=r.started_at, predicted_start_s=r.predicted_start_s,
                   wait_gpu_type=r.wait_gpu_type, wait_gpus=r.wait_gpus, wait_reason=r.wait_reason,
                   request=dict(r.request or {}), request_state=r.request_state, error=r.error,
                   ended_at=r.ended_at)

    @property
    def open_request(self) -> bool:
        """A re-size or stop the scheduler asked for and the run has not finished acting on."""
        return bool(self.request) and self.request_state in ("pending", "acked")


class JobQueue:
    """The queue tables of ``ledger`` (a ``Ledger`` or its URL)."""

    def __init__(self, ledger: Ledger | str | None = None):
        self.ledger = ledger if isinstance(ledger, Ledger) else Ledger(ledger)

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
              alive_s: float = DEFAULT_ALIVE_S) -> QueueJob | None:
        """The submitter's (or its run's) heartbeat: keeps the row alive, records progress, and
        returns the row (its state and any request). None for an unknown job."""
        with self.ledger._tx() as s:
            row = self._row(s, job_id)
            if row is None:
                return None
            now = db_now(s)
            row.alive_until = now + alive_s
            if steps_done is not None and steps_done > row.steps_done:
                row.steps_done = int(steps_done)
            row.updated_at = now
            return QueueJob.of(row)

    def note(self, job_id: str, reason: str) -> None:
        """What a placed job waits for before it trains (e.g. a worker of its pool), shown as
        its ``why`` in the queue; ``""`` clears it. Only a running row: a pending one's reason
        is the scheduler's (``set_waits``)."""
        with self.ledger._tx() as s:
            row = self._row(s, job_id)
            if row is not None and row.state == "running":
                row.wait_reason, row.updated_at = reason[:200], db_now(s)

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

    def resized(self, job_id: str, request_id: str, assignment: dict[str, Any], steps_done: int) -> None:
        """The run stopped for a re-size and holds its new allocation (``assignment``: the
        flow's Assignment as JSON)."""
        with self._run_ended(job_id, steps_done) as (row, now):
            if row is None:
                return
            row.allocation_id, row.allocation, row.started_at = assignment["allocation_id"], dict(assignment), now
            row.resizes += 1
            if row.request.get("id") == request_id:
                row.request_state = "done"
            row.state, row.updated_at = "running", now

    def requeue(self, job_id: str, *, steps_done: int, preempted: bool, reason: str = "") -> None:
        """The run stopped and released its GPUs; the job waits for a new allocation
        (``preempted``: counted as a preemption, else a re-size whose target was taken)."""
        with self._run_ended(job_id, steps_done) as (row, now):
            if row is None:
                return
            row.state, row.allocation_id, row.allocation, row.started_at = "pending", None, {}, None
            row.preemptions += 1 if preempted else 0
            row.restarts += 1
            if row.request:
                row.request_state = "done"
            row.wait_reason, row.updated_at = reason, now

    def finish(self, job_id: str, state: str, error: str = "", steps_done: int | None = None) -> None:
        """The job ended: ``done`` or ``failed``. An open request is marked ignored."""
        if state not in ("done", "failed"):
            raise ValueError(f"a job ends done or failed, not {state!r}")
        with self.ledger._tx() as s:
            row = self._row(s, job_id)
            if row is None:
                return
            now = db_now(s)
            if row.state == "running":
                self._account(row, now)
            row.state, row.error, row.ended_at, row.updated_at = state, error[:500], now, now
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
            row.started_at, row.updated_at = now, now
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
        with self.ledger._tx() as s:
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

    def set_waits(self, waits: dict[str, dict[str, Any]]) -> None:
        """Record why each pending job waits: ``{job_id: {"predicted_start_s", "gpu_type",
        "gpus", "reason"}}`` (jobs left out keep their last answer)."""
        if not waits:
            return
        with self.ledger._tx() as s:
            rows = s.exec(select(QueueJobRow).where(QueueJobRow.job_id.in_(list(waits)),
                                                    QueueJobRow.state == "pending")).all()
            for r in rows:
                w = waits[r.job_id]
                p = w.get("predicted_start_s")
                r.predicted_start_s = p if p is not None and p == p and p != float("inf") else None
                r.wait_gpu_type, r.wait_gpus = w.get("gpu_type"), w.get("gpus")
                r.wait_reason = str(w.get("reason") or "")[:200]

    def reap(self) -> dict[str, list[str]]:
        """Free expired GPU leases and give up jobs nobody waits for any more: a running job
        whose allocation expired (its run stopped renewing), a job whose submitter stopped
        beating. Returns ``{"leases": [...], "jobs": [...]}``."""
        expired = self.ledger.expire_leases()
        gone: list[str] = []
        with self.ledger._tx() as s:
            now = db_now(s)
            rows = s.exec(select(QueueJobRow).where(QueueJobRow.state.in_(ACTIVE))).all()
            alloc_ids = [r.allocation_id for r in rows if r.allocation_id]
            status = {a.id: a.status for a in s.exec(select(AllocationRow).where(
                AllocationRow.id.in_(alloc_ids))).all()} if alloc_ids else {}
            for r in rows:
                why = ""
                if r.alive_until < now:
                    why = "its submitter stopped sending heartbeats"
                elif r.state == "running" and status.get(r.allocation_id) == "expired":
                    why = "its run stopped renewing its GPU lease"
                elif (r.request_state == "pending" and r.request.get("at") is not None
                      and now - float(r.request["at"]) > REQUEST_ACK_S):
                    log.warning("request %s (%s) for job %s not acknowledged within %.0f s: withdrawn",
                                r.request.get("id"), r.request.get("kind"), r.job_id, REQUEST_ACK_S)
                    r.request_state, r.updated_at = "ignored", now
                if why:
                    r.state, r.error, r.ended_at, r.updated_at = "failed", f"reaped: {why}", now, now
                    if r.request and r.request_state in ("pending", "acked"):
                        r.request_state = "ignored"
                    gone.append(r.job_id)
        return {"leases": list(expired), "jobs": gone}

    # --- views ----------------------------------------------------------------------------
    def get(self, job_id: str) -> QueueJob | None:
        with self.ledger._read() as s:
            row = s.get(QueueJobRow, job_id)
            return QueueJob.of(row) if row is not None else None

    def jobs(self, states: tuple[str, ...] = ACTIVE) -> list[QueueJob]:
        """Jobs in ``states``, oldest submission first."""
        with self.ledger._read() as s:
            stmt = select(QueueJobRow).where(QueueJobRow.state.in_(list(states)))
            return [QueueJob.of(r) for r in s.exec(stmt.order_by(QueueJobRow.submitted_at,
                                                                 QueueJobRow.job_id)).all()]

    def now(self) -> float:
        with self.ledger._read() as s:
            return db_now(s)

    # --- helpers --------------------------------------------------------------------------
    def _row(self, s: Session, job_id: str) -> QueueJobRow | None:
        stmt = select(QueueJobRow).where(QueueJobRow.job_id == job_id)
        if self.ledger.is_postgres:
            stmt = stmt.with_for_update()
        return s.exec(stmt).first()

    @contextmanager
    def _run_ended(self, job_id: str, steps_done: int) -> Iterator[tuple[QueueJobRow | None, float]]:
        """A transaction on the row of a job whose run just stopped: its service accounted,
        its progress recorded; yields (row or None, database time)."""
        with self.ledger._tx() as s:
            row = self._row(s, job_id)
            now = db_now(s)
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

    def release(self) -> None:
        """Give the lease up at once (a clean shutdown), so a standby need not wait the TTL."""
        with self.ledger._tx() as s:
            row = s.get(SchedulerLeaseRow, self.name)
            if row is not None and row.holder == self.holder:
                row.expires_at = db_now(s) - 1.0
        self.epoch = None
