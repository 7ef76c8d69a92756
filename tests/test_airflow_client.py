"""frenzy_airflow: trigger a deployment over Prefect's REST API with an idempotency key (a retry
never starts a second run), wait for the final state; never imports prefect.

The HTTP side runs against the session Prefect server. Airflow itself cannot be installed next
to Prefect, so the operator test here gives it a two-class stand-in for Airflow's base classes and
exercises the operator's own logic (key per task instance, XCom id, waiting) in seconds; the
real Airflow, in its own environment, runs the example DAG in tests/test_airflow_dag.py."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import types
import uuid
from pathlib import Path

import pytest

from frenzy_airflow import client as af

ROOT = Path(__file__).resolve().parent.parent
JOB = {"name": "af", "model": "gpt2-tiny", "seq_len": 16, "global_batch": 2, "train_steps": 1}
PLAN = {"gpu_type": "CPU", "gpus": 1}


def test_the_airflow_side_never_imports_prefect():
    code = ("import sys, frenzy_airflow, frenzy_airflow.client\n"
            "bad = sorted(m for m in sys.modules if m == 'prefect' or m.startswith('prefect.'))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_idempotency_key_is_per_task_instance_not_per_try():
    k = af.idempotency_key("train_llm", "train", "scheduled__2026-01-01T00:00:00+00:00")
    assert k == "airflow:train_llm:train:scheduled__2026-01-01T00:00:00+00:00"
    assert af.idempotency_key("d", "t", "r", map_index=3) == "airflow:d:t:r:3"
    assert af.idempotency_key("d", "t", "r2") != af.idempotency_key("d", "t", "r")


def test_make_client_needs_an_api_url(monkeypatch):
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with pytest.raises(ValueError, match="api_url"):
        af.make_client(None)


# ---------------------------------------------------------------- against the server

@pytest.fixture(scope="module")
def deployment(prefect_server):
    from deployments.pools import sync_pools

    pool = f"af-{uuid.uuid4().hex[:6]}"
    sync_pools({"pools": [{"name": pool, "gpu": "CPU", "nodes": 1, "gpus_per_node": 1}]},
               entrypoint="tests/test_pools_dispatch.py:fake_train", control_pool=False, log=lambda *_: None)
    return f"frenzy-train-standin/frenzy-train-{pool}"


@pytest.fixture
def http(prefect_server):
    from prefect.settings import PREFECT_API_URL

    with af.make_client(PREFECT_API_URL.value()) as c:
        yield c


def _finish_later(http, run_id: str, state: str, after_s: float = 1.0) -> threading.Thread:
    """What a worker does at the end of a run: move it to a final state on the server."""
    def go():
        time.sleep(after_s)
        http.post(f"/flow_runs/{run_id}/set_state",
                  json={"state": {"type": state, "name": state.title(), "message": f"set to {state}"},
                        "force": True})
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _runs_of(http, deployment: str) -> list[dict]:
    dep = af.find_deployment(http, deployment)
    return http.post("/flow_runs/filter", json={"deployments": {"id": {"any_": [dep["id"]]}}}).json()


@pytest.mark.prefect
def test_same_key_same_run_and_wait_returns_the_completed_run(http, deployment):
    key = f"airflow:dag:task:{uuid.uuid4().hex}"
    first = af.trigger(http, deployment, parameters={"job": JOB, "plan": PLAN}, idempotency_key=key,
                       tags=["airflow"])
    again = af.trigger(http, deployment, parameters={"job": JOB, "plan": PLAN}, idempotency_key=key)
    assert again["id"] == first["id"]
    other = af.trigger(http, deployment, parameters={"job": JOB, "plan": PLAN},
                       idempotency_key=key + "-other-run")
    assert other["id"] != first["id"]
    assert {r["idempotency_key"] for r in _runs_of(http, deployment)} >= {key, key + "-other-run"}
    assert sum(r["idempotency_key"] == key for r in _runs_of(http, deployment)) == 1

    _finish_later(http, first["id"], "COMPLETED")
    polls: list[str] = []
    done = af.wait(http, first["id"], poll_s=0.2, timeout_s=30, on_poll=lambda r: polls.append(af.state_type(r)))
    assert af.state_type(done) == "COMPLETED" and polls[0] == "SCHEDULED" and polls[-1] == "COMPLETED"


@pytest.mark.prefect
def test_wait_raises_on_failure_and_on_timeout(http, deployment):
    fr = af.trigger(http, deployment, parameters={"job": JOB, "plan": PLAN}, idempotency_key=uuid.uuid4().hex)
    with pytest.raises(TimeoutError, match="still SCHEDULED"):
        af.wait(http, fr["id"], poll_s=0.2, timeout_s=0.5)
    _finish_later(http, fr["id"], "FAILED", after_s=0.2)
    with pytest.raises(af.FrenzyRunFailed, match="ended FAILED: set to FAILED"):
        af.wait(http, fr["id"], poll_s=0.2, timeout_s=30)


@pytest.mark.prefect
def test_parameters_the_flow_rejects_are_refused_before_a_run(http, deployment):
    before = len(_runs_of(http, deployment))
    with pytest.raises(ValueError, match="parameters: rejected.*plan"):
        af.trigger(http, deployment, parameters={"job": JOB}, idempotency_key=uuid.uuid4().hex)
    with pytest.raises(ValueError, match="no deployment"):
        af.trigger(http, "frenzy-submit/does-not-exist", parameters={})
    assert len(_runs_of(http, deployment)) == before


@pytest.fixture
def operators(monkeypatch):
    """``frenzy_airflow.operators`` over stand-ins for the two Airflow base classes (Airflow
    cannot be installed next to Prefect; tests/test_airflow_dag.py runs the real one)."""
    class BaseOperator:
        def __init__(self, task_id: str, **kw):
            self.task_id = task_id
            self.log = __import__("logging").getLogger(f"airflow.task.{task_id}")

    airflow = types.ModuleType("airflow")
    models = types.ModuleType("airflow.models")
    models.BaseOperator = BaseOperator
    sensors = types.ModuleType("airflow.sensors")
    sensors_base = types.ModuleType("airflow.sensors.base")
    sensors_base.BaseSensorOperator = BaseOperator
    for name, mod in {"airflow": airflow, "airflow.models": models, "airflow.sensors": sensors,
                      "airflow.sensors.base": sensors_base}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delitem(sys.modules, "frenzy_airflow.operators", raising=False)
    import frenzy_airflow.operators
    return frenzy_airflow.operators


@pytest.mark.prefect
def test_operator_retry_reuses_the_first_tries_run(http, deployment, operators):
    FrenzyFlowRunSensor, FrenzySubmitOperator = operators.FrenzyFlowRunSensor, operators.FrenzySubmitOperator

    api = str(http.base_url).rstrip("/")
    run_id = f"manual__{uuid.uuid4().hex}"
    ti = types.SimpleNamespace(dag_id="train_llm", task_id="start", map_index=-1, try_number=1)
    op = FrenzySubmitOperator(task_id="start", job=JOB, parameters={"plan": PLAN}, deployment=deployment,
                              api_url=api, wait=False)
    first = op.execute({"ti": ti, "run_id": run_id})
    ti.try_number = 2                                 # Airflow retries the task
    assert op.execute({"ti": ti, "run_id": run_id}) == first
    assert sum(r["id"] == first for r in _runs_of(http, deployment)) == 1
    fr = af.read_flow_run(http, first)
    assert fr["parameters"] == {"job": JOB, "plan": PLAN} and "dag:train_llm" in fr["tags"]

    sensor = FrenzyFlowRunSensor(task_id="done", flow_run_id=first, api_url=api)
    assert sensor.poke({}) is False
    _finish_later(http, first, "COMPLETED", after_s=0).join()
    assert sensor.poke({}) is True

    waiting = FrenzySubmitOperator(task_id="train", job=JOB, parameters={"plan": PLAN}, deployment=deployment,
                                   api_url=api, wait=True, poll_interval=0.2, wait_timeout=30)
    ti2 = types.SimpleNamespace(dag_id="train_llm", task_id="train", map_index=-1)
    key_run = f"scheduled__{uuid.uuid4().hex}"
    t = threading.Thread(target=lambda: _fail_when_created(http, deployment, af.idempotency_key(
        "train_llm", "train", key_run)), daemon=True)
    t.start()
    with pytest.raises(af.FrenzyRunFailed):
        waiting.execute({"ti": ti2, "run_id": key_run})


@pytest.mark.prefect
def test_a_retry_after_a_failed_run_trains_again_and_a_killed_task_cancels_its_run(http, deployment, operators):
    """A retry found the failed run of the first try and failed with it at once: retries never
    trained again. Now a retry after a failed (crashed, cancelled) run starts one new run, the
    same for every try that finds that failure; a retry after a completed run returns it; and a
    task Airflow kills cancels the run it waits on (the run trained on)."""
    api = str(http.base_url).rstrip("/")
    op = operators.FrenzySubmitOperator(task_id="t", job=JOB, parameters={"plan": PLAN}, deployment=deployment,
                                        api_url=api, wait=False)
    ti = types.SimpleNamespace(dag_id="d", task_id="t", map_index=-1, try_number=1)
    ctx = {"ti": ti, "run_id": f"manual__{uuid.uuid4().hex}"}
    first = op.execute(ctx)
    _finish_later(http, first, "FAILED", after_s=0).join()
    ti.try_number = 2
    second = op.execute(ctx)
    assert second != first and op.execute(ctx) == second                  # one new run per failure
    assert af.read_flow_run(http, second)["idempotency_key"] == af.retry_key(
        af.idempotency_key("d", "t", ctx["run_id"]), first)
    _finish_later(http, second, "COMPLETED", after_s=0).join()
    ti.try_number = 3
    assert op.execute(ctx) == second                                      # done: not trained again

    # Airflow's execution_timeout: its exception leaves execute first, then Airflow calls on_kill
    waiting = operators.FrenzySubmitOperator(task_id="w", job=JOB, parameters={"plan": PLAN}, deployment=deployment,
                                             api_url=api, wait=True, poll_interval=0.2, wait_timeout=0.5)
    wctx = {"ti": types.SimpleNamespace(dag_id="d", task_id="w", map_index=-1), "run_id": ctx["run_id"]}
    with pytest.raises(TimeoutError):
        waiting.execute(wctx)
    run_id = waiting._waiting_on
    assert run_id
    waiting.on_kill()
    assert af.state_type(af.read_flow_run(http, run_id)) in ("CANCELLING", "CANCELLED")
    _finish_later(http, run_id, "CANCELLED", after_s=0.5)        # what the run's worker does
    waiting.wait = False
    assert waiting.execute(wctx) not in (run_id, first, second)   # the retry trains again


def _fail_when_created(http, deployment: str, key: str) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        runs = [r for r in _runs_of(http, deployment) if r["idempotency_key"] == key]
        if runs:
            _finish_later(http, runs[0]["id"], "CRASHED", after_s=0).join()
            return
        time.sleep(0.2)


def test_a_busy_server_is_asked_again_and_a_refusal_is_not(monkeypatch):
    """A Prefect server whose database is busy answers 503 (the request rolled back): the client
    asks again with backoff, as Prefect's own client does; an error that is not transient (500)
    is reported at once. A real HTTP server on a local port plays the busy Prefect server."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers = {"busy": [503, 503, 200], "broken": [500, 200]}
    asked: dict[str, int] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):                                   # /api/flow_runs/<which>
            which = self.path.rsplit("/", 1)[-1]
            n = asked[which] = asked.get(which, 0) + 1
            code = answers[which][min(n, len(answers[which])) - 1]
            body = json.dumps({"id": which} if code == 200 else {"exception_message": "nope"}).encode()
            self.send_response(code)
            if code == 503:
                self.send_header("Retry-After", "0")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(af, "BACKOFF_S", 0.01)
    try:
        with af.make_client(f"http://127.0.0.1:{server.server_port}/api") as c:
            assert af.read_flow_run(c, "busy") == {"id": "busy"}
            assert asked["busy"] == 3
            with pytest.raises(RuntimeError, match="HTTP 500"):
                af.read_flow_run(c, "broken")
            assert asked["broken"] == 1
    finally:
        server.shutdown()
