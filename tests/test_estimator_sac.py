"""Per-op selective activation checkpointing (torchtitan's policy, ``act_ckpt="selective"``
under the ``torchtitan`` profile): what a checkpointed block keeps, against the outputs torch's
own selective-checkpoint cache holds after a real forward of Hugging Face blocks on the CPU."""
from __future__ import annotations

import functools
import math
from collections import defaultdict

import pytest

from estimator import estimate
from estimator.memory import GIB, op_sac_saved_tok
from estimator.models import ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _kept_per_token(model, tokens: int) -> list[float]:
    """Bytes per token each decoder block's selective-checkpoint cache holds after a forward,
    under torchtitan's policy (its save list: mm, the attention kernels, max; every second mm
    recomputed, counted per block), the CPU attention kernel added to the list."""
    from torch.utils._pytree import tree_leaves
    from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten.max.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    caches = []

    def context_fn():
        meta = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == aten.mm.default:
                meta[f"{mode}_mm_count"] += 1
            keep = func in save and not (func == aten.mm.default and meta[f"{mode}_mm_count"] % 2 == 0)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

        fwd, recompute = create_selective_checkpoint_contexts(policy)
        caches.append(fwd)
        return fwd, recompute

    for layer in model.model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, context_fn=context_fn)
    ids = torch.randint(0, model.config.vocab_size, (2, tokens // 2))
    model(input_ids=ids, labels=ids)
    out = []
    for cache in caches:
        kept = [w.val for per_op in cache.storage.values() for entry in per_op.values()
                for w in tree_leaves(entry) if isinstance(getattr(w, "val", None), torch.Tensor)]
        out.append(sum(math.prod(t.shape) * t.element_size() for t in kept) / tokens)
    return out


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_a_blocks_kept_outputs_match_torchs_selective_checkpoint_cache(family):
    torch.manual_seed(0)
    dims = dict(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                num_hidden_layers=2, vocab_size=128, attn_implementation="sdpa")
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims))
    else:                                               # fused qkv_proj and gate_up_proj
        model = transformers.Phi3ForCausalLM(transformers.Phi3Config(**dims, pad_token_id=0))
    spec = ModelSpec(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2, ffn=176, vocab=128,
                     hf_model_type=family)
    measured = _kept_per_token(model, tokens=32)
    assert len(measured) == 2
    assert measured == [op_sac_saved_tok(spec, 4.0)] * 2          # fp32 on the CPU: to the byte


def test_torchtitans_selective_sits_between_none_and_full_by_the_kept_outputs():
    """Llama-3.1-8B at 8K tokens over FSDP on 8 GPUs (torchtitan's flagship recipe): full
    checkpointing plus 32 blocks x 8,192 tokens x the kept bytes; the attention-core meaning
    (Megatron's) saves nothing beside flash attention, which had said 'as none'."""
    kw = dict(model="llama-3.1-8b", seq_len=8192, micro_batch=1, dp=8, zero=3, framework="torchtitan",
              gpu="H100-80GB")
    none, sel, full = (estimate(**kw, act_ckpt=a).allocated_peak_gib for a in ("none", "selective", "full"))
    spec = ModelSpec(arch="llama", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256)
    assert sel - full == pytest.approx(32 * 8192 * op_sac_saved_tok(spec, 2.0) / GIB, rel=1e-9)
    assert full < sel < none and sel < 80
    hf = dict(kw, framework="hf", zero=3)
    assert estimate(**hf, act_ckpt="selective").allocated_peak_gib == pytest.approx(
        estimate(**hf, act_ckpt="none").allocated_peak_gib, rel=0.01)
