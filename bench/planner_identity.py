"""Is the planner's output the same in two checkouts? Every plan of a broad grid of jobs
(every model preset x sequence lengths x global batches, a few precision / optimizer /
attention / fine-tuning variants, every catalog GPU type including CPU, several cluster
shapes, safety margins, host memory and ``--plan`` filters), through ``plans_for_job`` and
``enumerate_plans``, every field of every plan to the last bit (``repr`` of the floats), and
the errors (the closest plan of a job that fits nowhere) word for word.

    python bench/planner_identity.py --against ../other-checkout   # both trees, then compare
    python bench/planner_identity.py --dump FILE                    # this tree's digest only

A planner speed change must print ``identical``: it may ask the throughput model less, never
answer differently. About 5-10 minutes per checkout on 2 shared cores (run it under the heavy
lock); ``--every N`` takes every Nth case for a quick look.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import time

SEQS = (256, 2048, 16384)      # each clipped to the model's positions (gpt2: 1024, bert: 512)
BATCHES = (8, 96, 256)
# (inventory count per GPU type, GPUs per node): one 8-GPU node to 64 GPUs over 8 nodes, and
# narrow nodes (PCIe boxes of 4, pairs) whose pp / tp / cp layouts cross nodes
CLUSTERS = ((64, 8), (16, 4), (6, 2))
FILTERS = ("zero=3", "tp=2", "pp=2", "pp=4,zero=2", "offload=optimizer", "cp=2", "vpp=2",
           "act_ckpt=full,micro_batch=1", "nodes=2", "dp=4,zero=1")
VARIANTS = ({}, {"precision": "fp32", "optimizer": "adafactor"}, {"attention": "eager"},
            {"finetune": {"method": "lora", "rank": 8}}, {"optimizer": "sgd", "master_weights": "none"})


def _plan_line(p) -> str:
    return repr(sorted(p.model_dump().items()))


def _outcome(fn) -> list[str]:
    from estimator.errors import DoesNotFitError, FrenzyInputError
    try:
        out = fn()
    except DoesNotFitError as err:
        return [f"DoesNotFit {err} {err.shortfall_gib!r} "
                + (_plan_line(err.closest) if err.closest is not None else "-")]
    except FrenzyInputError as err:
        return ["FrenzyInputError " + str(err)]
    if isinstance(out, dict):
        return [f"{g}: {_plan_line(p)}" for g, ps in out.items() for p in ps] + [f"types {list(out)}"]
    return [_plan_line(p) for p in out]


def cases():
    """(name, thunk) per case; thunks import from whatever checkout is first on sys.path."""
    from estimator.catalog import CATALOG
    from estimator.models import PRESETS
    from estimator.plan_filter import parse_plan_filter
    from estimator.plans import enumerate_plans, plans_for_job

    types = list(CATALOG)
    for model, spec in PRESETS.items():
        for seq in sorted({min(s, spec.max_positions) for s in SEQS}):
            for gb in BATCHES:
                for vi, var in enumerate(VARIANTS):
                    if vi and (seq, gb) != (min(2048, spec.max_positions), 96):      # the variants at one shape
                        continue
                    job = dict(model=model, seq_len=seq, global_batch=gb, **var)
                    for count, gpn in CLUSTERS:
                        inv = {g: count for g in types}
                        yield (f"{model} s={seq} b={gb} v={vi} inv={count}x{gpn}",
                               lambda job=job, inv=inv, gpn=gpn: plans_for_job(job, inv, gpus_per_node=gpn))
                    if vi == 0 and gb == 96:
                        yield (f"{model} s={seq} b={gb} margin=0 host=64",
                               lambda job=job: plans_for_job(job, {g: 32 for g in types}, safety_margin_gib=0.0,
                                                             host_ram_gib={g: 64.0 for g in types}))
                        yield (f"{model} s={seq} b={gb} enumerate A100-40GB margin=3",
                               lambda job=job: enumerate_plans(job, "A100-40GB", max_gpus=24,
                                                               safety_margin_gib=3.0))
                    if vi == 0 and gb == 256 and seq < 16384:
                        for flt in FILTERS:
                            yield (f"{model} s={seq} b={gb} plan={flt}",
                                   lambda job=job, flt=flt: plans_for_job(job, {g: 16 for g in types},
                                                                          plan_filter=parse_plan_filter(flt)))


def dump(path: str, every: int = 1) -> None:
    t0 = time.perf_counter()
    n = 0
    with open(path, "w", encoding="utf-8") as fh:
        for i, (name, thunk) in enumerate(cases()):
            if i % every:
                continue
            t = time.perf_counter()
            lines = _outcome(thunk)
            n += len(lines)
            digest = hashlib.sha256("\n".join(lines).encode()).hexdigest()
            fh.write(f"{name}\t{digest}\t{len(lines)}\t{time.perf_counter() - t:.3f}\n")
    print(f"{path}: {n} lines in {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--against", help="the other checkout's root")
    ap.add_argument("--dump", help="write this tree's digest to FILE")
    ap.add_argument("--every", type=int, default=1, help="every Nth case only (a quick look)")
    ap.add_argument("--root", help=argparse.SUPPRESS)     # the checkout to import (for --against)
    a = ap.parse_args()
    if a.root or not a.against:
        sys.path.insert(0, a.root or os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    if a.dump:
        dump(a.dump, a.every)
        return 0
    if not a.against:
        ap.error("give --against DIR or --dump FILE")
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    outs = []
    for i, root in enumerate((os.path.abspath(a.against), os.path.abspath(here))):
        out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"planner_identity_{os.getpid()}_{i}.tsv")
        env = dict(os.environ, PYTHONPATH=root)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--root", root, "--dump", out,
                        "--every", str(a.every)],
                       env=env, check=True)
        outs.append(out)
    a_lines, b_lines = ([line.rsplit("\t", 1)[0] for line in open(p, encoding="utf-8").read().splitlines()]
                        for p in outs)       # the last column is the case's seconds
    diff = [(x, y) for x, y in zip(a_lines, b_lines) if x != y]
    total = sum(int(x.split("\t")[2]) for x in b_lines)
    if len(a_lines) != len(b_lines) or diff:
        for x, y in diff[:10]:
            print(f"DIFFERS: {x.split(chr(9))[0]}")
        print(f"{len(diff)} of {len(b_lines)} cases differ ({len(a_lines)} vs {len(b_lines)} cases)")
        return 1
    print(f"identical: {len(b_lines)} cases, {total} plans / error lines "
          f"(against {a.against}; digests in {outs[0]}, {outs[1]})")
    print(f"reproduce: PYTHONPATH=$PWD python bench/planner_identity.py --against {a.against}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
