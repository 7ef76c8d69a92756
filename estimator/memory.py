"""Analytic per-GPU training memory: the `estimate` contract and its model.

Peak allocated bytes = max over four phases of one training step, per pipeline stage:

  A  loss backward:   states + saved activations + logits/loss buffers (fp32 log-softmax,
                      its gradient and the gradient of its input: ~14 B per logit in bf16)
  B  layer backward:  states + saved activations + held logits + LM-head gradient
                      + one layer's backward temporaries (+ the recomputed layer under full ckpt)
  B' first block's backward: states + the other blocks' gradients + one block's activations
  C  optimizer step:  weights + gradients + optimizer states + foreach step temporaries

Model states follow the mixed-precision regime the trainer runs:
  * ``zero == 0`` with bf16/fp16 (Accelerate / HF Trainer AMP): fp32 weights, fp32 grads,
    fp32 optimizer states, plus autocast's 16-bit copies of the weights, alive from the forward
    until each layer's backward (2 B/param).
  * ``zero >= 1`` (DeepSpeed / Megatron): 16-bit weights and grads, fp32 master weights and
    states in the optimizer, an fp32 gradient partition for the step; ZeRO divides optimizer
    (1), gradients (2) and weights (3) by the sharding degree ``dp * cp``.
  * fp32: everything fp32, no copies.
Activations are an inventory of the tensors Hugging Face's implementations save for backward
(gpt2, llama/mistral/qwen2/qwen3, opt, bert), per layer and token, split into the part tensor
parallelism shards and the part it replicates (sharded too with ``sp``).

Then the allocator and the runtime (estimator.overheads): reserved = allocated x (1 + frag)
+ workspace; device_used = reserved + CUDA context + NCCL per communicator.
Pure: no torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import lru_cache
from operator import attrgetter
from typing import Any, NamedTuple

from pydantic import BaseModel, Field

from .catalog import CATALOG, get_gpu
from .errors import FrenzyInputError
from .job import DEFAULT_LORA_RANK, MAX_GLOBAL_BATCH, MAX_GPUS, MAX_SEQ_LEN
from .models import ModelSpec, model_from_kwargs, seq_len_rule, stage_layers, with_positions
from .overheads import Overheads, overheads_for
from .profiles import FRAMEWORKS, PROFILES, Profile, check_knobs, get_profile
from .throughput import Adapters

GIB = float(2 ** 30)

PRECISIONS = ("fp32", "fp16", "bf16")
# adamw8bit-paged: bitsandbytes PagedAdamW8bit, whose large state tensors live in CUDA unified
# memory (cudaMallocManaged): device memory the caching allocator does not see
OPTIMIZERS = ("adamw", "adam", "sgd", "adafactor", "adamw8bit", "adamw8bit-paged")
ACT_CKPTS = ("none", "selective", "full")
OFFLOADS = ("none", "optimizer", "optimizer+params")
ATTENTIONS = ("flash", "eager")
MP_STYLES = ("auto", "amp", "master")
ALLOCATORS = ("auto", "default", "expandable")     # torch's caching allocator: segments' mode
MASTER_WEIGHTS = ("auto", "fp32", "none")
FINETUNES = ("full", "lora", "qlora")
# fp32-logits: the model itself upcasts the logits and returns the fp32 copy (Hugging Face
# causal LMs before transformers 4.46: ``logits = logits.float()`` in forward)
# auto: the profile's own loss path: "fp32-logits" where the run goes through Accelerate's native
# AMP (Knobs.accelerate_amp: its forward wrapper converts the outputs to fp32), else "standard"
LOSSES = ("auto", "standard", "chunked", "fused-linear", "fp32-logits", "none")
# foreach-legacy: torch's foreach Adam(W) as PyTorch 2.0/2.1 ran it, with an out-of-place
# denominator (two state-sized temporaries at the step; see stage_peaks)
ADAMW_IMPLS = ("auto", "foreach", "foreach-legacy", "fused", "for-loop")
# torchtune's CEWithChunkedOutputLoss splits the logits into 8 chunks (num_output_chunks = 8)
LOSS_CHUNKS = 8
# bitsandbytes NF4 with double quantisation: 4 bits + an 8-bit absmax per 64 values + an fp32
# absmax per 256 of those = 4.127 bits per weight (QLoRA paper, section 2)
NF4_BYTES = 4.127 / 8
# Sequences beyond the longest public measurement the profiles were checked on (128K tokens)
COVERED_SEQ = 131072
# Module names LoRA adapts when a job names none: PEFT's defaults per architecture, and per
# Hugging Face model type where PEFT has none (phi3: PEFT asks for target_modules; the fused
# attention projection, as PEFT's q_proj/v_proj adapt the attention only)
LORA_DEFAULT_TARGETS = {"llama": ("q_proj", "v_proj"), "opt": ("q_proj", "v_proj"),
                        "gpt": ("c_attn",), "bert": ("query", "value")}
LORA_TYPE_TARGETS = {"phi3": ("qkv_proj",)}
ALL_LINEAR = "all-linear"       # PEFT's name for every linear layer but the output head


# ---------------------------------------------------------------------------- result models
class StageMemory(BaseModel):
    stage: int
    layers: int
    allocated_peak_gib: float
    reserved_peak_gib: float
    device_used_gib: float


class Estimate(BaseModel):
    """Per-GPU memory of one training configuration (GiB; the most-loaded rank)."""

    params: int = Field(description="model parameters (exact count)")
    allocated_peak_gib: float = Field(description="tensors alive at the peak (max_memory_allocated)")
    reserved_peak_gib: float = Field(description="caching-allocator segments (max_memory_reserved)")
    device_used_gib: float = Field(description="what nvidia-smi shows: reserved + context + NCCL")
    breakdown_gib: dict[str, float] = Field(description="weights, gradients, optimizer, activations, other")
    stages: list[StageMemory]
    method: str = "analytic"
    model: str = ""
    gpu: str | None = None
    gpu_memory_gib: float | None = None
    fits: bool | None = Field(None, description="device_used_gib <= the GPU's memory (when gpu given)")
    overheads: dict[str, float] = Field(default_factory=dict)
    warnings: list[str] = Field(default_factory=list)
    framework: str = Field("frenzy", description="the implementation profile of the estimate")
    host_offload_gib: float = Field(0.0, description="host memory one training process holds for "
                                                     "ZeRO-Offload (0 without offload)")


_STAGE_FIELDS = frozenset(StageMemory.model_fields)
_ESTIMATE_FIELDS = frozenset(Estimate.model_fields)
_setattr = object.__setattr__


def _built(cls, fields: frozenset, values: dict) -> Any:
    """``cls.model_construct(**values)`` for the hot path: ``values`` names every field of
    ``cls`` in declaration order (so no per-field default or alias lookup is needed) and is
    trusted, as model_construct's is. Same instance state: __dict__, fields set, no extra."""
    m = cls.__new__(cls)
    _setattr(m, "__dict__", values)
    _setattr(m, "__pydantic_fields_set__", set(fields))
    _setattr(m, "__pydantic_extra__", None)
    _setattr(m, "__pydantic_private__", None)
    return m


# ---------------------------------------------------------------------------- validation
@dataclass(frozen=True, slots=True)
class Knobs:
    """The validated job and parallel knobs (hashable: keys the caches)."""

    seq_len: int
    micro_batch: int
    grad_accum: int
    dp: int
    tp: int
    pp: int
    cp: int
    sp: bool
    vpp: int
    zero: int
    offload: str
    precision: str
    optimizer: str
    act_ckpt: str
    attention: str
    mp_style: str
    framework: str = "frenzy"
    master: str = "fp32"                 # fp32 | none (resolved from master_weights)
    finetune: str = "full"
    lora_rank: int = DEFAULT_LORA_RANK
    lora_targets: tuple[str, ...] = ()
    lora_dropout: bool = False           # dropout on the adapters' input (PEFT lora_dropout > 0)
    loss: str = "standard"
    act_offload: bool = False
    opt_in_bwd: bool = False
    adamw_impl: str = "foreach"          # resolved from the profile when "auto"
    fused: bool = False                 # fused norm/activation kernels (torch.compile, Liger)
    bucket: float = 0.0                 # DeepSpeed reduce_bucket_size (elements); 0: the default
    bucket_view: bool = False           # DDP gradient_as_bucket_view / FSDP NO_SHARD: no bucket copy
    overlap_comm: bool = False          # DeepSpeed overlap_comm (resolved: its default per stage)
    score_clamp: bool = False           # eager attention clamps the masked scores (old HF OPT/Llama)
    # the step runs under Accelerate's native AMP (a zero-0 16-bit run with fp32 weights or
    # adapters and no DeepSpeed engine, in a profile whose trainer is Accelerate): autocast
    # around the forward and ``convert_outputs_to_fp32`` on what it returns
    accelerate_amp: bool = False
    # the caching allocator runs expandable segments (resolved from the profile when "auto")
    expandable: bool = False


def _pos_int(name: str, v: Any) -> int:
    if type(v) is int and v > 0:                 # the common case, first (bool is not int here)
        return v
    if isinstance(v, bool):
        raise FrenzyInputError(name, f"must be a positive integer, got {v!r}")
    try:
        iv = int(v)
    except (TypeError, ValueError, OverflowError):       # OverflowError: inf
        raise FrenzyInputError(name, f"must be a positive integer, got {v!r}") from None
    if iv != v and not (isinstance(v, str) and str(iv) == v.strip()):
        raise FrenzyInputError(name, f"must be a positive integer, got {v!r}")
    if iv <= 0:
        raise FrenzyInputError(name, f"must be a positive integer, got {iv}")
    return iv


def _choice(name: str, v: Any, allowed: tuple[str, ...]) -> str:
    if v not in allowed:
        raise FrenzyInputError(name, f"must be one of {', '.join(allowed)} (got {v!r})")
    return v


def _bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("true", "1", "yes", "false", "0", "no"):
        return v.lower() in ("true", "1", "yes")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise FrenzyInputError(name, f"must be true or false (got {v!r})")


def validate_knobs(spec: ModelSpec, *, seq_len: Any, micro_batch: Any = 1, grad_accum: Any = 1,
                   dp: Any = 1, tp: Any = 1, pp: Any = 1, cp: Any = 1, sp: Any = False,
                   vpp: Any = 1, zero: Any = 0, offload: Any = "none", precision: Any = "bf16",
                   optimizer: Any = "adamw", act_ckpt: Any = "none", attention: Any = "flash",
                   mp_style: Any = "auto", framework: Any = "frenzy", master_weights: Any = "auto",
                   finetune: Any = "full", lora_rank: Any = DEFAULT_LORA_RANK, lora_targets: Any = None,
                   loss: Any = "auto", act_offload: Any = False,
                   optimizer_in_backward: Any = False, adamw_impl: Any = "auto",
                   fused_kernels: Any = False, zero_bucket_elems: Any = None,
                   gradient_as_bucket_view: Any = None, overlap_comm: Any = None,
                   score_clamp: Any = False, lora_dropout: Any = 0.0, allocator: Any = "auto") -> Knobs:
    """Check every knob against the model; raise FrenzyInputError naming field and rule."""
    return _knobs(framework, spec, seq_len, micro_batch, grad_accum, dp, tp, pp, cp, sp, vpp, zero,
                  offload, precision, optimizer, act_ckpt, attention, mp_style, master_weights,
                  finetune, lora_rank, lora_targets, loss, act_offload, optimizer_in_backward,
                  adamw_impl, fused_kernels, zero_bucket_elems, gradient_as_bucket_view,
                  overlap_comm, score_clamp, lora_dropout, allocator)


def _knobs(framework: Any, *args: Any) -> Knobs:
    """validate_knobs on positional arguments (``_validate``'s order; estimate's hot path: a call
    with 31 keywords costs a third of a cached validation)."""
    try:
        return _validated(PROFILES.get(framework), framework, *args)
    except TypeError:                  # an unhashable argument (a list of LoRA targets): uncached
        return _validate(framework, *args)


def _validate(framework: Any, spec: ModelSpec, seq_len: Any, micro_batch: Any, grad_accum: Any,
              dp: Any, tp: Any, pp: Any, cp: Any, sp: Any, vpp: Any, zero: Any, offload: Any,
              precision: Any, optimizer: Any, act_ckpt: Any, attention: Any, mp_style: Any,
              master_weights: Any, finetune: Any, lora_rank: Any, lora_targets: Any, loss: Any,
              act_offload: Any, optimizer_in_backward: Any, adamw_impl: Any, fused_kernels: Any,
              zero_bucket_elems: Any, gradient_as_bucket_view: Any, overlap_comm: Any,
              score_clamp: Any, lora_dropout: Any = 0.0, allocator: Any = "auto") -> Knobs:
    s = _pos_int("seq_len", seq_len)
    mb = _pos_int("micro_batch", micro_batch)
    ga = _pos_int("grad_accum", grad_accum)
    dp, tp, pp = _pos_int("dp", dp), _pos_int("tp", tp), _pos_int("pp", pp)
    cp, vpp = _pos_int("cp", cp), _pos_int("vpp", vpp)
    # a training job's own bounds (estimator.job): beyond them an estimate is only a big number
    # (micro_batch 10^30 answered ~1e29 GiB)
    if s > MAX_SEQ_LEN or max(mb, ga) > MAX_GLOBAL_BATCH or max(dp, tp, pp, cp, vpp) > MAX_GPUS:
        for name, v, most in (("seq_len", s, MAX_SEQ_LEN), ("micro_batch", mb, MAX_GLOBAL_BATCH),
                              ("grad_accum", ga, MAX_GLOBAL_BATCH), ("dp", dp, MAX_GPUS), ("tp", tp, MAX_GPUS),
                              ("pp", pp, MAX_GPUS), ("cp", cp, MAX_GPUS), ("vpp", vpp, MAX_GPUS)):
            if v > most:
                raise FrenzyInputError(name, f"must be at most {most:,}, got {v:,}")
    sp = _bool("sp", sp)
    if isinstance(zero, bool) or zero not in (0, 1, 2, 3, "0", "1", "2", "3"):
        raise FrenzyInputError("zero", f"must be 0, 1, 2 or 3 (got {zero!r})")
    zero = int(zero)
    offload = _choice("offload", offload, OFFLOADS)
    precision = _choice("precision", precision, PRECISIONS)
    optimizer = _choice("optimizer", optimizer, OPTIMIZERS)
    act_ckpt = _choice("act_ckpt", act_ckpt, ACT_CKPTS)
    attention = _choice("attention", attention, ATTENTIONS)
    mp_style = _choice("mp_style", mp_style, MP_STYLES)
    if spec.heads % tp:
        raise FrenzyInputError("tp", f"must divide heads ({spec.heads} % {tp} != 0)")
    if spec.n_kv % tp and tp % spec.n_kv:
        raise FrenzyInputError("tp", f"must divide kv_heads or be a multiple of it ({spec.n_kv} vs {tp})")
    if pp > spec.layers:
        raise FrenzyInputError("pp", f"must not exceed layers ({pp} > {spec.layers})")
    if sp and tp == 1:
        raise FrenzyInputError("sp", "sequence parallelism needs tp > 1")
    if vpp > 1 and pp == 1:
        raise FrenzyInputError("vpp", "virtual pipeline stages need pp > 1")
    if vpp > 1 and spec.layers % (pp * vpp):
        raise FrenzyInputError("vpp", f"pp * vpp must divide layers ({spec.layers} % {pp * vpp} != 0)")
    if s % cp:
        raise FrenzyInputError("cp", f"must divide seq_len ({s} % {cp} != 0)")
    if sp and s % tp:
        raise FrenzyInputError("sp", f"tp must divide seq_len with sequence parallelism ({s} % {tp} != 0)")
    rule = seq_len_rule(spec, s)
    if rule is not None:
        raise FrenzyInputError("seq_len", rule)
    if optimizer in ("adafactor", "adamw8bit", "adamw8bit-paged") and zero >= 1:
        raise FrenzyInputError("zero", f"{optimizer} cannot be sharded by ZeRO (its states are "
                                       "per-tensor: factored rows/columns or blockwise 8-bit); use zero 0")
    if offload != "none" and zero == 0 and framework in ("frenzy", "deepspeed", "megatron"):
        raise FrenzyInputError("offload", f"needs ZeRO (zero >= 1) with framework {framework}: "
                                          "offload moves ZeRO's optimizer partition")
    if offload == "optimizer+params" and zero != 3:
        raise FrenzyInputError("offload", "optimizer+params needs zero 3 (parameters must be partitioned)")
    prof = get_profile(framework)
    if _eager_only(spec, prof):
        if attention == "flash":
            raise FrenzyInputError("attention", f"{spec.model_type} soft-caps its attention scores, which SDPA "
                                                f"cannot: Hugging Face runs it eager (attention: eager)")
        if cp > 1:
            raise FrenzyInputError("cp", f"Ulysses (cp > 1) attends through SDPA, which {spec.model_type} has "
                                         f"not (soft-capped scores): use cp 1")
    if cp > 1 and prof.hf_models and spec.window_reached(s):
        # DeepSpeed's Ulysses wrapper hands SDPA no mask (ulysses_sp.py: attention_mask = None
        # for sdpa): the model would train without its window
        raise FrenzyInputError("cp", f"Ulysses (cp > 1) attends without {spec.name}'s sliding window of "
                                     f"{spec.window} tokens at seq_len {s} (it drops the attention mask): use cp 1")
    if mp_style == "amp" and zero >= 1 and not prof.torch_sharding:
        raise FrenzyInputError("mp_style", f"amp (fp32 weights + autocast) is the zero-0 regime of "
                                           f"{framework}; its ZeRO keeps 16-bit weights with fp32 master copies")
    master_weights = _choice("master_weights", master_weights, MASTER_WEIGHTS)
    finetune = _choice("finetune", finetune, FINETUNES)
    loss = _choice("loss", loss, LOSSES)
    adamw_impl = _choice("adamw_impl", adamw_impl, ADAMW_IMPLS)
    act_offload = _bool("act_offload", act_offload)
    opt_in_bwd = _bool("optimizer_in_backward", optimizer_in_backward)
    fused = _bool("fused_kernels", fused_kernels)
    if master_weights == "auto":
        master = "none" if (precision == "fp32" or (prof.zero0_regime == "pure" and zero == 0)) else "fp32"
    else:
        master = "none" if precision == "fp32" else master_weights
    if master == "none" and mp_style == "amp" and precision != "fp32":
        raise FrenzyInputError("mp_style", "amp keeps fp32 weights; master_weights none trains "
                                           "the 16-bit weights themselves")
    check_knobs(prof, finetune=finetune, zero=zero, master=master_weights, precision=precision,
                opt_in_bwd=opt_in_bwd, optimizer=optimizer, offload=offload, loss=loss,
                act_offload=act_offload, fused=fused)
    rank, targets, drop = DEFAULT_LORA_RANK, (), False
    if finetune != "full":
        if isinstance(lora_dropout, bool) or not isinstance(lora_dropout, (int, float)) \
                or not 0 <= lora_dropout < 1:
            raise FrenzyInputError("lora_dropout", f"must be a number in [0, 1) (got {lora_dropout!r})")
        drop = lora_dropout > 0
        rank = _pos_int("lora_rank", lora_rank)
        names = lora_projections(spec)
        if lora_targets is None or lora_targets == ():
            targets = default_lora_targets(spec)
        else:
            if isinstance(lora_targets, str):
                lora_targets = [t.strip() for t in lora_targets.split(",") if t.strip()]
            if ALL_LINEAR in lora_targets:
                # PEFT's shorthand: every linear layer of the blocks (the output head excluded)
                lora_targets = [t for t in lora_targets if t != ALL_LINEAR] + list(names)
            targets = tuple(sorted(set(lora_targets)))
            bad = [t for t in targets if t not in names]
            if bad or not targets:
                raise FrenzyInputError("lora_targets", f"{spec.arch} has projections "
                                       f"{', '.join(names)} (or {ALL_LINEAR}; got {', '.join(bad) or 'none'})")
        if finetune == "qlora" and precision == "fp32":
            raise FrenzyInputError("finetune", "qlora computes in 16 bits (precision bf16 or fp16)")
    if opt_in_bwd and ga > 1:
        raise FrenzyInputError("optimizer_in_backward", "needs grad_accum 1 (each gradient is "
                                                        "applied and freed as it is produced)")
    if opt_in_bwd and pp > 1:
        raise FrenzyInputError("optimizer_in_backward", "needs pp 1")
    if spec.vocab_padded == 0:
        loss = "none"                          # an encoder without vocabulary has no LM loss
    if loss == "fused-linear" and tp > 1:
        raise FrenzyInputError("loss", "fused-linear cross-entropy needs tp 1 (it gathers the head)")
    impl = adamw_impl if adamw_impl != "auto" else prof.adamw_impl
    bucket = 0.0
    if zero_bucket_elems is not None:
        if isinstance(zero_bucket_elems, bool) or not isinstance(zero_bucket_elems, (int, float)) \
                or not 1 <= zero_bucket_elems <= 1e12:
            raise FrenzyInputError("zero_bucket_elems", f"must be a number of elements in [1, 1e12] "
                                                        f"(got {zero_bucket_elems!r})")
        bucket = float(zero_bucket_elems)
    # DDP with gradient_as_bucket_view=True, and FSDP NO_SHARD (it all-reduces the flat
    # gradient in place), keep no second copy of the gradients; None: the profile's default
    view = (not prof.ddp_bucket_copy) if gradient_as_bucket_view is None else \
        _bool("gradient_as_bucket_view", gradient_as_bucket_view)
    # DeepSpeed's overlap_comm defaults to true at stage 3 and false at stages 0-2
    # (deepspeed/runtime/zero/config.py, overlap_comm_valid); None: that default
    if overlap_comm is None:
        overlap = prof.overlap_comm == "stage3" and zero == 3
    else:
        overlap = _bool("overlap_comm", overlap_comm)
    clamp = _bool("score_clamp", score_clamp)
    if clamp and attention != "eager":
        raise FrenzyInputError("score_clamp", "applies to eager attention only (flash never "
                                              "materialises the scores)")
    if overlap_comm is not None and not prof.overlap_comm:
        raise FrenzyInputError("overlap_comm", f"is a DeepSpeed setting, not expressible with "
                                               f"framework {prof.name}")
    # settings of something the configuration does not run were ignored without a word
    if overlap_comm is not None and overlap and zero == 0:
        raise FrenzyInputError("overlap_comm", "overlaps ZeRO 1-3's gradient reduction; zero 0 has none to overlap")
    if adamw_impl != "auto" and optimizer not in ("adam", "adamw"):
        raise FrenzyInputError("adamw_impl", f"is how Adam / AdamW steps; optimizer {optimizer} has its own step")
    if mp_style != "auto" and precision == "fp32":
        raise FrenzyInputError("mp_style", "is the 16-bit regime (amp or master); precision fp32 has none")
    # Accelerate's native AMP (accelerate/accelerator.py, prepare_model): the AMP regime (fp32
    # weights, or fp32 LoRA adapters, and autocast) with no DeepSpeed engine (tp and cp run
    # through DeepSpeed in Frenzy's trainer, as ZeRO does; a pipeline is its own program)
    accel = (prof.accelerate_amp and tp == 1 and cp == 1 and pp == 1
             and _amp_regime(prof, precision, master, zero, pp, mp_style))
    if loss == "auto":
        # its forward wrapper (utils/operations.py, convert_outputs_to_fp32) returns an fp32
        # copy of the logits, which the output holds through the backward: the model's own
        # upcast inside the loss then finds fp32 and copies nothing. Measured on the H200
        # (scripts/gpu_check.sh --set memory, Llama-3.2-1B): the zero-0 AMP runs' allocated
        # peaks sat 2.0 and 4.0 GiB above the "standard" path at 8,192 and 16,384 tokens, one
        # 16-bit logits tensor (2 B x 128,256 x tokens = 1.96 / 3.92 GiB); ZeRO and pure-bf16
        # runs, which Accelerate does not wrap, matched "standard" (+0.1%, -0.2%)
        loss = "fp32-logits" if accel else "standard"
    if allocator not in ALLOCATORS:
        raise FrenzyInputError("allocator", f"must be one of {', '.join(ALLOCATORS)} (got {allocator!r})")
    expandable = prof.expandable_segments if allocator == "auto" else allocator == "expandable"
    return Knobs(s, mb, ga, dp, tp, pp, cp, sp, vpp, zero, offload, precision, optimizer,
                 act_ckpt, attention, mp_style, prof.name, master, finetune, rank, targets, drop,
                 loss, act_offload, opt_in_bwd, impl, fused, bucket, view, overlap, clamp, accel,
                 expandable)


def _torch_zero(prof: Profile, pp: int) -> bool:
    """ZeRO as torch runs it (the profile's, or its pipelines'): fp32 parameters stay."""
    return prof.torch_sharding or (pp > 1 and prof.pipeline_torch_zero)


def _amp_regime(prof: Profile, precision: str, master: str, zero: int, pp: int, mp_style: str) -> bool:
    """The AMP regime: fp32 weights with autocast computing in 16 bits (``mp_style`` "auto": the
    profile's zero-0 regime, kept under torch's ZeRO; "amp" / "master": as named). ``master``
    is the resolved master weights (fp32 or none)."""
    if mp_style != "auto":
        return precision != "fp32" and mp_style == "amp"
    return (precision != "fp32" and master != "none" and (zero == 0 or _torch_zero(prof, pp))
            and prof.zero0_regime == "amp")


def _eager_only(spec: ModelSpec, prof: Profile | None) -> bool:
    """Whether the profile runs ``spec`` on Hugging Face's modelling code, which builds no SDPA
    attention for it (``ModelSpec.eager_only``: Gemma 2 soft-caps its scores)."""
    return spec.eager_only and prof is not None and prof.hf_models


def attention_for(spec: ModelSpec, attention: Any, framework: Any = "frenzy") -> Any:
    """The attention a job asking for ``attention`` runs: eager where the framework's modelling
    code has no fused kernel for the model (``_eager_only``), whatever is asked; the estimate,
    the planner, plan re-estimates and the trainer's launch spec ask here. Anything else is
    returned as given (validation names what is wrong with it)."""
    if attention == "flash" and type(framework) is str and _eager_only(spec, PROFILES.get(framework)):
        return "eager"
    return attention


# Validation is a pure function of its arguments and the framework's profile (PROFILES may be
# replaced at run time: the profile object is part of the key). Typed: 1, 1.0 and True stay
# apart, as the checks tell them apart. Errors are not cached; Knobs are immutable, so one is
# shared by every call with the same arguments (the 30 object.__setattr__ of a frozen
# dataclass were half of a validation's cost).
@lru_cache(maxsize=4096, typed=True)
def _validated(prof: Profile | None, *args: Any) -> Knobs:
    return _validate(*args)


def default_lora_targets(spec: ModelSpec) -> tuple[str, ...]:
    """The projections LoRA adapts when a job names none (``LORA_TYPE_TARGETS``, else
    ``LORA_DEFAULT_TARGETS``)."""
    return LORA_TYPE_TARGETS.get(spec.model_type) or LORA_DEFAULT_TARGETS[spec.arch]


# The Llama family's projections that read the attention norm's and the MLP norm's output (the
# separate ones, and Phi-3's fused ones): LoRA on any of them keeps that output saved
ATTN_NORM_READERS = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj"})
MLP_NORM_READERS = frozenset({"gate_proj", "up_proj", "gate_up_proj"})


def lora_projections(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """Each block's projections LoRA can target: name -> (in features, out features)."""
    h, f = spec.hidden, spec.f
    q, kv = spec.heads * spec.d_head, spec.n_kv * spec.d_head
    if spec.arch == "llama" and spec.fused_proj:
        return {"qkv_proj": (h, q + 2 * kv), "o_proj": (q, h), "gate_up_proj": (h, 2 * f), "down_proj": (f, h)}
    if spec.arch == "llama":
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, f), "up_proj": (h, f), "down_proj": (f, h)}
    if spec.arch == "opt":
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "out_proj": (q, h),
                "fc1": (h, f), "fc2": (f, h)}
    if spec.arch == "gpt":
        return {"c_attn": (h, q + 2 * kv), "c_proj": (q, h), "c_fc": (h, f), "mlp.c_proj": (f, h)}
    return {"query": (h, q), "key": (h, kv), "value": (h, kv), "attention.output.dense": (q, h),
            "intermediate.dense": (h, f), "output.dense": (f, h)}


def lora_layer_params(spec: ModelSpec, k: Knobs) -> int:
    """Trainable adapter parameters of one block: r x (in + out) per targeted projection."""
    names = lora_projections(spec)
    return sum(k.lora_rank * sum(names[t]) for t in k.lora_targets)


def lora_adapters(spec: ModelSpec, k: Knobs) -> Adapters | None:
    """What the throughput model needs of a LoRA / QLoRA job's adapters (None for full
    fine-tuning): the widths of the projections they adapt, and, as the memory terms read them,
    fp32 adapters under autocast (``accelerate_amp``) and dropout on their input."""
    if k.finetune == "full":
        return None
    return _adapters(spec, k.lora_rank, k.lora_targets, k.accelerate_amp, k.lora_dropout, k.finetune == "qlora")


@lru_cache(maxsize=1024)
def _adapters(spec: ModelSpec, rank: int, targets: tuple[str, ...], fp32: bool, dropout: bool,
              qlora: bool) -> Adapters:
    names = lora_projections(spec)
    return Adapters(rank, sum(names[t][0] for t in targets), sum(names[t][1] for t in targets),
                    fp32, dropout, qlora)


# ---------------------------------------------------------------------------- model facts
@lru_cache(maxsize=512)
def _trainable_shapes(spec: ModelSpec, lora_rank: int,
                      lora_targets: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Shapes of the tensors the optimizer steps: the whole model's (``lora_rank`` 0), or each
    block's adapters (A: r x in, B: out x r per target), unsharded."""
    if not lora_rank:
        return tuple(spec.weight_shapes())
    proj = lora_projections(spec)
    block = tuple(s for t in lora_targets
                  for s in ((lora_rank, proj[t][0]), (proj[t][1], lora_rank)))
    return block * spec.layers


@lru_cache(maxsize=512)
def _state_bytes_per_param(spec: ModelSpec, optimizer: str, lora_rank: int = 0,
                           lora_targets: tuple[str, ...] = ()) -> float:
    """Optimizer-state bytes per trainable parameter (fp32 states), averaged over the trainable
    tensors (see _trainable_shapes)."""
    if optimizer in ("adam", "adamw"):
        return 8.0
    if optimizer == "sgd":
        return 4.0                                # momentum buffer
    shapes = _trainable_shapes(spec, lora_rank, lora_targets)
    n = sum(math.prod(shape) for shape in shapes)
    if optimizer == "adafactor":                  # HF Adafactor, beta1=None: factored 2nd moment
        total = sum(4.0 * (shape[0] + shape[1]) if len(shape) == 2 else 4.0 * math.prod(shape)
                    for shape in shapes)
    else:                                         # bitsandbytes 8-bit AdamW (paged or not)
        total = _bnb8_state_bytes(spec, lora_rank, lora_targets, optimizer == "adamw8bit-paged")[0]
    return total / n


# bitsandbytes 8-bit optimizers (read in bitsandbytes 0.45.0, optim/optimizer.py,
# Optimizer2State.init_state and Optimizer8bit.get_state_buffer): tensors below min_8bit_size
# (4096 elements) keep two fp32 states; larger ones two uint8 states plus, blockwise, one fp32
# absmax per 256 values for each state (``blocks = n // 256``); the paged variants put a state
# buffer in CUDA unified memory (F.get_paged, cudaMallocManaged) only for tensors of 1e5+
# elements, and their absmax arrays are ordinary device tensors either way
BNB_MIN_8BIT_ELEMS = 4096
BNB_BLOCK = 256
BNB_PAGED_MIN_ELEMS = 100_000


@lru_cache(maxsize=512)
def _bnb8_state_bytes(spec: ModelSpec, lora_rank: int, lora_targets: tuple[str, ...],
                     paged: bool) -> tuple[float, float]:
    """(bytes the caching allocator holds, bytes in CUDA unified memory) of bitsandbytes 8-bit
    Adam states over the trainable tensors (see _trainable_shapes), whole model, unsharded."""
    alloc = unified = 0.0
    for shape in _trainable_shapes(spec, lora_rank, lora_targets):
        numel = math.prod(shape)
        if numel < BNB_MIN_8BIT_ELEMS:
            alloc += 8.0 * numel
            continue
        alloc += 2 * 4.0 * math.ceil(numel / BNB_BLOCK)          # the absmax arrays
        if paged and numel >= BNB_PAGED_MIN_ELEMS:
            unified += 2.0 * numel
        else:
            alloc += 2.0 * numel
    return alloc, unified


def _layer_vector_params(spec: ModelSpec) -> int:
    """Norm and bias parameters of one block: replicated, not split by tensor parallelism."""
    h, f = spec.hidden, spec.f
    q, kv = spec.heads * spec.d_head, spec.n_kv * spec.d_head
    if spec.arch == "llama":
        return (spec.norms_per_layer * h
                + ((q + 2 * kv + (h if spec.has_o_bias else 0)) if spec.has_qkv_bias else 0)
                + (2 * spec.d_head if spec.has_qk_norm else 0))
    return 4 * h + q + 2 * kv + h + f + h


@dataclass(frozen=True, slots=True)
class _Sem:
    """Kernel semantics that change saved-tensor sizes: CUDA (default) or CPU."""

    mask_bytes: float        # dropout mask element (CUDA: bool; CPU: input dtype)
    stat_bytes: float        # LayerNorm mean/rstd element (CUDA: fp32; CPU: input dtype)
    cuda: bool = True


CUDA_SEM = _Sem(1.0, 4.0)


def _cpu_sem(c: float) -> _Sem:
    return _Sem(c, c, False)


def op_sac_saved_tok(spec: ModelSpec, c: float, t: int = 1, sp: bool = False) -> float:
    """Bytes per token one block keeps under per-op selective checkpointing (torchtitan's
    policy) beyond its input: the outputs of every other matmul, the 1st, 3rd, ... in the order
    the block runs them (llama: q, k, v, o, gate, up, down -> q, v, gate, down; fused
    projections: qkv, o, gate_up, down -> qkv, gate_up), and the attention kernel's output and
    log-sum-exp (fp32, one per head). Split by tensor parallelism, except a row-parallel
    projection's output (the block's last, kept whole: its partial sums before the reduction);
    under sequence parallelism the save list's reduce-scatter outputs after the attention's and
    the MLP's output projections are kept too (h / tp each)."""
    h, f, a = spec.hidden, spec.f, spec.heads
    q, kvd = a * spec.d_head, spec.n_kv * spec.d_head
    if spec.arch == "llama" and not spec.fused_proj:
        outs = [q, kvd, kvd, h, f, f, h]
    elif spec.arch == "llama":
        outs = [q + 2 * kvd, h, 2 * f, h]
    else:                                   # fused qkv, output, MLP in, MLP out
        outs = [q + 2 * kvd, h, f, h]
    kept = outs[0::2]
    last = kept[-1] if len(outs) % 2 else 0          # the block's last projection, when kept
    scattered = 2 * c * h / t if sp and t > 1 else 0.0
    return c * (sum(kept) - last) / t + c * last + scattered + (c * q + 4.0 * a) / t


def layer_activation_bytes(spec: ModelSpec, s: int, c: float, amp: bool, attention: str,
                           act_ckpt: str, sem: _Sem = CUDA_SEM, *, compiled: bool = False,
                           repeat_kv: bool = False, hf_models: bool = True,
                           score_clamp: bool = False, ulysses: bool = False,
                           window_share: float | None = None) -> tuple[float, float]:
    """Bytes per token one block saves for backward: (replicated under TP, sharded under TP).

    ``c``: compute dtype bytes (2 for 16-bit, 4 for fp32); ``amp``: fp32 weights + autocast
    (residual stream in fp32, one 16-bit cast of a norm output per consuming linear);
    ``ulysses``: sequence parallel through DeepSpeed Ulysses (cp > 1), per token of the rank's
    slice (``s`` stays the whole sequence: each rank attends over all of it for heads / cp);
    ``window_share``: the share of the block's layers attending through a window
    (``ModelSpec.window_share``; default the whole model's)."""
    h, f, a = spec.hidden, spec.f, spec.heads
    q = a * spec.d_head
    kvd = spec.n_kv * spec.d_head
    r = 4.0 if amp else c                      # residual stream dtype
    st = 2 * (4.0 if amp else sem.stat_bytes)  # LayerNorm mean + rstd per token
    flash = attention == "flash"
    score = 0.0 if act_ckpt == "selective" else 1.0   # selective recomputes the attention core
    # llama/opt upcast softmax explicitly; under autocast gpt2's scores meet its fp32 mask
    # value and softmax runs in fp32; either way a 16-bit copy of the probabilities follows
    fp32_softmax = c < 4 and (spec.arch in ("llama", "opt") or (amp and spec.arch == "gpt"))
    probs = score * a * s * ((4.0 + c) if fp32_softmax else c)
    if flash and c == 4 and spec.n_kv < a and sem.cuda:
        # Measured on H200: fp32 SDPA with grouped-query attention has no fused CUDA kernel
        # (flash needs 16-bit, the memory-efficient kernel has no GQA), so it runs the math
        # kernel with k/v repeated and the fp32 probabilities saved, like eager attention.
        attn = c * 3 * q + score * a * s * c + c * q
    elif flash:
        # q, k, v, log-sum-exp, output; implementations that repeat k/v to every head before
        # SDPA (torchtune's attention at the measured versions) save the repeated copies, and so
        # does Hugging Face's where a sliding window is reached: with a mask it does not hand
        # SDPA grouped k / v (``use_gqa_in_sdpa`` wants none): in the share of layers that
        # attend through a window (Gemma 3: not its global ones). The mask itself:
        # ``window_mask_bytes``
        share = spec.window_share(s) if window_share is None else window_share
        repeated = 1.0 if repeat_kv else (share if hf_models else 0.0)
        attn = c * (q + 2 * (kvd + repeated * (q - kvd))) + 4.0 * a + c * q
        if ulysses:
            # Without cp the inventory above has one output tensor for SDPA's saved output and the
            # output projection's saved input (one storage: the traces show one). Under Ulysses the
            # projection's input is the all-to-all's output, a second tensor of q elements per
            # token; SDPA's q, k, v and output are the gathered copies, heads / cp over all s
            # positions: per token of the slice the same bytes as without cp. The all-to-all
            # send/receive buffers are freed once exchanged; in the backward, dq, dk, dv and one
            # exchange's pair (~3 q + 2 kv wide) stay below the MLP's gradient temporaries of the
            # same layer that ``layer_backward_transient`` counts (2 h + 2 ffn wide)
            attn += c * q
        else:
            attn += c * q * merged_copy(spec, c, attention, hf_models, ulysses, sem.cuda, share)
        if spec.arch == "gpt" and amp and sem.cuda and act_ckpt != "selective" and hf_models:
            # Measured on H200 (torch 2.11): HF GPT-2 under autocast hands SDPA its fp32 additive
            # mask, so CUDA picks the memory-efficient kernel, which saves the mask expanded to
            # b x heads x s x s in 16 bits per layer (the CPU trace does not show it).
            attn += c * a * s
    else:   # q, k^T and v (repeated to all heads), probabilities, merged output copy (q wide)
        attn = c * 3 * q + probs + c * q
        if spec.attn_softcap:
            # Gemma 2 soft-caps the scores, tanh(scores / cap) x cap: tanh keeps its output
            attn += score * a * s * c
        if score_clamp:
            # Hugging Face eager attention of 2022-2023 (OPTAttention, the first LlamaAttention:
            # transformers 4.2x) clamps the masked scores, torch.max(scores + mask,
            # finfo.min); maximum's backward keeps its input: one more 16-bit a x s per token
            attn += score * a * s * c
    drop_res = spec.dropout > 0
    drop_attn = spec.attn_dropout > 0 and not flash
    m = sem.mask_bytes
    if spec.arch == "gpt":
        rep = 2 * r * h + 2 * st + 2 * c * h                 # ln_1, ln_2: input, stats, output
        # gelu_new saves 4 f-tensors + output; compiled (Inductor recomputes the pointwise
        # chain in backward) only its input and the c_proj input remain
        shard = attn + (2 if compiled else 5) * c * f
        if drop_res:
            rep += 2 * m * h
    elif spec.arch == "llama":
        if amp:   # RMSNorm: fp32 input, fp32 normalized, a cast per consuming projection
            # (autocast caches casts of weights only): Phi-3's fused qkv_proj and gate_up_proj
            # take one each (saved-tensor hooks under CPU autocast)
            n_attn, n_mlp = (1, 1) if spec.fused_proj else (3, 2)
            rep = (8 * h + n_attn * c * h + 4) + (8 * h + n_mlp * c * h + 4)
        elif compiled:
            # Inductor fuses RMSNorm: it saves the 16-bit input, rstd and the output the
            # projections read, not the fp32 upcast or the normalised copy (recomputed)
            rep = 2 * (2 * c * h + 4)
        elif spec.gemma_norms:
            # Gemma's RMSNorm scales in fp32 before its cast: the fp32 upcast, rstd, the fp32
            # normalised copy (the (1 + w) product keeps it for the weight's gradient), then
            # the cast output the projections read; under autocast this is Llama's inventory
            # (the input is the fp32 residual; one cast per consuming projection)
            rep = 2 * (8 * h + c * h + 4)
        else:
            rep = 2 * (4 * h + 2 * c * h + 4)
        if spec.sandwich_norms:
            # Gemma 3's post-attention and post-feedforward norms: fp32 upcast of the sublayer's
            # output, rstd and the fp32 normalised copy; their cast output only joins the
            # residual (an add saves nothing). Compiled: the input and rstd
            rep += 2 * ((c * h + 4) if compiled and not amp else (8 * h + 4))
        # gate, up, silu(gate), product; compiled: silu(gate) is recomputed from gate
        shard = attn + (3 if compiled and not amp else 4) * c * f
        if spec.has_qk_norm:
            # Qwen3's q_norm / k_norm (the RMSNorm above, over each head's slice of the q and k
            # projections' outputs): the fp32 upcast (the input itself in fp32) and the
            # normalised copy in the input dtype that the weight multiplies, per element, and
            # one fp32 rstd per head row; the rotary embedding after it saves no copy of q or k
            # (its cos / sin need no gradient). Compiled: the input and rstd (recomputed rest)
            # Gemma 3's (the Gemma norm, per head): the fp32 upcast and the fp32 normalised copy;
            # its cast output goes to the rotary embedding, which keeps none
            rows = a + spec.n_kv
            per_elem = c if compiled and not amp else (8.0 if spec.gemma_norms else 4.0 + c)
            shard += per_elem * (q + kvd) + 4.0 * rows
    elif spec.arch == "opt":
        rep = 2 * r * h + 2 * st + ((4 * c * h) if amp else (2 * c * h))
        shard = attn + c * f                                  # relu output (= fc2 input)
        if drop_res:
            rep += 2 * m * h
    else:  # bert, post-LN
        rep = 2 * r * h + 2 * st + ((4 * c * h) if amp else (2 * c * h))
        # gelu input, gelu output; gated (SwiGLU, ViT-g): gate, up, silu(gate), product
        shard = attn + (4 if spec.gated else 2) * c * f
        if drop_res:
            rep += 2 * m * h
    if drop_attn:
        shard += score * a * s * (m + c)
    return rep, shard


def merged_copy(spec: ModelSpec, c: float, attention: str, hf_models: bool, ulysses: bool, cuda: bool,
                share: float = 0.0) -> float:
    """The share of a block's layers that save a copy of SDPA's output beside it, q wide: Phi-3's
    q is a slice of the fused qkv output, so the rotary embedding writes it head-major ([b,
    heads, s, d]; a Llama's q_proj output stays token-major), SDPA's output follows q's layout
    where the kernel allocates it like q, and the merge of the heads before o_proj then copies
    it, which o_proj saves for its weight's gradient. The CPU kernel does so in every layer
    (saved-tensor hooks). On CUDA (PyTorch's meta registrations of its kernels' outputs; not
    measured on a GPU here) the flash kernel does, 16-bit and unmasked only; a layer handed a
    mask (``share``: the layers whose window the sequence reaches) or fp32 runs the
    memory-efficient kernel, which allocates its output token-major: no copy. None where eager
    or the math kernel merges a copy anyway, nor under Ulysses (its all-to-all output is the
    copy)."""
    if not (spec.fused_proj and hf_models and attention == "flash" and not ulysses):
        return 0.0
    if not cuda:
        return 1.0
    return 0.0 if c == 4 else 1.0 - share


def window_mask_bytes(spec: ModelSpec, s: int, c: float, attention: str, act_ckpt: str, hf_models: bool,
                      cuda: bool = True, share: float | None = None) -> float:
    """Bytes per token one block keeps of SDPA's explicit sliding-window mask, beside
    ``layer_activation_bytes``'s inventory: where a Hugging Face model's window is reached,
    it passes SDPA a boolean ``b x 1 x s x s`` mask, which SDPA converts to an additive one in
    the query dtype per call, so each layer saves its own: ``c x s`` per token, whole on every
    tp rank and under sequence parallelism too (attention sees the whole sequence of all its
    heads). None under selective checkpointing (the attention core, mask included, is
    recomputed: one alive at a time) or where fp32 grouped-query attention runs CUDA's math
    kernel. ``share``: of the block's layers, those with a window (``ModelSpec.window_share``;
    default the whole model's). Traced on the CPU (saved-tensor hooks); CUDA's memory-efficient kernel is handed the
    same converted bias (not measured on a GPU here; ``analytic_estimate`` warns)."""
    if attention != "flash" or not hf_models or not spec.window_reached(s) or act_ckpt == "selective":
        return 0.0
    if c == 4 and spec.n_kv < spec.heads and cuda:
        return 0.0
    return c * s * (spec.window_share(s) if share is None else share)     # per layer, over the windowed share


def layer_backward_transient(spec: ModelSpec, s: int, c: float, attention: str, tp: int) -> float:
    """Bytes per token of temporaries while one block runs backward (activation gradients)."""
    h, f, a = spec.hidden, spec.f, spec.heads
    t = 2 * c * h + (2 * c * f) / tp
    if attention == "eager":
        t += a * s * (c + (4.0 if spec.arch in ("llama", "opt") else c)) / tp
    return t


def _loss_bytes_per_logit(spec: ModelSpec, c: float, amp: bool) -> tuple[float, float, float]:
    """(held logits, peak in the loss forward, peak in the loss backward) bytes per logit.
    Causal LMs in HF upcast logits to fp32 before cross-entropy; BERT's MLM loss does not,
    except under autocast, which runs cross-entropy in fp32."""
    if spec.arch == "bert" and not amp:
        return c, 3 * c, 4 * c
    lsm = 4.0
    copy = 4.0 if c < 4 else 0.0
    return c, c + copy + lsm, c + 3 * lsm


# ---------------------------------------------------------------------------- the model
@dataclass(slots=True)
class StagePeak:
    stage: int
    layers: int
    allocated: float
    weights: float
    gradients: float
    optimizer: float
    activations: float
    other: float


@lru_cache(maxsize=2048)
def _param_split(spec: ModelSpec, t: int) -> tuple[float, float, float, float]:
    """Per tensor-parallel rank: (one block, input side, output side, largest gathered unit).
    Matrices split by t (vocab-parallel embedding/head too); norms and biases replicate."""
    V, e = spec.vocab_padded, spec.e
    vec = _layer_vector_params(spec)
    layer_p = (spec.layer_params() - vec) / t + vec
    emb_p = spec.embedding_params() - V * e + V * e / t
    head_p = spec.head_params()
    if not spec.tied:
        head_p = head_p - V * e + V * e / t
    if spec.arch == "bert":                            # MLM head instead of the pooler
        # (cross-attention is counted per block by the caller, not in the head)
        head_p = (spec.train_params - spec.embedding_params() - spec.layers * spec.layer_params()
                  - spec.cross_attn_params())
        head_p = head_p - V + V / t
    return layer_p, emb_p, head_p, spec.largest_layer_params() / t


def _interleaved_inflight(pp: int, vpp: int, m: int, rank: int) -> float:
    """Micro-batches' activations (in units of the rank's whole ``layers / pp``) that pipeline
    rank ``rank`` of an interleaved 1F1B schedule holds at its peak.

    torch 2.13's ``ScheduleInterleaved1F1B`` (as Megatron-LM) runs ``(vpp - 1) x mpr + 2 (pp -
    1 - rank)`` chunk forwards before its first backward (``mpr`` micro-batches per round of
    ``max(1, m // pp)``; at most all ``m x vpp``), then one forward per backward: one chunk more
    at the peak, each chunk ``1 / vpp`` of the rank's layers. For the first rank with ``m`` a
    multiple of ``pp`` that is ``pp (1 + (pp - 1) / (pp vpp))``, the factor of Korthikanti et
    al. 2022 ("Reducing activation recomputation in large transformer models", 4.2.3); with
    fewer micro-batches than ranks a rank runs all its chunks of every micro-batch first: ``m``."""
    mpr = m // max(1, m // pp)
    warmup = min((vpp - 1) * mpr + 2 * (pp - 1 - rank), m * vpp)
    return min(warmup + 1, m * vpp) / vpp


def _loss_terms(spec: ModelSpec, k: Knobs, prof: Profile, c: float, amp: bool) -> tuple[float, float]:
    """(bytes per logit held through the whole backward, bytes per logit at the loss backward's
    peak, held included) for the loss kernel and the profile's loss path."""
    if k.loss == "none":
        return 0.0, 0.0
    if k.loss == "fused-linear":               # Liger-style: logits only per chunk (fixed terms)
        return 0.0, 0.0
    # Gemma 2 soft-caps the logits in the model's forward, tanh(logits / cap) x cap: tanh keeps
    # its output (16-bit, one per logit) beside the capped logits, through the backward
    # (measured on the CPU, storage by storage: +2 B per logit at the loss backward's peak)
    cap = c if spec.logit_softcap else 0.0
    if k.loss == "fp32-logits":
        # the output keeps the fp32 logits through the backward (the 16-bit head output is
        # freed by the upcast); the loss backward adds to them the fp32 log-softmax, the nll
        # gradient and the log-softmax gradient: 4 x 4 B at its peak (2 B more than "standard")
        return 4.0 + cap, 4 * 4.0 + cap
    if k.loss == "chunked":
        # 16-bit logits of all chunks stay until their chunk's backward; one chunk at a time is
        # upcast (fp32 copy, log-softmax, two fp32 gradients) and its 16-bit gradient made.
        # Held through the blocks' backward only where the model output keeps them (HF); a
        # recipe that deletes the output frees each chunk after its backward
        # (the model's forward caps the whole logits first: tanh's output held beside them)
        held = c + cap if prof.loss == "hf" else 0.0
        return held, c + (cap if held else 0.0) + (3 * 4.0 + c) / LOSS_CHUNKS
    if prof.loss == "deleted":
        # the recipe upcasts in the model and deletes the output before backward: only the
        # fp32 log-softmax survives; backward adds its gradient and the logits' fp32 gradient
        return 0.0, 3 * 4.0
    if prof.loss == "vocab-parallel":
        # Megatron: 16-bit logits held, fused fp32 softmax, gradient computed in place, cast
        return c, c + 4.0 + c
    held, _fwd, bwd = _loss_bytes_per_logit(spec, c, amp)
    return held + cap, bwd + cap


def _lora_activation_delta(spec: ModelSpec, k: Knobs, c: float, mask_b: float,
                           compiled: bool = False, merged: float = 0.0) -> tuple[float, float]:
    """Per token and block: (replicated, sharded) bytes LoRA changes. Frozen projections keep
    no input for a weight gradient, frozen norm weights no normalised copy; each adapter saves
    its A output, and the input its A matrix saw: the tensor the norm produced when nothing
    copies it (16-bit adapters, no dropout), else a copy of its own (``_adapter_input_bytes``).
    ``compiled``: the norms are fused (``layer_activation_bytes``' compiled inventory keeps no
    normalised copy to take off); ``merged``: the share of layers whose inventory holds the
    merged attention output that only o_proj's weight gradient keeps (``merged_copy``)."""
    h, f, r = spec.hidden, spec.f, k.lora_rank
    t = set(k.lora_targets)
    names = lora_projections(spec)
    adapters = c * r * len(t) + _adapter_input_bytes(k, c, mask_b) * sum(names[x][0] for x in t)
    # An adapter that copies its input (cast to fp32, dropout) saves the copy, not the input: the
    # input itself is then saved by nothing (its frozen projection keeps none), checked with
    # autograd's saved-tensor hooks on PEFT (tests/test_lora_saved_inputs.py). Measured on the
    # H200 before this rule: allocated over by exactly these inputs on 8 of 8 LoRA runs
    # (+0.3 to +5.0 GiB, the down_proj input the largest; docs/benchmarks.md).
    keeps = not _adapter_copies_input(k)
    if spec.arch == "llama":
        # normalised copies (frozen weights): Gemma's are fp32, and it has four norms a block
        # with ``sandwich_norms``
        if compiled:
            rep = 0.0
        else:
            rep = -spec.norms_per_layer * 4.0 * h if spec.gemma_norms else -2 * c * h
        if not (keeps and t & ATTN_NORM_READERS):
            rep -= c * h                                        # attention-norm output unsaved
        if not (keeps and t & MLP_NORM_READERS):
            rep -= c * h                                        # mlp-norm output unsaved
        shard = adapters - (0.0 if keeps and "down_proj" in t else c * f)  # down_proj input
        if merged and not (keeps and "o_proj" in t):
            shard -= merged * c * spec.heads * spec.d_head       # o_proj's copy of its input
        if spec.has_qk_norm and not compiled:                   # q/k norms' normalised copies
            shard -= (4.0 if spec.gemma_norms else c) * (spec.heads + spec.n_kv) * spec.d_head
        return rep, shard
    if spec.arch == "opt":
        return 0.0, adapters        # fc2's input is ReLU's output, which ReLU's backward saves
    down = {"gpt": "mlp.c_proj", "bert": "output.dense"}[spec.arch]
    return 0.0, adapters - (0.0 if keeps and down in t else c * f)   # GELU saves its input only


def _adapter_copies_input(k: Knobs) -> bool:
    """Whether each adapter makes its own copy of its input (``_adapter_input_bytes``)."""
    return bool(k.accelerate_amp or k.lora_dropout)


def _adapter_input_bytes(k: Knobs, c: float, mask_b: float) -> float:
    """Bytes per input element an adapter saves beside the base layer's input. PEFT's LoRA
    forward casts the input to the adapter's dtype (peft/tuners/lora/layer.py,
    ``_cast_input_dtype``): fp32 adapters (``autocast_adapter_dtype``, Frenzy's trainer with
    fp32 master weights) under Accelerate's autocast get an fp32 copy, and autocast casts it
    back to 16 bits for A's matmul, which saves that new 16-bit copy (c B). Dropout
    (``lora_dropout`` > 0) saves its mask (``mask_b``: CUDA bool) and makes a new tensor, which
    is the copy A saves when nothing casts it. Measured on the H200 (Llama-3.2-1B, r 16 on
    q_proj and v_proj, dropout 0.05): allocated 2.9 GiB above the estimate without the
    fp32 logits output (loss "auto", 1.96 GiB) and these terms (1.5 GiB); with both, 0.6 GiB
    (2%) above."""
    copy = c if _adapter_copies_input(k) else 0.0
    return copy + (mask_b if k.lora_dropout else 0.0)


@lru_cache(maxsize=4096)       # pure in its (hashable) arguments: per shape, not per batch
def _shape_terms(spec: ModelSpec, t: int, optimizer: str, s: int, c: float, act_amp: bool,
                 attention: str, act_ckpt: str, cpu: bool, fused: bool, repeat_kv: bool,
                 hf_models: bool, score_clamp: bool, ulysses: bool = False, lora_rank: int = 0,
                 lora_targets: tuple[str, ...] = (), *, window_share: float = 0.0) -> tuple:
    """The per-shape facts stage_peaks needs, one cache lookup (the model is hashed once, not
    per fact): parameter split, optimizer-state bytes per trainable parameter, the block's
    activation inventory and backward temporaries; then the model's dimensions it reads
    (hidden, padded vocabulary, embedding width, ffn, tied, arch, position rows, dropout on,
    cross-attention parameters per block), which are properties computed on each access."""
    sem = _cpu_sem(c) if cpu else CUDA_SEM
    rep, shard = layer_activation_bytes(spec, s, c, act_amp, attention, act_ckpt, sem,
                                        compiled=fused, repeat_kv=repeat_kv, hf_models=hf_models,
                                        score_clamp=score_clamp, ulysses=ulysses, window_share=window_share)
    st_b = _state_bytes_per_param(spec, optimizer, lora_rank, lora_targets)
    cross_block = spec.cross_attn_params() / spec.layers if spec.cross_attn_layers else 0.0
    return (*_param_split(spec, t), st_b, rep, shard,
            layer_backward_transient(spec, s, c, attention, t),
            spec.hidden, spec.vocab_padded, spec.e, spec.f, spec.tied, spec.arch, spec.positions,
            spec.dropout > 0, cross_block)


# The knobs the stages' shared terms depend on: all but the batch (micro_batch, grad_accum),
# which only the per-stage loop of stage_peaks reads
_SHAPE_KNOBS = tuple(f.name for f in fields(Knobs) if f.name not in ("micro_batch", "grad_accum"))
_shape_of = attrgetter(*_SHAPE_KNOBS)


class _StageSetup(NamedTuple):
    """What every stage of ``stage_peaks`` shares (``_stage_setup``), by name; ``stage_peaks``
    unpacks it in this order (tests/test_estimator_memory.py checks the two agree)."""

    c: float
    pure: bool
    torch_zero: bool
    lora: bool
    act_amp: bool
    sem: Any
    N: int
    w_b: float
    g_b: float
    opt_b: float
    g32_b: float
    layer_p: float
    emb_p: float
    head_p: float
    largest: float
    st_b: float
    transient_tok: float
    h: int
    V: int
    e: int
    f: int
    tied: bool
    arch: str
    positions: int
    dropout: bool
    step_tmp_b: float
    lora_p: float
    base_b: float
    head_w: float
    largest_tensor: float
    sp_div: int
    per_layer_tok: float
    r: float
    ckpt_keep_tok: float
    held_b: float
    bwd_loss_b: float
    logits_tok: float
    full: bool
    fsdp_sgo: bool
    w_div: int
    g_div: int
    o_div: int
    casts: bool
    layer_copies: float
    keep_tok: float
    e_unsharded: float
    inbwd: bool
    ddp_copy: bool


@lru_cache(maxsize=4096)       # pure in its (hashable) arguments: per shape, not per batch
def _stage_setup(spec: ModelSpec, prof: Profile, shape: tuple, cpu: bool) -> _StageSetup:
    """What every stage of ``stage_peaks`` shares: the regime's bytes per parameter, the
    per-shape facts, per-token activation terms and the sharding divisors, for the knobs
    ``shape`` (``_shape_of``; rebuilt with micro_batch and grad_accum 0, so a term here that
    read the batch would show at once)."""
    k = Knobs(micro_batch=0, grad_accum=0, **dict(zip(_SHAPE_KNOBS, shape)))
    zero, loss, optimizer = k.zero, k.loss, k.optimizer
    c = 4.0 if k.precision == "fp32" else 2.0
    pure = c < 4 and k.master == "none"
    torch_zero = _torch_zero(prof, k.pp)
    amp = _amp_regime(prof, k.precision, k.master, zero, k.pp, k.mp_style)
    master = c < 4 and not amp and not pure
    lora = k.finetune != "full"
    act_amp = amp and not lora                 # a LoRA base is loaded in 16 bits
    # the share of a stage's blocks attending through a sliding window (pipeline chunks: the
    # largest; full checkpointing's one live block: a windowed one where there is any)
    share = spec.window_share(k.seq_len, k.pp * k.vpp, k.act_ckpt == "full")
    sem = _cpu_sem(c) if cpu else CUDA_SEM
    N = k.dp * k.cp                                   # ZeRO sharding degree
    t = k.tp

    # bytes per trainable parameter by regime
    if master:
        w_b, g_b, opt_b, g32_b = 2.0, 2.0, 4.0, 4.0   # opt_b: fp32 master copy; g32: fp32 grads
    elif pure:
        # 16-bit weights, gradients and states; DeepSpeed still keeps a 16-bit master partition
        # and master gradients (bf16_master_weights_and_grads)
        dup = c if prof.master_copy_when_pure and zero >= 1 else 0.0
        w_b, g_b, opt_b, g32_b = c, c, dup, dup
    else:
        w_b, g_b, opt_b, g32_b = 4.0, 4.0, 0.0, 0.0
    (layer_p, emb_p, head_p, largest, st_b, rep, shard, transient_tok,
     h, V, e, f, tied, arch, positions, dropout, cross_block) = _shape_terms(
        spec, t, optimizer, k.seq_len, c, act_amp, k.attention, k.act_ckpt, cpu, k.fused,
        prof.repeat_kv, prof.hf_models, k.score_clamp, k.cp > 1, *_lora_key(k), window_share=share)
    if pure and optimizer in ("adam", "adamw", "sgd"):
        st_b *= c / 4.0                                # states in the parameters' dtype
    # torch's foreach Adam/AdamW materialises sqrt(v): one state-sized copy; fused kernels none.
    # PyTorch 2.0/2.1 built the denominator out of place (denom = _foreach_add(sqrt(v), eps)),
    # so sqrt(v) and denom are both alive at _foreach_addcdiv_: two copies. The Lightning FSDP
    # tables (PyTorch 2.1, fp32 Adam) measure 7.0, 6.0, 3.07 and 3.01 x the fp32 parameter
    # bytes for DDP, NO_SHARD, SHARD_GRAD_OP and FULL_SHARD over 2 GPUs: 4 + 2 temporaries
    # (+ DDP's bucket copy), and 2.5 + 2 x 0.25 sharded, which one temporary cannot reach
    step_tmp_b = 0.0
    if optimizer in ("adam", "adamw") and k.adamw_impl in ("foreach", "foreach-legacy"):
        step_tmp_b = (4.0 if not pure else c) * (2 if k.adamw_impl == "foreach-legacy" else 1)

    if cross_block:                                    # decoder cross-attention, spread per block
        layer_p += cross_block / t
    lora_p = lora_layer_params(spec, k) / t if lora else 0.0
    base_b = 0.0
    if lora:                                           # the frozen base, in 16 bits (or NF4)
        mat_b = NF4_BYTES if k.finetune == "qlora" else c
        vec_l = _layer_vector_params(spec)
        base_b = mat_b * (layer_p - vec_l) + c * vec_l   # per block
    head_w = V * e / t                                 # the (vocab-parallel) LM head's weight
    largest_tensor = max(head_w, spec.largest_block_matrix / t)

    if lora:
        d_rep, d_shard = _lora_activation_delta(
            spec, k, c, sem.mask_bytes, compiled=k.fused and not act_amp,
            merged=merged_copy(spec, c, k.attention, prof.hf_models, k.cp > 1, sem.cuda, share))
        rep, shard = rep + d_rep, shard + d_shard
    sp_div = t if k.sp else 1                          # sequence parallelism shards the rest
    per_layer_tok = ((rep / t if k.sp else rep) + shard / t
                     + window_mask_bytes(spec, k.seq_len, c, k.attention, k.act_ckpt, prof.hf_models, not cpu,
                                         share))
    r = 4.0 if act_amp else c
    ckpt_keep_tok = r * h / sp_div                    # full ckpt keeps the block input
    held_b, bwd_loss_b = _loss_terms(spec, k, prof, c, act_amp)
    logits_tok = V / t if loss != "none" else 0.0     # vocab-parallel logits per token

    full = k.act_ckpt == "full"
    if k.act_ckpt == "selective" and prof.selective_ac == "op":
        # per-op selective checkpointing: a checkpointed block (its input kept, one block
        # recomputed in the backward, as full) that also keeps its save list's outputs
        full = True
        ckpt_keep_tok += op_sac_saved_tok(spec, c, t, k.sp)
    # FSDP SHARD_GRAD_OP (torch's ZeRO-2; a pipeline's ZeRO-2 is FSDP2 without resharding
    # after the forward) keeps sharded parameters between steps and the unsharded ones from
    # the forward until each unit's post-backward reshard: the step sees only the shards,
    # the forward and backward the whole model (``unsharded``)
    fsdp_sgo = zero == 2 and torch_zero and N > 1
    w_div = N if zero >= 3 or fsdp_sgo else 1          # who shards weights, gradients, states
    g_div = N if zero >= 2 else 1
    o_div = N if zero >= 1 else 1
    casts = amp and not lora                           # autocast's 16-bit weight copies
    layer_copies = 2.0 * layer_p if casts else 0.0
    keep_tok = ckpt_keep_tok if full else per_layer_tok
    # (FSDP SHARD_GRAD_OP: the other units have resharded; the first block's stays whole)
    e_unsharded = w_b * layer_p if fsdp_sgo else 0.0
    # optimizer in backward: each tensor is stepped by its own (per-tensor, non-foreach)
    # Adam as its gradient lands: sqrt(v) and its quotient are two state-sized temporaries
    # of that tensor, at worst the largest, while the head's gradient exists (phase B)
    inbwd = k.opt_in_bwd and optimizer in ("adam", "adamw") and k.adamw_impl != "fused"
    # DDP buckets (gradient_as_bucket_view=False), also under ZeroRedundancyOptimizer
    ddp_copy = prof.ddp_bucket_copy and not k.bucket_view
    return _StageSetup(c=c, pure=pure, torch_zero=torch_zero, lora=lora, act_amp=act_amp, sem=sem,
                       N=N, w_b=w_b, g_b=g_b, opt_b=opt_b, g32_b=g32_b, layer_p=layer_p,
                       emb_p=emb_p, head_p=head_p, largest=largest, st_b=st_b,
                       transient_tok=transient_tok, h=h, V=V, e=e, f=f, tied=tied, arch=arch,
                       positions=positions, dropout=dropout, step_tmp_b=step_tmp_b, lora_p=lora_p,
                       base_b=base_b, head_w=head_w, largest_tensor=largest_tensor, sp_div=sp_div,
                       per_layer_tok=per_layer_tok, r=r, ckpt_keep_tok=ckpt_keep_tok, held_b=held_b,
                       bwd_loss_b=bwd_loss_b, logits_tok=logits_tok, full=full, fsdp_sgo=fsdp_sgo,
                       w_div=w_div, g_div=g_div, o_div=o_div, casts=casts,
                       layer_copies=layer_copies, keep_tok=keep_tok, e_unsharded=e_unsharded,
                       inbwd=inbwd, ddp_copy=ddp_copy)


def stage_peaks(spec: ModelSpec, k: Knobs, ov: Overheads, cpu: bool = False) -> list[StagePeak]:
    """Peak allocated bytes per pipeline stage, with the breakdown at each stage's peak."""
    return _peaks(spec, k, ov, cpu, ((k.micro_batch, k.grad_accum),), True)[0]


def peak_allocated(spec: ModelSpec, k: Knobs, ov: Overheads, cpu: bool,
                   batches: "tuple[tuple[int, int], ...]", terms: tuple | None = None) -> list[float]:
    """The largest stage's allocated peak (bytes) of ``k`` run at each (micro_batch, grad_accum)
    of ``batches`` instead of its own: ``max(s.allocated for s in stage_peaks(...))`` of each,
    to the bit, with what does not depend on the batch computed once (the planner's memory
    table asks every micro-batch of every structure); ``terms``: ``peak_terms(spec, k, ov,
    cpu)`` kept from an earlier call (the planner asks a structure again for each global batch)."""
    return _peaks(spec, k, ov, cpu, batches, False, terms)


def peak_terms(spec: ModelSpec, k: Knobs, ov: Overheads, cpu: bool) -> tuple:
    """What ``_peaks`` computes of ``k`` before it reads a batch: what it reads of the shared
    setup (``_stage_setup``) and, per pipeline stage, its model states, buffers and
    optimizer-step total. Pure in its arguments (``k``'s micro-batch and accumulation are not read): the
    planner keeps it per structure and asks it of every global batch."""
    prof = get_profile(k.framework)
    setup = _stage_setup(spec, prof, _shape_of(k), cpu)
    (c, pure, torch_zero, lora, act_amp, sem, N, w_b, g_b, opt_b, g32_b, layer_p, emb_p,
     head_p, largest, st_b, transient_tok, h, V, e, f, tied, arch, positions, dropout,
     step_tmp_b, lora_p, base_b, head_w, largest_tensor, sp_div, per_layer_tok, r,
     ckpt_keep_tok, held_b, bwd_loss_b, logits_tok, full, fsdp_sgo, w_div, g_div, o_div,
     casts, layer_copies, keep_tok, e_unsharded, inbwd, ddp_copy) = setup
    zero, offload, loss, optimizer, opt_in_bwd = k.zero, k.offload, k.loss, k.optimizer, k.opt_in_bwd
    t, p, dp, act_offload = k.tp, k.pp, k.dp, k.act_offload
    bucket_elems = k.bucket or prof.zero_bucket_elems or ov.zero_bucket_elems

    stages = []
    made: dict[tuple, tuple] = {}      # what is read below: (layers, first, last) -> its stage
    for i, L_i in enumerate(stage_layers(spec.layers, p)):
        first, last = i == 0, i == p - 1
        same = made.get((L_i, first, last))
        if same is not None:           # a middle stage as deep as an earlier one: all but its index
            stages.append((i,) + same[1:])
            continue
        P = L_i * layer_p + (emb_p if first else 0.0) + (head_p if last else 0.0)
        if last and p > 1 and tied:
            P += head_w                                # last stage keeps its copy of the tied head
        Pt = L_i * lora_p if lora else P               # trainable parameters
        frozen_w = 0.0
        if lora:                                       # embeddings, head, norms stay 16-bit
            frozen_w = L_i * base_b + c * (P - L_i * layer_p)
        cast_P = 0.0
        if casts and zero <= 1:  # autocast's 16-bit copies of every weight a matmul uses (not the lookup tables)
            cast_P = P - (emb_p if first and not tied else 0.0)
            if first and tied and not last:
                cast_P -= emb_p
            if first and arch in ("gpt", "opt", "bert"):
                cast_P -= positions * h
        # --- model states (persistent) ---
        weights = (frozen_w + w_b * Pt) / w_div
        unsharded = (frozen_w + w_b * Pt) if fsdp_sgo else 0.0
        if offload == "optimizer+params":
            weights = 0.0
        grads = g_b * Pt / g_div
        optim = (opt_b + st_b) * Pt / o_div
        if offload != "none":
            optim = 0.0
            if offload == "optimizer+params":
                grads = 0.0                            # gradients stream to the CPU too
            elif zero == 3 and prof.overlap_comm:
                # DeepSpeed ZeRO-3 with offload_optimizer keeps its gradient partitions on the
                # host: stage3.py sets self.device to the CPU and allocates the partition
                # buffer (grad_partitions_flat_buffer) and the fp32 gradients there, pinned;
                # each reduced bucket is copied out (partition_grads) and its GPU grads freed
                grads = 0.0
        g32_elems = Pt / o_div
        if zero == 3 and prof.zero3_subgroup_elems:
            g32_elems = min(g32_elems, prof.zero3_subgroup_elems)   # one sub-group at a time
        grads32 = g32_b * g32_elems if offload == "none" else 0.0
        # --- persistent buffers ---
        other_fixed = 0.0
        after_bwd = 0.0                                # buffers made once the backward is over
        if tied and p > 1 and t > 1 and (first or last) and prof.pipeline_tie_whole:
            # the frenzy pipeline sums a tied embedding's two copies whole beside tensor parallel
            # (the embeddings shard the hidden size, the head the vocabulary:
            # Pipeline.sum_tied_gradients): after the backward the first and last stage gather
            # the whole V x e gradient (DTensor.full_tensor); the first stage's hidden-size shards
            # are concatenated out of the all-gather's buffer, a second whole copy (torch 2.13,
            # read in the code, not measured)
            after_bwd = (2.0 if first else 1.0) * g_b * V * e
        if dp > 1 and zero == 0:
            if ddp_copy:
                other_fixed += g_b * Pt                # DDP buckets
            elif prof.zero_bucket_elems:
                # DeepSpeed's zero-0 all-reduce flattens the gradients into buffers of up to
                # reduce_bucket_size elements after the backward (engine.allreduce_gradients ->
                # buffered_allreduce_fallback): the activations are gone by then
                after_bwd = max(after_bwd, c * min(Pt, bucket_elems))
        elif zero in (1, 2) and not torch_zero and (dp > 1 or not cpu):
            # DeepSpeed's reduce (ipg) buffer of reduce_bucket_size elements, allocated in
            # engine.backward() before loss.backward() (stage_1_and_2.py: self.ipg_buffer), at
            # any world size on GPUs; a second one with overlap_comm (double buffering). The
            # all-gather after the step writes into the flat 16-bit parameter buffer itself
            # (no buffer of allgather_bucket_size). The CPU trace these are checked against
            # runs one rank without DeepSpeed
            other_fixed += (2 if k.overlap_comm else 1) * c * min(Pt, bucket_elems)
        elif dp > 1 and zero == 1 and ddp_copy:
            other_fixed += g_b * Pt                    # ZeroRedundancyOptimizer runs under DDP
        if zero == 3 and not prof.torch_sharding and (dp > 1 or not cpu):
            # DeepSpeed stage 3 with contiguous_gradients (default) reduces through one 16-bit
            # buffer of reduce_bucket_size elements (stage3.py: bucket.buffer = torch.empty(...))
            other_fixed += c * min(Pt, bucket_elems)
        if zero == 3:
            # gathered 16-bit parameters of the current unit (at worst the largest) and the
            # prefetched ones (blocks), and the current unit's unsharded gradients
            other_fixed += (c * (largest + (ov.zero3_live_units - 1) * layer_p)
                            + (0.0 if lora else g_b * largest))
            if prof.fsdp2_copy_in and not lora and N > 1:
                other_fixed += g_b * largest           # FSDP2's reduce-scatter input copy
        if k.finetune == "qlora":
            other_fixed += c * spec.largest_block_matrix / t   # one weight dequantised for its matmul
        # --- what the batch does not change ---
        # activation offloading copies each block's saved tensors to the CPU as the forward
        # moves on: the GPU holds the block in flight
        kept_layers = min(L_i, 1) if act_offload else L_i
        fin = 0.0                                      # the final norm's saved bytes per token
        head_grad = 0.0
        if last:
            if arch == "llama":
                # Gemma's norm keeps its normalised copy in fp32 whatever the regime
                fin = (4 * h + (4 if act_amp or spec.gemma_norms else c) * h + c * h + 4)
            elif arch == "bert":
                fin = 3 * c * h + 2 * sem.stat_bytes + r * h
            else:
                fin = r * h + 2 * sem.stat_bytes + c * h
            if loss != "none" and not lora:
                head_grad = (g_b if zero < 2 else g_b / N) * V * e / t
        copies = 2.0 * cast_P if casts else 0.0
        if full and casts:
            # checkpointed blocks run their forward without keeping autocast's weight copies;
            # only the LM head's survives to its backward; recomputation re-creates one block's
            copies = 2.0 * head_w if last else 0.0
        inbwd_tmp = 2 * (c if pure else 4.0) * min(Pt, largest_tensor) if inbwd else 0.0
        # phase B' (below): the other blocks' gradients at the first block's backward
        grads_end = grads * max(0.0, P - layer_p) / P if P > 0 else 0.0
        if opt_in_bwd:                                 # each gradient is applied, then freed
            grads_end = g_b * min(Pt, largest_tensor)
        # phase C: optimizer step (inside backward, one tensor at a time, with opt_in_bwd)
        tmp = step_tmp_b * Pt / o_div if offload == "none" else 0.0
        if optimizer == "adafactor":
            tmp = 3 * 4.0 * largest_tensor
        if opt_in_bwd:
            c_total = weights + optim + other_fixed + g_b * min(Pt, largest_tensor) + inbwd_tmp
        else:
            c_total = weights + grads + optim + other_fixed + max(after_bwd, grads32 + tmp)
        stages.append((i, L_i, first, last, kept_layers, fin, weights, unsharded, grads, optim,
                       other_fixed, head_grad, copies, inbwd_tmp, grads_end, c_total, after_bwd,
                       grads32, tmp))
        made[(L_i, first, last)] = stages[-1]
    # what the batch loop reads of the setup (the planner keeps these per structure, not the
    # whole record: its memory of a trace's structures)
    consts = (c, act_amp, sem, transient_tok, h, V, e, arch, dropout, sp_div, per_layer_tok, r,
              ckpt_keep_tok, held_b, bwd_loss_b, logits_tok, full, layer_copies, keep_tok, e_unsharded)
    return consts, tuple(stages)


def _peaks(spec: ModelSpec, k: Knobs, ov: Overheads, cpu: bool, batches: tuple, breakdown: bool,
           terms: tuple | None = None) -> list:
    """Per (micro_batch, grad_accum) of ``batches``: the stages' ``StagePeak`` (``breakdown``), or
    the largest stage's allocated bytes; ``terms``: ``peak_terms`` of the same arguments, when
    the caller kept them."""
    consts, stages = terms if terms is not None else peak_terms(spec, k, ov, cpu)
    (c, act_amp, sem, transient_tok, h, V, e, arch, dropout, sp_div, per_layer_tok, r,
     ckpt_keep_tok, held_b, bwd_loss_b, logits_tok, full, layer_copies, keep_tok, e_unsharded) = consts
    loss, opt_in_bwd, p, vpp = k.loss, k.opt_in_bwd, k.pp, k.vpp
    chunked = loss == "chunked"

    out: list = [[] for _ in batches] if breakdown else [0.0] * len(batches)
    # Only the largest stage counts without a breakdown: a middle stage as deep as an earlier
    # middle one differs from it only by its 1F1B in-flight micro-batches (min(m, p - i), fewer
    # for a later i), so it never peaks higher and is skipped (half the work of a 16-stage
    # pipeline; an interleaved schedule's in-flight count is not read here, so never skipped)
    seen_middle: set[int] | None = None if breakdown or vpp > 1 else set()
    for (i, L_i, first, last, kept_layers, fin, weights, unsharded, grads, optim, other_fixed,
         head_grad, copies, inbwd_tmp, grads_end, c_total, after_bwd, grads32, tmp) in stages:
        if seen_middle is not None and not first and not last:
            if L_i in seen_middle:
                continue
            seen_middle.add(L_i)
        # --- what it does: per (micro-batch, accumulation) ---
        for bi, (mb_, ga_) in enumerate(batches):
            T = mb_ * k.seq_len / k.cp                # tokens per micro-batch on this rank
            m = ga_
            persist = (m > 1 or p > 1) and not opt_in_bwd
            # --- activations of the in-flight micro-batches ---
            # 1F1B: stage i has started p - i micro-batches before its first backward
            inflight = min(m, p - i) if p > 1 else 1
            if vpp > 1:
                inflight = _interleaved_inflight(p, vpp, m, i)
            acts = inflight * kept_layers * keep_tok * T
            if first:
                acts += inflight * T * 16.0                # input ids + labels (int64)
                if dropout:
                    acts += inflight * T * sem.mask_bytes * h / sp_div
                if arch == "bert":
                    acts += inflight * T * (r * h + 2 * sem.stat_bytes + (4 if act_amp else 1) * c * h)
            loss_a = 0.0
            fin_acts = 0.0
            if last:
                # the final norm's saved tensors: alive until its own backward, which runs before
                # any block's (phase A has them, phase B does not)
                fin_acts = T * fin / sp_div
                acts += T * held_b * logits_tok            # logits held by the model output
                loss_a = T * (bwd_loss_b - held_b) * logits_tok
                if loss == "fused-linear":
                    # Liger: the head's gradient and the hidden states' gradient are made in the
                    # forward, and one chunk of ~T*h/V rows of logits (power of 2: up to 2x)
                    loss_a += c * V * e + c * T * h + 2 * c * T * h
            # recomputation buffer and backward temporaries for one block
            one_layer = per_layer_tok * T if full else 0.0
            trans = transient_tok * T
            persist_grads = grads if persist else 0.0
            states_fwd = weights + optim + persist_grads + other_fixed + unsharded
            head_g = 0.0 if persist else head_grad
            # phase A: loss backward (last stage) / phase B: the last block's backward. A chunked
            # loss runs the head's backward chunk by chunk inside it: the head's gradient exists
            # while later chunks' logits are still held
            a_total = (states_fwd + copies + acts + fin_acts + loss_a
                       + (head_g if chunked else 0.0))
            b_extra = one_layer + trans + (layer_copies if full else 0.0)
            b_total = states_fwd + copies + acts + b_extra + head_g + inbwd_tmp
            # phase B': the first block's backward: the other blocks' gradients exist, their
            # activations are freed; one block's activations (recomputed under full ckpt) remain
            first_acts = (ckpt_keep_tok * T + one_layer) if full else per_layer_tok * T
            fixed_acts = (T * 16.0 if first else 0.0) + (T * held_b * logits_tok if last else 0.0)
            e_extra = first_acts + fixed_acts + trans + layer_copies
            e_total = (weights + optim + other_fixed + max(grads_end, persist_grads) + e_extra
                       + e_unsharded)
            total = max(a_total, b_total, c_total, e_total)
            if not breakdown:
                if total > out[bi]:
                    out[bi] = total
                continue
            # the breakdown of the phase that peaks (weights, gradients, optimizer, activations, other)
            if total == a_total:
                bd = (weights + unsharded, persist_grads + (head_g if chunked else 0.0),
                      optim, acts + fin_acts + loss_a, other_fixed + copies)
            elif total == b_total:
                bd = (weights + unsharded, persist_grads + head_g, optim, acts + one_layer,
                      other_fixed + copies + trans + (layer_copies if full else 0.0) + inbwd_tmp)
            elif total == c_total and not opt_in_bwd:
                step_extra = max(after_bwd, grads32 + tmp)
                bd = (weights, grads, optim + (grads32 if step_extra > after_bwd else 0.0), 0.0,
                      other_fixed + (tmp if step_extra > after_bwd else after_bwd))
            elif total == c_total:
                bd = (weights, 0.0, optim, 0.0, c_total - weights - optim)
            else:
                bd = (weights + e_unsharded, max(grads_end, persist_grads), optim, first_acts + fixed_acts,
                      other_fixed + trans + layer_copies)
            out[bi].append(StagePeak(i, L_i, total, *bd))
    return out


# ZeRO-Offload's host memory per offloaded trainable parameter of a process's partition: its fp32
# master copy (4 B), its fp32 gradient (4 B) and the optimizer's states (Adam: two fp32 moments,
# 8 B); with the parameters offloaded too, also their 16-bit copy. That is DeepSpeed's own count
# (estimate_zero2/zero3_model_states_mem_needs: 16 B, 18 B with parameter offload), and its 1.5x
# for the pinned staging buffers and allocator slack around them (additional_buffer_factor).
OFFLOAD_HOST_MASTER_B = 4.0
OFFLOAD_HOST_GRAD_B = 4.0
OFFLOAD_HOST_BUFFER_FACTOR = 1.5


def host_offload_bytes(spec: ModelSpec, k: Knobs) -> float:
    """Host bytes one training process of ``k`` holds for ZeRO-Offload (its partition of the
    most-loaded pipeline stage; 0 without offload). Per node: this times its processes."""
    if k.offload == "none":
        return 0.0
    c = 4.0 if k.precision == "fp32" else 2.0
    st_b = _state_bytes_per_param(spec, k.optimizer, *_lora_key(k))
    layer_p, emb_p, head_p, _ = _param_split(spec, k.tp)
    lora = k.finetune != "full"
    lora_p = lora_layer_params(spec, k) / k.tp if lora else 0.0
    N = max(1, k.dp * k.cp)                            # offload needs ZeRO: partitions over dp x cp
    layers = stage_layers(spec.layers, k.pp)
    worst = 0.0
    for i, L_i in enumerate(layers):
        first, last = i == 0, i == len(layers) - 1
        P = L_i * layer_p + (emb_p if first else 0.0) + (head_p if last else 0.0)
        if last and k.pp > 1 and spec.tied:
            P += spec.vocab_padded * spec.e / k.tp     # the last stage's copy of the tied head
        Pt = L_i * lora_p if lora else P
        b = (OFFLOAD_HOST_MASTER_B + st_b + OFFLOAD_HOST_GRAD_B) * Pt
        if k.offload == "optimizer+params":
            b += c * P                                 # the 16-bit parameters (a LoRA base too)
        worst = max(worst, b / N)
    return worst * OFFLOAD_HOST_BUFFER_FACTOR


def paged_state_bytes(spec: ModelSpec, k: Knobs) -> float:
    """Bytes of optimizer state in CUDA unified memory (bitsandbytes paged optimizers: the two
    uint8 states of every trainable tensor of 1e5+ elements; see _bnb8_state_bytes), per GPU:
    device memory the caching allocator never sees."""
    if k.optimizer != "adamw8bit-paged" or k.offload != "none":
        return 0.0
    return _bnb8_state_bytes(spec, *_lora_key(k), True)[1] / (k.tp * k.pp)


def _lora_key(k: Knobs) -> tuple[int, tuple[str, ...]]:
    """(rank, targets) of the trainable adapters; (0, ()) when the whole model trains."""
    return (0, ()) if k.finetune == "full" else (k.lora_rank, k.lora_targets)


def _comms(k: Knobs) -> int:
    return (k.dp > 1) + (k.tp > 1) + (k.pp > 1) + (k.cp > 1)


def _fragmentation(ov: Overheads, k: Knobs) -> float:
    if k.act_ckpt == "full":
        return ov.fragmentation_recompute_expandable if k.expandable else ov.fragmentation_recompute
    return ov.fragmentation_adapters if k.expandable and k.finetune != "full" else ov.fragmentation


def _outside_allocator_gib(ov: Overheads, k: Knobs) -> float:
    return ov.cuda_context_gib + ov.workspace_gib + ov.nccl_per_comm_gib * _comms(k)


def _finish(alloc_b: float, ov: Overheads, k: Knobs) -> tuple[float, float, float]:
    """allocated -> reserved (fragmentation; recomputation churns more) -> device used."""
    alloc = alloc_b / GIB
    reserved = alloc * (1.0 + _fragmentation(ov, k))
    used = reserved + _outside_allocator_gib(ov, k)
    return alloc, reserved, used


def finish_key(k: Knobs) -> tuple:
    """All ``_finish`` and ``_alloc_limit_b`` read of ``k`` (``_fragmentation``: checkpointing,
    the allocator setting, adapters; ``_outside_allocator_gib``: the communicators): knobs
    with equal keys have equal limits, so the planner asks once per key and GPU type."""
    return (k.act_ckpt, k.expandable, k.finetune != "full", _comms(k))


def batch_key(k: Knobs, grad_accum: int) -> int:
    """All ``_peaks`` reads of a gradient accumulation of ``k``: whether gradients persist
    between micro-batches (more than one) and the micro-batches a plain 1F1B pipeline has in
    flight (``min(m, pp - stage)``): ``min(grad_accum, max(pp, 2))``; an interleaved schedule
    reads all of it (``_interleaved_inflight``). Equal keys, equal peaks: the planner's memory
    tables share them across global batches."""
    return grad_accum if k.vpp > 1 else min(grad_accum, max(k.pp, 2))


def _alloc_limit_b(used_gib: float, ov: Overheads, k: Knobs) -> float:
    """The inverse of ``_finish``: the most allocated bytes whose device-used figure stays
    within ``used_gib``."""
    return (used_gib - _outside_allocator_gib(ov, k)) / (1.0 + _fragmentation(ov, k)) * GIB


def _resolve_gpu(gpu: Any):
    """A catalog name, or a GPU object itself (a cluster's custom type)."""
    if gpu is None:
        return None
    if type(gpu) is str and gpu in CATALOG:         # the common case, first
        return CATALOG[gpu]
    if hasattr(gpu, "memory_gib"):
        return gpu
    return get_gpu(str(gpu))


def estimate(model: Any = None, *, arch: str | None = None, layers: int | None = None,
             hidden: int | None = None, heads: int | None = None, kv_heads: int | None = None,
             ffn: int | None = None, vocab: int | None = None,
             tied_embeddings: bool | None = None, seq_len: int = 1024, micro_batch: int = 1,
             grad_accum: int = 1, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1,
             sp: bool = False, vpp: int = 1, zero: int = 0, offload: str = "none",
             precision: str = "bf16", optimizer: str = "adamw", act_ckpt: str = "none",
             attention: str = "flash", gpu: Any = None, method: str = "analytic",
             mp_style: str = "auto", model_factory: Any = None, framework: str = "frenzy",
             master_weights: str = "auto", finetune: str = "full", lora_rank: int | None = None,
             lora_targets: Any = None, loss: str = "auto", act_offload: bool = False,
             optimizer_in_backward: bool = False, adamw_impl: str = "auto",
             fused_kernels: bool = False, zero_bucket_elems: float | None = None,
             gradient_as_bucket_view: bool | None = None, overlap_comm: bool | None = None,
             score_clamp: bool = False, lora_dropout: float | None = None, allocator: str = "auto") -> Estimate:
    """Per-GPU training memory of one configuration (see the module docstring).

    ``model``: preset name, path to a HF config.json, dict of dimensions or ModelSpec; or the
    dimension keywords. ``method``: "analytic" (microseconds) or "traced" (runs one real step
    of the model under FakeTensorMode on the CPU; falls back to analytic with a warning).
    ``gpu``: a catalog name, or a ``catalog.GPU`` (a cluster's own type).
    ``framework``: the implementation profile (estimator.profiles: frenzy, hf, torchtitan,
    megatron, deepspeed, torchtune, lightning). Technique knobs: ``master_weights`` (auto: the
    profile's; fp32; none = pure 16-bit), ``finetune`` (full, lora, qlora; ``lora_rank``,
    ``lora_targets``, ``lora_dropout``: rank 16, the architecture's projections, no dropout
    unless given; given with a full fine-tune, an error), ``loss`` (auto: the profile's path; standard, chunked,
    fused-linear, fp32-logits, none), ``act_offload``,
    ``optimizer_in_backward``, ``adamw_impl`` (auto, foreach, foreach-legacy, fused, for-loop), ``fused_kernels``
    (torch.compile / Liger: fused RMSNorm and SwiGLU save fewer tensors), ``zero_bucket_elems``
    (DeepSpeed reduce_bucket_size; default: the profile's, else Frenzy's trainer config),
    ``gradient_as_bucket_view`` (DDP without its bucket copy of the gradients, as FSDP NO_SHARD;
    default: the profile's), ``overlap_comm`` (DeepSpeed's; default: its own per stage, off
    in Frenzy's trainer config), ``score_clamp`` (eager attention of transformers 4.2x OPT /
    Llama, which clamps the masked scores and saves them), ``allocator`` (the caching allocator's
    mode, which sets reserved and device used: auto = the profile's, ``default``, or
    ``expandable`` = ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``).
    """
    if (arch is None and layers is None and hidden is None and heads is None and kv_heads is None
            and ffn is None and vocab is None and tied_embeddings is None):
        spec = model_from_kwargs(model)           # the common case: no dimension keywords to sift
    else:
        spec = model_from_kwargs(model, arch=arch, layers=layers, hidden=hidden, heads=heads,
                                 kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                                 tied_embeddings=tied_embeddings)
    # 4096, 4096.0 and "4096" are one length (``_pos_int``): the position table follows it alike
    spec = with_positions(spec, _pos_int("seq_len", seq_len))
    if finetune == "full" and (lora_rank is not None or lora_targets is not None or lora_dropout is not None):
        # adapter settings on a full fine-tune were ignored without a word (the CLI refuses them)
        given = ", ".join(n for n, v in (("lora_rank", lora_rank), ("lora_targets", lora_targets),
                                         ("lora_dropout", lora_dropout)) if v is not None)
        raise FrenzyInputError("finetune", f"{given}: adapter settings need finetune lora or qlora (got 'full')")
    lora_rank = DEFAULT_LORA_RANK if lora_rank is None else lora_rank
    lora_dropout = 0.0 if lora_dropout is None else lora_dropout
    attention = attention_for(spec, attention, framework)
    k = _knobs(framework, spec, seq_len, micro_batch, grad_accum, dp, tp, pp, cp, sp, vpp, zero,
               offload, precision, optimizer, act_ckpt, attention, mp_style, master_weights,
               finetune, lora_rank, lora_targets, loss, act_offload, optimizer_in_backward,
               adamw_impl, fused_kernels, zero_bucket_elems, gradient_as_bucket_view,
               overlap_comm, score_clamp, lora_dropout, allocator)
    if method not in ("analytic", "traced"):
        raise FrenzyInputError("method", f"must be analytic or traced (got {method!r})")
    g = _resolve_gpu(gpu)
    if method == "traced":
        from .traced import traced_estimate
        return traced_estimate(spec, k, gpu=g, model_factory=model_factory)
    return analytic_estimate(spec, k, g)


def shape_warnings(spec: ModelSpec, seq_len: int, attention: str, framework: str) -> list[str]:
    """What an estimate of this model at this sequence length, attention and framework says
    beside its figures, whatever the plan: where no measured source reaches, or the memory is
    traced rather than measured (``Estimate.warnings``; the planner's CLI prints them too)."""
    notes, prof = [], get_profile(framework)
    if seq_len > COVERED_SEQ:
        notes.append(f"seq_len {seq_len} is beyond any measured source ({COVERED_SEQ} tokens): "
                     "the estimate extrapolates")
    if spec.window_reached(seq_len) and attention == "flash" and prof.hf_models:
        notes.append(f"{spec.name}'s sliding window ({spec.window} tokens) is not longer than seq_len: SDPA "
                     f"attends through an explicit {seq_len} x {seq_len} mask with k / v repeated to every "
                     f"head in {spec.windowed_layers()} of its {spec.layers} layers (their memory counted as traced "
                     f"on the CPU, not measured on a GPU)")
    if _eager_only(spec, prof):
        notes.append(f"{spec.name} attends with eager kernels (Hugging Face has no SDPA path for its "
                     f"soft-capped scores): its attention keeps every head's s x s scores")
    return notes


def analytic_estimate(spec: ModelSpec, k: Knobs, g: Any = None, *, cpu: bool | None = None) -> Estimate:
    is_cpu = bool(getattr(g, "is_cpu", False)) if cpu is None else cpu
    ov = overheads_for(g.name if g is not None else None, is_cpu=is_cpu)
    peaks = stage_peaks(spec, k, ov, is_cpu)
    # _finish per stage, with its two overhead terms computed once
    grow = (1.0 + _fragmentation(ov, k)) / GIB
    outside = _outside_allocator_gib(ov, k)
    paged = paged_state_bytes(spec, k) / GIB
    stages = []
    top = peaks[0]
    for sp_ in peaks:
        r = sp_.allocated * grow
        stages.append(_built(StageMemory, _STAGE_FIELDS, {
            "stage": sp_.stage, "layers": sp_.layers, "allocated_peak_gib": sp_.allocated / GIB,
            "reserved_peak_gib": r, "device_used_gib": r + outside + paged if paged else r + outside}))
        if sp_.allocated > top.allocated:
            top = sp_
    a = top.allocated / GIB
    r = top.allocated * grow
    u = r + outside
    bd = {"weights": top.weights / GIB, "gradients": top.gradients / GIB,
          "optimizer": top.optimizer / GIB, "activations": top.activations / GIB,
          "other": top.other / GIB}
    mem = getattr(g, "memory_gib", None)
    notes: list[str] = []
    ovd = ov.as_dict()
    if paged:
        # unified-memory pages occupy the device when touched, outside the caching allocator
        # (the stages' device_used carry them above)
        u += paged
        ovd["paged_optimizer_gib"] = paged
        notes.append(f"{paged:.2f} GiB of paged 8-bit optimizer state is in CUDA unified memory: "
                     "counted in device_used, not in allocated/reserved")
    notes += shape_warnings(spec, k.seq_len, k.attention, k.framework)
    if k.fused and spec.arch not in ("llama", "gpt"):
        notes.append(f"fused_kernels change only llama/gpt block inventories; {spec.arch} is modelled eager")
    name = getattr(g, "name", None)
    return _built(Estimate, _ESTIMATE_FIELDS, {
        "params": spec.params, "allocated_peak_gib": a, "reserved_peak_gib": r,
        "device_used_gib": u, "breakdown_gib": bd, "stages": stages, "method": "analytic",
        "model": spec.name, "gpu": name, "gpu_memory_gib": mem,
        "fits": (u <= mem) if mem is not None else None, "overheads": ovd, "warnings": notes,
        "framework": k.framework, "host_offload_gib": host_offload_bytes(spec, k) / GIB})
