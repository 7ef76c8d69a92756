"""Traced estimator: run real training steps of the actual model on the CPU under
``FakeTensorMode`` (no memory is allocated) with ``MemTracker`` recording every tensor, and
report the same fields as the analytic model. torch and transformers are imported lazily.

What is traced: the Hugging Face model built from ``ModelSpec.hf_config()`` (or a user
``nn.Module`` factory), one optimizer step (states created beforehand, as after the first step), the trainer's
mixed-precision regime:

* fp32: fp32 model, AdamW as the profile runs it (``adamw_impl``: fused for Frenzy's trainer).
* AMP (bf16/fp16 with zero 0): fp32 model, forward + loss under ``torch.autocast``, fp32 grads.
* master (zero >= 1, DeepSpeed-style): 16-bit model, optimizer over fp32 master copies, fp32
  gradient copies at the step.

What stays analytic (added as documented deltas, ``analytic(job) - analytic(traced setting)``):

* distribution: the trace is one rank with dp = tp = pp = cp = 1 (ZeRO sharding, TP/PP/CP
  division, DDP/ZeRO buckets, gathered ZeRO-3 units);
* dropout: traced with dropout off, because CPU kernels save dropout masks in the input dtype
  while CUDA saves 1-byte masks, and CPU SDPA with attention dropout falls back to an fp32 math
  kernel where GPU flash kernels regenerate the mask; CUDA LayerNorm keeps fp32 statistics and
  CUDA autocast runs softmax in fp32 (CPU autocast does not): the analytic CUDA-vs-CPU
  difference is added;
* allocator and runtime overheads (reserved, device used): MemTracker sees tensors only.
"""
from __future__ import annotations

import time
import warnings
from typing import Any, Callable

from .memory import GIB, Estimate, Knobs, analytic_estimate, stage_peaks
from .models import ModelSpec
from .overheads import overheads_for


def _single(k: Knobs) -> Knobs:
    """The one-rank configuration the trace runs (same micro-batch, at most 2 micro-batches)."""
    from dataclasses import replace
    return replace(k, dp=1, tp=1, pp=1, cp=1, sp=False, vpp=1,
                   zero=0 if k.zero == 0 else 1, offload="none",
                   grad_accum=min(k.grad_accum, 2))


def _no_dropout(spec: ModelSpec) -> ModelSpec:
    if spec.dropout == 0 and spec.attn_dropout == 0:
        return spec
    return spec.model_copy(update={"dropout": 0.0, "attn_dropout": 0.0})


def trace_step(spec: ModelSpec, k: Knobs, model_factory: Callable[[], Any] | None = None,
               steps: int = 1) -> dict[str, float]:
    """Peak bytes by MemTracker category for ``k`` (single rank) on the CPU under fake tensors.
    Returns {"Parameter", "Gradient", "Optstate", "Activation", "Temp", ..., "Total"}."""
    import torch
    import torch.nn.functional as F
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    if k.dp * k.tp * k.pp * k.cp != 1:
        raise ValueError("trace_step traces one rank: dp = tp = pp = cp = 1")
    c16 = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(k.precision)
    pure = c16 is not None and k.master == "none"
    lora = k.finetune == "lora"
    amp = c16 is not None and not pure and not lora and (
        k.mp_style == "amp" or (k.mp_style == "auto" and k.zero == 0))
    master = c16 is not None and not amp and not pure and not lora
    build_dtype = c16 if (master or pure or lora) else torch.float32
    if k.optimizer not in ("adamw", "adam", "sgd", "adafactor"):
        raise NotImplementedError(f"optimizer {k.optimizer} has no fake-tensor kernels (bitsandbytes)")
    if k.framework not in ("frenzy", "hf"):
        raise NotImplementedError(f"the trace runs the HF modelling code, not {k.framework}'s")
    # MemTracker registers a gradient hook on every parameter a module runs with, which frozen
    # (adapter-base) parameters refuse: LoRA stays analytic (its terms are documented there)
    for knob, on in (("finetune " + k.finetune, k.finetune != "full"), ("loss " + k.loss, k.loss not in ("standard", "fp32-logits")),
                     ("act_offload", k.act_offload), ("fused_kernels", k.fused)):
        if on:
            raise NotImplementedError(f"{knob} is not traced (no CPU fake-tensor equivalent)")
    if k.act_ckpt == "selective" and k.attention == "eager":
        raise NotImplementedError("selective recomputation of eager attention is not a HF switch")

    def build():
        if model_factory is not None:
            return model_factory()
        import transformers
        from transformers import AutoConfig
        cfg = AutoConfig.for_model(**spec.hf_config())
        attn = "sdpa" if k.attention == "flash" else "eager"
        cls = (transformers.AutoModelForMaskedLM if spec.arch == "bert"
               else transformers.AutoModelForCausalLM)
        return cls.from_config(cfg, attn_implementation=attn)

    prev = torch.get_default_dtype()
    with FakeTensorMode(allow_non_fake_inputs=True):
        torch.set_default_dtype(build_dtype)
        try:
            model = build()
        finally:
            torch.set_default_dtype(prev)
        model.train()
        if k.act_ckpt == "full":
            if not hasattr(model, "gradient_checkpointing_enable"):
                raise NotImplementedError("the model factory's module has no gradient_checkpointing_enable")
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        params = [p for p in model.parameters() if p.requires_grad]
        if master:
            opt_params = [p.detach().float() for p in params]
        else:
            opt_params = params
        if k.optimizer in ("adamw", "adam"):
            cls = torch.optim.AdamW if k.optimizer == "adamw" else torch.optim.Adam
            if k.adamw_impl == "fused":
                opt = cls(opt_params, lr=1e-4, fused=True)
            elif k.adamw_impl == "foreach-legacy":
                opt = _legacy_foreach_adam(cls)(opt_params, lr=1e-4, foreach=True)
            else:
                opt = cls(opt_params, lr=1e-4, foreach=k.adamw_impl == "foreach")
        elif k.optimizer == "sgd":
            opt = torch.optim.SGD(opt_params, lr=1e-3, momentum=0.9, foreach=True)
        else:
            from transformers.optimization import Adafactor
            opt = Adafactor(opt_params, lr=1e-3, relative_step=False, scale_parameter=False,
                            warmup_init=False)
        # Create the optimizer states before tracking with one step on zero gradients: the
        # tracked step then sees them exactly as every step after the first does, without
        # paying for a second traced forward/backward.
        for q in opt_params:
            q.grad = torch.zeros_like(q)
        opt.step()
        for q in opt_params:
            q.grad = None
        if k.opt_in_bwd:
            # one optimizer per parameter, stepped as its gradient is accumulated, then freed
            per = {q: cls(opt.param_groups[0]["params"][:0] + [q], lr=1e-4,
                          foreach=False) for q in opt_params}
            for q, o in per.items():
                o.state[q] = opt.state[q]
                def hook(t, o=o):
                    o.step()
                    t.grad = None
                q.register_post_accumulate_grad_hook(hook)
        vocab = spec.vocab_padded
        ids = torch.randint(0, vocab, (k.micro_batch, k.seq_len))
        mt = MemTracker()
        mt.track_external(model, opt, ids, *(opt_params if master else ()))
        # transformers before 4.46 upcast in the forward (loss "fp32-logits" outside Accelerate)
        legacy = k.loss == "fp32-logits" and not k.accelerate_amp and model_factory is None
        with mt:
            for step in range(steps):
                for _ in range(k.grad_accum):
                    ctx = (torch.autocast("cpu", dtype=c16) if amp else _null())
                    with ctx:
                        if legacy:
                            out = model(input_ids=ids)
                        else:
                            out = model(input_ids=ids, labels=ids) if model_factory is None else model(ids)
                    if k.accelerate_amp and model_factory is None:
                        # Accelerate's convert_outputs_to_fp32: the loss was made inside the
                        # forward; the output's logits are replaced by an fp32 copy
                        out.logits = out.logits.float()
                        loss = out.loss
                    elif legacy:
                        # transformers before 4.46: forward upcasts the logits and returns the fp32
                        # copy (the 16-bit head output is dropped), the loss runs on a shifted copy
                        out.logits = out.logits.float()
                        v = out.logits.shape[-1]
                        loss = F.cross_entropy(out.logits[..., :-1, :].contiguous().view(-1, v),
                                               ids[..., 1:].contiguous().view(-1))
                    elif model_factory is None:
                        loss = out.loss
                    else:
                        logits = out.logits if hasattr(out, "logits") else out
                        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), ids.view(-1))
                    loss.backward()
                    del loss, out             # the output (logits) goes before the step
                    mt.reset_mod_stats()      # the global peak survives; module stats must not
                if master:
                    for p, m in zip(params, opt_params):
                        m.grad = p.grad.float()
                    opt.step()
                    with torch.no_grad():
                        for p, m in zip(params, opt_params):
                            p.copy_(m)
                            m.grad = None
                            p.grad = None
                else:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
        peak = mt.get_tracker_snapshot("peak")
    cats: dict[str, float] = {}
    for dev, by in peak.items():
        for cat, v in by.items():
            name = getattr(cat, "value", str(cat))
            cats[name] = cats.get(name, 0.0) + float(v)
    return cats


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def traced_estimate(spec: ModelSpec, k: Knobs, *, gpu: Any = None,
                    model_factory: Callable[[], Any] | None = None) -> Estimate:
    """The estimate contract, with the single-rank peak measured by a fake-tensor trace.
    Falls back to the analytic estimate with a warning when the trace cannot run."""
    ks = _single(k)
    spec0 = _no_dropout(spec)
    t0 = time.perf_counter()
    try:
        cats = trace_step(spec0, ks, model_factory)
    except Exception as err:  # noqa: BLE001 - any failure of the fake run falls back
        why = f"traced estimate fell back to analytic: {type(err).__name__}: {str(err)[:200]}"
        warnings.warn(why, UserWarning, stacklevel=3)
        est = analytic_estimate(spec, k, gpu)
        return est.model_copy(update={"warnings": [why]})
    elapsed = time.perf_counter() - t0
    traced_b = cats.get("Total", 0.0)
    # analytic deltas for what the trace does not run (see the module docstring)
    ov = overheads_for(None)
    job_peaks = stage_peaks(spec, k, ov, cpu=False)
    base_b = max(s.allocated for s in stage_peaks(spec0, ks, ov, cpu=True))
    est = analytic_estimate(spec, k, gpu)
    delta_b = max(s.allocated for s in job_peaks) - base_b
    alloc_b = max(0.0, traced_b + delta_b)
    scale = alloc_b / GIB / est.allocated_peak_gib if est.allocated_peak_gib > 0 else 1.0
    ovg = overheads_for(getattr(gpu, "name", None), is_cpu=bool(getattr(gpu, "is_cpu", False)))
    from .memory import _finish
    a, r, u = _finish(alloc_b, ovg, k)
    bd = {"weights": cats.get("Parameter", 0.0) / GIB, "gradients": cats.get("Gradient", 0.0) / GIB,
          "optimizer": cats.get("Optstate", 0.0) / GIB, "activations": cats.get("Activation", 0.0) / GIB}
    bd["other"] = a - sum(bd.values())
    stages = [s.model_copy(update={"allocated_peak_gib": s.allocated_peak_gib * scale,
                                   "reserved_peak_gib": s.reserved_peak_gib * scale,
                                   "device_used_gib": s.device_used_gib * scale})
              for s in est.stages]
    notes = [f"traced one rank in {elapsed:.1f}s; distribution, dropout and CUDA-kernel terms "
             f"added analytically ({delta_b / GIB:+.3f} GiB)"]
    mem = getattr(gpu, "memory_gib", None)
    return est.model_copy(update={
        "allocated_peak_gib": a, "reserved_peak_gib": r, "device_used_gib": u,
        "breakdown_gib": bd, "stages": stages, "method": "traced",
        "fits": (u <= mem) if mem is not None else None, "warnings": notes})


def _legacy_foreach_adam(cls):
    """``cls`` (torch Adam / AdamW) whose step runs the foreach update as PyTorch 2.0/2.1 wrote
    it: the denominator sqrt(v)/bc2 + eps is a new list of tensors (``_foreach_add``, out of
    place), so two state-sized temporaries are alive at ``_foreach_addcdiv_``."""
    import torch

    class LegacyForeach(cls):
        @torch.no_grad()
        def step(self, closure=None):
            for g in self.param_groups:
                ps = [p for p in g["params"] if p.grad is not None]
                if not ps:
                    continue
                b1, b2 = g["betas"]
                for p in ps:
                    st = self.state[p]
                    if not st:
                        st["step"] = 0
                        st["exp_avg"] = torch.zeros_like(p)
                        st["exp_avg_sq"] = torch.zeros_like(p)
                    st["step"] += 1
                m = [self.state[p]["exp_avg"] for p in ps]
                v = [self.state[p]["exp_avg_sq"] for p in ps]
                grads = [p.grad for p in ps]
                if isinstance(self, torch.optim.AdamW) and g["weight_decay"]:
                    torch._foreach_mul_(ps, 1 - g["lr"] * g["weight_decay"])
                torch._foreach_lerp_(m, grads, 1 - b1)
                torch._foreach_mul_(v, b2)
                torch._foreach_addcmul_(v, grads, grads, 1 - b2)
                n = self.state[ps[0]]["step"]
                sqrt_v = torch._foreach_sqrt(v)
                torch._foreach_div_(sqrt_v, (1 - b2 ** n) ** 0.5)
                denom = torch._foreach_add(sqrt_v, g["eps"])
                torch._foreach_addcdiv_(ps, m, denom, -g["lr"] / (1 - b1 ** n))
                del sqrt_v, denom
            return None

    return LegacyForeach
