"""What the trainer's safety nets cost on this machine (CPU, tiny GPT-2, real accelerate launch):
launch overhead (time to the first step), an injected OOM that falls back and resumes, and a
killed rank that is retried and resumes.

    python bench/trainer_recovery.py [--steps 8] [--procs 2]

Prints one table; every figure is wall-clock seconds measured here (nothing hard-coded).
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil  # noqa: E402

from estimator.job import TrainingJob  # noqa: E402
from estimator.plan import Plan  # noqa: E402
from trainer.fallback import reestimate  # noqa: E402
from trainer.runner import run_training  # noqa: E402


def run(label: str, job: TrainingJob, plan: Plan, *, kill_at: int | None = None, inject: int | None = None):
    if inject:
        os.environ["FRENZY_INJECT_OOM_AT_STEP"] = str(inject)
    else:
        os.environ.pop("FRENZY_INJECT_OOM_AT_STEP", None)
    t0 = time.monotonic()
    first: list[float] = []
    killed: list[int] = []

    def on_step(step, total, loss):
        if not first:
            first.append(time.monotonic() - t0)
        if kill_at and step == kill_at and not killed:
            ranks = []
            for p in psutil.Process().children(recursive=True):
                try:
                    if "trainer.train" in " ".join(p.cmdline()):
                        ranks.append(p)
                except psutil.Error:                        # exited (a zombie until reaped)
                    pass
            os.kill(ranks[-1].pid, signal.SIGKILL)
            killed.append(ranks[-1].pid)

    with tempfile.TemporaryDirectory() as d:
        res = run_training(job, plan, run_dir=Path(d) / "run", acquire=lambda p: [f"cpu{i}" for i in range(p.gpus)],
                           release=lambda: None, log=lambda l: None, on_step=on_step, backoff_s=0.5,
                           inventory={"CPU": plan.gpus})
    wall = time.monotonic() - t0
    os.environ.pop("FRENZY_INJECT_OOM_AT_STEP", None)
    return {"run": label, "status": res.status, "attempts": "/".join(a.outcome for a in res.attempts),
            "resumed_from": res.attempts[-1].resumed_from_step, "first_step_s": first[0] if first else None,
            "wall_s": wall, "step_s": res.measured.step_time_s, "final_loss": res.losses[-1] if res.losses else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--procs", type=int, default=2)
    a = ap.parse_args()
    job = TrainingJob(model="gpt2-tiny", seq_len=64, global_batch=8, train_steps=a.steps, lr=3e-3, checkpoint_every=2)

    def plan(n):
        p = Plan(gpu_type="CPU", gpus=n, dp=n, micro_batch=4 // n if n <= 4 else 1, grad_accum=2)
        return reestimate(job, p, safety_margin_gib=0.0) or p

    rows = [run("1 proc, plain", job, plan(1)),
            run("1 proc, OOM injected at step 3", job, plan(1), inject=3),
            run(f"{a.procs} procs, plain", job, plan(a.procs)),
            run(f"{a.procs} procs, rank killed at step 3", job, plan(a.procs), kill_at=3)]
    cols = ["run", "status", "attempts", "resumed_from", "first_step_s", "wall_s", "step_s", "final_loss"]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    table = [cols] + [[fmt(r[c]) for c in cols] for r in rows]
    w = [max(len(row[i]) for row in table) for i in range(len(cols))]
    print(f"tiny GPT-2 on CPU, {a.steps} steps, global batch 8, checkpoint every 2 steps")
    for i, row in enumerate(table):
        print("  ".join(c.ljust(x) for c, x in zip(row, w)))
        if i == 0:
            print("  ".join("-" * x for x in w))
    print(f"\nreproduce: python bench/trainer_recovery.py --steps {a.steps} --procs {a.procs}")


if __name__ == "__main__":
    main()
