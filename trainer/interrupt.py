"""Stopping every training this process runs, from a signal handler or a watchdog.

    interrupt.request("SIGTERM")      # the CLI's signal handler
    interrupt.requested()             # -> "SIGTERM" (None before)

``run_training`` registers its run folder for as long as it runs (``active``); a request
writes a stop into each registered folder's control file (``trainer.control``), so the program
stops at its next step boundary with a checkpoint, and a run that starts after the request
stops at once. The runner also reads ``requested()`` to neither retry nor fall back once a stop
was asked for. Nothing here blocks or takes a lock, so a signal handler may call ``request``
even when it interrupts the main thread in the middle of ``active``.

Pure (no torch, no prefect).
"""
from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from . import control

_runs: dict[str, Path] = {}          # run folder (str) -> Path; dict ops are atomic under the GIL
_written: dict[str, str] = {}        # run folder (str) -> id of the stop request written there
_state: dict[str, str | None] = {"reason": None}


def requested() -> str | None:
    """The reason of the stop asked for, or None."""
    return _state["reason"]


def _stop(run_dir: Path, reason: str) -> None:
    key = str(run_dir.resolve())
    if key in _written:
        return
    try:
        _written[key] = control.request_stop(run_dir, f"interrupted: {reason}")
    except OSError:              # a read-only or vanished folder: the launcher's kill still stops it
        pass


def _withdraw(run_dir: Path, key: str) -> None:
    """Remove our stop request when the program never acted on it (killed first), so a later
    launch in the same folder does not stop on it."""
    rid = _written.pop(key, None)
    if rid is None or rid in control.handled(run_dir):
        return
    path = run_dir / control.CONTROL_FILE
    try:
        if json.loads(path.read_text()).get("request_id") == rid:
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def request(reason: str) -> int:
    """Ask every registered training to stop at its next step boundary (first reason wins);
    returns how many were asked."""
    if _state["reason"] is None:
        _state["reason"] = reason
    runs = list(_runs.values())
    for run_dir in runs:
        _stop(run_dir, _state["reason"] or reason)
    return len(runs)


def active_runs() -> list[Path]:
    return list(_runs.values())


@contextlib.contextmanager
def active(run_dir: str | Path) -> Iterator[None]:
    """Register ``run_dir`` for the block; a stop already requested is written at once."""
    path = Path(run_dir)
    key = str(path.resolve())
    _runs[key] = path
    try:
        if _state["reason"] is not None:
            _stop(path, _state["reason"])
        yield
    finally:
        _runs.pop(key, None)
        _withdraw(path, key)


def reset() -> None:
    """Forget a request (a process that runs several jobs, and tests)."""
    _state["reason"] = None
