"""Throughput model vs published, measured training speeds (tokens/s per GPU) on many GPU types.

Scores every row of a CSV in the schema of the shared public set (``published.csv``: model
dimensions, parallel plan, precision, GPU type, nodes, measured tokens/s per GPU; attention kernel
in ``notes`` as ``attention=flash|eager``). Prints per row the predicted and measured speed and
their ratio (predicted / measured), then the median, p10 and p90 of the ratio, the median per GPU
type, and the same-job pairs of GPU types (rows of one model at one sequence length on two GPU
types) that the model orders like the measurements. A row with an unknown GPU type, a missing or
malformed column or a configuration the model cannot express is listed as not expressible with
its reason, never a crash.

Spellings other sources use are read as what they mean: header names in any case or spacing,
GPU names as NVML or a datasheet writes them ('A100-SXM4-80GB', 'Tesla V100-SXM2-32GB', 'RTX
4090'; a family name with several sizes, 'A100', is refused as ambiguous, and the H100 PCIe part,
slower than the SXM one the catalog holds, as unknown), precisions in any case and llm-foundry's
or Lightning's names ('amp_bf16', 'bf16-mixed', '16-mixed'), ``act_ckpt`` as true / false,
attention kernels by their names ('sdpa', 'fa2', 'flash_attention_2' -> flash; 'math' -> eager),
integers written '64.0', '6.7e9' or '107,000'. Optional columns the schema may grow are read
when present: ``attention`` (else the notes' ``attention=``, else flash), ``tied_embeddings``
(default true), ``vpp`` and ``cp`` (default 1).

    python bench/throughput_public.py [--csv PATH] [--json] [--calibrate-on SOURCES] [--terms]
                                      [--factor NAME=VALUE ...] [--peak]

``--json``: the last line is one JSON object {"rows", "expressible", "median_ratio", "p10_ratio",
"p90_ratio", "per_gpu_median_ratio", "rank_pairs", "rank_pairs_correct"} (plus, with
``--calibrate-on``, the held-out figures before and after calibrating).
A row whose notes carry the source's ``CAUTION`` (a measurement SOURCES.md flags as anomalous) is
scored like every other; the per-GPU medians are printed a second time without those rows (text
only: the JSON keeps the fields above), so a type's figure that rests on such a row shows.
``--terms``: per row, the share of the predicted step time in each part of the model (compute,
memory-bound kernels, communication, optimizer, overheads), to see which term a ratio hangs on.
``--factor NAME=VALUE`` (repeatable): a what-if, every row scored with that named ``Factors``
field set (e.g. ``eager_bytes_per_score=46``) instead of the default; it sizes what a term would
have to be, it does not change the model.
``--peak``: a feasibility bound, every GPU at its datasheet peaks (utilisation 1 of the rated
tensor rate, the full datasheet memory and link bandwidth, no fixed per-step overheads): the
fastest the model's own work counts (FLOPs, bytes, bits) allow. A ratio below 1 then means the
measurement is faster than those counts allow on that GPU's datasheet, i.e. the row's software
moves less work than the model counts for its configuration (or the metric is not what it says).
``--calibrate-on``: comma-separated source prefixes (e.g. ``mosaicml,lambdal``): refit the model's
named per-GPU factors (``estimator.throughput.fit_factors``) on those rows and score the others
(the held-out part) before and after.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.public_csv import ACT_CKPT, ATTENTION, TRUE_FALSE, CsvProblem, integer, named, read_rows  # noqa: E402
from estimator.catalog import CATALOG, from_nvml_name, gpu_names_meant  # noqa: E402
from estimator.errors import FrenzyInputError  # noqa: E402
from estimator.plan import Plan  # noqa: E402
from estimator.throughput import (DEFAULT_FACTORS, Factors, Measurement, fit_factors,  # noqa: E402
                                  step_time_breakdown, tokens_per_s)

_PUBLIC = Path("shared") / "data" / "throughput-public" / "published.csv"
# the shared data folder sits in the checkout or beside it (worktrees: two levels up)
DEFAULT_CSV = next((d / _PUBLIC for d in (ROOT, *ROOT.parents) if (d / _PUBLIC).is_file()), ROOT / _PUBLIC)

INT_COLS = ("params", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len",
            "micro_batch", "grad_accum", "dp", "tp", "pp", "zero", "gpus_per_node", "nodes")
STR_COLS = ("row", "source", "model", "act_ckpt", "precision", "gpu")
FLOAT_COLS = ("measured_tokens_per_s_per_gpu",)
ATTN = re.compile(r"attention\s*=\s*([\w.-]*\w)")          # "attention=flash." ends a sentence
# the precision of the training (AMP or not); GEMM precisions fp8 / tf32 are read apart below
PRECISION_NAMES = {"bf16": "bf16", "amp_bf16": "bf16", "bf16-mixed": "bf16", "bf16_mixed": "bf16",
                   "bfloat16": "bf16", "fp16": "fp16", "amp_fp16": "fp16", "16-mixed": "fp16",
                   "16_mixed": "fp16", "float16": "fp16", "amp": "fp16", "fp32": "fp32", "32": "fp32",
                   "float32": "fp32", "32-true": "fp32", "fp8": "fp8", "tf32": "tf32"}
# a blank cell of these columns (the column itself present) means the plain setting; kv_heads:
# as many as the heads (no grouped-query attention)
BLANK_MEANS = {"kv_heads": "", "grad_accum": "1", "tp": "1", "pp": "1", "zero": "0", "act_ckpt": "none"}
# beyond these a number is a typo, not a model (the largest dense models have ~2e12 params,
# hidden sizes ~3e4, vocabularies ~3e5, context windows ~1e7, clusters ~1e5 GPUs)
MAX_PARAMS, MAX_DIM = 10 ** 14, 1 << 30
SIZE = re.compile(r"\d+\s*GB", re.I)
CAUTION = re.compile(r"\bCAUTION\b")        # the source flags this measurement as anomalous
NO_HEAD = re.compile(r"\bno (LM|language[- ]model) head\b", re.I)


@dataclass
class Row:
    row: str
    source: str
    model: str
    gpu: str
    seq_len: int
    measured: float
    spec: Any = None
    plan: Any = None
    nodes: int = 1
    reason: str = ""          # empty: expressible
    caution: bool = False     # the notes carry the source's CAUTION (kept, reported apart)
    predicted: float = 0.0

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured


def gpu_type(text: str) -> str:
    """The catalog GPU type a row names, however its source spells it (``FrenzyInputError``
    naming ``gpu`` when none, or more than one, is meant)."""
    name = text.strip()
    try:
        meant = gpu_names_meant(name)
    except FrenzyInputError:
        meant = []
    if len(meant) == 1 and meant[0] != "CPU":
        return meant[0]
    if len(meant) > 1:
        raise FrenzyInputError("gpu", f"GPU type {name!r} is ambiguous: one of {', '.join(meant)}")
    if re.search(r"H[12]00.*(PCI|NVL)", name, re.I):
        raise FrenzyInputError("gpu", f"unknown GPU type {name!r}: the catalog's H100-80GB and H200-141GB are "
                                      "the SXM parts (H100: 989 dense bf16 TFLOP/s; the PCIe card 756, NVL 835)")
    if re.search(r"4090\s*D\b", name, re.I):
        raise FrenzyInputError("gpu", f"unknown GPU type {name!r}: the RTX 4090 D has 11% fewer cores than the "
                                      "catalog's RTX4090-24GB")
    mapped = from_nvml_name(name)
    if mapped is not None:
        family = gpu_names_meant(mapped.split("-")[0])
        if len(family) > 1 and not SIZE.search(name):        # 'NVIDIA A100', 'Tesla V100': which size?
            raise FrenzyInputError("gpu", f"GPU type {name!r} is ambiguous: one of {', '.join(family)}")
        return mapped
    raise FrenzyInputError("gpu", f"unknown GPU type {name!r}")


def parse_row(d: dict[str, str]) -> Row:
    """One CSV row -> a Row with a spec and a plan, or with ``reason`` saying why it is not expressible."""
    r = Row(row=str(d.get("row") or "?"), source=str(d.get("source") or ""), model=str(d.get("model") or "?"),
            gpu=str(d.get("gpu") or "?"), seq_len=0, measured=float("nan"),
            caution=bool(CAUTION.search(d.get("notes") or "")))
    try:
        d = {k: (val or "") for k, val in d.items()}
        for c, default in BLANK_MEANS.items():          # a blank the source leaves: the plain setting
            if not d.get(c, "").strip() and c in d:
                d[c] = d.get("heads", "") if c == "kv_heads" else default
        missing = [c for c in INT_COLS + STR_COLS + FLOAT_COLS if (d.get(c) or "").strip() == ""]
        if missing:
            raise FrenzyInputError(missing[0], "missing column or empty value")
        v: dict[str, Any] = {}
        optional = {c: d[c] for c in ("vpp", "cp") if (d.get(c) or "").strip()}
        for c, text in [*((c, d[c]) for c in INT_COLS), *optional.items()]:
            v[c] = integer(c, re.sub(r"^zero[-_ ]*", "", text.strip(), flags=re.I) if c == "zero" else text)
            if v[c] < (0 if c == "zero" else 1):
                raise FrenzyInputError(c, f"must be >= {0 if c == 'zero' else 1}, got {v[c]}")
            if v[c] > (MAX_PARAMS if c == "params" else MAX_DIM):
                raise FrenzyInputError(c, f"{v[c]} is beyond any model or cluster "
                                          f"(at most {MAX_PARAMS if c == 'params' else MAX_DIM})")
        vpp, cp = v.get("vpp", 1), v.get("cp", 1)
        try:
            meas = float(d["measured_tokens_per_s_per_gpu"].strip().replace(",", "").replace("_", ""))
        except ValueError:
            raise FrenzyInputError("measured_tokens_per_s_per_gpu", "must be a number") from None
        if not (math.isfinite(meas) and meas > 0):
            raise FrenzyInputError("measured_tokens_per_s_per_gpu", f"must be a positive number, got {meas}")
        r.seq_len, r.measured = v["seq_len"], meas
        r.gpu = gpu_type(r.gpu)
        gpus = v["dp"] * v["tp"] * v["pp"] * cp
        if gpus != v["gpus_per_node"] * v["nodes"]:
            raise FrenzyInputError("dp", f"dp x tp x pp{' x cp' if cp > 1 else ''} = {gpus} != gpus_per_node x "
                                         f"nodes = {v['gpus_per_node'] * v['nodes']}")
        # layouts no framework runs: the model would price work that cannot be split that way
        if v["pp"] * vpp > v["layers"]:
            raise FrenzyInputError("pp", f"pp x vpp = {v['pp'] * vpp} stages for {v['layers']} layers")
        if v["kv_heads"] > v["heads"] or v["heads"] % v["kv_heads"]:
            raise FrenzyInputError("kv_heads", f"{v['kv_heads']} must divide heads ({v['heads']})")
        if v["heads"] % v["tp"]:
            raise FrenzyInputError("tp", f"tp {v['tp']} must divide heads ({v['heads']})")
        notes = d.get("notes") or ""
        m = ATTN.search(notes)
        attention_text = (d.get("attention") or "").strip() or (m.group(1) if m else "flash")
        attention = named("attention", attention_text, ATTENTION)
        # fp8 / tf32 name the GEMM precision: 16-bit training with FP8 GEMMs, fp32 on TF32 cores
        prec = named("precision", d["precision"], PRECISION_NAMES)
        precision, matmul_precision = {"fp8": ("bf16", "fp8"), "tf32": ("fp32", "tf32")}.get(prec, (prec, "default"))
        act_ckpt = named("act_ckpt", d["act_ckpt"], ACT_CKPT)
        tied = named("tied_embeddings", d.get("tied_embeddings") or "", TRUE_FALSE, blank=True)
        arch = "bert" if r.model.lower().startswith("bert") else "gpt"   # encoder: no causal mask
        lm_head = not NO_HEAD.search(notes)                             # e.g. a SQuAD span head
        # without an LM head the params beyond the embedding are the layers' (throughput.py): a
        # source that counts fewer params than its embedding alone holds is not this model
        if not lm_head and v["params"] <= v["vocab"] * v["hidden"]:
            raise FrenzyInputError("params", f"{v['params']} is no more than the embedding "
                                             f"(vocab x hidden = {v['vocab'] * v['hidden']})")
        r.spec = SimpleNamespace(params=v["params"], layers=v["layers"], hidden=v["hidden"], heads=v["heads"],
                                 kv_heads=v["kv_heads"], ffn=v["ffn"], vocab=v["vocab"], tied_embeddings=tied,
                                 arch=arch, lm_head=lm_head)
        from pydantic import ValidationError
        try:
            r.plan = Plan(gpu_type=r.gpu, gpus=gpus, dp=v["dp"], tp=v["tp"], pp=v["pp"], zero=v["zero"],
                          vpp=vpp, cp=cp,
                          act_ckpt=act_ckpt, micro_batch=v["micro_batch"], grad_accum=v["grad_accum"],
                          precision=precision, matmul_precision=matmul_precision, attention=attention)
        except ValidationError as e:
            err = e.errors()[0]
            raise FrenzyInputError(".".join(map(str, err["loc"])) or "plan", err["msg"]) from None
        r.nodes = v["nodes"]
    except FrenzyInputError as e:
        r.reason = str(e)
    return r


def load(path: Path) -> list[Row]:
    """Every row of the file (``public_csv.read_rows``: a BOM, CRLF, cp1252, header case)."""
    return [parse_row(d) for d in read_rows(path)]


def predict(rows: list[Row], factors: Factors = DEFAULT_FACTORS) -> None:
    for r in rows:
        if r.reason:
            continue
        try:
            r.predicted = tokens_per_s(r.spec, r.plan, CATALOG[r.gpu], seq_len=r.seq_len, nodes=r.nodes,
                                       factors=factors) / r.plan.gpus
        except (FrenzyInputError, ValueError, ArithmeticError) as e:
            r.reason = f"model cannot express it: {e}"
            continue
        if not (math.isfinite(r.predicted) and r.predicted > 0):
            r.reason = f"model cannot express it: predicted {r.predicted} tokens/s"


def _q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p * (len(xs) - 1)))]


def summary(rows: list[Row]) -> dict[str, Any]:
    ok = [r for r in rows if not r.reason]
    ratios = [r.ratio for r in ok]
    by_gpu: dict[str, list[float]] = {}
    by_gpu_plain: dict[str, list[float]] = {}      # without the rows the source flags (CAUTION)
    for r in ok:
        by_gpu.setdefault(r.gpu, []).append(r.ratio)
        if not r.caution:
            by_gpu_plain.setdefault(r.gpu, []).append(r.ratio)
    # a same-job pair: one source's rows of one model at one sequence length (two sources' runs
    # of a model differ in software, which no GPU ordering explains)
    jobs: dict[tuple[str, str, int], list[Row]] = {}
    for r in ok:
        jobs.setdefault((r.source, r.model, r.seq_len), []).append(r)
    pairs = correct = 0
    wrong: list[str] = []
    gaps: list[float] = []      # |log(predicted speed ratio / measured speed ratio)| per pair
    for group in jobs.values():
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                if a.gpu == b.gpu or a.measured == b.measured:
                    continue
                pairs += 1
                gaps.append(abs(math.log((a.predicted / b.predicted) / (a.measured / b.measured))))
                if (a.predicted > b.predicted) == (a.measured > b.measured):
                    correct += 1
                else:
                    wrong.append(f"{a.model} seq {a.seq_len}: {a.gpu} vs {b.gpu} (measured "
                                 f"{a.measured / b.measured:.2f}x, predicted {a.predicted / b.predicted:.2f}x)")
    return {"rows": len(rows), "expressible": len(ok),
            "median_ratio": round(statistics.median(ratios), 4) if ratios else None,
            "p10_ratio": round(_q(ratios, 0.1), 4) if ratios else None,
            "p90_ratio": round(_q(ratios, 0.9), 4) if ratios else None,
            "per_gpu_median_ratio": {g: round(statistics.median(v), 4) for g, v in sorted(by_gpu.items())},
            "_per_gpu_no_caution": {g: round(statistics.median(v), 4)
                                    for g, v in sorted(by_gpu_plain.items())},
            "_caution_rows": sum(r.caution for r in ok),
            "rank_pairs": pairs, "rank_pairs_correct": correct, "_wrong_pairs": wrong,
            "_gap_median": statistics.median(gaps) if gaps else None, "_gap_max": max(gaps) if gaps else None}


def measurements(rows: list[Row]) -> list[Measurement]:
    return [Measurement(spec=r.spec, plan=r.plan, gpu=CATALOG[r.gpu], seq_len=r.seq_len, nodes=r.nodes,
                        step_s=r.plan.global_batch * r.seq_len / (r.measured * r.plan.gpus))
            for r in rows if not r.reason]


def _shape(p: Plan) -> str:
    return (f"dp{p.dp} tp{p.tp} pp{p.pp}" + (f" vpp{p.vpp}" if p.vpp > 1 else "") + (f" cp{p.cp}" if p.cp > 1 else "")
            + f" z{p.zero} mb{p.micro_batch}x{p.grad_accum}")


def print_rows(rows: list[Row]) -> None:
    wr = max([4] + [len(r.row) for r in rows])
    wm = max([16] + [len(r.model) for r in rows])
    wg = max([14] + [len(r.gpu) for r in rows])
    ws = max([21] + [len(_shape(r.plan)) for r in rows if not r.reason])
    print(f"{'row':>{wr}} {'model':<{wm}} {'gpu':<{wg}} {'seq':>6} {'plan':>{ws}} {'attn':<6}"
          f"{'measured':>10}{'predicted':>11}{'ratio':>7}")
    for r in rows:
        if r.reason:
            print(f"{r.row:>{wr}} {r.model:<{wm}} {r.gpu:<{wg}} not expressible: {r.reason}")
            continue
        p = r.plan
        print(f"{r.row:>{wr}} {r.model:<{wm}} {r.gpu:<{wg}} {r.seq_len:>6} {_shape(p):>{ws}} {p.attention:<6}"
              f"{r.measured:>10.0f}{r.predicted:>11.0f}{r.ratio:>7.2f}")


def print_terms(rows: list[Row], factors: Factors = DEFAULT_FACTORS) -> None:
    """Per row: the share of the predicted step time in each part of ``StepTime``."""
    parts = ("compute", "memory", "bubble", "dp_comm", "tp_comm", "pp_comm", "optimizer", "offload", "overhead")
    print(f"\n{'row':>4} {'gpu':<15}" + "".join(f"{p:>10}" for p in parts) + f"{'step s':>10}")
    for r in rows:
        if r.reason:
            continue
        b = step_time_breakdown(r.spec, r.plan, CATALOG[r.gpu], seq_len=r.seq_len, nodes=r.nodes, factors=factors)
        print(f"{r.row:>4} {r.gpu:<15}" + "".join(f"{getattr(b, p) / b.total:>10.3f}" for p in parts)
              + f"{b.total:>10.3f}")


def print_summary(s: dict[str, Any], title: str) -> None:
    print(f"\n{title}: {s['expressible']}/{s['rows']} rows expressible; predicted/measured median "
          f"{s['median_ratio']}, p10 {s['p10_ratio']}, p90 {s['p90_ratio']}")
    print("  per GPU type: " + ", ".join(f"{g} {v:.2f}" for g, v in s["per_gpu_median_ratio"].items()))
    if s["_caution_rows"]:
        n = s["_caution_rows"]
        print(f"  per GPU type without the {n} row{'s' if n != 1 else ''} the source flags (CAUTION): "
              + ", ".join(f"{g} {v:.2f}" for g, v in s["_per_gpu_no_caution"].items()))
    print(f"  same-job pairs of GPU types ordered right: {s['rank_pairs_correct']}/{s['rank_pairs']}")
    if s["_gap_median"] is not None:
        print(f"  their speed ratio (predicted / measured): median error {math.exp(s['_gap_median']) - 1:+.1%}"
              f", worst {math.exp(s['_gap_max']) - 1:+.1%}")
    for w in s["_wrong_pairs"]:
        print(f"    wrong: {w}")


def what_if(pairs: list[str]) -> Factors:
    """``NAME=VALUE`` pairs -> the default factors with those scalar fields set."""
    scalar = {k for k, v in DEFAULT_FACTORS.__dataclass_fields__.items() if v.type in ("float", float)}
    kw: dict[str, float] = {}
    for p in pairs:
        name, _, value = p.partition("=")
        if name not in scalar:
            raise ValueError(f"{name!r} is not a scalar throughput factor (one of {', '.join(sorted(scalar))})")
        try:
            kw[name] = float(value)
        except ValueError:
            raise ValueError(f"{name}: {value!r} is not a number") from None
    return DEFAULT_FACTORS.with_(**kw) if kw else DEFAULT_FACTORS


def at_peak(factors: Factors) -> Factors:
    """``factors`` with every GPU at its datasheet peaks and no fixed overheads (``--peak``)."""
    every = {g: 1.0 for g in CATALOG}
    return factors.with_(util=every, mem_eff=every, fp32_util=1.0, nvlink_eff=1.0, network_eff=1.0,
                         microbatch_overhead_s=0.0, step_overhead_s=0.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(DEFAULT_CSV), help="CSV in the public file's schema")
    ap.add_argument("--json", action="store_true", help="last line: one JSON object of the summary")
    ap.add_argument("--calibrate-on", default=None,
                    help="comma-separated source prefixes to refit the per-GPU factors on; "
                         "the other rows are the held-out part")
    ap.add_argument("--terms", action="store_true", help="per row, the share of each part of the step time")
    ap.add_argument("--factor", action="append", default=[], metavar="NAME=VALUE",
                    help="what-if: score with this named throughput factor set (repeatable)")
    ap.add_argument("--peak", action="store_true",
                    help="feasibility bound: every GPU at its datasheet peaks, no fixed overheads")
    args = ap.parse_args(argv)
    path = Path(args.csv)
    if not path.is_file():
        print(f"--csv: no such file {path}", file=sys.stderr)
        return 2
    try:
        factors = what_if(args.factor)
        if args.peak:
            factors = at_peak(factors)
    except ValueError as e:
        print(f"--factor: {e}", file=sys.stderr)
        return 2
    try:
        rows = load(path)
    except CsvProblem as e:
        print(f"--csv: {e}", file=sys.stderr)
        return 2
    predict(rows, factors)
    print_rows(rows)
    if args.terms:
        print_terms(rows, factors)
    s = summary(rows)
    print_summary(s, "all rows")
    out = {k: v for k, v in s.items() if not k.startswith("_")}
    if args.calibrate_on:
        prefixes = tuple(p.strip().lower() for p in args.calibrate_on.split(",") if p.strip())
        fit_rows = [r for r in rows if r.source.lower().startswith(prefixes)]
        held = [r for r in rows if not r.source.lower().startswith(prefixes)]
        before = summary(held)
        fitted = fit_factors(measurements(fit_rows), factors)
        predict(held, fitted)
        after = summary(held)
        print_summary(before, f"held-out ({len(held)} rows not from {','.join(prefixes)}), default factors")
        print_summary(after, f"held-out, factors refit on {len(fit_rows)} rows")
        print("  fitted per-GPU utilisation: " + ", ".join(f"{g} {u:.3f}" for g, u in sorted(fitted.util.items())))
        out["calibration"] = {"fit_on": list(prefixes), "fit_rows": len(fit_rows), "held_out_rows": len(held),
                              "before": {k: v for k, v in before.items() if not k.startswith("_")},
                              "after": {k: v for k, v in after.items() if not k.startswith("_")},
                              "util": {g: round(u, 4) for g, u in sorted(fitted.util.items())}}
    cmd = "python bench/throughput_public.py" + ("" if path == DEFAULT_CSV else f" --csv {shlex.quote(args.csv)}") \
        + (f" --calibrate-on {args.calibrate_on}" if args.calibrate_on else "") + (" --terms" if args.terms else "") \
        + "".join(f" --factor {p}" for p in args.factor) + (" --peak" if args.peak else "") \
        + (" --json" if args.json else "")
    print(f"\nreproduce: PYTHONPATH=$PWD {cmd}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
