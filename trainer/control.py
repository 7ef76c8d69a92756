"""The trainer control file: how a runner (the live scheduler, a deadline) asks a running
training to stop or export at the next optimizer step.

    request_stop(run_dir, reason="resize", request_id="r-17")     # the orchestrator side
    request_export(run_dir, request_id="e-3")

The request is ``<run_dir>/control.json``, written atomically (a temporary file renamed over
it), e.g. ``{"action": "stop", "reason": "resize", "request_id": "r-17"}`` (``"export": true``
also exports the model at the stop, as a deadline stop does). Rank 0 of the
training program reads it between optimizer steps and all-reduces the action, so every rank
acts after the same step: ``stop`` saves a checkpoint, prints ``FRENZY_STOPPED {"step": N,
"reason": ..., "request_id": ...}`` and exits 0; ``export`` writes a Hugging Face export of the
model at that step (``FRENZY_EXPORT``) and training goes on. A request is acted on once: the
program records it in ``control-ack.json``, so a relaunch on another plan in the same run
folder does not stop again on the same request.

Pure (no torch): the runner imports it, and the program reads with ``read_request``.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Literal

from estimator.home import write_atomic

CONTROL_FILE = "control.json"
ACK_FILE = "control-ack.json"

Action = Literal["stop", "export"]
# Wire codes of the actions in the all-reduced tensor (0: nothing requested).
ACTION_CODES: dict[str, int] = {"stop": 1, "export": 2}

ControlRequest = dict[str, Any]      # {"action", "reason", "request_id"}


def request(run_dir: str | Path, action: Action, *, reason: str, request_id: str | None = None,
            export: bool = False) -> str:
    """Ask the training in ``run_dir`` to ``action`` after its current optimizer step; returns
    the request id (a fresh one when none is given)."""
    if action not in ACTION_CODES:
        raise ValueError(f"action must be one of {', '.join(ACTION_CODES)} (got {action!r})")
    rid = request_id or uuid.uuid4().hex[:12]
    payload: dict[str, Any] = {"action": action, "reason": reason, "request_id": rid}
    if export and action == "stop":
        payload["export"] = True
    write_atomic(Path(run_dir) / CONTROL_FILE, json.dumps(payload))
    return rid


def request_stop(run_dir: str | Path, reason: str, request_id: str | None = None, *, export: bool = False) -> str:
    """Stop the training in ``run_dir`` at the next step boundary, with a checkpoint (and, with
    ``export``, an evaluation and a Hugging Face export of the model at that step: what a
    deadline stop leaves behind)."""
    return request(run_dir, "stop", reason=reason, request_id=request_id, export=export)


def request_export(run_dir: str | Path, request_id: str | None = None, reason: str = "requested") -> str:
    """Write a Hugging Face export at the next step boundary; training continues."""
    return request(run_dir, "export", reason=reason, request_id=request_id)


def handled(run_dir: str | Path) -> set[str]:
    """Request ids the program already acted on (in any launch of this run folder)."""
    try:
        return set(json.loads((Path(run_dir) / ACK_FILE).read_text()).get("handled", []))
    except (OSError, json.JSONDecodeError, AttributeError):
        return set()


def read_request(run_dir: str | Path) -> ControlRequest | None:
    """The pending request (not yet acted on), or None. A malformed file is ignored: a writer
    that does not use ``request`` must not crash a training."""
    path = Path(run_dir) / CONTROL_FILE
    try:
        req = json.loads(path.read_text())
        written_ns = path.stat().st_mtime_ns
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(req, dict) or req.get("action") not in ACTION_CODES:
        return None
    # a hand-written request without an id is identified by when it was written
    rid = str(req.get("request_id") or f"unnamed-{written_ns}")
    if rid in handled(run_dir):
        return None
    return {"action": req["action"], "reason": str(req.get("reason") or req["action"]), "request_id": rid,
            "export": bool(req.get("export"))}


def acknowledge(run_dir: str | Path, req: ControlRequest, step: int) -> None:
    """Record that ``req`` was acted on at ``step`` (rank 0, before it reports)."""
    path = Path(run_dir) / ACK_FILE
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        doc = {}
    ids = list(doc.get("handled", [])) + [req["request_id"]]
    write_atomic(path, json.dumps({"handled": ids, "last": {**req, "step": step}}))
