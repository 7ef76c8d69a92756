"""Check the estimator on real GPUs: train a model (GPT-2 medium by default) under three plans
for 30 steps each with Frenzy's own trainer, and print predicted vs measured peaks.

    scripts/gpu_check.sh [--model gpt2-medium] [--steps 30] [--seq-len 1024] [--zero] [--out DIR]
    scripts/gpu_check.sh --set memory [--steps 10] [--out DIR]   # ~1B Llama, 7 plans (below)
    scripts/gpu_check.sh --set heldout [--out DIR]               # Qwen2.5-0.5B, 4 plans
    scripts/gpu_check.sh --set lora [--out DIR]                  # Qwen2.5-1.5B, full vs 5 LoRA plans
    scripts/gpu_check.sh --set lora --predict [--gpu-type H200-141GB]   # no GPU: the predictions only
    scripts/gpu_check.sh --set lora-heldout [--out DIR]          # Llama-3.2-3B, 6 plans predicted first
    scripts/gpu_check.sh --set parallel --gpus 2 [--out DIR]     # ~1B Llama: tp, pp, cp, offload plans
    scripts/gpu_check.sh --rescore docs/data/gpu_check_h200.json   # no GPU: today's estimator vs saved measurements

Predicted: ``estimator.estimate`` for the plan on the catalog GPU type NVML reports.
Measured: each rank's ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` and the
device's NVML used memory, as the training program reports them (``FRENZY_RESULT``).
Needs torch with CUDA, transformers, accelerate, pyyaml, psutil, pydantic; DeepSpeed only for
the ZeRO plans (``--zero``, ``--set memory``); PEFT for the LoRA plan. Runs from a checkout
(PYTHONPATH=.), nothing installed.

``--set memory`` is the device-used check of the estimator (a ~1B Llama, Llama-3.2-1B's shape
from its config, random weights, seq 2048, global batch 8, one GPU, the launcher's
``expandable_segments`` allocator): plain mixed precision, full activation checkpointing,
DeepSpeed ZeRO-2, ZeRO-3, ZeRO-2 with the optimizer offloaded (DeepSpeed's CPU Adam), LoRA and
pure bf16 (no fp32 master weights). The report is written after every plan, so a run cut short
keeps what it measured.

``--set parallel`` measures the plan kinds beyond data parallel (issue 13's check): tensor
parallel (DeepSpeed AutoTP), pipeline parallel (1F1B over torch.distributed.pipelining), sequence
parallel (DeepSpeed Ulysses), each on 2 GPUs, and ZeRO-3 with the optimizer and then the
parameters offloaded to the CPU, on as many GPUs as given: peak memory and step time against the
estimate and the throughput model. On one GPU only the offload plans run; the others are listed
as needing 2.

``--set lora`` checks the throughput model's LoRA terms (frozen base without weight gradients,
the adapters' casts, dropout, scaling and add, adapter-only optimizer) and the memory terms of
LoRA on a model, ranks and targets the earlier sets did not use: the step-time ratio LoRA / full
fine-tuning is the figure (the absolute level carries the GPU's uncalibrated utilisation).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path


def pct(pred: float | None, meas: float | None) -> str:
    if not pred or meas is None:
        return "-"
    return f"{100.0 * (pred - meas) / meas:+.1f}%"


def f2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


# A GPU box is bare (no MLflow there); the check's figures go to its own report.
NO_TRACKING = {"enabled": False}

# The job-level settings a plan set varies beside the plan (rescore rebuilds the same job).
JOB_KNOBS = ("finetune", "master_weights")

KNOBS = {"gpu_type", "gpus", "dp", "tp", "pp", "cp", "zero", "offload", "act_ckpt", "micro_batch", "grad_accum",
         "precision", "optimizer", "attention"}


def plan_of(gpu_type: str, gpus: int, global_batch: int, kw: dict):
    """The plan of a set's row on ``gpus`` GPUs: data parallel over what tp x pp x cp leaves,
    the global batch kept by gradient accumulation."""
    from estimator.plan import Plan

    dp = gpus // _model_parallel(kw)
    return Plan(gpu_type=gpu_type, gpus=gpus, dp=dp, grad_accum=global_batch // dp // kw["micro_batch"], **kw)


def _model_parallel(kw: dict) -> int:
    """The GPUs one data-parallel replica of a row's plan spans (tp x pp x cp)."""
    return kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1)


def runnable_rows(rows: list[tuple[str, dict, dict]], gpus: int, global_batch: int) -> list[tuple[str, dict, dict]]:
    """The rows whose tp x pp x cp divides ``gpus`` and whose data-parallel micro-batches divide
    the global batch; the others are named on stderr."""
    keep = []
    for label, kw, job_kw in rows:
        need = _model_parallel(kw)
        if gpus % need:
            print(f"gpu_check: {label}: needs a multiple of {need} GPUs (--gpus {need}); skipped", file=sys.stderr)
        elif global_batch % (gpus // need * kw["micro_batch"]):
            print(f"gpu_check: {label}: dp {gpus // need} x micro-batch {kw['micro_batch']} does not divide the "
                  f"global batch {global_batch}; skipped", file=sys.stderr)
        else:
            keep.append((label, kw, job_kw))
    return keep


def print_table(report: dict) -> None:
    rows = report["rows"]
    hdr = ("plan", "alloc pred", "alloc meas", "err", "resv pred", "resv meas", "err", "used pred", "nvml meas",
           "err", "step pred s", "step meas s", "tok/s")
    table = [hdr]
    for r in rows:
        p, m = r["predicted"], r["measured"]
        table.append((r["plan"] if r["status"] == "completed" else f"{r['plan']} ({r['status']})",
                      f2(p["allocated_peak_gib"]), f2(m["allocated_peak_gib"]), pct(p["allocated_peak_gib"], m["allocated_peak_gib"]),
                      f2(p["reserved_peak_gib"]), f2(m["reserved_peak_gib"]), pct(p["reserved_peak_gib"], m["reserved_peak_gib"]),
                      f2(p["device_used_gib"]), f2(m["nvml_used_gib"]), pct(p["device_used_gib"], m["nvml_used_gib"]),
                      f"{p['step_time_s']:.3f}", f"{m['step_time_s']:.3f}", f"{m['tokens_per_s']:.0f}"))
    widths = [max(len(str(row[i])) for row in table) for i in range(len(hdr))]
    n = rows[0]["knobs"]["gpus"] if rows and "knobs" in rows[0] else 1
    print(f"\n{report['model']}, seq {report['seq_len']}, global batch {report['global_batch']}, {report['steps']} steps, "
          f"{n} x {report['catalog']} (GiB; err = (pred - meas) / meas)")
    for i, row in enumerate(table):
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


PREDICTED = ("allocated_peak_gib", "reserved_peak_gib", "device_used_gib", "step_time_s")


def predicted_fields(pred) -> dict[str, float]:
    """A report row's predicted figures of the re-estimated plan ``pred``."""
    return {k: getattr(pred, k) for k in PREDICTED}


def predict_anyway(job, plan):
    """``plan`` re-estimated for ``job`` (memory and step time) even where it does not fit."""
    from trainer.fallback import reestimate
    return reestimate(job, plan, safety_margin_gib=-10 ** 6)


def rescore(path: str) -> int:
    """Recompute the predictions of a saved report with the estimator as it is now (no GPU)."""
    from estimator.plan import Plan

    report = json.loads(Path(path).read_text())
    for r in report["rows"]:
        job = check_job(report["model"], report["seq_len"], report["global_batch"], report["steps"],
                        **r.get("job", {}))
        plan = Plan(**r["knobs"])
        r["predicted"] = predicted_fields(predict_anyway(job, plan))
    print(f"gpu_check: predictions recomputed now for the measurements in {path}")
    print_table(report)
    return 0


def predict(a, write: bool) -> int:
    """The predictions of a plan set on ``--gpu-type``, no GPU: a table, and the report (measured
    fields empty) under ``--out`` when given."""
    from estimator.catalog import get_gpu

    rows = []
    for label, kw, job_kw in runnable_rows(plan_set(a.set, a.global_batch // a.gpus, zero=a.zero), a.gpus,
                                           a.global_batch):
        job = check_job(a.model, a.seq_len, a.global_batch, a.steps, **job_kw)
        plan = plan_of(a.gpu_type, a.gpus, a.global_batch, kw)
        pred = predict_anyway(job, plan)
        rows.append({"plan": label, "knobs": plan.model_dump(include=KNOBS),
                     "job": job.model_dump(mode="json", include=set(JOB_KNOBS)), "status": "predicted",
                     "predicted": predicted_fields(pred)})
    report = {"catalog": a.gpu_type, "model": a.model, "seq_len": a.seq_len, "global_batch": a.global_batch,
              "steps": a.steps, "set": a.set, "rows": rows}
    print(f"{a.model}, seq {a.seq_len}, global batch {a.global_batch}, {a.gpus} x {a.gpu_type}: predicted (GiB, s)")
    base = rows[0]["predicted"]["step_time_s"]
    cap = get_gpu(a.gpu_type).memory_gib
    for r in rows:
        p = r["predicted"]
        print(f"  {r['plan']:>32}  alloc {p['allocated_peak_gib']:7.2f}  reserved {p['reserved_peak_gib']:7.2f}  "
              f"used {p['device_used_gib']:7.2f}  step {p['step_time_s']:.3f}  (x{p['step_time_s'] / base:.3f} "
              f"of {rows[0]['plan']})" + ("  DOES NOT FIT" if p["device_used_gib"] > cap else ""))
    if write:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "gpu_check_predicted.json").write_text(json.dumps(report, indent=2))
    return 0


def oom_drill(a) -> int:
    """A real CUDA out-of-memory on one GPU, then the fallback ladder until a plan trains."""
    from estimator.catalog import from_nvml_name, get_gpu
    from estimator.job import TrainingJob
    from estimator.plan import Plan
    from scheduler.discover import nvml_gpus
    from trainer.runner import run_training

    found = nvml_gpus()
    gpu_type = from_nvml_name(found[0].name, found[0].memory_gib)
    cap = get_gpu(gpu_type).memory_gib
    mb = 8
    while True:                       # the smallest power-of-two micro-batch predicted to overflow by 15%
        job = TrainingJob(name="oom-drill", model=a.model, seq_len=a.seq_len, global_batch=mb, train_steps=a.steps,
                          lr=1e-4, checkpoint_every=5, precision="bf16",
                          tracking=NO_TRACKING)
        plan = Plan(gpu_type=gpu_type, gpus=1, dp=1, micro_batch=mb, grad_accum=1, act_ckpt="none")
        big = predict_anyway(job, plan)
        if big.device_used_gib > 1.15 * cap or mb >= 4096:
            break
        mb *= 2
    print(f"gpu_check: OOM drill: {a.model} seq {a.seq_len} micro-batch {mb} predicted {big.device_used_gib:.1f} GiB "
          f"on {gpu_type} ({cap:.1f} GiB)", flush=True)
    out = Path(a.out) / "oom_drill"
    shutil.rmtree(out, ignore_errors=True)

    def log(line: str) -> None:
        if line.startswith(("frenzy:", "FRENZY_OOM", "FRENZY_RESUME", "FRENZY_RESULT")) or "OutOfMemoryError" in line:
            print("  " + line[:300], flush=True)

    t0 = time.time()
    res = run_training(job, big, run_dir=out, acquire=lambda p: [str(found[0].index)], release=lambda: None, log=log,
                       inventory={gpu_type: 1}, deadline_s=a.deadline_s * 3, max_transient_retries=0)
    print(f"\nOOM drill: {res.status} in {time.time() - t0:.0f} s")
    for at in res.attempts:
        print(f"  attempt {at.number}: {at.outcome:7s} {at.plan.short():55s} predicted {at.plan.device_used_gib:7.1f} GiB"
              f"  resumed from {at.resumed_from_step}" + (f"  [{(at.error or '')[:90]}]" if at.error else ""))
    m = res.measured
    if m.memory_measured:
        print(f"  final plan measured: allocated {m.allocated_peak_gib:.2f} reserved {m.reserved_peak_gib:.2f} "
              f"NVML {m.nvml_used_gib:.2f} GiB; predicted used {res.final_plan.device_used_gib:.2f} GiB")
    (Path(a.out) / "oom_drill.json").write_text(json.dumps(res.model_dump(mode="json"), indent=2))
    return 0 if res.status == "completed" and res.attempts[0].outcome == "oom" else 1


def check_job(model: str, seq_len: int, global_batch: int, steps: int, **job_kw):
    """The job a plan set trains, and ``--rescore`` rebuilds to predict it again: bf16, one
    checkpoint (at the end), no export, no tracking; ``job_kw``: a row's ``JOB_KNOBS``."""
    from estimator.job import TrainingJob
    return TrainingJob(name="gpu-check", model=model, seq_len=seq_len, global_batch=global_batch,
                       train_steps=steps, lr=1e-4, checkpoint_every=10 ** 6, precision="bf16",
                       export={"enabled": False}, tracking=NO_TRACKING, **job_kw)


def plan_set(name: str, per_rank: int, *, zero: bool = False) -> list[tuple[str, dict, dict]]:
    """(label, plan knobs, job knobs) of each plan a set runs, in the order they run."""
    if name == "memory":
        mb = min(4, per_rank)
        return [("mb4 no-ckpt", dict(micro_batch=mb), {}),
                ("mb4 lora", dict(micro_batch=mb), {"finetune": {"method": "lora"}}),
                ("mb4 zero2", dict(micro_batch=mb, zero=2), {}),
                ("mb4 zero3", dict(micro_batch=mb, zero=3), {}),
                ("mb4 pure-bf16", dict(micro_batch=mb), {"master_weights": "none"}),
                (f"mb{min(8, per_rank)} full-ckpt", dict(micro_batch=min(8, per_rank), act_ckpt="full"), {}),
                ("mb4 zero2 offload-opt", dict(micro_batch=mb, zero=2, offload="optimizer"), {})]
    if name == "heldout":
        # another model, vocabulary, sequence length and LoRA settings than "memory", for the
        # terms that set measured: Accelerate's fp32 logits, adapters' input copies and masks
        mb = min(8, per_rank)
        every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        return [("mb8 no-ckpt", dict(micro_batch=mb), {}),
                ("mb8 lora no-dropout", dict(micro_batch=mb), {"finetune": {"method": "lora", "dropout": 0.0}}),
                ("mb8 lora all-linear", dict(micro_batch=mb),
                 {"finetune": {"method": "lora", "dropout": 0.1, "target_modules": every}}),
                (f"mb{per_rank} full-ckpt", dict(micro_batch=per_rank, act_ckpt="full"), {})]
    if name == "lora":
        # a model, ranks, targets and dropout the "memory" and "heldout" sets did not run; pure
        # bf16 (16-bit adapters, no casts), DeepSpeed ZeRO-2 (its bf16 engine: 16-bit adapters)
        mb = min(4, per_rank)
        every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        mlp = ["gate_proj", "up_proj", "down_proj"]
        return [("mb4 full", dict(micro_batch=mb), {}),
                ("mb4 lora r8 qv", dict(micro_batch=mb), {"finetune": {"method": "lora", "rank": 8}}),
                ("mb4 lora r64 all-linear", dict(micro_batch=mb),
                 {"finetune": {"method": "lora", "rank": 64, "dropout": 0.0, "target_modules": every}}),
                ("mb4 lora mlp pure-bf16", dict(micro_batch=mb),
                 {"master_weights": "none", "finetune": {"method": "lora", "dropout": 0.1, "target_modules": mlp}}),
                (f"mb{per_rank} lora all-linear full-ckpt", dict(micro_batch=per_rank, act_ckpt="full"),
                 {"finetune": {"method": "lora", "rank": 32, "dropout": 0.05, "target_modules": every}}),
                ("mb4 lora qv zero2", dict(micro_batch=mb, zero=2), {"finetune": {"method": "lora"}})]
    if name == "lora-heldout":
        # predicted before it ran, after the "lora" set had fixed the adapters' saved inputs and
        # the LoRA / expandable-segments recomputation fragmentation: another model and settings
        mb, big = min(4, per_rank), per_rank
        every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
        return [("mb4 full", dict(micro_batch=mb), {}),
                (f"mb{big} full-ckpt", dict(micro_batch=big, act_ckpt="full"), {}),
                ("mb4 lora", dict(micro_batch=mb), {"finetune": {"method": "lora"}}),
                ("mb4 lora all-linear no-dropout", dict(micro_batch=mb),
                 {"finetune": {"method": "lora", "dropout": 0.0, "target_modules": every}}),
                ("mb4 lora attn r32 pure-bf16", dict(micro_batch=mb),
                 {"master_weights": "none",
                  "finetune": {"method": "lora", "rank": 32, "dropout": 0.1, "target_modules": attn}}),
                (f"mb{big} lora full-ckpt", dict(micro_batch=big, act_ckpt="full"), {"finetune": {"method": "lora"}})]
    if name == "parallel":
        # one model, every kind: the pipeline's micro-batches come from the accumulation (4 in
        # flight), tensor and sequence parallel replicate the batch over their group
        return [("mb2 tp2", dict(micro_batch=2, tp=2), {}),
                ("mb4 tp2 full-ckpt", dict(micro_batch=4, tp=2, act_ckpt="full"), {}),
                ("mb1 pp2", dict(micro_batch=1, pp=2), {}),
                ("mb2 cp2", dict(micro_batch=2, cp=2), {}),
                ("mb2 zero3 offload-opt", dict(micro_batch=min(2, per_rank), zero=3, offload="optimizer"), {}),
                ("mb2 zero3 offload-opt+params", dict(micro_batch=min(2, per_rank), zero=3,
                                                      offload="optimizer+params"), {})]
    shapes = [("mb4 no-ckpt", dict(micro_batch=min(4, per_rank), act_ckpt="none"), {}),
              ("mb16 no-ckpt", dict(micro_batch=min(16, per_rank), act_ckpt="none"), {}),
              ("mb16 full-ckpt", dict(micro_batch=min(16, per_rank), act_ckpt="full"), {})]
    if zero:
        shapes.append(("mb4 zero2", dict(micro_batch=min(4, per_rank), act_ckpt="none", zero=2), {}))
    return shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=("basic", "memory", "heldout", "lora", "lora-heldout", "parallel"),
                    default="basic",
                    help="basic: three plans (+ ZeRO-2 with --zero); memory: the 7-plan device-used check; "
                         "heldout: 4 plans of another model to check memory's terms on")
    ap.add_argument("--model", help="default gpt2-medium (basic), llama-3.2-1b (memory)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--global-batch", type=int)
    ap.add_argument("--gpus", type=int, default=1, help="GPUs per plan (data parallel)")
    ap.add_argument("--zero", action="store_true", help="add a ZeRO-2 plan (needs deepspeed)")
    ap.add_argument("--out", help="report folder (default gpu_check_out; --predict writes only when given)")
    ap.add_argument("--deadline-s", type=float, default=240.0, help="per plan")
    ap.add_argument("--predict", action="store_true",
                    help="no training: print (and with --out write) the set's predictions, e.g. to commit them first")
    ap.add_argument("--gpu-type", default="H200-141GB", help="the catalog GPU type --predict predicts for")
    ap.add_argument("--rescore", metavar="JSON", help="no training: re-predict a saved gpu_check.json with "
                                                      "the current estimator and print the table")
    ap.add_argument("--oom-drill", action="store_true",
                    help="instead of the three plans: start a plan the estimator says overflows the GPU, "
                         "let it really run out of memory and follow the trainer's fallback ladder")
    a = ap.parse_args(argv)
    defaults = {"basic": ("gpt2-medium", 30, 1024, 16), "memory": ("llama-3.2-1b", 10, 2048, 8),
                "heldout": ("qwen2.5-0.5b", 8, 1024, 16), "lora": ("qwen2.5-1.5b", 8, 2048, 8),
                "lora-heldout": ("llama-3.2-3b", 6, 1024, 16), "parallel": ("llama-3.2-1b", 10, 2048, 8)}[a.set]
    for name, value in zip(("model", "steps", "seq_len", "global_batch"), defaults):
        if getattr(a, name) is None:
            setattr(a, name, value)
    out_given, a.out = a.out is not None, a.out or "gpu_check_out"
    if a.rescore:
        return rescore(a.rescore)
    if a.oom_drill:
        return oom_drill(a)
    if a.predict:
        return predict(a, write=out_given)

    from estimator.catalog import from_nvml_name
    from scheduler.discover import nvml_gpus
    from trainer.fallback import reestimate
    from trainer.runner import run_training

    found = nvml_gpus()
    if len(found) < a.gpus:
        print(f"gpu_check: needs {a.gpus} GPUs, NVML sees {len(found)}", file=sys.stderr)
        return 2
    gpu_type = from_nvml_name(found[0].name, found[0].memory_gib)
    if gpu_type is None:
        print(f"gpu_check: {found[0].name!r} is not in the GPU catalog", file=sys.stderr)
        return 2
    devices = [str(g.index) for g in found[: a.gpus]]
    print(f"gpu_check: {len(found)} x {found[0].name} ({found[0].memory_gib:.1f} GiB) -> catalog {gpu_type}; using {devices}")

    n = a.gpus
    shapes = runnable_rows(plan_set(a.set, a.global_batch // n, zero=a.zero), n, a.global_batch)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    report = {"gpu": found[0].name, "catalog": gpu_type, "model": a.model, "seq_len": a.seq_len,
              "global_batch": a.global_batch, "steps": a.steps, "set": a.set, "rows": rows}
    for label, kw, job_kw in shapes:
        job = check_job(a.model, a.seq_len, a.global_batch, a.steps, **job_kw)
        plan = plan_of(gpu_type, n, a.global_batch, kw)
        pred = reestimate(job, plan, safety_margin_gib=0.0)
        if pred is None:
            print(f"gpu_check: {label}: the estimator says it does not fit; running it anyway")
            pred = plan
        t0 = time.time()

        def log(line: str, label=label) -> None:
            if line.startswith("FRENZY_STEP"):
                step = json.loads(line.split(" ", 1)[1])
                if step["step"] % 10 == 0 or step["step"] == 1:
                    print(f"  [{label}] step {step['step']} loss {step['loss']:.3f} {step['step_time_s']:.3f}s", flush=True)
            elif "Error" in line or line.startswith(("FRENZY_", "frenzy:")):
                print(f"  [{label}] {line}", flush=True)

        run_dir = out / label.replace(" ", "_")
        shutil.rmtree(run_dir, ignore_errors=True)        # a rerun must not resume the last one
        res = run_training(job, pred, run_dir=run_dir, acquire=lambda p: devices,
                           release=lambda: None, log=log, deadline_s=a.deadline_s, max_transient_retries=0,
                           fallbacks=iter(()))
        m = res.measured
        rows.append({"plan": label, "short": pred.short(), "knobs": plan.model_dump(include=KNOBS),
                     "job": job.model_dump(mode="json", include=set(JOB_KNOBS)), "status": res.status, "wall_s": round(time.time() - t0, 1),
                     "predicted": predicted_fields(pred),
                     "measured": m.model_dump(), "first_loss": res.losses[0] if res.losses else None,
                     "last_loss": res.losses[-1] if res.losses else None, "error": res.error})
        print(f"gpu_check: {label}: {res.status} in {time.time() - t0:.0f} s", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))   # a cut-short run keeps its rows
        shutil.rmtree(run_dir, ignore_errors=True)        # a ~1B model's checkpoint is ~15 GB of disk

    print_table(report)
    return 0 if all(r["status"] == "completed" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
