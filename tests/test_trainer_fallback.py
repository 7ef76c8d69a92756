"""OOM fallback order, re-estimated by the real estimator (pure, milliseconds)."""
from __future__ import annotations

import itertools

import pytest

from estimator.catalog import get_gpu
from estimator.job import TrainingJob
from estimator.plan import Plan
from estimator.plans import enumerate_plans
from trainer.fallback import fallback_plans, realisable, reestimate

BIG = TrainingJob(model="llama-3.1-8b", seq_len=4096, global_batch=64, train_steps=10)
TINY = TrainingJob(model="gpt2-tiny", seq_len=64, global_batch=8, train_steps=6)


def first_realisable(job, gpu, n):
    return next(p for p in enumerate_plans(job, gpu, max_gpus=n) if realisable(p))


def test_issue_order_on_a_big_model():
    start = first_realisable(BIG, "A100-80GB", 4)
    seq = list(fallback_plans(BIG, start, inventory={"A100-80GB": 16, "H200-141GB": 8, "RTX3090-24GB": 32}))
    assert seq, "a fallback must exist"
    stage = []
    for prev, p in zip([start] + seq, seq):
        if p.gpu_type != start.gpu_type:
            stage.append(5)
        elif p.gpus > start.gpus:
            stage.append(4)
        elif p.offload != prev.offload:
            stage.append(3)
        elif p.zero != prev.zero:
            stage.append(2)
        else:
            assert p.act_ckpt != prev.act_ckpt
            stage.append(1)
    assert stage == sorted(stage), f"out of order: {stage} for {[p.short() for p in seq]}"
    # every fallback keeps the global batch, is realisable, and the estimator believes it fits
    for p in seq:
        assert p.global_batch == BIG.global_batch
        assert realisable(p)
        assert p.device_used_gib <= get_gpu(p.gpu_type).memory_gib
    # steps 1-3 lower the predicted memory at each rung on the same GPUs
    same = [p for p in seq if p.gpu_type == start.gpu_type and p.gpus == start.gpus]
    mems = [start.device_used_gib] + [p.device_used_gib for p in same]
    assert all(b < a for a, b in zip(mems, mems[1:]))
    # the next GPU type is one with more memory, never the RTX 3090
    assert {p.gpu_type for p in seq} <= {"A100-80GB", "H200-141GB"}
    assert seq[-1].gpu_type == "H200-141GB"


def test_first_fallback_is_more_activation_checkpointing():
    start = reestimate(TINY, Plan(gpu_type="CPU", gpus=1, dp=1, micro_batch=4, grad_accum=2))
    first = next(fallback_plans(TINY, start))
    assert first.act_ckpt in ("selective", "full") and first.zero == 0 and first.gpus == 1
    assert (first.micro_batch, first.grad_accum) == (4, 2)


def test_more_gpus_only_as_the_inventory_allows():
    start = reestimate(TINY, Plan(gpu_type="CPU", gpus=1, dp=1, micro_batch=4, grad_accum=2))
    alone = list(fallback_plans(TINY, start, inventory={"CPU": 1}))
    assert all(p.gpus == 1 for p in alone)
    more = list(fallback_plans(TINY, start, inventory={"CPU": 2}))
    two = [p for p in more if p.gpus == 2]
    assert two and two[0].dp == 2 and two[0].global_batch == 8


def test_fallbacks_are_lazy_and_distinct():
    start = first_realisable(BIG, "A100-80GB", 4)
    gen = fallback_plans(BIG, start, inventory={"A100-80GB": 16, "H200-141GB": 8})
    got = list(itertools.islice(gen, 2))
    assert len(got) == 2 and got[0] != got[1]
    keys = [(p.gpu_type, p.gpus, p.zero, p.offload, p.act_ckpt, p.micro_batch) for p in fallback_plans(
        BIG, start, inventory={"A100-80GB": 16, "H200-141GB": 8})]
    assert len(keys) == len(set(keys))


def test_nothing_left_when_the_job_fits_nowhere_bigger():
    start = first_realisable(BIG, "H200-141GB", 8)
    seq = list(fallback_plans(BIG, start.model_copy(update={"act_ckpt": "full", "zero": 3,
                                                               "offload": "optimizer+params"}),
                              inventory={"H200-141GB": start.gpus, "A100-80GB": 64}))
    assert seq == []


@pytest.mark.parametrize("bad", [dict(cp=2, tp=2, dp=1), dict(pp=2, dp=2, zero=2, offload="optimizer"), dict(tp=2, dp=4), dict(offload="optimizer", zero=0),
                                 dict(offload="optimizer+params", zero=2)])
def test_unrealisable_plans_are_never_proposed(bad):
    p = Plan(gpu_type="A100-80GB", gpus=4, grad_accum=8, **{"dp": 4, **bad})
    assert not realisable(p)


@pytest.mark.parametrize("good", [dict(), dict(zero=1), dict(zero=2, offload="optimizer"),
                                  dict(zero=3, offload="optimizer+params"), dict(dp=2, tp=2, zero=3), dict(dp=2, cp=2, zero=1),
                                  dict(dp=2, pp=2, zero=3)])
def test_data_parallel_zero_plans_are_realisable(good):
    assert realisable(Plan(gpu_type="A100-80GB", gpus=4, grad_accum=8, **{"dp": 4, **good}))
