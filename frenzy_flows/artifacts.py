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
from trainer.fallback import not_launchable
from frenzy_cli.units import format_duration, format_memory, format_seconds  # noqa: F401 (re-exported)

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


def _is_cpu(gpu_type: str) -> bool:
    try:
        from estimator.catalog import get_gpu
        return bool(get_gpu(gpu_type).is_cpu)
    except Exception:
        return False


def device_used_label(gpu_type: str) -> str:
    """What the third memory figure is on this device: NVML's used memory on a GPU; on the CPU
    the estimate of the training process's resident memory (no nvidia-smi there)."""
    return "process memory (host RAM)" if _is_cpu(gpu_type) else "device used (nvidia-smi)"


def _gpu_memory_gib(gpu_type: str) -> float | None:
    try:  # the catalog is H2's; a custom type unknown to it just has no capacity line
        from estimator.catalog import get_gpu
        return float(get_gpu(gpu_type).memory_gib)
    except Exception:
        return None


# ---------------------------------------------------------------- plan table

def _layout(p: Plan) -> str:
    """The plan's knobs in one short cell: 'dp4 tp2 ZeRO-1 ckpt:full mb 2x4'."""
    par = " ".join(f"{k}{getattr(p, k)}" for k in ("dp", "tp", "pp", "vpp", "cp") if k == "dp" or getattr(p, k) > 1)
    zero = f"ZeRO-{p.zero}" + ("" if p.offload == "none" else f"+off:{p.offload}")
    ckpt = "" if p.act_ckpt == "none" else f" ckpt:{p.act_ckpt}"
    return f"{par} {zero}{ckpt} mb {p.micro_batch}x{p.grad_accum}"


def why_not_chosen(p: Plan, chosen: Plan, *, short: bool = False) -> str:
    """Why a plan ranked above the chosen one was not taken, from the figures alone; ``short``:
    the few words of the plans table's ``choice`` column."""
    bad = not_launchable(p)
    if bad:
        return bad.split(":")[0] if short else bad
    if p.gpu_type == chosen.gpu_type and p.gpus > chosen.gpus and p.step_time_s > 0:
        eff = chosen.step_time_s * chosen.gpus / (p.step_time_s * p.gpus)
        if short:
            return f"{100 * eff:.0f}% efficiency"
        return (f"{chosen.step_time_s / p.step_time_s:.2f}x faster on {p.gpus} GPUs, not {chosen.gpus}: "
                f"{100 * eff:.0f}% parallel efficiency")
    if p.gpu_type != chosen.gpu_type:
        return "other GPU type" if short else f"policy placed the job on {chosen.gpu_type}"
    return "policy's pick" if short else "policy preferred the chosen plan"


def plan_rows(plans_by_type: Mapping[str, list[Plan]], chosen: Plan, *, steps: int) -> list[dict[str, Any]]:
    """One row per candidate plan, GPU types in the given order, the chosen plan marked.

    Six named columns that fit the artifact page at 1400 px: ``choice`` (``CHOSEN_MARK``, or in
    a few words why a plan ranked above the chosen one was not taken), ``GPUs``, ``layout``,
    ``memory / GPU``, ``step``, ``duration``. The rest (why in full, predicted end, pools)
    goes in the artifact's description (``plans_description``).
    """
    rows: list[dict[str, Any]] = []
    seen_chosen = False
    for plans in plans_by_type.values():
        for p in plans:
            is_chosen = not seen_chosen and p.same_knobs(chosen)
            seen_chosen = seen_chosen or is_chosen
            choice = CHOSEN_MARK if is_chosen else ""
            if not is_chosen and p.step_time_s < chosen.step_time_s:
                choice = why_not_chosen(p, chosen, short=True)
            rows.append({
                "choice": choice,
                "GPUs": f"{p.gpus} x {p.gpu_type}",
                "layout": _layout(p),
                "memory / GPU": format_memory(p.device_used_gib),
                "step": format_seconds(p.step_time_s),
                "duration": format_duration(p.step_time_s * steps),
            })
    if not seen_chosen:   # chosen plan not among candidates: still show it
        rows.insert(0, plan_rows({chosen.gpu_type: [chosen]}, chosen, steps=steps)[0])
    return rows


def plans_description(plans_by_type: Mapping[str, list[Plan]], chosen: Plan, *, steps: int,
                      pool_notes: Mapping[str, str] | None = None, now: dt.datetime | None = None) -> str:
    """The plans table's description: the chosen plan and its predicted end, why each faster
    plan was not taken (in full), and what the pools' workers look like."""
    now = now or dt.datetime.now(dt.timezone.utc)
    plans = [p for ps in plans_by_type.values() for p in ps]
    rows = plan_rows(plans_by_type, chosen, steps=steps)
    idx = next(i for i, r in enumerate(rows) if r["choice"] == CHOSEN_MARK)
    done = now + dt.timedelta(seconds=chosen.step_time_s * steps)
    n_types = len(plans_by_type)
    text = (f"{len(plans)} candidate plans over {n_types} GPU type{'s' if n_types != 1 else ''} for {steps} steps, "
            "fastest first. "
            f"Chosen: {chosen.short()} (row {idx + 1}), predicted done by {done:%Y-%m-%d %H:%M} UTC.")
    faster = sorted({why_not_chosen(p, chosen) for p in plans
                     if p.step_time_s < chosen.step_time_s and not p.same_knobs(chosen)})
    if faster:
        text += " Faster plans not taken: " + "; ".join(faster) + "."
    if pool_notes:
        text += " Pools: " + "; ".join(pool_notes.values()) + "."
    return text


def plans_table(plans_by_type: dict[str, list[Plan]], chosen: Plan, *, steps: int,
                pool_notes: Mapping[str, str] | None = None) -> None:
    """Table artifact ``frenzy-plans``: every candidate plan per GPU type, the chosen one marked."""
    from prefect.artifacts import create_table_artifact

    create_table_artifact(table=plan_rows(plans_by_type, chosen, steps=steps), key=PLANS_KEY,
                          description=plans_description(plans_by_type, chosen, steps=steps, pool_notes=pool_notes))


# ---------------------------------------------------------------- memory breakdown

_COMPONENTS = ("weights", "gradients", "optimizer", "activations", "other")


def memory_markdown(estimate: Any, plan: Plan) -> str:
    """Markdown for the per-GPU memory estimate of ``plan``: components, peaks, stages, headroom.
    Figures in the unit that suits them (``format_memory``)."""
    est = _as_dict(estimate)
    breakdown = _as_dict(est.get("breakdown_gib"))
    total = sum(float(breakdown.get(k, 0.0) or 0.0) for k in _COMPONENTS) or 1.0
    per = "process" if _is_cpu(plan.gpu_type) else "GPU"
    lines = [f"# Memory estimate per {per}: {plan.short()}", ""]
    if est.get("params") is not None:
        lines += [f"Parameters: **{int(est['params']):,}**", ""]
    lines += ["| component | memory | share |", "|---|---:|---:|"]
    for k in _COMPONENTS:
        v = float(breakdown.get(k, 0.0) or 0.0)
        lines.append(f"| {k} | {format_memory(v)} | {100 * v / total:.1f}% |")
    lines += ["", "| peak | memory |", "|---|---:|"]
    for label, key in (("allocated (max_memory_allocated)", "allocated_peak_gib"),
                       ("reserved (max_memory_reserved)", "reserved_peak_gib"),
                       (device_used_label(plan.gpu_type), "device_used_gib")):
        if est.get(key) is not None:
            lines.append(f"| {label} | {format_memory(est[key])} |")
    cap = _gpu_memory_gib(plan.gpu_type)
    used = est.get("device_used_gib")
    if cap is not None and used is not None:
        what = (f"The {plan.gpu_type} pool budgets {format_memory(cap)} per training process"
                if _is_cpu(plan.gpu_type) else f"{plan.gpu_type} holds {format_memory(cap)}")
        lines += ["", f"{what}: headroom **{format_memory(cap - float(used))}** ({100 * float(used) / cap:.0f}% used)."]
    stages = est.get("stages") or []
    if len(stages) > 1:
        lines += ["", "| pipeline stage | allocated | reserved | device used |", "|---:|---:|---:|---:|"]
        for i, s in enumerate(stages):
            s = _as_dict(s)
            lines.append(f"| {i} | {format_memory(s.get('allocated_peak_gib', 0))} | "
                         f"{format_memory(s.get('reserved_peak_gib', 0))} | "
                         f"{format_memory(s.get('device_used_gib', 0))} |")
    return "\n".join(lines) + "\n"


def memory_breakdown(estimate: Any, plan: Plan) -> None:
    """Markdown artifact ``frenzy-memory`` with the estimate's breakdown for the chosen plan."""
    from prefect.artifacts import create_markdown_artifact

    per = "per-process" if _is_cpu(plan.gpu_type) else "per-GPU"
    create_markdown_artifact(markdown=memory_markdown(estimate, plan), key=MEMORY_KEY,
                             description=f"predicted {per} memory of the chosen plan, {plan.short()}")


# ---------------------------------------------------------------- progress

@dataclass
class ProgressHandle:
    artifact_id: UUID
    total: int
    last_sent_s: float = 0.0
    last_progress: float = 0.0
    # the API client every update of this run goes through (made at the first update): Prefect's
    # own ``update_progress_artifact`` builds a new client per call, whose TLS context loads the
    # CA bundle each time; measured at a quarter of a running tiny job's orchestrating process
    client: Any = None


def progress_start(total_steps: int) -> ProgressHandle:
    """Progress artifact ``frenzy-progress`` at 0 %; pass the handle to ``progress_update``
    and, once the run is over, to ``progress_end``."""
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
    total = int(total or handle.total)
    progress = min(100.0, 100.0 * step / max(total, 1))
    now = time.monotonic()
    final = step >= total
    if not final and now - handle.last_sent_s < PROGRESS_MIN_INTERVAL_S:
        return False
    from prefect.client.schemas.actions import ArtifactUpdate

    desc = f"training: step {step}/{total}" + (f", loss {loss:.4f}" if loss is not None else "")
    if handle.client is None:
        from prefect import get_client

        handle.client = get_client(sync_client=True).__enter__()
    handle.client.update_artifact(artifact_id=handle.artifact_id,
                                  artifact=ArtifactUpdate(data=progress, description=desc))
    handle.last_sent_s, handle.last_progress = now, progress
    return True


def progress_end(handle: ProgressHandle | None) -> None:
    """Close the handle's API client (the run's last update is out by then)."""
    client = handle.client if handle is not None else None
    if client is not None:
        handle.client = None
        try:
            client.__exit__(None, None, None)
        except Exception:                    # closing never fails a run
            pass


# ---------------------------------------------------------------- predicted vs measured

# (label, predicted key, measured key, formatter): the figures a person compares, in their units
_COMPARED = (("step time", "step_time_s", "step_time_s", format_seconds),
             ("allocated peak", "allocated_peak_gib", "allocated_peak_gib", format_memory),
             ("reserved peak", "reserved_peak_gib", "reserved_peak_gib", format_memory),
             (None, "device_used_gib", "nvml_used_gib", format_memory))   # label per device


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def loss_chart(losses: list[float], eval_losses: list[Mapping[str, Any]] = (), *, first_step: int = 1,
               width: int = 60, height: int = 10) -> str:
    """A text plot of the loss per step (``*`` training, ``o`` eval), for a markdown code block:
    at most ``width`` columns (steps bucketed, each column the bucket's mean) by ``height`` rows."""
    if not losses:
        return ""
    n = len(losses)
    cols = min(width, n)
    per = n / cols
    buckets = [losses[int(i * per): max(int((i + 1) * per), int(i * per) + 1)] for i in range(cols)]
    ys = [sum(b) / len(b) for b in buckets]
    evals = [(int(e["step"]), float(e["loss"])) for e in eval_losses]
    lo = min(ys + [v for _, v in evals])
    hi = max(ys + [v for _, v in evals])
    span = (hi - lo) or 1.0
    grid = [[" "] * cols for _ in range(height)]

    def row_of(v: float) -> int:
        return height - 1 - int(round((v - lo) / span * (height - 1)))

    for x, y in enumerate(ys):
        grid[row_of(y)][x] = "*"
    for step, v in evals:
        x = min(cols - 1, max(0, int((step - first_step) / per)))
        grid[row_of(v)][x] = "o"
    label_w = max(len(f"{hi:.4g}"), len(f"{lo:.4g}"))
    out = []
    for i, line in enumerate(grid):
        label = f"{hi:.4g}" if i == 0 else f"{lo:.4g}" if i == height - 1 else ""
        out.append(f"{label:>{label_w}} |{''.join(line).rstrip()}")
    last = first_step + n - 1
    axis = f"step {first_step}"
    out.append(" " * label_w + " +" + "-" * cols)
    out.append(" " * label_w + f"  {axis}{' ' * max(1, cols - len(axis) - len(str(last)))}{last}")
    return "\n".join(out)


def summary_markdown(plan: Plan, predicted: Mapping[str, Any], measured: Mapping[str, Any],
                     trained: Mapping[str, Any] | None = None) -> str:
    """Markdown a person reads at the end: status, final and eval loss, throughput, checkpoint
    and export paths (from ``trained``, a TrainResult dump), then predicted vs measured step time
    and memory in their units with the relative error, then a text plot of the loss."""
    trained = trained or {}
    cpu = _is_cpu(plan.gpu_type)
    status = trained.get("status") or ("completed" if measured else "not run")
    lines = [f"# Run summary: {status} on {plan.short()}", "", "| | |", "|---|---|"]
    losses = [float(x) for x in trained.get("losses") or []]
    evals = trained.get("eval_losses") or []
    first = int((trained.get("attempts") or [{}])[0].get("resumed_from_step", 0) or 0) + 1
    if losses:
        lines.append(f"| steps | {len(losses)}" + (f" (resumed at step {first})" if first > 1 else "") + " |")
        lines.append(f"| final loss | {losses[-1]:.4f} (first {losses[0]:.4f}) |")
    ev = evals[-1] if evals else None
    lines.append(f"| eval loss | {float(ev['loss']):.4f} at step {int(ev['step'])} |" if ev
                 else "| eval loss | no eval set |")
    tps = _number(measured.get("tokens_per_s"))
    step_s = _number(measured.get("step_time_s"))
    if tps or step_s:
        lines.append(f"| throughput | {tps or 0:,.0f} tokens/s, {format_seconds(step_s)} per step |")
    lines.append(f"| checkpoint | `{trained['checkpoint_dir']}` |" if trained.get("checkpoint_dir")
                 else "| checkpoint | none written |")
    lines.append(f"| export | `{trained['export_dir']}` |" if trained.get("export_dir")
                 else "| export | not exported (the job's export is off) |")
    if trained.get("stop"):
        st = trained["stop"]
        lines.append(f"| stopped | step {st.get('step')}: {st.get('reason')} |")
    if trained.get("error"):
        lines.append(f"| error | {str(trained['error']).splitlines()[0]} |")

    lines += ["", "## Predicted vs measured", "", "| figure | predicted | measured | error |", "|---|---:|---:|---:|"]
    mem_measured = measured.get("memory_measured", True)
    for label, pk, mk, fmt in _COMPARED:
        label = label or device_used_label(plan.gpu_type)
        p, m = _number(predicted.get(pk)), _number(measured.get(mk))
        if pk not in predicted and mk not in measured:
            continue
        is_mem = fmt is format_memory
        if m is None or (is_mem and not mem_measured):
            shown = "not measured (CPU)" if cpu and is_mem else "not measured"
            err = ""
        else:
            shown = fmt(m)
            err = f"{100 * (p - m) / m:+.1f}%" if p is not None and m else ""
        lines.append(f"| {label} | {fmt(p) if p is not None else 'no prediction'} | {shown} | {err} |")
    if losses:
        lines += ["", "## Loss", "", "```", loss_chart(losses, evals, first_step=first), "```",
                  "", "`*` training loss (mean per column), `o` eval loss."]
    return "\n".join(lines) + "\n"


def summary(plan: Plan, predicted: dict, measured: dict, trained: Mapping[str, Any] | None = None) -> None:
    """Markdown artifact ``frenzy-summary``: the run's outcome, predicted vs measured, the loss plot."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=summary_markdown(plan, predicted, measured, trained), key=SUMMARY_KEY,
                             description=f"outcome, predicted vs measured and loss of {plan.short()}")


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
