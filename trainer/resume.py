"""Resubmission resumes: which checkpoint a new run of a job continues from.

Every run folder records the job it runs (``job.json``, written when the folder is chosen) and,
at the end, how it ended (``result.json``: completed, stopped, failed, timeout). A job
submitted again under the same name continues from the newest complete checkpoint of its
newest run that did not complete and trained the same thing (model, starting weights,
fine-tune method, sequence length, global batch, precision; the data and the step count may
change). ``resume_from`` names the checkpoint explicitly: a checkpoint folder, a run folder
or a job id under the runs folder.

    run_dir = prepare_run_dir(job, job_id, runs_root)   # the flows' hook: folder + resume pointer
    ck = resume_checkpoint(job, run_dir)                # the runner: where this run starts

The new run keeps its own folder (its own checkpoints, logs, export); ``resume.json`` in it
points at the checkpoint it continues from. Pure: no torch, no prefect.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from estimator.errors import FrenzyInputError
from estimator.home import frenzy_home
from estimator.job import TrainingJob

from . import checkpoints

JOB_FILE = "job.json"
RESULT_FILE = "result.json"
POINTER_FILE = "resume.json"
# What must be equal for a checkpoint to load into a new run of the job.
SAME_TRAINING = ("model", "init_from", "finetune", "seq_len", "global_batch", "precision", "master_weights",
                 "optimizer", "entry_point")


def default_runs_root() -> Path:
    """The runs folder of this Frenzy home (where the flows put run folders)."""
    return frenzy_home() / "runs"


SHARED_RUNS_ENV = "FRENZY_SHARED_RUNS"


def shared_runs_root() -> Path:
    """Where the flows keep run folders: storage every node sees (an NFS or Lustre mount),
    ``FRENZY_SHARED_RUNS`` on the control machine and on every worker, so a gang's nodes share
    one folder and a run preempted or relaunched on another node resumes from its checkpoint;
    else the runs folder of this Frenzy home, which is shared only when FRENZY_HOME itself is
    (nodes standing in on one machine)."""
    import os

    path = os.environ.get(SHARED_RUNS_ENV)
    return Path(path).expanduser().resolve() if path else default_runs_root()


def fingerprint(job: TrainingJob | dict[str, Any]) -> dict[str, Any]:
    doc = job.model_dump(mode="json") if isinstance(job, TrainingJob) else job
    return {k: doc.get(k) for k in SAME_TRAINING}


def record_job(run_dir: Path, job: TrainingJob) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / JOB_FILE).write_text(json.dumps({"job": job.model_dump(mode="json"), "time": time.time()}))


def record_result(run_dir: Path, status: str, **extra: Any) -> None:
    (run_dir / RESULT_FILE).write_text(json.dumps({"status": status, "time": time.time(), **extra}))


def _status(run_dir: Path) -> str | None:
    try:
        return json.loads((run_dir / RESULT_FILE).read_text()).get("status")
    except (OSError, json.JSONDecodeError, AttributeError):
        return None                         # still running, or its orchestrator died


def _job_doc(run_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((run_dir / JOB_FILE).read_text())["job"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None


def previous_checkpoint(job: TrainingJob, runs_root: Path, exclude: Path | None = None
                        ) -> checkpoints.Checkpoint | None:
    """The newest complete checkpoint among unfinished runs of a job named ``job.name`` that
    trained the same thing (see ``SAME_TRAINING``)."""
    if not runs_root.is_dir():
        return None
    want = fingerprint(job)
    best: tuple[float, checkpoints.Checkpoint] | None = None
    for d in runs_root.iterdir():
        if not d.is_dir() or (exclude is not None and d.resolve() == exclude.resolve()):
            continue
        doc = _job_doc(d)
        if doc is None or doc.get("name") != job.name or _status(d) == "completed":
            continue
        if fingerprint(doc) != want:
            continue
        ck = checkpoints.latest_checkpoint(d)
        if ck is None:
            continue
        written = float(ck.meta.get("time", 0.0))
        if best is None or written > best[0]:
            best = (written, ck)
    return best[1] if best else None


def explicit_checkpoint(resume_from: str, runs_root: Path | None = None) -> checkpoints.Checkpoint:
    """``resume_from`` -> its checkpoint: a checkpoint folder, a run folder (its newest), or a
    job id under ``runs_root``. Raises FrenzyInputError("resume_from", ...)."""
    root = runs_root or default_runs_root()
    for cand in (Path(resume_from).expanduser(), root / resume_from):
        if not cand.is_dir():
            continue
        ck = checkpoints.read_checkpoint(cand) or checkpoints.latest_checkpoint(cand)
        if ck is None:
            raise FrenzyInputError("resume_from", f"{cand} holds no complete checkpoint")
        return ck
    raise FrenzyInputError("resume_from", f"{resume_from!r} is neither a checkpoint or run folder nor a job id "
                                          f"under {root}")


def check_resumable(job: TrainingJob, ck: checkpoints.Checkpoint) -> None:
    """``resume_from``'s checkpoint must hold the weights this job trains: the same model's
    shapes, and full-model weights for a full fine-tune or the same adapters (rank, targets)
    for LoRA / QLoRA. Another run's checkpoint passed the checks and failed inside the
    training (a missing adapter_state file, or a shape mismatch). A checkpoint whose run left
    no job record is left to the load. Batch, length, precision and optimizer may change."""
    from estimator.models import resolve_model

    from estimator.job import FinetuneSpec

    doc = _job_doc(ck.path.parent.parent)              # <run>/checkpoints/step-N
    # only the two fields read here: a record that today's rules would refuse elsewhere (a
    # field since tightened) still says which weights its checkpoint holds
    try:
        was = FinetuneSpec.model_validate(doc.get("finetune") or {}) if isinstance(doc, dict) else None
    except ValueError:
        was = None
    if was is None or not doc.get("model"):
        return
    now = job.finetune
    if (was.method == "full") != (now.method == "full"):
        raise FrenzyInputError("resume_from", f"{ck.path} holds {'full-model' if was.method == 'full' else was.method} "
                                              f"weights; this job trains {'every weight' if now.method == 'full' else now.method + ' adapters'}")
    if now.method != "full" and (was.rank != now.rank or sorted(was.target_modules or []) != sorted(now.target_modules or [])):
        raise FrenzyInputError("resume_from", f"{ck.path} holds adapters of rank {was.rank} on "
                                              f"{', '.join(was.target_modules or ['the default modules'])}; this job's "
                                              f"are rank {now.rank} on {', '.join(now.target_modules or ['the default modules'])}")
    try:
        a, b = resolve_model(doc["model"]), resolve_model(job.model)
    except FrenzyInputError:                   # a model folder since moved: the load checks the shapes
        return
    if a.params != b.params or a.dims() != b.dims():
        raise FrenzyInputError("resume_from", f"{ck.path} is of another model ({a.params:,} parameters; this "
                                              f"job's has {b.params:,})")


def prepare_run_dir(job: TrainingJob, job_id: str, runs_root: Path) -> Path:
    """The run folder of a new run of ``job`` (``runs_root/job_id``), with ``job.json`` and, when
    it continues another run, ``resume.json`` pointing at that run's checkpoint."""
    run_dir = runs_root / job_id
    record_job(run_dir, job)
    ck = (explicit_checkpoint(job.resume_from, runs_root) if job.resume_from
          else previous_checkpoint(job, runs_root, exclude=run_dir))
    if ck is not None:
        (run_dir / POINTER_FILE).write_text(json.dumps({"checkpoint": str(ck.path.resolve()), "step": ck.step}))
    return run_dir


def resume_checkpoint(job: TrainingJob, run_dir: Path) -> checkpoints.Checkpoint | None:
    """Where a launch in ``run_dir`` starts: its own newest checkpoint (a retry, a fallback, a
    re-size), else the one ``resume.json`` points at, else ``job.resume_from``'s; None: step 0."""
    own = checkpoints.latest_checkpoint(run_dir)
    if own is not None:
        return own
    try:
        pointer = json.loads((run_dir / POINTER_FILE).read_text())["checkpoint"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        pointer = None
    if pointer:
        ck = checkpoints.read_checkpoint(pointer)
        if ck is not None:
            return ck
    if job.resume_from:
        return explicit_checkpoint(job.resume_from, run_dir.parent)
    return None
