"""Placement and OOM-fallback events reach the Prefect server with the job as resource."""
from __future__ import annotations

import time
import uuid

import pytest

from estimator.plan import Plan

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_server")]


def _read(event_name: str, resource_id: str, timeout_s: float = 20.0):
    from prefect import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    flt = EventFilter(event=EventNameFilter(name=[event_name]),
                      resource=EventResourceFilter(id=[resource_id]))
    deadline = time.monotonic() + timeout_s
    while True:
        with get_client(sync_client=True) as client:
            page = client.read_events(filter=flt, limit=50)   # the server caps at 50; the client default is 100
        if page.events or time.monotonic() > deadline:
            return page.events
        time.sleep(0.5)


def test_placed_and_oom_fallback_events_carry_plan_allocation_and_step():
    from prefect import flow

    from frenzy_flows import events

    job = f"ev-{uuid.uuid4().hex[:6]}"
    p1 = Plan(gpu_type="RTX3090-24GB", gpus=2, dp=2, micro_batch=4, grad_accum=2)
    p2 = p1.model_copy(update={"act_ckpt": "full"})
    alloc = {"allocation_id": "a-17", "pool": "rtx3090", "gpu_type": "RTX3090-24GB",
             "devices": ["2", "3"], "placement": {"rtx3090-0": [2, 3]}}

    @flow
    def emit():
        events.placed(job, p1, alloc, job_id=f"{job}-id")
        events.oom_fallback(job, p1, p2, step=7, job_id=f"{job}-id")
        events.oom_fallback(job, p2, None, step=9)

    emit()
    placed = _read(events.PLACED, f"frenzy.job.{job}")
    assert len(placed) == 1
    ev = placed[0]
    assert ev.resource["frenzy.pool"] == "rtx3090" and ev.resource["frenzy.gpus"] == "2"
    assert ev.resource["frenzy.job_id"] == f"{job}-id"      # names repeat across submissions
    assert ev.payload["allocation"]["devices"] == ["2", "3"]
    assert ev.payload["allocation"]["allocation_id"] == "a-17"
    assert ev.payload["plan"]["micro_batch"] == 4
    roles = {r["prefect.resource.role"]: r["prefect.resource.id"] for r in ev.related}
    assert roles["work-pool"] == "frenzy.pool.rtx3090"
    assert roles["gpu-type"] == "frenzy.gpu-type.RTX3090-24GB"
    assert "flow-run" in roles            # Prefect links the emitting run

    ooms = _read(events.OOM_FALLBACK, f"frenzy.job.{job}")
    deadline = time.monotonic() + 10
    while len(ooms) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
        ooms = _read(events.OOM_FALLBACK, f"frenzy.job.{job}")
    by_step = {e.payload["step"]: e for e in ooms}
    assert set(by_step) == {7, 9}
    assert by_step[7].payload["to_plan"]["act_ckpt"] == "full" and by_step[7].resource["frenzy.job_id"] == f"{job}-id"
    assert "frenzy.job_id" not in by_step[9].resource
    assert by_step[9].payload["to_plan"] is None and by_step[9].resource["frenzy.to_gpu_type"] == "none"


def test_ledger_allocation_objects_publish_their_id_as_allocation_id():
    from frenzy_flows.events import _alloc_fields

    class Allocation:       # the shape of ledger.Allocation
        id = 42
        pool = "a100"
        gpu_type = "A100-80GB"
        devices = ["0"]
        placement = {"a100-0": [0]}

    out = _alloc_fields(Allocation())
    assert out["allocation_id"] == "42" and "id" not in out and out["pool"] == "a100"


def test_announced_fallbacks_emit_when_each_fallback_is_taken():
    from prefect import flow

    from frenzy_flows import events

    job = {"name": f"fb-{uuid.uuid4().hex[:6]}"}
    p1 = Plan(gpu_type="A100-40GB", gpus=2, dp=2)
    p2 = p1.model_copy(update={"act_ckpt": "full"})
    p3 = Plan(gpu_type="A100-80GB", gpus=2, dp=2)
    step = {"now": 0}

    @flow
    def train():
        it = events.announced_fallbacks(job, p1, plans=[p2, p3], last_step=lambda: step["now"])
        step["now"] = 5
        assert next(it, None) == p2            # what the runner does after an OOM
        step["now"] = 11
        assert next(it, None) == p3
        assert next(it, None) is None          # nothing left: announced, then exhausted

    train()
    evs = _read(events.OOM_FALLBACK, f"frenzy.job.{job['name']}")
    deadline = time.monotonic() + 10
    while len(evs) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
        evs = _read(events.OOM_FALLBACK, f"frenzy.job.{job['name']}")
    got = sorted((e.payload["step"], e.payload["from_plan"]["gpu_type"], e.payload["from_plan"]["act_ckpt"],
                  (e.payload["to_plan"] or {}).get("gpu_type")) for e in evs)
    assert got == [(5, "A100-40GB", "none", "A100-40GB"), (11, "A100-40GB", "full", "A100-80GB"),
                   (11, "A100-80GB", "none", None)]
