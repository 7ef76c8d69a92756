"""Frenzy's Prefect flows: submit a training job without naming a GPU.

    from frenzy_flows import submit_training
    result = submit_training(job={"model": "gpt2-tiny", "seq_len": 64, "global_batch": 8, "train_steps": 10})
    result.plan, result.allocation, result.measured, result.checkpoint_dir
"""
from .flow import submit_training
from .results import SubmitResult

__all__ = ["submit_training", "SubmitResult"]
