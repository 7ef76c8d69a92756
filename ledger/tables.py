"""The ledger's tables (SQLModel). Times are Unix epoch seconds (floats): portable between
SQLite and PostgreSQL and directly comparable with the scheduler's clock.

A GPU is held by at most one allocation by construction: ``gpus.alloc_id`` is a single column,
set only inside the allocating transaction while that row is locked and still NULL.
"""
from __future__ import annotations

from typing import Any, Optional

from sqlalchemy import JSON, BigInteger, Column, Index, UniqueConstraint, text
from sqlmodel import Field, SQLModel


def change_column() -> Any:
    """``chg``: the change marker of a row the scheduling round mirrors (``ledger.mirror``).
    Never written by Python: the database's triggers (revision ``0005_change_markers``) set
    it on every insert and on every update of a column a round reads, to the writing
    transaction's id (PostgreSQL) or a counter bumped under the write lock (SQLite)."""
    return Field(default=0, sa_column=Column("chg", BigInteger, nullable=False, default=0,
                                             server_default=text("0"), index=True))


class PoolRow(SQLModel, table=True):
    __tablename__ = "pools"

    name: str = Field(primary_key=True)
    gpu_type: str
    nodes: int
    gpus_per_node: int
    inter_node_gbps: float
    gpu_memory_gib: float
    intra_link: str = "pcie4"
    active: bool = True
    chg: int = change_column()


class NodeRow(SQLModel, table=True):
    __tablename__ = "nodes"

    node_id: str = Field(primary_key=True)
    pool: str = Field(foreign_key="pools.name", index=True)
    idx: int
    address: Optional[str] = None
    active: bool = True
    chg: int = change_column()


class GpuRow(SQLModel, table=True):
    __tablename__ = "gpus"
    __table_args__ = (UniqueConstraint("node_id", "device_index", name="uq_gpu_node_device"),
                      Index("ix_gpus_type_free", "gpu_type", "alloc_id"))

    id: Optional[int] = Field(default=None, primary_key=True)
    node_id: str = Field(foreign_key="nodes.node_id")
    device_index: int
    pool: str
    gpu_type: str
    alloc_id: Optional[str] = Field(default=None, index=True)
    active: bool = True
    chg: int = change_column()


class JobRow(SQLModel, table=True):
    __tablename__ = "jobs"

    job_id: str = Field(primary_key=True)
    name: str = ""
    spec: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    status: str = "pending"          # pending | placed, then as its queue row ends: done | failed | stopped
    steps: Optional[int] = None
    submitted_at: float = 0.0


class PlanRow(SQLModel, table=True):
    __tablename__ = "plans"

    id: Optional[int] = Field(default=None, primary_key=True)
    job_id: str = Field(foreign_key="jobs.job_id", index=True)
    rank: int
    gpu_type: str
    gpus: int
    device_used_gib: float
    step_time_s: float
    plan: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))


class AllocationRow(SQLModel, table=True):
    __tablename__ = "allocations"

    id: str = Field(primary_key=True)
    job_id: str = Field(foreign_key="jobs.job_id", index=True)
    pool: str
    gpu_type: str
    plan: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    placement: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    status: str = Field(default="active", index=True)   # active | released | expired
    created_at: float
    lease_expires_at: float
    expected_end_at: Optional[float] = None
    ended_at: Optional[float] = None
    chg: int = change_column()


class MeasurementRow(SQLModel, table=True):
    __tablename__ = "measurements"

    id: Optional[int] = Field(default=None, primary_key=True)
    job_id: str = Field(index=True)
    alloc_id: Optional[str] = None
    gpu_type: str = Field(index=True)
    plan: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    predicted: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    measured: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    # flattened for calibration queries (NULL when not given)
    predicted_device_used_gib: Optional[float] = None
    measured_device_used_gib: Optional[float] = None
    predicted_reserved_peak_gib: Optional[float] = None
    measured_reserved_peak_gib: Optional[float] = None
    predicted_step_time_s: Optional[float] = None
    measured_step_time_s: Optional[float] = None
    tokens_per_s: Optional[float] = None
    created_at: float = 0.0


# --- the live scheduler's queue and leadership (ledger.queue) ------------------------------
class QueueJobRow(SQLModel, table=True):
    """A submitted job as the live scheduler sees it: what it asks for, where it runs, why it
    waits, and the re-size or stop request the scheduler made of its run. Times come from the
    database's clock (``ledger.queue.db_now``), never a caller's."""

    __tablename__ = "queue_jobs"

    job_id: str = Field(primary_key=True)
    name: str = ""
    job: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))      # TrainingJob JSON
    plans: list[Any] = Field(default_factory=list, sa_column=Column(JSON))         # candidate Plan JSON
    state: str = Field(default="pending", index=True)   # pending | running | done | failed | stopped
    submitted_at: float = 0.0
    steps_total: int = 0
    steps_done: int = 0
    model: str = ""
    checkpoint_gb: float = 0.0
    attained_gpu_s: float = 0.0
    restarts: int = 0
    preemptions: int = 0
    resizes: int = 0
    allocation_id: Optional[str] = None
    allocation: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))  # Assignment JSON
    started_at: Optional[float] = None
    predicted_start_s: Optional[float] = None
    wait_gpu_type: Optional[str] = None
    wait_gpus: Optional[int] = None
    wait_reason: str = ""
    # why the scheduler started the current run (its start decision's reason, e.g. "stopgap"; ""
    # for the policy's own choice, and once the run moved to another allocation): the policy
    # reads it back as RunningJob.reason
    start_reason: str = ""
    # {"id", "kind": grow|shrink|move|preempt, "plan", "placement", "reason", "at"}; {} = none
    request: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON))
    request_state: str = ""          # "" | pending | acked (stop written) | done | ignored
    alive_until: float = 0.0         # the submitter's heartbeat
    # the Prefect flow run training the job now (the run records it when it starts): the one
    # the scheduler cancels when it does not answer a request in time
    flow_run_id: Optional[str] = None
    error: str = ""
    updated_at: float = 0.0
    ended_at: Optional[float] = None
    chg: int = change_column()


class SchedulerLeaseRow(SQLModel, table=True):
    """Leadership: the one scheduler allowed to act holds this row's lease. ``epoch`` grows by
    one at every change of holder (a fencing token)."""

    __tablename__ = "scheduler_lease"

    name: str = Field(primary_key=True)
    holder: str = ""
    epoch: int = 0
    expires_at: float = 0.0
    acquired_at: float = 0.0


# --- multi-node runs (ledger.gang) ---------------------------------------------------------
class GangNodeRow(SQLModel, table=True):
    """One node of a multi-node run (a gang): its rank, its address, its state and the
    heartbeat of the flow run training there. Node 0's row carries the rendezvous: the address
    and port its c10d store listens on, which every other node waits for. A gang id names one
    launch of the whole gang; a retried gang gets a new id (and a new rendezvous)."""

    __tablename__ = "gang_nodes"

    gang_id: str = Field(primary_key=True)
    node_rank: int = Field(primary_key=True)
    job_id: str = Field(index=True)
    node_id: str = ""
    address: Optional[str] = None
    port: Optional[int] = None
    state: str = "starting"          # starting | running | done | failed | oom (ledger.gang)
    error: str = ""
    alive_until: float = 0.0         # the node's heartbeat, by the database's clock
    updated_at: float = 0.0
    step: int = 0                    # the node's last finished step (node 0's is the job's progress)


class LedgerChangesRow(SQLModel, table=True):
    """One row (``id`` 1) the change triggers keep: ``counter`` (SQLite: the last change
    marker handed out) and ``deletes`` (bumped by every DELETE on a mirrored table: a mirror
    that sees it move reads everything again)."""

    __tablename__ = "ledger_changes"

    id: int = Field(primary_key=True)
    counter: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, default=0))
    deletes: int = Field(default=0, sa_column=Column(BigInteger, nullable=False, default=0))
