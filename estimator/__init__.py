"""Frenzy's estimator: model shapes, per-GPU training memory, parallel plans. Pure (no torch,
no Prefect at import); ``method="traced"`` imports torch lazily.

    from estimator import estimate
    est = estimate(model="llama-3.1-8b", seq_len=4096, micro_batch=1, zero=3, dp=8, gpu="H100-80GB")
"""
from .memory import Estimate, StageMemory, estimate
from .models import PRESETS, ModelSpec, resolve_model

__all__ = ["estimate", "Estimate", "StageMemory", "ModelSpec", "PRESETS", "resolve_model"]
