"""Throughput-model speed against the issue's targets:

* predicted step time of one plan < 20 microseconds (varied plans, no cache)
* all plans of one job over 8 GPU types < 5 ms: every throughput-model call the planner makes
  for one job, recomputed uncached (captured from ``estimator.plans``: the parts shared by the
  ZeRO / offload variants of each plan shape, whose floor ranks the candidates, and the step
  times of the variants that may be kept); the planner's own total, cold and warm, is printed
  beside it

    python bench/throughput_speed.py [--reps N]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from estimator import plans as plans_mod  # noqa: E402
from estimator.catalog import GPU_NAMES, get_gpu  # noqa: E402
from estimator.models import resolve_model  # noqa: E402
from estimator.plan import Plan  # noqa: E402
from estimator.throughput import shared_parts, step_time, step_time_with  # noqa: E402

JOB = dict(model="llama-3.1-8b", seq_len=4096, global_batch=256)


def bench_one(reps: int, clock=time.perf_counter) -> float:
    spec = resolve_model("llama-3.1-8b")
    cases = [(Plan(gpu_type=g, gpus=dp * tp, dp=dp, tp=tp, zero=z, micro_batch=mb, grad_accum=ga,
                   act_ckpt=ck, attention=at), get_gpu(g), n)
             for g, dp, tp, z, mb, ga, ck, at, n in [
                 ("H100-80GB", 8, 1, 3, 2, 4, "none", "flash", 1), ("A100-80GB", 4, 2, 1, 1, 8, "full", "flash", 1),
                 ("RTX3090-24GB", 16, 1, 3, 1, 16, "full", "eager", 2), ("L4-24GB", 8, 4, 0, 1, 32, "selective", "flash", 4)]]
    per = []
    for plan, gpu, nodes in cases:
        t = clock()
        for i in range(reps):
            step_time(spec, plan, gpu, seq_len=2048 + (i & 7), nodes=nodes)   # varied seq: no cache
        per.append((clock() - t) / reps * 1e6)
    return statistics.mean(per)


def captured_calls() -> list[tuple]:
    """Every throughput-model call the planner makes for JOB, in order: ("shared", spec, plan
    shape, gpu, seq_len, nodes, factors, adapters) and ("time", shared parts, zero, offload)."""
    calls: list[tuple] = []
    saved = plans_mod.shared_parts, plans_mod.step_time_with

    def shared(spec, shape, gpu, *, seq_len, nodes, factors, adapters=None):
        calls.append(("shared", spec, shape, gpu, seq_len, nodes, factors, adapters))
        return saved[0](spec, shape, gpu, seq_len=seq_len, nodes=nodes, factors=factors, adapters=adapters)

    def timed(sh, zero, offload):
        calls.append(("time", sh, zero, offload))
        return saved[1](sh, zero, offload)
    plans_mod.clear_caches()
    plans_mod.shared_parts, plans_mod.step_time_with = shared, timed
    try:
        plans_mod.plans_for_job(JOB, {g: 64 for g in list(GPU_NAMES)[:8]})
    finally:
        plans_mod.shared_parts, plans_mod.step_time_with = saved
    return calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5000)
    args = ap.parse_args()
    one, one_cpu = bench_one(args.reps), bench_one(args.reps, time.process_time)
    calls = captured_calls()

    def job(clock) -> float:
        times = []
        for _ in range(20):
            t = clock()
            for call in calls:
                if call[0] == "shared":
                    _, spec, shape, gpu, seq_len, nodes, factors, adapters = call
                    shared_parts(spec, shape, gpu, seq_len=seq_len, nodes=nodes, factors=factors,
                                 adapters=adapters)
                else:
                    step_time_with(*call[1:])
            times.append((clock() - t) * 1e3)
        return statistics.median(times)
    job_ms, job_cpu = job(time.perf_counter), job(time.process_time)
    inv = {g: 64 for g in list(GPU_NAMES)[:8]}
    plans_mod.clear_caches()
    t = time.perf_counter()
    plans_mod.plans_for_job(JOB, inv)
    cold = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    plans_mod.plans_for_job(JOB, inv)
    warm = (time.perf_counter() - t) * 1e3
    print(f"one plan's step time: {one_cpu:.1f} us CPU, {one:.1f} us wall (target < 20 us)")
    n_shared = sum(1 for c in calls if c[0] == "shared")
    print(f"all {len(calls) - n_shared} step times (and the {n_shared} plan shapes' shared parts) the planner "
          f"asks for one job ({JOB['model']}) over 8 GPU types: {job_cpu:.2f} ms CPU, {job_ms:.2f} ms wall "
          f"(target < 5 ms)")
    print(f"planner total for that job (memory model included): cold {cold:.1f} ms, warm {warm:.2f} ms")
    print(f"reproduce: PYTHONPATH=$PWD python bench/throughput_speed.py --reps {args.reps}")


if __name__ == "__main__":
    main()
