"""Memory outside the tensor model: the caching allocator and the CUDA runtime, as named terms.

allocated (tensors alive, torch.cuda.max_memory_allocated)
  -> reserved = allocated * (1 + fragmentation)                     (torch.cuda.max_memory_reserved)
     (fragmentation_recompute instead under full activation checkpointing, or
      fragmentation_recompute_expandable with expandable segments; with expandable segments,
      fragmentation_adapters for LoRA / QLoRA without recomputation)
  -> device_used = reserved + cuda_context + workspace + nccl_per_comm * comms   (nvidia-smi)

Defaults are documented figures (notes/memory-model.md section 8); ``frenzy calibrate`` fits
them per GPU type from measured runs and writes ``$FRENZY_HOME/calibration.json``:

    {"A100-80GB": {"cuda_context_gib": 0.52, "fragmentation": 0.06, ...}, ...}

Only the keys present override the defaults. Pure: no torch.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields, replace
from functools import lru_cache
from operator import attrgetter
from pathlib import Path
from .home import DEFAULT_HOME, forget_json_cache, frenzy_home, read_json_cached, write_atomic

# --- documented defaults ------------------------------------------------------------------
# CUDA context + kernel images per process with lazy module loading (CUDA 11.7+ default):
# 0.3-0.5 GB on A100/H100 in the literature; 0.61 GiB measured on H200 (torch 2.11, CUDA 13).
CUDA_CONTEXT_GIB = 0.6
# Library workspaces and kernels loaded during training, outside the caching allocator
# (cuBLAS/cuDNN/flash handles): nvidia-smi used - max_memory_reserved - context = 0.14 GiB
# on every one of 54 H200 runs (bench/estimator_measured_h200*.json).
WORKSPACE_GIB = 0.15
# Caching-allocator fragmentation: max_memory_reserved / max_memory_allocated - 1, measured
# on 54 H200 runs (bench/estimator_measured_h200*.json): without recomputation 0.3-24 %,
# median 4.4 %, 90th percentile 10 %; full recomputation churns more blocks: 0.4-28 %,
# median 19 %, 90th percentile 28 %. The defaults are the 90th percentiles, so reserved and
# device-used predictions rarely fall short (the documented range is a few % to 15 %).
FRAGMENTATION = 0.10
FRAGMENTATION_RECOMPUTE = 0.28
# LoRA / QLoRA runs through Frenzy's trainer (expandable segments) churn more: per adapted
# projection and micro-batch, transient input casts (fp32 copies twice the activation's size),
# rank-r activations and the copies each adapter saves interleave with the block's large
# tensors. Measured on 7 such runs without recomputation (H200; docs/benchmarks.md): 6.3-23.5 %,
# median 13 %, 90th percentile ~20 %, against 3.7-10.5 % for full fine-tuning runs of the same
# models; the default is that 90th percentile, as for the others. Two runs held out afterwards
# (Llama-3.2-3B) measured 4.8 % and 11.7 %. Only for profiles that run expandable segments: the
# one default-allocator LoRA measurement (PEFT's suite, public row 12) sits at the 10 % above.
FRAGMENTATION_ADAPTERS = 0.20
# Full recomputation under PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (what Frenzy's
# launcher sets, as torchtitan does): one growing mapped segment per stream instead of
# fixed-size segments that cannot merge, so the recomputed blocks' churn strands less. Measured
# through Frenzy's trainer on the H200: 13.0 % and 14.4 % (full fine-tuning, Llama-3.2-1B,
# Qwen2.5-0.5B), 22.4 % (LoRA on all projections, Qwen2.5-1.5B), against 19 % median and 28 %
# 90th percentile with the default allocator above. Profiles say which allocator they run
# (``profiles.Profile.expandable_segments``).
FRAGMENTATION_RECOMPUTE_EXPANDABLE = 0.20
# NCCL buffers per communicator a rank joins (NCCL_BUFFSIZE 4 MiB x channels x peers; 0.2-1 GB).
NCCL_PER_COMM_GIB = 0.25
# What a run may hold outside its allocator and still be measured alone: a CUDA context with
# every kernel image loaded eagerly (CUDA_MODULE_LOADING=EAGER: torch's kernels, ~1-2 GB) plus
# the workspaces; NCCL's buffers per communicator (NCCL_BUFFSIZE 4 MiB x at most 32 channels x
# send and receive x a few peers, plus NVLink SHARP's buffers on NVSwitch systems, ~1-2 GiB)
# stay under 4 GiB, and the per-communicator figure divides by the parallel dimensions, not
# every group a rank joins, so it runs high. NVML's used memory is the whole
# device's: a run that shared its GPU with another process reads more, and calibrating on it
# made every plan of the type carry the other process (one run on a shared A100 gave a 61 GiB
# "context"). Such runs are left out of the context and NCCL fits (``outliers``).
MAX_CONTEXT_GIB = 2.0
MAX_NCCL_PER_COMM_GIB = 4.0
# DeepSpeed ZeRO-1/2 communication buckets (elements): a reduce and an all-gather bucket of
# 16-bit values. The trainer's DeepSpeed config (trainer/launch_config.py) sets both to 5e7 with
# overlap_comm off; DeepSpeed's own default is 5e8 (about 9 GB with overlap_comm on).
ZERO_BUCKET_ELEMS = 5e7
# ZeRO-3 / FSDP: gathered 16-bit parameters of the current and the prefetched unit.
ZERO3_LIVE_UNITS = 2
# CPU pseudo-GPU: no context, no allocator rounding we can see; processes share host RAM.
CPU_CONTEXT_GIB = 0.0


FIELDS: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Overheads:
    """Per-GPU-type runtime and allocator terms (GiB unless noted)."""

    cuda_context_gib: float = CUDA_CONTEXT_GIB
    workspace_gib: float = WORKSPACE_GIB
    fragmentation: float = FRAGMENTATION
    fragmentation_recompute: float = FRAGMENTATION_RECOMPUTE
    fragmentation_adapters: float = FRAGMENTATION_ADAPTERS
    fragmentation_recompute_expandable: float = FRAGMENTATION_RECOMPUTE_EXPANDABLE
    nccl_per_comm_gib: float = NCCL_PER_COMM_GIB
    zero_bucket_elems: float = ZERO_BUCKET_ELEMS
    zero3_live_units: float = ZERO3_LIVE_UNITS

    def as_dict(self) -> dict[str, float]:
        return dict(zip(FIELDS, _values(self)))  # a fresh dict: callers may add to it


FIELDS = tuple(f.name for f in fields(Overheads))
_values = attrgetter(*FIELDS)
DEFAULT = Overheads()
CPU_OVERHEADS = Overheads(cuda_context_gib=CPU_CONTEXT_GIB, workspace_gib=0.0, fragmentation=0.0,
                          fragmentation_recompute=0.0, fragmentation_adapters=0.0,
                          fragmentation_recompute_expandable=0.0, nccl_per_comm_gib=0.0)



def calibration_path() -> Path:
    return frenzy_home() / "calibration.json"


def _calibration_file() -> str:
    # the hot path (every estimate with a GPU type): plain strings, no pathlib, joined once per home
    return _calibration_in(os.environ.get("FRENZY_HOME") or DEFAULT_HOME)


@lru_cache(maxsize=16)
def _calibration_in(home: str) -> str:
    return os.path.join(home, "calibration.json")


# What a fitted term may be (a file edited by hand or written by another tool): GiB terms and
# fragmentation shares are never negative (a negative context or share would make any plan fit),
# a share above 1 would mean reserved more than twice allocated (54 H200 runs: at most 0.28);
# buckets hold elements, and ZeRO-3 keeps at least the unit it computes.
_TERM_RANGE = {**{k: (0.0, None) for k in ("cuda_context_gib", "workspace_gib", "nccl_per_comm_gib")},
               **{k: (0.0, 1.0) for k in ("fragmentation", "fragmentation_recompute",
                                            "fragmentation_adapters", "fragmentation_recompute_expandable")},
               "zero_bucket_elems": (1.0, None), "zero3_live_units": (1.0, None)}


def _checked_term(gpu: str, key: str, value: object) -> float:
    low, high = _TERM_RANGE[key]
    v = float(value) if type(value) in (int, float) else math.nan
    if not (math.isfinite(v) and v >= low and (high is None or v <= high)):
        rule = f"a number >= {low:g}" + (f" and <= {high:g}" if high is not None else "")
        raise ValueError(f"{gpu}.{key} must be {rule}, got {value!r}")
    return v


def load_calibration(path: str | os.PathLike | None = None) -> dict[str, dict[str, float]]:
    """The calibration file's contents ({gpu_type: {term: value}}); {} when absent.
    Re-read only when the file changes (mtime), so estimates stay fast. A term out of its
    range (NaN, a negative context, a share above 1) makes the file not parse: a warning
    names it and the defaults are used (``home.read_json_cached``)."""
    def parse(data: dict) -> dict[str, dict[str, float]]:
        return {str(g): {k: _checked_term(str(g), k, v) for k, v in terms.items() if k in FIELDS}
                for g, terms in data.items() if isinstance(terms, dict)}
    return read_json_cached(os.fspath(path) if path else _calibration_file(), parse) or {}


def overheads_for(gpu_type: str | None, *, is_cpu: bool = False) -> Overheads:
    """Fitted terms for ``gpu_type`` where the calibration file has them, defaults otherwise."""
    base = CPU_OVERHEADS if is_cpu or gpu_type == "CPU" else DEFAULT
    if gpu_type:
        fitted = load_calibration().get(gpu_type)
        if fitted:
            return replace(base, **fitted)
    return base


def write_calibration(fits: dict[str, dict[str, float]], path: str | os.PathLike | None = None) -> Path:
    """Merge ``fits`` into the calibration file (other GPU types kept) and return its path."""
    p = Path(path) if path else calibration_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    current = {}
    if p.exists():
        try:
            current = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            current = {}
    for g, terms in fits.items():
        current.setdefault(g, {}).update({k: float(v) for k, v in terms.items() if k in FIELDS})
    write_atomic(p, json.dumps(current, indent=2, sort_keys=True))
    forget_json_cache()
    return p


# ---------------------------------------------------------------------------- calibration fit
def _get(row: object, key: str):
    return row.get(key) if isinstance(row, dict) else getattr(row, key, None)


def _quantile(vals: list[float], q: float) -> float:
    s = sorted(vals)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def fit_calibration(measurements: list, specs: dict[str, dict] | None = None) -> dict[str, dict[str, float | int]]:
    """Fit the overhead terms per GPU type from measured runs (ledger measurement rows, or
    dicts with ``gpu_type``, ``plan`` and ``measured``; ``specs``: job id -> the job's spec,
    which says whether a run trained LoRA adapters).

    * ``fragmentation`` (and ``fragmentation_recompute`` for full-checkpointing runs;
      ``fragmentation_recompute_expandable`` for those whose ``measured["allocator"]`` says
      expandable segments, as the trainer reports it, and ``fragmentation_adapters`` for LoRA runs
      without recomputation there): reserved / allocated - 1, the 90th percentile (the maximum
      below 5 runs) so the fitted figure rarely under-predicts;
    * ``cuda_context_gib``: device used - reserved - workspace on single-GPU runs (90th pct);
    * ``nccl_per_comm_gib``: the rest of device used on multi-GPU runs, per communicator.
    Runs whose device used exceeds what one process explains (``MAX_CONTEXT_GIB``,
    ``MAX_NCCL_PER_COMM_GIB``: another process on the GPU) are left out of those two fits.
    Returns {gpu_type: {term: value, ..., "runs": n, "outliers": m}} for types with usable
    rows only (``outliers`` only where m > 0; neither key is a term)."""
    from .job import trains_adapters

    by_type: dict[str, list] = {}
    for m in measurements:
        meas = _get(m, "measured") or {}
        a, r = meas.get("allocated_peak_gib"), meas.get("reserved_peak_gib")
        if not meas.get("memory_measured", True) or not a or not r or a <= 0:
            continue
        by_type.setdefault(str(_get(m, "gpu_type")), []).append(m)
    fits: dict[str, dict[str, float | int]] = {}
    for gtype, rows in by_type.items():
        frag, frag_rc, frag_rc_exp, frag_lora, ctx, nccl = [], [], [], [], [], []
        outliers = 0
        for m in rows:
            meas, plan = _get(m, "measured"), _get(m, "plan") or {}
            a, r = float(meas["allocated_peak_gib"]), float(meas["reserved_peak_gib"])
            expandable = meas.get("allocator") == "expandable"
            if plan.get("act_ckpt") == "full":
                bucket = frag_rc_exp if expandable else frag_rc
            else:
                lora = trains_adapters((specs or {}).get(_get(m, "job_id")))
                bucket = frag_lora if expandable and lora else frag
            bucket.append(max(0.0, r / a - 1.0))
            used = meas.get("nvml_used_gib", meas.get("device_used_gib"))
            if used:
                outside = float(used) - r - WORKSPACE_GIB
                comms = sum(1 for d in ("dp", "tp", "pp", "cp") if int(plan.get(d, 1) or 1) > 1)
                if comms == 0:
                    if outside > MAX_CONTEXT_GIB:
                        outliers += 1
                    else:
                        ctx.append(max(0.0, outside))
                else:
                    nccl.append((outside, comms))
        pick = (lambda v: _quantile(v, 0.9) if len(v) >= 5 else max(v))
        fit: dict[str, float | int] = {"runs": len(rows)}
        if frag:
            fit["fragmentation"] = round(min(0.5, pick(frag)), 4)
        if frag_rc:
            fit["fragmentation_recompute"] = round(min(0.8, pick(frag_rc)), 4)
        if frag_rc_exp:
            fit["fragmentation_recompute_expandable"] = round(min(0.8, pick(frag_rc_exp)), 4)
        if frag_lora:
            fit["fragmentation_adapters"] = round(min(0.8, pick(frag_lora)), 4)
        if ctx:
            fit["cuda_context_gib"] = round(pick(ctx), 4)
        if nccl:
            base = fit.get("cuda_context_gib", CUDA_CONTEXT_GIB)
            per = [max(0.0, (o - base) / c) for o, c in nccl]
            kept = [v for v in per if v <= MAX_NCCL_PER_COMM_GIB]
            outliers += len(per) - len(kept)
            if kept:
                fit["nccl_per_comm_gib"] = round(pick(kept), 4)
        if outliers:
            fit["outliers"] = outliers
        fits[gtype] = fit
    return fits
