"""Airflow operator and sensor that run Frenzy's ``frenzy-submit`` on a Prefect server.

    from frenzy_airflow.operators import FrenzySubmitOperator, FrenzyFlowRunSensor

    train = FrenzySubmitOperator(task_id="train", api_url="http://prefect:4200/api",
                                 job={"model": "gpt2", "seq_len": 1024, "global_batch": 64,
                                      "train_tokens": 200_000_000})
    # or fire and forget, then wait in a sensor (frees the worker slot while training runs):
    start = FrenzySubmitOperator(task_id="start", job=..., wait=False)
    done = FrenzyFlowRunSensor(task_id="done", flow_run_id=start.output, mode="reschedule")

Tested against a real Airflow 3 (``airflow dags test`` of ``examples/airflow/frenzy_dag.py``, see
tests/test_airflow_dag.py); the Airflow 2 import paths are kept as a fallback.

The idempotency key is the task instance (dag, task, run id, map index), never the try number:
an Airflow retry finds the flow run of the first try and waits on it while it runs or returns it
when it completed; it never starts a second training beside it. After a failed, crashed or
cancelled run a retry starts the next one (``client.trigger_or_resume``: one per failed run,
whatever the number of tries that find it), which resumes the job's checkpoints. A task Airflow
kills (a timeout, marked failed) cancels the run it waits on (``on_kill``). The flow run id goes
to XCom. Only httpx talks to Prefect: no prefect import here.
"""
from __future__ import annotations

from typing import Any, Sequence

try:                                   # Airflow 3: the task SDK is the public API
    from airflow.sdk import BaseOperator, BaseSensorOperator
except ImportError:                    # Airflow 2
    from airflow.models import BaseOperator
    from airflow.sensors.base import BaseSensorOperator

from .client import (DEFAULT_DEPLOYMENT, FINAL_STATES, FrenzyRunFailed, cancel, idempotency_key, make_client,
                     read_flow_run, state_type, trigger_or_resume, wait)


def _conn(conn_id: str | None, api_url: str | None) -> tuple[str | None, str | None]:
    """API URL and key from an Airflow connection (host = API URL, password = API key)."""
    if not conn_id:
        return api_url, None
    try:
        from airflow.sdk import BaseHook
    except ImportError:
        from airflow.hooks.base import BaseHook

    c = BaseHook.get_connection(conn_id)
    return api_url or c.host, c.password or None


class FrenzySubmitOperator(BaseOperator):
    """Start ``frenzy-submit`` (or another deployment) with ``job`` and, with ``wait=True``,
    wait for its final state. Returns (XCom) the flow run id."""

    template_fields: Sequence[str] = ("job", "parameters", "job_variables", "deployment")

    def __init__(self, *, job: dict | None = None, parameters: dict | None = None,
                 deployment: str = DEFAULT_DEPLOYMENT, job_variables: dict | None = None,
                 api_url: str | None = None, prefect_conn_id: str | None = None, wait: bool = True,
                 poll_interval: float = 30.0, wait_timeout: float | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.job, self.parameters, self.deployment = job, parameters, deployment
        self.job_variables, self.api_url, self.prefect_conn_id = job_variables, api_url, prefect_conn_id
        self.wait, self.poll_interval, self.wait_timeout = wait, poll_interval, wait_timeout
        self._waiting_on: str | None = None        # the flow run ``execute`` waits for

    def execute(self, context: Any) -> str:
        ti = context["ti"]
        key = idempotency_key(ti.dag_id, ti.task_id, context["run_id"], getattr(ti, "map_index", -1))
        params = dict(self.parameters or {})
        if self.job is not None:
            params["job"] = self.job
        url, api_key = _conn(self.prefect_conn_id, self.api_url)
        with make_client(url, api_key) as client:
            fr = trigger_or_resume(client, self.deployment, parameters=params, job_variables=self.job_variables,
                                   idempotency_key=key, tags=["airflow", f"dag:{ti.dag_id}"])
            self.log.info("Prefect flow run %s (%s), idempotency key %s", fr["name"], fr["id"],
                          fr.get("idempotency_key") or key)
            if self.wait:
                # kept when the wait ends in an exception: Airflow calls on_kill after its
                # timeout exception has left execute
                self._waiting_on = fr["id"]
                wait(client, fr["id"], poll_s=self.poll_interval, timeout_s=self.wait_timeout,
                     on_poll=lambda r: self.log.info("flow run %s: %s", r["name"], state_type(r)))
                self._waiting_on = None
        return fr["id"]

    def on_kill(self) -> None:
        """Airflow stops the task (a timeout, marked failed): the training it waits on stops too."""
        run_id = self._waiting_on
        if not run_id:
            return
        url, api_key = _conn(self.prefect_conn_id, self.api_url)
        with make_client(url, api_key) as client:
            fr = cancel(client, run_id, f"Airflow stopped task {self.task_id}")
        self.log.info("flow run %s (%s): %s", fr.get("name"), run_id, state_type(fr))


class FrenzyFlowRunSensor(BaseSensorOperator):
    """Succeeds when the Prefect flow run is COMPLETED; fails the task on any other final state."""

    template_fields: Sequence[str] = ("flow_run_id",)

    def __init__(self, *, flow_run_id: str, api_url: str | None = None, prefect_conn_id: str | None = None,
                 **kwargs: Any):
        super().__init__(**kwargs)
        self.flow_run_id, self.api_url, self.prefect_conn_id = flow_run_id, api_url, prefect_conn_id

    def poke(self, context: Any) -> bool:
        url, api_key = _conn(self.prefect_conn_id, self.api_url)
        with make_client(url, api_key) as client:
            fr = read_flow_run(client, self.flow_run_id)
        st = state_type(fr)
        self.log.info("flow run %s (%s): %s", fr.get("name"), self.flow_run_id, st)
        if st in FINAL_STATES and st != "COMPLETED":
            raise FrenzyRunFailed(fr)
        return st == "COMPLETED"
