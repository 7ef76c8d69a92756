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


@dataclass(slots=True)
class ClusterState:
    nodes: list[Node]
    running: list[RunningJob] = field(default_factory=list)
    inter_node_gbps: dict[str, float] = field(default_factory=dict)  # pool -> bandwidth
    gpu_memory_gib: dict[str, float] = field(default_factory=dict)  # gpu_type -> device memory (custom types too)


@dataclass(slots=True)
class Decision:
    """Start ``job_id`` with ``plan`` on ``placement``, or preempt it (round-based baselines)."""

    job_id: str
    plan: Plan | None
    placement: dict[str, list[int]]
    action: Literal["start", "preempt"] = "start"


class Policy(ABC):
    """A scheduling policy. ``schedule`` must not mutate its inputs."""

    name: str = "policy"
    # round-based policies (gavel, sia) set a period; event-driven ones leave None
    round_s: float | None = None
    # an event-driven policy that re-sizes running jobs onto idle GPUs (frenzy's growth) sets
    # this: the simulator then also gives it a periodic tick while GPUs sit idle, not only
    # while jobs wait
    grows_runs: bool = False

    @abstractmethod
    def schedule(self, pending: list[JobRequest], state: ClusterState, now: float) -> list[Decision]:
        ...

    def on_oom(self, job: JobRequest, plan: Plan) -> JobRequest:
        """How this policy resubmits a job whose run died of out-of-memory (default: unchanged)."""
        job.restarts += 1
        return job
