"""End to end on a real Prefect server.

`prefect server start` on loopback (SQLite, or a fresh PostgreSQL database when
FRENZY_TEST_POSTGRES_URL is set) -> `frenzy pools sync` -> `prefect deploy` of frenzy-submit onto
the cpu pool -> a frenzy-submit run that a `prefect worker start --pool cpu --run-once` picks up;
it places the job and dispatches the training to the pool's frenzy-train-cpu deployment, which
a second `--run-once` worker runs: the tiny model really trains. Server and workers are stopped
at the end whatever happens.

Talks to the server over plain HTTP so it never mixes with the session test server.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from trainer.ports import free_port

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}

pytestmark = [pytest.mark.slow]

TINY_JOB = {"name": "e2e-tiny", "model": "gpt2-tiny", "seq_len": 32, "global_batch": 4, "train_steps": 4,
            "precision": "fp32", "lr": 0.003, "checkpoint_every": 2, "data": {"kind": "synthetic"}}


def _stop(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL: workers ignore SIGTERM while the API is up."""
    if proc is None or proc.poll() is not None:
        return
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


@pytest.fixture
def postgres_database():
    """A throwaway database for the Prefect server when PostgreSQL is configured, else None."""
    base = os.environ.get("FRENZY_TEST_POSTGRES_URL")
    if not base:
        yield None
        return
    import psycopg
    from sqlalchemy.engine import make_url

    url = make_url(base)
    name = f"frenzy_e2e_{uuid.uuid4().hex[:8]}"
    admin = url.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield url.set(drivername="postgresql+asyncpg", database=name).render_as_string(hide_password=False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_submit_lands_on_the_cpu_pool_and_trains_through_workers(tmp_path, postgres_database):
    import httpx

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_API_URL=api, FRENZY_HOME=str(tmp_path / "frenzy"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_WORKER_QUERY_SECONDS="1",
               PREFECT_WORKER_PREFETCH_SECONDS="5", PREFECT_LOGGING_LEVEL="INFO")
    env.pop("FRENZY_LEDGER_URL", None)
    if postgres_database:
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = postgres_database
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")
    logs = tmp_path / "logs"
    logs.mkdir()

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen:
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(logs / f"{name}.log", "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def tail(name: str) -> str:
        p = logs / f"{name}.log"
        return f"--- {name} ---\n" + (p.read_text()[-4000:] if p.exists() else "(no log)")

    server = worker1 = worker2 = None
    http = httpx.Client(base_url=api, timeout=30)
    try:
        server = spawn("server", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                  "--port", str(port), "--no-ui"])
        deadline = time.monotonic() + 120
        while True:
            try:
                if http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, tail("server")
            time.sleep(0.5)
        # the blocks arrive through the prefect.collections entry point, before anything saved them
        for slug in ("gpu-cluster", "frenzy-settings"):
            assert http.get(f"/block_types/slug/{slug}").status_code == 200, slug

        sync = subprocess.run([sys.executable, "-m", "frenzy_cli.main", "pools", "sync", "--cluster", str(cluster)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert sync.returncode == 0, sync.stdout + sync.stderr
        deploy = subprocess.run([str(BIN / "prefect"), "--no-prompt", "deploy", "--name", "frenzy-submit",
                                 "--pool", "cpu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert deploy.returncode == 0, deploy.stdout[-3000:] + deploy.stderr[-3000:]

        sub_dep = http.get("/deployments/name/frenzy-submit/frenzy-submit").json()
        train_dep = http.get("/deployments/name/frenzy-train/frenzy-train-cpu").json()
        assert sub_dep["work_pool_name"] == "cpu" and train_dep["work_pool_name"] == "cpu"
        r = http.post(f"/deployments/{sub_dep['id']}/create_flow_run",
                      json={"parameters": {"job": TINY_JOB, "cluster": str(cluster)}})
        assert r.status_code == 201, r.text
        submit_id = r.json()["id"]

        worker1 = spawn("worker1", [str(BIN / "prefect"), "worker", "start", "--pool", "cpu", "--run-once"])

        def train_runs() -> list[dict]:
            return http.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [train_dep["id"]]}}}).json()

        def state(run_id: str) -> str:
            return (http.get(f"/flow_runs/{run_id}").json().get("state") or {}).get("type", "")

        # the submit run dispatches the training to the pool; a second one-shot worker takes it
        deadline = time.monotonic() + 150
        while not train_runs():
            assert state(submit_id) not in FINAL, tail("worker1")
            assert time.monotonic() < deadline, tail("worker1")
            time.sleep(1)
        worker2 = spawn("worker2", [str(BIN / "prefect"), "worker", "start", "--pool", "cpu", "--run-once"])
        while state(submit_id) not in FINAL:
            assert time.monotonic() < deadline, tail("worker1") + tail("worker2")
            time.sleep(1)
        [train] = train_runs()
        assert state(submit_id) == "COMPLETED", tail("worker1") + tail("worker2")
        assert train["state"]["type"] == "COMPLETED"

        # the training run got its devices from the pool template's job variables
        assert train["job_variables"]["gpu_type"] == "CPU"
        assert train["job_variables"]["num_processes"] >= 1
        assert train["parameters"]["job"]["name"] == "e2e-tiny"
        w2 = (logs / "worker2.log").read_text()
        assert "FRENZY_STEP" in w2 or "loss" in w2, tail("worker2")

        # what the UI shows: the plan table on the submit run, progress on the training run
        arts = http.post("/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [submit_id, train["id"]]}}}).json()
        by_key = {(a["key"], a["flow_run_id"]): a for a in arts}
        assert ("frenzy-plans", submit_id) in by_key and ("frenzy-summary", submit_id) in by_key
        assert float(by_key[("frenzy-progress", train["id"])]["data"]) == 100.0
        # GPU slots are all back
        gcl = http.get("/v2/concurrency_limits/gpu:cpu").json()
        assert gcl["limit"] == 2 and gcl["active_slots"] == 0
        placed = http.post("/events/filter", json={"filter": {"event": {"name": ["frenzy.job.placed"]}}, "limit": 50}).json()
        assert any(e["resource"]["prefect.resource.name"] == "e2e-tiny" for e in placed["events"])
        if postgres_database:     # the server really kept its state in PostgreSQL
            import psycopg
            from sqlalchemy.engine import make_url

            pg = make_url(postgres_database).set(drivername="postgresql").render_as_string(hide_password=False)
            with psycopg.connect(pg) as conn:
                assert conn.execute("SELECT count(*) FROM flow_run").fetchone()[0] == 2
    finally:
        http.close()
        _stop(worker2)
        _stop(worker1)
        _stop(server, grace=20)
    for p in (worker1, worker2, server):
        assert p is None or p.poll() is not None
