"""How often sequence parallel (cp, DeepSpeed Ulysses) is the fastest plan: over the job shapes
of a workload mix (every class x model x seq_len x global_batch of ``bench/mix-sia-like.yaml`` by
default) and every GPU type of the catalog, the fastest launchable plan the planner returns
unasked, and the fastest cp plan against the fastest cp = 1 plan (the cp plans asked for with
``--plan cp=N``, N = 2, 4, 8), so the figure reads the same whether or not the planner enumerates
cp unasked. A cp plan should win only where memory binds the cp = 1 plans: long sequences that
need full recomputation or a smaller micro-batch without cp.

    PYTHONPATH=$PWD python bench/cp_choice.py [--mix bench/mix-sia-like.yaml] [--gpus 16]
        [--seq-lens 8192,32768] [--json]

``--seq-lens`` replaces the mix's sequence lengths (the same models and batches, longer sequences).
"""
import argparse
import collections
import json
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from estimator.catalog import CATALOG  # noqa: E402
from estimator.errors import FrenzyInputError  # noqa: E402
from estimator.plans import plans_for_job  # noqa: E402

CPS = (2, 4, 8)          # Ulysses degrees inside an 8-GPU node


def shapes(mix: dict) -> list[dict]:
    """Every (max_gpus, model, seq_len, global_batch) of the mix with room for cp (>= 2 GPUs)."""
    out = []
    for cls in mix["classes"]:
        if int(cls["max_gpus"]) < 2:
            continue
        for model in cls["models"]:
            for seq in mix["seq_len"]:
                for gb in mix["global_batch"]:
                    out.append({"model": model, "seq_len": int(seq), "global_batch": int(gb),
                                "max_gpus": int(cls["max_gpus"]), "train_steps": 1})
    return out


def launchable(job: dict, gpu: str, gpus: int, gpn: int, flt: dict | None = None) -> list:
    try:
        plans = plans_for_job(job, {gpu: gpus}, gpus_per_node=gpn, plan_filter=flt)[gpu]
    except FrenzyInputError:      # DoesNotFitError, or no plan matches the filter
        return []
    return [p for p in plans if p.not_launchable is None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mix", default="bench/mix-sia-like.yaml")
    ap.add_argument("--gpus", type=int, default=16, help="GPUs of each type (default 16)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--seq-lens", default="", help="comma-separated sequence lengths replacing the mix's")
    ap.add_argument("--json", action="store_true", help="last line: the summary as JSON")
    a = ap.parse_args()
    mix = yaml.safe_load(Path(a.mix).read_text(encoding="utf-8"))
    if a.seq_lens:
        mix["seq_len"] = [int(v) for v in a.seq_lens.split(",")]
    types = [g for g, spec in CATALOG.items() if not spec.is_cpu]
    t0 = time.perf_counter()
    pairs = chosen = would_win = 0
    by_seq: dict[int, list[int]] = collections.defaultdict(lambda: [0, 0, 0])   # pairs, chosen, wins
    why = collections.Counter()      # what the best cp = 1 plan gave up, where a cp plan is faster
    examples = []
    for job in shapes(mix):
        for gpu in types:
            best = launchable(job, gpu, a.gpus, a.gpus_per_node)
            if not best:
                continue
            pairs += 1
            row = by_seq[job["seq_len"]]
            row[0] += 1
            if best[0].cp > 1:
                chosen += 1
                row[1] += 1
            flat = [p for p in best if p.cp == 1] or launchable(job, gpu, a.gpus, a.gpus_per_node, {"cp": 1})
            cps = [p for c in CPS for p in launchable(job, gpu, a.gpus, a.gpus_per_node, {"cp": c})[:1]]
            if not cps or not flat:
                continue
            top_cp = min(cps, key=lambda p: p.step_time_s)
            if top_cp.step_time_s < flat[0].step_time_s:
                would_win += 1
                row[2] += 1
                f = flat[0]
                # memory binds the cp = 1 plan: it recomputes the forward, or runs fewer tokens per
                # micro-batch (GEMM rows: micro_batch x seq / cp), or splits the layers over tp / pp
                why[("full recompute" if f.act_ckpt == "full" and top_cp.act_ckpt != "full" else
                     "fewer tokens per micro-batch" if f.micro_batch < top_cp.micro_batch / top_cp.cp else
                     "tp or pp" if f.tp * f.pp > 1 else "neither")] += 1
                if len(examples) < 8:
                    examples.append(f"{job['model']} seq {job['seq_len']} gb {job['global_batch']} on {gpu}: "
                                    f"cp={top_cp.cp} dp={top_cp.dp} mb={top_cp.micro_batch} {top_cp.act_ckpt} "
                                    f"{top_cp.step_time_s:.3f} s vs cp=1 dp={f.dp} tp={f.tp} pp={f.pp} "
                                    f"mb={f.micro_batch} {f.act_ckpt} {f.step_time_s:.3f} s")
    secs = time.perf_counter() - t0
    print(f"command: PYTHONPATH=$PWD python bench/cp_choice.py --mix {a.mix} --gpus {a.gpus}"
          + (f" --seq-lens {a.seq_lens}" if a.seq_lens else ""))
    print(f"{pairs} job shape x GPU type pairs with a launchable plan ({secs:.1f} s)")
    print(f"fastest plan unasked is a cp plan: {chosen}")
    print(f"a cp plan is faster than every cp=1 plan: {would_win}  (cp=1 plan gave up: {dict(why)})")
    for seq in sorted(by_seq):
        p, c, w = by_seq[seq]
        print(f"  seq_len {seq}: {p} pairs, cp chosen {c}, cp faster {w}")
    for e in examples:
        print("  e.g.", e)
    if a.json:
        print(json.dumps({"pairs": pairs, "cp_chosen": chosen, "cp_faster": would_win,
                          "by_seq": {str(s): dict(zip(("pairs", "cp_chosen", "cp_faster"), v))
                                     for s, v in sorted(by_seq.items())}, "why": dict(why)}))


if __name__ == "__main__":
    main()
