"""scripts/gpu_check.py without a GPU: the plan sets it runs and its rescoring of saved measurements."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_check import NO_TRACKING, plan_set  # noqa: E402

from estimator.job import TrainingJob  # noqa: E402
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
        job = TrainingJob(name="gpu-check", model="llama-3.2-1b", seq_len=2048, global_batch=8, train_steps=8,
                          tracking=NO_TRACKING, export={"enabled": False}, **jk)
        plan = Plan(gpu_type="H200-141GB", gpus=1, dp=1, grad_accum=8 // kw["micro_batch"], **kw)
        assert reestimate(job, plan, safety_margin_gib=0.0) is not None, label


def test_rescore_reads_the_saved_h200_report():
    saved = ROOT / "docs" / "data" / "gpu_check_memory_h200.json"
    rows = json.loads(saved.read_text())["rows"]
    out = subprocess.run([sys.executable, "scripts/gpu_check.py", "--rescore", str(saved)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.returncode == 0, out.stderr
    for r in rows:
        assert r["plan"] in out.stdout
    assert "mb4 lora" in out.stdout


@pytest.mark.parametrize("name", ["basic", "memory"])
def test_plan_sets_keep_the_global_batch(name):
    for _, kw, _ in plan_set(name, 8):
        assert 8 % kw["micro_batch"] == 0
