"""The one interface every scheduling policy implements, live and in the simulator.

Plain slotted dataclasses (not pydantic) because a round walks thousands of jobs and nodes
and must finish in milliseconds. Plans are ``estimator.plan.Plan`` with predictions filled in.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Literal

from estimator.plan import Plan


@dataclass(slots=True)
class JobRequest:
    """A job waiting for GPUs, as a policy sees it."""

    job_id: str
    submit_s: float
    plans: list[Plan]                    # feasible plans over all GPU types, predictions filled
    steps_left: int                      # optimizer steps still to run
    requested_gpu_type: str | None = None  # what the author asked for (fifo-user baseline)
    requested_gpus: int | None = None
    attained_gpu_s: float = 0.0          # GPU-seconds of service so far (LAS policies)
    restarts: int = 0                    # OOM or preemption restarts so far
    model: str = ""                      # preset name, for reports
    checkpoint_gb: float = 0.0           # model + optimizer states a restart saves and restores
                                         # (scheduler.restart.checkpoint_gb); 0 = unknown
    preemptions: int = 0                 # times stopped and sent back to the queue (not re-sizes);
                                         # whoever applies a round counts them (RoundResult.preempted)


@dataclass(slots=True)
class Node:
    node_id: str
    pool: str
    gpu_type: str
    gpus: int                            # GPUs on the node
    free: list[int]                      # device indices free now, ascending
    intra_link: str = "pcie"             # e.g. "nvlink4", "pcie4"


@dataclass(slots=True)
class RunningJob:
    job_id: str
    plan: Plan
    placement: dict[str, list[int]]      # node_id -> device indices
    start_s: float
    expected_end_s: float                # predicted, from the throughput model
    # the job's request (plans over every GPU type, steps left at this start, restarts,
    # checkpoint size): what a policy needs to re-size or preempt the run without keeping
    # private notes on it; None only for runs the scheduler knows nothing about
    request: JobRequest | None = None
    resizes: int = 0                     # re-sizes (grow, shrink, recall) of this job so far
    reason: str = ""                     # why this run started: its start Decision's reason ("" for
                                         # the policy's own choice; "stopgap", "grow", "move up", ...)


@dataclass(slots=True)
class ClusterState:
    nodes: list[Node]
    running: list[RunningJob] = field(default_factory=list)
    inter_node_gbps: dict[str, float] = field(default_factory=dict)  # pool -> bandwidth
    gpu_memory_gib: dict[str, float] = field(default_factory=dict)  # gpu_type -> device memory (custom types too)


@dataclass(slots=True)
class Decision:
    """Start ``job_id`` with ``plan`` on ``placement``, or preempt it. A preempt and a start of
    the same running job in one round is a re-size (``scheduler.round`` tells them apart)."""

    job_id: str
    plan: Plan | None
    placement: dict[str, list[int]]
    action: Literal["start", "preempt"] = "start"
    reason: str = ""                     # why, for events and the queue view (e.g. "grow", "recall")


@dataclass(slots=True)
class Wait:
    """Why a pending job did not start this round, and when the policy expects it to."""

    job_id: str
    predicted_start_s: float             # absolute time; inf when unknown
    gpu_type: str | None = None          # the plan it waits for
    gpus: int = 0
    reason: str = ""


class Policy(ABC):
    """A scheduling policy. ``schedule`` must not mutate its inputs.

    What a policy may do is declared, not probed: ``restarts_runs`` (it emits preempt
    decisions: preemption, shrinking, re-sizing) and ``grows_runs`` (it re-sizes running jobs
    onto idle GPUs). The live scheduler and the simulator act on every decision alike."""

    name: str = "policy"
    # round-based policies (gavel, sia) set a period; event-driven ones leave None
    round_s: float | None = None
    # a policy that stops running jobs (preempt, shrink, re-size) sets this
    restarts_runs: bool = False
    # an event-driven policy that re-sizes running jobs onto idle GPUs (frenzy's growth) sets
    # this: the simulator then also gives it a periodic tick while GPUs sit idle, not only
    # while jobs wait
    grows_runs: bool = False

    @abstractmethod
    def schedule(self, pending: list[JobRequest], state: ClusterState, now: float) -> list[Decision]:
        ...

    def waits(self) -> dict[str, Wait]:
        """After ``schedule``: why each pending job that did not start waits (default: none
        known). The live scheduler shows it in the queue view."""
        return {}

    def on_oom(self, job: JobRequest, plan: Plan) -> JobRequest:
        """How this policy resubmits a job whose run died of out-of-memory (default: unchanged)."""
        job.restarts += 1
        return job
