"""Shared fixtures. Pure tests need nothing; flow tests ask for the one Prefect server:

    pytestmark = pytest.mark.usefixtures("prefect_server")

Starting a Prefect test server costs 12-25 s on 2 cores (migrations), so there is exactly one
per pytest session, created lazily by the first test that asks for it (one per test process
under ``pytest -n 2``). Tests that share something outside their process (the DeepSpeed
extension folder, a PostgreSQL database) keep what they change in a copy, a schema or a
database of their own.
"""
from __future__ import annotations

import os
import subprocess
import tempfile
from contextlib import ExitStack
from typing import Any

import pytest

# Isolate Prefect and Frenzy state before anything imports prefect.
_HOME = tempfile.mkdtemp(prefix="frenzy-test-home-")
# Each test process (pytest-xdist worker) its own homes, also inside homes the caller set (CI
# sets both): a shared FRENZY_HOME would share the default ledger, and with it the embedded
# schedulers' leadership, between processes.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    for _name in ("PREFECT_HOME", "FRENZY_HOME"):
        if os.environ.get(_name):
            os.environ[_name] = os.path.join(os.environ[_name], _WORKER)
            os.makedirs(os.environ[_name], exist_ok=True)
os.environ.setdefault("PREFECT_HOME", os.path.join(_HOME, "prefect"))
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
os.environ.setdefault("FRENZY_HOME", os.path.join(_HOME, "frenzy"))
# One MLflow store for the session, never a developer's tracking server. A run's default store is
# a new SQLite file under its FRENZY_HOME (trainer.tracking), and most tests give each run a home
# of its own: creating that file (MLflow's schema migrations) took 4.1 s on 2 cores per run, an
# existing one 0.01 s. The test of the default location runs `frenzy run` without this variable.
os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{os.path.join(_HOME, 'mlflow.db')}"
# Tests write their data sets into pytest's temporary folders: a configured data root
# (trainer.allowlist), as a site's shared data folder would be.
os.environ.setdefault("FRENZY_DATA_ROOTS", tempfile.gettempdir())


# What befell the Prefect test server, for the run's summary: xdist workers append lines to one
# file the controlling process names (its environment reaches the workers it starts). The
# server's own output goes to a log of this process (it would land in some test's captured
# output, dropped when that test passes), whose tail is shown when it dies.
_EVENTS_VAR = "FRENZY_TEST_SERVER_EVENTS"
_SERVER_LOG = os.path.join(_HOME, "prefect-test-server.log")
_harness: dict[str, Any] = {}         # "stack": the live harness; "wanted": the session asked for one


def _uptime_s() -> float | None:
    try:
        with open("/proc/uptime") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


_SESSION_UPTIME_S = _uptime_s()        # the kernel log's clock when this process started


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[_EVENTS_VAR] = os.path.join(_HOME, "server-events.txt")   # this run's own


def _server_event(line: str) -> None:
    with open(os.environ.get(_EVENTS_VAR) or os.path.join(_HOME, "server-events.txt"), "a") as f:
        f.write(f"[{_WORKER or 'main'}] {line}\n")


def _kernel_kills() -> list[str]:
    """The kernel's lines about killed processes (the OOM killer) since this run began, where its
    log may be read."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    kills = []
    for line in out.splitlines():
        if "Killed process" not in line and "Out of memory" not in line:
            continue
        try:
            at = float(line.split("]", 1)[0].lstrip("[ "))
        except ValueError:
            at = None
        if at is None or _SESSION_UPTIME_S is None or at >= _SESSION_UPTIME_S:
            kills.append(line)
    return kills[-5:]


def pytest_terminal_summary(terminalreporter):
    path = os.environ.get(_EVENTS_VAR)
    if path and os.path.exists(path):
        terminalreporter.section("Prefect test server")
        for line in open(path).read().splitlines() + _kernel_kills():
            terminalreporter.write_line(line)


def _start_harness() -> None:
    """One ``prefect_test_harness`` (server, database, settings), its server's stdout and stderr
    (inherited at its start) pointed at ``_SERVER_LOG``."""
    import sys

    from prefect.testing.utilities import prefect_test_harness

    _harness["wanted"] = True
    stack = ExitStack()
    log = os.open(_SERVER_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    saved = os.dup(1), os.dup(2)
    sys.stdout.flush(), sys.stderr.flush()
    try:
        os.dup2(log, 1), os.dup2(log, 2)
        stack.enter_context(prefect_test_harness(server_startup_timeout=120))
    except BaseException:
        stack.close()
        raise
    finally:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        for fd in (*saved, log):
            os.close(fd)
    _harness["stack"] = stack


def _dead_server() -> str | None:
    """How the harness's server is gone (exited, or stopped through its object), or None."""
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer._instances.get(None)     # the harness registers its server here
    proc = getattr(server, "server_process", None)
    if proc is None:
        return "was stopped (no server process)"
    if proc.poll() is not None:
        return f"(pid {proc.pid}) exited with code {proc.returncode}"
    return None


def _close_harness(dead: bool) -> None:
    """Close the harness; a dead server's without draining Prefect's log and event workers into
    it (they retried it for 2+ minutes: what they hold is dropped)."""
    import prefect.testing.utilities as harness_module

    stack = _harness.pop("stack", None)
    if stack is None:
        return
    drain = harness_module.run_coro_as_sync
    if dead:
        harness_module.run_coro_as_sync = lambda coro, *a, **kw: coro.close()
    try:
        stack.close()
    except Exception as err:
        _server_event(f"closing the harness: {type(err).__name__}: {err}")
    finally:
        harness_module.run_coro_as_sync = drain


def _log_tail(lines: int = 20) -> list[str]:
    try:
        with open(_SERVER_LOG, errors="replace") as f:
            return ["    " + line for line in f.read().splitlines()[-lines:]]
    except OSError:
        return []


@pytest.fixture(scope="session")
def prefect_server():
    _start_harness()
    yield
    _close_harness(dead=_dead_server() is not None)


@pytest.fixture(autouse=True)
def _prefect_server_alive(request):
    """The session's server died (it has: every later flow test of that process then failed on a
    dead or reused port): say so with its exit code and the tail of its output, in the run's
    summary, and start a new one (a new database: what earlier tests registered is gone, and a
    module's fixtures keep what they made on the old one), so one death costs few tests."""
    uses = "prefect_server" in request.fixturenames and _harness.get("wanted")
    if uses:
        how = _dead_server() if "stack" in _harness else "did not start again"
        if how is not None:
            _server_event(f"the server {how} before {request.node.nodeid}; starting a new one")
            for line in _log_tail():
                _server_event(line)
            _close_harness(dead=True)
            try:
                _start_harness()
            except Exception as err:
                _server_event(f"the new server did not start: {type(err).__name__}: {err}")
                raise
    yield
    if uses and "stack" in _harness:
        how = _dead_server()
        if how is not None:
            _server_event(f"the server {how} during {request.node.nodeid}")


@pytest.fixture
def postgres_url():
    url = os.environ.get("FRENZY_TEST_POSTGRES_URL")
    if not url:
        pytest.skip("FRENZY_TEST_POSTGRES_URL is not set: PostgreSQL tests need a server")
    return url


@pytest.fixture
def frenzy_home(tmp_path, monkeypatch):
    """A private FRENZY_HOME (ledger, runs, calibration) for one test."""
    monkeypatch.setenv("FRENZY_HOME", str(tmp_path / "frenzy"))
    return tmp_path / "frenzy"


@pytest.fixture(autouse=True)
def _no_embedded_scheduler_left():
    """A flow run in this process starts an embedded scheduler thread that outlives the test; stop
    it after each test: a later test that forks (the 50-process ledger test) would otherwise copy a
    lock that thread holds and hang, and the next test's ledger would have a stray scheduler."""
    yield
    import sys

    service = sys.modules.get("frenzy_scheduler.service")
    if service is not None:
        service.stop_embedded_schedulers()
