"""Estimator accuracy, side by side.

1. Against real GPU runs (default when the measurement file exists): our analytic (and, with
   --traced, traced) allocated / reserved / device-used peaks vs the peaks measured on a GPU by
   bench/estimator_gpu_measure.py (file bench/estimator_measured_h200.json), with median,
   90th-percentile and worst under-prediction errors.

       python bench/estimator_accuracy.py                    # vs measured, analytic
       python bench/estimator_accuracy.py --traced           # + traced column (slow: ~1-10 s each)

2. Against other estimators (--tools): on the same configurations, our analytic and traced
   allocated peaks next to DeepSpeed's estimate_zero2/3_model_states_mem_needs (explicit
   parameter counts, 1 GPU) and Accelerate's training-size estimate
   (calculate_maximum_sizes on an empty-weights model + estimate_training_usage), so a reader
   sees what each counts (model states only) and misses (activations, logits, temporaries).

       python bench/estimator_accuracy.py --tools

3. --write-configs FILE writes the GPU configurations (with each model's hf_config) for
   bench/estimator_gpu_measure.py.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from estimator import estimate  # noqa: E402
from estimator.models import resolve_model  # noqa: E402

MEASURED = os.path.join(os.path.dirname(__file__), "estimator_measured_h200.json")

# (model, regime, micro_batch, seq_len, attention, act_ckpt, optimizer, grad_accum)
GPU_CONFIGS = [
    ("gpt2", "amp", 8, 1024, "flash", "none", "adamw", 1),
    ("gpt2", "amp", 8, 1024, "eager", "none", "adamw", 1),
    ("gpt2", "fp32", 4, 1024, "flash", "none", "adamw", 1),
    ("gpt2", "amp", 16, 1024, "flash", "full", "adamw", 1),
    ("gpt2", "master", 8, 1024, "flash", "none", "adamw", 1),
    ("gpt2-medium", "amp", 8, 1024, "flash", "none", "adamw", 1),
    ("gpt2-medium", "master", 8, 1024, "flash", "none", "adamw", 1),
    ("gpt2-medium", "amp", 4, 1024, "eager", "none", "adamw", 1),
    ("gpt2-medium", "amp", 8, 1024, "flash", "none", "sgd", 1),
    ("gpt2-medium", "amp", 8, 1024, "flash", "none", "adafactor", 1),
    ("gpt2-xl", "amp", 4, 1024, "flash", "none", "adamw", 1),
    ("gpt2-xl", "amp", 8, 1024, "flash", "full", "adamw", 1),
    ("gpt2-xl", "master", 4, 1024, "flash", "none", "adamw", 1),
    ("opt-1.3b", "amp", 4, 2048, "flash", "none", "adamw", 1),
    ("opt-1.3b", "amp", 2, 2048, "eager", "none", "adamw", 1),
    ("opt-350m", "amp", 8, 2048, "flash", "none", "adamw", 1),
    ("bert-large-uncased", "amp", 16, 512, "flash", "none", "adamw", 1),
    ("bert-base-uncased", "fp32", 32, 512, "eager", "none", "adamw", 1),
    ("qwen2.5-0.5b", "amp", 4, 2048, "flash", "none", "adamw", 1),
    ("qwen2.5-0.5b", "master", 4, 2048, "flash", "none", "adamw", 1),
    ("qwen2.5-0.5b", "amp", 8, 4096, "flash", "full", "adamw", 1),
    ("qwen2.5-0.5b", "amp", 2, 2048, "flash", "none", "adamw", 2),
    ("qwen2.5-1.5b", "amp", 2, 4096, "flash", "none", "adamw", 1),
    ("qwen2.5-1.5b", "master", 4, 2048, "flash", "none", "adamw", 1),
    ("llama-3.2-1b", "amp", 4, 2048, "flash", "none", "adamw", 1),
    ("llama-3.2-1b", "master", 4, 2048, "flash", "none", "adamw", 1),
    ("llama-3.2-1b", "amp", 1, 2048, "eager", "none", "adamw", 1),
    ("llama-3.2-1b", "amp", 8, 4096, "flash", "full", "adamw", 1),
    ("llama-3.2-3b", "master", 2, 2048, "flash", "none", "adamw", 1),
    ("llama-3.2-3b", "amp", 1, 4096, "flash", "full", "adamw", 1),
]

# Held out: measured after the model was tuned on GPU_CONFIGS (other models, shapes, knobs).
HELDOUT_CONFIGS = [
    ("gpt2-large", "amp", 4, 1024, "flash", "none", "adamw", 1),
    ("gpt2-large", "master", 8, 1024, "flash", "full", "adamw", 1),
    ("gpt2-large", "amp", 2, 1024, "eager", "none", "sgd", 2),
    ("opt-2.7b", "amp", 2, 2048, "flash", "none", "adamw", 1),
    ("opt-2.7b", "master", 4, 2048, "flash", "full", "adamw", 1),
    ("opt-125m", "fp32", 8, 2048, "flash", "none", "adamw", 1),
    ("opt-125m", "amp", 4, 2048, "eager", "none", "adafactor", 1),
    ("bert-base-uncased", "amp", 32, 512, "flash", "none", "adamw", 1),
    ("bert-large-uncased", "master", 16, 512, "eager", "none", "adamw", 1),
    ("qwen2.5-3b", "master", 2, 2048, "flash", "none", "adamw", 1),
    ("qwen2.5-3b", "amp", 2, 4096, "flash", "full", "adamw", 1),
    ("qwen2.5-1.5b", "amp", 1, 2048, "eager", "none", "adamw", 1),
    ("qwen2.5-0.5b", "fp32", 2, 2048, "flash", "none", "sgd", 1),
    ("qwen2.5-0.5b", "amp", 1, 8192, "flash", "none", "adafactor", 1),
    ("llama-3.2-1b", "amp", 2, 2048, "flash", "none", "adamw", 4),
    ("llama-3.2-1b", "fp32", 2, 2048, "flash", "none", "adamw", 1),
    ("llama-3.2-1b", "master", 16, 2048, "flash", "full", "adamw", 1),
    ("llama-3.2-3b", "amp", 2, 2048, "flash", "none", "adamw", 1),
    ("llama-3.2-3b", "master", 1, 8192, "flash", "full", "adamw", 1),
    ("gpt2-medium", "fp32", 4, 1024, "eager", "none", "adamw", 1),
    ("gpt2-medium", "master", 16, 1024, "flash", "none", "sgd", 1),
    ("gpt2", "amp", 32, 1024, "flash", "none", "adamw", 1),
    ("gpt2-xl", "amp", 2, 1024, "eager", "none", "adamw", 1),
    ("opt-1.3b", "master", 8, 2048, "flash", "full", "adamw", 1),
]


def knobs_of(model, regime, b, s, attn, ck, opt, ga) -> dict:
    # bench/estimator_gpu_measure.py steps torch's default AdamW/Adam (foreach): its step
    # temporaries were measured, so the estimate names them (Frenzy's trainer runs fused).
    # Its loop runs torch.autocast itself, not Accelerate: the model's own loss path, whose
    # output keeps the 16-bit logits ("standard"; the trainer's Accelerate AMP holds fp32 ones),
    # and torch's default caching allocator (the trainer's launcher sets expandable segments)
    return dict(model=model, seq_len=s, micro_batch=b, grad_accum=ga, attention=attn,
                act_ckpt=ck, optimizer=opt, loss="standard", allocator="default",
                **({"adamw_impl": "foreach"} if opt in ("adam", "adamw") else {}),
                precision="fp32" if regime == "fp32" else "bf16",
                zero=1 if regime == "master" else 0,
                mp_style="master" if regime == "master" else "auto")


def write_configs(path: str, rows=None) -> None:
    out = []
    for row in rows or GPU_CONFIGS:
        model, regime, b, s, attn, ck, opt, ga = row
        out.append(dict(model=model, regime=regime, micro_batch=b, seq_len=s, attention=attn,
                        act_ckpt=ck, optimizer=opt, grad_accum=ga,
                        hf_config=resolve_model(model).hf_config()))
    with open(path, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {len(out)} configurations to {path}")


def _pct(pred: float, meas: float) -> float:
    return (pred - meas) / meas * 100.0


def _summary(name: str, errs: list[float]) -> str:
    if not errs:
        return f"{name}: no data"
    a = sorted(abs(e) for e in errs)
    p90 = a[min(len(a) - 1, int(round(0.9 * (len(a) - 1))))]
    worst_under = min(errs)
    return (f"{name}: n={len(errs)} median |err| {statistics.median(a):.1f}%  p90 {p90:.1f}%  "
            f"worst under-prediction {min(0.0, worst_under):.1f}%  max over {max(errs):.1f}%")


def vs_measured(path: str, traced: bool) -> int:
    data = json.load(open(path))
    hdr = data["header"]
    print(f"measured on {hdr['device']} (torch {hdr['torch']}, transformers {hdr.get('transformers')}), "
          f"CUDA context {hdr['context_gib']:.2f} GiB")
    cols = "model regime mb seq attn ckpt opt ga | meas alloc/resv/used | ours alloc/resv/used | err% alloc resv used"
    print(cols)
    ea, er, eu, et = [], [], [], []
    for r in data["results"]:
        c = r["config"]
        if "error" in r:
            print(f"{c['model']} {c['regime']}: measurement failed: {r['error'][:80]}")
            continue
        kw = knobs_of(c["model"], c["regime"], c["micro_batch"], c["seq_len"], c["attention"],
                      c["act_ckpt"], c["optimizer"], c.get("grad_accum", 1))
        est = estimate(**kw, gpu="H200-141GB")
        a, rs, u = est.allocated_peak_gib, est.reserved_peak_gib, est.device_used_gib
        ea.append(_pct(a, r["allocated_gib"]))
        er.append(_pct(rs, r["reserved_gib"]))
        eu.append(_pct(u, r["device_used_gib"]))
        line = (f"{c['model']:18s} {c['regime']:6s} {c['micro_batch']:3d} {c['seq_len']:5d} "
                f"{c['attention']:5s} {c['act_ckpt']:4s} {c['optimizer']:9s} {c.get('grad_accum', 1)} | "
                f"{r['allocated_gib']:6.2f} {r['reserved_gib']:6.2f} {r['device_used_gib']:6.2f} | "
                f"{a:6.2f} {rs:6.2f} {u:6.2f} | {ea[-1]:+6.1f} {er[-1]:+6.1f} {eu[-1]:+6.1f}")
        if traced:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = estimate(**kw, gpu="H200-141GB", method="traced")
            et.append(_pct(t.allocated_peak_gib, r["allocated_gib"]))
            line += f" | traced alloc {t.allocated_peak_gib:6.2f} ({et[-1]:+.1f}%)"
        print(line)
    print(_summary("analytic allocated", ea))
    print(_summary("analytic reserved", er))
    print(_summary("analytic device used", eu))
    if traced:
        print(_summary("traced allocated", et))
    return 0


TOOL_CONFIGS = [
    ("gpt2", "amp", 8, 1024, "flash", "none", "adamw", 1),
    ("gpt2-xl", "amp", 4, 1024, "flash", "none", "adamw", 1),
    ("opt-1.3b", "amp", 4, 2048, "flash", "none", "adamw", 1),
    ("qwen2.5-0.5b", "master", 4, 2048, "flash", "none", "adamw", 1),
    ("llama-3.2-1b", "amp", 4, 2048, "flash", "none", "adamw", 1),
]


def vs_tools(traced: bool) -> int:
    import torch  # noqa: F401  (DeepSpeed and Accelerate need it)
    from accelerate import init_empty_weights
    from accelerate.commands.estimate import estimate_training_usage
    from accelerate.utils import calculate_maximum_sizes
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs
    import transformers
    from transformers import AutoConfig

    meas = {}
    if os.path.exists(MEASURED):
        for r in json.load(open(MEASURED))["results"]:
            if "error" not in r:
                c = r["config"]
                meas[(c["model"], c["regime"], c["micro_batch"], c["seq_len"], c["attention"],
                      c["act_ckpt"], c["optimizer"], c.get("grad_accum", 1))] = r["allocated_gib"]
    print("GiB per GPU, 1 GPU. DeepSpeed/Accelerate count model states only (no activations, "
          "logits or temporaries).")
    print(f"{'config':44s} {'measured':>8s} {'analytic':>8s} {'traced':>8s} {'DS zero2':>8s} "
          f"{'DS zero3':>8s} {'Accel':>8s}")
    for row in TOOL_CONFIGS:
        model, regime, b, s, attn, ck, opt, ga = row
        spec = resolve_model(model)
        kw = knobs_of(*row)
        an = estimate(**kw).allocated_peak_gib
        tr = float("nan")
        if traced:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tr = estimate(**kw, method="traced").allocated_peak_gib
        P = spec.params
        _, ds2 = estimate_zero2_model_states_mem_needs(total_params=P, num_gpus_per_node=1,
                                                       num_nodes=1, cpu_offload=False)
        _, ds3, _ = estimate_zero3_model_states_mem_needs(
            total_params=P, largest_layer_params=spec.largest_layer_params(), num_gpus_per_node=1,
            num_nodes=1, cpu_offload=False, cpu_offload_params=False, zero_init=True)
        cfg = AutoConfig.for_model(**spec.hf_config())
        cls = (transformers.AutoModelForMaskedLM if spec.arch == "bert"
               else transformers.AutoModelForCausalLM)
        with init_empty_weights():
            m = cls.from_config(cfg)
        total_b, _ = calculate_maximum_sizes(m)
        acc = max(estimate_training_usage(total_b, "float16" if regime != "fp32" else "float32").values())
        name = f"{model} {regime} b{b} s{s} {attn} {ck}"
        me = meas.get(row)
        print(f"{name:44s} {me if me is not None else float('nan'):8.2f} {an:8.2f} {tr:8.2f} "
              f"{ds2 / 2**30:8.2f} {ds3 / 2**30:8.2f} {acc / 2**30:8.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-configs", metavar="FILE")
    ap.add_argument("--heldout", action="store_true",
                    help="with --write-configs: the held-out set; otherwise compare against "
                         "bench/estimator_measured_h200_heldout.json")
    ap.add_argument("--measured", default=MEASURED)
    ap.add_argument("--traced", action="store_true")
    ap.add_argument("--tools", action="store_true")
    a = ap.parse_args(argv)
    if a.write_configs:
        write_configs(a.write_configs, HELDOUT_CONFIGS if a.heldout else GPU_CONFIGS)
        return 0
    if a.heldout and a.measured == MEASURED:
        a.measured = MEASURED.replace(".json", "_heldout.json")
    if a.tools:
        return vs_tools(a.traced)
    if not os.path.exists(a.measured):
        print(f"no measurements at {a.measured}: run bench/estimator_gpu_measure.py on a GPU")
        return 1
    return vs_measured(a.measured, a.traced)


if __name__ == "__main__":
    sys.exit(main())
