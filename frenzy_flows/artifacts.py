"""What a Frenzy run shows in the Prefect UI: the candidate plans, the memory breakdown, training
progress, the predicted-vs-measured summary, the link to the run's MLflow record and its loss
curve, as Prefect artifacts.

Each function has a pure half (``*_rows`` / ``*_markdown``: plain data, unit-testable) and a thin
half that creates the artifact. Artifacts are attached to the current flow/task run when there
is one. Keys are fixed (Prefect keys allow lowercase letters, digits and dashes), so the
Artifacts page keeps one versioned history per kind across runs.
"""
from __future__ import annotations

import datetime as dt
import time
from dataclasses import dataclass
from typing import Any, Mapping
from uuid import UUID

from estimator.plan import Plan

PLANS_KEY = "frenzy-plans"
MEMORY_KEY = "frenzy-memory"
PROGRESS_KEY = "frenzy-progress"
SUMMARY_KEY = "frenzy-summary"
TRACKING_KEY = "frenzy-mlflow"
LOSS_KEY = "frenzy-loss-curve"

# A loss table longer than this is thinned to every k-th step (the first and last kept): the UI
# shows tables unpaged, and MLflow holds every step anyway.
LOSS_TABLE_MAX_ROWS = 200

# The UI needs no more than a few progress updates a second; a tiny model steps far faster.
PROGRESS_MIN_INTERVAL_S = 1.0

CHOSEN_MARK = "<- chosen"


# ---------------------------------------------------------------- helpers

def _as_dict(obj: Any) -> dict[str, Any]:
    """A pydantic model, dataclass-like object or mapping as a plain dict."""
    if obj is None:
        return {}
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "model_dump"):
        return obj.model_dump()
    return {k: getattr(obj, k) for k in dir(obj) if not k.startswith("_") and not callable(getattr(obj, k))}


def _same_plan(a: Plan, b: Plan | None) -> bool:
    # Predictions may be refilled between enumeration and choice: compare the plan's knobs only.
    if b is None:
        return False
    knobs = ("gpu_type", "gpus", "dp", "tp", "pp", "cp", "zero", "offload", "act_ckpt",
             "micro_batch", "grad_accum", "precision", "optimizer", "attention")
    return all(getattr(a, k) == getattr(b, k) for k in knobs)


def format_duration(seconds: float) -> str:
    """'2d 3h', '1h 05m', '4m 10s', '12.3s'."""
    s = float(seconds)
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m:02d}m"
    return f"{m}m {s:02d}s"


def _gpu_memory_gib(gpu_type: str) -> float | None:
    try:  # the catalog is H2's; a custom type unknown to it just has no capacity line
        from estimator.catalog import get_gpu
        return float(get_gpu(gpu_type).memory_gib)
    except Exception:
        return None


# ---------------------------------------------------------------- plan table

def plan_rows(plans_by_type: Mapping[str, list[Plan]], chosen: Plan, *, steps: int,
              pool_notes: Mapping[str, str] | None = None,
              now: dt.datetime | None = None) -> list[dict[str, Any]]:
    """One row per candidate plan, GPU types in the given order, the chosen plan marked.

    ``pool_notes`` (gpu_type -> text, e.g. "cpu: no workers online") fills the ``pool`` column so
    a type whose pool cannot run anything right now says so in the table.
    """
    now = now or dt.datetime.now(dt.timezone.utc)
    rows: list[dict[str, Any]] = []
    for gpu_type, plans in plans_by_type.items():
        note = (pool_notes or {}).get(gpu_type, "")
        for p in plans:
            total_s = p.step_time_s * steps
            done = now + dt.timedelta(seconds=total_s)
            rows.append({
                "chosen": CHOSEN_MARK if _same_plan(p, chosen) else "",
                "gpu_type": p.gpu_type,
                "gpus": p.gpus,
                "dp/tp/pp": f"{p.dp}/{p.tp}/{p.pp}" + (f" cp{p.cp}" if p.cp > 1 else ""),
                "zero": p.zero if p.offload == "none" else f"{p.zero}+off:{p.offload}",
                "act_ckpt": p.act_ckpt,
                "micro_batch": f"{p.micro_batch}x{p.grad_accum}",
                "pred_mem_gib": round(p.device_used_gib, 2),
                "pred_step_s": round(p.step_time_s, 4),
                "pred_total": format_duration(total_s),
                "pred_completion_utc": done.strftime("%Y-%m-%d %H:%M"),
                "pool": note,
            })
    if not any(r["chosen"] for r in rows):   # chosen plan not among candidates: still show it
        rows.insert(0, plan_rows({chosen.gpu_type: [chosen]}, chosen, steps=steps,
                                 pool_notes=pool_notes, now=now)[0])
    return rows


def plans_table(plans_by_type: dict[str, list[Plan]], chosen: Plan, *, steps: int,
                pool_notes: Mapping[str, str] | None = None) -> None:
    """Table artifact ``frenzy-plans``: every candidate plan per GPU type, the chosen one marked."""
    from prefect.artifacts import create_table_artifact

    rows = plan_rows(plans_by_type, chosen, steps=steps, pool_notes=pool_notes)
    n = sum(len(v) for v in plans_by_type.values())
    create_table_artifact(
        table=rows, key=PLANS_KEY,
        description=(f"{n} candidate plans over {len(plans_by_type)} GPU types for {steps} steps; "
                     f"chosen: {chosen.short()}"))


# ---------------------------------------------------------------- memory breakdown

_COMPONENTS = ("weights", "gradients", "optimizer", "activations", "other")


def memory_markdown(estimate: Any, plan: Plan) -> str:
    """Markdown for the per-GPU memory estimate of ``plan``: components, peaks, stages, headroom."""
    est = _as_dict(estimate)
    breakdown = _as_dict(est.get("breakdown_gib"))
    total = sum(float(breakdown.get(k, 0.0) or 0.0) for k in _COMPONENTS) or 1.0
    lines = [f"# Memory estimate per GPU: {plan.short()}", ""]
    if est.get("params") is not None:
        lines += [f"Parameters: **{int(est['params']):,}**", ""]
    lines += ["| component | GiB | share |", "|---|---:|---:|"]
    for k in _COMPONENTS:
        v = float(breakdown.get(k, 0.0) or 0.0)
        lines.append(f"| {k} | {v:.3f} | {100 * v / total:.1f}% |")
    lines += ["", "| peak | GiB |", "|---|---:|"]
    for label, key in (("allocated (max_memory_allocated)", "allocated_peak_gib"),
                       ("reserved (max_memory_reserved)", "reserved_peak_gib"),
                       ("device used (nvidia-smi)", "device_used_gib")):
        if est.get(key) is not None:
            lines.append(f"| {label} | {float(est[key]):.3f} |")
    cap = _gpu_memory_gib(plan.gpu_type)
    used = est.get("device_used_gib")
    if cap is not None and used is not None:
        lines += ["", f"{plan.gpu_type} holds {cap:.1f} GiB: headroom "
                      f"**{cap - float(used):.2f} GiB** ({100 * float(used) / cap:.0f}% used)."]
    stages = est.get("stages") or []
    if len(stages) > 1:
        lines += ["", "| pipeline stage | allocated | reserved | device used |", "|---:|---:|---:|---:|"]
        for i, s in enumerate(stages):
            s = _as_dict(s)
            lines.append(f"| {i} | {float(s.get('allocated_peak_gib', 0)):.3f} | "
                         f"{float(s.get('reserved_peak_gib', 0)):.3f} | {float(s.get('device_used_gib', 0)):.3f} |")
    return "\n".join(lines) + "\n"


def memory_breakdown(estimate: Any, plan: Plan) -> None:
    """Markdown artifact ``frenzy-memory`` with the estimate's breakdown for the chosen plan."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=memory_markdown(estimate, plan), key=MEMORY_KEY,
                             description=f"predicted per-GPU memory of {plan.short()}")


# ---------------------------------------------------------------- progress

@dataclass
class ProgressHandle:
    artifact_id: UUID
    total: int
    last_sent_s: float = 0.0
    last_progress: float = 0.0


def progress_start(total_steps: int) -> ProgressHandle:
    """Progress artifact ``frenzy-progress`` at 0 %; pass the handle to ``progress_update``."""
    from prefect.artifacts import create_progress_artifact

    aid = create_progress_artifact(progress=0.0, key=PROGRESS_KEY,
                                   description=f"training: step 0/{total_steps}")
    return ProgressHandle(artifact_id=aid, total=int(total_steps), last_sent_s=time.monotonic())


def progress_update(handle: ProgressHandle, step: int, total: int | None = None,
                    loss: float | None = None) -> bool:
    """Move the progress bar to ``step/total`` (percent). Updates closer together than
    ``PROGRESS_MIN_INTERVAL_S`` are skipped, except the last step. Returns whether it sent one.

    A synchronous HTTP call: the trainer calls it from its bounded step mailbox
    (``trainer.runner.Mailbox``), never from the thread that drains the ranks' output, so an
    API that is down only drops progress updates."""
    from prefect.artifacts import update_progress_artifact

    total = int(total or handle.total)
    progress = min(100.0, 100.0 * step / max(total, 1))
    now = time.monotonic()
    final = step >= total
    if not final and now - handle.last_sent_s < PROGRESS_MIN_INTERVAL_S:
        return False
    desc = f"training: step {step}/{total}" + (f", loss {loss:.4f}" if loss is not None else "")
    update_progress_artifact(artifact_id=handle.artifact_id, progress=progress, description=desc)
    handle.last_sent_s, handle.last_progress = now, progress
    return True


# ---------------------------------------------------------------- predicted vs measured

def summary_markdown(plan: Plan, predicted: Mapping[str, Any], measured: Mapping[str, Any]) -> str:
    """Markdown table: one row per metric in either dict, with the relative error where both are numbers."""
    keys = list(predicted) + [k for k in measured if k not in predicted]
    lines = [f"# Predicted vs measured: {plan.short()}", "",
             "| metric | predicted | measured | error |", "|---|---:|---:|---:|"]

    def fmt(v: Any) -> str:
        if v is None:
            return "not measured"
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    for k in keys:
        p, m = predicted.get(k), measured.get(k)
        err = ""
        if isinstance(p, (int, float)) and isinstance(m, (int, float)) and not isinstance(p, bool) \
                and not isinstance(m, bool) and m:
            err = f"{100 * (p - m) / m:+.1f}%"
        lines.append(f"| {k} | {fmt(p)} | {fmt(m)} | {err} |")
    return "\n".join(lines) + "\n"


def summary(plan: Plan, predicted: dict, measured: dict) -> None:
    """Markdown artifact ``frenzy-summary``: predicted vs measured at the end of training."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=summary_markdown(plan, predicted, measured), key=SUMMARY_KEY,
                             description=f"predicted vs measured for {plan.short()}")


# ---------------------------------------------------------------- tracking and loss curve

def loss_curve_rows(losses: list[float], eval_losses: list[Mapping[str, Any]], *, first_step: int = 1,
                    max_rows: int = LOSS_TABLE_MAX_ROWS) -> list[dict[str, Any]]:
    """One row per optimizer step (thinned to at most ``max_rows``, eval steps always kept):
    ``step``, training ``loss`` and ``eval_loss`` where the run evaluated."""
    evals = {int(e["step"]): float(e["loss"]) for e in eval_losses}
    steps = {first_step + i: v for i, v in enumerate(losses)}
    every = max(1, -(-len(steps) // max_rows))
    last = max(steps, default=0)
    rows = []
    for step in sorted(set(steps) | set(evals)):
        if step in evals or step == last or (step - first_step) % every == 0:
            rows.append({"step": step, "loss": steps.get(step), "eval_loss": evals.get(step)})
    return rows


def tracking_markdown(trained: Mapping[str, Any]) -> str | None:
    """Markdown naming the MLflow run (link when the store is a server, else the command that
    opens it), the export folder and the last eval loss; None without an MLflow run."""
    run_id = trained.get("mlflow_run_id")
    if not run_id:
        return None
    uri = trained.get("mlflow_tracking_uri") or ""
    url = trained.get("mlflow_url")
    lines = ["# MLflow run", ""]
    if url:
        lines.append(f"[{run_id}]({url}) on {uri}")
    else:
        lines += [f"Run `{run_id}` in experiment {trained.get('mlflow_experiment_id')} of `{uri}`; open it with",
                  "", f"    mlflow ui --backend-store-uri {uri}", ""]
    evals = trained.get("eval_losses") or []
    lines += ["", "| field | value |", "|---|---|",
              f"| status | {trained.get('status')} |",
              f"| parameters (trainable) | {trained.get('params')} ({trained.get('trainable_params')}) |",
              f"| optimizer | {trained.get('optimizer_impl')} |"]
    if evals:
        lines.append(f"| last eval loss | {float(evals[-1]['loss']):.4f} (step {evals[-1]['step']}) |")
    if trained.get("export_dir"):
        lines.append(f"| export | `{trained['export_dir']}` |")
    if trained.get("stop"):
        st = trained["stop"]
        lines.append(f"| stopped | step {st.get('step')}: {st.get('reason')} |")
    return "\n".join(lines) + "\n"


def training_record(trained: Mapping[str, Any]) -> None:
    """Artifacts ``frenzy-mlflow`` (markdown with the MLflow link) and ``frenzy-loss-curve``
    (table: training and eval loss per step) of a finished training (a TrainResult dump)."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    md = tracking_markdown(trained)
    if md is not None:
        create_markdown_artifact(markdown=md, key=TRACKING_KEY, description="the MLflow run of this training")
    losses = list(trained.get("losses") or [])
    if losses:
        first = int((trained.get("attempts") or [{}])[0].get("resumed_from_step", 0)) + 1
        rows = loss_curve_rows(losses, trained.get("eval_losses") or [], first_step=first)
        create_table_artifact(table=rows, key=LOSS_KEY,
                              description=f"loss per step ({len(losses)} steps, {len(rows)} rows shown)")
