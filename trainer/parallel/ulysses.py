"""Sequence parallel (``plan.cp``) through DeepSpeed Ulysses, set up by Accelerate.

Each rank of a sequence-parallel group (``cp`` consecutive ranks, DeepSpeed's
``parallel_state_sp`` order) is given the same micro-batch, keeps its ``seq_len / cp`` slice of
tokens, labels (shifted once over the whole sequence, so no boundary token is lost) and global
positions; Ulysses' all-to-all gives each rank all positions for ``heads / cp`` heads inside
attention. The loss is the token-weighted mean over the group, through a differentiable
all-reduce, so every rank back-propagates the loss of the whole sequence.

Trap: Ulysses is bypassed in eval mode (``disable_in_eval``), and ``from_pretrained`` returns a
model in eval mode: the slices would then attend only to themselves and the loss would be
silently wrong. ``prepare_model`` puts the model in train mode.
"""
from __future__ import annotations

from typing import Any


def accelerator_kwargs(cp: int, seq_len: int) -> dict[str, Any]:
    if cp <= 1:
        return {}
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length=seq_len, sp_seq_length_is_variable=False,
                                              sp_attn_implementation="sdpa")
    return {"parallelism_config": ParallelismConfig(sp_size=cp, sp_backend="deepspeed", sp_handler=handler)}


def prepare_model(model) -> None:
    model.train()


def group():
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as sp

    return sp.get_sequence_parallel_group(), sp.get_sequence_parallel_rank(), sp.get_sequence_parallel_world_size()


def loss(model, x, *, vocab: int):
    """The whole sequence's mean token loss, computed from this rank's slice of ``x``."""
    import torch
    import torch.distributed.nn.functional as dfn
    from transformers.loss.loss_utils import ForCausalLMLoss

    sp_group, sp_rank, cp = group()
    seq = x.shape[1]
    if seq % cp:
        raise ValueError(f"seq_len {seq} does not divide by cp {cp}")
    chunk = seq // cp
    shift = torch.nn.functional.pad(x, (0, 1), value=-100)[..., 1:]
    pos = torch.arange(seq, device=x.device).unsqueeze(0).expand_as(x)
    part = slice(sp_rank * chunk, (sp_rank + 1) * chunk)
    xl, sl, pl = x[:, part].contiguous(), shift[:, part].contiguous(), pos[:, part].contiguous()
    out = model(input_ids=xl, position_ids=pl)
    local = ForCausalLMLoss(out.logits, None, vocab, shift_labels=sl)
    tokens = (sl != -100).sum().to(local.dtype)
    total_tokens = tokens.detach().clone()
    torch.distributed.all_reduce(total_tokens, group=sp_group)
    weighted = dfn.all_reduce(local * tokens, group=sp_group)
    return weighted / total_tokens
