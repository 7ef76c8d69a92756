"""One cluster-wide scheduling round, for the simulator and the live scheduler alike.

A round hands the policy every pending job and the whole cluster (free GPUs, running jobs with
their requests), checks every decision it returns against that state, and sorts them into
actions the caller applies to its own source of truth:

* ``stops``   running jobs to stop now, in decision order: preempted back to the queue, or
              stopped for a re-size (``Resize``: the same job restarts on another plan);
* ``starts``  placements to start, in decision order, after every stop: pending jobs, and the
              new plan of each re-sized job.

The simulator applies them to its event queue (simulated clock, its own truth model); the live
scheduler to the ledger and the runs (wall clock). Only the clock and the source of truth
differ; the decisions come from this one function. ``wants_tick`` and ``next_round_s`` say when
rounds run: on every arrival and completion, on the round boundary for round-based policies,
and on a tick while jobs wait (or, for a policy that grows runs, while GPUs sit idle).

A decision that names an unknown node, GPUs that are not free, a node of another GPU type or
the wrong number of GPUs, or stops a job that is not running, is a policy bug: ``ValueError``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from estimator.plan import Plan
from scheduler.types import ClusterState, Decision, JobRequest, Policy, RunningJob, Wait

Placement = dict[str, list[int]]        # node_id -> device indices


@dataclass(slots=True)
class Resize:
    """A running job restarted on another plan in the same round (grow, shrink or recall)."""

    job_id: str
    old_plan: Plan
    old_placement: Placement
    start: Decision                      # the new plan and placement

    @property
    def kind(self) -> str:
        """"grow", "shrink" or "move" (same GPU count, another plan or type)."""
        new, old = self.start.plan.gpus, self.old_plan.gpus
        return "grow" if new > old else "shrink" if new < old else "move"


@dataclass(slots=True)
class RoundResult:
    decisions: list[Decision]            # as the policy returned them
    stops: list[Decision]                # preempts, in decision order (re-sizes included)
    starts: list[Decision]               # starts, in decision order (re-sizes included)
    resizes: dict[str, Resize] = field(default_factory=dict)   # job_id -> its re-size
    waits: dict[str, Wait] = field(default_factory=dict)       # pending jobs that did not start
    policy_ms: float = 0.0               # the policy's own time
    cached: bool = False                 # the policy answered from memory (sia's ILP)

    @property
    def preempted(self) -> list[str]:
        """Jobs stopped and sent back to the queue (not re-sized)."""
        return [d.job_id for d in self.stops if d.job_id not in self.resizes]

    @property
    def started(self) -> list[Decision]:
        """Starts of jobs that were pending (not re-sizes)."""
        return [d for d in self.starts if d.job_id not in self.resizes]


def run_round(policy: Policy, pending: list[JobRequest], state: ClusterState, now: float) -> RoundResult:
    """Run ``policy`` over the whole cluster once and check its decisions (module docstring)."""
    t0 = time.perf_counter()
    decisions = policy.schedule(pending, state, now)
    policy_ms = (time.perf_counter() - t0) * 1e3
    result = check_decisions(policy.name, decisions, pending, state)
    result.policy_ms = policy_ms
    result.cached = bool(getattr(policy, "round_was_cached", False))
    started = {d.job_id for d in result.starts}
    result.waits = {j: w for j, w in policy.waits().items() if j not in started}
    return result


def check_decisions(name: str, decisions: list[Decision], pending: list[JobRequest],
                    state: ClusterState) -> RoundResult:
    """Validate ``decisions`` against ``state`` (stops first, then starts in order) and sort
    them into a ``RoundResult``; ``ValueError`` names the policy and the broken rule."""
    nodes = {n.node_id: n for n in state.nodes}
    free = {n.node_id: set(n.free) for n in state.nodes}
    running: dict[str, RunningJob] = {r.job_id: r for r in state.running}
    waiting = {j.job_id for j in pending}
    stops: list[Decision] = []
    stopped: dict[str, RunningJob] = {}
    for d in decisions:
        if d.action != "preempt":
            continue
        rj = running.get(d.job_id)
        if rj is None or d.job_id in stopped:
            raise ValueError(f"policy {name}: preempt of {d.job_id}, which is not running")
        for node_id, devs in rj.placement.items():
            if node_id in free:
                free[node_id].update(devs)
        stopped[d.job_id] = rj
        stops.append(d)
    starts: list[Decision] = []
    resizes: dict[str, Resize] = {}
    for d in decisions:
        if d.action != "start":
            continue
        jid = d.job_id
        if jid in stopped and jid not in resizes:
            rj = stopped[jid]
            if d.plan is not None:
                resizes[jid] = Resize(jid, rj.plan, {k: list(v) for k, v in rj.placement.items()}, d)
        elif jid not in waiting or any(s.job_id == jid for s in starts):
            raise ValueError(f"policy {name}: start of {jid}, which is not pending")
        plan = d.plan
        if plan is None:
            raise ValueError(f"policy {name}: start of {jid} without a plan")
        ngpu = 0
        for node_id, devs in d.placement.items():
            node = nodes.get(node_id)
            if node is None:
                raise ValueError(f"policy {name}: {jid} placed on unknown node {node_id}")
            if node.gpu_type != plan.gpu_type:
                raise ValueError(f"policy {name}: {jid} plan {plan.gpu_type} placed on {node.gpu_type} node")
            if len(set(devs)) != len(devs) or not free[node_id].issuperset(devs):
                raise ValueError(f"policy {name}: {jid} placed on busy GPUs {node_id}:{devs}")
            ngpu += len(devs)
        if ngpu != plan.gpus:
            raise ValueError(f"policy {name}: {jid} plan needs {plan.gpus} GPUs, placement has {ngpu}")
        for node_id, devs in d.placement.items():
            free[node_id].difference_update(devs)
        starts.append(d)
    return RoundResult(decisions=decisions, stops=stops, starts=starts, resizes=resizes)


# ---------------------------------------------------------------------------- when rounds run
def wants_tick(policy: Policy, *, pending: int, running: int, any_free: bool) -> bool:
    """Event-driven policies get a periodic tick while jobs wait (aging, reservations coming
    due), and a policy that grows runs also while GPUs sit idle under running jobs."""
    return pending > 0 or (policy.grows_runs and running > 0 and any_free)


# The finest tick (and simulated world round), live and simulated: a round a second. A live
# round takes tens of ms and the service reads the ledger every 0.5 s; finer ticks only multiply
# rounds (a simulated 1e-9 s tick never finished).
MIN_TICK_S = 1.0


def next_round_s(policy: Policy, now: float, tick_s: float, *, after_round: bool) -> float:
    """When the next round is due without a new event. Round-based policies: ``round_s`` after
    a round, else the next round boundary (rounds align to multiples of ``round_s``, which may
    be ``now``). Event-driven ones: ``now + tick_s``."""
    r = policy.round_s
    if r is None:
        return now + tick_s
    return now + r if after_round else math.ceil(now / r) * r
