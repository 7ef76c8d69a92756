"""Pieces of the submit flow that need no Prefect server."""
from __future__ import annotations


def test_site_defaults_fill_only_what_the_job_leaves_unset():
    from blocks import FrenzySettings
    from estimator.job import TrainingJob
    from frenzy_flows.tasks import with_site_defaults

    site = FrenzySettings(default_precision="fp16", default_optimizer="sgd")
    job = TrainingJob(name="a", model="gpt2-tiny", seq_len=64, global_batch=8, train_steps=1, precision="fp32")
    filled = with_site_defaults(job, site)
    assert (filled.precision, filled.optimizer) == ("fp32", "sgd")      # the job's own value wins
    bare = TrainingJob(name="b", model="gpt2-tiny", seq_len=64, global_batch=8, train_steps=1)
    assert (with_site_defaults(bare, site).precision, bare.precision) == ("fp16", "bf16")
    assert with_site_defaults(job, None) is job
