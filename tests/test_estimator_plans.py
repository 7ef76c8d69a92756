"""Plan enumeration: feasibility, global batch, ranking, CPU rules, does-not-fit errors."""
import pytest

from estimator import estimate
from estimator.catalog import get_gpu
from estimator.errors import DoesNotFitError, FrenzyInputError
from estimator.job import TrainingJob
from estimator.plans import enumerate_plans, plans_for_job

JOB = dict(model="llama-3.1-8b", seq_len=4096, global_batch=64)


def test_plans_fit_keep_batch_and_are_ranked():
    plans = enumerate_plans(JOB, "A100-80GB", max_gpus=16)
    assert plans
    cap = get_gpu("A100-80GB").memory_gib - 1.0
    for p in plans:
        assert p.gpu_type == "A100-80GB"
        assert p.micro_batch * p.grad_accum * p.dp == 64
        assert p.gpus == p.dp * p.tp * p.pp * p.cp <= 16
        assert 0 < p.device_used_gib <= cap
        assert p.step_time_s > 0
        assert p.precision == "bf16" and p.optimizer == "adamw" and p.attention == "flash"
    # launchable plans first, each group fastest first
    flags = [p.not_launchable is not None for p in plans]
    assert flags == sorted(flags)
    for group in (False, True):
        times = [p.step_time_s for p in plans if (p.not_launchable is not None) == group]
        assert times == sorted(times)


def test_plan_predictions_match_estimate():
    p = enumerate_plans(JOB, "H100-80GB", max_gpus=8)[0]
    e = estimate(model=JOB["model"], seq_len=4096, micro_batch=p.micro_batch,
                 grad_accum=p.grad_accum, dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, zero=p.zero,
                 offload=p.offload, act_ckpt=p.act_ckpt, gpu="H100-80GB")
    assert p.device_used_gib == pytest.approx(e.device_used_gib, abs=1e-3)


def test_safety_margin_removes_plans():
    loose = enumerate_plans(JOB, "A100-40GB", max_gpus=8, safety_margin_gib=0)
    tight = enumerate_plans(JOB, "A100-40GB", max_gpus=8, safety_margin_gib=10)
    mem = get_gpu("A100-40GB").memory_gib
    assert all(p.device_used_gib <= mem - 10 for p in tight)
    # without a margin the planner uses the room the margin would keep free
    assert any(p.device_used_gib > mem - 10 for p in loose)
    assert len(tight) <= len(loose)


def test_job_options_are_used():
    job = TrainingJob(model="gpt2", seq_len=512, global_batch=32, train_steps=1,
                      precision="fp32", optimizer="sgd", attention="eager")
    plans = enumerate_plans(job, "T4-16GB", max_gpus=4)
    assert plans and all(p.precision == "fp32" and p.optimizer == "sgd" for p in plans)


def test_cpu_type_is_data_parallel_only():
    plans = enumerate_plans(dict(model="gpt2-tiny", seq_len=64, global_batch=8), "CPU", max_gpus=4)
    assert plans
    assert all(p.tp == 1 and p.pp == 1 and p.zero in (0, 2) and p.offload == "none" for p in plans)
    assert {p.gpus for p in plans} <= {1, 2, 4}


def test_plans_for_job_per_type_and_constraints():
    inv = {"A100-80GB": 8, "T4-16GB": 4, "H100-80GB": 0}
    out = plans_for_job(dict(JOB, allowed_gpu_types=["A100-80GB", "T4-16GB"]), inv)
    assert set(out) == set(inv)
    assert out["H100-80GB"] == []
    assert out["A100-80GB"] and all(p.gpus <= 8 for p in out["A100-80GB"])
    capped = plans_for_job(dict(JOB, max_gpus=4), {"A100-80GB": 8})
    assert capped["A100-80GB"] and all(p.gpus <= 4 for p in capped["A100-80GB"])


def test_does_not_fit_names_closest_plan():
    with pytest.raises(DoesNotFitError) as err:
        plans_for_job(dict(model="llama-2-70b", seq_len=4096, global_batch=8), {"T4-16GB": 2})
    e = err.value
    assert e.closest is not None and e.closest.gpu_type == "T4-16GB"
    assert e.shortfall_gib > 0
    assert "misses by" in str(e) and e.field == "job"


def test_gpus_per_node_limits_tensor_parallel():
    out = plans_for_job(JOB, {"A10-24GB": 16}, gpus_per_node={"A10-24GB": 2})
    assert out["A10-24GB"] and all(p.tp <= 2 for p in out["A10-24GB"])


def test_bad_input():
    with pytest.raises(FrenzyInputError):
        enumerate_plans(JOB, "NOPE-1GB", max_gpus=4)
    with pytest.raises(FrenzyInputError, match="max_gpus"):
        enumerate_plans(JOB, "A100-80GB", max_gpus=0)
    with pytest.raises(FrenzyInputError, match="seq_len"):
        enumerate_plans(dict(JOB, seq_len=0), "A100-80GB", max_gpus=4)


def test_custom_gpu_type_from_a_cluster_gets_plans():
    from estimator.catalog import get_gpu
    from estimator.errors import FrenzyInputError
    from estimator.plans import plans_for_job

    custom = get_gpu("A100-80GB").model_copy(update={"name": "MI300X-192GB", "memory_gib": 192.0})
    job = {"model": "llama-2-13b", "seq_len": 2048, "global_batch": 8, "train_steps": 10}
    with pytest.raises(FrenzyInputError, match="MI300X-192GB"):
        plans_for_job(job, {"MI300X-192GB": 8})
    plans = plans_for_job(job, {"MI300X-192GB": 8}, gpus={"MI300X-192GB": custom})
    assert plans["MI300X-192GB"]
    from estimator.plans import estimate_plan
    est = estimate_plan(job, plans["MI300X-192GB"][0], gpus={"MI300X-192GB": custom})
    assert est.gpu_memory_gib == 192.0 and est.fits
    assert abs(est.device_used_gib - plans["MI300X-192GB"][0].device_used_gib) < 1e-3
    assert all(p.device_used_gib <= 192.0 - 1.0 for p in plans["MI300X-192GB"])
    # the same job holds on fewer of the big custom cards than on 80 GB ones
    a100 = plans_for_job(job, {"A100-80GB": 8})["A100-80GB"]
    assert min(p.gpus for p in plans["MI300X-192GB"]) <= min(p.gpus for p in a100)


def test_estimate_plan_agrees_with_the_enumerated_predictions():
    from estimator.plans import estimate_plan, plans_for_job

    job = {"model": "llama-3.2-1b", "seq_len": 2048, "global_batch": 16, "train_steps": 10}
    plans = plans_for_job(job, {"A100-80GB": 8, "RTX3090-24GB": 16})
    checked = 0
    for p in (p for ps in plans.values() for p in ps):
        est = estimate_plan(job, p)
        assert abs(est.device_used_gib - p.device_used_gib) < 1e-3
        assert abs(est.allocated_peak_gib - p.allocated_peak_gib) < 1e-3
        checked += 1
    assert checked >= 4


def test_paged_optimizer_plans_count_the_paged_states_in_device_used():
    """bitsandbytes' paged 8-bit AdamW keeps its large states in CUDA unified memory, outside
    the allocator: the planner counts them in device used as ``estimate`` does, so its plans
    fit with the states resident (and agree with ``estimate_plan``)."""
    from estimator.plans import estimate_plan, plans_for_job

    job = {"model": "llama-3.2-1b", "seq_len": 2048, "global_batch": 16, "train_steps": 10,
           "optimizer": "adamw8bit-paged"}
    plans = plans_for_job(job, {"RTX3090-24GB": 8, "A100-80GB": 4})
    cap = {g: get_gpu(g).memory_gib - 1.0 for g in plans}
    checked = 0
    for p in (p for ps in plans.values() for p in ps):
        est = estimate_plan(job, p)
        paged = est.overheads["paged_optimizer_gib"]
        assert paged > 0.1
        assert abs(est.device_used_gib - p.device_used_gib) < 1e-3
        assert p.device_used_gib <= cap[p.gpu_type] + 1e-9
        assert p.device_used_gib - p.reserved_peak_gib > paged      # beyond the allocator's share
        checked += 1
    assert checked >= 4


def test_plan_step_times_are_the_throughput_model_of_the_plan_itself():
    """Every field of a plan the throughput model reads reaches the planner's step time: an
    eager-attention job's plans are timed with eager kernels (they were timed as flash)."""
    from estimator.models import resolve_model
    from estimator.throughput import step_time
    spec = resolve_model("gpt2-medium")
    for attention in ("flash", "eager"):
        plans = enumerate_plans(dict(model="gpt2-medium", seq_len=1024, global_batch=64, attention=attention),
                                "A100-80GB", max_gpus=8)
        assert plans
        for p in plans[:20]:
            assert p.attention == attention
            nodes = -(-p.gpus // 8)
            assert p.step_time_s == pytest.approx(step_time(spec, p, get_gpu("A100-80GB"), seq_len=1024, nodes=nodes),
                                                  rel=1e-9)


def test_tp_the_kv_heads_do_not_split_into_is_marked_not_launchable():
    """The planner keeps Megatron-style plans whose tp replicates KV heads (tp a multiple of
    them) for the simulator, marked with the trainer's reason; tp not dividing the query heads
    is never enumerated."""
    from estimator.job import TrainingJob
    from estimator.plans import enumerate_plans
    from trainer.fallback import realisable

    model = {"name": "gqa-8-2", "arch": "llama", "layers": 4, "hidden": 512, "heads": 8, "kv_heads": 2,
             "vocab": 1024}
    job = TrainingJob(model=model, seq_len=256, global_batch=8, train_steps=1)
    plans = enumerate_plans(job, "A100-80GB", max_gpus=8, gpus_per_node=8)
    by_tp = {}
    for p in plans:
        by_tp.setdefault(p.tp, []).append(p)
    assert by_tp[2] and all(p.not_launchable is None or "plan.tp" not in p.not_launchable for p in by_tp[2])
    assert any(p.not_launchable is None for p in by_tp[2])
    assert by_tp.get(4) or by_tp.get(8), "tp > KV heads plans are enumerated (KV heads replicated)"
    for tp in (4, 8):
        for p in by_tp.get(tp, []):
            assert p.not_launchable and f"tp={tp} must divide the model's 8 attention heads and 2 KV heads" \
                in p.not_launchable
            assert not realisable(p)


def test_preflight_refuses_a_plan_whose_tp_the_heads_do_not_split_into():
    from estimator.errors import FrenzyInputError
    from estimator.job import TrainingJob
    from estimator.plan import Plan
    from trainer.runner import preflight

    job = TrainingJob(model="gpt2-tiny", seq_len=16, global_batch=4, train_steps=1)
    with pytest.raises(FrenzyInputError, match="tp=8 must divide the model's 4 attention heads"):
        preflight(job, Plan(gpu_type="A100-80GB", gpus=8, tp=8, micro_batch=4))


def test_pipeline_plans_are_launchable_for_llama_decoders_only():
    from estimator.job import TrainingJob

    dims = {"layers": 8, "hidden": 1024, "heads": 8, "vocab": 32000}
    llama = TrainingJob(model={"name": "l", "arch": "llama", **dims}, seq_len=1024, global_batch=16, train_steps=1)
    gpt = TrainingJob(model={"name": "g", "arch": "gpt", **dims}, seq_len=1024, global_batch=16, train_steps=1)
    from estimator.plans import plans_for_job

    lp = plans_for_job(llama, {"A100-80GB": 8}, plan_filter={"pp": 2, "tp": 1})["A100-80GB"]
    # ZeRO 0 and 1 (ZeroRedundancyOptimizer over each stage's replicas) launch; offload does not
    assert any(p.not_launchable is None and p.zero == 1 and p.dp > 1 for p in lp)
    assert all((p.not_launchable is None) == (p.offload == "none") for p in lp)
    assert all("plan.pp" in p.not_launchable for p in lp if p.not_launchable)
    gp = plans_for_job(gpt, {"A100-80GB": 8}, plan_filter={"pp": 2, "tp": 1})["A100-80GB"]
    assert gp and all(p.not_launchable and "built for llama decoders" in p.not_launchable for p in gp)


def test_sequence_parallel_is_enumerated_on_gpus_but_chosen_only_where_memory_binds():
    """Unasked, the planner enumerates Ulysses (cp) plans on GPU types; a short-sequence job does
    not pick one (it only adds all-to-alls), a long-sequence job whose cp = 1 plans must split
    the layers over tp ranks or recompute the forward to fit does. The CPU pseudo type keeps
    data parallel unless a filter asks."""
    short = {"model": "gpt2", "seq_len": 512, "global_batch": 32, "train_steps": 1}
    assert plans_for_job(short, {"A100-80GB": 16})["A100-80GB"][0].cp == 1
    long = {"model": "llama-3.1-8b", "seq_len": 8192, "global_batch": 32, "train_steps": 1}
    best = plans_for_job(long, {"H100-80GB": 8}, gpus_per_node=8)["H100-80GB"][0]
    assert best.cp > 1 and best.tp == best.pp == 1 and best.not_launchable is None
    flat = [p for p in plans_for_job(long, {"H100-80GB": 8}, gpus_per_node=8, plan_filter={"cp": 1})["H100-80GB"]
            if p.not_launchable is None][0]
    assert flat.step_time_s > best.step_time_s and (flat.tp > 1 or flat.act_ckpt == "full")
    assert all(p.cp == 1 for p in plans_for_job(short, {"CPU": 2}, gpus_per_node=2)["CPU"])


def test_the_planner_times_only_plans_it_may_keep_and_keeps_what_timing_all_would(monkeypatch):
    """Per GPU count the planner keeps the few fastest plans; it asks step times only of the
    candidates whose shared floor does not prove them slower. Timing every candidate with
    ``throughput.step_time`` itself must give the same plans, in the same order, to the bit,
    also with a filter, eager attention (selective checkpointing) and narrow nodes."""
    from estimator import plans as plans_mod
    from estimator.plan_filter import parse_plan_filter
    from estimator.throughput import step_time

    def time_all(cands, spec, gpu, seq_len, nodes, precision, attention, factors, lora=False):
        for c in cands:
            base = c.base
            shape = plans_mod._PlanShape(base.dp, base.tp, base.pp, base.cp, base.zero, base.offload,
                                         base.act_ckpt, c.mb, c.ga, precision, attention, base.vpp)
            c.step_time = step_time(spec, shape, gpu, seq_len=seq_len, nodes=nodes, factors=factors,
                             adapters=plans_mod.lora_adapters(spec, base) if lora else None)
        return cands

    timed = []
    pruned_fastest = plans_mod._time_fastest

    def counting(cands, *args):
        out = pruned_fastest(cands, *args)
        timed.append((len(cands), len(out)))
        return out

    inv = {"A100-40GB": 16, "H100-80GB": 24, "RTX3090-24GB": 8, "CPU": 4}
    cases = [(dict(model="llama-3.2-1b", seq_len=2048, global_batch=64), {}),
             (dict(model="gpt2-medium", seq_len=1024, global_batch=48, attention="eager"), {"gpus_per_node": 4}),
             (dict(model="llama-3.1-8b", seq_len=4096, global_batch=32), {"plan_filter": parse_plan_filter("zero=3")}),
             (dict(model="llama-3.2-1b", seq_len=2048, global_batch=64,
                   finetune={"method": "lora", "target_modules": ["q_proj", "down_proj"]}), {})]
    for job, kw in cases:
        plans_mod._plans_cached.cache_clear()
        monkeypatch.setattr(plans_mod, "_time_fastest", counting)
        pruned = plans_for_job(job, inv, **kw)
        plans_mod._plans_cached.cache_clear()
        monkeypatch.setattr(plans_mod, "_time_fastest", time_all)
        every = plans_for_job(job, inv, **kw)
        assert sum(map(len, pruned.values())) > 0
        assert {g: [p.model_dump() for p in ps] for g, ps in pruned.items()} == \
            {g: [p.model_dump() for p in ps] for g, ps in every.items()}
    plans_mod._plans_cached.cache_clear()
    # and it did skip step times: fewer candidates timed than there were
    assert sum(t for _, t in timed) < sum(n for n, _ in timed)


def test_a_global_batch_planned_after_others_gets_the_plans_of_a_fresh_planner():
    """The structures of a job shape, their launch rules and their peaks are shared across
    global batches; the plans of a batch asked after others (the memo filled) must be those of
    a planner that never saw the shape, every field to the bit, interleaved pipelines too."""
    from estimator import plans as plans_mod
    from estimator.plan_filter import parse_plan_filter

    inv = {"A100-40GB": 32, "L40S-48GB": 16, "RTX3090-24GB": 8}

    def dump(job, **kw):
        return {g: [p.model_dump() for p in ps] for g, ps in plans_for_job(job, inv, **kw).items()}

    # llama-2-7b at 2,048 tokens: pipelines bind memory, so a batch key that merged their
    # in-flight micro-batches would change its plans (tried)
    for job, kw in [(dict(model="llama-3.2-1b", seq_len=2048), {}),
                    (dict(model="llama-2-7b", seq_len=2048), {}),
                    (dict(model="llama-3.1-8b", seq_len=4096), {"plan_filter": parse_plan_filter("vpp=2")})]:
        plans_mod.clear_caches()
        alone = dump({**job, "global_batch": 96}, **kw)
        plans_mod.clear_caches()
        for gb in (32, 256, 48, 8):
            dump({**job, "global_batch": gb}, **kw)
        assert dump({**job, "global_batch": 96}, **kw) == alone
        assert sum(map(len, alone.values())) > 0


def test_a_replaced_framework_profile_is_planned_afresh(monkeypatch):
    """``estimator.profiles.PROFILES`` may be replaced at run time: the planner's caches (the
    shape's structures, its tables, its plans) are keyed by the profile object, so plans after
    a replacement are a fresh planner's, for a batch seen before and a new one."""
    import dataclasses

    from estimator import plans as plans_mod, profiles

    inv = {"A100-40GB": 16}
    job = dict(model="llama-3.2-1b", seq_len=2048)

    def dump(gb):
        return {g: [p.model_dump() for p in ps]
                for g, ps in plans_for_job({**job, "global_batch": gb}, inv).items()}

    before = dump(32)
    monkeypatch.setitem(profiles.PROFILES, "frenzy",
                        dataclasses.replace(profiles.PROFILES["frenzy"], zero_bucket_elems=5e9))
    warm = dump(32), dump(64)
    plans_mod.clear_caches()
    assert warm == (dump(32), dump(64))
    assert warm[0] != before          # the bucket term moved the ZeRO plans' memory


@pytest.mark.parametrize("inventory,kw,field", [
    ({"H100-80GB": 10 ** 30}, {}, "inventory['H100-80GB']"), ({"H100-80GB": 2.5}, {}, "inventory['H100-80GB']"),
    ({"H100-80GB": True}, {}, "inventory['H100-80GB']"), ({"H100-80GB": 8}, {"gpus_per_node": 0}, "gpus_per_node"),
    ({"L4-24GB": 2}, {"host_ram_gib": {"L4-24GB": float("nan")}}, "host_ram_gib['L4-24GB']"),
    (["H100-80GB"], {}, "inventory"),
])
def test_cluster_sizes_the_planner_cannot_use_are_one_line(inventory, kw, field):
    """A count of 10^30 spun for ever, 2.5 GPUs were truncated, True was 1, a node of 0 GPUs was
    clamped to 1, a NaN host memory shrank the plan list."""
    from estimator.errors import FrenzyInputError
    job = {"model": "gpt2", "seq_len": 128, "global_batch": 8, "train_steps": 1}
    with pytest.raises(FrenzyInputError) as e:
        plans_for_job(job, inventory, **kw)
    assert e.value.field == field


def test_a_sequence_length_given_as_a_float_or_text_is_the_same_length():
    from estimator import estimate
    dims = dict(arch="gpt", layers=4, hidden=256, heads=4, vocab=1000)
    assert estimate(model=dims, seq_len=4096).params == estimate(model=dims, seq_len=4096.0).params \
        == estimate(model=dims, seq_len="4096").params


def test_allowed_gpu_types_are_read_as_gpu_names_and_a_typo_is_refused():
    """'a100-80gb' matched no type and silently left A100-80GB out; 'Z100' was taken too."""
    job = {"model": "gpt2-tiny", "seq_len": 64, "global_batch": 8}
    inv = {"A100-80GB": 2, "A100-40GB": 2, "H100-80GB": 2}

    def kept(allowed):
        return {g for g, ps in plans_for_job({**job, "allowed_gpu_types": allowed}, inv).items() if ps}

    assert kept(["a100-80gb", "H100-80GB"]) == {"A100-80GB", "H100-80GB"}
    assert kept(["h100"]) == {"H100-80GB"}
    assert kept(["A100"]) == {"A100-40GB", "A100-80GB"}       # a family allows each of its types
    assert TrainingJob(**job, train_steps=1, allowed_gpu_types=["h100", "H100-80GB"]).allowed_gpu_types == ["H100-80GB"]
    with pytest.raises(FrenzyInputError) as err:
        plans_for_job({**job, "allowed_gpu_types": ["Z100", "H100-80GB"]}, inv)
    assert err.value.field == "allowed_gpu_types" and "Z100" in str(err.value)
    # a cluster's own type is known by its name
    from estimator.catalog import GPU
    mi = GPU(name="MI300X-192GB", memory_gib=192, bf16_tflops=1300, fp16_tflops=1300, fp32_tflops=160,
             mem_bw_gbs=5300)
    got = plans_for_job({**job, "allowed_gpu_types": ["MI300X-192GB"]}, {"MI300X-192GB": 8, "H100-80GB": 8},
                        gpus={"MI300X-192GB": mi})
    assert got["MI300X-192GB"] and not got["H100-80GB"]


def test_a_plan_filter_names_an_unknown_or_absent_gpu_and_too_deep_a_pipeline():
    job = {"model": "llama-3.2-1b", "seq_len": 2048, "global_batch": 16}
    inv = {"A100-80GB": 8, "A100-40GB": 8, "H100-80GB": 8}
    for flt, says in (("gpu=Z100", "unknown GPU type"), ("gpu=A100", "ambiguous"),
                      ("gpu=L4", "not in the inventory"), ("pp=100", "has 16")):
        with pytest.raises(FrenzyInputError) as err:
            plans_for_job(job, inv, plan_filter=flt)
        assert err.value.field == "plan" and says in str(err.value), (flt, str(err.value))
    got = plans_for_job(job, inv, plan_filter="gpu=h100")       # as --gpu reads a name
    assert got["H100-80GB"] and not got["A100-80GB"] and not got["A100-40GB"]
