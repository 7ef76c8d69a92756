"""What the scheduler shows in the Prefect UI: an event for every decision and the queue as an
artifact it updates after every round.

Events (resource ``frenzy.job.<job name>``, related: the GPU type, as ``frenzy_flows.events``
does): ``frenzy.job.started``, ``frenzy.job.resized`` (payload: kind grow / shrink / move, the
old and new plans), ``frenzy.job.preempted``, ``frenzy.job.recalled``, ``frenzy.job.cancelled`` (its run did not
answer a request in time: cancelled through Prefect, the job queued again). Artifact: a table under
the key ``frenzy-queue`` (the rows ``frenzy queue`` prints).
"""
from __future__ import annotations

from typing import Any

from frenzy_flows.events import _related, job_resource

QUEUE_ARTIFACT = "frenzy-queue"
KINDS = ("started", "resized", "preempted", "recalled", "cancelled")


def event_name(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown scheduler decision {kind!r}")
    return f"frenzy.job.{kind}"


def emit_decision(kind: str, payload: dict[str, Any]):
    """Emit the event of one decision; returns the Event (None when Prefect drops it)."""
    from prefect.events import emit_event

    plan = payload.get("to_plan") or payload.get("plan") or payload.get("from_plan") or {}
    gpu_type = plan.get("gpu_type") if isinstance(plan, dict) else None
    labels = {"frenzy.job_id": payload.get("job_id", "")}
    if gpu_type:
        labels["frenzy.gpu_type"] = gpu_type
        labels["frenzy.gpus"] = str(plan.get("gpus", ""))
    return emit_event(event=event_name(kind), resource=job_resource(payload.get("job_name") or payload["job_id"], **labels),
                      related=_related(payload.get("pool"), gpu_type), payload=dict(payload))


def publish_queue(rows: list[dict[str, Any]]) -> None:
    """Replace the queue artifact with ``rows`` (a new version under the same key)."""
    import warnings

    from prefect.artifacts import create_table_artifact

    table = rows or [{"job": "", "state": "queue empty"}]
    with warnings.catch_warnings():     # the scheduler's artifact belongs to no flow run, on purpose
        warnings.simplefilter("ignore", FutureWarning)
        create_table_artifact(key=QUEUE_ARTIFACT, table=table,
                              description="Frenzy queue: pending jobs, predicted start, GPU type and count, why they wait")
