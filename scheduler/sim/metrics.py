"""Metrics of one simulation: the ``frenzy simulate --json`` contract and the series to plot.

Definitions (all over the workload's jobs):
* ``jobs``: rows in the workload; ``completed``: jobs that finished (not rejected because no
  plan fits the cluster, not given up after repeated out-of-memory failures, not stranded).
* ``avg_jct_s`` / ``p50_jct_s`` / ``p99_jct_s``: completion time minus submission time of the
  completed jobs (p99 by linear interpolation).
* ``makespan_s``: last completion minus first submission.
* ``avg_queue_s``: mean time from submission to first start, completed jobs.
* ``gpu_util``: allocated GPU-seconds (including start-up and failed runs) over (cluster GPUs
  x the time from the first submission to the last release: a round-based world holds a run's
  GPUs to the round after its last step, past the makespan).
* ``oom_events``: runs that died of out-of-memory.
* ``sched_ms_p50`` / ``sched_ms_p99``: wall time of one ``Policy.schedule`` call (rounds a
  policy answered from memory because its inputs had not changed are left out). The first
  call pays one-time set-up (sia's solver: 440 ms, then ~5 ms a round), which a short
  simulation's p99 shows.
* ``idle_waiting_gpu_h`` (beyond the contract): per GPU type, GPU-hours left free while a
  pending job had a plan of that type needing no more GPUs than were free (work conservation).
* ``lower_bound_avg_jct_s``: mean over jobs of ``startup_s + steps x real step time`` of the
  fastest plan that really fits (truth, not prediction) with the cluster to itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .truth import step_factor

CONTRACT_KEYS = ("policy", "jobs", "completed", "avg_jct_s", "p50_jct_s", "p99_jct_s", "makespan_s",
                 "avg_queue_s", "gpu_util", "oom_events", "sched_ms_p50", "sched_ms_p99",
                 "lower_bound_avg_jct_s")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class SimResult:
    policy: str
    jobs: int
    completed: int
    avg_jct_s: float
    p50_jct_s: float
    p99_jct_s: float
    makespan_s: float
    avg_queue_s: float
    gpu_util: float
    oom_events: int
    sched_ms_p50: float
    sched_ms_p99: float
    lower_bound_avg_jct_s: float
    # beyond the contract
    rejected: int = 0
    failed: int = 0
    stranded: int = 0
    preemptions: int = 0
    rounds: int = 0
    sim_wall_s: float = 0.0
    idle_waiting_gpu_h: dict[str, float] = field(default_factory=dict)
    jcts: list[float] = field(default_factory=list, repr=False)
    queue_series: list[tuple[float, int]] = field(default_factory=list, repr=False)
    per_job: list[dict[str, Any]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """Exactly the contract's keys, in the contract's order."""
        return {k: getattr(self, k) for k in CONTRACT_KEYS}


def _lower_bound(sim) -> float:
    cfg, gpus = sim.cfg, sim.cluster.gpus
    bounds = []
    for sj in sim.jobs:
        best = None
        for p in sj.req.plans:
            if p.device_used_gib * sj.mem_factor > gpus[p.gpu_type].memory_gib:
                continue
            t = (p.step_time_s * cfg.step_ratio.get((p.gpu_type, p.gpus), 1.0)
                 * step_factor(cfg.seed, sj.wl.job_id, p.gpu_type, cfg.noise))
            if best is None or t < best:
                best = t
        if best is not None:
            bounds.append(cfg.startup_s + sj.steps_total * best)
    return sum(bounds) / len(bounds) if bounds else 0.0


def summarise(sim, wall_s: float) -> SimResult:
    done = [sj for sj in sim.jobs if sj.state == "done"]
    jcts = [sj.end_s - sj.wl.submit_s for sj in done]
    queues = [sj.first_start - sj.wl.submit_s for sj in done]
    first = min((sj.wl.submit_s for sj in sim.jobs), default=0.0)
    last = max((sj.end_s for sj in done), default=first)
    makespan = last - first
    held = max(last, sim.last_release_s) - first        # GPUs are allocated until released
    total = sim.cluster.total_gpus
    per_job = [{"job_id": sj.wl.job_id, "model": sj.wl.model, "state": sj.state,
                "submit_s": sj.wl.submit_s, "first_start_s": sj.first_start, "end_s": sj.end_s,
                "ooms": sj.ooms, "preemptions": sj.preemptions, "starts": sj.starts, "resizes": sj.resizes}
               for sj in sim.jobs]
    return SimResult(
        policy=sim.policy.name, jobs=len(sim.jobs), completed=len(done),
        avg_jct_s=sum(jcts) / len(jcts) if jcts else 0.0,
        p50_jct_s=percentile(jcts, 50), p99_jct_s=percentile(jcts, 99),
        makespan_s=makespan, avg_queue_s=sum(queues) / len(queues) if queues else 0.0,
        gpu_util=sim.busy_gpu_s / (total * held) if total and held > 0 else 0.0,
        oom_events=sim.oom_events,
        sched_ms_p50=percentile(sim.sched_ms, 50), sched_ms_p99=percentile(sim.sched_ms, 99),
        lower_bound_avg_jct_s=_lower_bound(sim),
        rejected=sum(sj.state == "rejected" for sj in sim.jobs),
        failed=sum(sj.state == "failed" for sj in sim.jobs),
        stranded=sum(sj.state in ("pending", "running") for sj in sim.jobs),
        preemptions=sum(sj.preemptions for sj in sim.jobs),
        rounds=sim.rounds, sim_wall_s=wall_s, jcts=jcts,
        idle_waiting_gpu_h={g: s / 3600.0 for g, s in sorted(sim.idle_waiting_gpu_s.items())},
        queue_series=list(sim.queue_series), per_job=per_job)
