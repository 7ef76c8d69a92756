"""Pieces of the submit flow that need no Prefect server."""
from __future__ import annotations


def test_live_policy_never_restarts_running_jobs():
    from frenzy_flows.tasks import live_policy
    from scheduler.policies import get_policy

    sim = get_policy("frenzy")
    live = live_policy("frenzy")
    assert (sim.preemption, sim.grow, sim.shrink) == (True, True, True)
    assert (live.preemption, live.grow, live.shrink) == (False, False, False)
    # policies without those knobs are built as they are
    assert type(live_policy("frenzy-paper")).__name__ == type(get_policy("frenzy-paper")).__name__


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
