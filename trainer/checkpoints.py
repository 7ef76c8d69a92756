"""Checkpoint folders of a run, readable without torch (the runner asks where a retry resumes).

Layout: ``<run_dir>/checkpoints/step-00000042/`` holds what ``accelerator.save_state`` wrote plus
``frenzy_ckpt.json``, written last by rank 0 once every rank has saved: a folder without it is
an interrupted save and is ignored. ``format`` says whether the state is DeepSpeed's (ZeRO
stage, world size) or Accelerate's plain one; the training program uses it to decide between
a full resume and a weights-only one when a fallback changed the plan.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, NamedTuple

MARKER = "frenzy_ckpt.json"
CONSOLIDATED = "consolidated.safetensors"   # full weights of a sharded-model (tensor-parallel) state
_NAME = re.compile(r"^step-(\d{8})$")


class Checkpoint(NamedTuple):
    step: int
    path: Path
    meta: dict[str, Any]


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step-{step:08d}"


def list_checkpoints(run_dir: str | Path) -> list[Checkpoint]:
    """Complete checkpoints, oldest first."""
    root = checkpoint_root(run_dir)
    out = []
    if root.is_dir():
        for d in root.iterdir():
            c = read_checkpoint(d)
            if c is not None:
                out.append(c)
    return sorted(out, key=lambda c: c.step)


def latest_checkpoint(run_dir: str | Path) -> Checkpoint | None:
    cks = list_checkpoints(run_dir)
    return cks[-1] if cks else None


def state_format(*, zero: int, world: int, offload: str, tp: int = 1, cp: int = 1,
                 deepspeed: bool | None = None) -> dict[str, Any]:
    return {"deepspeed": zero > 0 if deepspeed is None else deepspeed, "zero": zero, "world": world,
            "offload": offload, "tp": tp, "cp": cp}


def full_resume_possible(saved: dict[str, Any], now: dict[str, Any]) -> bool:
    """Can ``accelerator.load_state`` restore a state saved under ``saved`` into ``now``?

    Plain Accelerate states hold full (unsharded) model and optimizer tensors, so any world size
    loads them; DeepSpeed's are sharded per ZeRO stage and rank count, so they need the same.
    """
    if saved.get("pp", 1) != now.get("pp", 1):
        return False                 # pipeline stages hold parts of the model: weights only
    if saved.get("pp", 1) > 1:
        # a stage file holds its rank's chunks: another interleaving cuts other layer sets; its
        # optimizer state is ZeroRedundancyOptimizer's (ZeRO-1), the plain optimizer's, or keyed
        # by parameter name (FSDP2, tensor parallel)
        return (saved.get("world") == now.get("world")
                and all(saved.get(k, d) == now.get(k, d) for k, d in (("vpp", 1), ("zero", 0), ("tp", 1))))
    if not saved.get("deepspeed") and not now.get("deepspeed"):
        return True
    return (all(saved.get(k) == now.get(k) for k in ("deepspeed", "zero", "world", "offload"))
            and all(saved.get(k, 1) == now.get(k, 1) for k in ("tp", "cp")))


def prune(run_dir: str | Path, keep: int = 2) -> None:
    """Delete all but the ``keep`` newest complete checkpoints (and interrupted saves older than them)."""
    cks = list_checkpoints(run_dir)
    if len(cks) <= keep:
        return
    newest_kept = cks[-keep].step
    for c in cks[:-keep]:
        shutil.rmtree(c.path, ignore_errors=True)
    root = checkpoint_root(run_dir)
    for d in root.iterdir():
        m = _NAME.match(d.name)
        if m and int(m.group(1)) < newest_kept and not (d / MARKER).exists():
            shutil.rmtree(d, ignore_errors=True)


def read_checkpoint(path: str | Path) -> Checkpoint | None:
    """The complete checkpoint in folder ``path`` (None when it is not one)."""
    d = Path(path)
    m = _NAME.match(d.name)
    if not m or not (d / MARKER).is_file():
        return None
    try:
        meta = json.loads((d / MARKER).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return Checkpoint(int(m.group(1)), d, meta)
