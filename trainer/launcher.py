"""Run a training launcher (``accelerate launch`` / ``torchrun``) as a child process group.

Why a subprocess in its own session (see the development notes, notes/prefect.md section 9): torch's
launchers install signal handlers and fork workers, neither of which is safe inside a Prefect
task thread, and CUDA must never be initialised in the orchestrating process. The deadline
does not depend on the child printing anything (a reader thread pumps the output while the
caller waits on the process), and whatever ends the wait - the deadline, an exception, a
KeyboardInterrupt (Prefect cancellation) - the whole tree is killed. Torch elastic starts each
rank in a session of its own, so ranks are not in the launcher's process group: we collect all
descendants with psutil *before* signalling and signal each of them too.

No prefect and no torch here: the flow passes ``on_line`` (its run logger) and we stay testable
with plain subprocesses.
"""
from __future__ import annotations

import collections
import hashlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import psutil

from .ports import LOOPBACK

# A line that means CUDA (or the injected rehearsal of it) ran out of memory.
OOM_MARKERS = ("FRENZY_OOM", "CUDA out of memory", "OutOfMemoryError", "CUDA error: out of memory",
               "CUBLAS_STATUS_ALLOC_FAILED")
TAIL_LINES = 200
LOOPBACK_IFNAME = "lo"          # Linux's loopback interface

REPO_ROOT = Path(__file__).resolve().parent.parent
# Secrets the orchestrating process holds that the ranks (which run the job's code) never get:
# the ledger URL carries the database password.
RANK_ENV_WITHHELD = ("FRENZY_LEDGER_URL",)

# Launches running now (pid -> process): what ``kill_all`` stops when the orchestrating process
# itself has to stop (a signal, a dead Prefect server) and cannot wait for a step boundary.
_LIVE: dict[int, subprocess.Popen] = {}


def launch_env(devices: Sequence[str], *, cpu: bool, attempt: int = 1, deepspeed: bool = False,
               base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None,
               main_address: str | None = None) -> dict[str, str]:
    """The child's environment: the allocated devices and nothing else visible.

    ``devices`` are what the ledger allocated (GPU indices or UUIDs); on a CPU plan they are
    labels only and every GPU is hidden. ``attempt`` tells the training program which attempt
    it is (``FRENZY_INJECT_OOM_AT_STEP`` fires on the first only). ``main_address``: node 0's
    address in a multi-node launch (``devices`` are then this node's own): the rendezvous store
    listens there, and on loopback only when node 0 is this machine's loopback.
    """
    env = dict(os.environ if base is None else base)
    for name in RANK_ENV_WITHHELD:
        env.pop(name, None)
    env["CUDA_VISIBLE_DEVICES"] = "" if cpu else ",".join(str(d) for d in devices)
    env["FRENZY_ATTEMPT"] = str(attempt)
    env["FRENZY_PARENT_PID"] = str(os.getpid())   # ranks stop if this process dies hard
    env["PYTHONUNBUFFERED"] = "1"
    # The training program is run as `-m trainer.train`: the repo root must be importable even
    # when the project is not installed (the GPU check runs it straight from a checkout).
    paths = [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["HF_HUB_OFFLINE"] = "1"           # never reach a hub from a training run
    env["TRANSFORMERS_OFFLINE"] = "1"
    if not cpu:
        # Expandable segments keep the caching allocator's slack small and steady (torchtitan
        # launches the same way); the estimator's reserved/device-used terms assume a steady
        # slack, which the default allocator's 0.3-28% spread between runs on the H200 is not.
        env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if cpu:
        env.setdefault("OMP_NUM_THREADS", "1")
        if deepspeed:
            env["DS_ACCELERATOR"] = "cpu"
        else:
            # Accelerate's multi-process launcher only picks gloo-on-CPU when told so by env:
            # `use_cpu` in a config file does not reach the ranks (verified, accelerate 1.15).
            env["ACCELERATE_USE_CPU"] = "true"
    if main_address is not None:
        # several nodes: every node dials node 0's published address; node 0's store listens
        # there only (trainer.bound_launch); gloo and NCCL pick the interface that routes to it
        env["MASTER_ADDR"] = main_address
        env["FRENZY_C10D_BIND"] = main_address
        if main_address == LOOPBACK:          # nodes standing in on one machine
            env["GLOO_SOCKET_IFNAME"] = LOOPBACK_IFNAME
            env["NCCL_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    elif all(":" not in str(d) for d in devices):
        # One node ("<node>:<index>" devices span several): the rendezvous store, gloo and NCCL's
        # bootstrap stay on loopback, reachable from no other host (trainer.bound_launch).
        env["MASTER_ADDR"] = LOOPBACK
        env["FRENZY_C10D_BIND"] = LOOPBACK
        env["GLOO_SOCKET_IFNAME"] = LOOPBACK_IFNAME
        env["NCCL_SOCKET_IFNAME"] = LOOPBACK_IFNAME
    if extra:
        env.update(extra)
    return env


def extensions_dir() -> Path:
    """Where DeepSpeed's JIT ops are built and kept, so reruns and CI find them: one folder per
    machine and Python environment. Per machine: a shared home directory must not share it
    (``trainer.op_builds`` tells a stale build lock by its holder, which it sees on this machine
    only). Per environment: torch rebuilds an op whose build flags changed, and they hold the
    environment's own include paths, so two environments (two checkouts' ``.venv``) sharing a
    folder rebuilt the ops (~75 s on 2 cores) every time the other had run."""
    prefix = os.path.realpath(sys.prefix)
    env_id = f"{Path(prefix).name}-{hashlib.sha1(prefix.encode()).hexdigest()[:10]}"
    return Path.home() / ".cache" / "frenzy" / "torch_extensions" / socket.gethostname() / env_id


def kill_tree(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the child's group and every descendant, wait ``grace_s``, then SIGKILL the rest."""
    tree = []
    if proc.poll() is None:       # reaped already, its pid may be another process's: its group only
        try:
            parent = psutil.Process(proc.pid)
            tree = [parent] + parent.children(recursive=True)   # collected before any signal
        except psutil.NoSuchProcess:
            pass
    # The child leads a session of its own (start_new_session): its group id is its pid, which the
    # kernel gives no new process while a member of the group lives.
    pgids = {proc.pid}
    for p in tree:
        try:
            pgids.add(os.getpgid(p.pid))
        except (ProcessLookupError, PermissionError):
            pass
    # never this process's own group (a child started without a session of its own shares it,
    # and with it this process, its parent and their other children): its tree is signalled
    # one process at a time below
    pgids.discard(os.getpgrp())

    def signal_all(sig: int) -> None:
        for pg in pgids:
            try:
                os.killpg(pg, sig)
            except (ProcessLookupError, PermissionError):
                pass
        for p in tree:
            try:
                p.send_signal(sig)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    term_then_kill(tree, grace_s, send=signal_all)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def term_then_kill(procs: list[psutil.Process], grace_s: float,
                   send: Callable[[int], None] | None = None) -> None:
    """SIGTERM ``procs``, wait ``grace_s``, SIGKILL those left and wait for them (10 s).
    ``send(sig)``: how to signal (e.g. their process groups too); default each process."""
    def each(sig: int) -> None:
        for p in procs:
            try:
                p.send_signal(sig)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    send = send or each
    send(signal.SIGTERM)
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    if alive:
        send(signal.SIGKILL)
        psutil.wait_procs(alive, timeout=10)


def live_launches() -> list[subprocess.Popen]:
    return [p for p in list(_LIVE.values()) if p.poll() is None]


@contextmanager
def stopped_with_launches(proc: subprocess.Popen) -> Iterator[None]:
    """While inside, ``kill_all`` stops ``proc`` (a child started in a session of its own) as it
    stops the launches: a process the launcher did not start but the run waits on."""
    _LIVE[proc.pid] = proc
    try:
        yield
    finally:
        _LIVE.pop(proc.pid, None)


def kill_all(grace_s: float) -> int:
    """Stop every launch of this process (each whole tree, as ``kill_tree``); returns how many
    were running. Safe from any thread: the waiting caller sees its child exit."""
    procs = live_launches()
    threads = [threading.Thread(target=kill_tree, args=(p, grace_s), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(grace_s + 25)
    return len(procs)


def run_process_group(cmd: list[str], env: Mapping[str, str] | None, deadline_s: float | None,
                      on_line: Callable[[str], None] | None = None, grace_s: float = 30.0,
                      cwd: str | os.PathLike | None = None) -> tuple[int | None, bool, list[str]]:
    """Run ``cmd`` (an argument list, never a shell string) in a new session.

    Every output line (stdout and stderr merged) goes to ``on_line`` as it arrives. Returns
    ``(returncode or None when the deadline passed, oom_seen, last lines)``. On timeout, on an
    exception in the caller's thread or a KeyboardInterrupt the whole process tree is killed
    (SIGTERM, ``grace_s``, SIGKILL) before this returns or re-raises.
    """
    if isinstance(cmd, (str, bytes)):
        raise TypeError("cmd must be a list of arguments, not a shell string")
    proc = subprocess.Popen(list(cmd), env=dict(env) if env is not None else None, cwd=cwd,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", bufsize=1, start_new_session=True)
    _LIVE[proc.pid] = proc
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    oom = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            tail.append(line)
            if any(m in line for m in OOM_MARKERS):
                oom.set()
            if on_line is not None:
                try:
                    on_line(line)
                except Exception:  # a broken logger must not stall the pipe (the child would block)
                    pass

    reader = threading.Thread(target=pump, name="frenzy-launch-reader", daemon=True)
    reader.start()
    rc: int | None = None
    seen: dict[int, float] = {}     # the launcher's descendants met so far: pid -> start time
    try:
        end = None if deadline_s is None else time.monotonic() + deadline_s
        while True:  # short waits so a KeyboardInterrupt reaches us promptly in the main thread
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                rc = None
                break
            try:
                rc = proc.wait(timeout=1.0 if left is None else min(1.0, left))
                break
            except subprocess.TimeoutExpired:
                _note_descendants(proc, seen)
                continue
    finally:
        if proc.poll() is None:
            kill_tree(proc, grace_s)
        else:
            stop_orphans(seen, grace_s)
        _LIVE.pop(proc.pid, None)
        reader.join(10)
    return rc, oom.is_set(), list(tail)


def _note_descendants(proc: subprocess.Popen, seen: dict[int, float]) -> None:
    """Add the launcher's live descendants (the ranks) to ``seen`` with their start times."""
    try:
        for p in psutil.Process(proc.pid).children(recursive=True):
            if p.pid not in seen:
                try:
                    seen[p.pid] = p.create_time()
                except psutil.NoSuchProcess:
                    pass
    except psutil.NoSuchProcess:
        pass


def stop_orphans(seen: dict[int, float], grace_s: float) -> int:
    """SIGTERM, then after ``grace_s`` SIGKILL, the processes of ``seen`` (pid -> start time)
    still running: the ranks of a launcher that died on its own (the OOM killer, a stray kill).
    They lead sessions of their own and watch only this process, so they trained on, holding
    the GPUs the next attempt was given. A pid now another process's (its start time differs)
    is left alone. Returns how many were running."""
    alive = []
    for pid, started in seen.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.NoSuchProcess:
            pass
    term_then_kill(alive, grace_s)
    return len(alive)
