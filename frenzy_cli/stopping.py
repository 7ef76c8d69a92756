"""How `frenzy run` stops: on SIGINT/SIGTERM, on the death of its embedded Prefect server, and
when it is killed outright.

* The embedded server (Prefect's ephemeral ``SubprocessASGIServer``) is started here, from the
  main thread, before any flow runs, in a session of its own (a Ctrl-C at the terminal reaches
  the whole foreground process group: the server would die first and the run would then retry
  the dead server for minutes) and with the kernel's parent-death signal (PR_SET_PDEATHSIG), so
  a ``kill -9`` of `frenzy run` takes the server down with it. The hook only calls a libc
  function resolved before the fork, from a process that has not started any flow yet.
* The first SIGINT/SIGTERM asks every training of this process to stop at its next step
  boundary with a checkpoint (``trainer.interrupt``); the flow then ends normally, the ledger
  releases the GPUs, and the CLI exits 130/143 with one line. When nothing is training, the
  signal interrupts the main thread (KeyboardInterrupt), which unwinds through the flow's
  ``finally`` blocks. A watchdog bounds it: after ``KILL_AFTER_S`` the launches are killed (the
  runner then neither retries nor falls back and releases), after ``EXIT_AFTER_S`` the process
  stops the server and exits whatever it was doing (the ledger's lease TTL frees what is left).
  A second signal skips to the kill.
* The embedded server exiting on its own stops the run the same way (exit status 1).
* The embedded server's own output (uvicorn's and the database layer's messages, among them the
  tracebacks its shutdown may log for requests it cancels) goes to ``embedded-server.log`` in
  ``PREFECT_HOME``, not to the terminal of the run; a failed start and a server that exits on
  its own name the file.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

# The bound for the whole stop is 30 s. A graceful stop needs the step under way plus
# a checkpoint save: a few seconds for the CPU and the small GPU jobs measured here, so 15 s
# leaves a 3x margin before the ranks are killed; the kill itself waits up to 5 s (SIGTERM
# grace, then SIGKILL); the last resort at 27 s leaves 3 s for the exit.
KILL_AFTER_S = 15.0
KILL_GRACE_S = 5.0
EXIT_AFTER_S = 27.0
# The embedded server's liveness is polled this often: the run stops within one poll of its death.
SERVER_POLL_S = 1.0

PR_SET_PDEATHSIG = 1          # <linux/prctl.h>
SERVER_LOG = "embedded-server.log"
SERVER_LOG_MAX_BYTES = 8 << 20  # a longer log is started afresh at the next server start

_prctl = None
if sys.platform.startswith("linux"):
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl     # resolved before any fork
    except (OSError, AttributeError):
        _prctl = None


def _die_with_parent() -> None:            # preexec hook: runs in the child between fork and exec
    if _prctl is not None:
        _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


_CLASS: list = []          # the server class, built on first use (prefect imports late)


def guarded_server_class():
    if _CLASS:
        return _CLASS[0]
    from prefect.server.api.server import SubprocessASGIServer

    class GuardedServer(SubprocessASGIServer):
        """Prefect's ephemeral server process, in its own session, dying with its parent."""

        def _run_uvicorn_command(self) -> subprocess.Popen:
            import prefect
            from prefect.settings import get_current_settings

            # the same command and environment as Prefect's own (prefect 3.9 server.py); its
            # output to the log file (the child keeps its own descriptor of it)
            with open_server_log() as log:
                return subprocess.Popen(
                    args=[sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent),
                          "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1",
                          "--port", str(self.port), "--log-level", "error", "--lifespan", "on"],
                    env={**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                         "PREFECT__SERVER_FINAL": "1",
                         **get_current_settings().to_environment_variables(exclude_unset=True)},
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=_die_with_parent)

    _CLASS.append(GuardedServer)
    return GuardedServer


def server_log_path() -> Path:
    from prefect.settings import get_current_settings

    return Path(get_current_settings().home) / SERVER_LOG


def open_server_log():
    """The embedded server's log, opened for the server process to append to (started afresh
    when it has grown past ``SERVER_LOG_MAX_BYTES``), with a line marking this start."""
    path = server_log_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    big = path.exists() and path.stat().st_size > SERVER_LOG_MAX_BYTES
    log = open(path, "w" if big else "a", encoding="utf-8")
    log.write(f"--- embedded Prefect server started by pid {os.getpid()} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    log.flush()
    return log


def server_log_tail(lines: int = 15) -> str:
    """The last ``lines`` lines of the embedded server's log ('' when there is none)."""
    try:
        return "\n".join(server_log_path().read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_embedded_server():
    """Start Prefect's ephemeral server for this process (when no ``PREFECT_API_URL`` is set and
    the ephemeral server is enabled), guarded as the module docstring says; returns it or None.
    Every Prefect client of this process then finds this instance (Prefect keeps one per port
    in a dict its subclasses share, and a client asks for the one of no fixed port)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    cls = guarded_server_class()
    existing = SubprocessASGIServer._instances.get(None)
    if existing is not None and not isinstance(existing, cls):
        return None               # someone started Prefect's own already: leave it alone
    server = cls()
    try:
        server.start()
    except RuntimeError as err:        # did not come up: what it said is in its log
        raise RuntimeError(f"{err} (its log, {server_log_path()}, ends:\n{server_log_tail()})") from err
    return server


def server_pid(server) -> int | None:
    proc = getattr(server, "server_process", None)
    return proc.pid if proc is not None else None


class Stopper:
    """The signal handlers and watchdogs of one `frenzy run` (see the module docstring)."""

    def __init__(self, server=None, *, out=sys.stderr):
        self.server = server
        self.out = out
        self.signum: int | None = None
        self.reason: str | None = None
        self.exit_code: int | None = None
        self._watch = None
        self._previous: dict[int, object] = {}
        self._done = threading.Event()
        self._server_dead = False

    # ------------------------------------------------------------ setup
    def install(self) -> "Stopper":
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        self._own_prefect_bridge(self._on_signal)
        return self

    def _own_prefect_bridge(self, handler) -> None:
        """Prefect's flow engine swaps SIGTERM for its own handler while a flow runs; that one
        raises TerminationSignal, the run crashes and the training is killed without its stop
        checkpoint. No Prefect runner sends cancellation SIGTERMs to `frenzy run`, so the bridge
        it installs is pointed at this handler (Prefect installs whatever that module-level
        name holds, and compares against it)."""
        try:
            import prefect.utilities.engine as engine
        except ImportError:
            return
        if hasattr(engine, "_prefect_sigterm_handler"):
            self._previous.setdefault("prefect", engine._prefect_sigterm_handler)
            engine._prefect_sigterm_handler = handler

    def watch_server(self) -> None:
        threading.Thread(target=self._watch_server, name="frenzy-server-watch", daemon=True).start()

    def uninstall(self) -> None:
        """Restore the handlers and stop watching the server (it is stopped at exit); a stop
        already under way keeps its watchdog to the end of the process."""
        self._done.set()
        for sig, handler in self._previous.items():
            if sig == "prefect":
                import prefect.utilities.engine as engine

                engine._prefect_sigterm_handler = handler
                continue
            try:
                signal.signal(sig, handler)
            except (TypeError, ValueError):
                pass
        self._previous.clear()

    def say(self, line: str) -> None:
        try:
            print(f"frenzy run: {line}", file=self.out, flush=True)
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------ triggers
    def _begin(self, reason: str, code: int) -> bool:
        """Record the first stop; returns whether this call was the first."""
        if self.reason is not None:
            return False
        self.reason, self.exit_code = reason, code
        from trainer import interrupt

        interrupt.request(reason)
        self._watch = threading.Thread(target=self._watchdog, name="frenzy-stop-watchdog", daemon=True)
        self._watch.start()
        return True

    def _on_signal(self, signum, frame) -> None:
        from trainer import interrupt

        name = signal.Signals(signum).name
        if self.signum is not None:                 # a second signal: kill the launches now
            self.say(f"{name} again: killing the training processes")
            threading.Thread(target=self._kill, daemon=True).start()
            return
        self.signum = signum
        training = bool(interrupt.active_runs())
        self._begin(name, 128 + signum)
        if training:
            self.say(f"{name}: stopping the training at its next step boundary (checkpoint), "
                     f"then exiting; at most {EXIT_AFTER_S:.0f} s")
            return
        self.say(f"{name}: stopping")
        raise KeyboardInterrupt(name)

    def _watch_server(self) -> None:
        proc = self.server.server_process if self.server is not None else None
        while proc is not None and not self._done.wait(SERVER_POLL_S):
            rc = proc.poll()
            if rc is not None and not self._done.is_set():
                self.say(f"the embedded Prefect server exited ({rc}; its log: {server_log_path()}): "
                         f"stopping the training with a checkpoint and exiting")
                self._server_dead = True
                self._begin("the embedded Prefect server exited", 1)
                return

    # ------------------------------------------------------------ escalation
    def _kill(self) -> None:
        from trainer.launcher import kill_all

        kill_all(KILL_GRACE_S)

    def _watchdog(self) -> None:
        from trainer import interrupt
        from trainer.launcher import live_launches

        t0 = time.monotonic()
        killed = False
        while True:             # to the end of the process: an exit that hangs is bounded too
            time.sleep(0.25)
            server_dead = self._server_dead
            elapsed = time.monotonic() - t0
            if server_dead and not interrupt.active_runs() and not live_launches():
                # the training has released its GPUs; the flow engine would now retry the
                # dead server for minutes
                self._exit("the embedded Prefect server exited; training stopped")
            if elapsed >= KILL_AFTER_S and not killed:
                killed = True
                if live_launches():
                    self.say(f"the training did not stop within {KILL_AFTER_S:.0f} s: killing it")
                    self._kill()
            if elapsed >= EXIT_AFTER_S:
                self._exit(f"{self.reason}: not finished within {EXIT_AFTER_S:.0f} s, exiting "
                           f"(the ledger's lease expiry frees what is still held)")

    def _exit(self, line: str) -> None:
        from trainer.launcher import kill_all

        kill_all(KILL_GRACE_S)
        stop_server(self.server, drain_s=None)          # the bound is near: no flush
        self.say(line)
        os._exit(self.exit_code or 1)


# Prefect's log and event workers send what they still hold at interpreter exit; with the server
# already stopped they retry it until the watchdog's EXIT_AFTER_S (measured: every stopped run
# exited on the 27 s bound, ~23 s after its last line). Flushed first, each within this bound
# (Prefect's own flush of its log worker waits 5 s), so the stop stays under 30 s.
DRAIN_S = 5.0


def drain_prefect_workers(timeout_s: float = DRAIN_S) -> None:
    """Send what Prefect's log and event workers still hold while the server is up."""
    for module, name in (("prefect.logging.handlers", "APILogWorker"), ("prefect.events.worker", "EventsWorker")):
        worker = getattr(sys.modules.get(module), name, None)
        if worker is None:
            continue
        try:
            worker.drain_all(timeout=timeout_s)
        except Exception:
            pass


def stop_server(server, drain_s: float | None = DRAIN_S) -> None:
    """Stop the embedded server, first flushing Prefect's workers to it (within ``drain_s``; None:
    not at all, for the watchdog's last resort) while it is still alive."""
    if server is None or server.server_process is None:
        return
    if drain_s and server.server_process.poll() is None:
        drain_prefect_workers(drain_s)
    try:
        server.stop()
    except Exception:
        pass
