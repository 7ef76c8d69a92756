"""torchtitan's per-op selective checkpointing, measured: what a checkpointed block's
selective-checkpoint cache holds after a forward.

``torchtitan_context(caches)`` is torchtitan's policy (torchtitan/models/llama3/infra/
parallelize.py, ``_custom_policy``: its save list, every second mm recomputed, counted per
block) with the CPU attention kernel added to the list. Run as a script, one torchtitan-style
Llama block under tensor (and sequence) parallelism on a fake process group prints the bytes per
token its cache holds (this rank's shards) and ``op_sac_saved_tok``'s figure; the tests run it
in its own process (it initialises a process group):
``python tests/sac_tp_block.py TP [--nosp]``."""
from __future__ import annotations

import math
import sys
from collections import defaultdict


def torchtitan_context(caches: list):
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint`` with torchtitan's policy; each
    call appends its forward cache (whose ``storage`` holds what the block keeps) to ``caches``."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    save = {aten.mm.default, aten.max.default, aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default,
            torch.ops._c10d_functional.reduce_scatter_tensor.default}

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

    return context_fn


def cached_bytes(cache) -> int:
    """Bytes a forward cache holds (a DTensor's local shard)."""
    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_leaves

    total = 0
    for per_op in cache.storage.values():
        for entry in per_op.values():
            for w in tree_leaves(entry):
                t = getattr(w, "val", None)
                if isinstance(t, torch.Tensor):
                    t = t._local_tensor if isinstance(t, DTensor) else t
                    total += math.prod(t.shape) * t.element_size()
    return total


def main(tp: int, sp: bool) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.checkpoint import checkpoint

    from estimator.memory import op_sac_saved_tok
    from estimator.models import ModelSpec

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    mesh = init_device_mesh("cpu", (tp,))
    h, heads, ffn, seq = 64, 4, 176, 32
    hd = h // heads

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv, self.wo = (nn.Linear(h, h, bias=False) for _ in range(4))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = (w(x).view(b, n, -1, hd).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.wo(o.transpose(1, 2).contiguous().view(b, n, -1))

    class FeedForward(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.w3 = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False)
            self.w2 = nn.Linear(ffn, h, bias=False)

        def forward(self, x):
            return self.w2(F.silu(self.w1(x)) * self.w3(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.ffn_norm = nn.RMSNorm(h), nn.RMSNorm(h)
            self.attention, self.feed_forward = Attention(), FeedForward()

        def forward(self, x):
            x = x + self.attention(self.attention_norm(x))
            return x + self.feed_forward(self.ffn_norm(x))

    block = Block()
    # torchtitan's tensor-parallel plan for a block (parallelize.py, apply_tp)
    plan = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel()}
    if sp:
        replicate = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel(),
                     "attention": replicate, "feed_forward": replicate,
                     "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                     "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))})
    else:
        plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
    parallelize_module(block, mesh, plan)
    caches: list = []
    x = torch.randn(1, seq // tp if sp else seq, h, requires_grad=True)
    checkpoint(block, x, use_reentrant=False, context_fn=torchtitan_context(caches))
    spec = ModelSpec(arch="llama", layers=1, hidden=h, heads=heads, kv_heads=heads, ffn=ffn, vocab=128)
    print(f"tp {tp} sp {sp}: measured {cached_bytes(caches[0]) / seq} bytes per token, "
          f"op_sac_saved_tok {op_sac_saved_tok(spec, 4.0, tp, sp)}")


if __name__ == "__main__":
    main(int(sys.argv[1]), "--nosp" not in sys.argv)
