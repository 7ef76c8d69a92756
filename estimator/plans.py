"""Plan enumeration: for a job and a GPU type, every feasible way to run it (GPU count,
dp/tp/pp, ZeRO stage, activation checkpointing, micro-batch x gradient accumulation keeping the
global batch), with memory and step-time predictions, ranked fastest first.

Speed: the allocated bytes of a configuration do not depend on the GPU type (only the
overhead terms do), so the memory table of a job shape is computed once and cached; each GPU
type then only applies its overheads, its capacity and the throughput model. Nor do a
structure's validation, launch rule and batch-independent memory terms depend on the global
batch or the node size: they are kept per structure and shared by every table of the shape. Per GPU count only
the few fastest plans are kept, so step times are asked only of the candidates that may be
among them (``_time_fastest``: a floor shared by a plan shape's ZeRO / offload variants proves
the others slower); the kept plans and their figures are those of timing every candidate.
"""
from __future__ import annotations

import math
from bisect import bisect_right, insort
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from .catalog import GPU, get_gpu
from .errors import DoesNotFitError, FrenzyInputError, check_number, from_validation_error
from .job import DEFAULT_LORA_RANK, MAX_GPUS, TrainingJob
from .memory import (GIB, Estimate, Knobs, _alloc_limit_b, _finish, attention_for, batch_key, estimate,
                     finish_key, host_offload_bytes, lora_adapters, paged_state_bytes, peak_allocated,
                     peak_terms, shape_warnings, validate_knobs)
from .models import ModelSpec, resolve_model, with_positions
from .overheads import Overheads, overheads_for
from .profiles import Profile, get_profile
from .plan import Plan
from .throughput import Adapters, Factors, calibrated_factors, shared_parts, step_time_with

DEFAULT_SAFETY_MARGIN_GIB = 1.0     # GPU memory kept free beyond the prediction
KEEP_PER_COUNT = 3                  # fastest launchable plans kept per GPU count (and as many
#                                     marked not-launchable ones, for the simulator and display)
MAX_PP = 16                         # deeper pipelines only add bubble for the models we plan


def _as_job(job: TrainingJob | dict[str, Any]) -> TrainingJob:
    if isinstance(job, TrainingJob):
        return job
    if not isinstance(job, dict):
        raise FrenzyInputError("job", f"expected a TrainingJob or a dict, got {type(job).__name__}")
    d = dict(job)
    if d.get("train_steps") is None and d.get("train_tokens") is None:
        d["train_steps"] = 1
    from pydantic import ValidationError
    try:
        return TrainingJob.model_validate(d)
    except ValidationError as err:
        raise from_validation_error(err) from None


@dataclass(slots=True)
class _PlanShape:
    """The plan fields the throughput model reads. Slots, not frozen: the planner builds one per
    plan shape it times (a frozen dataclass costs ~4x to build) and the model reads them as
    slots; it carries ``matmul_precision`` so the model's read of it finds the field (a missing
    attribute costs a caught exception per read)."""

    dp: int
    tp: int
    pp: int
    cp: int
    zero: int
    offload: str
    act_ckpt: str
    micro_batch: int
    grad_accum: int
    precision: str
    attention: str = "flash"    # eager kernels move the s x s scores: ~2x the step time of flash at seq 1024
    vpp: int = 1                # interleaved pipeline chunks per rank: the bubble over vpp
    matmul_precision: str = "default"   # the planner's plans run at the default (Plan's default)


class _Candidate:
    """A structure at its largest micro-batch that fits one GPU type: the plan it would be
    (``why`` it cannot launch, or None), before its step time (``step_time``, filled in by
    ``_time_fastest`` for the candidates that may be kept)."""

    __slots__ = ("why", "step_time", "mb", "base", "alloc_b", "ga")

    def __init__(self, why: str | None, mb: int, base: Knobs, alloc_b: float, ga: int):
        self.why, self.step_time, self.mb, self.base, self.alloc_b, self.ga = why, None, mb, base, alloc_b, ga


def _time_fastest(cands: list[_Candidate], spec: ModelSpec, gpu: GPU, seq_len: int, nodes: int,
                  precision: str, attention: str, factors: Factors, lora: bool = False) -> list[_Candidate]:
    """The candidates of one GPU count (table order) that may be among the ``KEEP_PER_COUNT``
    fastest of their kind (launchable, or not), with their step times filled in, in table order.

    Candidates that differ only in ZeRO stage and offload share a shape (tp, pp, cp,
    micro-batch, checkpointing; dp and nodes follow from the count): what their step times
    share is computed once (``throughput.shared_parts``), and with it a floor under all of
    them. Step times are asked in ascending floor order, and a candidate whose floor is above
    the ``KEEP_PER_COUNT``-th fastest step time of its kind found so far is strictly slower
    than that many and is never timed. The ones timed include every one the full sort would
    keep, so the kept plans, their order and their figures are those of timing all.
    ``lora``: a LoRA / QLoRA job: each candidate's adapters (``memory.lora_adapters``; whether
    they are fp32 follows the ZeRO stage) are part of its shape."""
    shared: dict[tuple, tuple] = {}

    def shared_of(c: _Candidate) -> tuple:
        mb, base = c.mb, c.base
        ad = lora_adapters(spec, base) if lora else None
        key = (base.tp, base.pp, base.cp, mb, base.act_ckpt, ad)
        sh = shared.get(key)
        if sh is None:
            shape = _PlanShape(base.dp, base.tp, base.pp, base.cp, base.zero, base.offload, base.act_ckpt, mb,
                               c.ga, precision, attention, base.vpp)
            sh = shared[key] = shared_parts(spec, shape, gpu, seq_len=seq_len, nodes=nodes, factors=factors,
                                            adapters=ad)
        return sh

    n_launchable = sum(1 for c in cands if c.why is None)
    crowded = {True: n_launchable > KEEP_PER_COUNT, False: len(cands) - n_launchable > KEEP_PER_COUNT}
    # all of a kind are kept when there are no more than KEEP_PER_COUNT: timed without a floor
    order = sorted((shared_of(c)[0] if crowded[c.why is None] else -math.inf, i) for i, c in enumerate(cands))
    fastest: dict[bool, list[float]] = {True: [], False: []}     # launchable? -> best step times
    for fl, i in order:
        c = cands[i]
        best = fastest[c.why is None]
        if len(best) >= KEEP_PER_COUNT and fl > best[-1]:
            continue
        c.step_time = st = step_time_with(shared_of(c), c.base.zero, c.base.offload)
        insort(best, st)
        del best[KEEP_PER_COUNT:]
    return [c for c in cands if c.step_time is not None]


def _pow2_upto(n: int) -> list[int]:
    out, v = [], 1
    while v <= n:
        out.append(v)
        v *= 2
    return out


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


@dataclass(frozen=True, slots=True)
class _Technique:
    """How Frenzy's trainer runs the job (the estimate's profile and technique knobs)."""

    framework: str = "frenzy"
    master_weights: str = "fp32"
    finetune: str = "full"
    lora_rank: int = DEFAULT_LORA_RANK
    lora_targets: tuple[str, ...] | None = None
    lora_dropout: float = 0.0


def _technique(job: TrainingJob) -> _Technique:
    ft = job.finetune
    targets = tuple(ft.target_modules) if ft.target_modules else None
    return _Technique("frenzy", job.master_weights, ft.method, ft.rank, targets, ft.dropout)


def _offloads(zero: int) -> tuple[str, ...]:
    """DeepSpeed ZeRO-Offload: the optimizer (ZeRO 1-3) and the parameters too (ZeRO 3)."""
    if zero == 3:
        return ("none", "optimizer", "optimizer+params")
    return ("none", "optimizer") if zero >= 1 else ("none",)


class _Structure:
    """One structure of a job shape (GPU count, dp/tp/pp/cp, ZeRO, offload, checkpointing)
    and what every global batch of the shape shares: its knobs validated at micro-batch 1 and
    accumulation 1 (``base``; validation reads the accumulation only to refuse
    optimizer-in-backward beside it, which the planner never asks), the batch-independent part
    of its peaks (``memory.peak_terms``), the peaks asked so far by (micro-batch,
    ``memory.batch_key``), and the trainer's launch rule (``rule``; an interleaved pipeline's
    reads the accumulation, so ``_table_rule`` asks it per accumulation instead)."""

    __slots__ = ("n", "base", "fin_key", "terms", "peaks", "rule")

    def __init__(self, n: int, base: Knobs, terms: tuple, rule: str | None):
        self.n, self.base, self.fin_key, self.terms, self.rule = n, base, finish_key(base), terms, rule
        self.peaks: dict[tuple[int, int], float] = {}


@lru_cache(maxsize=64)
def _structure_memo(spec: ModelSpec, seq_len: int, precision: str, optimizer: str, attention: str,
                    cpu: bool, tech: _Technique, vpp: int, prof: Profile) -> dict[tuple, _Structure | None]:
    """The structures of a job shape met so far, whatever the global batch, GPU count limit or
    node size (none of which validation or the peaks read): (n, tp, pp, cp, zero, offload,
    act_ckpt) -> ``_Structure``, or None where the model refuses the knobs. A job mix shares a
    shape across global batches and node sizes: the full cluster04 trace on large-4type builds
    540,228 table rows from 84,084 structures. ``prof``: the framework's profile object
    (``PROFILES`` may be replaced at run time; validation and the peaks read it). Memory: about
    3 KB per structure (~250 MB for that trace's 52 shapes); 64 shapes are kept, and within a
    shape the peaks grow with the micro-batches asked (a shape planned at every global batch
    1-200 on 32 GPUs: ~12 MB)."""
    return {}


# (structure, per-rank batch, ((micro_batch, allocated_bytes), ...), (allocated_bytes, ...))
TableRow = tuple[_Structure, int, tuple[tuple[int, float], ...], tuple[float, ...]]


@lru_cache(maxsize=256)
def _memory_table(spec: ModelSpec, seq_len: int, global_batch: int, precision: str,
                  optimizer: str, attention: str, max_gpus: int, gpus_per_node: int,
                  cpu: bool, tech: _Technique = _Technique(), cpu_kinds: bool = False,
                  with_cp: bool = False, vpp: int = 1, *, prof: Profile) -> tuple[TableRow, ...]:
    """Every structure (gpu count, dp/tp/pp/cp, zero, offload, checkpointing) of a job shape
    with the allocated bytes of each candidate micro-batch (ascending: allocation grows with
    it; a micro-batch no GPU holds ends the row). What does not depend on the global batch
    comes from the shape's ``_structure_memo``.

    On the CPU pseudo GPU type (``cpu``) only data-parallel structures, unless ``cpu_kinds``:
    then tp (DeepSpeed AutoTP), pp (the pipeline path), cp (Ulysses) and offload (ZeRO-Offload)
    too. All of them launch on CPU ranks, but none is faster there than data parallel (one
    process per core, gloo), so they are enumerated only when a ``--plan`` filter asks for one.
    cp (Ulysses) plans with ``with_cp``: on every GPU type, on the CPU pseudo type only when a
    filter asks for cp > 1; beside data parallel (tp = pp = 1, the one layout the trainer runs
    Ulysses in: ``trainer.launch_config.check_realisable``). The throughput model charges them
    their all-to-alls and full-sequence attention, so they win where memory binds the cp = 1
    plans (long sequences), not by default.
    ``vpp`` (a filter asking for interleaved
    pipelines) gives every pp > 1 structure that many virtual stages per rank (those whose layers
    do not split into pp x vpp equal chunks drop out); unasked, pipelines are plain 1F1B: the
    interleaved bubble term would make every pp plan prefer vpp = 2, and its extra
    point-to-point cost is modelled from the paper, not measured on a GPU here.
    ``prof``: the framework's profile object (``PROFILES`` may be replaced at run time)."""
    rows = []
    counts = sorted(set(_pow2_upto(max_gpus)) | {g for g in range(gpus_per_node, max_gpus + 1,
                                                                   gpus_per_node)})
    ckpts = ("none", "selective", "full") if attention == "eager" else ("none", "full")
    shard_ok = optimizer not in ("adafactor", "adamw8bit", "adamw8bit-paged")
    ov = overheads_for(None, is_cpu=cpu)      # allocated bytes need only the ZeRO bucket terms
    from .catalog import CATALOG
    ceiling_b = max(g.memory_gib for g in CATALOG.values()) * 4 * GIB   # room for custom types
    dp_only = cpu and not cpu_kinds
    memo = _structure_memo(spec, seq_len, precision, optimizer, attention, cpu, tech, vpp, prof)
    for n in counts:
        tps = [1] if dp_only else [t for t in _pow2_upto(min(n, gpus_per_node)) if spec.heads % t == 0
                                   and (spec.n_kv % t == 0 or t % spec.n_kv == 0)]
        for tp, pp, cp in _layouts(spec, n, tps, gpus_per_node, seq_len, dp_only, with_cp):
            dp = n // (tp * pp * cp)
            if global_batch % dp:
                continue
            if dp_only:
                zeros = (0, 2) if dp > 1 and shard_ok else (0,)
            elif dp == 1 or not shard_ok:
                zeros = (0,)
            else:
                # pipelines too: the trainer's pipeline path runs ZeRO-1 with torch's
                # ZeroRedundancyOptimizer and ZeRO-2/3 with FSDP2, over each stage's replicas
                zeros = (0, 1, 2, 3)
            per_rank = global_batch // dp
            mbs = _divisors(per_rank)
            for zero, off, ck in ((z, o, ck) for z in zeros
                                  for o in (("none",) if dp_only else _offloads(z))
                                  for ck in ckpts):
                key = (n, tp, pp, cp, zero, off, ck)
                try:
                    s = memo[key]
                except KeyError:
                    s = memo[key] = _new_structure(spec, seq_len, n, dp, tp, pp, cp, zero, off, ck,
                                                   precision, optimizer, attention, tech, vpp, ov, cpu)
                if s is None:
                    continue
                rows.append((s, per_rank, *_table_allocs(spec, s, per_rank, mbs, ov, cpu, ceiling_b)))
    return tuple(rows)


def _new_structure(spec: ModelSpec, seq_len: int, n: int, dp: int, tp: int, pp: int, cp: int,
                   zero: int, off: str, ck: str, precision: str, optimizer: str, attention: str,
                   tech: _Technique, vpp: int, ov: Overheads, cpu: bool) -> _Structure | None:
    """A structure validated (None where the model refuses its knobs) with its peak terms."""
    try:
        base = validate_knobs(spec, seq_len=seq_len, micro_batch=1, grad_accum=1, dp=dp, tp=tp,
                              pp=pp, cp=cp, vpp=vpp if pp > 1 else 1, zero=zero, offload=off,
                              precision=precision, optimizer=optimizer, act_ckpt=ck,
                              attention=attention, framework=tech.framework,
                              master_weights=tech.master_weights, finetune=tech.finetune,
                              lora_rank=tech.lora_rank, lora_targets=tech.lora_targets,
                              lora_dropout=tech.lora_dropout)
    except FrenzyInputError:
        return None
    return _Structure(n, base, peak_terms(spec, base, ov, cpu), _structure_rule(spec, base, n, 1))


def _table_allocs(spec: ModelSpec, s: _Structure, per_rank: int, mbs: list[int], ov: Overheads,
                  cpu: bool, ceiling_b: float) -> tuple[tuple, tuple]:
    """A table row's ((micro_batch, allocated bytes), ...) and (allocated bytes, ...): the
    micro-batches ``mbs`` of ``per_rank``, up to the first that no GPU holds; peaks asked by an
    earlier global batch (same ``memory.batch_key``) are not asked again."""
    base, peaks = s.base, s.peaks
    keys = [(mb, batch_key(base, per_rank // mb)) for mb in mbs]
    missing = [i for i, key in enumerate(keys) if key not in peaks]
    if missing:
        got = peak_allocated(spec, base, ov, cpu, tuple((mbs[i], per_rank // mbs[i]) for i in missing),
                             s.terms)
        for i, a in zip(missing, got):
            peaks[keys[i]] = a
    allocs = []
    for mb, key in zip(mbs, keys):
        a = peaks[key]
        allocs.append((mb, a))
        if a > ceiling_b:     # no GPU holds this: larger ones neither
            break
    return tuple(allocs), tuple(a for _, a in allocs)


def clear_caches() -> None:
    """Forget every job shape the planner has seen (structures, memory tables, plans, launch
    rules): the next plans are a planner's that never saw them (speed benchmarks' cold figures,
    tests)."""
    for cache in (_structure_memo, _memory_table, _plans_cached, _launch_rule):
        cache.cache_clear()


def _layouts(spec: ModelSpec, n: int, tps: list[int], gpus_per_node: int, seq_len: int,
             dp_only: bool, with_cp: bool) -> list[tuple[int, int, int]]:
    """The (tp, pp, cp) layouts of ``n`` GPUs: tp within a node, pp up to ``MAX_PP`` stages and
    the model's layers, cp (Ulysses: whole query and KV heads per rank, a whole share of the
    sequence) within a node beside data parallel only."""
    out = []
    for tp in tps:
        pps = [1] if dp_only else [p for p in _pow2_upto(min(n // tp, MAX_PP)) if p <= spec.layers]
        for pp in pps:
            if n % (tp * pp):
                continue
            cps = [1]
            if with_cp and not dp_only and tp == 1 and pp == 1:
                cps += [c for c in _pow2_upto(min(n, gpus_per_node))[1:]
                        if spec.heads % c == 0 and spec.n_kv % c == 0 and seq_len % c == 0]
            out.extend((tp, pp, cp) for cp in cps if n % (tp * pp * cp) == 0)
    return out


def _plan(gpu: GPU, n: int, base: Knobs, mb: int, ga: int, precision: str, optimizer: str,
          attention: str, a: float, r: float, u: float, step_time_s: float, why: str | None,
          nodes: int = 1) -> Plan:
    """The Plan of a structure (``base``) run at micro-batch ``mb`` with gradient accumulation
    ``ga`` on ``nodes`` nodes; ``why``: the reason the trainer cannot launch it
    (``_launch_rule``), None when it can."""
    return Plan.model_construct(
        gpu_type=gpu.name, gpus=n, nodes=nodes, dp=base.dp, tp=base.tp, pp=base.pp, vpp=base.vpp, cp=base.cp, zero=base.zero,
        offload=base.offload, act_ckpt=base.act_ckpt, micro_batch=mb,
        grad_accum=ga, precision=precision, optimizer=optimizer,
        attention=attention, allocated_peak_gib=a, reserved_peak_gib=r, device_used_gib=u,
        step_time_s=step_time_s, not_launchable=why)


@dataclass(slots=True)
class _RuleProbe:
    """What the trainer's layout rules read of a plan (``trainer.launch_config``:
    ``check_realisable``, ``check_pipeline_model``, ``check_tp_model``, ``check_heads``): the
    planner asks them of hundreds of new layouts per job shape, and a pydantic ``Plan`` copy per
    question cost ~40% of ``_launch_rule``."""

    gpus: int = 1
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    zero: int = 0
    offload: str = "none"
    vpp: int = 1
    grad_accum: int = 1


@lru_cache(maxsize=4096)
def _launch_rule(tp: int, pp: int, cp: int, gpus: int, dp: int, zero: int, offload: str,
                 heads: int | None = None, kv_heads: int | None = None, arch: str | None = None, *,
                 vpp: int = 1, grad_accum: int = 1, layers: int | None = None,
                 model_type: str | None = None) -> str | None:
    """The trainer's own rules (no torch): the plan's layout, with ``heads`` how tp and cp
    split the model's attention heads, with ``arch`` (and ``layers``) whether pp (and vpp) can
    cut the model into stages, with ``model_type`` whether tp can shard its embedding;
    ``grad_accum``: the micro-batches an interleaved schedule runs."""
    try:
        from trainer.launch_config import check_pipeline_model, check_realisable, check_tp_model
    except ImportError:          # an estimator installed without the trainer: nothing to check
        return None
    probe = _RuleProbe(gpus, dp, tp, pp, cp, zero, offload, vpp, grad_accum)
    try:
        check_realisable(probe)
        if arch is not None:
            check_pipeline_model(probe, arch, layers)
        check_tp_model(probe, model_type)
    except FrenzyInputError as err:
        return f"{err.field}: {err.rule}"
    return heads_rule(tp, cp, heads, kv_heads, pp) if heads is not None else None


def heads_rule(tp: int, cp: int, heads: int, kv_heads: int | None = None, pp: int = 1) -> str | None:
    """Why the trainer cannot split the model's attention heads over ``tp`` and ``cp`` ranks
    (``trainer.launch_config.check_heads``, one line; ``pp`` names the tp backend), or None."""
    try:
        from trainer.launch_config import check_heads
    except ImportError:          # an estimator installed without the trainer: nothing to check
        return None
    try:
        check_heads(_RuleProbe(tp=tp, cp=cp, pp=pp), heads, kv_heads)
    except FrenzyInputError as err:
        return f"{err.field}: {err.rule}"
    return None


def _structure_rule(spec: ModelSpec, base: Knobs, n: int, ga: int) -> str | None:
    """``_launch_rule`` of a structure's knobs on ``n`` GPUs with gradient accumulation ``ga``."""
    return _launch_rule(base.tp, base.pp, base.cp, n, base.dp, base.zero, base.offload, spec.heads,
                        spec.n_kv, spec.arch, vpp=base.vpp, grad_accum=ga, layers=spec.layers,
                        model_type=spec.model_type)


def _table_rule(spec: ModelSpec, s: _Structure, ga: int) -> str | None:
    """The launch rule of a structure run with gradient accumulation ``ga``: the structure's own
    unless its pipeline is interleaved (the one rule that reads ``ga``)."""
    return s.rule if s.base.vpp == 1 else _structure_rule(spec, s.base, s.n, ga)


def not_launchable_reason(plan: Plan, spec: ModelSpec | None = None) -> str | None:
    """Why this installation's trainer cannot launch ``plan`` (the trainer's realisability
    rules, in one line; with the model's ``spec`` also its heads rule), or None when it can."""
    return _launch_rule(plan.tp, plan.pp, plan.cp, plan.gpus, plan.dp, plan.zero, plan.offload,
                        *((spec.heads, spec.n_kv, spec.arch) if spec is not None else ()),
                        vpp=plan.vpp, grad_accum=plan.grad_accum,
                        layers=spec.layers if spec is not None else None,
                        model_type=spec.model_type if spec is not None else None)


def _host_rule(spec: ModelSpec, base: Knobs, n: int, gpus_per_node: int,
               host_ram_gib: float | None) -> str | None:
    """Why an offload plan cannot run on nodes of ``host_ram_gib`` host memory: the offloaded
    states of the node's training processes (``memory.host_offload_bytes`` each) exceed it."""
    if host_ram_gib is None or base.offload == "none":
        return None
    per = host_offload_bytes(spec, base) / GIB
    procs = min(n, gpus_per_node)
    if per * procs <= host_ram_gib:
        return None
    return (f"plan.offload: {base.offload} needs {per * procs:,.0f} GiB of host memory per node "
            f"({procs} process{'es' if procs != 1 else ''} x {per:,.1f} GiB) but a node has "
            f"{host_ram_gib:,.0f} GiB (a pool's host_ram_gib; unset: 2 x its nodes' GPU memory)")


def _plans_for_gpu(job: TrainingJob, spec: ModelSpec, gpu: GPU, max_gpus: int,
                   gpus_per_node: int, margin: float, keep_closest: list | None = None,
                   host_ram_gib: float | None = None, plan_filter: dict | None = None,
                   fitting: list | None = None) -> list[Plan]:
    """``fitting``: gets the number of plans that fit before ``plan_filter`` kept its matches."""
    ov = overheads_for(gpu.name, is_cpu=gpu.is_cpu)
    tech = _technique(job)
    # the profile object is part of the caches' keys: PROFILES may be replaced at run time
    plans, closest, n_fit = _plans_cached(spec, job.seq_len, job.global_batch, job.precision,
                                          job.optimizer, attention_for(spec, job.attention, tech.framework),
                                          gpu, max_gpus, gpus_per_node,
                                          float(margin), ov, tech,
                                          None if host_ram_gib is None else float(host_ram_gib),
                                          tuple(plan_filter.items()) if plan_filter else None,
                                          prof=get_profile(tech.framework))
    if keep_closest is not None and closest is not None:
        keep_closest.append(closest)
    if fitting is not None:
        fitting.append(n_fit)
    return list(plans)


@lru_cache(maxsize=4096)
def _plans_cached(spec: ModelSpec, seq_len: int, global_batch: int, precision: str,
                  optimizer: str, attention: str, gpu: GPU, max_gpus: int, gpus_per_node: int,
                  margin: float, ov: Overheads, tech: _Technique = _Technique(),
                  host_ram_gib: float | None = None, plan_filter: tuple | None = None, *,
                  prof: Profile) -> tuple[tuple[Plan, ...], tuple[float, Plan] | None, int]:
    """The plans of one job shape on one GPU type, the closest miss when none fits (shortfall
    GiB, plan), and how many fit. With ``host_ram_gib`` (per node) offload plans whose
    offloaded states the nodes cannot hold are marked not launchable; with ``plan_filter``
    (``estimator.plan_filter`` items) only matching plans are kept, chosen before the best few
    per GPU count, so a slower plan kind asked for on purpose is not crowded out."""
    from .plan_filter import asks_for_parallel_kind, matches, nodes_for

    flt = dict(plan_filter) if plan_filter else None
    keep_closest: list = []
    table = _memory_table(spec, seq_len, global_batch, precision, optimizer, attention,
                          max_gpus, gpus_per_node, gpu.is_cpu, tech,
                          gpu.is_cpu and asks_for_parallel_kind(flt),
                          not gpu.is_cpu or (bool(flt) and int(flt.get("cp", 1)) > 1),
                          int(flt.get("vpp", 1)) if flt else 1, prof=prof)
    cap = gpu.memory_gib - margin
    # a paged 8-bit optimizer's states sit in CUDA unified memory, outside the allocator
    # (``memory.paged_state_bytes``): device used counts them, as ``estimate`` does, so a plan
    # keeps them resident rather than paging them to the host every step
    paged = optimizer == "adamw8bit-paged"

    def finish(alloc_b: float, base: Knobs) -> tuple[float, float, float]:
        a, r, u = _finish(alloc_b, ov, base)
        return (a, r, u + paged_state_bytes(spec, base) / GIB) if paged else (a, r, u)

    by_count: dict[int, list[_Candidate]] = {}
    limits: dict[tuple, float] = {}     # memory.finish_key -> the most allocated bytes that fit
    for s, per_rank, allocs, alloc_values in table:
        base, n = s.base, s.n
        key = (s.fin_key, base.tp, base.pp, base.offload) if paged else s.fin_key
        limit = limits.get(key)
        if limit is None:
            limit = limits[key] = _alloc_limit_b(
                cap - paged_state_bytes(spec, base) / GIB if paged else cap, ov, base)
        # used GiB grows with allocated bytes, so the largest fitting micro-batch is a bisection
        j = bisect_right(alloc_values, limit)
        if j == 0:
            mb0, a0 = allocs[0]
            a, r, u = finish(a0, base)
            keep_closest.append((u - cap, s, per_rank // mb0, mb0, a, r, u))
            continue
        mb, a_b = allocs[j - 1]
        ga = per_rank // mb
        why = _table_rule(spec, s, ga) or _host_rule(spec, base, n, gpus_per_node, host_ram_gib)
        by_count.setdefault(n, []).append(_Candidate(why, mb, base, a_b, ga))
    plans = []
    n_fit = sum(len(c) for c in by_count.values())
    f = calibrated_factors()        # one snapshot of the calibration file for the whole type
    for n, cands in by_count.items():
        nodes = nodes_for(n, gpus_per_node)
        if flt:     # on the knobs alone (memory and step time are not filter knobs)
            cands = [c for c in cands if matches(_plan(gpu, n, c.base, c.mb, c.ga, precision, optimizer,
                                                       attention, 0.0, 0.0, 0.0, 0.0, c.why, nodes),
                                                 flt, gpus_per_node)]
        # every launchable plan is considered before the best few per count are kept, so
        # faster plans the trainer cannot launch never crowd out the ones it can; memory
        # figures and Plan objects are made for the timed and the kept ones only
        # (candidate, (allocated, reserved, used GiB)), fastest first, then the least used
        timed = [(c, finish(c.alloc_b, c.base))
                 for c in _time_fastest(cands, spec, gpu, seq_len, nodes, precision, attention, f,
                                        tech.finetune != "full")]
        timed.sort(key=lambda t: (t[0].why is not None, t[0].step_time, t[1][2]))
        kept = [t for t in timed if t[0].why is None][:KEEP_PER_COUNT] + \
            [t for t in timed if t[0].why is not None][:KEEP_PER_COUNT]
        plans.extend(_plan(gpu, n, c.base, c.mb, c.ga, precision, optimizer, attention, round(a, 4),
                           round(r, 4), round(u, 4), c.step_time, c.why, nodes)
                     for c, (a, r, u) in kept)
    plans.sort(key=lambda p: (p.not_launchable is not None, p.step_time_s, p.gpus,
                              p.device_used_gib))
    closest = None
    if keep_closest and not n_fit:
        short, s, ga, mb, a, r, u = min(keep_closest, key=lambda x: x[0])
        closest = (short, _plan(gpu, s.n, s.base, mb, ga, precision, optimizer, attention, a, r, u, 0.0,
                                _table_rule(spec, s, ga), nodes_for(s.n, gpus_per_node)))
    return tuple(plans), closest, n_fit


def enumerate_plans(job: TrainingJob | dict, gpu_type: str, *, max_gpus: int,
                    gpus_per_node: int = 8, safety_margin_gib: float = DEFAULT_SAFETY_MARGIN_GIB,
                    gpus: dict[str, GPU] | None = None, host_ram_gib: float | None = None) -> list[Plan]:
    """Feasible plans of ``job`` on ``gpu_type`` using at most ``max_gpus`` GPUs, each with
    ``device_used_gib <= memory - safety_margin_gib``: the launchable ones first, fastest first
    (predicted step time), then those this trainer cannot launch (``not_launchable`` says why).
    ``gpus``: a cluster's own GPU types (``Cluster.gpu_catalog()``), looked up before the catalog.
    ``host_ram_gib``: host memory per node (``Cluster.host_ram_gib()``); offload plans whose
    offloaded states exceed it are marked not launchable. None: not checked."""
    j = _as_job(job)
    spec = with_positions(resolve_model(j.model), j.seq_len)
    gpu = get_gpu(gpu_type, gpus)
    if not isinstance(max_gpus, int):             # 8.0 is not a GPU count here (check_number takes it)
        raise FrenzyInputError("max_gpus", f"must be a positive integer, got {max_gpus!r}")
    check_number("max_gpus", max_gpus, low=1, low_open=False, high=MAX_GPUS, integer=True)
    _check_sizes({}, gpus_per_node, None if host_ram_gib is None else {gpu_type: host_ram_gib})
    if j.max_gpus:
        max_gpus = min(max_gpus, j.max_gpus)
    if safety_margin_gib is None:
        safety_margin_gib = DEFAULT_SAFETY_MARGIN_GIB
    check_number("safety_margin_gib", safety_margin_gib, low_open=False)
    return _plans_for_gpu(j, spec, gpu, max_gpus, int(gpus_per_node), safety_margin_gib, host_ram_gib=host_ram_gib)


def _check_sizes(inventory: Any, gpus_per_node: Any, host_ram_gib: Any) -> None:
    """The planner's cluster sizes, one line each when wrong: GPU counts whole and within
    ``MAX_GPUS`` (0: the type is not there), GPUs per node whole and positive, host memory a
    positive finite number (a bool, 2.5 GPUs, a count of 10^30 or a NaN were taken as they came,
    truncated, spun for ever or crashed deep inside)."""
    if not isinstance(inventory, dict):
        raise FrenzyInputError("inventory", f"must map GPU type -> GPU count, got {type(inventory).__name__}")
    for g, n in inventory.items():
        check_number(f"inventory[{g!r}]", n, low_open=False, high=MAX_GPUS, integer=True)
    per_node = gpus_per_node if isinstance(gpus_per_node, dict) else {"": gpus_per_node}
    for g, n in per_node.items():
        check_number(f"gpus_per_node[{g!r}]" if g else "gpus_per_node", n, low=1, low_open=False, high=MAX_GPUS,
                     integer=True)
    if host_ram_gib is not None:
        if not isinstance(host_ram_gib, dict):
            raise FrenzyInputError("host_ram_gib", f"must map GPU type -> GiB per node, got {host_ram_gib!r}")
        for g, ram in host_ram_gib.items():
            if ram is not None:
                check_number(f"host_ram_gib[{g!r}]", ram, what="GiB per node")


def plans_for_job(job: TrainingJob | dict, inventory: dict[str, int], *,
                  gpus_per_node: dict[str, int] | int = 8,
                  safety_margin_gib: float = DEFAULT_SAFETY_MARGIN_GIB,
                  gpus: dict[str, GPU] | None = None,
                  host_ram_gib: dict[str, float] | None = None,
                  plan_filter: dict | str | None = None) -> dict[str, list[Plan]]:
    """Feasible plans per GPU type of the inventory (gpu_type -> GPUs in the cluster), each list
    fastest first; ``gpus`` as in ``enumerate_plans``; ``host_ram_gib``: GPU type -> host memory
    per node (``Cluster.host_ram_gib()``), for the offload plans; ``plan_filter``: only plans
    with these knobs (a ``--plan`` string such as ``"tp=2,zero=1"``, or its
    ``estimator.plan_filter.parse_plan_filter`` dict), picked among all that fit.
    GPU types the job does not allow or that hold no plan map to []. Raises DoesNotFitError
    (closest plan, shortfall in GiB) when nothing fits anywhere, FrenzyInputError naming the
    filter when plans fit but none matches it."""
    j = _as_job(job)
    spec = with_positions(resolve_model(j.model), j.seq_len)
    if safety_margin_gib is None:
        safety_margin_gib = DEFAULT_SAFETY_MARGIN_GIB
    check_number("safety_margin_gib", safety_margin_gib, low_open=False)
    _check_sizes(inventory, gpus_per_node, host_ram_gib)
    if isinstance(plan_filter, str):            # the --plan text; "" filters nothing, as {} and None
        from .plan_filter import parse_plan_filter
        plan_filter = parse_plan_filter(plan_filter) if plan_filter.strip() else None
    elif plan_filter:                            # a dict: the same knobs and values as the text
        from .plan_filter import describe, parse_plan_filter
        if not isinstance(plan_filter, dict):
            raise FrenzyInputError("plan", f"must be knob=value text or a dict of knobs, got {plan_filter!r}")
        plan_filter = parse_plan_filter(describe(plan_filter))
    if plan_filter:
        from .plan_filter import check_gpu, check_heads
        check_heads(plan_filter, spec)      # tp=3 on 4 heads: that, not "no plan matches"
        plan_filter = check_gpu(plan_filter, [g for g, n in inventory.items() if n > 0], gpus)
    if j.allowed_gpu_types:
        # TrainingJob made catalog names the catalog's; a name neither the catalog, the
        # cluster's own types nor the inventory has is a typo, not a type to leave out
        from .catalog import CATALOG
        known = {**CATALOG, **(gpus or {}), **dict.fromkeys(inventory)}
        for name in j.allowed_gpu_types:
            if name not in known:
                raise FrenzyInputError("allowed_gpu_types", f"unknown GPU type {name!r}; known types: "
                                                            f"{', '.join(sorted(known))}")
    out: dict[str, list[Plan]] = {}
    closest: list = []
    fitting: list[int] = []
    for gtype, count in inventory.items():
        if j.allowed_gpu_types and gtype not in j.allowed_gpu_types:
            out[gtype] = []
            continue
        if count <= 0:
            out[gtype] = []
            continue
        gpu = get_gpu(gtype, gpus)
        gpn = gpus_per_node.get(gtype, 8) if isinstance(gpus_per_node, dict) else gpus_per_node
        n = min(int(count), j.max_gpus or int(count))
        out[gtype] = _plans_for_gpu(j, spec, gpu, n, int(gpn), safety_margin_gib, closest,
                                    host_ram_gib=(host_ram_gib or {}).get(gtype), plan_filter=plan_filter,
                                    fitting=fitting)
    if not any(out.values()) and plan_filter and sum(fitting):
        from .plan_filter import no_match_error
        raise no_match_error(plan_filter, sum(fitting), list(out))
    if not any(out.values()):
        if closest:
            short, plan = min(closest, key=lambda x: x[0])
            raise DoesNotFitError(plan, short, f"(safety margin {safety_margin_gib} GiB)")
        _refuse_without_plans(j, spec, inventory)
    return out


def plan_warnings(job: TrainingJob | dict) -> list[str]:
    """What every plan of ``job`` carries beside its figures (``memory.shape_warnings`` of the
    job's model, sequence length and attention under Frenzy's trainer): where the estimates
    extrapolate beyond any measured source, or are traced rather than measured."""
    j = _as_job(job)
    spec = with_positions(resolve_model(j.model), j.seq_len)
    framework = _technique(j).framework
    return shape_warnings(spec, j.seq_len, attention_for(spec, j.attention, framework), framework)


# estimate()'s adapter knobs as a TrainingJob names them
_JOB_FIELDS = {"lora_targets": "finetune.target_modules", "lora_rank": "finetune.rank",
               "lora_dropout": "finetune.dropout"}


def _refuse_without_plans(j: TrainingJob, spec: ModelSpec, inventory: dict[str, int]) -> None:
    """No plan, not even a closest miss: say why in the job's own terms. The job's allowed GPU
    types are not in the inventory (named), or the model refuses the job at any layout (e.g. a
    sequence longer than its learned position table: the model's own rule, as ``estimate``
    says it), else no layout of it is valid on these types."""
    have = [g for g, n in inventory.items() if n > 0]
    if j.allowed_gpu_types and have and not set(have) & set(j.allowed_gpu_types):
        raise FrenzyInputError("allowed_gpu_types", f"none of {', '.join(j.allowed_gpu_types)} is in the "
                                                    f"inventory ({', '.join(have)})")
    if not have:
        raise DoesNotFitError(None, float("inf"), "(no GPU type of the inventory is allowed)")
    t = _technique(j)
    try:
        validate_knobs(spec, seq_len=j.seq_len, precision=j.precision, optimizer=j.optimizer,
                       attention=attention_for(spec, j.attention, t.framework), framework=t.framework,
                       master_weights=t.master_weights, finetune=t.finetune, lora_rank=t.lora_rank,
                       lora_targets=t.lora_targets, lora_dropout=t.lora_dropout)
    except FrenzyInputError as err:     # the estimator's knob names, as the job's fields
        raise FrenzyInputError(_JOB_FIELDS.get(err.field, err.field), err.rule) from None
    raise DoesNotFitError(None, float("inf"), f"(no parallel layout of {spec.name} is valid on "
                                              f"{', '.join(have)})")


def _plan_knobs(j: TrainingJob, plan: Plan) -> dict[str, Any]:
    """The `estimate` / `validate_knobs` keywords of ``j`` run on ``plan``: the one place that
    turns a plan and a job's technique back into knobs."""
    t = _technique(j)
    spec = resolve_model(j.model)
    return dict(seq_len=j.seq_len, micro_batch=plan.micro_batch, grad_accum=plan.grad_accum, dp=plan.dp,
                tp=plan.tp, pp=plan.pp, cp=plan.cp, vpp=plan.vpp, zero=plan.zero, offload=plan.offload,
                precision=plan.precision, optimizer=plan.optimizer, act_ckpt=plan.act_ckpt,
                attention=attention_for(spec, plan.attention, t.framework), framework=t.framework,
                master_weights=t.master_weights, finetune=t.finetune,
                # adapter settings only where there are adapters (``estimate`` refuses them beside
                # a full fine-tune)
                **(dict(lora_rank=t.lora_rank, lora_targets=t.lora_targets, lora_dropout=t.lora_dropout)
                   if t.finetune != "full" else {}))


def estimate_plan(job: TrainingJob | dict, plan: Plan, *, gpus: dict[str, GPU] | None = None) -> Estimate:
    """The full estimate (breakdown, per-stage peaks) of ``job`` run on ``plan``. ``gpus``: as
    in ``enumerate_plans``."""
    j = _as_job(job)
    return estimate(j.model, gpu=get_gpu(plan.gpu_type, gpus), **_plan_knobs(j, plan))


def plan_adapters(job: TrainingJob | dict, plan: Plan) -> Adapters | None:
    """The LoRA adapters the throughput model charges when ``job`` runs on ``plan``
    (``throughput.step_time(..., adapters=...)``); None for full fine-tuning."""
    j = _as_job(job)
    if j.finetune.method == "full":
        return None
    spec = with_positions(resolve_model(j.model), j.seq_len)
    return lora_adapters(spec, validate_knobs(spec, **_plan_knobs(j, plan)))
