"""What a training's output line looks like in the run's log (the Prefect run log, `frenzy run`).

The training program speaks to the runner in ``FRENZY_<TAG> {json}`` lines (trainer/train.py),
which the runner forwards to its ``log`` as printed (and writes to the attempt's log file).
The flows hand it ``readable_log(logger.info)``, so the run log gets a sentence instead:
``step 40/200: loss 4.1250, 52.1 ms/step``. Step lines are thinned on long runs, since the
``frenzy-progress`` artifact and the loss curve hold every step. Python warnings and the
libraries' notices (torch, transformers, accelerate, DeepSpeed: the same few on every launch)
and progress bars stay in the attempt's file only.
Pure: no torch.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable

# About this many step lines per run: enough to follow a loss in the log; the artifacts have all.
STEP_LINES = 20

# A warning as Python's warnings module prints it ("path.py:12: FutureWarning: ..."); the
# source line it shows under it is indented.
_WARNING = re.compile(r"^\S+\.py:\d+: \w*Warning: ")
# The libraries' own notices, seen on every tiny CPU run: transformers' logger ("[transformers]
# `loss_type=None` ..."), accelerate's per-rank logger ("[RANK 0] Removed shared tensor ...") and
# DeepSpeed's INFO/WARNING lines ("[2026-12-01 21:38:43,579] [WARNING] [real_accelerator.py...");
# DeepSpeed's ERROR lines stay.
_LIBRARY = re.compile(r"^(?:\[transformers\] |\[RANK \d+\] |\[\d{4}-\d\d-\d\d [\d:,.]+\] \[(?:INFO|WARNING)\] )")
# tqdm bars ("Writing model shards: 100%|#####| 1/1 [...]") and the blank lines around them
_PROGRESS_BAR = re.compile(r"\d+%\|.*\|")


def parse_line(line: str) -> tuple[str, dict[str, Any]] | None:
    """``(tag, payload)`` of the training program's ``FRENZY_<TAG> {json}`` line, else None (any
    other line, or one cut short: the process killed while it printed)."""
    tag, _, rest = line.partition(" ")
    if not tag.startswith("FRENZY_"):
        return None
    try:
        payload = json.loads(rest)
    except ValueError:
        return None
    return (tag, payload) if isinstance(payload, dict) else None


def _ms(s: Any) -> str:
    return f"{float(s) * 1000:.1f} ms" if float(s) < 1 else f"{float(s):.2f} s"


def _step(p: dict[str, Any]) -> str | None:
    step, total = int(p["step"]), int(p.get("total") or 0)
    every = max(1, total // STEP_LINES) if total else 1
    if not (step == 1 or step == total or step % every == 0):
        return None
    line = f"step {step}/{total}: loss {float(p['loss']):.4f}" if total else f"step {step}: loss {float(p['loss']):.4f}"
    return line + (f", {_ms(p['step_time_s'])}/step" if p.get("step_time_s") else "")


def _sentence(tag: str, p: dict[str, Any]) -> str | None:
    if tag == "FRENZY_STEP":
        return _step(p)
    if tag == "FRENZY_EVAL":
        return f"eval at step {p['step']}: loss {float(p['loss']):.4f}"
    if tag == "FRENZY_CHECKPOINT":
        return f"checkpoint at step {p['step']}: {p['dir']}"
    if tag == "FRENZY_EXPORT":
        return None                  # the program prints its own "frenzy: export step N -> dir" line
    if tag == "FRENZY_RESUME":
        return f"resumed from step {p['step']} ({p.get('mode', 'checkpoint')}): {p.get('from', '')}"
    if tag == "FRENZY_MODEL":
        trainable = p.get("trainable_params")
        part = f", {trainable:,} trainable" if trainable and trainable != p.get("params") else ""
        return f"model: {int(p['params']):,} parameters{part} ({p.get('finetune', 'full')})"
    if tag == "FRENZY_STOPPED":
        return f"stopped at step {p.get('step', '?')}: {p.get('reason') or p.get('kind') or 'requested'}"
    if tag == "FRENZY_RESULT":
        return None                  # the runner reports the outcome itself
    if tag == "FRENZY_OOM":
        return f"out of memory on rank {p.get('rank', '?')}: {p.get('message', '')}"
    if tag == "FRENZY_ERROR":
        return f"error ({p.get('type', 'error')}): {p.get('message', '')}"
    return None


class RunLog:
    """Output lines -> the run log's lines (``None``: keep it out). Stateful: a warning's source
    line, which follows it, goes with it."""

    def __init__(self) -> None:
        self._in_warning = False

    def __call__(self, line: str) -> str | None:
        if _WARNING.search(line):
            self._in_warning = True
            return None
        if self._in_warning and line[:1].isspace():
            return None
        self._in_warning = False
        if not line.strip() or _LIBRARY.match(line) or _PROGRESS_BAR.search(line):
            return None
        parsed = parse_line(line)
        if parsed is None:
            return line
        try:
            return _sentence(*parsed)
        except (ValueError, KeyError, TypeError):
            return line              # a field missing or malformed: as printed


def readable_log(log: Callable[[str], None]) -> Callable[[str], None]:
    """``log`` behind a ``RunLog``: what the run log of one training gets."""
    run_log = RunLog()

    def forward(line: str) -> None:
        shown = run_log(line)
        if shown is not None:
            log(shown)

    return forward
