"""Would enumerating interleaved pipelines (vpp=2) unasked change the planner's choice? For job
shapes x GPU types, the fastest plan the planner keeps today against the fastest vpp=2 plan a
``--plan vpp=2`` filter finds (launchable ones, and any kind as the simulator sees them).

    PYTHONPATH=$PWD python bench/vpp_choices.py
"""
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from estimator.errors import DoesNotFitError, FrenzyInputError  # noqa: E402
from estimator.plans import plans_for_job  # noqa: E402

MODELS = ("gpt2", "gpt2-medium", "opt-350m", "qwen2.5-0.5b", "gpt2-large", "llama-3.2-1b", "opt-1.3b",
          "qwen2.5-1.5b", "gpt2-xl", "qwen2.5-3b", "llama-3.1-8b", "llama-2-7b")   # bench/mix-sia-like.yaml + 2 larger
GPUS = ("T4-16GB", "RTX3090-24GB", "A100-40GB", "A100-80GB", "H100-80GB")
SEQS, BATCHES, MAX_GPUS, PER_NODE = (1024, 2048), (32,), 16, 8


def fastest(plans, launchable: bool):
    ok = [p for p in plans if p.not_launchable is None or not launchable]
    return min(ok, key=lambda p: p.step_time_s) if ok else None


def main() -> None:
    t0 = time.time()
    pairs = changed_launchable = changed_any = with_vpp = 0
    examples = []
    for model, gpu, seq, gb in itertools.product(MODELS, GPUS, SEQS, BATCHES):
        job = {"model": model, "seq_len": seq, "global_batch": gb, "train_steps": 1}
        try:
            free = plans_for_job(job, {gpu: MAX_GPUS}, gpus_per_node=PER_NODE)[gpu]
        except (DoesNotFitError, FrenzyInputError):
            continue
        if not free:
            continue
        pairs += 1
        try:
            inter = plans_for_job(job, {gpu: MAX_GPUS}, gpus_per_node=PER_NODE, plan_filter={"vpp": 2})[gpu]
        except (DoesNotFitError, FrenzyInputError):
            continue
        with_vpp += bool(inter)
        for launchable in (True, False):
            a, b = fastest(free, launchable), fastest(inter, launchable)
            if a is not None and b is not None and b.step_time_s < a.step_time_s:
                if launchable:
                    changed_launchable += 1
                    if len(examples) < 3:
                        examples.append(f"{model} seq {seq} on {gpu}: {a.short()} {a.step_time_s:.3f}s -> "
                                        f"{b.short()} {b.step_time_s:.3f}s")
                else:
                    changed_any += 1
    print(json.dumps({"pairs": pairs, "pairs_with_a_vpp2_plan": with_vpp,
                      "fastest_launchable_becomes_vpp2": changed_launchable, "fastest_any_becomes_vpp2": changed_any,
                      "examples": examples, "wall_s": round(time.time() - t0, 1)}, indent=1))


if __name__ == "__main__":
    main()
