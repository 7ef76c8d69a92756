"""Gemma and Gemma 3 (text) in the estimator: parameters as transformers builds them, config.json
reading, and the activations their norms and sliding windows save, checked against what autograd
saves (saved-tensor hooks on the installed transformers, CPU, pure bf16)."""
from __future__ import annotations

import json
import math

import pytest

from estimator import estimate
from estimator.errors import FrenzyInputError
from estimator.models import PRESETS, resolve_model

# google/gemma-* model cards and configs: parameters as transformers counts them
GEMMA_PARAMS = {"gemma-2b": 2_506_172_416, "gemma-7b": 8_537_680_896, "gemma-2-2b": 2_614_341_888,
                "gemma-2-9b": 9_241_705_984, "gemma-2-27b": 27_227_128_320,
                "gemma-3-270m": 268_098_176, "gemma-3-1b": 999_885_952}

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 128}
B, S = 2, 16


@pytest.mark.parametrize("name", sorted(GEMMA_PARAMS))
def test_gemma_presets_have_the_published_parameter_counts(name):
    spec = PRESETS[name]
    assert spec.params == GEMMA_PARAMS[name]
    assert spec.tied and spec.d_head == (128 if name == "gemma-2-27b" else 256) and spec.gemma_norms
    assert spec.params == sum(math.prod(s) for s in spec.weight_shapes())


def test_gemma3_presets_alternate_five_windowed_layers_with_one_global():
    spec = PRESETS["gemma-3-1b"]
    assert (spec.window, spec.window_pattern, spec.windowed_layers()) == (512, 6, 22)   # 26 layers, 4 global
    assert spec.windowed_layers(0, 6) == 5 and spec.windowed_layers(6, 13) == 6
    assert spec.window_share(511) == 0.0 and spec.window_share(4096) == pytest.approx(22 / 26)
    # pipeline chunks (7, 7, 6, 6 layers, one global each): the largest chunk's share, so no
    # stage is charged less than it holds;
    # full checkpointing's one live block: a windowed one
    assert spec.window_share(4096, chunks=4) == 6 / 7 and spec.window_share(4096, whole_layer=True) == 1.0


def test_a_pipeline_stage_is_charged_the_windowed_layers_it_holds():
    """Four layers on four stages: stage 0 holds the same windowed layer 0 whether the model's
    other layers are windowed or global, so its peak is the same."""
    kw = dict(arch="llama", layers=4, hidden=1024, heads=8, kv_heads=1, ffn=2048, vocab=1000,
              hf_model_type="gemma3_text", sliding_window=512)
    peaks = [estimate(model=dict(kw, window_pattern=p), seq_len=8192, pp=4, grad_accum=4).stages[0].allocated_peak_gib
             for p in (2, 5)]
    assert peaks[0] == peaks[1]


def test_a_gemma3_whose_layers_are_all_global_has_no_window_to_reach():
    cfg = {"model_type": "gemma3_text", **TINY, "sliding_window": 8, "layer_types": ["full_attention"] * 2}
    spec = resolve_model(cfg)
    assert spec.windowed_layers() == 0 and not spec.window_reached(64)
    e = estimate(model=cfg, seq_len=64, cp=2)           # Ulysses drops no mask: not refused
    assert not any("sliding window" in w for w in e.warnings)


def test_an_arch_beside_a_gemma3_preset_builds_its_own_model():
    from estimator.models import model_from_kwargs

    spec = model_from_kwargs("gemma-3-1b", arch="gpt")
    assert spec.model_type == "gpt2" and spec.window_pattern is None


def test_compiled_norms_under_lora_take_off_no_copy_they_never_had():
    """The fused (compiled) norm inventory keeps no normalised copy, so LoRA has none to take
    off: a block's replicated bytes stay those of the norms' inputs, rstd and outputs."""
    from estimator.memory import _lora_activation_delta, layer_activation_bytes, validate_knobs

    for name in ("gemma-3-1b", "gemma-2b", "llama-3.2-1b"):
        spec = resolve_model(name)
        k = validate_knobs(spec, seq_len=2048, finetune="lora", lora_targets=["q_proj", "v_proj"],
                           fused_kernels=True, framework="deepspeed")
        rep, _ = layer_activation_bytes(spec, 2048, 2.0, False, "flash", "none", compiled=True)
        d_rep, _ = _lora_activation_delta(spec, k, 2.0, 1.0, compiled=True)
        assert rep + d_rep > 0


def assert_config_json_builds_the_spec(tmp_path, cfg: dict, keys: tuple[str, ...]):
    """``cfg`` written as a config.json and read by the estimator: the model transformers builds
    from ``cfg`` has the spec's parameters and tensor shapes, and the config the spec writes
    (``hf_config``) agrees with ``cfg``'s on ``keys``. Returns (spec, transformers' config)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    built = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(built)
    assert sum(p.numel() for p in model.parameters()) == spec.params
    assert sorted(tuple(p.shape) for p in model.parameters()) == sorted(spec.weight_shapes())
    ours = transformers.AutoConfig.for_model(**spec.hf_config())
    for key in keys:
        assert getattr(ours, key, None) == getattr(built, key, None), key
    return spec, built


@pytest.mark.parametrize("cfg", [
    {"model_type": "gemma", **TINY},
    {"model_type": "gemma2", **TINY, "num_hidden_layers": 3},
    {"model_type": "gemma2", **TINY, "query_pre_attn_scalar": 24, "final_logit_softcapping": None,
     "attn_logit_softcapping": 20.0},
    {"model_type": "gemma3_text", **TINY, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    {"model_type": "gemma3_text", **TINY, "num_hidden_layers": 7, "sliding_window_pattern": 3},
    {"model_type": "gemma3_text", **TINY, "num_hidden_layers": 7},          # the default pattern, 6
    # the attention scale and both rotary bases, in either spelling
    {"model_type": "gemma3_text", **TINY, "query_pre_attn_scalar": 24, "rope_theta": 5e5, "rope_local_base_freq": 2e4},
    {"model_type": "gemma3_text", **TINY, "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                                                             "sliding_attention": {"rope_type": "default", "rope_theta": 2e4}}},
])
def test_a_gemma_config_json_is_the_model_transformers_builds(tmp_path, cfg):
    spec, built = assert_config_json_builds_the_spec(tmp_path, cfg, (
        "layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters", "head_dim",
        "tie_word_embeddings", "attn_logit_softcapping", "final_logit_softcapping"))
    if cfg["model_type"] != "gemma":
        assert spec.windowed_layers() == built.layer_types.count("sliding_attention")


@pytest.mark.parametrize("extra,field", [
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),     # no Gemma 3 layout
    ({"sliding_window": None}, "sliding_window"),
    ({"num_attention_heads": 6}, "heads"),        # Gemma3TextConfig wants hidden % heads == 0
    ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),                # not one per layer
    ({"sliding_window_pattern": None}, "sliding_window_pattern"),
])
def test_gemma3_configs_it_cannot_model_are_one_line_errors(extra, field):
    with pytest.raises(FrenzyInputError) as e:
        resolve_model({"model_type": "gemma3_text", **TINY, **extra})
    assert e.value.field in (field, f"model.{field}")
    assert "\n" not in str(e.value)


def saved_in_blocks(cfg: dict, targets: list[str] | None = None, first: int = 0, attn: str = "sdpa",
                    adapters_16bit: bool = False, amp: bool = False, seq: int = S) -> int:
    """Bytes autograd saves inside the decoder blocks ``first..`` of a pure-bf16 model (``amp``:
    fp32 weights under CPU autocast to bf16) on ``B`` rows of ``seq`` tokens: every saved storage
    of a batch's tensor once (leading dimension ``B``, or ``B x seq`` for the ``(tokens,
    features)`` view a linear layer saves of its input), so not the weights, their autocast
    copies (pick a ``seq`` whose ``B x seq`` no weight dimension equals) nor the per-sequence
    rotary tables (batch 1). With LoRA adapters (rank 4, no
    dropout; PEFT's fp32 adapters unless ``adapters_16bit``, as the trainer makes them for a
    pure-bf16 job) on ``targets`` when given."""
    import contextlib

    import peft
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.modeling import peft_targets

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg, attn_implementation=attn))
    if not amp:
        m = m.to(torch.bfloat16)
    if targets:
        m = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=peft_targets(targets)),
                                autocast_adapter_dtype=not adapters_16bit)
    m.train()
    inner = m.base_model.model if targets else m
    inside, saved = [False], {}
    for layer in inner.model.layers[first:]:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    weights = {p.untyped_storage().data_ptr() for p in m.parameters()}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if inside[0] and t.dim() > 1 and t.shape[0] in (B, B * seq) and ptr not in weights:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, cfg["vocab_size"], (B, seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if amp else contextlib.nullcontext()
    with autocast, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(input_ids=ids, labels=ids)
    return sum(saved.values())


def estimated_in_blocks(cfg: dict, targets: list[str] | None = None, blocks: int = 2, attention: str = "flash",
                        amp: bool = False, seq: int = S, adapters_16bit: bool = False) -> float:
    """The estimate's bytes for ``blocks`` of the model's blocks: the tensors ``saved_in_blocks``
    counts with the same arguments, with the CPU kernels' semantics (what the hooks run)."""
    from estimator.memory import (_cpu_sem, _lora_activation_delta, layer_activation_bytes, merged_copy,
                                  validate_knobs, window_mask_bytes)

    spec = resolve_model(cfg)
    per_token = (sum(layer_activation_bytes(spec, seq, 2.0, amp, attention, "none", _cpu_sem(2.0)))
                 + window_mask_bytes(spec, seq, 2.0, attention, "none", True, cuda=False))
    if targets:
        # rank 4 as the hooks' adapters; 16-bit ones (a pure-bf16 job's) copy no input
        k = validate_knobs(spec, seq_len=seq, finetune="lora", lora_targets=targets, lora_dropout=0.0,
                           lora_rank=4, **({"master_weights": "none"} if adapters_16bit else {}))
        assert k.accelerate_amp != adapters_16bit
        merged = merged_copy(spec, 2.0, attention, True, False, cuda=False)
        per_token += sum(_lora_activation_delta(spec, k, 2.0, 1.0, merged=merged))
    return per_token * B * seq * blocks


@pytest.mark.parametrize("cfg", [
    {"model_type": "gemma", **TINY},
    # layer 0 attends through a window the sequence reaches (mask, k / v repeated), layer 1 globally
    {"model_type": "gemma3_text", **TINY, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    {"model_type": "gemma3_text", **TINY, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
])
def test_gemma_blocks_save_what_the_estimate_counts(cfg):
    """Gemma's norms scale in fp32 before the cast (an fp32 normalised copy where Llama keeps a
    16-bit one); Gemma 3 adds post-sublayer norms, per-head q/k norms of the same kind, and a
    sliding window on its local layers only. Against the Llama of the same dimensions, the
    blocks save exactly the bytes the estimate adds."""
    pytest.importorskip("transformers")
    llama = {**TINY, "model_type": "llama"}
    hooks = saved_in_blocks(cfg) - saved_in_blocks(llama)
    assert hooks > 0
    assert estimated_in_blocks(cfg) - estimated_in_blocks(llama) == hooks


@pytest.mark.parametrize("cfg", [
    # Gemma 2 attends eager: its soft-capped scores keep tanh's output too; every other layer
    # windowed (eager masks are added, not saved)
    {"model_type": "gemma2", **TINY, "sliding_window": 8},
    {"model_type": "gemma2", **TINY, "sliding_window": 8, "attn_logit_softcapping": None},
    {"model_type": "gemma3_text", **TINY, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
])
def test_gemma_blocks_under_eager_attention_save_what_the_estimate_counts(cfg):
    pytest.importorskip("transformers")
    llama = {**TINY, "model_type": "llama"}
    hooks = saved_in_blocks(cfg, attn="eager") - saved_in_blocks(llama, attn="eager")
    assert (estimated_in_blocks(cfg, attention="eager") - estimated_in_blocks(llama, attention="eager")
            == hooks)


@pytest.mark.parametrize("model_type", ["gemma", "gemma3_text"])
def test_gemma_blocks_under_lora_save_what_the_estimate_counts(model_type):
    """Under LoRA the frozen norm weights keep no fp32 normalised copy. Block 1 only: in block 0
    the frozen k projection's output needs no gradient yet, so its k norm saves nothing (the
    estimate counts every block as a later one, a few bytes over)."""
    pytest.importorskip("peft")
    cfg = {"model_type": model_type, **TINY, "sliding_window": 64}
    cfg.pop("sliding_window") if model_type == "gemma" else None
    llama = {**TINY, "model_type": "llama"}
    qv = ["q_proj", "v_proj"]
    hooks = saved_in_blocks(cfg, qv, first=1) - saved_in_blocks(llama, qv, first=1)
    assert estimated_in_blocks(cfg, qv, 1) - estimated_in_blocks(llama, qv, 1) == hooks


def test_a_gemma3_estimate_charges_masks_to_its_windowed_layers_only():
    """At a sequence past the window, the SDPA mask and the repeated k / v are charged to the
    windowed share of the layers: a model whose every layer is windowed (pattern above the
    layer count) holds more than the same model with every other layer global."""
    kw = dict(arch="llama", layers=4, hidden=256, heads=4, kv_heads=1, ffn=512, vocab=1000,
              hf_model_type="gemma3_text", sliding_window=512)
    every = estimate(model=dict(kw, window_pattern=5), seq_len=4096)
    half = estimate(model=dict(kw, window_pattern=2), seq_len=4096)
    short = estimate(model=dict(kw, window_pattern=2), seq_len=256)
    assert every.allocated_peak_gib > half.allocated_peak_gib
    assert any("sliding window" in w for w in half.warnings)
    assert not any("sliding window" in w for w in short.warnings)


def _real_peak_bytes(cfg: dict, seq: int) -> int:
    """The most bytes a real CPU training step (autocast bf16, the Hugging Face loss) holds at
    once in tensors it creates, storage by storage (a dispatch mode sees every new storage; a
    finaliser sees it freed)."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg, attn_implementation="eager"))
    m.train()
    live, now, peak = set(), [0], [0]

    def track(t):
        st = t.untyped_storage()
        key, n = st.data_ptr(), st.nbytes()
        if key in live or n == 0:
            return
        live.add(key)
        now[0] += n
        peak[0] = max(peak[0], now[0])

        def freed(k=key, n=n):
            live.discard(k)
            now[0] -= n
        weakref.finalize(st, freed)

    class Storages(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for o in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(o, torch.Tensor):
                    track(o)
            return out

    ids = torch.randint(0, cfg["vocab_size"], (1, seq))
    with Storages():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
    return peak[0]


def test_gemma2_logit_softcap_keeps_one_more_16bit_copy_per_logit():
    """Gemma 2's tanh(logits / 30) x 30 before the loss: tanh keeps its output through the
    backward. A real step's peak (the loss backward's, a vocabulary-heavy model) rises by 2 B
    per logit with the cap, and so does the estimate's."""
    pytest.importorskip("transformers")
    seq, vocab = 512, 8192
    cfg = dict(model_type="gemma2", hidden_size=256, intermediate_size=512, num_hidden_layers=1,
               num_attention_heads=4, num_key_value_heads=2, head_dim=128, vocab_size=vocab, sliding_window=384,
               attn_logit_softcapping=None)
    real = _real_peak_bytes(dict(cfg, final_logit_softcapping=30.0), seq) - _real_peak_bytes(
        dict(cfg, final_logit_softcapping=None), seq)
    assert real == 2 * seq * vocab

    def est(capped):
        return estimate(model=dict(cfg, final_logit_softcapping=30.0 if capped else None), seq_len=seq,
                        attention="eager", framework="hf").allocated_peak_gib * 2 ** 30
    assert est(True) - est(False) == pytest.approx(real, rel=1e-9)


def test_gemma2_attends_eager_and_says_so():
    """Hugging Face builds Gemma 2 without SDPA (it soft-caps its scores): the planner and the
    estimate run it eager whatever the job asks; asked directly, flash is a one-line error,
    and Ulysses (SDPA) is refused."""
    from estimator.memory import validate_knobs
    from estimator.plans import plans_for_job

    e = estimate(model="gemma-2-2b", seq_len=2048)
    assert any("eager kernels" in w for w in e.warnings)
    assert estimate(model="gemma-2-2b", seq_len=2048).allocated_peak_gib == \
        estimate(model="gemma-2-2b", seq_len=2048, attention="eager").allocated_peak_gib
    plans = plans_for_job(dict(model="gemma-2-2b", seq_len=2048, global_batch=16), {"H100-80GB": 8})
    assert plans and all(p.attention == "eager" for v in plans.values() for p in v)
    for kw, field in ((dict(attention="flash"), "attention"), (dict(attention="eager", cp=2), "cp")):
        with pytest.raises(FrenzyInputError) as err:
            validate_knobs(PRESETS["gemma-2-2b"], seq_len=2048, **kw)
        assert err.value.field == field


def test_a_gemma2_plan_asking_for_flash_is_re_estimated_as_it_runs():
    """A stored or hand-made plan saying flash: memory, adapters and step time are eager's, and
    the plan says so."""
    from estimator.job import TrainingJob
    from estimator.plans import plans_for_job
    from trainer.fallback import reestimate

    j = TrainingJob(model="gemma-2-2b", seq_len=2048, global_batch=16, train_steps=1, finetune={"method": "lora"})
    p = plans_for_job(j, {"H100-80GB": 8})["H100-80GB"][0]
    q = reestimate(j, p.model_copy(update={"attention": "flash"}))
    assert q.attention == "eager" and q.step_time_s == p.step_time_s
    assert q.allocated_peak_gib == pytest.approx(p.allocated_peak_gib, abs=1e-4)


def test_gemma2_logit_cap_is_held_under_a_chunked_loss_too():
    """The model's forward caps the whole logits before a chunked loss sees them (Hugging Face
    profile): tanh's output is held as the logits are."""
    kw = dict(arch="llama", layers=1, hidden=256, heads=4, kv_heads=2, head_dim=128, ffn=512, vocab=8192,
              hf_model_type="gemma2", sliding_window=384, attn_softcap=None)

    def per_logit(loss, framework):
        a, b = (estimate(model=dict(kw, logit_softcap=cap), seq_len=512, attention="eager", loss=loss,
                         framework=framework).allocated_peak_gib for cap in (30.0, None))
        return (a - b) * 2 ** 30 / (512 * 8192)
    assert per_logit("chunked", "hf") == pytest.approx(2.0)
    assert per_logit("standard", "hf") == pytest.approx(2.0)


@pytest.mark.parametrize("value", ["50", True, float("inf"), 0, -1.0])
def test_a_soft_cap_must_be_a_positive_finite_number(value):
    with pytest.raises(FrenzyInputError) as e:
        resolve_model(dict(arch="llama", layers=2, hidden=64, heads=4, vocab=100, hf_model_type="gemma2",
                           sliding_window=64, attn_softcap=value))
    assert e.value.field.endswith("attn_softcap")


def test_an_arch_beside_a_gemma2_preset_drops_its_caps():
    from estimator.models import model_from_kwargs

    spec = model_from_kwargs("gemma-2-2b", arch="gpt")
    assert spec.model_type == "gpt2" and spec.attn_softcap is None and spec.logit_softcap is None
