"""What really happens, as opposed to what the estimator predicts.

Each job's real peak memory is its plan's predicted ``device_used_gib`` times one lognormal
factor per job (an estimator error is systematic for a model shape: the same job misses the
same way on every plan and every retry); its real step time is the predicted step time times a
lognormal factor per (job, GPU type) (throughput errors differ by GPU class). Both use
``sigma = noise``. Factors come from a hash of (seed, job_id, what), not from a shared stream,
so a job's truth does not depend on arrival order or on which policy runs: every policy meets
the same truth. The normal deviate is clipped at +-3 sigma (a bounded estimator error; without
clipping a 15,000-job trace would always contain 4-sigma outliers no margin covers).
"""
from __future__ import annotations

import hashlib
import math
import random

CLIP_SIGMAS = 3.0


def _deviate(seed: int, job_id: str, what: str) -> float:
    h = hashlib.blake2b(f"{seed}|{job_id}|{what}".encode(), digest_size=8).digest()
    z = random.Random(int.from_bytes(h, "little")).gauss(0.0, 1.0)
    return max(-CLIP_SIGMAS, min(CLIP_SIGMAS, z))


def memory_factor(seed: int, job_id: str, noise: float) -> float:
    """Real peak memory / predicted, for every plan of this job."""
    return math.exp(noise * _deviate(seed, job_id, "mem")) if noise > 0 else 1.0


def step_factor(seed: int, job_id: str, gpu_type: str, noise: float) -> float:
    """Real step time / predicted, for this job on this GPU type."""
    return math.exp(noise * _deviate(seed, job_id, f"step:{gpu_type}")) if noise > 0 else 1.0
