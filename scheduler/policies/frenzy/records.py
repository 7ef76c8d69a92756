"""The named records ``frenzy``'s steps pass each other (no parallel per-job dicts, no
positional tuples). NamedTuples where a hot loop unpacks them, slotted dataclasses elsewhere."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from estimator.plan import Plan
from scheduler.types import JobRequest, RunningJob

GpuCounts = dict[str, int]              # gpu_type -> GPUs
Placement = dict[str, list[int]]        # node_id -> device indices


class Cand(NamedTuple):
    """One plan of a job's menu, with the fields the hot loops compare first."""

    step_s: float
    gpus: int
    gpu_type: str
    plan: Plan


@dataclass(slots=True)
class Menu:
    """A job's memory-safe plans, per GPU type only those a bigger count makes faster, fastest
    first, under three parallel-efficiency floors (``gate.build_menu``). Built once per plan
    list (jobs of one shape share it), for pending and running jobs alike."""

    queue: list[Cand]                   # >= Choice.min_efficiency: what a queued job may take
    wide: list[Cand]                    # >= Choice.idle_min_efficiency: idle starts
    grow: list[Cand]                    # >= the growth floors: re-sizing a run onto idle GPUs
    fewest: list[tuple[str, int]]       # per GPU type, the fewest GPUs of a queue plan
    least: int                          # the fewest GPUs of any queue plan (0: no plan)
    top: GpuCounts                      # per GPU type, the most GPUs of a queue plan: a run holding
                                        # more has GPUs "lent" (recall takes them back)
    work: float                         # GPU-seconds per step of the cheapest queue plan
    footprint_gib: float                # least GPUs x device memory over queue plans (a checkpoint
                                        # size bound when the request names none)


class Queued(NamedTuple):
    """A pending job in queue order (``order.order_queue`` sorts by the first three fields)."""

    key: float                          # aged remaining work: smaller goes first
    submit_s: float
    job_id: str
    job: JobRequest
    menu: Menu


class Pick(NamedTuple):
    """A plan choice: the candidate, its predicted start and its predicted duration."""

    cand: Cand
    start: float
    dur: float


class Waiter(NamedTuple):
    """A job still waiting after the queue pass, with the start it waits for."""

    job: JobRequest
    start: float
    dur: float
    menu: Menu
    pick: Pick                          # the plan it waits for
    cands: list[Cand]                   # the menu it chose from (queue or idle)


@dataclass(slots=True)
class Run:
    """A running job as this round sees it: derived from ``RunningJob.request`` each round."""

    rj: RunningJob
    gpu_type: str
    menu: Menu
    ckpt_gb: float                      # what a restart saves and restores


class WaitNote(NamedTuple):
    """Raw facts about a waiting job, turned into a ``scheduler.types.Wait`` on demand."""

    job_id: str
    start: float                        # predicted start (inf: unknown)
    gpu_type: str | None
    gpus: int
    why: str                            # one of WHY (``policy.FrenzyPolicy.waits``)
