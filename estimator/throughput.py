"""Throughput model: predicted seconds per optimizer step of a plan on a GPU type. Pure.

step = matmuls at the GPU's sustained tensor rate, plus the operand traffic they cannot hide
       (a serial roofline per GEMM shape: narrow or split layers are bandwidth-bound, not
       "inefficient" by a fixed width curve)
     + attention: fused (flash) kernels at a share of the GEMM rate, causal masks skip half;
       eager kernels as batched GEMMs plus the s x s score traffic (scale, mask, softmax,
       dropout) at memory bandwidth
     + memory-bound work: norms, residual adds, MLP activation, the loss over the vocabulary
     + pipeline bubble (interleaved 1F1B: divided by the virtual stages ``vpp``)
     + exposed data-parallel communication (all-reduce, or ZeRO reduce-scatter / all-gather),
       over the slowest link the data-parallel group crosses, minus what overlaps compute
     + tensor-parallel all-reduces (on the critical path) + pipeline point-to-point (and a
       tied embedding's gradient summed between the first and last stage)
     + sequence-parallel (DeepSpeed Ulysses) all-to-alls of q, k, v and the attention output
     + optimizer step (memory-bound) + CPU-offload traffic + a fixed per-micro-batch overhead
     LoRA / QLoRA (``adapters``): the frozen base skips its weight-gradient GEMMs, each adapter
     adds its casts, dropout, scale and add at memory bandwidth (``Adapters``), the gradient
     communication and the optimizer cover the adapters only; QLoRA dequantises the 4-bit base
     in every forward and backward

FLOPs follow the PaLM / Megatron accounting (forward = 1/3): ``6 x matmul params + 12 x
layers x hidden x seq`` (attention scores and values); full activation recomputation adds a
forward: ``8 x P + 16 x l h s``; selective recomputation only re-runs attention. Under sequence
parallelism (DeepSpeed Ulysses) ``s`` stays the whole sequence: each rank attends over all of it
for heads / cp heads. Every other term is bytes over the GPU's own memory bandwidth or bits over
a link.

Every factor is a field of ``Factors`` (defaults = the module constants below) so measured runs
can recalibrate them without touching code; per-GPU utilisation lives in the catalog.
Collective volumes follow the ring algorithm: an all-reduce over n ranks moves ``2 (n-1)/n``
of the buffer per rank, a reduce-scatter or all-gather ``(n-1)/n``.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .catalog import GPU
from .home import DEFAULT_HOME, forget_json_cache, read_json_cached, write_atomic

# --- named constants (defaults of Factors) -----------------------------------------------
ATTN_FLOPS_PER_LHS = 12.0          # training FLOPs per token per (layer x hidden x seq), no recompute
RECOMPUTE_FULL_EXTRA = 1.0 / 3.0   # full recompute: one more forward = +1/3 of training FLOPs
MEM_BW_EFF = 0.85                  # share of datasheet DRAM bandwidth streaming kernels reach
                                   # (STREAM-like copies: ~85-92% on HBM2e/HBM3 and GDDR6X)
CAUSAL_ATTN_SHARE = 0.5            # a causal mask lets fused kernels skip half the score tiles
# Memory-bound bytes per token per layer, for 2-byte activations (fp32 doubles them). Forward
# writes and backward reads each saved tensor; each backward kernel reads input + grad, writes grad:
NORM_RESIDUAL_BYTES_PER_H = 126.0  # two norms + two residual adds, unfused PyTorch under autocast:
                                   # a norm reads 2 B, writes fp32 4 B, the next GEMM's cast reads 4
                                   # writes 2 (12 B/h each); a residual add reads 2+2 writes 2; fwd
                                   # 2 x 12 + 2 x 6 = 36 B/h, bwd ~2.5x (reads x, dy, writes dx, casts)
MLP_ACT_BYTES_PER_FFN = 10.0       # GeLU on the ffn width: fwd read+write 4 B, bwd read x, dy, write dx 6 B
GATED_ACT_BYTES_PER_FFN = 16.0     # SwiGLU: fwd reads two halves, writes one (6 B), bwd ~10 B
FLASH_IO_BYTES_PER_H = 26.0        # fused attention: fwd reads q,k,v writes o; bwd reads q,k,v,o,do,
                                   # writes dq,dk,dv: ~13 h-wide tensors x 2 B
EAGER_BYTES_PER_SCORE = 72.0       # eager attention per (head, query, key): fwd scale 4 + mask 4 +
                                   # softmax (autocast fp32) 6 + dropout 9 + cast 6 B, bwd ~31 B, plus
                                   # the score GEMMs' own writes/reads of the s x s matrices ~12 B
LOSS_BYTES_PER_VOCAB = 28.0        # cross entropy per logit: cast to fp32 (2+4), log-softmax (4+4),
                                   # backward softmax grad (4+4), cast back (4+2) bytes
FP32_UTIL = 0.6                    # plain fp32 (no tensor cores) reaches a higher share of its
                                   # much lower peak: 76% in a large GEMM on H200
DP_OVERLAP = 0.7                   # fraction of the overlap window DP comms hide under
DP_MIN_EXPOSED = 0.15              # ... but at least this share of them stays exposed (bucket tail)
OVERLAP_COST = 0.15                # an overlapped collective still slows compute by this share of
                                   # its time: NCCL runs a CTA per channel (16-32 channels on NVLink
                                   # systems hold ~12-25% of the SMs) and its copies draw HBM bandwidth
NVLINK_EFF = 0.8                   # NCCL bus bandwidth over NVLink: nccl-tests reach ~230-240 of 300
                                   # GB/s (A100) and ~360-380 of 450 GB/s (H100) per GPU
NETWORK_EFF = 0.9                  # ... and ~90% of InfiniBand / RoCE line rate between nodes
TP_OVERLAP = 0.0                   # Megatron TP all-reduces sit on the critical path
CP_OVERLAP = 0.0                   # Ulysses' all-to-alls too: attention needs the gathered q, k, v
                                   # and the next projection the scattered output (the HF attention
                                   # DeepSpeed registers issues them on the compute stream)
PP_P2P_EXPOSED_FACTOR = 2.0        # fill + drain: activation sends on the critical path per stage boundary
OPTIMIZER_BYTES_PER_PARAM = 32.0   # Adam step: read/write fp32 master, m, v + grads + 16-bit params
OFFLOAD_PCIE_GBS = 12.0            # effective host<->device GB/s for ZeRO-Offload traffic
CPU_ADAM_PARAMS_PER_S = 1.0e9      # DeepSpeed CPU-Adam throughput on a many-core host
MICROBATCH_OVERHEAD_S = 0.002      # launches, Python, loss/logits bookkeeping per micro-batch
STEP_OVERHEAD_S = 0.005            # optimizer/zero_grad/scheduler bookkeeping per step
CPU_MICROBATCH_OVERHEAD_S = 0.02   # the CPU pseudo-type (gloo, Python-bound tiny models)
# LoRA adapters (PEFT's lora.Linear beside a frozen projection; peft/tuners/lora/layer.py), bytes
# per token per element of an adapted projection's input (k wide) or output (n wide), 16-bit
# activations, as (forward, backward). Input side: A's GEMM reads x (2); backward: A's dgrad
# writes dx (2), A's wgrad reads x (2), dx is added to the base's input gradient (2 + 2 + 2).
LORA_IN_BYTES = (2.0, 10.0)
# fp32 adapters (fp32 master weights under autocast): the forward casts x to fp32 (reads 2,
# writes 4) and autocast casts it back for A's GEMM (4 + 2); the backward undoes both (6 + 6).
LORA_CAST_BYTES = (12.0, 12.0)
# Output side: B writes its output (2), the scaling reads and writes it (4), the add to the base
# output reads two and writes one (6); backward: the scaling's gradient (4), B's dgrad and wgrad
# each read the output gradient (2 + 2).
LORA_OUT_BYTES = (12.0, 8.0)
# Dropout on the adapter's input (lora_dropout > 0) reads and writes the adapter-dtype input and
# writes a 1-byte mask, forward; the backward reads the gradient and the mask, writes one: per
# element 2 x adapter bytes + 1, each way.
LORA_DROPOUT_MASK_BYTES = 1.0
# QLoRA: every forward and input-gradient pass dequantises the frozen NF4 base (bitsandbytes):
# reads 0.5 B per weight (+ block absmax) and writes the 16-bit weight the GEMM then reads (2)
QLORA_DEQUANT_BYTES_PER_PARAM = 2.5


@dataclass(frozen=True, slots=True)
class Factors:
    """Recalibratable throughput factors (all defaults are the named constants above)."""

    attn_flops_per_lhs: float = ATTN_FLOPS_PER_LHS
    recompute_full_extra: float = RECOMPUTE_FULL_EXTRA
    mem_bw_eff: float = MEM_BW_EFF
    causal_attn_share: float = CAUSAL_ATTN_SHARE
    norm_residual_bytes_per_h: float = NORM_RESIDUAL_BYTES_PER_H
    mlp_act_bytes_per_ffn: float = MLP_ACT_BYTES_PER_FFN
    gated_act_bytes_per_ffn: float = GATED_ACT_BYTES_PER_FFN
    flash_io_bytes_per_h: float = FLASH_IO_BYTES_PER_H
    eager_bytes_per_score: float = EAGER_BYTES_PER_SCORE
    loss_bytes_per_vocab: float = LOSS_BYTES_PER_VOCAB
    fp32_util: float = FP32_UTIL
    dp_overlap: float = DP_OVERLAP
    dp_min_exposed: float = DP_MIN_EXPOSED
    tp_overlap: float = TP_OVERLAP
    cp_overlap: float = CP_OVERLAP
    overlap_cost: float = OVERLAP_COST
    nvlink_eff: float = NVLINK_EFF
    network_eff: float = NETWORK_EFF
    pp_p2p_exposed_factor: float = PP_P2P_EXPOSED_FACTOR
    optimizer_bytes_per_param: float = OPTIMIZER_BYTES_PER_PARAM
    offload_pcie_gbs: float = OFFLOAD_PCIE_GBS
    cpu_adam_params_per_s: float = CPU_ADAM_PARAMS_PER_S
    microbatch_overhead_s: float = MICROBATCH_OVERHEAD_S
    step_overhead_s: float = STEP_OVERHEAD_S
    cpu_microbatch_overhead_s: float = CPU_MICROBATCH_OVERHEAD_S
    lora_in_bytes: tuple[float, float] = LORA_IN_BYTES
    lora_cast_bytes: tuple[float, float] = LORA_CAST_BYTES
    lora_out_bytes: tuple[float, float] = LORA_OUT_BYTES
    lora_dropout_mask_bytes: float = LORA_DROPOUT_MASK_BYTES
    qlora_dequant_bytes_per_param: float = QLORA_DEQUANT_BYTES_PER_PARAM
    util: dict[str, float] = field(default_factory=dict)        # gpu_type -> calibrated utilisation
    mem_eff: dict[str, float] = field(default_factory=dict)     # gpu_type -> calibrated bandwidth share

    def with_(self, **kw: Any) -> "Factors":
        return replace(self, **kw)


DEFAULT_FACTORS = Factors()

_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(frozen=True, slots=True)
class Adapters:
    """LoRA adapters of one transformer block, what the throughput model needs of them
    (``estimator.memory.lora_adapters`` builds it from a job's knobs): their rank, the summed
    input and output widths of the projections they adapt, whether they hold fp32 weights under
    autocast (casts), whether dropout runs on their input, and whether the frozen base is
    4-bit (QLoRA)."""

    rank: int
    in_features: int
    out_features: int
    fp32: bool = False
    dropout: bool = False
    qlora: bool = False

    @property
    def params(self) -> int:
        """Trainable parameters of one block: A (rank x in) and B (out x rank) per projection."""
        return self.rank * (self.in_features + self.out_features)

    def bytes_per_token(self, recompute: float, f: "Factors") -> float:
        """Memory-bound bytes per token through one block's adapters (16-bit activations),
        forward and backward, the forward repeated ``recompute`` times more (full recomputation)."""
        a = 4.0 if self.fp32 else 2.0
        fin, bin_ = f.lora_in_bytes
        if self.fp32:
            fin, bin_ = fin + f.lora_cast_bytes[0], bin_ + f.lora_cast_bytes[1]
        if self.dropout:
            mask = f.lora_dropout_mask_bytes
            fin, bin_ = fin + 2 * a + mask, bin_ + 2 * a + mask
        fout, bout = f.lora_out_bytes
        return ((1.0 + recompute) * (fin * self.in_features + fout * self.out_features)
                + bin_ * self.in_features + bout * self.out_features)


@dataclass(slots=True)
class StepTime:
    """Seconds per optimizer step, by part (``total`` is what the scheduler uses).

    ``compute``: matmuls and attention (tensor math plus the operand traffic GEMMs cannot hide);
    ``memory``: memory-bound kernels (norms, activations, eager score traffic, loss);
    ``cp_comm``: sequence-parallel (Ulysses) all-to-alls on the critical path.
    """

    compute: float
    bubble: float
    dp_comm: float
    tp_comm: float
    pp_comm: float
    optimizer: float
    offload: float
    overhead: float
    memory: float = 0.0
    cp_comm: float = 0.0

    @property
    def total(self) -> float:
        return (self.compute + self.memory + self.bubble + self.dp_comm + self.tp_comm + self.pp_comm
                + self.optimizer + self.offload + self.overhead + self.cp_comm)

    def as_dict(self) -> dict[str, float]:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["total"] = self.total
        return d


def _spec_dims(spec: Any) -> tuple[float, int, int, int, float, bool]:
    """params, layers, hidden, the LM head's vocabulary (0 without a head), matmul params and
    whether the head is tied to the input embedding.

    The input embedding is a lookup, not a matmul; a tied head still multiplies by it. A model
    without an LM head (``lm_head=False``: e.g. a span or classification head) only looks it up.
    """
    params = float(spec.params)
    layers = int(spec.layers)
    hidden = int(spec.hidden)
    vocab = int(getattr(spec, "vocab", 0) or 0)
    tied = getattr(spec, "tied", None)          # ModelSpec resolves the arch default here
    if tied is None:
        tied = getattr(spec, "tied_embeddings", None)
    tied = True if tied is None else bool(tied)
    head = bool(getattr(spec, "lm_head", True))
    matmul_params = params - (0 if tied and head else vocab * hidden)
    return params, layers, hidden, vocab if head else 0, matmul_params, tied and head


def _shape_dims(spec: Any, hidden: int) -> tuple[int, int, int, bool, bool, int]:
    """heads, kv heads, ffn width, gated MLP, causal, head width: from a ModelSpec or any
    object with them (the head width is hidden / heads unless the model says otherwise:
    Qwen3's 128-wide heads make its small models' attention 2x hidden wide)."""
    heads = int(getattr(spec, "heads", 0) or 0) or max(1, hidden // 64)
    kv = int(getattr(spec, "n_kv", 0) or getattr(spec, "kv_heads", 0) or heads)
    ffn = int(getattr(spec, "f", 0) or getattr(spec, "ffn", 0) or 4 * hidden)
    arch = getattr(spec, "arch", "gpt")
    d_head = int(getattr(spec, "d_head", 0) or getattr(spec, "head_dim", 0) or hidden // heads)
    return heads, kv, ffn, arch == "llama", arch != "bert", d_head


_dims_cache: dict[int, tuple[Any, tuple]] = {}


def _dims(spec: Any) -> tuple:
    """``_spec_dims`` + ``_shape_dims`` of ``spec``, memoised by identity (the planner asks for
    the same spec thousands of times; the spec object is kept so a reused id cannot alias)."""
    hit = _dims_cache.get(id(spec))
    if hit is not None and hit[0] is spec:
        return hit[1]
    base = _spec_dims(spec)
    dims = base + _shape_dims(spec, base[2])
    if len(_dims_cache) > 4096:
        _dims_cache.clear()
    _dims_cache[id(spec)] = (spec, dims)
    return dims


def _attn_flops(layers: int, width: int, seq_len: int, f: Factors) -> float:
    """Training FLOPs per token of the attention core (scores and values), no recompute;
    ``width``: the query heads' total width, heads x head width (the hidden size, for most)."""
    return f.attn_flops_per_lhs * layers * width * seq_len


def flops_per_token(spec: Any, seq_len: int, act_ckpt: str = "none",
                    factors: Factors = DEFAULT_FACTORS) -> float:
    """Training FLOPs per token (forward + backward, plus recomputation)."""
    _, layers, hidden, _, matmul_params, _ = _spec_dims(spec)
    heads, *_, d_head = _shape_dims(spec, hidden)
    attn = _attn_flops(layers, heads * d_head, seq_len, factors)
    base = 6.0 * matmul_params + attn
    if act_ckpt == "full":
        return base * (1.0 + factors.recompute_full_extra)
    if act_ckpt == "selective":
        return base + attn * factors.recompute_full_extra  # re-run only the attention core
    return base


@dataclass(frozen=True, slots=True)
class _Ctx:
    """What a step time needs of (spec, GPU, sequence, precision, kernels, factors), per token
    and per layer, before the plan's shape divides it (memoised: the planner asks thousands of
    shapes of one context)."""

    params: float
    layers: int
    hidden: int
    nbytes: int
    rate: float          # sustained matmul FLOP/s
    attn_rate: float     # FLOP/s the attention core runs at (fused: a share of the GEMM rate)
    bw: float            # achieved bytes/s of memory-bound kernels
    mm_flops: float      # 6 x matmul params (training FLOPs per token, no recompute)
    attn_flops: float    # attention core FLOPs per token (per layer x layers), causal skip applied
    g0: float            # per-layer GEMM operand elements per token: g0 + g1/tp + g2/(tp m)
    g1: float
    g2: float
    gv0: float           # LM head: gv0/pp + gv1/(tp pp) + gv2/(tp pp m)
    gv1: float
    gv2: float
    attn_io: float       # per layer per token (before / tp): fused q,k,v,o traffic or eager scores
    a2a: float           # per layer per token (before / tp): q, k, v and output elements (Ulysses)
    elem_h: float        # norms + residuals, per layer per token
    elem_ffn: float      # MLP activation, per layer per token (before / tp)
    loss: float          # cross entropy over the vocabulary, per token (before / (tp pp))
    tied_elems: float    # a tied head's weight elements (vocab x hidden); 0 untied


_ctx_cache: dict[tuple, tuple[Any, Any, Any, _Ctx]] = {}


def _context(spec: Any, gpu: GPU, seq_len: int, precision: str, matmul_precision: str, eager: bool,
             f: Factors) -> _Ctx:
    key = (id(spec), id(gpu), seq_len, precision, matmul_precision, eager, id(f))
    hit = _ctx_cache.get(key)
    if hit is not None and hit[0] is spec and hit[1] is gpu and hit[2] is f:
        return hit[3]
    params, layers, hidden, vocab, mm_params, tied, heads, kv, ffn, gated, causal, d_head = _dims(spec)
    nbytes = _BYTES.get(precision, 2)
    util = f.util.get(gpu.name, gpu.util)
    if precision == "fp32" and matmul_precision != "tf32" and not gpu.is_cpu:
        util = f.fp32_util
    rate = gpu.peak_tflops(precision, matmul_precision) * 1e12 * util
    bw = gpu.mem_bw_gbs * 1e9 * f.mem_eff.get(gpu.name, f.mem_bw_eff)
    # Every query attends to the whole sequence, also under sequence parallelism: Ulysses gives
    # each of the cp ranks all s positions of heads / cp heads, so per token of its s / cp slice
    # a rank does the attention FLOPs (and eager score traffic) of the full length s, not of s / cp
    s = seq_len
    h = float(hidden)
    qd = float(heads * d_head)                 # the query heads' width (h for most models)
    q_kv = qd + 2 * kv * d_head
    up = ffn * (2 if gated else 1)
    # Operand elements one token moves through an (m x k) @ (k x n) GEMM in one pass: its input
    # row k, its output row n and its share k n / m of the weights (read once per micro-batch).
    # A block's four GEMMs per TP rank: qkv (h, q_kv/tp), out (qd/tp, h), up (h, up/tp),
    # down (ffn/tp, h); summed: g0 + g1 / tp + g2 / (tp m). The LM head (h, V/tp) likewise.
    g0, g1, g2 = 4 * h, q_kv + qd + up + ffn, h * q_kv + qd * h + h * up + ffn * h
    gv = (h, vocab, h * vocab) if vocab else (0.0, 0.0, 0.0)
    half = nbytes / 2.0
    if eager:   # full s x s scores (a causal mask is applied, not skipped)
        attn_rate = rate
        attn_io = heads * s * f.eager_bytes_per_score * half
    else:
        # a sliding window the sequence reaches: Hugging Face hands SDPA an explicit mask (see
        # memory.window_mask_bytes), and a kernel given a mask computes every score tile; in the
        # share of layers that attend through one (Gemma 3: not its global layers)
        share = getattr(spec, "window_share", None)
        masked = share(s) if share else 0.0
        attn_rate = rate * gpu.flash_attn_eff / ((f.causal_attn_share * (1.0 - masked) + masked) if causal else 1.0)
        attn_io = f.flash_io_bytes_per_h * qd * half
    act = f.gated_act_bytes_per_ffn if gated else f.mlp_act_bytes_per_ffn
    c = _Ctx(params=params, layers=layers, hidden=hidden, nbytes=nbytes, rate=rate, attn_rate=attn_rate, bw=bw,
             mm_flops=6.0 * mm_params,
             attn_flops=_attn_flops(layers, int(qd), s, f), g0=g0, g1=g1, g2=g2, gv0=gv[0], gv1=gv[1], gv2=gv[2],
             attn_io=attn_io, a2a=q_kv + qd, elem_h=f.norm_residual_bytes_per_h * h * half, elem_ffn=act * ffn * half,
             loss=vocab * f.loss_bytes_per_vocab, tied_elems=float(vocab * hidden) if tied else 0.0)
    if len(_ctx_cache) > 8192:
        _ctx_cache.clear()
    _ctx_cache[key] = (spec, gpu, f, c)
    return c


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


_stage_caches: dict[tuple[int, int, int], tuple[Any, Any, Any, dict]] = {}
_last_stages: tuple = (None, None, None, {})
STAGE_CACHE_MAX = 65536     # stage entries over all (spec, GPU, factors): ~0.4 kB each, ~26 MB at most
_stage_entries = 0


def _stages_of(spec: Any, gpu: GPU, f: Factors) -> dict:
    """The stage cache of one (spec, GPU, factors), by identity (the objects are kept so that a
    reused id cannot alias); remembered as the last one asked for (the planner asks runs of one)."""
    global _last_stages
    hit = _stage_caches.get((id(spec), id(gpu), id(f)))
    if hit is None or hit[0] is not spec or hit[1] is not gpu or hit[2] is not f:
        hit = (spec, gpu, f, {})
        _stage_caches[(id(spec), id(gpu), id(f))] = hit
    _last_stages = hit          # one tuple assignment: a reader sees the old or the new one
    return hit[3]


def _stage(stages: dict, key: tuple, spec: Any, gpu: GPU, f: Factors, seq_len: int, precision: str,
           matmul_precision: str, eager: bool, cp: int, tp: int, pp: int, mb: int, act_ckpt: str,
           adapters: Adapters | None = None) -> tuple:
    """Everything of a step time that one model-parallel stage shape fixes (context, tp, pp,
    micro-batch, recomputation), per token or per byte, so that a plan only scales it by its
    data-parallel degree, ZeRO stage, accumulation and placement. Memoised: the planner asks for
    many dp / ZeRO / accumulation / node variants of each stage shape."""
    c = _context(spec, gpu, seq_len, precision, matmul_precision, eager, f)
    nbytes, bw = c.nbytes, c.bw
    m = mb * seq_len / cp                           # GEMM rows per micro-batch
    # fwd, dgrad, wgrad = 3 passes; full recomputation adds a forward to everything, selective
    # only to the attention core
    passes = 3.0 + (3.0 * f.recompute_full_extra if act_ckpt == "full" else 0.0)
    attn_passes = 3.0 + (3.0 * f.recompute_full_extra if act_ckpt in ("full", "selective") else 0.0)
    mp = tp * pp
    lay = c.layers / pp
    # LoRA: the frozen projections and head compute no weight gradient, one GEMM pass fewer
    mm_passes = passes if adapters is None else passes - 1.0
    # --- compute per token of one rank's stages: matmuls (serial roofline) and attention -------
    gemm_elems = lay * (c.g0 + c.g1 / tp + c.g2 / (tp * m)) + c.gv0 / pp + c.gv1 / (mp + 0.0) \
        + c.gv2 / (mp * m)
    compute_tok = (c.mm_flops / mp * (mm_passes / 3.0) / c.rate
                   + gemm_elems * mm_passes * nbytes / bw
                   + c.attn_flops / mp * (attn_passes / 3.0) / c.attn_rate)
    # --- memory-bound kernels per token ---------------------------------------------------------
    attn_io = lay * c.attn_io / tp * (attn_passes / 3.0)
    elem = lay * (c.elem_h + c.elem_ffn / tp) * (passes / 3.0)
    memory_tok = (attn_io + elem + c.loss / mp) / bw
    params_mp = c.params / mp                       # this rank's model-parallel slice
    trainable_mp = params_mp
    if adapters is not None:
        rec = passes - 3.0                          # forwards repeated by full recomputation
        # the adapters' GEMMs (6 FLOPs per parameter per token, + 2 per recomputed forward) and
        # their casts, dropout, scaling and add at memory bandwidth
        compute_tok += lay * adapters.params * (6.0 + 2.0 * rec) / tp / c.rate
        memory_tok += lay * adapters.bytes_per_token(rec, f) * (nbytes / 2.0) / tp / bw
        if adapters.qlora:      # the block's projections dequantised per forward / dgrad pass
            memory_tok += lay * c.g2 / tp * f.qlora_dequant_bytes_per_param * mm_passes / m / bw
        trainable_mp = adapters.params * c.layers / mp
    intra = gpu.intra_link_gbps * (f.nvlink_eff if gpu.intra_link.startswith("nvlink") else 1.0)
    act_bytes = m * c.hidden * nbytes               # one micro-batch's activations at a layer boundary
    # tensor parallel: 2 all-reduces fwd + 2 bwd per layer (+2 with full recompute), per micro-batch:
    # Gbit over the link (seconds = Gbit / link Gbit/s)
    n_ar = 4 + (2 if act_ckpt == "full" else 0)
    tp_gbit = lay * n_ar * (2.0 * _ring(tp) * act_bytes) * 8.0 / 1e9 * (1.0 - f.tp_overlap) if tp > 1 else 0.0
    # tensor parallel inside pipeline stages (trainer.parallel.pipeline): one all-gather of a
    # micro-batch's boundary activation ((n-1)/n of it per rank); ``shared_parts`` counts them
    gather_gbit = _ring(tp) * act_bytes * 8.0 / 1e9 * (1.0 - f.tp_overlap) if tp > 1 and pp > 1 else 0.0
    # sequence parallel (DeepSpeed Ulysses, cp ranks inside a node): per layer and micro-batch the
    # forward trades each rank's s/cp tokens x all heads of q, k, v for all s tokens x heads/cp
    # (three all-to-alls before attention) and the attention output back (one after); the backward
    # sends the four gradients the same way, full recomputation repeats the forward ones. An
    # all-to-all over n ranks keeps 1/n of the tensor and sends (n-1)/n of it, so per rank:
    #   lay x (2 + full) x (cp-1)/cp x m x (q + 2 kv + o widths) / tp x bytes, as Gbit
    n_a2a = 2 + (1 if act_ckpt == "full" else 0)
    cp_gbit = (lay * n_a2a * _ring(cp) * m * c.a2a / tp * nbytes * 8.0 / 1e9 * (1.0 - f.cp_overlap)
               if cp > 1 else 0.0)
    # pipeline point-to-point on the critical path (fill + drain), Gbit over the link
    pp_gbit = f.pp_p2p_exposed_factor * (pp - 1) * (act_bytes / tp) * 8.0 / 1e9 if pp > 1 else 0.0
    # a tied head's gradient summed between the first and last stage once per step, before the
    # global norm every rank waits for (trainer.parallel.pipeline.Pipeline.sum_tied_gradients): an
    # all-reduce over those 2 ranks moves the whole V x hidden gradient (2 x 1/2 of it); beside
    # tensor parallel each stage first gathers it whole from its tp shards ((tp-1)/tp of it,
    # charged on the same link).
    # ZeRO-2/3 without tp reduces each replica's 1/dp shard only; counted whole (ZeRO-independent)
    tie_gbit = (c.tied_elems * nbytes * 8.0 / 1e9 * (1.0 + _ring(tp)) if pp > 1 else 0.0)
    pcie = f.offload_pcie_gbs * 1e9
    entry = (compute_tok, memory_tok,
             trainable_mp * nbytes * 8.0 / 1e9,                # its gradients / ZeRO shard, Gbit
             intra, gpu.inter_node_gbps * f.network_eff, tp_gbit, gather_gbit, pp_gbit, tie_gbit, cp_gbit,
             trainable_mp * f.optimizer_bytes_per_param / bw,  # Adam step on the GPU, unsharded
             trainable_mp / f.cpu_adam_params_per_s,           # ... on the CPU (offload)
             trainable_mp * 4.0 / pcie,                        # offload: 16-bit grads down, params up
             params_mp * nbytes * 2.0 / pcie,                  # params offload: fetched fwd + bwd
             f.cpu_microbatch_overhead_s if gpu.is_cpu else f.microbatch_overhead_s,
             f.step_overhead_s, f.dp_overlap, f.dp_min_exposed, f.overlap_cost,
             # ZeRO-3 gathers the frozen base too: its 16-bit parameters beyond the trainable ones
             (params_mp - trainable_mp) * nbytes * 8.0 / 1e9)
    global _stage_entries
    _stage_entries += 1
    if _stage_entries > STAGE_CACHE_MAX:     # bound the memory: start over (the planner refills it)
        _stage_caches.clear()
        stages.clear()
        _stage_entries = 0
    stages[key] = entry
    return entry


def shared_parts(spec: Any, plan: Any, gpu: GPU, *, seq_len: int, nodes: int = 1,
                 inter_node_gbps: float | None = None, factors: Factors | None = None,
                 adapters: Adapters | None = None) -> tuple:
    """What the step times of ``plan`` under every ZeRO stage and offload share, computed once:
    ``step_time_with(shared, zero, offload)`` is then ``step_time`` of ``plan`` with that ZeRO
    stage and offload, to the last bit, for a fraction of its cost (the planner times many such
    variants of one shape). Its first item is their floor: ``step_time``'s sum without the
    data-parallel communication, optimizer step and offload traffic; each part left out is
    >= 0 (for factors in their physical ranges: every default, and the fitted per-GPU
    utilisation and bandwidth shares in (0, 1]) and rounding to nearest is monotone, so no
    variant's step time is below it, also in floating point.

    The tuple: (floor, compute + memory + bubble, tp_comm, pp_comm, overhead, cp_comm), what
    ``_zero_parts`` needs, then (compute, bubble, memory), then the frozen parameters' Gbit.
    ``adapters``: the job's LoRA adapters (``Adapters``), None for full fine-tuning."""
    f = factors if factors is not None else calibrated_factors()
    # plain attribute reads, no int() / max() / min() / id() calls on this path (the planner asks
    # for thousands of step times per job; each builtin call costs ~30-100 ns): Plan validates its
    # fields as positive integers; other plan-like objects may lack the optional fields
    dp, tp, pp, mb, ga = plan.dp, plan.tp, plan.pp, plan.micro_batch, plan.grad_accum
    try:        # an exception costs ~1 us: only objects lacking these fields take that path
        cp, precision, act_ckpt, vpp, matmul_precision, attention = (
            plan.cp, plan.precision, plan.act_ckpt, plan.vpp, plan.matmul_precision, plan.attention)
    except AttributeError:
        cp, precision, act_ckpt, vpp = (getattr(plan, "cp", 1), getattr(plan, "precision", "bf16"),
                                        getattr(plan, "act_ckpt", "none"), getattr(plan, "vpp", 1))
        matmul_precision, attention = getattr(plan, "matmul_precision", None), getattr(plan, "attention", "flash")
        cp = cp or 1
        vpp = vpp or 1
    matmul_precision = matmul_precision or "default"
    eager = attention == "eager"
    # the stage cache of this (spec, GPU, factors): the last one asked, else by identity
    last = _last_stages
    if last[0] is spec and last[1] is gpu and last[2] is f:
        stages = last[3]
    else:
        stages = _stages_of(spec, gpu, f)
    key = (seq_len, precision, matmul_precision, eager, cp, tp, pp, mb, act_ckpt, adapters)
    s = stages.get(key)
    if s is None:
        s = _stage(stages, key, spec, gpu, f, seq_len, precision, matmul_precision, eager, cp, tp, pp, mb, act_ckpt,
                   adapters)
    compute_tok, memory_tok, shard_gbit, intra, inter, tp_gbit, gather_gbit, pp_gbit, tie_gbit, cp_gbit, opt_s, \
        cpu_opt_s, off_s, fetch_s, mb_over, step_over, dp_overlap, dp_min_exposed, overlap_cost, frozen_gbit = s
    if nodes < 1:
        nodes = 1
    per_node = -(-(dp * tp * pp * cp) // nodes)     # GPUs per node (ceil)
    if inter_node_gbps:
        inter = inter_node_gbps * f.network_eff

    tokens_gpu = mb * ga * seq_len / cp             # tokens one rank's stages see per step
    compute = tokens_gpu * compute_tok
    memory = tokens_gpu * memory_tok
    busy = compute + memory
    t_mb = busy / ga                     # one micro-batch through one stage (fwd + bwd)
    # 1F1B: (pp - 1) micro-batch slots idle per step (fill + drain), whatever ga. Interleaved
    # 1F1B: a rank's vpp chunks each take 1/vpp of its per-micro-batch time and fill and drain
    # advance one chunk at a time, so with ga >= pp the idle time is (pp - 1) chunk slots: bubble
    # fraction (pp - 1) / (vpp ga) (Narayanan et al. 2021, "Efficient large-scale language model
    # training on GPU clusters", 2.2.2). With fewer micro-batches than ranks a rank has nothing to
    # run while its first micro-batch goes round the other ranks: pp - ga whole slots stay idle
    # (ga = 1: no gain). At vpp = 1 both read pp - 1.
    if ga < pp:
        bubble = t_mb * ((pp - ga) + (ga - 1) / vpp)
    else:
        bubble = t_mb * (pp - 1) / vpp

    # --- tensor parallel all-reduces (critical path); TP groups stay inside a node when they fit
    if tp > 1:
        # beside pp, per micro-batch and pipeline (trainer.parallel.pipeline): each of the
        # pp vpp - 1 chunk boundaries sends 1/tp of the activation per tp rank and costs two
        # all-gathers (``holder``: the receiver's of the slices in the forward, the sender's of
        # their gradients in the backward), the first stage all-gathers the embeddings' hidden-size
        # slices (one more) and the last stage all-reduces the head's input gradient (two
        # all-gathers' volume): 2 pp vpp + 1 all-gathers, spread over the pp ranks as the head's
        # and embeddings' work is (2 vpp + 1/pp per rank; 0 without pp)
        gathers = 2.0 * vpp + 1.0 / pp
        tp_comm = ga * (tp_gbit + gathers * gather_gbit) / (intra if tp <= per_node or intra < inter / per_node
                                                            else inter / per_node)
    else:
        tp_comm = 0.0
    # --- pipeline point-to-point -----------------------------------------------------------------
    if pp > 1:
        link = inter / per_node if nodes > 1 and dp < nodes else intra
        pp_comm = pp_gbit / link
        if vpp > 1:
            # fill and drain cross every chunk boundary, pp vpp - 1 of them instead of pp - 1
            # (the same paper: interleaving multiplies the point-to-point volume by vpp)
            pp_comm *= (pp * vpp - 1) / (pp - 1)
        pp_comm += tie_gbit / link
    else:
        pp_comm = 0.0
    # --- sequence-parallel all-to-alls (critical path; cp groups are consecutive ranks of a node)
    cp_comm = ga * cp_gbit / intra if cp > 1 else 0.0
    overhead = step_over + ga * mb_over
    head = busy + bubble
    # step_time's sum without the parts the ZeRO stage and offload set (each >= 0): its floor
    floor = head + tp_comm + pp_comm + overhead + cp_comm
    return (floor, head, tp_comm, pp_comm, overhead, cp_comm, dp * cp, ga, nodes, tp, pp, per_node,
            shard_gbit, intra, inter, busy, t_mb, dp_overlap, dp_min_exposed, overlap_cost,
            opt_s, cpu_opt_s, off_s, fetch_s, compute, bubble, memory, frozen_gbit)


def _zero_parts(shared: tuple, zero: int, offload: str) -> tuple[float, float, float]:
    """(dp_comm, optimizer, offload) of the plan ``shared`` (``shared_parts``) was made for, run with
    ``zero`` and ``offload``."""
    (_, _, _, _, _, _, sdp, ga, nodes, tp, pp, per_node, shard_gbit, intra, inter, busy, t_mb,
     dp_overlap, dp_min_exposed, overlap_cost, opt_s, cpu_opt_s, off_s, fetch_s, _, _, _, frozen_gbit) = shared
    # --- data parallel (gradients / ZeRO shards of this rank's model-parallel slice) --------
    # Ulysses' ranks hold the same weights but different tokens: DeepSpeed reduces the gradients
    # (and ZeRO shards the states) over the sequence-data-parallel group, dp x cp ranks (sdp)
    if sdp > 1:
        # ZeRO-3: gather fwd + gather bwd + reduce-scatter, per micro-batch; ZeRO-2: reduce-scatter
        # per micro-batch + one parameter all-gather; else one all-reduce per step (no_sync while
        # accumulating). Ring volumes: 2 (n-1)/n per all-reduce = twice a reduce-scatter's.
        volume = shard_gbit * (3.0 * ga if zero >= 3 else (ga + 1.0 if zero == 2 else 2.0))
        if zero >= 3 and frozen_gbit:   # LoRA: the two gathers carry the frozen base as well
            volume += frozen_gbit * 2.0 * ga
        if nodes > 1:
            # hierarchical: ring inside each node, then the node's NICs carry every DP group's
            # shard (one group per model-parallel slice on the node) across nodes
            dp_nodes = nodes if nodes < sdp else sdp
            g = sdp // dp_nodes
            groups_on_node = tp * pp if tp * pp < per_node else per_node
            raw = volume * ((g - 1) / g / intra + (dp_nodes - 1) / dp_nodes * groups_on_node / inter)
        else:
            raw = volume * (sdp - 1) / sdp / intra
        # ZeRO-3 prefetches the next layer's gather during the current one's compute, forward and
        # backward; gradient reduction (DDP buckets, ZeRO-1/2) overlaps the backward only
        window = busy if zero >= 3 else (2.0 / 3.0) * (busy if zero == 2 else t_mb)
        exposed = raw - dp_overlap * window
        least = dp_min_exposed * raw
        if exposed < least:
            exposed = least
        dp_comm = exposed + overlap_cost * (raw - exposed)   # hidden comms still slow compute
    else:
        dp_comm = 0.0

    # --- optimizer step (ZeRO shards it over dp), offload -----------------------------------------
    if offload == "none":
        optimizer = opt_s / sdp if zero >= 1 else opt_s
        off = 0.0
    else:
        optimizer = cpu_opt_s / sdp if zero >= 1 else cpu_opt_s
        off = off_s / sdp if zero >= 1 else off_s
        if offload == "optimizer+params":
            off += fetch_s * ga
    return dp_comm, optimizer, off


def _parts(spec: Any, plan: Any, gpu: GPU, seq_len: int, nodes: int, inter_node_gbps: float | None,
           f: Factors, adapters: Adapters | None = None
           ) -> tuple[float, float, float, float, float, float, float, float, float, float]:
    """The parts of ``StepTime`` in field order (compute, bubble, dp_comm, tp_comm, pp_comm,
    optimizer, offload, overhead, memory, cp_comm); see ``step_time_breakdown``."""
    sh = shared_parts(spec, plan, gpu, seq_len=seq_len, nodes=nodes, inter_node_gbps=inter_node_gbps, factors=f,
                      adapters=adapters)
    dp_comm, optimizer, off = _zero_parts(sh, *_zero_offload(plan))
    return sh[24], sh[25], dp_comm, sh[2], sh[3], optimizer, off, sh[4], sh[26], sh[5]


def _zero_offload(plan: Any) -> tuple[int, str]:
    try:        # plan-like objects may lack them (an exception costs ~1 us: only those pay it)
        return plan.zero, plan.offload
    except AttributeError:
        return getattr(plan, "zero", 0), getattr(plan, "offload", "none")


def step_time_breakdown(spec: Any, plan: Any, gpu: GPU, *, seq_len: int, nodes: int = 1,
                        inter_node_gbps: float | None = None,
                        factors: Factors | None = None, adapters: Adapters | None = None) -> StepTime:
    """Predicted seconds per optimizer step of ``plan`` on ``gpu``, by part.

    ``spec``: a model with ``params``, ``layers``, ``hidden`` (``vocab``, ``tied_embeddings``,
    ``heads``, ``kv_heads``, ``ffn``, ``arch`` optional), e.g. ``estimator.models.ModelSpec``.
    ``plan``: ``estimator.plan.Plan`` (or any object with its fields). ``nodes``: how many nodes
    the placement spans; the data-parallel group then crosses the inter-node network
    (``inter_node_gbps``, node aggregate, defaults to the GPU class's typical figure).
    Tensor-parallel groups stay inside a node when they fit. ``factors``: None = the defaults
    with the per-GPU factors ``frenzy calibrate`` fitted (``calibrated_factors``).
    ``adapters``: a LoRA / QLoRA job's adapters (``estimator.memory.lora_adapters``); None: full
    fine-tuning.
    """
    f = factors if factors is not None else calibrated_factors()
    return StepTime(*_parts(spec, plan, gpu, seq_len, nodes, inter_node_gbps, f, adapters))


def step_time(spec: Any, plan: Any, gpu: GPU, *, seq_len: int, nodes: int = 1,
              inter_node_gbps: float | None = None, factors: Factors | None = None,
              adapters: Adapters | None = None) -> float:
    """Predicted seconds per optimizer step (``step_time_breakdown(...).total``, without building it)."""
    zero, offload = _zero_offload(plan)
    return step_time_with(shared_parts(spec, plan, gpu, seq_len=seq_len, nodes=nodes,
                                       inter_node_gbps=inter_node_gbps, factors=factors, adapters=adapters),
                          zero, offload)


def step_time_with(shared: tuple, zero: int, offload: str) -> float:
    """``step_time`` of the plan ``shared`` (``shared_parts``) was made for, run with ``zero``
    and ``offload``."""
    dp_comm, optimizer, off = _zero_parts(shared, zero, offload)
    # step_time_breakdown's total, in its order: (compute + memory + bubble) + dp_comm + tp_comm
    # + pp_comm + optimizer + offload + overhead + cp_comm
    return shared[1] + dp_comm + shared[2] + shared[3] + optimizer + off + shared[4] + shared[5]


def tokens_per_s(spec: Any, plan: Any, gpu: GPU, *, seq_len: int, nodes: int = 1,
                 inter_node_gbps: float | None = None, factors: Factors | None = None,
                 adapters: Adapters | None = None) -> float:
    tokens = plan.micro_batch * plan.grad_accum * plan.dp * seq_len
    return tokens / step_time(spec, plan, gpu, seq_len=seq_len, nodes=nodes,
                              inter_node_gbps=inter_node_gbps, factors=factors, adapters=adapters)


def job_duration_s(spec: Any, plan: Any, gpu: GPU, *, seq_len: int, steps: int, nodes: int = 1,
                   inter_node_gbps: float | None = None, factors: Factors | None = None,
                   adapters: Adapters | None = None) -> float:
    """Predicted seconds to run ``steps`` optimizer steps."""
    return steps * step_time(spec, plan, gpu, seq_len=seq_len, nodes=nodes,
                             inter_node_gbps=inter_node_gbps, factors=factors, adapters=adapters)


# --- calibration from measured runs ----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Measurement:
    """One measured run: what ran (spec, plan, GPU, sequence length, nodes) and its step time."""

    spec: Any
    plan: Any
    gpu: GPU
    seq_len: int
    step_s: float
    nodes: int = 1
    adapters: Adapters | None = None      # a LoRA run's adapters (None: full fine-tuning)


FIT_UTIL_GRID = tuple(round(0.10 + 0.02 * i, 2) for i in range(46))      # 0.10 .. 1.00
FIT_MEM_EFF_GRID = tuple(round(0.20 + 0.05 * i, 2) for i in range(17))   # 0.20 .. 1.00


FIT_PRIOR_RUNS = 2.0   # the datasheet-derived default weighs as much as two runs: one or two runs
                       # (a single benchmark, another software stack) move a factor only part way


def _log_err(ms: list[Measurement], f: Factors) -> float:
    return sum(math.log(step_time(m.spec, m.plan, m.gpu, seq_len=m.seq_len, nodes=m.nodes, factors=f,
                                  adapters=m.adapters)
                        / m.step_s) ** 2 for m in ms)


def fit_factors(measured: list[Measurement], base: Factors = DEFAULT_FACTORS) -> Factors:
    """Refit the per-GPU-type named factors from measured runs: the sustained tensor-core
    utilisation (``Factors.util``) and, where the runs separate it, the share of memory bandwidth
    the memory-bound kernels reach (``Factors.mem_eff``).

    Per GPU type, the pair minimising the squared log error of predicted / measured step time
    over that type's runs plus a pull towards the defaults (``FIT_PRIOR_RUNS`` pseudo-runs at
    the default values, in log space), on a grid of physical values (utilisation 0.10-1.00,
    bandwidth share 0.20-1.00). With fewer than 3 runs only the utilisation is refit (one run
    cannot separate the two). Types without runs keep their defaults. Pure; returns new Factors.
    """
    by_gpu: dict[str, list[Measurement]] = {}
    for m in measured:
        if m.step_s > 0 and math.isfinite(m.step_s):
            by_gpu.setdefault(m.gpu.name, []).append(m)
    util, mem = dict(base.util), dict(base.mem_eff)
    for name, ms in by_gpu.items():
        u0, me0 = util.get(name, ms[0].gpu.util), mem.get(name, base.mem_bw_eff)
        mem_grid = FIT_MEM_EFF_GRID if len(ms) >= 3 else (me0,)
        best = (math.inf, u0, me0)
        for me in mem_grid:
            for u in FIT_UTIL_GRID:
                err = _log_err(ms, base.with_(util={**util, name: u}, mem_eff={**mem, name: me})) \
                    + FIT_PRIOR_RUNS * (math.log(u / u0) ** 2 + math.log(me / me0) ** 2)
                if err < best[0]:
                    best = (err, u, me)
        util[name], mem[name] = best[1], best[2]
    return base.with_(util=util, mem_eff=mem)


# --- the calibration file: per-GPU factors fitted from the ledger's measurements -----------------
CALIBRATED_KEYS = ("util", "mem_eff")
CAL_RECHECK_S = 1.0    # look at the file's mtime at most once a second (a stat costs ~3 us a call)
_cal_checked: dict[str, tuple[float, Factors]] = {}


def calibration_file() -> str:
    """``$FRENZY_HOME/throughput_calibration.json``: {gpu_type: {"util": u, "mem_eff": m}}."""
    return os.path.join(os.environ.get("FRENZY_HOME") or DEFAULT_HOME, "throughput_calibration.json")


def calibrated_factors(path: str | os.PathLike | None = None) -> Factors:
    """The default factors with the fitted per-GPU ones from the calibration file (the defaults
    alone when there is none). The file is looked at at most once a second per location and
    re-read only when it changed (mtime): every step time calls this."""
    home = os.fspath(path) if path else os.environ.get("FRENZY_HOME") or DEFAULT_HOME
    now = time.monotonic()
    seen = _cal_checked.get(home)
    if seen is not None and now - seen[0] < CAL_RECHECK_S:
        return seen[1]
    f = _load_calibrated(os.fspath(path) if path else calibration_file())
    _cal_checked[home] = (now, f)
    return f


def _load_calibrated(key: str) -> Factors:
    def parse(data: dict) -> Factors:
        per = {k: {str(g): float(t[k]) for g, t in data.items() if isinstance(t, dict) and k in t}
               for k in CALIBRATED_KEYS}
        per = {k: {g: v for g, v in d.items() if math.isfinite(v) and 0 < v <= 1} for k, d in per.items()}
        return DEFAULT_FACTORS.with_(util=per["util"], mem_eff=per["mem_eff"])
    return read_json_cached(key, parse) or DEFAULT_FACTORS


def write_calibration(fitted: Factors, gpu_types: list[str], path: str | os.PathLike | None = None) -> Path:
    """Merge the fitted per-GPU factors of ``gpu_types`` into the calibration file (other types
    kept) and return its path."""
    p = Path(path) if path else Path(calibration_file())
    p.parent.mkdir(parents=True, exist_ok=True)
    current: dict[str, Any] = {}
    if p.exists():
        try:
            current = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            current = {}
    for g in gpu_types:
        terms = {k: getattr(fitted, k)[g] for k in CALIBRATED_KEYS if g in getattr(fitted, k)}
        current.setdefault(g, {}).update(terms)
    write_atomic(p, json.dumps(current, indent=2, sort_keys=True))
    forget_json_cache()
    _cal_checked.clear()
    return p
