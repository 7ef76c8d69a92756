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
import tempfile

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


@pytest.fixture(scope="session")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


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
