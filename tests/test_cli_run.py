"""`frenzy run`, end to end as a user runs it: a real subprocess, a fresh project-local
Prefect home, the embedded ephemeral server, a real `accelerate launch` on the CPU."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def frenzy(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "FRENZY_"))}
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "frenzy_cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_run_example_job_json(tmp_path):
    proc = frenzy("run", str(ROOT / "examples/tiny-job.yaml"), "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["status"] == "completed"
    plan = doc["plan"]
    for key in ("gpu_type", "gpus", "dp", "tp", "pp", "zero", "act_ckpt", "micro_batch", "grad_accum"):
        assert key in plan
    assert plan["micro_batch"] * plan["grad_accum"] * plan["dp"] == 8
    assert doc["estimate"]["allocated_peak_gib"] > 0
    assert len(doc["losses"]) == 12 and doc["losses"][-1] < doc["losses"][0]
    assert doc["attempts"] and doc["attempts"][-1]["outcome"] == "ok"
    # state stayed project-local
    assert (tmp_path / ".frenzy" / "prefect").is_dir()
    assert Path(doc["checkpoint_dir"]).is_dir()


def test_run_missing_job_file(tmp_path):
    proc = frenzy("run", "nope.yaml", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "job" in proc.stderr and "nope.yaml" in proc.stderr and "Traceback" not in proc.stderr


def test_run_bad_field_names_it(tmp_path):
    job = tmp_path / "bad.yaml"
    job.write_text("model: gpt2-tiny\nseq_len: -4\nglobal_batch: 8\ntrain_steps: 3\n")
    proc = frenzy("run", str(job), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "seq_len" in proc.stderr and "greater than 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_job_that_fits_nowhere_names_closest_plan(tmp_path):
    job = tmp_path / "big.yaml"
    job.write_text("model: llama-2-70b\nseq_len: 4096\nglobal_batch: 8\ntrain_steps: 3\n")
    cluster = tmp_path / "cpu.yaml"
    cluster.write_text("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")
    proc = frenzy("run", str(job), "--cluster", str(cluster), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "closest plan" in proc.stderr and "misses by" in proc.stderr and "GiB" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / ".frenzy" / "prefect").exists()     # failed before Prefect started


@pytest.mark.parametrize("extra, field", [
    ("data: {kind: text, path: /etc/passwd}\n", "data.path"),                 # outside the data roots
    ("data: {kind: text, path: missing.txt}\n", "data.path"),                 # not there
    ("data: {kind: text, path: d.txt, tokenizer: ./no-tokenizer}\n", "data.tokenizer"),
    ("entry_point: os:system\n", "entry_point"),                              # not an allowed module
    pytest.param("optimizer: adamw8bit\n", "optimizer",                      # bitsandbytes missing
                 marks=pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None,
                                          reason="bitsandbytes is installed")),
    pytest.param("optimizer: adamw8bit-paged\n", "optimizer",
                 marks=pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is not None,
                                          reason="bitsandbytes is installed")),
    # found only after a server started and a job was recorded, or after the whole training
    ("resume_from: no-such-run\n", "resume_from"),
    ("tracking: {uri: 'ftp://x'}\n", "tracking.uri"),
    ("export: {dir: d.txt/model}\n", "export.dir"),                          # under a file
], ids=["outside-roots", "missing", "tokenizer", "entry-point", "optimizer", "optimizer-paged",
        "resume-from", "tracking-uri", "export-dir"])
def test_run_checks_data_tokenizer_and_entry_point_before_prefect(tmp_path, extra, field):
    (tmp_path / "d.txt").write_text("hello world " * 200)
    job = tmp_path / "j.yaml"
    job.write_text("model: gpt2-tiny\nseq_len: 16\nglobal_batch: 2\ntrain_steps: 2\nprecision: fp32\n" + extra)
    proc = frenzy("run", str(job), cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().count("\n") == 0 and field in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / ".frenzy").exists()        # no Prefect, no ledger, no run folder


def test_run_json_bad_input_prints_a_json_error(tmp_path):
    job = tmp_path / "j.yaml"
    job.write_text("model: gpt2-tiny\nseq_len: 16\nglobal_batch: 2\ntrain_steps: 2\n"
                   "data: {kind: text, path: /etc/passwd}\n")
    proc = frenzy("run", str(job), "--json", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["status"] == "failed" and doc["field"] == "data.path" and "/etc/passwd" in doc["error"]
