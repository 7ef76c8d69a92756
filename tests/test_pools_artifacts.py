"""Artifacts a run shows in the UI: pure row/markdown builders, then the real artifacts on the
session Prefect server, read back through the API."""
from __future__ import annotations

import datetime as dt
import json

import pytest

from estimator.plan import Plan
from frenzy_flows import artifacts


def _plans():
    a = Plan(gpu_type="A100-80GB", gpus=4, dp=4, zero=1, micro_batch=2, grad_accum=4,
             device_used_gib=41.5, step_time_s=0.8)
    b = Plan(gpu_type="A100-80GB", gpus=2, dp=2, zero=2, act_ckpt="full", micro_batch=4, grad_accum=4,
             device_used_gib=60.2, step_time_s=1.5)
    c = Plan(gpu_type="RTX3090", gpus=8, dp=4, tp=2, zero=1, micro_batch=2, grad_accum=4,
             device_used_gib=21.0, step_time_s=2.0)
    return {"A100-80GB": [a, b], "RTX3090": [c]}, a, b, c


def test_plan_rows_mark_exactly_the_chosen_plan_and_predict_completion():
    by_type, a, b, c = _plans()
    now = dt.datetime(2026, 1, 1, 12, 0, tzinfo=dt.timezone.utc)
    # the chosen plan may carry refreshed predictions: still matched by its knobs
    chosen = b.model_copy(update={"step_time_s": 1.4})
    rows = artifacts.plan_rows(by_type, chosen, steps=3600)
    assert len(rows) == 3
    assert rows[1]["choice"] == artifacts.CHOSEN_MARK
    assert sum(r["choice"] == artifacts.CHOSEN_MARK for r in rows) == 1
    # the faster row above the chosen one says why it was not taken
    assert rows[0]["choice"] == "87% efficiency"
    assert rows[2]["choice"] == ""                             # slower than the chosen: no remark
    assert rows[1]["duration"] == "1h 30m"                     # 3600 * 1.5 s, the candidate row
    assert rows[1]["layout"] == "dp2 ZeRO-2 ckpt:full mb 4x4"
    assert rows[2]["layout"] == "dp4 tp2 ZeRO-1 mb 2x4"
    assert rows[0]["memory / GPU"] == "41.50 GiB" and rows[0]["GPUs"] == "4 x A100-80GB"
    desc = artifacts.plans_description(by_type, chosen, steps=3600, now=now,
                                       pool_notes={"RTX3090": "rtx3090: no workers online"})
    assert "(row 2), predicted done by 2026-01-01 13:24 UTC" in desc
    assert "1.75x faster on 4 GPUs, not 2: 87% parallel efficiency" in desc
    assert desc.endswith("Pools: rtx3090: no workers online.")


def test_plan_rows_show_a_chosen_plan_outside_the_candidates():
    by_type, a, b, c = _plans()
    other = Plan(gpu_type="H100-80GB", gpus=1, step_time_s=0.5, device_used_gib=70)
    rows = artifacts.plan_rows(by_type, other, steps=10)
    assert rows[0]["choice"] == artifacts.CHOSEN_MARK and rows[0]["GPUs"] == "1 x H100-80GB"
    assert sum(r["choice"] == artifacts.CHOSEN_MARK for r in rows) == 1


def test_format_duration():
    assert artifacts.format_duration(12.34) == "12.3s"
    assert artifacts.format_duration(250) == "4m 10s"
    assert artifacts.format_duration(3 * 86400 + 7200) == "3d 2h"


ESTIMATE = {"params": 124_439_808, "allocated_peak_gib": 10.0, "reserved_peak_gib": 11.0,
            "device_used_gib": 12.0,
            "breakdown_gib": {"weights": 1.0, "gradients": 1.0, "optimizer": 2.0, "activations": 5.0, "other": 1.0},
            "stages": [{"allocated_peak_gib": 10.0, "reserved_peak_gib": 11.0, "device_used_gib": 12.0},
                       {"allocated_peak_gib": 8.0, "reserved_peak_gib": 9.0, "device_used_gib": 10.0}]}


def test_memory_markdown_lists_components_shares_peaks_and_stages(monkeypatch):
    monkeypatch.setattr(artifacts, "_gpu_memory_gib", lambda name: 80.0 if name == "A100-80GB" else None)
    plan = Plan(gpu_type="A100-80GB", gpus=2, pp=2)
    md = artifacts.memory_markdown(ESTIMATE, plan)
    assert "| activations | 5.00 GiB | 50.0% |" in md
    assert "| optimizer | 2.00 GiB | 20.0% |" in md
    assert "124,439,808" in md
    assert "| device used (nvidia-smi) | 12.00 GiB |" in md
    assert "headroom **68.00 GiB** (15% used)" in md
    assert "| 1 | 8.00 GiB | 9.00 GiB | 10.00 GiB |" in md
    # an unknown GPU type has no capacity line, and a pydantic-like object works as well as a dict
    class Est:
        def model_dump(self):
            return ESTIMATE
    md2 = artifacts.memory_markdown(Est(), Plan(gpu_type="custom", gpus=1))
    assert "headroom" not in md2 and "| weights | 1.00 GiB | 10.0% |" in md2


def test_summary_markdown_computes_relative_error_and_marks_unmeasured():
    plan = Plan(gpu_type="CPU", gpus=2, dp=2)
    md = artifacts.summary_markdown(plan, {"step_time_s": 0.12, "allocated_peak_gib": 1.5},
                                    {"step_time_s": 0.10, "allocated_peak_gib": None, "tokens_per_s": 5000.0})
    assert "| step time | 120.0 ms | 100.0 ms | +20.0% |" in md
    assert "| allocated peak | 1.50 GiB | not measured (CPU) |  |" in md
    assert "| throughput | 5,000 tokens/s, 100.0 ms per step |" in md


# ---------------------------------------------------------------- real artifacts on the server

@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_artifacts_are_attached_to_the_run_and_progress_reaches_100(monkeypatch):
    from prefect import flow, get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.runtime import flow_run as rt_flow_run

    monkeypatch.setattr(artifacts, "PROGRESS_MIN_INTERVAL_S", 3600.0)   # only first/last go out
    by_type, a, b, c = _plans()

    @flow
    def show():
        artifacts.plans_table(by_type, a, steps=100, pool_notes={"RTX3090": "rtx3090: no workers online"})
        artifacts.memory_breakdown(ESTIMATE, a)
        h = artifacts.progress_start(10)
        sent = [artifacts.progress_update(h, s, 10, loss=5.0 - s / 10) for s in range(1, 11)]
        artifacts.summary(a, {"step_time_s": 0.8}, {"step_time_s": 1.0})
        return str(rt_flow_run.id), sent

    run_id, sent = show()
    assert sent == [False] * 9 + [True]        # throttled, but the final step always goes out
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    by_key = {x.key: x for x in arts}
    assert set(by_key) == {artifacts.PLANS_KEY, artifacts.MEMORY_KEY, artifacts.PROGRESS_KEY, artifacts.SUMMARY_KEY}
    table = by_key[artifacts.PLANS_KEY].data
    table = json.loads(table) if isinstance(table, str) else table
    assert [r["choice"] for r in table] == [artifacts.CHOSEN_MARK, "", ""]
    assert "Pools: rtx3090: no workers online." in by_key[artifacts.PLANS_KEY].description
    assert by_key[artifacts.PLANS_KEY].type == "table"
    assert float(by_key[artifacts.PROGRESS_KEY].data) == 100.0
    assert "loss 4.0000" in by_key[artifacts.PROGRESS_KEY].description
    assert "| activations | 5.00 GiB | 50.0% |" in by_key[artifacts.MEMORY_KEY].data
    assert "| step time | 800.0 ms | 1 s | -20.0% |" in by_key[artifacts.SUMMARY_KEY].data
