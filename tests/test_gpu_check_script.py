"""scripts/gpu_check.py without a GPU: the plan sets it runs and its rescoring of saved measurements."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import check_job, plan_set  # noqa: E402

from estimator.plan import Plan  # noqa: E402
from trainer.fallback import reestimate  # noqa: E402


def test_memory_set_covers_zero_lora_offload_and_every_plan_fits_an_h200():
    shapes = plan_set("memory", 8)
    assert len(shapes) >= 6
    knobs = [kw for _, kw, _ in shapes]
    assert {kw.get("zero", 0) for kw in knobs} >= {0, 2, 3}
    assert any(kw.get("offload") == "optimizer" for kw in knobs)
    assert any(jk.get("finetune", {}).get("method") == "lora" for _, _, jk in shapes)
    for label, kw, jk in shapes:
        job = check_job("llama-3.2-1b", 2048, 8, 8, **jk)
        plan = Plan(gpu_type="H200-141GB", gpus=1, dp=1, grad_accum=8 // kw["micro_batch"], **kw)
        assert reestimate(job, plan, safety_margin_gib=0.0) is not None, label


@pytest.mark.parametrize("name", ["memory", "heldout", "lora"])
def test_rescore_predicts_each_saved_row_as_its_own_job(name):
    """``--rescore`` prints, per saved row, today's prediction for that row's plan and job
    (LoRA, pure bf16: the job knobs the row saved) beside the measurement."""
    saved = ROOT / "docs" / "data" / f"gpu_check_{name}_h200.json"
    report = json.loads(saved.read_text())
    out = subprocess.run([sys.executable, "scripts/gpu_check.py", "--rescore", str(saved)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.returncode == 0, out.stderr
    by_label = {}
    for line in out.stdout.splitlines():
        for r in report["rows"]:
            label = r["plan"].split()
            if line.split()[:len(label)] == label and len(line.split()) == len(label) + 12:
                by_label[r["plan"]] = line.split()[len(label):]      # the 12 figures
    assert set(by_label) == {r["plan"] for r in report["rows"]}
    preds = set()
    for r in report["rows"]:
        cols = by_label[r["plan"]]
        job = check_job(report["model"], report["seq_len"], report["global_batch"], report["steps"], **r["job"])
        want = reestimate(job, Plan(**r["knobs"]), safety_margin_gib=0.0)
        assert float(cols[0]) == pytest.approx(want.allocated_peak_gib, abs=0.006)
        assert float(cols[1]) == pytest.approx(r["measured"]["allocated_peak_gib"], abs=0.006)
        assert float(cols[6]) == pytest.approx(want.device_used_gib, abs=0.006)
        preds.add(round(want.allocated_peak_gib, 2))
    assert len(preds) == len(report["rows"])   # every row its own job and plan: no two predicted alike


@pytest.mark.parametrize("name", ["lora", "lora-heldout"])
def test_predict_writes_the_sets_predictions_without_a_gpu(name, tmp_path):
    """``--predict``: what a set will be compared with, written before it runs (committed
    beside the measurements); the LoRA plans' step times carry the adapters' terms."""
    out = subprocess.run([sys.executable, "scripts/gpu_check.py", "--set", name, "--predict", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.returncode == 0, out.stderr
    report = json.loads((tmp_path / "gpu_check_predicted.json").read_text())
    rows = report["rows"]
    assert len(rows) == len(plan_set(name, report["global_batch"])) and all(r["status"] == "predicted" for r in rows)
    full = [r for r in rows if r["job"]["finetune"]["method"] == "full" and r["knobs"]["act_ckpt"] == "none"]
    lora = [r for r in rows if r["job"]["finetune"]["method"] == "lora"]
    assert full and lora
    steps = {r["predicted"]["step_time_s"] for r in lora}
    assert len(steps) > 1                       # targets, rank and dropout change the step
    for r in lora:
        assert r["predicted"]["allocated_peak_gib"] < full[0]["predicted"]["allocated_peak_gib"]


def test_parallel_set_runs_every_plan_kind_the_trainer_launches_and_says_what_one_gpu_skips(tmp_path):
    """Issue 13's device check: tp, pp, cp and offload plans of a ~1B Llama, each one the trainer
    can launch, predicted to fit an H200; on one GPU only the offload plans run."""
    from gpu_check import plan_of, runnable_rows
    from trainer.fallback import not_launchable

    rows = plan_set("parallel", 4)
    plans = {label: plan_of("H200-141GB", 2, 8, kw) for label, kw, _ in rows}
    assert {p.tp for p in plans.values()} >= {1, 2} and any(p.pp == 2 for p in plans.values())
    assert any(p.cp == 2 for p in plans.values())
    assert {p.offload for p in plans.values()} >= {"optimizer", "optimizer+params"}
    from estimator.models import resolve_model
    from estimator.plans import not_launchable_reason

    spec = resolve_model("llama-3.2-1b")
    for label, plan in plans.items():
        # the trainer's own rule and the model's (heads, pipeline stages, embedding sharding)
        assert plan.global_batch == 8 and not_launchable(plan) is None, label
        assert not_launchable_reason(plan, spec) is None, label
        assert reestimate(check_job("llama-3.2-1b", 2048, 8, 10), plan, safety_margin_gib=0.0) is not None, label
    one = runnable_rows(rows, 1, 8)
    assert [label for label, _, _ in one] == [label for label, kw, _ in rows if "offload" in kw]
    out = subprocess.run([sys.executable, "scripts/gpu_check.py", "--set", "parallel", "--predict", "--gpus", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert "mb2 tp2: needs a multiple of 2 GPUs" in out.stderr and "offload-opt+params" in out.stdout
    assert [label for label, _, _ in runnable_rows(rows, 3, 8)] == []          # dp 3 never divides 8
    assert "mb4 tp2 full-ckpt" not in [label for label, _, _ in runnable_rows(rows, 8, 8)]   # dp 4 x mb 4 > 8
