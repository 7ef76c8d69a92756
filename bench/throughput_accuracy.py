"""Throughput model vs measured step times on a real GPU.

Reads the single-GPU training runs H1 measured on an H200 (bench/estimator_measured_h200.json:
30 configurations of GPT-2 / OPT / BERT / Qwen2.5 / Llama-3.2 models, amp / master / fp32,
flash and eager attention, with and without recomputation) and prints, per run, the predicted
step time (estimator.throughput.step_time) next to the measured one, then the median and the
spread of predicted / measured (uncalibrated defaults unless ``--fit``).

    python bench/throughput_accuracy.py [--file bench/estimator_measured_h200.json] [--fit FILE]

``--fit FILE``: first refit the per-GPU factors (``estimator.throughput.fit_factors``) on the runs
of FILE (e.g. the other measured file: a held-out check), then score ``--file`` with them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator.catalog import from_nvml_name, get_gpu  # noqa: E402
from estimator.models import resolve_model  # noqa: E402
from estimator.plan import Plan  # noqa: E402
from estimator.throughput import DEFAULT_FACTORS, Measurement, fit_factors, step_time_breakdown  # noqa: E402

PRECISION = {"amp": "bf16", "master": "bf16", "fp32": "fp32"}


def _plan(gpu, c) -> Plan:
    return Plan(gpu_type=gpu.name, gpus=1, micro_batch=c["micro_batch"], grad_accum=c.get("grad_accum", 1),
                act_ckpt=c["act_ckpt"], attention=c["attention"], precision=PRECISION[c["regime"]],
                optimizer=c["optimizer"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--file", default="bench/estimator_measured_h200.json")
    ap.add_argument("--fit", default=None, help="refit the per-GPU factors on this file's runs first")
    args = ap.parse_args()
    data = json.loads(Path(args.file).read_text())
    hdr = data["header"]
    gpu = get_gpu(from_nvml_name(hdr["device"], hdr.get("total_gib")) or hdr["device"])
    factors = DEFAULT_FACTORS
    if args.fit:
        fit = json.loads(Path(args.fit).read_text())
        factors = fit_factors([Measurement(resolve_model(r["config"]["model"]), _plan(gpu, r["config"]), gpu,
                                           r["config"]["seq_len"], r["step_s"])
                               for r in fit["results"] if r.get("step_s")])
        print(f"factors refit on {args.fit}: util {factors.util}, mem_eff {factors.mem_eff}")
    print(f"device {hdr['device']} -> catalog {gpu.name} (util {gpu.util}); torch {hdr.get('torch')}")
    print(f"{'model':<20}{'regime':<8}{'mb':>4}{'seq':>6} {'attn':<6}{'ckpt':<10}{'measured s':>11}{'predicted s':>12}{'ratio':>7}")
    ratios, by_kind = [], {}
    for r in data["results"]:
        c, meas = r["config"], r.get("step_s")
        if not meas:
            continue
        pred = step_time_breakdown(resolve_model(c["model"]), _plan(gpu, c), gpu, seq_len=c["seq_len"],
                                   factors=factors).total
        ratio = pred / meas
        ratios.append(ratio)
        by_kind.setdefault("fp32" if c["regime"] == "fp32" else c["attention"], []).append(ratio)
        print(f"{c['model']:<20}{c['regime']:<8}{c['micro_batch']:>4}{c['seq_len']:>6} {c['attention']:<6}"
              f"{c['act_ckpt']:<10}{meas:>11.3f}{pred:>12.3f}{ratio:>7.2f}")
    ratios.sort()
    q = lambda p: ratios[min(len(ratios) - 1, round(p * (len(ratios) - 1)))]  # noqa: E731
    print(f"\npredicted/measured over {len(ratios)} runs: median {statistics.median(ratios):.2f}, "
          f"p10 {q(0.1):.2f}, p90 {q(0.9):.2f}; within +-25%: "
          f"{sum(0.75 <= x <= 1.25 for x in ratios)}/{len(ratios)}")
    for k, v in sorted(by_kind.items()):
        print(f"  {k:<6} n={len(v):<3} median {statistics.median(v):.2f}")
    print(f"reproduce: python bench/throughput_accuracy.py --file {args.file}"
          + (f" --fit {args.fit}" if args.fit else ""))


if __name__ == "__main__":
    main()
