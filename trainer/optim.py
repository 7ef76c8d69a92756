"""Optimizer construction and the learning-rate schedule of the training program.

Which implementation runs, per (device, plan) - ``optimizer_impl`` says it, the program reports
it in ``FRENZY_MODEL`` and the tracking records it:

================  =====================  =====================================================
optimizer         device / plan          implementation
================  =====================  =====================================================
adamw, adam       CUDA, no ZeRO          ``torch.optim.AdamW/Adam(fused=True)`` (one CUDA kernel)
adamw, adam       CUDA, ZeRO 1-3         DeepSpeed ``FusedAdam`` (multi-tensor apply); if its op
                                         cannot be built on that box, torch's fused AdamW/Adam
adamw, adam       ZeRO + offload         DeepSpeed ``DeepSpeedCPUAdam`` (SIMD, on the host)
adamw, adam       CPU (gloo)             ``torch.optim.AdamW/Adam(fused=True)`` (torch's CPU kernel)
adamw, adam, sgd  pipeline (pp), ZeRO-1  torch's ``ZeroRedundancyOptimizer`` over the no-ZeRO
                                         choice of the row (``trainer.parallel.pipeline.zero1``)
adamw, adam, sgd  pipeline, ZeRO-2/3     the no-ZeRO choice over FSDP2's sharded parameters
                                         (``trainer.parallel.pipeline.fsdp``)
sgd               any                    ``torch.optim.SGD`` (momentum 0.9, foreach)
adafactor         any                    transformers ``Adafactor`` (fixed lr, no relative step)
adamw8bit         CUDA                   bitsandbytes ``AdamW8bit``
adamw8bit-paged   CUDA                   bitsandbytes ``PagedAdamW8bit`` (its large states in
                                         CUDA unified memory, which the caching allocator
                                         does not see: ``estimator.memory.paged_state_bytes``)
================  =====================  =====================================================

None of them is torch's default (foreach) AdamW, whose step allocates temporaries as large as
the states it updates (``_foreach_sqrt`` of the second moments, ~4 bytes/param more at the step).

Weight decay applies to matrices (2-D and up) only; biases, norms and other vectors are not
decayed (the usual LLM practice, e.g. nanoGPT). Sharded (DTensor) and whole parameters go in
separate groups (``param_groups``).
"""
from __future__ import annotations

import math
from typing import Any

from .problems import InputProblem

ADAM_FAMILY = ("adamw", "adam")


def optimizer_impl(name: str, *, device_type: str, zero: int, offload: str) -> str:
    """The implementation ``make_optimizer`` picks first (pure: the table above)."""
    if name in ADAM_FAMILY:
        torch_name = "torch.optim.AdamW(fused)" if name == "adamw" else "torch.optim.Adam(fused)"
        if zero > 0 and offload != "none":
            return "deepspeed.ops.adam.DeepSpeedCPUAdam"
        if zero > 0 and device_type == "cuda":
            return "deepspeed.ops.adam.FusedAdam"
        return torch_name
    return {"sgd": "torch.optim.SGD", "adafactor": "transformers.Adafactor",
            "adamw8bit": "bitsandbytes.optim.AdamW8bit",
            "adamw8bit-paged": "bitsandbytes.optim.PagedAdamW8bit"}.get(name, name)


def param_groups(model, weight_decay: float) -> list[dict[str, Any]]:
    """Trainable parameters grouped by (decayed matrix or undecayed vector, DTensor or plain
    tensor), empty groups dropped. Tensor parallel inside pipeline stages shards some
    parameters (DTensors: q/k/v biases among them) and leaves others whole (norms), and torch's
    optimizers refuse one group that mixes the two (``got mixed torch.Tensor and DTensor``)."""
    groups: dict[tuple[bool, bool], list] = {}
    for p in model.parameters():
        if not p.requires_grad:
            continue
        # ZeRO-3 placeholders are 1-D of size 0: their real shape is ds_shape
        dims = len(getattr(p, "ds_shape", p.shape))
        groups.setdefault((dims >= 2, hasattr(p, "device_mesh")), []).append(p)
    order = [(decay, sharded) for decay in (True, False) for sharded in (True, False)]
    out = [{"params": groups[k], "weight_decay": weight_decay if k[0] else 0.0} for k in order if k in groups]
    return out or [{"params": [], "weight_decay": weight_decay}]


def make_optimizer(name: str, model, *, lr: float, optim: dict[str, Any], device_type: str,
                   zero: int, offload: str):
    """The optimizer over ``model``'s trainable parameters; returns (optimizer, implementation)."""
    import torch

    betas = tuple(optim.get("betas", (0.9, 0.95)))
    eps = float(optim.get("eps", 1e-8))
    wd = float(optim.get("weight_decay", 0.1))
    groups = param_groups(model, wd)
    impl = optimizer_impl(name, device_type=device_type, zero=zero, offload=offload)
    if name in ADAM_FAMILY:
        decoupled = name == "adamw"
        if impl.endswith("DeepSpeedCPUAdam"):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, eps=eps, adamw_mode=decoupled), impl
        if impl.endswith("FusedAdam"):
            try:
                from deepspeed.ops.adam import FusedAdam

                return FusedAdam(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=decoupled), impl
            except Exception as e:   # the op is JIT-built: no CUDA toolkit on this box
                print(f"frenzy: DeepSpeed FusedAdam unavailable ({type(e).__name__}: {str(e)[:120]}); "
                      f"using torch's fused {name}", flush=True)
                impl = "torch.optim.AdamW(fused)" if decoupled else "torch.optim.Adam(fused)"
        cls = torch.optim.AdamW if decoupled else torch.optim.Adam
        return cls(groups, lr=lr, betas=betas, eps=eps, fused=True), impl
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9), impl
    if name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=lr, scale_parameter=False, relative_step=False), impl
    if name in ("adamw8bit", "adamw8bit-paged"):
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise InputProblem(f"optimizer: {name} needs the bitsandbytes package") from None
        cls = bnb.optim.PagedAdamW8bit if name == "adamw8bit-paged" else bnb.optim.AdamW8bit
        return cls(groups, lr=lr, betas=betas, eps=eps), impl
    raise InputProblem(f"optimizer: unknown {name!r}")


def warmup_steps(schedule: dict[str, Any], steps: int) -> int:
    w = schedule.get("warmup_steps")
    return max(1, min(100, steps // 10)) if w is None else int(w)


def lr_at(step: int, base: float, steps: int, schedule: dict[str, Any] | None = None) -> float:
    """The learning rate of optimizer step ``step`` (1-based) of ``steps``: linear warm-up over
    ``warmup_steps``, then constant, or a linear or cosine decay to ``min_lr_ratio * base`` at
    the last step. A function of the step alone, so a resumed run needs no scheduler state."""
    schedule = schedule or {}
    warm = warmup_steps(schedule, steps)
    if warm and step <= warm:
        return base * step / warm
    kind = schedule.get("kind", "constant")
    if kind == "constant":
        return base
    floor = float(schedule.get("min_lr_ratio", 0.0))
    progress = min(1.0, max(0.0, (step - warm) / max(1, steps - warm)))
    if kind == "linear":
        ratio = 1.0 - (1.0 - floor) * progress
    elif kind == "cosine":
        ratio = floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise InputProblem(f"schedule.kind: unknown {kind!r}")
    return base * ratio
