"""What a person reads: units that scale, a plans table that fits, a summary without raw
Python values, the chosen plan in every artifact (one real submission on the session server)."""
from __future__ import annotations

import os

import pytest

from estimator.plan import Plan
from frenzy_flows import artifacts


def test_memory_figures_scale_their_unit():
    assert artifacts.format_memory(0.006) == "6.1 MiB"            # a tiny model, not "0.000 GiB"
    assert artifacts.format_memory(0.5) == "512 MiB"
    assert artifacts.format_memory(1.5) == "1.50 GiB"
    assert artifacts.format_memory(0.0004) == "419 KiB"
    assert artifacts.format_memory(None) == "not measured"
    assert artifacts.format_seconds(0.0467) == "46.7 ms" and artifacts.format_seconds(2.5) == "2.5 s"


def _cpu_plans():
    two = Plan(gpu_type="CPU", gpus=2, dp=2, zero=2, micro_batch=4, device_used_gib=0.006, step_time_s=0.0467)
    pp = Plan(gpu_type="CPU", gpus=2, dp=1, pp=2, zero=2, offload="optimizer", micro_batch=8, device_used_gib=0.005,
              step_time_s=0.0400)
    one = Plan(gpu_type="CPU", gpus=1, dp=1, micro_batch=8, device_used_gib=0.0106, step_time_s=0.0540)
    return {"CPU": [pp, two, one]}, one


def test_plans_table_has_few_named_columns_and_says_why_the_chosen_row_is_not_first():
    by_type, chosen = _cpu_plans()
    rows = artifacts.plan_rows(by_type, chosen, steps=12)
    headers = list(rows[0])
    assert len(headers) == 6 and all(h.strip() for h in headers)
    assert all(list(r) == headers for r in rows)
    assert [r["choice"] for r in rows] == ["cannot launch pp2", "58% efficiency", artifacts.CHOSEN_MARK]
    assert rows[2]["memory / GPU"] == "10.9 MiB"
    desc = artifacts.plans_description(by_type, chosen, steps=12)
    assert "(row 3)" in desc
    assert "1.16x faster on 2 GPUs, not 1: 58% parallel efficiency" in desc
    assert "cannot launch pp2: pipeline parallel runs beside data and tensor parallel and ZeRO 0-3 only, without offload" in desc
    # the artifact page leaves ~840 px for the table at a 1400 px window (screenshot in docs/):
    # six columns of at most ~30 characters at ~7 px each plus padding
    assert sum(max(len(str(r[h])) for r in rows + [dict(zip(headers, headers))]) for h in headers) <= 90


def test_cpu_memory_is_not_labelled_nvidia_smi():
    plan = Plan(gpu_type="CPU", gpus=1, dp=1, device_used_gib=0.01)
    est = {"params": 1000, "breakdown_gib": {"weights": 0.001}, "allocated_peak_gib": 0.01,
           "reserved_peak_gib": 0.01, "device_used_gib": 0.01}
    md = artifacts.memory_markdown(est, plan)
    assert "nvidia-smi" not in md and "| process memory (host RAM) | 10.2 MiB |" in md
    assert "0.000" not in md
    assert "nvidia-smi" in artifacts.memory_markdown(est, plan.model_copy(update={"gpu_type": "A100-80GB"}))


def test_summary_has_outcome_paths_and_no_raw_python_values():
    plan = Plan(gpu_type="CPU", gpus=1, dp=1, device_used_gib=0.0106, step_time_s=0.054)
    measured = {"step_time_s": 0.04, "tokens_per_s": 12800.0, "allocated_peak_gib": None,
                "reserved_peak_gib": None, "nvml_used_gib": None, "memory_measured": False,
                "per_rank": [{"rank": 0, "allocated_peak_gib": None}]}
    trained = {"status": "completed", "losses": [5.5, 5.0, 4.6, 4.4], "checkpoint_dir": "/runs/x/checkpoints/step-4",
               "export_dir": "/runs/x/export", "eval_losses": [{"step": 4, "loss": 4.9}],
               "attempts": [{"resumed_from_step": 0}]}
    md = artifacts.summary_markdown(plan, {"step_time_s": 0.054, "device_used_gib": 0.0106}, measured, trained)
    for raw in ("[{", "{'", "None", "True", "False", "per_rank", "memory_measured"):
        assert raw not in md, raw
    assert "| final loss | 4.4000 (first 5.5000) |" in md
    assert "| eval loss | 4.9000 at step 4 |" in md
    assert "| throughput | 12,800 tokens/s, 40.0 ms per step |" in md
    assert "| checkpoint | `/runs/x/checkpoints/step-4` |" in md and "| export | `/runs/x/export` |" in md
    assert "| process memory (host RAM) | 10.9 MiB | not measured (CPU) |  |" in md
    assert "| step time | 54.0 ms | 40.0 ms | +35.0% |" in md
    chart = md.split("```")[1]
    assert chart.count("*") == 4 and "o" in chart and "step 1" in chart


def test_loss_chart_buckets_long_runs_to_its_width():
    losses = [10.0 - i / 100 for i in range(1000)]
    chart = artifacts.loss_chart(losses, width=50, height=8)
    body = chart.splitlines()[:8]
    assert sum(line.count("*") for line in body) == 50
    assert chart.splitlines()[0].startswith("9.905") and "1000" in chart.splitlines()[-1]


def test_frenzy_home_and_the_paths_under_it_are_absolute(tmp_path, monkeypatch):
    from estimator.home import frenzy_home

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FRENZY_HOME", "relative-home")
    assert frenzy_home() == tmp_path / "relative-home"
    monkeypatch.delenv("FRENZY_HOME")
    assert frenzy_home() == tmp_path / ".frenzy" and frenzy_home().is_absolute()


@pytest.mark.prefect
@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_submission_shows_the_chosen_plan_in_every_artifact(tmp_path, frenzy_home, monkeypatch):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from deployments.pools import sync_pools
    from frenzy_flows import submit_training
    from scheduler.cluster import load_cluster

    cluster = tmp_path / "cpu.yaml"
    cluster.write_text("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")
    sync_pools(load_cluster(cluster))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FRENZY_HOME", "rel-home")         # a relative home: returned paths still absolute
    job = {"name": "ui-tiny", "model": "gpt2-tiny", "seq_len": 64, "global_batch": 8, "train_steps": 6,
           "precision": "fp32", "lr": 0.003, "checkpoint_every": 3}
    result = submit_training(job=job, cluster=str(cluster))
    assert result.status == "completed"
    assert result.checkpoint_dir and os.path.isabs(result.checkpoint_dir)
    with get_client(sync_client=True) as client:
        arts = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[result.flow_run_id])))
    by_key = {a.key: a for a in arts}
    chosen = result.initial_plan.short()
    assert by_key[artifacts.MEMORY_KEY].data.startswith(f"# Memory estimate per process: {chosen}\n")
    assert chosen in by_key[artifacts.PLANS_KEY].description
    summary = by_key[artifacts.SUMMARY_KEY].data
    assert f"| final loss | {result.losses[-1]:.4f}" in summary
    assert f"| checkpoint | `{result.checkpoint_dir}` |" in summary
    assert "nvidia-smi" not in summary and "[{" not in summary


def test_cli_report_names_every_column_and_scales_units():
    from rich.console import Console

    from frenzy_cli.report import print_result
    from frenzy_flows.results import Assignment, SubmitResult

    by_type, chosen = _cpu_plans()
    est = {"params": 1000, "breakdown_gib": {"weights": 0.001, "activations": 0.005}, "allocated_peak_gib": 0.0106,
           "reserved_peak_gib": 0.0106, "device_used_gib": 0.0106}
    result = SubmitResult(status="completed", job_id="j", job_name="tiny", plan=chosen, initial_plan=chosen,
                          allocation=Assignment(allocation_id="1", plan=chosen, pool="cpu", gpu_type="CPU",
                                                placement={"cpu-0": [0]}),
                          estimate=est, plans=by_type, losses=[5.0, 4.5],
                          measured={"step_time_s": 0.04, "tokens_per_s": 1000.0, "memory_measured": False},
                          checkpoint_dir="/abs/ckpt", eval_losses=[{"step": 2, "loss": 4.7}])
    con = Console(width=200, record=True)
    print_result(result, console=con)
    text = con.export_text()
    assert "nvidia-smi" not in text and "process memory (host RAM)" in text
    assert "0.000" not in text and "10.9 MiB" in text
    header = next(line for line in text.splitlines() if "GPU type" in line and "┃" in line)
    assert header.rstrip().rstrip("┃").rstrip().endswith("choice")
    assert "cannot launch" in text and "58% efficiency" in text and "<- chosen" in text
    assert "final loss 4.5000, eval loss 4.7000 at step 2" in text and "checkpoints: /abs/ckpt" in text
    assert "placement cpu-0 devices 0," in text and "{" not in text


def test_cli_report_prints_error_text_that_looks_like_markup():
    """A rank killed mid-run failed the first attempt with gloo's "[/.../pair.cc:537] Connection
    reset"; the run recovered, and the report raised Rich's MarkupError printing that text."""
    from rich.console import Console

    from frenzy_cli.report import print_result
    from frenzy_flows.results import Assignment, SubmitResult

    by_type, chosen = _cpu_plans()
    err = "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Connection reset"
    est = {"params": 1000, "breakdown_gib": {"weights": 0.001}, "allocated_peak_gib": 0.01,
           "reserved_peak_gib": 0.01, "device_used_gib": 0.01}
    result = SubmitResult(status="completed", job_id="j", job_name="tiny", plan=chosen, initial_plan=chosen,
                          allocation=Assignment(allocation_id="1", plan=chosen, pool="cpu[a]", gpu_type="CPU",
                                                placement={"cpu-0": [0]}),
                          estimate=est, plans=by_type, losses=[5.0, 4.5],
                          attempts=[{"outcome": "failed", "plan": {"gpu_type": "CPU"}, "error": err},
                                    {"outcome": "ok", "plan": {"gpu_type": "CPU"}, "resumed_from_step": 1}],
                          checkpoint_dir="/abs/[ckpt]")
    con = Console(width=300, record=True)
    print_result(result, console=con)
    text = con.export_text()
    assert err in text and "pool cpu[a]" in text and "checkpoints: /abs/[ckpt]" in text
