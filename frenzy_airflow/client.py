"""Prefect's REST API, the few calls Airflow needs: start a deployment run with an idempotency
key and wait for its final state. Plain httpx: this module must never import prefect (Prefect
and Airflow cannot share one environment)."""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Mapping
from urllib.parse import quote

import httpx

FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CRASHED", "CANCELLED"})
DEFAULT_DEPLOYMENT = "frenzy-submit/frenzy-submit"


class FrenzyRunFailed(RuntimeError):
    """The Prefect run ended in a state other than COMPLETED."""

    def __init__(self, flow_run: Mapping[str, Any]):
        self.flow_run = dict(flow_run)
        st = flow_run.get("state") or {}
        super().__init__(f"flow run {flow_run.get('name')} ({flow_run.get('id')}) ended "
                         f"{st.get('type')}: {st.get('message') or ''}".rstrip(": "))


FAILED_STATES = FINAL_STATES - {"COMPLETED"}
# A retry that finds its run CANCELLING waits this long for it to end (Prefect kills a run's
# process 30 s after asking it to stop; its worker then reports it cancelled)
CANCELLING_WAIT_S = 120.0


def idempotency_key(dag_id: str, task_id: str, run_id: str, map_index: int = -1) -> str:
    """One key per Airflow task instance, the same on every retry (no try number in it), so a
    retried task finds the flow run its first try started instead of starting a second one."""
    key = f"airflow:{dag_id}:{task_id}:{run_id}"
    return key if map_index < 0 else f"{key}:{map_index}"


def retry_key(key: str, failed_run_id: str) -> str:
    """The key of the run that follows ``failed_run_id`` (started under ``key``'s chain): the
    same for every try that finds that run failed, so concurrent or repeated tries converge on
    one new run."""
    return f"{key.split(':after:', 1)[0]}:after:{failed_run_id}"


# Answers that say "not now" rather than "no": what Prefect's own client retries (408, 429, 502,
# 503: a server whose database is busy answers 503 and has rolled the request back), and 504.
RETRY_STATUSES = frozenset({408, 429, 502, 503, 504})
RETRIES = 5                     # Prefect's default (PREFECT_CLIENT_MAX_RETRIES)
BACKOFF_S = 0.5                 # then 1, 2, 4, 8 s: ~15 s in all, within an Airflow task's patience


def make_client(api_url: str | None = None, api_key: str | None = None, timeout_s: float = 30.0) -> httpx.Client:
    """An HTTP client for a Prefect API (``http://host:4200/api``, or a Prefect Cloud workspace
    URL with an API key); a connection that cannot be made is tried again ``RETRIES`` times
    (httpx's transport: nothing was sent, so any call may be)."""
    url = (api_url or os.environ.get("PREFECT_API_URL") or "").rstrip("/")
    if not url:
        raise ValueError("api_url: give the Prefect API URL (or set PREFECT_API_URL)")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=timeout_s,
                        transport=httpx.HTTPTransport(retries=RETRIES))


def _send(client: httpx.Client, method: str, url: str, **kw: Any) -> httpx.Response:
    """One API call, sent again on a transient answer (``RETRY_STATUSES``), after a backoff or
    the answer's Retry-After (at most 30 s); any other answer, and the last one, as it is."""
    for attempt in range(RETRIES):
        r = client.request(method, url, **kw)
        if r.status_code not in RETRY_STATUSES:
            return r
        try:
            delay = min(30.0, float(r.headers["retry-after"]))
        except (KeyError, ValueError):
            delay = BACKOFF_S * 2 ** attempt
        time.sleep(delay)
    return client.request(method, url, **kw)


def _check(r: httpx.Response, what: str) -> Any:
    if r.status_code >= 400:
        raise RuntimeError(f"{what}: HTTP {r.status_code}: {r.text[:500]}")
    return r.json()


def find_deployment(client: httpx.Client, name: str) -> dict:
    """``flow-name/deployment-name`` -> the deployment document."""
    if "/" not in name:
        raise ValueError(f"deployment: {name!r} must be '<flow name>/<deployment name>'")
    flow, dep = name.split("/", 1)
    r = _send(client, "GET", f"/deployments/name/{quote(flow, safe='')}/{quote(dep, safe='')}")
    if r.status_code == 404:
        raise ValueError(f"deployment: no deployment {name!r} on the Prefect server")
    return _check(r, f"read deployment {name}")


def trigger(client: httpx.Client, deployment: str, *, parameters: Mapping[str, Any] | None = None,
            job_variables: Mapping[str, Any] | None = None, idempotency_key: str | None = None,
            tags: list[str] | None = None, name: str | None = None) -> dict:
    """Create a flow run of ``deployment``. With the same ``idempotency_key`` the server returns
    the run it created the first time, so callers may retry freely. The server validates the
    parameters against the flow's schema (HTTP 409 naming the field)."""
    dep = find_deployment(client, deployment)
    body: dict[str, Any] = {"parameters": dict(parameters or {}), "tags": list(tags or [])}
    if job_variables:
        body["job_variables"] = dict(job_variables)
    if idempotency_key:
        body["idempotency_key"] = idempotency_key
    if name:
        body["name"] = name
    r = _send(client, "POST", f"/deployments/{dep['id']}/create_flow_run", json=body)
    if r.status_code == 409:
        raise ValueError(f"parameters: rejected by the Prefect server: {r.text[:500]}")
    return _check(r, f"create a run of {deployment}")


def trigger_or_resume(client: httpx.Client, deployment: str, *, idempotency_key: str,
                      max_chain: int = 100, **kw: Any) -> dict:
    """The task instance's flow run: the one its key names while that one is running or
    completed; after a failed, crashed or cancelled one, the next of the chain
    (``retry_key``), so an Airflow retry trains again (resuming the job's checkpoints) instead
    of waiting on the failure it retries. ``kw``: ``trigger``'s."""
    key = idempotency_key
    for _ in range(max_chain):
        fr = trigger(client, deployment, idempotency_key=key, **kw)
        deadline = time.monotonic() + CANCELLING_WAIT_S
        while state_type(fr) == "CANCELLING" and time.monotonic() < deadline:
            time.sleep(1.0)          # being cancelled (a killed try's on_kill): wait for its end
            fr = read_flow_run(client, fr["id"])
        if state_type(fr) not in FAILED_STATES:
            return fr
        key = retry_key(key, fr["id"])
    raise RuntimeError(f"{max_chain} flow runs of {idempotency_key} failed; not starting another")


def cancel(client: httpx.Client, flow_run_id: str, message: str) -> dict:
    """Ask Prefect to cancel the flow run (state CANCELLING: its worker stops the run's
    process; the Frenzy run releases its GPUs as it ends). A run already final is left as it is."""
    fr = read_flow_run(client, flow_run_id)
    if state_type(fr) in FINAL_STATES:
        return fr
    r = _send(client, "POST", f"/flow_runs/{flow_run_id}/set_state",
              json={"state": {"type": "CANCELLING", "name": "Cancelling", "message": message}})
    _check(r, f"cancel flow run {flow_run_id}")
    return read_flow_run(client, flow_run_id)


def read_flow_run(client: httpx.Client, flow_run_id: str) -> dict:
    return _check(_send(client, "GET", f"/flow_runs/{flow_run_id}"), f"read flow run {flow_run_id}")


def state_type(flow_run: Mapping[str, Any]) -> str:
    return ((flow_run.get("state") or {}).get("type") or "").upper()


def wait(client: httpx.Client, flow_run_id: str, *, poll_s: float = 10.0, timeout_s: float | None = None,
         on_poll: Callable[[dict], None] | None = None) -> dict:
    """Poll until the run is final. Returns the run when COMPLETED; raises ``FrenzyRunFailed``
    for any other final state and ``TimeoutError`` after ``timeout_s``."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        fr = read_flow_run(client, flow_run_id)
        if on_poll:
            on_poll(fr)
        st = state_type(fr)
        if st in FINAL_STATES:
            if st != "COMPLETED":
                raise FrenzyRunFailed(fr)
            return fr
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"flow run {fr.get('name')} still {st} after {timeout_s}s")
        time.sleep(poll_s)
