"""Trace-driven discrete-event cluster simulator.

It drives the very same code as live runs: plans from ``estimator.plans`` (memory model +
throughput model), step times from ``estimator.throughput``, policies from
``scheduler.policies`` behind ``scheduler.types.Policy``. Only the truth differs from the
prediction: seeded lognormal noise on each job's step time and peak memory (``truth.py``).

    from scheduler.sim import simulate
    result = simulate(workload_jobs, cluster, "frenzy", seed=0, noise=0.1)
    result.summary()   # the `frenzy simulate --json` object
"""
from .engine import SimConfig, SimResult, simulate

__all__ = ["SimConfig", "SimResult", "simulate"]
