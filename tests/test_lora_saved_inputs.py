"""The rule the memory estimator's LoRA terms rest on (``memory._lora_activation_delta``),
checked with autograd's saved-tensor hooks on the installed PEFT and torch, on the CPU: a
frozen projection saves no input; an adapter that copies its input (fp32 adapters cast it,
dropout makes a new tensor) saves the copy, so the input itself is saved by nothing; a
16-bit adapter without dropout saves the input itself."""
import contextlib

import pytest
import torch

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")


def saved_inputs(targets, dropout, fp32_adapters):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    # two blocks: the second's inputs require gradients (the first's adapters feed them), as in
    # every block but the first of a real model
    cfg = LlamaConfig(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128)
    m = LlamaForCausalLM(cfg)
    if not fp32_adapters:
        m = m.to(torch.bfloat16)
    m = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=targets, lora_dropout=dropout),
                            autocast_adapter_dtype=fp32_adapters)
    m.train()
    layer = m.base_model.model.model.layers[1]
    inputs = {}
    for name, mod in (("q_proj", layer.self_attn.q_proj), ("down_proj", layer.mlp.down_proj)):
        mod.register_forward_pre_hook(lambda _m, args, name=name: inputs.__setitem__(name, args[0]))
    saved = []
    ids = torch.randint(0, 128, (2, 16))
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if fp32_adapters else contextlib.nullcontext()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t), amp:
        m(input_ids=ids, labels=ids)
    ptrs = {t.untyped_storage().data_ptr() for t in saved}
    return {k: v.untyped_storage().data_ptr() in ptrs for k, v in inputs.items()}


@pytest.mark.parametrize("dropout,fp32", [(0.0, True), (0.1, True), (0.1, False)])
def test_an_adapter_that_copies_its_input_leaves_the_input_unsaved(dropout, fp32):
    assert saved_inputs(["q_proj", "v_proj", "down_proj"], dropout, fp32) == {"q_proj": False, "down_proj": False}


def test_a_16_bit_adapter_without_dropout_saves_the_input_and_a_frozen_projection_saves_none():
    assert saved_inputs(["q_proj", "v_proj"], 0.0, False) == {"q_proj": True, "down_proj": False}


def test_relu_keeps_its_output_for_a_frozen_fc2():
    """OPT's fc2 reads ReLU's output, which ReLU's backward saves itself: a LoRA job keeps that
    tensor whatever fc2's adapter does (``memory._lora_activation_delta``, opt)."""
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(0)
    cfg = OPTConfig(hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                    word_embed_proj_dim=64, max_position_embeddings=64)
    m = peft.get_peft_model(OPTForCausalLM(cfg), peft.LoraConfig(r=4, target_modules=["fc2"], lora_dropout=0.1))
    m.train()
    seen = {}
    m.base_model.model.model.decoder.layers[1].fc2.register_forward_pre_hook(
        lambda _m, args: seen.__setitem__("fc2_input", args[0]))
    saved = []
    ids = torch.randint(0, 128, (2, 16))
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        m(input_ids=ids, labels=ids)
    assert seen["fc2_input"].untyped_storage().data_ptr() in {t.untyped_storage().data_ptr() for t in saved}


@pytest.mark.parametrize("lora", [False, True])
def test_qwen3_q_norm_saves_an_fp32_upcast_and_a_normalised_copy_only_when_it_trains(lora):
    """What ``memory.layer_activation_bytes`` (and ``_lora_activation_delta``) count for Qwen3's
    per-head q/k norms, per element of q or k in bf16: the fp32 upcast (4 B) and, when the norm
    weight trains, the normalised bf16 copy the weight multiplies (2 B); plus an fp32 rstd per
    head row. Under LoRA the frozen weight needs no copy. The estimate's own q/k-norm bytes (a
    Qwen3 against the Llama of the same dimensions) are these, q's and k's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from estimator.memory import _lora_activation_delta, layer_activation_bytes, validate_knobs
    from estimator.models import resolve_model

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=128)
    m = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    if lora:
        m = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
        inner = m.base_model.model
    else:
        inner = m
    m.train()
    norm = inner.model.layers[1].self_attn.q_norm
    inside, saved = [False], {}
    norm.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
    norm.register_forward_hook(lambda *_: inside.__setitem__(0, False))

    def pack(t):
        if inside[0] and t.dim() > 1:            # the weight (1-D) is the model's, not saved bytes
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 128, (2, 16))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        m(input_ids=ids, labels=ids)
    elems, rows = 2 * 16 * 4 * 32, 2 * 16 * 4
    assert sum(saved.values()) == (4 if lora else 4 + 2) * elems + 4 * rows

    def per_token(model_type: str) -> float:        # one block's saved bytes per token, pure bf16
        spec = resolve_model(dict(model_type=model_type, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, vocab_size=128))
        total = sum(layer_activation_bytes(spec, 16, 2.0, False, "flash", "none"))
        if lora:
            k = validate_knobs(spec, seq_len=16, finetune="lora", lora_targets=["q_proj", "v_proj"], lora_dropout=0.0)
            total += sum(_lora_activation_delta(spec, k, 2.0, 1.0))
        return total

    q_share = 4 / (4 + 2)                             # q's heads of the q and k rows (4 and 2)
    assert (per_token("qwen3") - per_token("llama")) * 2 * 16 * q_share == sum(saved.values())


def test_all_linear_adapts_what_peft_adapts_and_the_estimate_counts_it():
    """``target_modules: all-linear`` (PEFT's shorthand, common in fine-tuning recipes): a job
    may write it as a string, the estimate expands it to every projection of the blocks, and the
    trainer hands PEFT the string (in a list PEFT looks for a module named so). The adapters
    PEFT makes are the ones the estimate counts."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from estimator.job import FinetuneSpec
    from estimator.memory import lora_layer_params, validate_knobs
    from estimator.models import resolve_model
    from trainer.modeling import peft_targets

    assert FinetuneSpec(method="lora", target_modules="all-linear").target_modules == ["all-linear"]
    cfg = dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, vocab_size=128)
    spec = resolve_model(cfg)
    k = validate_knobs(spec, seq_len=16, finetune="lora", lora_rank=4, lora_targets=["all-linear"])
    assert set(k.lora_targets) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    torch.manual_seed(0)
    m = peft.get_peft_model(Qwen3ForCausalLM(Qwen3Config(**{k_: v for k_, v in cfg.items() if k_ != "model_type"})),
                            peft.LoraConfig(r=4, target_modules=peft_targets(["all-linear"])))
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert trainable == spec.layers * lora_layer_params(spec, k)
