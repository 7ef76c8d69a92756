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
# file the controlling process names (its environment reaches the workers it starts).
_EVENTS_VAR = "FRENZY_TEST_SERVER_EVENTS"
_harness: dict[str, ExitStack] = {}


def pytest_configure(config):
    if not os.environ.get("PYTEST_XDIST_WORKER") and not os.environ.get(_EVENTS_VAR):
        os.environ[_EVENTS_VAR] = os.path.join(_HOME, "server-events.txt")


def _server_event(line: str) -> None:
    with open(os.environ.get(_EVENTS_VAR) or os.path.join(_HOME, "server-events.txt"), "a") as f:
        f.write(f"[{_WORKER or 'main'}] {line}\n")


def _kernel_kills() -> list[str]:
    """The kernel's log lines about killed processes (the OOM killer), where it may be read."""
    try:
        out = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line for line in out.splitlines() if "Killed process" in line or "Out of memory" in line][-5:]


def pytest_terminal_summary(terminalreporter):
    path = os.environ.get(_EVENTS_VAR)
    if path and os.path.exists(path):
        terminalreporter.section("Prefect test server")
        for line in open(path).read().splitlines() + _kernel_kills():
            terminalreporter.write_line(line)


def _start_harness() -> None:
    from prefect.testing.utilities import prefect_test_harness

    stack = ExitStack()
    stack.enter_context(prefect_test_harness(server_startup_timeout=120))
    _harness["stack"] = stack


def _harness_process():
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer._instances.get(None)     # the harness registers its server here
    return server.server_process if server is not None else None


@pytest.fixture(scope="session")
def prefect_server():
    _start_harness()
    yield
    _harness.pop("stack").close()


@pytest.fixture(autouse=True)
def _prefect_server_alive(request):
    """The session's server died (it has: every later flow test of that process then failed on a
    dead or reused port): say so with its exit code, in the run's summary, and start a new one
    (a new database: what earlier tests registered is gone), so one death costs one test."""
    if "prefect_server" in request.fixturenames and "stack" in _harness:
        proc = _harness_process()
        if proc is not None and proc.poll() is not None:
            _server_event(f"the server (pid {proc.pid}) exited with code {proc.returncode} "
                          f"before {request.node.nodeid}; started a new one")
            try:
                _harness.pop("stack").close()
            except Exception as err:                        # its teardown talks to the dead server
                _server_event(f"closing the dead server's harness: {type(err).__name__}: {err}")
            _start_harness()
    yield
    if "prefect_server" in request.fixturenames and "stack" in _harness:
        proc = _harness_process()
        if proc is not None and proc.poll() is not None:
            _server_event(f"the server (pid {proc.pid}) exited with code {proc.returncode} "
                          f"during {request.node.nodeid}")


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
