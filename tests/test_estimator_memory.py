"""The analytic estimate: contract fields, every keyword's effect, bad input, calibration, and
agreement with real GPU measurements (bench/estimator_measured_h200.json)."""
import json
import os

import pytest

from estimator import Estimate, estimate
from estimator.errors import FrenzyInputError
from estimator.memory import GIB
from estimator.models import PRESETS

MEASURED = os.path.join(os.path.dirname(__file__), "..", "bench", "estimator_measured_h200.json")


def est(**kw):
    kw.setdefault("model", "llama-2-7b")
    kw.setdefault("seq_len", 2048)
    return estimate(**kw)


def test_contract_fields():
    e = est(gpu="A100-80GB")
    assert isinstance(e, Estimate)
    assert e.params == PRESETS["llama-2-7b"].params
    assert set(e.breakdown_gib) == {"weights", "gradients", "optimizer", "activations", "other"}
    assert 0 < e.allocated_peak_gib < e.reserved_peak_gib < e.device_used_gib
    assert sum(e.breakdown_gib.values()) == pytest.approx(e.allocated_peak_gib, rel=1e-9)
    assert len(e.stages) == 1 and e.stages[0].allocated_peak_gib == e.allocated_peak_gib
    assert e.gpu == "A100-80GB" and e.fits is False    # 7B with AMP AdamW needs > 100 GiB
    assert e.model_dump(mode="json")["method"] == "analytic"


def test_model_states_per_regime():
    """Phase C (optimizer step) holds exactly the documented bytes per parameter."""
    P = PRESETS["gpt2"].params
    # AMP: fp32 weights + fp32 grads + 8 B Adam states (the trainer's fused AdamW: no step temporaries)
    e = estimate(model="gpt2", seq_len=8, micro_batch=1, gpu="A100-80GB")
    assert e.breakdown_gib["weights"] * GIB == pytest.approx(4 * P)
    assert e.breakdown_gib["optimizer"] * GIB == pytest.approx(8 * P)
    # master (ZeRO-1 on 1 rank): 2 B weights, 2 B grads, 4 B master + 8 B states + 4 B fp32 grads
    e = estimate(model="gpt2", seq_len=8, zero=1)
    assert e.breakdown_gib["weights"] * GIB == pytest.approx(2 * P)


def test_zero_stages_shrink_memory():
    vals = [est(dp=8, zero=z, micro_batch=1).allocated_peak_gib for z in (0, 1, 2, 3)]
    assert vals[0] > vals[1] > vals[2] > vals[3]
    z3 = est(dp=8, zero=3)
    assert z3.breakdown_gib["weights"] * GIB == pytest.approx(2 * PRESETS["llama-2-7b"].params / 8)


def test_offload_moves_optimizer_off_the_gpu():
    on = est(dp=4, zero=2)
    off = est(dp=4, zero=2, offload="optimizer")
    assert off.breakdown_gib["optimizer"] == 0 and on.breakdown_gib["optimizer"] > 0
    assert est(dp=4, zero=3, offload="optimizer+params").breakdown_gib["weights"] == 0


def test_zero3_optimizer_offload_keeps_gradient_partitions_on_the_host():
    from estimator.memory import OFFLOAD_HOST_GRAD_B

    # DeepSpeed ZeRO-3 with offload_optimizer: the gradient partition buffer and the fp32
    # gradients live on the host, so the step holds the 16-bit parameter shard and no gradient
    # shard on the GPU (without offload: 2 B per parameter / dp of bf16 gradient partitions)
    P = PRESETS["llama-2-7b"].params
    for framework in ("deepspeed", "frenzy"):
        kw = dict(model="llama-2-7b", seq_len=8, micro_batch=1, dp=8, zero=3, framework=framework)
        off = estimate(offload="optimizer", **kw)
        shard = 2 * P / 8
        # (what remains is the head's gradient partition in flight in the backward)
        assert off.breakdown_gib["gradients"] * GIB < 0.05 * shard
        assert off.breakdown_gib["weights"] * GIB == pytest.approx(shard)
        # the step no longer holds a gradient shard beside the parameter shard and buffers
        assert off.allocated_peak_gib * GIB < shard + shard + off.breakdown_gib["other"] * GIB
        # the fp32 gradient partition is among the host bytes (4 B per parameter / dp)
        assert off.host_offload_gib * GIB >= OFFLOAD_HOST_GRAD_B * P / 8
        assert estimate(**kw).breakdown_gib["gradients"] * GIB >= 2 * P / 8
    # ZeRO-2 offload keeps its terms (stage_1_and_2's GPU staging of gradients is not this path)
    z2 = estimate(model="llama-2-7b", seq_len=8, dp=8, zero=2, offload="optimizer", framework="deepspeed")
    assert z2.breakdown_gib["gradients"] > 0


def test_tensor_and_sequence_parallel_divide():
    one, two = est(tp=1, zero=1, dp=2), est(tp=2, zero=1, dp=2)
    assert two.breakdown_gib["weights"] == pytest.approx(one.breakdown_gib["weights"] / 2, rel=0.01)
    no_sp, sp = est(tp=4, micro_batch=4), est(tp=4, sp=True, micro_batch=4)
    assert sp.breakdown_gib["activations"] < no_sp.breakdown_gib["activations"]


def test_context_parallel_divides_activations():
    # same ZeRO-3 sharding degree (dp * cp = 32), so only activations differ: a quarter of the
    # tokens per rank, plus the one tensor Ulysses adds per layer (the output projection's input
    # is the all-to-all's result, no longer SDPA's saved output): q-wide, 2 bytes per element
    a1 = est(micro_batch=1, seq_len=8192, zero=3, dp=32, cp=1).breakdown_gib["activations"]
    a4 = est(micro_batch=1, seq_len=8192, zero=3, dp=8, cp=4).breakdown_gib["activations"]
    layers, hidden, tokens = 32, 4096, 8192 / 4
    assert a4 - a1 / 4 == pytest.approx(layers * tokens * 2 * hidden / 2 ** 30, rel=0.01)


def test_pipeline_stages_first_to_last():
    e = est(pp=4, grad_accum=8, micro_batch=1, seq_len=4096)
    assert [s.stage for s in e.stages] == [0, 1, 2, 3]
    assert sum(s.layers for s in e.stages) == 32
    assert e.allocated_peak_gib == max(s.allocated_peak_gib for s in e.stages)
    mid = [s.allocated_peak_gib for s in e.stages[:3]]
    assert mid[0] > mid[1] > mid[2]          # 1F1B: stage i keeps p - i micro-batches
    inter = est(pp=4, vpp=2, grad_accum=8, micro_batch=1, seq_len=4096)
    assert inter.stages[0].allocated_peak_gib > e.stages[0].allocated_peak_gib
    few = est(pp=4, grad_accum=1, micro_batch=1, seq_len=4096)   # m < p: fewer in flight
    assert few.stages[0].allocated_peak_gib < e.stages[0].allocated_peak_gib


def test_checkpointing_and_attention():
    big = dict(model="llama-2-7b", seq_len=4096, micro_batch=4, zero=3, dp=8)
    none, full = estimate(**big), estimate(**big, act_ckpt="full")
    assert full.breakdown_gib["activations"] < none.breakdown_gib["activations"] / 3
    kw = dict(model="gpt2", seq_len=1024, micro_batch=8)
    eager, flash = estimate(**kw, attention="eager"), estimate(**kw)
    assert eager.allocated_peak_gib > flash.allocated_peak_gib
    sel = estimate(**kw, attention="eager", act_ckpt="selective")
    assert sel.allocated_peak_gib < eager.allocated_peak_gib
    assert sel.allocated_peak_gib == pytest.approx(
        estimate(**kw, act_ckpt="selective").allocated_peak_gib, rel=0.1)


def test_optimizers_and_precision():
    kw = dict(model="gpt2-medium", seq_len=16, micro_batch=1)
    o = {opt: estimate(**kw, optimizer=opt).breakdown_gib["optimizer"] for opt in
         ("adamw", "adam", "sgd", "adafactor", "adamw8bit")}
    assert o["adamw"] == o["adam"] > o["sgd"] > o["adamw8bit"] > o["adafactor"] > 0
    assert o["sgd"] == pytest.approx(o["adamw"] / 2)
    big = dict(model="gpt2-medium", seq_len=1024, micro_batch=4)
    fp32 = estimate(**big, precision="fp32")
    bf16 = estimate(**big, precision="bf16", zero=1)
    assert fp32.allocated_peak_gib > bf16.allocated_peak_gib


def test_large_vocab_logits_dominate_small_models():
    e = estimate(model="qwen2.5-0.5b", seq_len=4096, micro_batch=4)
    assert e.breakdown_gib["activations"] > 0.6 * e.allocated_peak_gib


def test_dimensions_instead_of_preset():
    a = estimate(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008,
                 vocab=32000, tied_embeddings=False, seq_len=2048)
    assert a.allocated_peak_gib == pytest.approx(est().allocated_peak_gib)


@pytest.mark.parametrize("kw,field", [
    (dict(tp=3), "tp"), (dict(pp=33), "pp"), (dict(sp=True), "sp"), (dict(vpp=2), "vpp"),
    (dict(zero=4), "zero"), (dict(micro_batch=-1), "micro_batch"), (dict(seq_len=0), "seq_len"),
    (dict(optimizer="adafactor", zero=1, dp=2), "zero"), (dict(offload="optimizer"), "offload"),
    (dict(offload="optimizer+params", zero=2, dp=2), "offload"), (dict(precision="int4"), "precision"),
    (dict(attention="ring"), "attention"), (dict(cp=3), "cp"), (dict(model="nope"), "model"),
    (dict(layers=0), "layers"), (dict(method="guess"), "method"), (dict(gpu="TPU-v9"), "gpu"),
])
def test_bad_input_names_the_field(kw, field):
    with pytest.raises(FrenzyInputError) as err:
        est(**kw)
    assert err.value.field.split(".")[-1] == field or err.value.field.startswith(field)
    assert "\n" not in str(err.value)


def test_learned_positions_limit_sequence():
    with pytest.raises(FrenzyInputError, match="seq_len"):
        estimate(model="gpt2", seq_len=2048)


def test_calibration_file_overrides_terms(frenzy_home):
    from estimator.overheads import write_calibration
    base = est(gpu="H100-80GB")
    write_calibration({"H100-80GB": {"cuda_context_gib": 2.0, "fragmentation": 0.0}})
    cal = est(gpu="H100-80GB")
    assert cal.reserved_peak_gib == pytest.approx(cal.allocated_peak_gib)
    assert cal.device_used_gib - cal.reserved_peak_gib == pytest.approx(
        base.device_used_gib - base.reserved_peak_gib + 2.0 - base.overheads["cuda_context_gib"])
    assert est(gpu="A100-80GB").overheads["cuda_context_gib"] == base.overheads["cuda_context_gib"]


def test_cpu_type_has_no_gpu_overheads():
    e = estimate(model="gpt2-tiny", seq_len=64, micro_batch=2, gpu="CPU")
    assert e.device_used_gib == pytest.approx(e.allocated_peak_gib)


@pytest.mark.parametrize("path", [MEASURED, MEASURED.replace(".json", "_heldout.json")])
def test_agrees_with_real_gpu_runs(path):
    """Measured on an H200 by bench/estimator_gpu_measure.py (tuning and held-out sets):
    allocated peaks never under by more than 5 %, median within 3 %, p90 within 8 %."""
    if not os.path.exists(path):
        pytest.skip("no GPU measurements in bench/")
    import statistics
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
    from estimator_accuracy import knobs_of
    data = json.load(open(path))
    errs = []
    for r in data["results"]:
        if "error" in r:
            continue
        c = r["config"]
        e = estimate(**knobs_of(c["model"], c["regime"], c["micro_batch"], c["seq_len"],
                                c["attention"], c["act_ckpt"], c["optimizer"],
                                c.get("grad_accum", 1)), gpu="H200-141GB")
        errs.append((e.allocated_peak_gib - r["allocated_gib"]) / r["allocated_gib"])
    assert len(errs) >= 20
    assert min(errs) > -0.05
    assert statistics.median(abs(x) for x in errs) < 0.03
    assert sorted(abs(x) for x in errs)[int(0.9 * (len(errs) - 1))] < 0.08


def test_fast_built_estimate_equals_a_validated_one():
    # the analytic hot path builds its result without pydantic's per-field work: the instance
    # must be the one validation would build (every field, in order, nothing extra)
    for kw in (dict(model="gpt2", seq_len=1024),
               dict(model="llama-2-70b", seq_len=4096, tp=8, pp=4, dp=2, zero=1, sp=True,
                    grad_accum=8, gpu="H100-80GB"),
               dict(model="llama-3.1-8b", seq_len=512, optimizer="adamw8bit-paged",
                    master_weights="none", framework="torchtune", gpu="H100-80GB")):
        e = estimate(**kw)
        again = Estimate.model_validate(e.model_dump())
        assert again == e and list(e.model_dump()) == list(Estimate.model_fields)
        assert e.model_fields_set == set(Estimate.model_fields)
        assert e.stages[-1].device_used_gib >= e.stages[-1].reserved_peak_gib


def test_stage_peaks_unpacks_the_stage_setup_by_its_field_names():
    """``peak_terms`` unpacks ``_stage_setup``'s record positionally (speed): its target names
    must be the record's fields in order, or terms would silently swap; and ``_peaks`` must
    unpack the batch loop's constants and each stage's terms in the order ``peak_terms`` packs
    them."""
    import ast
    import inspect

    from estimator import memory

    terms_src = ast.parse(inspect.getsource(memory.peak_terms).lstrip())
    peaks_src = ast.parse(inspect.getsource(memory._peaks).lstrip())
    targets = [n for n in ast.walk(terms_src) if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Tuple)
               and isinstance(n.value, ast.Name) and n.value.id == "setup"]
    assert len(targets) == 1
    assert tuple(elt.id for elt in targets[0].targets[0].elts) == memory._StageSetup._fields
    # the batch loop's constants: packed in peak_terms, unpacked in _peaks, in one order
    packed_c = [n.value for n in ast.walk(terms_src) if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", None) == "consts"]
    unpacked_c = [n.targets[0] for n in ast.walk(peaks_src) if isinstance(n, ast.Assign)
                  and getattr(n.value, "id", None) == "consts"]
    assert len(packed_c) == 1 and len(unpacked_c) == 1
    assert [e.id for e in packed_c[0].elts] == [e.id for e in unpacked_c[0].elts]
    # each stage's terms: appended in peak_terms (the one tuple written out; a middle stage as
    # deep as an earlier one is that stage's tuple with its own index), the loop target in
    # _peaks, in one order
    packed = [n for n in ast.walk(terms_src)
              if isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "append"
              and isinstance(n.args[0], ast.Tuple)]
    unpacked = [n for n in ast.walk(peaks_src)
                if isinstance(n, ast.For) and isinstance(n.iter, ast.Name) and n.iter.id == "stages"]
    assert len(packed) == 1 and len(unpacked) == 1
    assert [e.id for e in packed[0].args[0].elts] == [e.id for e in unpacked[0].target.elts]


def test_peak_allocated_equals_stage_peaks_at_each_batch_to_the_bit():
    """The planner's memory table asks ``peak_allocated`` for every micro-batch of a structure
    at once; it must answer what ``stage_peaks`` answers for each, exactly."""
    import random
    from dataclasses import replace

    from estimator import memory
    from estimator.models import resolve_model, with_positions
    from estimator.overheads import overheads_for

    rng = random.Random(7)
    cases = [dict(), dict(pp=4, grad_accum=8, zero=1, dp=2), dict(tp=2, act_ckpt="full"),
             dict(zero=3, dp=8, offload="optimizer+params"), dict(finetune="lora", lora_dropout=0.1),
             dict(pp=2, vpp=2, grad_accum=4, dp=2, zero=2), dict(act_offload=True, framework="torchtune"),
             dict(zero=2, dp=4, offload="optimizer", precision="fp32"), dict(cp=2, dp=2, zero=2),
             # deep pipelines, even (32 / 16, 24 / 8) and uneven (24 / 16: stages of 2 and 1
             # layers): the planner's table skips middle stages as deep as an earlier one
             dict(pp=16), dict(pp=8, tp=2, dp=2, zero=2)]
    for model in ("llama-3.1-8b", "gpt2-medium", "qwen2.5-0.5b"):
        spec = with_positions(resolve_model(model), 2048 if model != "gpt2-medium" else 1024)
        for kw in cases:
            seq = 1024 if model == "gpt2-medium" else 2048
            k = memory.validate_knobs(spec, seq_len=seq, **kw)
            per_rank = 16
            batches = tuple((mb, per_rank // mb) for mb in (1, 2, 4, 8, 16))
            for cpu in (False, True):
                ov = overheads_for(rng.choice([None, "H100-80GB"]), is_cpu=cpu)
                got = memory.peak_allocated(spec, k, ov, cpu, batches)
                want = [max(s.allocated for s in memory.stage_peaks(spec, replace(k, micro_batch=mb, grad_accum=ga),
                                                                   ov, cpu)) for mb, ga in batches]
                assert got == want, (model, kw, cpu)


def test_batch_key_tells_apart_every_accumulation_the_peaks_read():
    """The planner shares a structure's peaks across global batches by (micro-batch,
    ``batch_key``): two accumulations with one key must have the same peak, to the bit (plain
    and interleaved pipelines, one stage, ZeRO-3 offload, LoRA); and the key must not merge
    accumulations whose peaks differ (a pipeline's in-flight micro-batches)."""
    from estimator import memory
    from estimator.models import resolve_model, with_positions
    from estimator.overheads import overheads_for

    spec = with_positions(resolve_model("llama-2-7b"), 1024)
    cases = [dict(), dict(zero=2, dp=4), dict(pp=2, dp=2, zero=1), dict(pp=4, dp=2),
             dict(pp=2, vpp=2, dp=2, zero=2), dict(zero=3, dp=8, offload="optimizer"),
             dict(finetune="lora", dp=2), dict(pp=8, act_ckpt="full")]
    distinct_pp4 = set()
    for kw in cases:
        k = memory.validate_knobs(spec, seq_len=1024, **kw)
        for cpu in (False, True):
            ov = overheads_for(None, is_cpu=cpu)
            for mb in (1, 2, 4):
                gas = tuple(range(1, 17))
                peaks = memory.peak_allocated(spec, k, ov, cpu, tuple((mb, ga) for ga in gas))
                by_key: dict[int, float] = {}
                for ga, a in zip(gas, peaks):
                    assert by_key.setdefault(memory.batch_key(k, ga), a) == a, (kw, cpu, mb, ga)
                if kw == dict(pp=4, dp=2) and not cpu and mb == 2:
                    distinct_pp4 = set(peaks)
    # one micro-batch (no gradients kept between), then 2, 3 and 4+ in flight on the first of 4 stages
    assert len(distinct_pp4) == 4


def test_the_planner_s_shared_terms_read_no_batch_and_finish_key_is_all_the_limits_read():
    """The planner keeps ``peak_terms`` per structure across global batches and asks each
    allocation limit once per ``finish_key``: ``peak_terms`` and ``_peaks`` must read neither the
    knobs' micro-batch nor their accumulation (the batches come as arguments), and knobs with one
    ``finish_key`` must get the same limit and the same finish on every GPU type's overheads."""
    import ast
    import inspect
    import itertools

    from estimator import memory
    from estimator.models import resolve_model, with_positions
    from estimator.overheads import overheads_for

    for fn in (memory.peak_terms, memory._peaks):
        tree = ast.parse(inspect.getsource(fn).lstrip())
        read = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name) and n.value.id == "k"}
        assert not read & {"micro_batch", "grad_accum"}, (fn.__name__, read)

    spec = with_positions(resolve_model("llama-3.2-1b"), 2048)
    knobs = []
    for dp, tp, pp, zero, off, ck, ft, alloc in itertools.product(
            (1, 2), (1, 2), (1, 2), (0, 2, 3), ("none", "optimizer"), ("none", "full"),
            ("full", "lora"), ("default", "expandable")):
        try:
            knobs.append(memory.validate_knobs(spec, seq_len=2048, dp=dp, tp=tp, pp=pp, zero=zero,
                                               offload=off, act_ckpt=ck, finetune=ft, allocator=alloc))
        except FrenzyInputError:
            pass
    groups: dict[tuple, list] = {}
    for k in knobs:
        groups.setdefault(memory.finish_key(k), []).append(k)
    assert len(groups) > 8 and any(len(g) > 4 for g in groups.values())
    for gpu in (None, "H100-80GB", "A10-24GB", "RTX4090-24GB"):
        ov = overheads_for(gpu, is_cpu=False)
        for g in groups.values():
            assert len({memory._alloc_limit_b(70.0, ov, k) for k in g}) == 1
            assert len({memory._finish(3e10, ov, k) for k in g}) == 1


def test_a_sliding_windows_mask_is_whole_on_every_rank_also_under_sequence_parallelism():
    """Sequence parallelism shards the block's replicated activations over the tp ranks, but
    attention sees the whole sequence: SDPA's window mask (b x 1 x s x s per layer) stays whole.
    The window costs the same with sp as without (it halved before)."""
    windowed = PRESETS["mistral-7b"]
    plain = windowed.model_copy(update={"sliding_window": None, "name": "no window"})

    def cost(**kw):
        return (estimate(model=windowed, seq_len=8192, tp=2, **kw).allocated_peak_gib
                - estimate(model=plain, seq_len=8192, tp=2, **kw).allocated_peak_gib)

    assert cost(sp=True) == pytest.approx(cost(), rel=1e-9)
    assert cost() > 4.0                        # 32 layers x 8192^2 x 2 B, and k / v repeated


def test_validation_is_cached_and_bad_knobs_are_named_before_any_cache():
    """Equal arguments share one validated Knobs (validation is a pure function, cached); an
    unhashable knob is still a one-line error naming it, not a TypeError from a cache."""
    from estimator import estimate
    from estimator.errors import FrenzyInputError
    from estimator.memory import validate_knobs
    from estimator.models import PRESETS

    spec = PRESETS["qwen3-0.6b"]
    assert validate_knobs(spec, seq_len=512, zero=1, dp=2) is validate_knobs(spec, seq_len=512, zero=1, dp=2)
    with pytest.raises(FrenzyInputError) as e:
        estimate(model="qwen3-0.6b", seq_len=512, attention=["flash"])
    assert e.value.field == "attention"
