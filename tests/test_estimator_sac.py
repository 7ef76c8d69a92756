"""Per-op selective activation checkpointing (torchtitan's policy, ``act_ckpt="selective"``
under the ``torchtitan`` profile): what a checkpointed block keeps, against the outputs torch's
own selective-checkpoint cache holds after a real forward of Hugging Face blocks on the CPU."""
from __future__ import annotations

import functools

import pytest

from estimator import estimate
from estimator.memory import GIB, op_sac_saved_tok
from estimator.models import ModelSpec

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _kept_per_token(model, tokens: int) -> list[float]:
    """Bytes per token each decoder block's selective-checkpoint cache holds after a forward,
    under torchtitan's policy (``tests/sac_tp_block.py``)."""
    from torch.utils.checkpoint import checkpoint

    from tests.sac_tp_block import cached_bytes, torchtitan_context

    caches: list = []
    context_fn = torchtitan_context(caches)
    for layer in model.model.layers:
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False, context_fn=context_fn)
    ids = torch.randint(0, model.config.vocab_size, (2, tokens // 2))
    model(input_ids=ids, labels=ids)
    return [cached_bytes(cache) / tokens for cache in caches]


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


@pytest.mark.parametrize("args", [["2", "--nosp"], ["4"]])
def test_a_tensor_parallel_blocks_kept_outputs_match_under_sequence_parallelism_too(args):
    """DTensor tensor parallelism on a fake process group (its own process): a row-parallel
    projection keeps its whole partial-sum output, sequence parallelism adds the two
    reduce-scatter outputs of the save list."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "tests" / "sac_tp_block.py"), *args], cwd=root,
                         capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(root), "PATH": ""})
    assert out.returncode == 0, out.stderr[-2000:]
    words = out.stdout.strip().splitlines()[-1].split()
    measured, formula = float(words[words.index("measured") + 1]), float(words[-1])
    assert measured == formula and measured > 0
