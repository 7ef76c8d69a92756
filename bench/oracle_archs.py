"""The analytic estimator against the fake-tensor trace, per model family: every combination of
the oracle grid's sizes, shapes, precision regimes, checkpointing and attention (AdamW) for the
families asked (the names of ``tests/test_estimator_traced.py``'s ``ARCHS``), with the worst and
median error per family. Single-GPU allocated peak, CPU kernel semantics (what the trace runs).

    python bench/oracle_archs.py [--archs gemma,gemma2,gemma3,llama-gqa]

About 0.3 s per trace on 2 cores (48 configurations per family; 24 for the eager-only ones).
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import warnings

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default="gemma,gemma2,gemma3,llama-gqa")
    a = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    import test_estimator_traced as grid

    from estimator.memory import stage_peaks, validate_knobs
    from estimator.overheads import overheads_for
    from estimator.traced import trace_step

    archs = a.archs.split(",")
    unknown = [x for x in archs if x not in grid.ARCHS]
    if unknown:
        ap.error(f"--archs: unknown {', '.join(unknown)} (one of {', '.join(grid.ARCHS)})")
    ov = overheads_for(None, is_cpu=True)
    for arch in archs:
        rows = []
        for size, (b, s), (prec, zero), ck, attn in itertools.product(range(len(grid.SIZES)), grid.SHAPES,
                                                                     grid.REGIMES, grid.CKPTS, grid.ATTNS):
            if arch in grid.EAGER_ONLY and attn == "flash":
                continue
            spec = grid._spec(arch, size)
            k = validate_knobs(spec, seq_len=s, micro_batch=b, precision=prec, zero=zero, optimizer="adamw",
                               act_ckpt=ck, attention=attn)
            traced = trace_step(spec, k)["Total"]
            analytic = max(p.allocated for p in stage_peaks(spec, k, ov, cpu=True))
            rows.append(((analytic - traced) / traced, (size, b, s, prec, zero, ck, attn)))
        worst = max(rows, key=lambda r: abs(r[0]))
        med = statistics.median(abs(r[0]) for r in rows)
        print(f"{arch:16s} {len(rows)} configs  worst {worst[0]:+.2%} at {worst[1]}  median |error| {med:.2%}")
    print(f"reproduce: python bench/oracle_archs.py --archs {a.archs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
