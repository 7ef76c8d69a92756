"""The attempt loop: launch, classify, retry or fall back, resume from the checkpoint.

    result = run_training(job, plan, run_dir=..., acquire=..., release=..., log=...)

* ``acquire(plan) -> list[str]`` gives the devices of an allocation for ``plan`` (the flow
  passes a ledger-backed function); ``release()`` frees the last one. Every ``acquire`` is
  paired with exactly one ``release``: before a retry or a fallback acquires again, and when
  this function returns or raises.
* Outcomes: ``ok``; ``oom`` -> the next plan of ``trainer.fallback.fallback_plans`` (same
  global batch), resumed from the newest checkpoint; ``failed`` -> retried on the same plan
  with exponential backoff and jitter when transient (a lost process, a collective timeout),
  at most ``max_transient_retries`` times; ``timeout`` (the run's deadline) -> stop.
* Bad input (missing data, tokenizer not loadable offline, entry point not importable, a plan
  the launcher cannot realise, more processes than devices) raises ``FrenzyInputError``
  before any process starts, with the devices released.

No prefect here: ``log``, ``on_step`` and ``on_attempt`` are the flow's hooks (Prefect logs,
progress artifact, events).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.plan import Plan

from . import checkpoints
from .data import check_data
from .fallback import fallback_plans
from .launch_config import Paths, check_realisable, is_cpu_plan, training_spec, write_launch_files
from .launcher import free_port, launch_env, run_process_group

Outcome = Literal["ok", "oom", "failed", "timeout"]


class Attempt(BaseModel):
    """One launch of the training program."""

    plan: Plan
    outcome: Outcome
    resumed_from_step: int = 0
    error: str | None = None
    number: int = 1
    devices: list[str] = Field(default_factory=list)
    duration_s: float = 0.0


class Measured(BaseModel):
    """What the successful attempt measured. Memory figures are the maximum over ranks (GiB);
    on the CPU they are None and ``memory_measured`` is False."""

    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    allocated_peak_gib: float | None = None
    reserved_peak_gib: float | None = None
    nvml_used_gib: float | None = None
    memory_measured: bool = False
    per_rank: list[dict[str, Any]] = Field(default_factory=list)


class TrainResult(BaseModel):
    status: Literal["completed", "failed", "timeout"]
    losses: list[float]
    attempts: list[Attempt]
    measured: Measured
    checkpoint_dir: str | None
    final_plan: Plan
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "completed"


# ---------------------------------------------------------------------------------- preflight
def preflight(job: TrainingJob, plan: Plan) -> dict[str, Any]:
    """Every check that needs no process: raises FrenzyInputError naming the file or setting."""
    check_realisable(plan)
    spec = training_spec(job, plan)
    hf = spec["hf_config"]
    positions = hf.get("n_positions") or hf.get("max_position_embeddings")
    if positions and job.seq_len > positions:
        raise FrenzyInputError("seq_len", f"{job.seq_len} exceeds the model's {positions} positions")
    vocab = int(hf.get("vocab_size", 0)) or 1 << 30
    check_data(spec["data"], vocab=vocab, seq_len=job.seq_len)
    if job.entry_point:
        mod_name, _, fn_name = job.entry_point.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:
            raise FrenzyInputError("entry_point", f"module {mod_name!r} does not import ({type(e).__name__}: {e})") from None
        if not callable(getattr(mod, fn_name, None)):
            raise FrenzyInputError("entry_point", f"{mod_name!r} has no callable {fn_name!r}")
    if plan.optimizer == "adamw8bit" and importlib.util.find_spec("bitsandbytes") is None:
        raise FrenzyInputError("optimizer", "adamw8bit needs the bitsandbytes package, which is not installed")
    return spec


def launch_command(paths: Paths) -> list[str]:
    """``accelerate launch`` as an argument list (no shell); the program runs as a module."""
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(paths.accelerate),
            "-m", "trainer.train", "--run-dir", str(paths.run_dir)]


# torch elastic's failure report for a rank killed by a signal ("exitcode  : -9", "Signal 9 (SIGKILL)")
_SIGNAL_DEATH = re.compile(r"exitcode\s*:\s*-\d+|Signal \d+ \(SIG[A-Z]+\) received by PID")


class _Listener:
    """Turns the program's lines into losses, the result and errors, and forwards every line."""

    def __init__(self, log: Callable[[str], None], on_step, losses: dict[int, float], logfile):
        self.log, self.on_step, self.losses, self.logfile = log, on_step, losses, logfile
        self.result: dict[str, Any] | None = None
        self.errors: list[dict[str, Any]] = []
        self.ooms: list[dict[str, Any]] = []
        self.resume: dict[str, Any] | None = None
        self.signalled = False       # a rank died from a signal (killed, lost): always worth a retry

    def __call__(self, line: str) -> None:
        self.logfile.write(line + "\n")
        self.log(line)
        if _SIGNAL_DEATH.search(line):
            self.signalled = True
        tag, _, rest = line.partition(" ")
        if not tag.startswith("FRENZY_"):
            return
        try:
            payload = json.loads(rest)
        except json.JSONDecodeError:
            return
        if tag == "FRENZY_STEP":
            self.losses[int(payload["step"])] = float(payload["loss"])
            if self.on_step is not None:
                self.on_step(int(payload["step"]), int(payload.get("total", 0)), float(payload["loss"]))
        elif tag == "FRENZY_RESULT":
            self.result = payload
        elif tag == "FRENZY_ERROR":
            self.errors.append(payload)
        elif tag == "FRENZY_OOM":
            self.ooms.append(payload)
        elif tag == "FRENZY_RESUME":
            self.resume = payload


def _backoff(retry: int, base_s: float, cap_s: float = 60.0) -> float:
    """Exponential backoff with full jitter in [0.5, 1.5) x base x 2^(retry-1)."""
    return min(cap_s, base_s * 2 ** (retry - 1)) * (0.5 + random.random())


def _error_text(tail: list[str], listener: _Listener, rc: int | None) -> str:
    if listener.ooms:
        return f"OutOfMemoryError: {listener.ooms[0].get('message')}"
    if listener.errors:
        e = listener.errors[0]
        return f"{e.get('type')}: {e.get('message')}"
    for line in reversed(tail):
        s = line.strip()
        if "OutOfMemoryError" in s or "out of memory" in s:
            return s[:300]
    for line in reversed(tail):
        s = line.strip()
        if s and ("Error" in s or "error" in s) and not s.startswith("[rank") and "CalledProcessError" not in s:
            return s[:300]
    return f"exit status {rc}"


# -------------------------------------------------------------------------------------- loop
def run_training(job: TrainingJob, plan: Plan, *, run_dir: str | Path,
                 acquire: Callable[[Plan], list[str]], release: Callable[[], None],
                 log: Callable[[str], None], on_step: Callable[[int, int, float], None] | None = None,
                 on_attempt: Callable[[Attempt], None] | None = None,
                 inventory: dict[str, int] | None = None, deadline_s: float | None = None,
                 max_transient_retries: int = 3, backoff_s: float = 2.0, grace_s: float = 30.0,
                 fallbacks: Iterator[Plan] | None = None) -> TrainResult:
    """Train ``job`` starting on ``plan``; see the module docstring. ``deadline_s`` bounds the
    whole run (all attempts); ``fallbacks`` overrides the OOM fallback sequence (default:
    ``fallback_plans(job, plan, inventory=inventory)``, computed lazily at the first OOM)."""
    run_dir = Path(run_dir)
    started = time.monotonic()
    preflight(job, plan)                                # nothing acquired yet: nothing to release
    run_dir.mkdir(parents=True, exist_ok=True)
    losses: dict[int, float] = {}
    attempts: list[Attempt] = []
    current = plan
    retries_left = max_transient_retries
    measured = Measured()
    status: str = "failed"
    error: str | None = None

    def remaining() -> float | None:
        return None if deadline_s is None else deadline_s - (time.monotonic() - started)

    for number in range(1, 10 ** 6):
        devices = list(acquire(current))
        try:
            if len(devices) < current.gpus:
                raise FrenzyInputError("plan.gpus", f"the plan runs {current.gpus} processes but only "
                                                    f"{len(devices)} devices were allocated ({', '.join(devices) or 'none'})")
            if current is not plan:
                preflight(job, current)
            paths = write_launch_files(run_dir, current, job, main_port=free_port())
        except BaseException:
            release()
            raise
        latest = checkpoints.latest_checkpoint(run_dir)
        resumed = latest.step if latest is not None else 0
        log(f"frenzy: attempt {number} on {current.short()} devices={','.join(devices[:current.gpus])}"
            + (f", resuming from step {resumed}" if resumed else ""))
        env = launch_env(devices[:current.gpus], cpu=is_cpu_plan(current), attempt=number,
                         deepspeed=current.zero > 0)
        left = remaining()
        t0 = time.monotonic()
        with open(run_dir / f"attempt-{number}.log", "w") as logfile:
            listener = _Listener(log, on_step, losses, logfile)
            try:
                if left is not None and left <= 0:
                    rc, oom, tail = None, False, []
                else:
                    rc, oom, tail = run_process_group(launch_command(paths), env, left, listener, grace_s)
            except BaseException:
                release()
                raise
        if listener.result is not None:
            # rank 0 reports the result after every rank finished and the last checkpoint is
            # saved: a crash while the processes tear down does not undo the training
            outcome: Outcome = "ok"
            if rc != 0:
                log(f"frenzy: attempt {number} finished training but its processes exited with {rc}")
        elif rc is None:
            outcome = "timeout"
        elif oom:
            outcome = "oom"
        else:
            outcome = "failed"
        err = None if outcome == "ok" else (
            f"deadline of {deadline_s:.0f} s reached" if outcome == "timeout" else _error_text(tail, listener, rc))
        att = Attempt(plan=current, outcome=outcome, resumed_from_step=resumed, error=err, number=number,
                      devices=devices[:current.gpus], duration_s=round(time.monotonic() - t0, 3))
        attempts.append(att)
        (run_dir / "attempts.json").write_text(json.dumps([a.model_dump(mode="json") for a in attempts], indent=2))
        if on_attempt is not None:
            on_attempt(att)

        if outcome == "ok":
            r = listener.result
            measured = Measured(step_time_s=r.get("step_time_s", 0.0), tokens_per_s=r.get("tokens_per_s", 0.0),
                                allocated_peak_gib=r.get("allocated_peak_gib"),
                                reserved_peak_gib=r.get("reserved_peak_gib"),
                                nvml_used_gib=r.get("nvml_used_gib"),
                                memory_measured=bool(r.get("memory_measured")), per_rank=r.get("per_rank", []))
            status = "completed"
            release()
            break
        if outcome == "timeout":
            status, error = "timeout", err
            release()
            break
        if outcome == "oom":
            release()
            if fallbacks is None:
                fallbacks = fallback_plans(job, current, inventory=inventory)
            nxt = next(fallbacks, None)
            if nxt is None:
                status, error = "failed", f"out of memory on {current.short()} and no fallback plan is left"
                log(f"frenzy: {error}")
                break
            log(f"frenzy: out of memory on {current.short()}; falling back to {nxt.short()} "
                f"(global batch {nxt.global_batch} kept)")
            current = nxt
            continue
        # failed
        release()
        permanent = (bool(listener.errors) and not listener.signalled and rc is not None and rc >= 0
                     and all(not e.get("transient", True) for e in listener.errors))
        if permanent or retries_left <= 0:
            status, error = "failed", err if permanent else f"{err} (after {max_transient_retries} retries)"
            log(f"frenzy: attempt {number} failed: {error}")
            break
        retries_left -= 1
        delay = _backoff(max_transient_retries - retries_left, backoff_s)
        left = remaining()
        if left is not None:
            delay = max(0.0, min(delay, left))
        log(f"frenzy: attempt {number} failed ({err}); retry in {delay:.1f} s "
            f"({retries_left} retries left), resuming from the newest checkpoint")
        time.sleep(delay)

    latest = checkpoints.latest_checkpoint(run_dir)
    return TrainResult(status=status, losses=[losses[s] for s in sorted(losses)], attempts=attempts,
                       measured=measured, checkpoint_dir=str(latest.path) if latest else None,
                       final_plan=current, error=error)
