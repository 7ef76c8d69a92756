"""Phi-3 and Phi-4 (Hugging Face model type phi3) in the estimator, the planner and the trainer's
LoRA: parameters and tensor shapes as transformers builds them, config.json reading, and the
activations its fused projections save, checked against what autograd saves (saved-tensor
hooks on the installed transformers, CPU, pure bf16) beside a Llama of the same dimensions."""
from __future__ import annotations

import math

import pytest

from estimator import estimate
from estimator.errors import FrenzyInputError
from estimator.models import PRESETS, resolve_model

from .test_estimator_gemma import (B, S, assert_config_json_builds_the_spec, estimated_in_blocks,
                                   saved_in_blocks)

# microsoft/Phi-3-mini-4k-instruct (3.8B), Phi-3-medium-4k-instruct (14B), Phi-3.5-mini-instruct,
# phi-4 (14.7B): parameters as transformers counts them
PHI3_PARAMS = {"phi-3-mini": 3_821_079_552, "phi-3-medium": 13_960_238_080, "phi-3.5-mini": 3_821_079_552,
               "phi-4": 14_659_507_200, "phi-4-mini": 3_836_021_760}

TINY = {"model_type": "phi3", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "pad_token_id": None,
        "eos_token_id": 127}


@pytest.mark.parametrize("name", sorted(PHI3_PARAMS))
def test_phi3_presets_have_the_published_parameter_counts(name):
    spec = PRESETS[name]
    assert spec.params == PHI3_PARAMS[name] == sum(math.prod(s) for s in spec.weight_shapes())
    assert spec.fused_proj and spec.tied == (name == "phi-4-mini") and not spec.has_qkv_bias


@pytest.mark.parametrize("cfg", [
    TINY,
    {**TINY, "sliding_window": 8, "num_key_value_heads": 4},
    {**TINY, "tie_word_embeddings": True, "rope_theta": 250000.0, "max_position_embeddings": 512},
    {**TINY, "attention_bias": True},              # Phi-3 builds no bias whatever the key says
])
def test_a_phi3_config_json_is_the_model_transformers_builds(tmp_path, cfg):
    spec, _ = assert_config_json_builds_the_spec(tmp_path, cfg, (
        "sliding_window", "tie_word_embeddings", "num_key_value_heads", "max_position_embeddings"))
    assert spec.window == cfg.get("sliding_window")


@pytest.mark.parametrize("extra,field", [
    ({"partial_rotary_factor": 1.5}, "partial_rotary_factor"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0}},
     "partial_rotary_factor"),
    ({"resid_pdrop": 0.1}, "resid_pdrop"),
    ({"embd_pdrop": 0.1}, "embd_pdrop"),
    ({"head_dim": 32}, "head_dim"),
])
def test_phi3_configs_it_cannot_model_are_one_line_errors(extra, field):
    with pytest.raises(FrenzyInputError) as e:
        resolve_model({**TINY, **extra})
    assert e.value.field in (field, f"model.{field}")
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("cfg", [{**TINY, "partial_rotary_factor": 0.75},
                                 {**TINY, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                              "partial_rotary_factor": 0.5}}])
def test_a_partial_rotary_is_built_as_the_config_says_and_saves_what_a_whole_one_saves(tmp_path, cfg):
    """Phi-4-mini turns three quarters of each head: the rotated part is concatenated with the
    rest into a new tensor, as the whole rotary's output is made, so the blocks save the same
    bytes (pure bf16, autocast, LoRA); the model built from the spec rotates the config's share."""
    spec, built = assert_config_json_builds_the_spec(tmp_path, cfg, ("rope_parameters",))
    assert spec.rotary_fraction == built.rope_parameters["partial_rotary_factor"] < 1
    whole = {k: v for k, v in cfg.items() if k not in ("partial_rotary_factor", "rope_parameters")}
    assert saved_in_blocks(cfg) == saved_in_blocks(whole)
    assert saved_in_blocks(cfg, amp=True, seq=24) == saved_in_blocks(whole, amp=True, seq=24)
    assert (saved_in_blocks(cfg, ["qkv_proj"], first=1, adapters_16bit=True)
            == saved_in_blocks(whole, ["qkv_proj"], first=1, adapters_16bit=True))


# the Llama (or, with a window, the Mistral) of the same dimensions, and its projections
def _unfused(cfg: dict) -> dict:
    other = {k: v for k, v in cfg.items() if k not in ("pad_token_id", "eos_token_id")}
    return {**other, "model_type": "mistral" if cfg.get("sliding_window") else "llama"}


@pytest.mark.parametrize("cfg", [TINY, {**TINY, "sliding_window": 8}, {**TINY, "sliding_window": 64}],
                         ids=["global", "window-reached", "window-not-reached"])
def test_phi3_blocks_save_what_the_estimate_counts(cfg):
    """q, k and v are slices of one fused output (and gate and up of another): what their uses
    save keeps that output alive whole, as a Llama keeps its three (two) outputs; but q, rotated
    from a slice, is head-major, so SDPA's output is too and the merge before o_proj copies it
    (``memory.merged_copy``): q wide more than the Llama (the Mistral, with a window) of the
    same dimensions. A window the sequence reaches adds the sliding mask and the repeated k / v,
    as Mistral's does. The blocks save what the estimate counts, to the byte, for both."""
    pytest.importorskip("transformers")
    hooks, unfused = saved_in_blocks(cfg), saved_in_blocks(_unfused(cfg))
    assert hooks == estimated_in_blocks(cfg)
    assert unfused == estimated_in_blocks(_unfused(cfg))
    assert hooks - unfused == 2 * B * S * cfg["hidden_size"] * 2           # 2 blocks, bf16, q wide


def test_phi3_blocks_under_autocast_save_one_cast_per_fused_projection():
    """fp32 weights under autocast: the norm's fp32 output is cast to 16 bits once per projection
    that reads it (autocast caches casts of weights only), and each cast is saved: a Llama's
    q, k and v take three, its gate and up two; Phi-3's qkv_proj and gate_up_proj one each. The
    blocks save what the estimate counts, for both."""
    pytest.importorskip("transformers")
    for cfg in (TINY, _unfused(TINY)):          # 2 x 24 tokens: no weight has 48 rows
        assert (saved_in_blocks(cfg, amp=True, seq=24) == estimated_in_blocks(cfg, amp=True, seq=24)), \
            cfg["model_type"]


@pytest.mark.parametrize("fused,unfused", [
    (["qkv_proj"], ["q_proj", "k_proj", "v_proj"]),
    (["gate_up_proj", "down_proj"], ["gate_proj", "up_proj", "down_proj"]),
    (["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], ["all-linear"]),
])
def test_phi3_blocks_under_lora_save_what_the_estimate_counts(fused, unfused):
    """LoRA adapts a fused projection as one: one rank-r output where the Llama's separate
    projections save three (two), on the same input; a frozen o_proj keeps no copy of its input
    (an adapter on it does). Block 1 only (in block 0 the frozen projections' outputs need no
    gradient yet): what the blocks save is the estimate, to the byte."""
    pytest.importorskip("peft")
    for cfg, targets in ((TINY, fused), (_unfused(TINY), unfused)):
        assert (saved_in_blocks(cfg, targets, first=1, adapters_16bit=True)
                == estimated_in_blocks(cfg, targets, 1, adapters_16bit=True)), cfg["model_type"]


def test_phi3_lora_defaults_to_its_fused_attention_projection_and_peft_takes_it():
    """PEFT has no default targets for phi3 (it asks for target_modules): a job that names none
    adapts qkv_proj, in the estimate and in the trainer alike."""
    peft = pytest.importorskip("peft")
    from transformers import AutoConfig, AutoModelForCausalLM

    from estimator.memory import lora_layer_params, validate_knobs
    from trainer.modeling import peft_targets

    spec = resolve_model(TINY)
    k = validate_knobs(spec, seq_len=S, finetune="lora", lora_rank=4)
    assert k.lora_targets == ("qkv_proj",)
    targets = peft_targets(None, "phi3")
    assert targets == ["qkv_proj"] and peft_targets(None, "llama") is None
    model = peft.get_peft_model(AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)),
                                peft.LoraConfig(r=4, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable == lora_layer_params(spec, k) * spec.layers
    with pytest.raises(FrenzyInputError) as e:
        validate_knobs(spec, seq_len=S, finetune="lora", lora_targets=["q_proj"])
    assert e.value.field == "lora_targets" and "qkv_proj" in e.value.rule


def test_phi3_plans_use_no_tensor_parallel_and_the_trainer_refuses_it(tmp_path):
    """Neither tensor-parallel path shards Phi-3's fused projections: every tp plan the planner
    shows says so (none is launchable), the trainer refuses one in a line; pipeline stages and
    ZeRO plans remain."""
    from estimator.job import TrainingJob
    from estimator.plan import Plan
    from estimator.plans import not_launchable_reason, plans_for_job
    from trainer.launch_config import training_spec

    spec = PRESETS["phi-4"]
    plans = plans_for_job({"model": "phi-4", "seq_len": 4096, "global_batch": 64}, {"H100-80GB": 16})["H100-80GB"]
    assert any(p.not_launchable is None for p in plans)
    assert all(p.not_launchable for p in plans if p.tp > 1)
    assert any("phi3" in (p.not_launchable or "") for p in plans)
    tp = Plan(gpu_type="H100-80GB", gpus=8, dp=4, tp=2, micro_batch=1, grad_accum=16)
    why = not_launchable_reason(tp, spec)
    assert why is not None and why.startswith("plan.tp:") and "phi3" in why
    assert not_launchable_reason(Plan(gpu_type="H100-80GB", gpus=8, dp=4, pp=2, micro_batch=1, grad_accum=16),
                                 spec) is None
    job = TrainingJob(model=TINY, seq_len=32, global_batch=4, train_steps=2)
    with pytest.raises(FrenzyInputError) as e:
        training_spec(job, Plan(gpu_type="CPU", gpus=2, dp=1, tp=2, micro_batch=4, grad_accum=1,
                                precision="fp32"), tmp_path)
    assert e.value.field == "plan.tp"


@pytest.mark.parametrize("extra", [{}, {"partial_rotary_factor": 0.75}], ids=["phi3", "partial-rotary"])
def test_phi3_pipeline_stages_compute_the_models_logits(extra):
    """Two pipeline stages of a windowed Phi-3 chained compute the whole model's logits (the
    stages' masks and rotary are the model's own). (Launched for real on the CPU: pp=2 and dp=2
    ZeRO-2 losses equal one process's, LoRA with its default target trained: run by hand,
    docs/parallel-plans.md.)"""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.parallel.pipeline import build_stage_module

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY, **extra, sliding_window=8))
    ids = torch.randint(0, TINY["vocab_size"], (2, 32))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        staged = build_stage_module(model, 1, 2)(build_stage_module(model, 0, 2)(ids))
    assert torch.allclose(staged, whole, atol=1e-5), float((staged - whole).abs().max())


def test_a_phi3_estimate_warns_only_past_its_window():
    short = estimate(model="phi-3-mini", seq_len=2046)          # shorter than its 2,047-token window
    long = estimate(model="phi-3-mini", seq_len=4096)
    assert not any("sliding window" in w for w in short.warnings)
    assert any("sliding window" in w for w in long.warnings)
    assert estimate(model="phi-4", seq_len=4096).params == PHI3_PARAMS["phi-4"]


def test_phi3_merged_copy_where_the_kernel_allocates_its_output_like_q():
    """The CPU kernel copies in every layer; on CUDA only the 16-bit flash kernel, in layers
    handed no mask (a reached window's layers and fp32 run the memory-efficient kernel, whose
    output is token-major); never for a Llama, eager attention or Ulysses."""
    from estimator.memory import merged_copy

    phi, llama = resolve_model(TINY), PRESETS["llama-3.2-1b"]
    assert merged_copy(phi, 2.0, "flash", True, False, cuda=False, share=1.0) == 1.0
    assert merged_copy(phi, 2.0, "flash", True, False, cuda=True) == 1.0
    assert merged_copy(phi, 2.0, "flash", True, False, cuda=True, share=0.75) == 0.25
    assert merged_copy(phi, 4.0, "flash", True, False, cuda=True) == 0.0
    assert merged_copy(phi, 2.0, "eager", True, False, cuda=False) == 0.0
    assert merged_copy(phi, 2.0, "flash", True, True, cuda=False) == 0.0
    assert merged_copy(llama, 2.0, "flash", True, False, cuda=False) == 0.0


def test_phi3_largest_matrix_and_token_ids():
    """The largest weight a per-tensor temporary holds is the fused gate_up_proj (2 ffn x h); the
    model built from a preset pads with Phi-3's token 32000 only in Phi-3's own vocabulary."""
    import math

    for name in ("phi-3-mini", "phi-3-medium", "phi-4"):
        spec = PRESETS[name]
        blocks = [s for s in spec.weight_shapes() if len(s) == 2 and spec.vocab not in s]
        assert spec.largest_block_matrix == max(math.prod(s) for s in blocks)
    assert PRESETS["phi-3-medium"].largest_block_matrix == 2 * 17920 * 5120
    # and the estimate sizes them by it: Adafactor's step temporaries (12 B an element of the
    # largest tensor) are the fused gate_up_proj's, where the Llama of the same dimensions has
    # its head as the largest
    medium = PRESETS["phi-3-medium"]
    llama = {**medium.model_dump(exclude_none=True), "hf_model_type": "llama", "sliding_window": None}
    others = [estimate(model=m, seq_len=1024, optimizer="adafactor").breakdown_gib["other"] * 2**30 / 12
              for m in (medium, llama)]
    assert others == [2 * 17920 * 5120, 32064 * 5120]
    assert PRESETS["phi-3-mini"].hf_config()["pad_token_id"] == 32000
    assert PRESETS["phi-4"].hf_config()["pad_token_id"] is None
    assert PRESETS["llama-3.2-1b"].largest_block_matrix == 2048 * 8192
