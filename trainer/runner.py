"""The attempt loop: launch, classify, retry or fall back, resume from the checkpoint.

    result = run_training(job, plan, run_dir=..., acquire=..., release=..., log=...)

* ``acquire(plan) -> list[str]`` gives the devices of an allocation for ``plan`` (the flow
  passes a ledger-backed function); ``release()`` frees the last one. Every ``acquire`` is
  paired with exactly one ``release``: before a retry or a fallback acquires again, and when
  this function returns or raises.
* Outcomes: ``ok``; ``oom`` -> the next plan of ``trainer.fallback.fallback_plans`` (same
  global batch), resumed from the newest checkpoint; ``failed`` -> retried on the same plan
  with exponential backoff and jitter when transient (a lost process, a collective timeout),
  at most ``max_transient_retries`` times; ``stopped`` -> the program acted on a stop request
  of the control file (``trainer.control.request_stop``: a re-size, a lease fenced, the
  deadline) after an optimizer step, with a checkpoint: the result says the step and the
  reason, and a relaunch in the same run folder (any plan with the same global batch)
  continues from that step; ``timeout`` -> the deadline passed before the program stopped.
  An ``acquire`` that raises ``LaunchElsewhere`` (a fallback's GPUs are another process's to
  launch on) ends the run ``stopped`` at its newest checkpoint the same way.
* The deadline (``deadline_s``) stops the program through the control file too: the runner
  writes a stop request (with an export of the model) when the time left is down to what a
  step, a checkpoint save and the exit take (measured as the run goes, ``stop_margin_s``).
* Where a run starts: its own newest checkpoint, else the checkpoint of an earlier run of the
  job (``trainer.resume``: a resubmission, or ``resume_from``), else step 0 or ``init_from``.
* Bad input (missing data, tokenizer not loadable offline, entry point not importable, a
  starting point that does not exist or does not match its config, LoRA targets that match
  nothing, QLoRA without a GPU, a plan the launcher cannot realise, more processes than
  devices, an MLflow store that cannot be opened) raises ``FrenzyInputError`` before any
  process starts, with the devices released.
* Tracking: one MLflow run per call (``trainer.tracking``), unless ``job.tracking.enabled`` is off.

No prefect here: ``log``, ``on_step`` and ``on_attempt`` are the flow's hooks (Prefect logs,
progress artifact, events).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import queue
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.models import resolve_model
from estimator.plan import Plan

from . import allowlist, checkpoints, control, interrupt, op_builds, resume
from .data import check_data, check_eval
from .loglines import parse_line
from .fallback import fallback_plans
from .launch_config import (Paths, check_heads, check_pipeline_model, check_realisable, is_cpu_plan, training_spec,
                            write_launch_files)
from .launcher import launch_env, run_process_group
from .ports import free_port
from .parallel import uses_deepspeed
from .pretrained import check_job

Outcome = Literal["ok", "oom", "failed", "timeout", "stopped"]
Status = Literal["completed", "failed", "timeout", "stopped"]

# What a deadline stop must leave time for beyond the measured step and checkpoint times: the
# program's teardown (end of training, process group destroyed, interpreter exit: 1-2 s for a
# CPU gloo run here) and the case of a program still starting when the request is written.
DEADLINE_STOP_FLOOR_S = 5.0

# Step updates waiting for a slow ``on_step`` (a progress artifact over HTTP). The newest is all
# a progress bar needs; 64 holds a minute of the artifact's one-per-second updates while one
# HTTP call retries, and when it is full the oldest is dropped instead of waiting.
ON_STEP_QUEUE_MAX = 64
# How long the end of a run waits for the last queued updates (the final step's progress) before
# leaving a hanging callee behind: one HTTP round trip to a live API takes well under a second.
ON_STEP_DRAIN_S = 2.0


class NodeRole(BaseModel):
    """This process's node in a multi-node launch (one runner per node, every node started the
    same way by its own flow run; ``frenzy_flows.gang``). ``endpoint()`` gives node 0's address
    and the port of the attempt's rendezvous: node 0 finds a free port on its own address and
    publishes both, the others wait for them (``ledger.gang``). The ranks of node ``r`` are the
    global ranks ``r * per_node ... (r + 1) * per_node - 1``; data is indexed by them."""

    model_config = {"arbitrary_types_allowed": True, "frozen": True}

    machine_rank: int = Field(ge=0)
    num_machines: int = Field(ge=2)
    endpoint: Callable[[], tuple[str, int]]


def node_suffix(machine_rank: int) -> str:
    """What tells node ``machine_rank``'s files in a shared run folder from the others' (node 0's
    have none, as a one-node run's)."""
    return f"-node{machine_rank}" if machine_rank else ""


def attempts_path(run_dir: Path, machine_rank: int = 0) -> Path:
    """Where a run records its attempts as they end (``attempts<suffix>.json``): the gang's
    dispatcher reads a node's record of the attempt that ran out of memory there."""
    return Path(run_dir) / f"attempts{node_suffix(machine_rank)}.json"


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
    allocator: str | None = None      # the caching allocator's mode: "expandable" | "default"
    per_rank: list[dict[str, Any]] = Field(default_factory=list)


def _forget_after(step: int, *by_step: dict[int, Any]) -> None:
    """Drop the entries past ``step`` (a checkpoint's): those steps are trained again."""
    for d in by_step:
        for gone in [s for s in d if s > step]:
            del d[gone]


class LaunchElsewhere(Exception):
    """Raised by ``acquire``: the GPUs of the next launch (an out-of-memory fallback's) are not
    where this process trains. The run ends "stopped" at its newest checkpoint, as for a
    stop request, and its caller launches the rest there (``frenzy_flows.training``)."""


class StopInfo(BaseModel):
    """Why and where a run stopped on a control-file request (``FRENZY_STOPPED``)."""

    step: int
    reason: str
    request_id: str = ""


class EvalLoss(BaseModel):
    step: int
    loss: float


class TrainResult(BaseModel):
    status: Status
    losses: list[float]
    attempts: list[Attempt]
    measured: Measured
    checkpoint_dir: str | None
    final_plan: Plan
    error: str | None = None
    stop: StopInfo | None = None                 # status "stopped": the step and the reason
    eval_losses: list[EvalLoss] = Field(default_factory=list)
    export_dir: str | None = None                # Hugging Face export (from_pretrained loads it)
    params: int | None = None                    # all parameters of the trained model
    trainable_params: int | None = None          # those the optimizer updates (LoRA: the adapters)
    optimizer_impl: str | None = None
    run_dir: str | None = None
    resumed_from: str | None = None              # another run's checkpoint this run continued from
    mlflow_run_id: str | None = None
    mlflow_experiment_id: str | None = None
    mlflow_tracking_uri: str | None = None
    mlflow_url: str | None = None
    ledger_error: str | None = None              # the ledger could not record the end (run still counts)
    handoff: dict[str, Any] | None = None        # status "stopped": the allocation (an Assignment's JSON) the
                                                 # run goes on from in another process (another pool or
                                                 # node, or a gang): its submitter launches it there

    @property
    def ok(self) -> bool:
        return self.status == "completed"


# ---------------------------------------------------------------------------------- preflight
def preflight(job: TrainingJob, plan: Plan) -> dict[str, Any]:
    """Every check that needs no process: raises FrenzyInputError naming the file or setting."""
    check_realisable(plan)
    spec = resolve_model(job.model)
    check_heads(plan, spec.heads, spec.n_kv)
    check_pipeline_model(plan, spec.arch, spec.layers)
    if job.finetune.method == "qlora":
        if is_cpu_plan(plan):
            raise FrenzyInputError("finetune.method", "qlora needs a GPU (bitsandbytes' 4-bit kernels); "
                                                      "the plan runs on the CPU")
        if plan.zero == 3 or plan.offload == "optimizer+params":
            raise FrenzyInputError("plan.zero", "qlora keeps its 4-bit base on every GPU; ZeRO-3 / parameter "
                                                "offload would partition it (use zero <= 2)")
    return preflight_job(job, plan)


def preflight_job(job: TrainingJob, plan: Plan) -> dict[str, Any]:
    """The checks of the job itself, whatever plan it gets (``plan``: any of its plans, for the
    optimizer): starting point, allow-lists, data, tokenizer, evaluation data, entry point,
    optimizer. The CLI runs them before Prefect starts; ``preflight`` again before a launch."""
    check_job(job)
    allowlist.check_job(job)       # before any file is read or module imported
    spec = training_spec(job, plan)
    hf = spec["hf_config"]
    positions = hf.get("n_positions") or hf.get("max_position_embeddings")
    if positions and job.seq_len > positions:
        raise FrenzyInputError("seq_len", f"{job.seq_len} exceeds the model's {positions} positions")
    vocab = int(hf.get("vocab_size", 0)) or 1 << 30
    tokens = check_data(spec["data"], vocab=vocab, seq_len=job.seq_len)
    check_eval(spec["eval"], spec["data"], vocab=vocab, seq_len=job.seq_len, tokens=tokens)
    if job.entry_point:
        mod_name, _, fn_name = job.entry_point.partition(":")
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:
            raise FrenzyInputError("entry_point", f"module {mod_name!r} does not import ({type(e).__name__}: {e})") from None
        if not callable(getattr(mod, fn_name, None)):
            raise FrenzyInputError("entry_point", f"{mod_name!r} has no callable {fn_name!r}")
    if plan.optimizer.startswith("adamw8bit") and importlib.util.find_spec("bitsandbytes") is None:
        raise FrenzyInputError("optimizer", f"{plan.optimizer} needs the bitsandbytes package, which is not installed")
    # what the run reads or writes at its start and end: found wrong only after a server
    # started and a job was recorded, or after the whole training (an export folder)
    if job.resume_from:
        resume.check_resumable(job, resume.explicit_checkpoint(job.resume_from))
    if job.tracking.enabled and job.tracking.uri:
        from .tracking import check_tracking_uri
        check_tracking_uri(job.tracking.uri)
    if job.export.enabled and job.export.dir:
        check_writable_folder("export.dir", job.export.dir)
        check_export_folder(job.export.dir)
    return spec


def check_export_folder(path: str) -> None:
    """An export replaces its folder: one that holds anything but an earlier export (its
    ``modeling.EXPORT_MARKER``) is refused; pointing ``export.dir`` at an existing folder of
    data, models or code deleted it after the training."""
    from .modeling import EXPORT_MARKER, holds_other_files

    p = Path(path).expanduser().resolve()
    if holds_other_files(p):
        raise FrenzyInputError("export.dir", f"{p} holds files that are not an earlier export (no {EXPORT_MARKER}): "
                                             "an export replaces its folder; give a new or empty folder")


def check_writable_folder(field: str, path: str) -> None:
    """``path`` can be made a folder: it is one or does not exist, and the nearest folder
    above it that exists takes new files (the export is written beside it, as
    ``<path>.partial``, and renamed). A probe file is made there and removed."""
    from estimator.home import check_can_write_in

    p = Path(path).expanduser().resolve()
    if p.exists() and not p.is_dir():
        raise FrenzyInputError(field, f"{p} is a file, not a folder")
    check_can_write_in(field, p.parent)


class Mailbox:
    """Calls ``fn`` on a thread of its own with what ``post`` hands it, so a slow or hanging
    callee (a progress update over HTTP while the API is down) never blocks the caller: the
    reader thread that drains the ranks' output pipe, whose stall would stall the ranks.
    Bounded: when full, the oldest update is dropped; a callee's exception drops its update."""

    _END = object()

    def __init__(self, fn: Callable[..., Any], maxsize: int = ON_STEP_QUEUE_MAX, name: str = "frenzy-on-step"):
        self.fn = fn
        self.q: queue.Queue = queue.Queue(maxsize=maxsize)
        self.dropped = 0
        self.failed = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _put(self, item: Any) -> None:
        while True:
            try:
                self.q.put_nowait(item)
                return
            except queue.Full:
                try:
                    self.q.get_nowait()
                    self.dropped += 1
                except queue.Empty:
                    pass

    def post(self, *args: Any) -> None:
        self._put(args)

    def _run(self) -> None:
        while True:
            item = self.q.get()
            if item is self._END:
                return
            try:
                self.fn(*item)
            except Exception:
                self.failed += 1

    def close(self, timeout_s: float = ON_STEP_DRAIN_S) -> bool:
        """Deliver what is queued within ``timeout_s``; returns whether the thread finished
        (a callee still hanging is left behind: the thread is a daemon)."""
        self._put(self._END)
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


def launch_command(paths: Paths) -> list[str]:
    """``accelerate launch`` as an argument list (no shell); the program runs as a module. The
    launch goes through ``trainer.bound_launch``: the c10d store listens on the node's address."""
    return [sys.executable, "-m", "trainer.bound_launch", "--config_file", str(paths.accelerate),
            "-m", "trainer.train", "--run-dir", str(paths.run_dir)]


# torch elastic's failure report for a rank killed by a signal ("exitcode  : -9", "Signal 9 (SIGKILL)")
_SIGNAL_DEATH = re.compile(r"exitcode\s*:\s*-\d+|Signal \d+ \(SIG[A-Z]+\) received by PID")


def logged_losses(log: Path) -> dict[int, float]:
    """Step -> loss from an attempt's log file (``attempt-<n>.log``, rank 0's step lines): what
    a gang's dispatcher keeps of a launch whose node 0 never returned a result."""
    out: dict[int, float] = {}
    for line in log.read_text(errors="replace").splitlines() if log.is_file() else []:
        parsed = parse_line(line)
        if parsed is not None and parsed[0] == "FRENZY_STEP":
            out[int(parsed[1]["step"])] = float(parsed[1]["loss"])
    return out


def attempt_log(run_dir: Path, number: int, machine_rank: int = 0) -> Path:
    """The log file of attempt ``number`` (of node ``machine_rank`` in a gang's shared folder)."""
    return Path(run_dir) / f"attempt-{number}{node_suffix(machine_rank)}.log"


class _Listener:
    """Turns the program's lines into losses, the result and errors, and forwards every line."""

    def __init__(self, log: Callable[[str], None], on_step, losses: dict[int, float], logfile,
                 evals: dict[int, float] | None = None, tracker=None):
        self.log, self.on_step, self.losses, self.logfile = log, on_step, losses, logfile
        self.evals = {} if evals is None else evals
        self.tracker = tracker
        self.result: dict[str, Any] | None = None
        self.errors: list[dict[str, Any]] = []
        self.ooms: list[dict[str, Any]] = []
        self.resume: dict[str, Any] | None = None
        self.model: dict[str, Any] | None = None
        self.stopped: dict[str, Any] | None = None
        self.exports: list[dict[str, Any]] = []
        self.slowest_step_s = 0.0
        self.slowest_save_s = 0.0
        self.signalled = False       # a rank died from a signal (killed, lost): always worth a retry

    def __call__(self, line: str) -> None:
        self.logfile.write(line + "\n")
        self.log(line)
        if _SIGNAL_DEATH.search(line):
            self.signalled = True
        parsed = parse_line(line)
        if parsed is None:
            return
        tag, payload = parsed
        if self.tracker is not None:
            self.tracker.on_line(tag, payload)
        if tag == "FRENZY_STEP":
            self.losses[int(payload["step"])] = float(payload["loss"])
            self.slowest_step_s = max(self.slowest_step_s, float(payload.get("step_time_s") or 0.0))
            if self.on_step is not None:
                self.on_step(int(payload["step"]), int(payload.get("total", 0)), float(payload["loss"]))
        elif tag == "FRENZY_EVAL":
            self.evals[int(payload["step"])] = float(payload["loss"])
        elif tag == "FRENZY_CHECKPOINT":
            self.slowest_save_s = max(self.slowest_save_s, float(payload.get("save_s") or 0.0))
        elif tag == "FRENZY_MODEL":
            self.model = payload
        elif tag == "FRENZY_EXPORT":
            self.exports.append(payload)
        elif tag == "FRENZY_STOPPED":
            self.stopped = payload
        elif tag == "FRENZY_RESULT":
            self.result = payload
        elif tag == "FRENZY_ERROR":
            self.errors.append(payload)
        elif tag == "FRENZY_OOM":
            self.ooms.append(payload)
        elif tag == "FRENZY_RESUME":
            self.resume = payload


def stop_margin_s(listener: _Listener) -> float:
    """Time a stop at the next step boundary needs: the step under way, the checkpoint save and
    an export (each bounded by twice/thrice the slowest seen so far), the teardown floor."""
    return DEADLINE_STOP_FLOOR_S + 2 * listener.slowest_step_s + 3 * listener.slowest_save_s


class _DeadlineStop:
    """While an attempt runs: write a stop request (with an export) into the control file once
    the time left is down to the stop margin, so the deadline ends the run with a checkpoint."""

    def __init__(self, run_dir: Path, remaining: Callable[[], float | None], listener: _Listener,
                 log: Callable[[str], None]):
        self.run_dir, self.remaining, self.listener, self.log = run_dir, remaining, listener, log
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="frenzy-deadline-stop", daemon=True)

    def __enter__(self) -> "_DeadlineStop":
        if self.remaining() is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(5)

    def _watch(self) -> None:
        while not self.done.wait(0.25):
            left = self.remaining()
            if left is not None and left <= stop_margin_s(self.listener):
                rid = control.request_stop(self.run_dir, "deadline", export=True)
                self.log(f"frenzy: {max(left, 0):.0f} s to the deadline: asked the training to stop with a "
                         f"checkpoint (request {rid})")
                return


def _release_at_end(release: Callable[[], None], log: Callable[[str], None]) -> None:
    """Release after the training ended: a ledger that cannot be reached then does not undo the
    training (its lease is no longer renewed and runs out on its own within the TTL)."""
    try:
        release()
    except Exception as err:
        log(f"frenzy: could not release the allocation ({type(err).__name__}: {str(err)[:200]}); "
            f"its lease runs out on its own")


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
                 fallbacks: Iterator[Plan] | None = None, node: NodeRole | None = None,
                 first_attempt: int = 1) -> TrainResult:
    """Train ``job`` starting on ``plan``; see the module docstring. ``deadline_s`` bounds the
    whole run (all attempts); ``fallbacks`` overrides the OOM fallback sequence (default:
    ``fallback_plans(job, plan, inventory=inventory)``, computed lazily at the first OOM).

    ``node``: this runner trains one node of a multi-node launch (``acquire`` gives that node's
    devices, ``plan.gpus / num_machines`` of them); only node 0's ranks report losses and the
    result, so another node's attempt is ``ok`` when its processes exit 0. Gang retries are the
    dispatcher's: give ``max_transient_retries=0`` and no fallbacks.

    ``first_attempt``: the number of this call's first attempt (``FRENZY_ATTEMPT``, the
    ``attempt-<n>`` log), when launches before it were another call's: a gang's relaunch
    continues the numbering, so a rehearsed out-of-memory failure fires on the first launch only."""
    if first_attempt < 1:
        raise ValueError(f"first_attempt must be 1 or more, not {first_attempt}")
    run_dir = Path(run_dir)
    started = time.monotonic()
    preflight(job, plan)                                # nothing acquired yet: nothing to release
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / resume.JOB_FILE).is_file():
        resume.record_job(run_dir, job)                 # so a resubmission finds this run
    start_ck = resume.resume_checkpoint(job, run_dir)
    external = start_ck if start_ck is not None and run_dir.resolve() not in start_ck.path.resolve().parents else None
    tracker = None
    lead = node is None or node.machine_rank == 0      # the node whose rank 0 reports
    machine_rank = node.machine_rank if node is not None else 0       # names this node's files
    machines = node.num_machines if node is not None else 1
    if job.tracking.enabled and lead:
        from .tracking import Tracker

        tracker = Tracker(job, plan, run_dir, log)      # FrenzyInputError when the store cannot be opened
        log(f"frenzy: MLflow run {tracker.run_id} at {tracker.uri}")
    losses: dict[int, float] = {}
    evals: dict[int, float] = {}
    attempts: list[Attempt] = []
    current = plan
    retries_left = max_transient_retries
    measured = Measured()
    status: Status = "failed"
    error: str | None = None
    stop: StopInfo | None = None
    model_info: dict[str, Any] = {}
    export: str | None = None

    def remaining() -> float | None:
        return None if deadline_s is None else deadline_s - (time.monotonic() - started)

    # the reader thread hands step updates to a thread of their own: a hanging callee drops them
    steps = Mailbox(on_step) if on_step is not None else None
    registered = interrupt.active(run_dir)      # a stop asked for (a signal) reaches this run too
    registered.__enter__()
    try:
        for number in range(first_attempt, first_attempt + 10 ** 6):
            if uses_deepspeed(current):
                # before the ranks and their devices: a lock a killed build or load left, or an op
                # this machine lacks, would hang them before their first step with no message
                op_builds.ensure_ops(launch_env([], cpu=is_cpu_plan(current), deepspeed=True),
                                     cpu=is_cpu_plan(current), offload=current.offload != "none", log=log)
            if interrupt.requested():   # a stop during the build too
                status, error = "failed", f"interrupted ({interrupt.requested()}) before attempt {number}"
                log(f"frenzy: {error}")
                break
            try:
                devices = list(acquire(current))
            except LaunchElsewhere as moved:
                latest = checkpoints.latest_checkpoint(run_dir) or external
                stop = StopInfo(step=latest.step if latest is not None else 0, reason=f"launch elsewhere: {moved}")
                status = "stopped"
                current = attempts[-1].plan if attempts else current    # the plan that last ran here
                _forget_after(stop.step, losses, evals)     # the next launch trains them again
                log(f"frenzy: {moved}; stopping here at the checkpoint of step {stop.step}")
                break
            try:
                local = current.gpus // machines           # this node's processes
                if len(devices) < local:
                    raise FrenzyInputError("plan.gpus", f"the plan runs {local} processes here but only "
                                                        f"{len(devices)} devices were allocated ({', '.join(devices) or 'none'})")
                if current is not plan:
                    preflight(job, current)
                address, port = node.endpoint() if node is not None else (None, free_port())
                paths = write_launch_files(run_dir, current, job, main_port=port, main_address=address,
                                           num_machines=machines,
                                           machine_rank=machine_rank,
                                           resume_from=str(external.path) if external is not None else None)
            except BaseException:
                release()
                raise
            latest = checkpoints.latest_checkpoint(run_dir) or external
            resumed = latest.step if latest is not None else 0
            # an attempt that failed after its last checkpoint logged steps this one trains
            # again: its losses go (the run's curve, and a stop's step, are this attempt's)
            _forget_after(resumed, losses, evals)
            log(f"frenzy: attempt {number} on {current.short()} devices={','.join(devices[:local])}"
                + (f" as node {node.machine_rank} of {machines} (rendezvous {address}:{port})" if node else "")
                + (f", resuming from step {resumed}" if resumed else ""))
            env = launch_env(devices[:local], cpu=is_cpu_plan(current), attempt=number,
                             deepspeed=uses_deepspeed(current), main_address=address)
            left = remaining()
            t0 = time.monotonic()
            # line-buffered: the log is current on disk (tail -f; what is left after a kill -9)
            with open(attempt_log(run_dir, number, machine_rank), "w", buffering=1) as logfile:
                listener = _Listener(log, steps.post if steps is not None else None, losses, logfile,
                                     evals, tracker)
                try:
                    if left is not None and left <= 0:
                        rc, oom, tail = None, False, []
                    else:
                        with _DeadlineStop(run_dir, remaining, listener, log):
                            rc, oom, tail = run_process_group(launch_command(paths), env, left, listener, grace_s)
                except BaseException:
                    release()
                    raise
            model_info = listener.model or model_info
            if listener.exports:
                export = listener.exports[-1]["dir"] if listener.exports[-1].get("request_id") is None else export
            if listener.stopped is not None and listener.result is not None:
                outcome: Outcome = "stopped"
            elif listener.result is not None:
                # rank 0 reports the result after every rank finished and the last checkpoint is
                # saved: a crash while the processes tear down does not undo the training
                outcome = "ok"
                if rc != 0:
                    log(f"frenzy: attempt {number} finished training but its processes exited with {rc}")
            elif not lead and rc == 0:
                outcome = "ok"          # another node: node 0 reports; its ranks finished cleanly
            elif rc is None:
                outcome = "timeout"
            elif oom:
                outcome = "oom"
            else:
                outcome = "failed"
            err = None if outcome in ("ok", "stopped") else (
                f"deadline of {deadline_s:.0f} s reached" if outcome == "timeout" else _error_text(tail, listener, rc))
            att = Attempt(plan=current, outcome=outcome, resumed_from_step=resumed, error=err, number=number,
                          devices=devices[:local], duration_s=round(time.monotonic() - t0, 3))
            attempts.append(att)
            attempts_path(run_dir, machine_rank).write_text(json.dumps([a.model_dump(mode="json") for a in attempts], indent=2))
            if on_attempt is not None:
                on_attempt(att)
            if outcome not in ("ok", "stopped") and interrupt.requested():
                release()                      # killed on the way out: neither retry nor fall back
                status, error = "failed", f"interrupted ({interrupt.requested()}): {err}"
                log(f"frenzy: attempt {number} {error}")
                break

            if outcome in ("ok", "stopped"):
                r = listener.result or {}
                measured = Measured(step_time_s=r.get("step_time_s", 0.0), tokens_per_s=r.get("tokens_per_s", 0.0),
                                    allocated_peak_gib=r.get("allocated_peak_gib"),
                                    reserved_peak_gib=r.get("reserved_peak_gib"),
                                    nvml_used_gib=r.get("nvml_used_gib"),
                                    memory_measured=bool(r.get("memory_measured")), per_rank=r.get("per_rank", []),
                                    allocator=r.get("allocator"))
                status = "completed" if outcome == "ok" else "stopped"
                if outcome == "stopped":
                    stop = StopInfo(**{k: listener.stopped.get(k) or d for k, d in
                                       (("step", 0), ("reason", "stop"), ("request_id", ""))})
                    log(f"frenzy: stopped after step {stop.step} ({stop.reason}), checkpoint saved")
                _release_at_end(release, log)
                break
            if outcome == "timeout":
                status, error = "timeout", err
                _release_at_end(release, log)
                break
            if outcome == "oom":
                release()
                if fallbacks is None:
                    fallbacks = fallback_plans(job, current, inventory=inventory)
                nxt = next(fallbacks, None)
                if nxt is None:
                    # a gang's node gets no fallbacks: its dispatcher falls back for the whole gang
                    status, error = "failed", (f"out of memory on {current.short()}" + (
                        " (the gang's dispatcher falls back)" if node is not None else
                        " and no fallback plan is left"))
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
            until = time.monotonic() + delay
            while time.monotonic() < until and not interrupt.requested():
                time.sleep(min(0.25, max(0.0, until - time.monotonic())))
    except BaseException as e:               # bad input found late, cancellation: the run ends failed
        if tracker is not None:
            tracker.finish("failed", measured={}, final_plan=current, export_dir=None, steps=max(losses, default=0))
        if lead:
            resume.record_result(run_dir, "failed", error=f"{type(e).__name__}: {str(e)[:300]}")
        raise
    finally:
        registered.__exit__(None, None, None)
        if steps is not None:
            steps.close()

    latest = checkpoints.latest_checkpoint(run_dir)
    result = TrainResult(
        status=status, losses=[losses[s] for s in sorted(losses)], attempts=attempts,
        measured=measured, checkpoint_dir=str(latest.path) if latest else None, final_plan=current,
        error=error, stop=stop, eval_losses=[EvalLoss(step=s, loss=evals[s]) for s in sorted(evals)],
        export_dir=export, params=model_info.get("params"), trainable_params=model_info.get("trainable_params"),
        optimizer_impl=model_info.get("optimizer_impl"), run_dir=str(run_dir.resolve()),
        resumed_from=str(external.path) if external is not None else None)
    if tracker is not None:
        tracker.finish(status, measured=measured.model_dump(exclude={"per_rank"}), final_plan=current,
                       export_dir=export, steps=max(losses, default=0))
        result = result.model_copy(update={"mlflow_run_id": tracker.run_id, "mlflow_experiment_id": tracker.experiment_id,
                                           "mlflow_tracking_uri": tracker.uri, "mlflow_url": tracker.url})
    if lead:
        resume.record_result(run_dir, status, stop=stop.model_dump() if stop else None)
    return result
