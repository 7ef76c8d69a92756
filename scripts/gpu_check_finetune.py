"""LoRA and QLoRA fine-tunes of a ~1B Llama-shaped model on one GPU: measured memory (torch
allocator peaks, NVML) against the estimator's prediction for the same plan.

    PYTHONPATH=. python3 scripts/gpu_check_finetune.py [--steps 20] [--out DIR]

The GPU box reaches no hub: the script saves a model of Llama-3.2-1B's shape with random
weights (bf16, save_pretrained) under --out first, and both fine-tunes start from that folder
(init_from), so loading, adapters, training and export run as they would on real weights.
Needs torch with CUDA, transformers, accelerate, peft (+ bitsandbytes for QLoRA; without it
QLoRA is reported as refused, which is the CPU behaviour too). Tracking is off (no MLflow needed).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

# Llama-3.2-1B's published shape (16 layers, hidden 2048, 32 heads, 8 KV heads, ffn 8192, vocab 128256)
SHAPE = dict(model_type="llama", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, intermediate_size=8192, vocab_size=128256, max_position_embeddings=4096,
             tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5)


def make_model(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").is_file():
        return out
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = AutoModelForCausalLM.from_config(AutoConfig.for_model(**SHAPE), dtype=torch.bfloat16)
    m.save_pretrained(str(out))
    del m
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=Path("out/gpu_finetune"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from estimator.catalog import get_gpu
    from estimator.errors import FrenzyInputError
    from estimator.job import TrainingJob
    from estimator.plan import Plan
    from estimator.plans import estimate_plan
    from scheduler.discover import cluster_or_local
    from trainer.runner import run_training

    t0 = time.time()
    model = make_model(args.out / "llama-1b-shape")
    gpu_type = next(iter(cluster_or_local(None).inventory()))
    rows = []
    for method in ("lora", "qlora"):
        job = TrainingJob(name=f"gpu-{method}", init_from=str(model), seq_len=2048, global_batch=8,
                          train_steps=args.steps, precision="bf16", checkpoint_every=10 ** 6,
                          finetune={"method": method, "rank": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
                          eval={"fraction": 0.01, "max_sequences": 8}, tracking={"enabled": False},
                          data={"kind": "synthetic"})
        plan = Plan(gpu_type=gpu_type, gpus=1, dp=1, micro_batch=4, grad_accum=2, precision="bf16", act_ckpt="full")
        row = {"method": method, "plan": plan.short()}
        try:
            est = estimate_plan(job, plan)
            row["predicted"] = {k: round(getattr(est, k), 3) for k in ("allocated_peak_gib", "reserved_peak_gib", "device_used_gib")}
        except FrenzyInputError as e:
            row["predicted"] = f"estimator refused: {e}"
        try:
            res = run_training(job, plan, run_dir=args.out / f"run-{method}", acquire=lambda p: ["0"],
                               release=lambda: None, log=lambda line: None)
            m = res.measured
            row.update(status=res.status, error=res.error, trainable_params=res.trainable_params, params=res.params,
                       optimizer_impl=res.optimizer_impl, step_time_s=m.step_time_s,
                       measured={"allocated_peak_gib": m.allocated_peak_gib, "reserved_peak_gib": m.reserved_peak_gib,
                                 "nvml_used_gib": m.nvml_used_gib},
                       eval_losses=[e.loss for e in res.eval_losses], export_dir=res.export_dir)
        except FrenzyInputError as e:
            row.update(status="refused", error=str(e))
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"gpu_type": gpu_type, "gpu_memory_gib": get_gpu(gpu_type).memory_gib, "model_shape": SHAPE,
           "steps": args.steps, "rows": rows, "wall_s": round(time.time() - t0, 1)}
    (args.out / "gpu_check_finetune.json").write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
