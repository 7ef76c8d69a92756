"""Implementation profiles and technique knobs of the estimator, the public-set score, and the
planner's use of them (offload plans, launchability, LoRA / pure-bf16 plans)."""
import csv
import json
import math
import os
import subprocess
import sys

import pytest

from estimator import estimate
from estimator.errors import FrenzyInputError
from estimator.memory import GIB, lora_layer_params, validate_knobs
from estimator.models import PRESETS, ModelSpec
from estimator.plans import enumerate_plans
from estimator.profiles import FRAMEWORKS

ROOT = os.path.join(os.path.dirname(__file__), "..")


def est(**kw):
    kw.setdefault("model", "llama-3.2-3b")
    kw.setdefault("seq_len", 2048)
    return estimate(**kw)


def test_every_profile_is_accepted_and_named():
    for name in FRAMEWORKS:
        e = est(framework=name)
        assert e.framework == name and e.allocated_peak_gib > 0
    with pytest.raises(FrenzyInputError) as err:
        est(framework="nemo")
    assert err.value.field == "framework"


def test_framework_labels_map_to_profiles():
    from estimator.profiles import profile_for_label
    assert profile_for_label("torchtune") == "torchtune"
    assert profile_for_label("deepspeed (HF transformers + Liger-Kernel)") == "deepspeed"
    assert profile_for_label("litgpt (Lightning Fabric)") == "lightning"
    assert profile_for_label("pytorch DDP (llm.c train_gpt2.py)") == "pytorch"
    assert profile_for_label("peft-method-comparison (plain PyTorch loop)") == "hf"
    assert profile_for_label("something else") == "hf"


def test_unexpressible_knob_names_both():
    with pytest.raises(FrenzyInputError) as err:
        est(framework="megatron", finetune="lora")
    msg = str(err.value)
    assert "lora" in msg and "megatron" in msg and "\n" not in msg
    with pytest.raises(FrenzyInputError, match="torchtune"):
        est(framework="torchtune", master_weights="fp32")
    with pytest.raises(FrenzyInputError, match="grad_accum"):
        est(optimizer_in_backward=True, grad_accum=2, framework="torchtune")
    # Frenzy's own trainer runs what its job spec can say: the techniques it has no switch
    # for are refused under its profile (the default), naming both
    for knob, kw in (("loss", dict(loss="chunked")), ("loss", dict(loss="fused-linear")),
                     ("act_offload", dict(act_offload=True)),
                     ("optimizer_in_backward", dict(optimizer_in_backward=True)),
                     ("fused_kernels", dict(fused_kernels=True))):
        with pytest.raises(FrenzyInputError) as err:
            est(**kw)
        assert err.value.field == knob and "frenzy" in str(err.value) and "\n" not in str(err.value)
        est(framework="hf", **kw)   # where it runs
    # its trainer runs bitsandbytes' paged 8-bit AdamW (trainer/optim.py): the paged states count
    # in device used, outside allocated and reserved, as under any framework that runs it
    paged = est(optimizer="adamw8bit-paged", gpu="H100-80GB")
    plain = est(optimizer="adamw8bit", gpu="H100-80GB")
    assert paged.overheads["paged_optimizer_gib"] > 0
    assert paged.device_used_gib - paged.reserved_peak_gib == pytest.approx(
        plain.device_used_gib - plain.reserved_peak_gib + paged.overheads["paged_optimizer_gib"], abs=1e-6)
    with pytest.raises(FrenzyInputError) as err:
        est(zero=3, dp=8, zero_bucket_elems=0)
    assert err.value.field == "zero_bucket_elems"
    # DeepSpeed's stage-3 reduce buffer: 5e8 16-bit elements by default, as configured
    big = est(zero=3, dp=8, framework="deepspeed").allocated_peak_gib
    small = est(zero=3, dp=8, framework="deepspeed", zero_bucket_elems=5e7).allocated_peak_gib
    assert (big - small) * GIB == pytest.approx(2 * (5e8 - 5e7), rel=0.01)


def test_pure_bf16_states_are_half_of_fp32_master():
    P = PRESETS["llama-3.2-3b"].params
    # short sequence: the optimizer step is the peak and its breakdown is the model states
    pure = est(seq_len=8, master_weights="none", adamw_impl="fused")
    assert pure.breakdown_gib["weights"] * GIB == pytest.approx(2 * P)
    assert pure.breakdown_gib["gradients"] * GIB == pytest.approx(2 * P)
    assert pure.breakdown_gib["optimizer"] * GIB == pytest.approx(4 * P)   # bf16 m and v
    amp = est(seq_len=8, adamw_impl="fused")
    assert amp.allocated_peak_gib > 1.9 * pure.allocated_peak_gib


def test_lora_trains_only_adapters():
    spec = PRESETS["llama-3.1-8b"]
    k = validate_knobs(spec, seq_len=8, finetune="lora", lora_rank=8, lora_targets=["q_proj", "v_proj"])
    # r x (in + out) per target: q 4096 -> 4096, v 4096 -> 1024
    assert lora_layer_params(spec, k) == 8 * (4096 + 4096) + 8 * (4096 + 1024)
    full = est(model="llama-3.1-8b", seq_len=512)
    lora = est(model="llama-3.1-8b", seq_len=512, finetune="lora", lora_rank=8)
    qlora = est(model="llama-3.1-8b", seq_len=512, finetune="qlora", lora_rank=8)
    assert lora.breakdown_gib["optimizer"] < 0.1 and lora.allocated_peak_gib < full.allocated_peak_gib / 4
    assert qlora.allocated_peak_gib < lora.allocated_peak_gib - 8      # 4-bit base saves ~10 GiB
    with pytest.raises(FrenzyInputError) as err:
        est(finetune="lora", lora_targets=["wq"])
    assert err.value.field == "lora_targets"


def test_loss_kernels_order():
    kw = dict(model="llama-3.1-8b", seq_len=8192, master_weights="none", framework="torchtune")
    std, chunked, fused = (est(**kw, loss=x).allocated_peak_gib
                           for x in ("standard", "chunked", "fused-linear"))
    assert std > chunked > fused
    # 8192 x 128256 logits: chunking keeps ~3.75 instead of 12 bytes per logit, and the
    # head's 16-bit gradient (128256 x 4096) already exists during the chunked loss backward
    assert std - chunked == pytest.approx(
        (8192 * 128256 * (12 - 2 - 14 / 8) - 2 * 128256 * 4096) / GIB, rel=0.02)


def test_activation_offload_and_optimizer_in_backward():
    kw = dict(seq_len=4096, micro_batch=2, framework="torchtune", act_ckpt="full", loss="chunked")
    base = est(**kw)
    inbwd = est(**kw, optimizer_in_backward=True)
    assert inbwd.allocated_peak_gib < base.allocated_peak_gib
    # the checkpointed block inputs (28 x 8192 tokens x 3072 x 2 B) leave the GPU
    off = est(**kw, optimizer_in_backward=True, act_offload=True)
    assert inbwd.allocated_peak_gib - off.allocated_peak_gib == pytest.approx(
        27 * 8192 * 3072 * 2 / GIB, rel=0.05)


def test_adamw_fused_drops_the_foreach_temporary():
    P = PRESETS["gpt2"].params
    foreach = estimate(model="gpt2", seq_len=8, adamw_impl="foreach")
    fused = estimate(model="gpt2", seq_len=8, adamw_impl="fused")
    assert (foreach.allocated_peak_gib - fused.allocated_peak_gib) * GIB == pytest.approx(4 * P, rel=1e-6)


def test_frenzy_profile_steps_adam_as_the_trainer_does():
    # the trainer (trainer/optim.py) builds torch's fused AdamW/Adam, DeepSpeed FusedAdam or
    # DeepSpeedCPUAdam, never torch's default foreach one: the frenzy profile models no step
    # temporaries, and an explicit foreach (what bench/estimator_gpu_measure.py measured) does
    from trainer.optim import optimizer_impl
    for device in ("cuda", "cpu"):
        for zero in (0, 1, 2, 3):
            for offload in ("none", "optimizer"):
                for name in ("adamw", "adam"):
                    impl = optimizer_impl(name, device_type=device, zero=zero, offload=offload)
                    assert "fused" in impl.lower() or impl.endswith("CPUAdam"), impl
    # the 8-bit ones are bitsandbytes', paged (unified-memory states) when asked
    assert optimizer_impl("adamw8bit-paged", device_type="cuda", zero=0, offload="none") == \
        "bitsandbytes.optim.PagedAdamW8bit"
    assert optimizer_impl("adamw8bit", device_type="cuda", zero=0, offload="none") == "bitsandbytes.optim.AdamW8bit"
    assert validate_knobs(PRESETS["gpt2"], seq_len=8).adamw_impl == "fused"
    P = PRESETS["gpt2"].params
    default = estimate(model="gpt2", seq_len=8)
    assert default.allocated_peak_gib == estimate(model="gpt2", seq_len=8, adamw_impl="fused").allocated_peak_gib
    foreach = estimate(model="gpt2", seq_len=8, adamw_impl="foreach")
    assert (foreach.allocated_peak_gib - default.allocated_peak_gib) * GIB == pytest.approx(4 * P, rel=1e-6)


def test_paged_8bit_states_are_outside_the_allocator():
    kw = dict(model="llama-3.1-8b", seq_len=512, master_weights="none", framework="torchtune")
    plain = est(**kw, optimizer="adamw8bit", gpu="H100-80GB")
    paged = est(**kw, optimizer="adamw8bit-paged", gpu="H100-80GB")
    gap = paged.overheads["paged_optimizer_gib"]
    assert gap > 10 and any("unified memory" in w for w in paged.warnings)
    assert paged.allocated_peak_gib < plain.allocated_peak_gib - 10
    assert paged.device_used_gib - paged.reserved_peak_gib > gap


def test_bitsandbytes_8bit_states_per_tensor():
    # bitsandbytes 0.44+ (Optimizer2State.init_state): two fp32 states below 4096 elements,
    # else two uint8 states + one fp32 absmax per 256 values each; the paged variant moves the
    # uint8 states of tensors of 1e5+ elements to unified memory, never the absmax arrays
    spec = PRESETS["llama-3.2-3b"]
    numels = [math.prod(s) for s in spec.weight_shapes()]
    plain_b = sum(8 * n if n < 4096 else 2 * n + 8 * math.ceil(n / 256) for n in numels)
    paged_b = sum(8 * n if n < 4096 else (8 * math.ceil(n / 256) if n >= 1e5 else
                                          2 * n + 8 * math.ceil(n / 256)) for n in numels)
    unified_b = sum(2 * n for n in numels if n >= 1e5)
    kw = dict(model="llama-3.2-3b", seq_len=512, framework="torchtune", master_weights="none")
    plain = est(**kw, optimizer="adamw8bit")
    paged = est(**kw, optimizer="adamw8bit-paged", gpu="H100-80GB")
    assert plain.breakdown_gib["optimizer"] * GIB == pytest.approx(plain_b, rel=1e-9)
    assert paged.breakdown_gib["optimizer"] * GIB == pytest.approx(paged_b, rel=1e-9)
    assert paged.overheads["paged_optimizer_gib"] * GIB == pytest.approx(unified_b, rel=1e-9)



def test_paged_8bit_lora_states_split_by_adapter_size():
    # under LoRA the optimizer steps the adapters only, and bitsandbytes' per-tensor rules apply
    # to them: A (r x in) and B (out x r) below 4096 elements keep fp32 states, those between
    # 4096 and 1e5 keep uint8 states on the device, larger ones page their uint8 states out
    spec = PRESETS["llama-3.1-8b"]
    h, f, kv = spec.hidden, spec.f, spec.n_kv * spec.d_head
    proj = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
            "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
    kw = dict(model="llama-3.1-8b", seq_len=512, framework="torchtune", finetune="lora",
              lora_targets=list(proj), optimizer="adamw8bit-paged", gpu="H100-80GB")
    kinds = set()
    for r in (1, 16):
        numels = [r * d for dims in proj.values() for d in dims] * spec.layers
        kinds |= {(n >= 4096) + (n >= 1e5) for n in numels}
        alloc_b = sum(8 * n if n < 4096 else
                      8 * math.ceil(n / 256) + (2 * n if n < 1e5 else 0) for n in numels)
        unified_b = sum(2 * n for n in numels if n >= 1e5)
        e = est(**kw, lora_rank=r)
        assert e.breakdown_gib["optimizer"] * GIB == pytest.approx(alloc_b, rel=1e-9)
        assert e.overheads.get("paged_optimizer_gib", 0.0) * GIB == pytest.approx(unified_b, rel=1e-9)
    assert kinds == {0, 1, 2}                     # every size class is exercised
    # Adafactor's factored states follow the adapters' shapes too: fp32 rows + columns of each
    factored_b = [4 * (16 + d) for dims in proj.values() for d in dims] * spec.layers
    ada = est(**dict(kw, optimizer="adafactor", gpu=None), lora_rank=16)
    assert ada.breakdown_gib["optimizer"] * GIB == pytest.approx(sum(factored_b), rel=1e-9)


def test_encoder_without_vocabulary_and_uncapped_positions():
    vit = estimate(arch="bert", layers=32, hidden=1280, heads=16, ffn=5120, vocab=0, seq_len=257,
                   micro_batch=8)
    assert vit.params == pytest.approx(32 * (12 * 1280 ** 2 + 13 * 1280) + 257 * 1280 + 2 * 1280)
    # a decoder predicts tokens: no vocabulary is an encoder's option only (one line, the field)
    for arch in ("gpt", "llama", "opt"):
        with pytest.raises(FrenzyInputError) as err:
            estimate(arch=arch, layers=2, hidden=64, heads=4, ffn=128, vocab=0, seq_len=64)
        assert err.value.field == "vocab" and arch in str(err.value) and "\n" not in str(err.value)
    # a model given by its dimensions does not cap positions; a preset's table does
    long = estimate(arch="gpt", layers=4, hidden=256, heads=4, vocab=1000, seq_len=8192)
    assert long.params > estimate(arch="gpt", layers=4, hidden=256, heads=4, vocab=1000,
                                  seq_len=1024).params
    with pytest.raises(FrenzyInputError, match="position table"):
        estimate(model="gpt2", seq_len=2048)


def test_out_of_coverage_warns():
    e = est(model="llama-3.1-8b", seq_len=1_000_000, act_ckpt="full", dp=8, zero=3)
    assert any("beyond any measured source" in w for w in e.warnings)
    assert not est().warnings


def test_cross_attention_counts_nn_transformer_exactly():
    spec = ModelSpec(arch="bert", layers=64, hidden=1024, heads=64, ffn=4096, vocab=33278,
                     tied_embeddings=False, cross_attn_layers=32, max_positions=35)
    assert spec.cross_attn_params() == 32 * (4 * 1024 ** 2 + 6 * 1024)


def test_public_set_score():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import estimator_public as ep
    if not os.path.isfile(ep.DEFAULT_CSV):
        pytest.skip("public data set not present")
    rows, summary = ep.score(ep.DEFAULT_CSV)
    assert set(summary) == {"rows", "expressible", "median_abs_err", "p90_abs_err", "worst_under"}
    assert summary["rows"] == 35 and summary["expressible"] >= 33
    # the targets this set meets (reached: 2.4% and 7.5%); the worst under-prediction
    # (the ZeRO-3 + CPU-offload 8K row, -26%) is not met, see docs/benchmarks.md
    assert summary["median_abs_err"] <= 0.03 and summary["p90_abs_err"] <= 0.08
    _, before = ep.score(ep.DEFAULT_CSV, columns_only=True)
    assert before["median_abs_err"] > 5 * summary["median_abs_err"]


def _public_scorer():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import estimator_public as ep
    if not os.path.isfile(ep.DEFAULT_CSV):
        pytest.skip("public data set not present")
    return ep


def test_another_csv_gets_no_shipped_rows_hand_read_settings(tmp_path):
    """The settings read by hand from a shipped row's source apply to that run only: another CSV
    numbered alike gets its settings from its own framework label and notes."""
    ep = _public_scorer()
    with open(ep.DEFAULT_CSV, newline="", encoding="utf-8") as fh:
        shipped = list(csv.DictReader(fh))
    header = list(shipped[0])
    # shipped row 10 (torchtune LoRA r8 on q/v) under another model name: not that run
    other = {**shipped[9], "model": "someone-else/Llama-3.1-8B", "notes": "plain run", "framework": "torchtune"}
    same = dict(shipped[9])
    path = tmp_path / "other.csv"
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, header)
        w.writeheader()
        w.writerows([same, other])
    rows, _ = ep.score(str(path))
    assert rows[0]["predicted"] == pytest.approx(ep.score(ep.DEFAULT_CSV)[0][9]["predicted"])
    assert rows[0]["caveat"].startswith("metric not named")               # its caveat, read by hand
    assert rows[1]["caveat"] == "" and rows[1]["predicted"] != pytest.approx(rows[0]["predicted"])
    kw, said = ep.row_kwargs({k: v.strip() for k, v in other.items()})
    assert "lora_rank" not in kw and said == []                        # nothing in "plain run"
    notes = ("LoRA r=16 on q_proj, v_proj; torch.optim.AdamW(fused=True); no compile; "
             "CEWithChunkedOutputLoss; optimizer_in_bwd=False; NO Liger; pure bf16")
    kw, said = ep.row_kwargs({**{k: v.strip() for k, v in other.items()}, "notes": notes})
    assert kw["lora_rank"] == 16 and kw["lora_targets"] == ("q_proj", "v_proj")
    assert kw["adamw_impl"] == "fused" and kw["loss"] == "chunked" and kw["master_weights"] == "none"
    assert "fused_kernels" not in kw and "optimizer_in_backward" not in kw     # negated mentions
    assert "lora_rank=16" in said
    # a cumulative table: "as previous + X" keeps what the row before said (same source only)
    first = {**other, "row": "1", "notes": "pure bf16; CEWithChunkedOutputLoss"}
    second = {**other, "row": "2", "notes": "as previous + optimizer_in_bwd=True"}
    elsewhere = {**second, "row": "3", "source": "another README"}
    path = tmp_path / "cumulative.csv"
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, header)
        w.writeheader()
        w.writerows([first, second, elsewhere])
    rows, _ = ep.score(str(path))
    assert "as the row before: loss, master_weights" in rows[1]["caveat"]
    assert "optimizer_in_backward=True" in rows[1]["caveat"] and "row before" not in rows[2]["caveat"]
    assert rows[1]["predicted"] < rows[2]["predicted"]
    # a LoRA row's adapter settings are not carried into a full fine-tune "as previous"; a quoted
    # line break inside the notes stays inside its cell
    adapters = {**other, "row": "4", "finetune": "lora", "notes": "LoRA r=32\non q_proj, v_proj"}
    full_after = {**other, "row": "5", "finetune": "full", "notes": "as previous, full fine-tune"}
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, header)
        w.writeheader()
        w.writerows([adapters, full_after])
    rows, summary = ep.score(str(path))
    assert summary["rows"] == 2 and summary["expressible"] == 2, rows
    assert "lora_rank=32" in rows[0]["caveat"]
    # an encoder-decoder's decoder blocks, PyTorch 2.1's foreach Adam, FSDP NO_SHARD, a bucket size
    lightning = {**{k: v.strip() for k, v in other.items()}, "optimizer": "adam", "framework": "lightning", "notes":
                 "32 encoder + 32 decoder layers; decoder layers add cross-attention; PyTorch 2.1; "
                 "NO_SHARD; reduce_bucket_size=5e+07"}
    kw, _ = ep.row_kwargs(lightning)
    assert kw["model"]["cross_attn_layers"] == 32 and kw["adamw_impl"] == "foreach-legacy"
    assert kw["gradient_as_bucket_view"] is True and kw["zero_bucket_elems"] == 5e7
    # a framework with its own AdamW (torchtune's fused) is not torch's foreach of that version
    assert "adamw_impl" not in ep.row_kwargs({**lightning, "framework": "torchtune"})[0]
    # negations and numbers that are not what they look like
    for notes, absent in (("no cross-attention; 32 decoder layers", "cross_attn_layers"),
                          ("use_liger_kernel=False", "loss"), ('"overlap_comm": false', "overlap_comm"),
                          ("non-fused AdamW", "adamw_impl"), ("torch.compile disabled", "fused_kernels")):
        kw, _ = ep.row_kwargs({**lightning, "notes": notes})
        assert absent not in kw and absent not in kw["model"], notes
    lora = {**lightning, "finetune": "lora"}
    for notes, rank in (("rank 0 reports; LoRA r=32", 32), ("lora_r=16", 16), ("8 GPUs, rank 0 measured", None),
                        ("LoRA rank 8, alpha 16", 8), ("dropout r=0.1", None)):
        assert ep.row_kwargs({**lora, "notes": notes})[0].get("lora_rank") == rank, notes


def test_another_csvs_spellings_and_faults_are_read_or_named(tmp_path, capsys):
    ep = _public_scorer()
    with open(ep.DEFAULT_CSV, newline="", encoding="utf-8") as fh:
        shipped = list(csv.DictReader(fh))
    base = {**shipped[24], "row": "101", "model": "another Llama-3.1-8B run"}     # ZeRO-2, no Liger
    spelled = {**base, "row": "102", "precision": "BF16-mixed", "optimizer": "adamw_torch", "act_ckpt": "false",
               "attention": "sdpa", "metric": "max_memory_reserved", "zero": "ZeRO-2", "cp": "", "vpp": "",
               "sp": "", "arch": "LLaMA"}
    mistral = {**base, "row": "103", "arch": "mistral"}
    bad = [{**base, "row": "104", "measured_gib": "~7.4"}, {**base, "row": "r5", "layers": "many"},
           {**base, "row": "106", "arch": "t5"}]
    path = tmp_path / "other.csv"
    header = [h.upper() for h in shipped[0]]
    with open(path, "w", newline="", encoding="utf-8-sig") as fh:          # a BOM, upper-case names
        w = csv.writer(fh)
        w.writerow(header)
        for r in [base, spelled, mistral, *bad]:
            w.writerow([r[k] for k in shipped[0]])
    rows, summary = ep.score(str(path))
    assert summary["rows"] == 6 and summary["expressible"] == 3
    assert rows[1]["predicted"] == pytest.approx(rows[0]["predicted"])
    assert rows[2]["predicted"] is not None
    assert "measured_gib" in rows[3]["why"] and "layers" in rows[4]["why"] and "arch" in rows[5]["why"]
    missing = tmp_path / "missing.csv"
    missing.write_text("row,model\n1,x\n")
    assert ep.main(["--csv", str(missing)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing columns" in err[0]
    cp1252 = tmp_path / "excel.csv"
    cp1252.write_bytes(path.read_text(encoding="utf-8-sig").replace("another", "caf\u00e9").encode("cp1252"))
    assert ep.score(str(cp1252))[1]["expressible"] == 3
    assert ep.main(["--csv", str(path), "--json"]) == 0
    out = capsys.readouterr().out
    assert "--csv" in out and json.loads(out.strip().splitlines()[-1])["rows"] == 6


def test_cli_framework_flag_and_bad_knob():
    env = {**os.environ, "PYTHONPATH": ROOT}
    ok = subprocess.run([sys.executable, "-m", "frenzy_cli.main", "estimate", "--model", "llama-3.2-3b",
                         "--seq-len", "2048", "--framework", "torchtune", "--loss", "chunked", "--json"],
                        capture_output=True, text=True, env=env, cwd=ROOT)
    assert ok.returncode == 0 and '"framework": "torchtune"' in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "frenzy_cli.main", "estimate", "--model", "llama-3.2-3b",
                          "--framework", "megatron", "--finetune", "lora"],
                         capture_output=True, text=True, env=env, cwd=ROOT)
    assert bad.returncode == 2
    lines = [x for x in bad.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and "megatron" in lines[0] and "lora" in lines[0]
    ds = subprocess.run([sys.executable, "-m", "frenzy_cli.main", "estimate", "--model", "opt-1.3b",
                         "--seq-len", "512", "--framework", "deepspeed", "--zero", "2", "--dp", "2",
                         "--attention", "eager", "--overlap-comm", "--score-clamp", "--json"],
                        capture_output=True, text=True, env=env, cwd=ROOT)
    assert ds.returncode == 0, ds.stderr
    assert json.loads(ds.stdout)["allocated_peak_gib"] == pytest.approx(estimate(
        model="opt-1.3b", seq_len=512, framework="deepspeed", zero=2, dp=2, attention="eager",
        overlap_comm=True, score_clamp=True).allocated_peak_gib)


def test_planner_offload_launchability_and_own_plans():
    job = dict(model="llama-2-7b", seq_len=2048, global_batch=32)
    plans = enumerate_plans(job, "RTX3090-24GB", max_gpus=8)
    assert any(p.offload != "none" and p.not_launchable is None for p in plans)
    marked = [p for p in plans if p.pp > 1]           # pipeline parallel: not launched yet
    assert all(p.not_launchable for p in marked)
    first_marked = next((i for i, p in enumerate(plans) if p.not_launchable), len(plans))
    assert all(p.not_launchable for p in plans[first_marked:])     # launchable ranked first
    # LoRA and pure-bf16 jobs get their own, smaller plans
    base = dict(model="llama-3.2-3b", seq_len=2048, global_batch=8)
    full = enumerate_plans(base, "A100-80GB", max_gpus=1)
    lora = enumerate_plans({**base, "finetune": {"method": "lora", "rank": 8}}, "A100-80GB", max_gpus=1)
    pure = enumerate_plans({**base, "master_weights": "none"}, "A100-80GB", max_gpus=1)
    from estimator.plans import estimate_plan
    assert full and lora and pure
    for other in (lora, pure):
        p = other[0]
        assert estimate_plan(base, p).device_used_gib > p.device_used_gib + 1.0
    assert lora[0].micro_batch >= full[0].micro_batch


@pytest.mark.slow
def test_traced_pure_bf16_fused_and_optimizer_in_backward():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from estimator.memory import stage_peaks
    from estimator.overheads import overheads_for
    from estimator.traced import trace_step
    ov = overheads_for(None, is_cpu=True)
    spec = ModelSpec(name="t", arch="llama", layers=2, hidden=384, heads=6, kv_heads=2,
                     vocab=16384, max_positions=512)
    for s, b, kw in [(512, 2, dict(master_weights="none")),
                     (512, 2, dict(master_weights="none", act_ckpt="full")),
                     (32, 1, dict(master_weights="none", adamw_impl="foreach")),
                     (32, 1, dict(master_weights="none", adamw_impl="fused")),
                     (32, 1, dict(master_weights="none", optimizer_in_backward=True)),
                     (32, 1, dict(adamw_impl="fused"))]:
        k = validate_knobs(spec, seq_len=s, micro_batch=b, precision="bf16", framework="hf", **kw)
        traced = trace_step(spec, k)["Total"]
        analytic = max(p.allocated for p in stage_peaks(spec, k, ov, cpu=True))
        assert abs(analytic / traced - 1) <= 0.05, (kw, analytic, traced)


def test_untied_bert_head_and_cross_attention_counted_once():
    # nn.Transformer (Lightning demo): an untied output Linear is its own V x h weight, and the
    # decoder blocks' cross-attention is counted once (per block), not again in the head
    kw = dict(arch="bert", layers=64, hidden=1024, heads=64, ffn=4096, vocab=33278,
              cross_attn_layers=32, max_positions=35)
    untied, tied = ModelSpec(tied_embeddings=False, **kw), ModelSpec(tied_embeddings=True, **kw)
    assert untied.train_params - tied.train_params == 33278 * 1024
    e = estimate(model=untied.model_dump(exclude_none=True), seq_len=35, precision="fp32",
                 optimizer="adam", framework="lightning")
    # fp32 Adam at zero 0 on one GPU: weights + grads + 2 states = 16 B per parameter
    assert e.breakdown_gib["weights"] * 2 ** 30 == pytest.approx(4.0 * untied.train_params, rel=1e-9)


def test_fsdp_no_shard_and_shard_grad_op_terms():
    kw = dict(model="gpt2-medium", seq_len=64, precision="fp32", optimizer="adam", dp=2,
              framework="lightning", adamw_impl="foreach-legacy")
    ddp = estimate(**kw)
    no_shard = estimate(gradient_as_bucket_view=True, **kw)
    P = ddp.params
    # DDP's bucket copy of the gradients is one fp32 gradient copy; NO_SHARD has none
    assert (ddp.allocated_peak_gib - no_shard.allocated_peak_gib) * 2 ** 30 == pytest.approx(4.0 * P, rel=0.01)
    # SHARD_GRAD_OP: the step sees sharded weights, so it is below NO_SHARD by about the
    # shards of weights, gradients, states and temporaries
    sgo = estimate(zero=2, **kw)
    assert sgo.allocated_peak_gib < 0.6 * no_shard.allocated_peak_gib
    assert sgo.breakdown_gib["weights"] >= ddp.breakdown_gib["weights"] / 2 * 0.99


def test_fsdp2_reduce_scatter_copy_in(monkeypatch):
    # FSDP2 keeps a unit's unsharded gradients until they are copied into the reduce-scatter
    # input: with ZeRO-3 over 8 ranks the largest unit's gradient bytes appear twice
    import dataclasses
    from estimator import profiles
    kw = dict(model="llama-3.1-8b", seq_len=2048, dp=8, zero=3, act_ckpt="full",
              framework="torchtune")
    with_copy = estimate(**kw).breakdown_gib["other"]
    monkeypatch.setitem(profiles.PROFILES, "torchtune",
                        dataclasses.replace(profiles.PROFILES["torchtune"], fsdp2_copy_in=False))
    without = estimate(**kw).breakdown_gib["other"]
    largest = 128256 * 4096                                  # the embedding / output unit
    assert (with_copy - without) * GIB == pytest.approx(2.0 * largest, rel=1e-6)


def test_deepspeed_zero12_reduce_buffers_and_overlap_comm():
    # ZeRO-1/2: one reduce (ipg) buffer of reduce_bucket_size 16-bit elements through the
    # backward, a second with overlap_comm; no all-gather buffer (it writes into the flat params)
    kw = dict(model="opt-1.3b", seq_len=512, micro_batch=8, dp=16, zero=2, attention="eager",
              framework="deepspeed", precision="fp16")
    off = estimate(**kw)
    on = estimate(overlap_comm=True, **kw)
    assert (on.allocated_peak_gib - off.allocated_peak_gib) * GIB == pytest.approx(2 * 5e8, rel=1e-6)
    small = estimate(zero_bucket_elems=5e7, **kw)
    assert (off.allocated_peak_gib - small.allocated_peak_gib) * GIB == pytest.approx(2 * (5e8 - 5e7), rel=1e-6)
    # a DeepSpeed setting: refused, naming both, where the profile runs no DeepSpeed engine
    with pytest.raises(FrenzyInputError) as err:
        estimate(model="opt-1.3b", seq_len=512, zero=2, dp=2, framework="hf", overlap_comm=True)
    assert err.value.field == "overlap_comm" and "hf" in str(err.value)


def test_deepspeed_zero0_allreduce_bucket_comes_after_the_backward():
    # the zero-0 flat all-reduce buffers are made once the backward is over: at the activation
    # peak (long sequence) they add nothing; at the step (tiny sequence) they do
    kw = dict(model="opt-350m", seq_len=512, micro_batch=8, dp=16, precision="fp16",
              attention="eager", adamw_impl="fused", framework="deepspeed")
    one, many = estimate(**{**kw, "dp": 1}), estimate(**kw)
    assert many.allocated_peak_gib == pytest.approx(one.allocated_peak_gib, rel=1e-9)


def test_score_clamp_saves_the_masked_scores():
    spec = PRESETS["opt-350m"]
    kw = dict(model="opt-350m", seq_len=512, micro_batch=8, precision="fp16", attention="eager",
              framework="deepspeed", loss="none")
    plain, clamp = estimate(**kw), estimate(score_clamp=True, **kw)
    # torch.max(scores + mask, finfo.min) keeps its 16-bit input: heads x s per token per layer
    extra = spec.layers * 8 * 512 * spec.heads * 512 * 2
    assert (clamp.breakdown_gib["activations"] - plain.breakdown_gib["activations"]) * GIB == \
        pytest.approx(extra, rel=1e-6)
    with pytest.raises(FrenzyInputError) as err:
        estimate(model="opt-350m", seq_len=512, score_clamp=True)     # flash: no scores
    assert err.value.field == "score_clamp"


def test_frenzy_amp_holds_the_fp32_logits_accelerate_returns():
    """Loss "auto" under Accelerate's native AMP (zero 0, bf16, fp32 weights): the forward
    wrapper returns an fp32 copy of the logits, 2 B per logit above the model's 16-bit ones;
    runs Accelerate does not wrap (DeepSpeed ZeRO, pure bf16) and other profiles keep the
    model's own loss path."""
    kw = dict(model="llama-3.2-1b", seq_len=2048, micro_batch=4)
    logits_16bit_gib = 2 * 128256 * 4 * 2048 / 2 ** 30
    for ck in ("none", "full"):
        auto = estimate(**kw, act_ckpt=ck).allocated_peak_gib
        assert auto - estimate(**kw, act_ckpt=ck, loss="standard").allocated_peak_gib == pytest.approx(logits_16bit_gib)
    for extra in (dict(zero=2), dict(master_weights="none"), dict(framework="hf"), dict(tp=2)):
        assert (estimate(**kw, **extra).allocated_peak_gib
                == estimate(**kw, **extra, loss="standard").allocated_peak_gib), extra


def test_lora_adapter_inputs_dropout_and_fp32_adapters():
    """Per adapter input element: 16-bit adapters save nothing extra without dropout and a
    mask (1 B) plus the dropped copy (2 B) with it, and then the input they share (the
    attention norm's output, 2 B per hidden element) is saved by nothing; fp32 adapters under
    Accelerate's autocast always save autocast's 16-bit copy, dropout adds only its mask."""
    kw = dict(model="llama-3.2-1b", seq_len=2048, micro_batch=4, finetune="lora", loss="standard")
    inputs_gib = 4 * 2048 * 16 * 2 * 2048 / 2 ** 30     # tokens x blocks x (q_proj, v_proj) x hidden

    def alloc(**extra):
        return estimate(**kw, **extra).allocated_peak_gib

    norm_output_gib = 2 * inputs_gib / 2                 # 2 B; q_proj and v_proj read one tensor
    assert alloc(master_weights="none", lora_dropout=0.05) - alloc(master_weights="none") == \
        pytest.approx(3 * inputs_gib - norm_output_gib)
    assert alloc(lora_dropout=0.05) - alloc() == pytest.approx(inputs_gib)
    with pytest.raises(FrenzyInputError, match="lora_dropout"):
        estimate(**kw, lora_dropout=1.0)


def test_an_input_every_adapter_copies_is_not_counted_but_relu_keeps_its_output():
    """``_lora_activation_delta`` against the saved-tensor rule (tests/test_lora_saved_inputs.py):
    Llama's down_proj input is saved by a 16-bit adapter without dropout and by nothing once the
    adapter copies it; OPT's fc2 input is ReLU's output, which ReLU keeps either way."""
    from dataclasses import replace

    from estimator import memory
    from estimator.models import resolve_model

    def shard(model, targets, **kw):
        spec = resolve_model(model)
        k = memory.validate_knobs(spec, seq_len=512, finetune="lora", lora_targets=targets, loss="standard", **kw)
        c, mask_b = 2.0, 1.0
        base = memory._lora_activation_delta(spec, replace(k, lora_dropout=False, accelerate_amp=False), c, mask_b)
        return spec, memory._lora_activation_delta(spec, k, c, mask_b)[1], base[1]

    spec, copied, kept = shard("llama-3.2-1b", ["down_proj"], master_weights="fp32")   # fp32 adapters: a copy
    adapter_only = 2.0 * 16 + 2.0 * spec.f            # rank-r activations + the copy of the f-wide input
    assert copied == pytest.approx(adapter_only - 2.0 * spec.f)    # the input itself: saved by nothing
    assert kept == pytest.approx(2.0 * 16)                          # the adapter saves the input itself
    spec, copied, kept = shard("opt-350m", ["fc2"], lora_dropout=0.1)
    assert copied - kept == pytest.approx((2.0 + 1.0) * spec.f)     # the copy and its mask, input still kept


def test_planner_passes_the_jobs_lora_dropout():
    from estimator.job import TrainingJob
    from estimator.plan import Plan
    from estimator.plans import estimate_plan

    plan = Plan(gpu_type="H200-141GB", gpus=1, micro_batch=4, grad_accum=2)
    job = dict(name="j", model="llama-3.2-1b", seq_len=2048, global_batch=8, train_steps=1)
    with_drop = estimate_plan(TrainingJob(**job, finetune={"method": "lora", "dropout": 0.05}), plan)
    without = estimate_plan(TrainingJob(**job, finetune={"method": "lora", "dropout": 0.0}), plan)
    assert with_drop.allocated_peak_gib - without.allocated_peak_gib == pytest.approx(4 * 2048 * 16 * 2 * 2048 / 2 ** 30)


def test_settings_of_what_the_configuration_does_not_run_are_refused():
    """They were ignored without a word: adapter settings on a full fine-tune (the CLI refused
    them, the Python call did not), an AdamW implementation for SGD, a 16-bit regime in fp32,
    DeepSpeed's overlap_comm at zero 0, grouped-query attention in a GPT."""
    for kw, field in ((dict(lora_rank=64), "finetune"), (dict(lora_dropout=0.5), "finetune"),
                      (dict(lora_targets="q_proj"), "finetune"),
                      (dict(optimizer="sgd", adamw_impl="fused"), "adamw_impl"),
                      (dict(precision="fp32", mp_style="amp"), "mp_style"),
                      (dict(framework="deepspeed", zero=0, overlap_comm=True), "overlap_comm"),
                      (dict(model=None, arch="gpt", layers=2, hidden=64, heads=4, kv_heads=2, vocab=100), "kv_heads")):
        kw = {"model": "llama-3.2-1b", "seq_len": 256, **kw}
        with pytest.raises(FrenzyInputError) as err:
            estimate(**kw)
        assert err.value.field == field and "\n" not in str(err.value), kw
    # where they apply they still count
    assert estimate(model="llama-3.2-1b", seq_len=256, finetune="lora", lora_rank=64).params > 0
    estimate(model="llama-3.2-1b", seq_len=256, framework="deepspeed", zero=2, dp=2, overlap_comm=True)
    # a preset moved to an arch without GQA leaves its KV-head count behind
    assert estimate(model="qwen2.5-0.5b", arch="gpt", seq_len=256).params > 0
