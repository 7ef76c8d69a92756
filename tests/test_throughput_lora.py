"""Throughput model, LoRA / QLoRA: the frozen base computes no weight gradients, the adapters
cost memory bandwidth, gradients and optimizer cover the adapters only; the planner and the
trainer's re-estimate charge the same terms (one implementation)."""
import pytest

from estimator.catalog import get_gpu
from estimator.memory import lora_adapters, validate_knobs
from estimator.models import resolve_model
from estimator.plan import Plan
from estimator.plans import plan_adapters, plans_for_job
from estimator.throughput import DEFAULT_FACTORS, Adapters, step_time, step_time_breakdown
from trainer.fallback import reestimate

LLAMA = resolve_model("llama-3.2-1b")
H200 = get_gpu("H200-141GB")


def plan(dp=1, zero=0, mb=4, ga=2, ckpt="none", g="H200-141GB"):
    return Plan(gpu_type=g, gpus=dp, dp=dp, zero=zero, micro_batch=mb, grad_accum=ga, act_ckpt=ckpt)


def parts(p, adapters=None, spec=LLAMA, seq=2048):
    return step_time_breakdown(spec, p, get_gpu(p.gpu_type), seq_len=seq, adapters=adapters)


def adapters_of(spec, **kw):
    k = validate_knobs(spec, seq_len=2048, micro_batch=4, grad_accum=2, **kw)
    return lora_adapters(spec, k)


def test_full_fine_tuning_has_no_adapters_and_its_plans_are_timed_without():
    assert adapters_of(LLAMA) is None
    job = dict(model="llama-3.2-1b", seq_len=2048, global_batch=8, train_steps=10)
    assert plan_adapters(job, plan()) is None
    for p in plans_for_job(job, {"H200-141GB": 8})["H200-141GB"][:6]:
        assert p.step_time_s == step_time(LLAMA, p, H200, seq_len=2048)


def test_lora_drops_the_weight_gradient_gemms_and_adds_adapter_traffic():
    ad = adapters_of(LLAMA, finetune="lora")         # q_proj, v_proj, r 16, fp32 adapters under AMP
    assert ad.in_features == 2 * 2048 and ad.out_features == 2048 + 512 and ad.fp32 and not ad.dropout
    full, lora = parts(plan()), parts(plan(), ad)
    # one GEMM pass in three gone: at most a third of the compute, at least a quarter on this shape
    assert full.compute * 0.66 < lora.compute < full.compute * 0.75
    assert lora.memory > full.memory              # the adapters' casts, scaling and add
    assert lora.optimizer < full.optimizer / 100  # Adam over ~1.7M adapter parameters, not 1.2B
    assert 0.7 < lora.total / full.total < 0.9


def test_adapter_cost_grows_with_targets_dropout_casts_and_recompute():
    qv = Adapters(16, 4096, 2560, fp32=True)
    every = Adapters(16, 4 * 2048 + 2 * 2048 + 8192, 2048 + 2 * 512 + 2048 + 2 * 8192, fp32=True)
    b = lambda a, rec=0.0: a.bytes_per_token(rec, DEFAULT_FACTORS)  # noqa: E731
    assert b(every) > 3 * b(qv)
    assert b(Adapters(16, 4096, 2560, fp32=True, dropout=True)) > b(qv)
    assert b(Adapters(16, 4096, 2560, fp32=False)) < b(qv)   # 16-bit adapters: no casts
    assert b(qv, 1.0) > b(qv)                                  # recomputation repeats the forward
    t = lambda a: parts(plan(), a).total  # noqa: E731
    assert t(qv) < t(every)
    assert parts(plan(ckpt="full"), qv).total > t(qv)


def test_data_parallel_traffic_covers_the_adapters_but_zero3_still_gathers_the_base():
    ad = adapters_of(LLAMA, finetune="lora", dp=8, zero=2)
    assert not ad.fp32                             # DeepSpeed's bf16 engine: 16-bit adapters
    p0, p3 = plan(dp=8, zero=0), plan(dp=8, zero=3)
    assert parts(p0, ad).dp_comm < parts(p0).dp_comm / 50
    # ZeRO-3: two of the three collectives (the parameter gathers) still carry the frozen base
    ratio = parts(p3, ad).dp_comm / parts(p3).dp_comm
    assert 0.5 < ratio < 0.75


def test_qlora_pays_for_dequantising_the_base():
    lora = adapters_of(LLAMA, finetune="lora")
    q = adapters_of(LLAMA, finetune="qlora")
    assert q.qlora and not lora.qlora
    assert parts(plan(), q).memory > parts(plan(), lora).memory


def test_planner_and_reestimate_charge_the_same_adapters():
    job = dict(model="llama-3.2-1b", seq_len=2048, global_batch=8, train_steps=10,
               finetune={"method": "lora", "target_modules": ["q_proj", "v_proj", "down_proj"]})
    full_job = {k: v for k, v in job.items() if k != "finetune"}
    inv = {"H200-141GB": 8}
    lora_plans = plans_for_job(job, inv)["H200-141GB"]
    full_plans = plans_for_job(full_job, inv)["H200-141GB"]
    assert lora_plans and full_plans
    assert min(p.step_time_s for p in lora_plans) < min(p.step_time_s for p in full_plans)
    for p in lora_plans[:6]:
        want = step_time(LLAMA, p, H200, seq_len=2048, adapters=plan_adapters(job, p))
        assert p.step_time_s == pytest.approx(want, rel=1e-12)
        again = reestimate(job_model(job), p, safety_margin_gib=0.0)
        assert again.step_time_s == pytest.approx(want, rel=1e-12)


def job_model(d):
    from estimator.job import TrainingJob
    return TrainingJob(name="lora", **d)
