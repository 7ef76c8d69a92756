"""Throughput model: predicted seconds per optimizer step of a plan on a GPU type. Pure.

step = compute / (peak x util x micro-batch efficiency)
     + pipeline bubble
     + exposed data-parallel communication (all-reduce, or ZeRO reduce-scatter / all-gather),
       over the slowest link the data-parallel group crosses
     + tensor-parallel all-reduces (on the critical path) + pipeline point-to-point
     + optimizer step (memory-bound) + CPU-offload traffic + a fixed per-micro-batch overhead

Compute counts training FLOPs per token (PaLM / Megatron accounting, forward = 1/3):
``6 x matmul params + 12 x layers x hidden x seq`` (attention scores and values); full
activation recomputation adds a forward: ``8 x P + 16 x l h s``; selective recomputation only
re-runs attention: ``6 x P + 16 x l h s``.

Every factor is a field of ``Factors`` (defaults = the module constants below) so measured runs
can recalibrate them without touching code; per-GPU utilisation lives in the catalog.
Collective volumes follow the ring algorithm: an all-reduce over n ranks moves ``2 (n-1)/n``
of the buffer per rank, a reduce-scatter or all-gather ``(n-1)/n``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from .catalog import GPU

# --- named constants (defaults of Factors) -----------------------------------------------
ATTN_FLOPS_PER_LHS = 12.0          # training FLOPs per token per (layer x hidden x seq), no recompute
RECOMPUTE_FULL_EXTRA = 1.0 / 3.0   # full recompute: one more forward = +1/3 of training FLOPs
MB_HALF_SAT_TOKENS = 512.0         # tokens per micro-batch per GPU where kernels reach ~half their
MB_FULL_TOKENS = 8192.0            # ... asymptotic efficiency; at MB_FULL_TOKENS the factor is 1
WIDTH_HALF_SAT = 1024.0           # GEMM width (hidden / tp) where matmuls reach ~half their
WIDTH_FULL = 4096.0                # ... asymptotic efficiency; from WIDTH_FULL up the factor is 1
EAGER_ATTN_FACTOR = 10.0           # eager attention (scores materialised: memory-bound masking,
                                   # softmax, dropout over s x s) costs ~10x the FLOP time of fused
                                   # (flash/SDPA) attention (fitted on H200 runs, see bench)
FP32_UTIL = 0.6                    # plain fp32 (no tensor cores) reaches a higher share of its
                                   # much lower peak: 76% in a large GEMM on H200
DP_OVERLAP = 0.7                   # fraction of the backward pass DP comms can hide under
DP_MIN_EXPOSED = 0.15              # ... but at least this share of them stays exposed (bucket tail)
TP_OVERLAP = 0.0                   # Megatron TP all-reduces sit on the critical path
PP_P2P_EXPOSED_FACTOR = 2.0        # fill + drain: activation sends on the critical path per stage boundary
OPTIMIZER_BYTES_PER_PARAM = 32.0   # Adam step: read/write fp32 master, m, v + grads + 16-bit params
OFFLOAD_PCIE_GBS = 12.0            # effective host<->device GB/s for ZeRO-Offload traffic
CPU_ADAM_PARAMS_PER_S = 1.0e9      # DeepSpeed CPU-Adam throughput on a many-core host
MICROBATCH_OVERHEAD_S = 0.002      # launches, Python, loss/logits bookkeeping per micro-batch
STEP_OVERHEAD_S = 0.005            # optimizer/zero_grad/scheduler bookkeeping per step
CPU_MICROBATCH_OVERHEAD_S = 0.02   # the CPU pseudo-type (gloo, Python-bound tiny models)


@dataclass(frozen=True, slots=True)
class Factors:
    """Recalibratable throughput factors (all defaults are the named constants above)."""

    attn_flops_per_lhs: float = ATTN_FLOPS_PER_LHS
    recompute_full_extra: float = RECOMPUTE_FULL_EXTRA
    mb_half_sat_tokens: float = MB_HALF_SAT_TOKENS
    mb_full_tokens: float = MB_FULL_TOKENS
    width_half_sat: float = WIDTH_HALF_SAT
    width_full: float = WIDTH_FULL
    eager_attn_factor: float = EAGER_ATTN_FACTOR
    fp32_util: float = FP32_UTIL
    dp_overlap: float = DP_OVERLAP
    dp_min_exposed: float = DP_MIN_EXPOSED
    tp_overlap: float = TP_OVERLAP
    pp_p2p_exposed_factor: float = PP_P2P_EXPOSED_FACTOR
    optimizer_bytes_per_param: float = OPTIMIZER_BYTES_PER_PARAM
    offload_pcie_gbs: float = OFFLOAD_PCIE_GBS
    cpu_adam_params_per_s: float = CPU_ADAM_PARAMS_PER_S
    microbatch_overhead_s: float = MICROBATCH_OVERHEAD_S
    step_overhead_s: float = STEP_OVERHEAD_S
    cpu_microbatch_overhead_s: float = CPU_MICROBATCH_OVERHEAD_S
    util: dict[str, float] = field(default_factory=dict)  # gpu_type -> calibrated utilisation

    def with_(self, **kw: Any) -> "Factors":
        return replace(self, **kw)


DEFAULT_FACTORS = Factors()

_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


@dataclass(slots=True)
class StepTime:
    """Seconds per optimizer step, by part (``total`` is what the scheduler uses)."""

    compute: float
    bubble: float
    dp_comm: float
    tp_comm: float
    pp_comm: float
    optimizer: float
    offload: float
    overhead: float

    @property
    def total(self) -> float:
        return (self.compute + self.bubble + self.dp_comm + self.tp_comm + self.pp_comm
                + self.optimizer + self.offload + self.overhead)

    def as_dict(self) -> dict[str, float]:
        d = {k: getattr(self, k) for k in self.__slots__}
        d["total"] = self.total
        return d


def _spec_dims(spec: Any) -> tuple[float, int, int, int, bool]:
    params = float(spec.params)
    layers = int(spec.layers)
    hidden = int(spec.hidden)
    vocab = int(getattr(spec, "vocab", 0) or 0)
    tied = getattr(spec, "tied", None)          # ModelSpec resolves the arch default here
    if tied is None:
        tied = getattr(spec, "tied_embeddings", None)
    tied = True if tied is None else bool(tied)
    return params, layers, hidden, vocab, tied


def _attn_flops(layers: int, hidden: int, seq_len: int, f: Factors) -> float:
    """Training FLOPs per token of the attention core (scores and values), no recompute."""
    return f.attn_flops_per_lhs * layers * hidden * seq_len


def flops_per_token(spec: Any, seq_len: int, act_ckpt: str = "none",
                    factors: Factors = DEFAULT_FACTORS) -> float:
    """Training FLOPs per token (forward + backward, plus recomputation)."""
    params, layers, hidden, vocab, tied = _spec_dims(spec)
    # The input embedding is a lookup, not a matmul; a tied head still multiplies by it.
    matmul_params = params - (0 if tied else vocab * hidden)
    attn = _attn_flops(layers, hidden, seq_len, factors)
    base = 6.0 * matmul_params + attn
    if act_ckpt == "full":
        return base * (1.0 + factors.recompute_full_extra)
    if act_ckpt == "selective":
        return base + attn * factors.recompute_full_extra  # re-run only the attention core
    return base


def _mb_efficiency(tokens: float, f: Factors) -> float:
    """Kernel efficiency for small micro-batches, 1.0 from ``mb_full_tokens`` tokens up."""
    k = f.mb_half_sat_tokens
    ref = f.mb_full_tokens / (f.mb_full_tokens + k)
    return min(1.0, (tokens / (tokens + k)) / ref)


def _width_efficiency(width: float, f: Factors) -> float:
    """GEMM efficiency for narrow layers (small hidden size, or hidden split by TP)."""
    k = f.width_half_sat
    ref = f.width_full / (f.width_full + k)
    return min(1.0, (width / (width + k)) / ref)


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def _xfer_s(nbytes: float, gbps: float) -> float:
    return nbytes * 8.0 / (gbps * 1e9)


def step_time_breakdown(spec: Any, plan: Any, gpu: GPU, *, seq_len: int, nodes: int = 1,
                        inter_node_gbps: float | None = None,
                        factors: Factors = DEFAULT_FACTORS) -> StepTime:
    """Predicted seconds per optimizer step of ``plan`` on ``gpu``, by part.

    ``spec``: a model with ``params``, ``layers``, ``hidden`` (``vocab``, ``tied_embeddings``
    optional), e.g. ``estimator.models.ModelSpec``. ``plan``: ``estimator.plan.Plan`` (or any
    object with its fields). ``nodes``: how many nodes the placement spans; the data-parallel
    group then crosses the inter-node network (``inter_node_gbps``, node aggregate, defaults to
    the GPU class's typical figure). Tensor-parallel groups stay inside a node when they fit.
    """
    f = factors
    params, layers, hidden, _, _ = _spec_dims(spec)
    dp, tp, pp = int(plan.dp), int(plan.tp), int(plan.pp)
    cp = int(getattr(plan, "cp", 1) or 1)
    mb, ga = int(plan.micro_batch), int(plan.grad_accum)
    precision = getattr(plan, "precision", "bf16")
    act_ckpt = getattr(plan, "act_ckpt", "none")
    zero = int(getattr(plan, "zero", 0))
    offload = getattr(plan, "offload", "none")
    nbytes = _BYTES.get(precision, 2)
    gpus = max(1, dp * tp * pp * cp)
    nodes = max(1, int(nodes))
    per_node = math.ceil(gpus / nodes)
    inter = inter_node_gbps if inter_node_gbps else gpu.inter_node_gbps
    intra = gpu.intra_link_gbps

    # --- compute --------------------------------------------------------------------------
    tokens_step = mb * ga * dp * seq_len
    per_token = flops_per_token(spec, seq_len, act_ckpt, f)
    if getattr(plan, "attention", "flash") == "eager":
        attn = _attn_flops(layers, hidden, seq_len, f)
        attn *= (1.0 + f.recompute_full_extra) if act_ckpt in ("full", "selective") else 1.0
        per_token += attn * (f.eager_attn_factor - 1.0)
    flops_gpu = tokens_step * per_token / (dp * tp * pp * cp)
    util = f.fp32_util if precision == "fp32" and not gpu.is_cpu else f.util.get(gpu.name, gpu.util)
    eff = _mb_efficiency(mb * seq_len / cp, f)
    if precision != "fp32":              # narrow GEMMs starve tensor cores; plain fp32 FMA less so
        eff *= _width_efficiency(hidden / tp, f)
    compute = flops_gpu / (gpu.peak_tflops(precision) * 1e12 * util * eff)
    t_mb = compute / ga                  # one micro-batch through one stage (fwd + bwd)
    bubble = t_mb * (pp - 1)             # 1F1B: (pp - 1) micro-batch slots idle per step

    # --- data parallel (gradients / ZeRO shards of this rank's model-parallel slice) --------
    shard_bytes = params / (tp * pp) * nbytes
    if dp > 1:
        if zero >= 3:
            mult = 3.0 * ga            # gather fwd + gather bwd + reduce-scatter, per micro-batch
        elif zero == 2:
            mult = ga + 1.0            # reduce-scatter per micro-batch + one parameter all-gather
        else:
            mult = 2.0                 # one all-reduce per step (no_sync while accumulating)
        dp_nodes = min(nodes, dp)
        if dp_nodes > 1:
            # hierarchical: ring inside each node, then the node's NICs carry every DP group's
            # shard (one group per model-parallel slice on the node) across nodes
            g = max(1, dp // dp_nodes)
            groups_on_node = max(1, min(tp * pp, per_node))
            raw = (_xfer_s(shard_bytes * mult * _ring(g), intra)
                   + _xfer_s(shard_bytes * mult * _ring(dp_nodes) * groups_on_node, inter))
        else:
            raw = _xfer_s(shard_bytes * mult * _ring(dp), intra)
        window = (2.0 / 3.0) * (compute if zero >= 2 else t_mb)  # backward the comms hide under
        dp_comm = max(raw - f.dp_overlap * window, f.dp_min_exposed * raw)
    else:
        dp_comm = 0.0

    # --- tensor parallel: 2 all-reduces fwd + 2 bwd per layer (+2 with full recompute) -------
    if tp > 1:
        act_bytes = mb * seq_len / cp * hidden * nbytes
        n_ar = 4 + (2 if act_ckpt == "full" else 0)
        link = intra if tp <= per_node else min(intra, inter / per_node)
        tp_comm = ga * (layers / pp) * n_ar * _xfer_s(2.0 * _ring(tp) * act_bytes, link) * (1.0 - f.tp_overlap)
    else:
        tp_comm = 0.0

    # --- pipeline point-to-point on the critical path --------------------------------------
    if pp > 1:
        act_bytes = mb * seq_len / cp * hidden * nbytes / tp
        crosses_nodes = nodes > 1 and dp < nodes
        link = inter / per_node if crosses_nodes else intra
        pp_comm = f.pp_p2p_exposed_factor * (pp - 1) * _xfer_s(act_bytes, link)
    else:
        pp_comm = 0.0

    # --- optimizer step, offload, overhead -------------------------------------------------
    opt_params = params / (tp * pp) / (dp if zero >= 1 else 1)
    if offload == "none":
        optimizer = opt_params * f.optimizer_bytes_per_param / (gpu.mem_bw_gbs * 1e9)
        off = 0.0
    else:
        optimizer = opt_params / f.cpu_adam_params_per_s
        pcie = f.offload_pcie_gbs * 1e9
        off = opt_params * 4.0 / pcie                          # 16-bit grads down, params up
        if offload == "optimizer+params":
            off += params / (tp * pp) / max(1, dp) * nbytes * 2.0 * ga * dp / pcie  # params fetched fwd + bwd
    mb_over = f.cpu_microbatch_overhead_s if gpu.is_cpu else f.microbatch_overhead_s
    overhead = f.step_overhead_s + ga * mb_over

    return StepTime(compute=compute, bubble=bubble, dp_comm=dp_comm, tp_comm=tp_comm,
                    pp_comm=pp_comm, optimizer=optimizer, offload=off, overhead=overhead)


def step_time(spec: Any, plan: Any, gpu: GPU, *, seq_len: int, nodes: int = 1,
              inter_node_gbps: float | None = None, factors: Factors = DEFAULT_FACTORS) -> float:
    """Predicted seconds per optimizer step (see ``step_time_breakdown``)."""
    return step_time_breakdown(spec, plan, gpu, seq_len=seq_len, nodes=nodes,
                               inter_node_gbps=inter_node_gbps, factors=factors).total


def tokens_per_s(spec: Any, plan: Any, gpu: GPU, *, seq_len: int, nodes: int = 1,
                 inter_node_gbps: float | None = None, factors: Factors = DEFAULT_FACTORS) -> float:
    tokens = plan.micro_batch * plan.grad_accum * plan.dp * seq_len
    return tokens / step_time(spec, plan, gpu, seq_len=seq_len, nodes=nodes,
                              inter_node_gbps=inter_node_gbps, factors=factors)


def job_duration_s(spec: Any, plan: Any, gpu: GPU, *, seq_len: int, steps: int, nodes: int = 1,
                   inter_node_gbps: float | None = None, factors: Factors = DEFAULT_FACTORS) -> float:
    """Predicted seconds to run ``steps`` optimizer steps."""
    return steps * step_time(spec, plan, gpu, seq_len=seq_len, nodes=nodes,
                             inter_node_gbps=inter_node_gbps, factors=factors)


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


def fit_factors(measured: list[Measurement], base: Factors = DEFAULT_FACTORS,
                iterations: int = 6) -> Factors:
    """Refit the per-GPU-type achievable utilisation (``Factors.util``) from measured runs.

    For each GPU type the utilisation is scaled until the median of predicted / measured step
    time over its runs is 1 (only the compute term depends on it, so a few fixed-point rounds
    converge). Types without runs keep the catalog's value. Pure; returns new Factors.
    """
    by_gpu: dict[str, list[Measurement]] = {}
    for m in measured:
        if m.step_s > 0 and math.isfinite(m.step_s):
            by_gpu.setdefault(m.gpu.name, []).append(m)
    util = dict(base.util)
    for name, ms in by_gpu.items():
        u = util.get(name, ms[0].gpu.util)
        for _ in range(iterations):
            f = base.with_(util={**util, name: u})
            ratios = sorted(step_time(m.spec, m.plan, m.gpu, seq_len=m.seq_len, nodes=m.nodes, factors=f)
                            / m.step_s for m in ms)
            med = ratios[len(ratios) // 2] if len(ratios) % 2 else \
                0.5 * (ratios[len(ratios) // 2 - 1] + ratios[len(ratios) // 2])
            u = min(1.0, u * med)
        util[name] = u
    return base.with_(util=util)
