"""Throughput model vs published, measured training speeds (tokens/s per GPU) on many GPU types.

Scores every row of a CSV in the schema of the shared public set (``published.csv``: model
dimensions, parallel plan, precision, GPU type, nodes, measured tokens/s per GPU; attention kernel
in ``notes`` as ``attention=flash|eager``). Prints per row the predicted and measured speed and
their ratio (predicted / measured), then the median, p10 and p90 of the ratio, the median per GPU
type, and the same-job pairs of GPU types (rows of one model at one sequence length on two GPU
types) that the model orders like the measurements. A row with an unknown GPU type, a missing or
malformed column or a configuration the model cannot express is listed as not expressible with
its reason, never a crash.

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
import csv
import json
import math
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from estimator.catalog import CATALOG  # noqa: E402
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
ATTN = re.compile(r"attention\s*=\s*(\w+)")
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


def parse_row(d: dict[str, str]) -> Row:
    """One CSV row -> a Row with a spec and a plan, or with ``reason`` saying why it is not expressible."""
    r = Row(row=str(d.get("row") or "?"), source=str(d.get("source") or ""), model=str(d.get("model") or "?"),
            gpu=str(d.get("gpu") or "?"), seq_len=0, measured=float("nan"),
            caution=bool(CAUTION.search(d.get("notes") or "")))
    try:
        missing = [c for c in INT_COLS + STR_COLS + FLOAT_COLS if (d.get(c) or "").strip() == ""]
        if missing:
            raise FrenzyInputError(missing[0], "missing column or empty value")
        v: dict[str, Any] = {}
        for c in INT_COLS:
            try:
                v[c] = int(d[c])
            except ValueError:
                raise FrenzyInputError(c, f"must be an integer, got {d[c]!r}") from None
            if v[c] < (0 if c == "zero" else 1):
                raise FrenzyInputError(c, f"must be >= {0 if c == 'zero' else 1}, got {v[c]}")
        try:
            meas = float(d["measured_tokens_per_s_per_gpu"])
        except ValueError:
            raise FrenzyInputError("measured_tokens_per_s_per_gpu", "must be a number") from None
        if not (math.isfinite(meas) and meas > 0):
            raise FrenzyInputError("measured_tokens_per_s_per_gpu", f"must be a positive number, got {meas}")
        r.seq_len, r.measured = v["seq_len"], meas
        if r.gpu not in CATALOG or r.gpu == "CPU":
            raise FrenzyInputError("gpu", f"unknown GPU type {r.gpu!r}")
        gpus = v["dp"] * v["tp"] * v["pp"]
        if gpus != v["gpus_per_node"] * v["nodes"]:
            raise FrenzyInputError("dp", f"dp x tp x pp = {gpus} != gpus_per_node x nodes = "
                                         f"{v['gpus_per_node'] * v['nodes']}")
        m = ATTN.search(d.get("notes") or "")
        attention = m.group(1) if m else "flash"
        # fp8 / tf32 name the GEMM precision: 16-bit training with FP8 GEMMs, fp32 on TF32 cores
        precision, matmul_precision = {"fp8": ("bf16", "fp8"), "tf32": ("fp32", "tf32")}.get(
            d["precision"], (d["precision"], "default"))
        arch = "bert" if r.model.lower().startswith("bert") else "gpt"   # encoder: no causal mask
        lm_head = not NO_HEAD.search(d.get("notes") or "")           # e.g. a SQuAD span head
        r.spec = SimpleNamespace(params=v["params"], layers=v["layers"], hidden=v["hidden"], heads=v["heads"],
                                 kv_heads=v["kv_heads"], ffn=v["ffn"], vocab=v["vocab"], tied_embeddings=True,
                                 arch=arch, lm_head=lm_head)
        from pydantic import ValidationError
        try:
            r.plan = Plan(gpu_type=r.gpu, gpus=gpus, dp=v["dp"], tp=v["tp"], pp=v["pp"], zero=v["zero"],
                          act_ckpt=d["act_ckpt"], micro_batch=v["micro_batch"], grad_accum=v["grad_accum"],
                          precision=precision, matmul_precision=matmul_precision, attention=attention)
        except ValidationError as e:
            err = e.errors()[0]
            raise FrenzyInputError(".".join(map(str, err["loc"])) or "plan", err["msg"]) from None
        r.nodes = v["nodes"]
    except FrenzyInputError as e:
        r.reason = str(e)
    return r


def load(path: Path) -> list[Row]:
    with open(path, newline="") as fh:
        return [parse_row(d) for d in csv.DictReader(fh)]


def predict(rows: list[Row], factors: Factors = DEFAULT_FACTORS) -> None:
    for r in rows:
        if r.reason:
            continue
        try:
            r.predicted = tokens_per_s(r.spec, r.plan, CATALOG[r.gpu], seq_len=r.seq_len, nodes=r.nodes,
                                       factors=factors) / r.plan.gpus
        except (FrenzyInputError, ValueError, ZeroDivisionError) as e:
            r.reason = f"model cannot express it: {e}"


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
    jobs: dict[tuple[str, int], list[Row]] = {}
    for r in ok:
        jobs.setdefault((r.model, r.seq_len), []).append(r)
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


def print_rows(rows: list[Row]) -> None:
    print(f"{'row':>4} {'model':<17}{'gpu':<15}{'seq':>5}{'plan':>22} {'attn':<6}"
          f"{'measured':>10}{'predicted':>11}{'ratio':>7}")
    for r in rows:
        if r.reason:
            print(f"{r.row:>4} {r.model:<17}{r.gpu:<15} not expressible: {r.reason}")
            continue
        p = r.plan
        shape = f"dp{p.dp} tp{p.tp} pp{p.pp} z{p.zero} mb{p.micro_batch}x{p.grad_accum}"
        print(f"{r.row:>4} {r.model:<17}{r.gpu:<15}{r.seq_len:>5}{shape:>22} {p.attention:<6}"
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
    rows = load(path)
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
    cmd = "python bench/throughput_public.py" + ("" if path == DEFAULT_CSV else f" --csv {args.csv}") \
        + (f" --calibrate-on {args.calibrate_on}" if args.calibrate_on else "") + (" --terms" if args.terms else "") \
        + "".join(f" --factor {p}" for p in args.factor) + (" --peak" if args.peak else "") \
        + (" --json" if args.json else "")
    print(f"\nreproduce: PYTHONPATH=$PWD {cmd}")
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
