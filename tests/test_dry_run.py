"""`frenzy run JOB --dry-run` and the submit flow's ``dry_run``: what would launch, with nothing
started or written; "needs at least N x TYPE" when nothing fits."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BIG = "name: big\nmodel: llama-3.1-8b\nseq_len: 8192\nglobal_batch: 64\ntrain_steps: 1000\nprecision: bf16\n"
SMALL_CLUSTER = ("pools:\n  - {name: a10, gpu: A10-24GB, nodes: 1, gpus_per_node: 1}\n"
                 "  - {name: l4, gpu: L4-24GB, nodes: 1, gpus_per_node: 2, addresses: [node-l4]}\n")


def frenzy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "FRENZY_"))}
    env["PYTHONPATH"] = str(ROOT)
    # a server that is not there: a dry run that asked one would fail or hang
    env["PREFECT_API_URL"] = "http://127.0.0.1:9/api"
    env["HOME"] = str(cwd / "home")                      # where Prefect would make ~/.prefect
    return subprocess.run([sys.executable, "-m", "frenzy_cli.main", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_dry_run_json_says_what_would_launch_and_writes_nothing(tmp_path):
    proc = frenzy("run", str(ROOT / "examples/tiny-job.yaml"), "--dry-run", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [line] = proc.stdout.strip().splitlines()            # one object
    d = json.loads(line)
    assert d["dry_run"] is True and d["launch"] is True
    assert d["gpu_type"] == "CPU" and d["gpus"] >= 1 and d["pool"] == "cpu"
    assert d["plan"].startswith(f"{d['gpus']}xCPU") and d["memory_per_gpu"].endswith("MiB")
    assert d["step_time_s"] > 0 and d["duration_s"] == pytest.approx(d["step_time_s"] * 12)
    assert "prefect worker start --pool cpu" in d["worker"]
    assert not (tmp_path / ".frenzy").exists()           # no ledger, no run folder, no Prefect home
    assert not (tmp_path / "home").exists()


def test_dry_run_text_names_the_nearest_gpu_counts_when_nothing_fits(tmp_path):
    (tmp_path / "big.yaml").write_text(BIG)
    (tmp_path / "cluster.yaml").write_text(SMALL_CLUSTER)
    proc = frenzy("run", "big.yaml", "--cluster", "cluster.yaml", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    out = proc.stdout
    assert "would not launch" in out
    # offload plans put a 7B model on 2 x L4; an 8B model at 8K tokens (logits, activations) needs more
    assert "A10-24GB: no count up to" in out              # 1-GPU nodes: no tensor parallel to split it
    assert "needs at least 4 x L4-24GB (the cluster has 2" in out
    assert "x A100-40GB (not in the cluster)" in out      # the nearest catalog type with more memory
    assert not (tmp_path / ".frenzy").exists()
    # with a plan filter too: the same report, not "no feasible plan matches" over no GPU type
    proc = frenzy("run", "big.yaml", "--cluster", "cluster.yaml", "--dry-run", "--plan", "zero=3", cwd=tmp_path)
    assert proc.returncode == 2 and "would not launch" in proc.stdout and "needs at least" in proc.stdout


def test_a_type_where_nothing_fits_says_so_not_that_plans_exceed_max_gpus(tmp_path):
    """A job without ``max_gpus`` on a type too small for it: the refusal says no plan fits on
    the GPUs the cluster has (it said "every feasible plan needs more than max_gpus=None")."""
    (tmp_path / "big.yaml").write_text("name: big\nmodel: llama-2-7b\nseq_len: 2048\nglobal_batch: 8\n"
                                       "train_steps: 10\n")
    (tmp_path / "cluster.yaml").write_text("pools:\n  - {name: a10, gpu: A10-24GB, nodes: 1, gpus_per_node: 1}\n"
                                           "  - {name: l4, gpu: L4-24GB, nodes: 1, gpus_per_node: 2}\n")
    proc = frenzy("run", "big.yaml", "--cluster", "cluster.yaml", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "A10-24GB: no plan fits in memory on the 1 GPU of this type the cluster has" in proc.stdout
    assert "max_gpus" not in proc.stdout


def test_dry_run_refuses_what_the_run_would_refuse(tmp_path):
    """Data, tokenizer and allow-list checks run in a dry run too (it said "would launch", exit
    0, for a job whose data file is missing); and a sequence longer than the model's positions
    is the model's rule, not "fits no GPU"."""
    job = "name: t\nmodel: gpt2-tiny\nseq_len: 64\nglobal_batch: 8\ntrain_steps: 4\nprecision: fp32\n"
    (tmp_path / "missing.yaml").write_text(job + "data: {kind: text, path: nowhere.txt}\n")
    proc = frenzy("run", "missing.yaml", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2 and "would launch" not in proc.stdout, proc.stdout
    [line] = proc.stderr.strip().splitlines()
    assert "data.path" in line and "nowhere.txt" in line
    (tmp_path / "long.yaml").write_text(job.replace("seq_len: 64", "seq_len: 1000"))
    proc = frenzy("run", "long.yaml", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "seq_len: exceeds the learned position table of gpt2-tiny (1000 > 256)" in line
    assert not (tmp_path / ".frenzy").exists()


def test_dry_run_places_on_the_cluster_and_names_the_node(tmp_path):
    from estimator.job import TrainingJob
    from frenzy_flows.dryrun import dry_run, dry_run_lines
    from scheduler.cluster import parse_cluster

    job = TrainingJob(name="mid", model="gpt2", seq_len=512, global_batch=8, train_steps=100, precision="bf16")
    cluster = parse_cluster(SMALL_CLUSTER)
    d = dry_run(job, cluster, safety_margin_gib=1.0, policy="frenzy", workers=lambda pool: 0)
    assert d["launch"] and d["pool"] in ("a10", "l4")
    assert d["gpus"] == sum(len(v) for v in d["placement"].values())
    text = "\n".join(dry_run_lines(d))
    assert f"would launch: {d['gpus']} x {d['gpu_type']}" in text
    assert f"no worker online in pool {d['pool']}" in text
    # a GPU pool of another machine: waited for, never trained on the control machine
    assert "never trains this pool's plan on the control machine" in d["worker"]
    if d["pool"] == "l4":
        assert "node-l4" in d["worker"]


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_flow_dry_run_returns_the_report_and_leaves_the_ledger_alone(frenzy_home, tmp_path):
    from frenzy_flows import submit_training
    from frenzy_flows.dryrun import DRY_RUN_KEY

    (tmp_path / "cluster.yaml").write_text("pools:\n  - {name: cpu-dry, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")
    job = {"name": "dry", "model": "gpt2-tiny", "seq_len": 64, "global_batch": 8, "train_steps": 5, "precision": "fp32"}
    # as the submission would: a pool Prefect does not have is no candidate (the dry run had
    # said "would launch" where the run then refused)
    d = submit_training(job=job, cluster=str(tmp_path / "cluster.yaml"), dry_run=True)
    assert not d["launch"] and "no Prefect work pool registered" in d["reason"]
    _register("cpu-dry")
    d = submit_training(job=job, cluster=str(tmp_path / "cluster.yaml"), dry_run=True)
    assert d["launch"] and d["pool"] == "cpu-dry"
    assert "no worker online in pool cpu-dry" in d["worker"]
    assert not frenzy_home.exists()                       # no ledger database, no run folder
    from prefect import get_client
    with get_client(sync_client=True) as client:
        art = client.read_latest_artifacts()
    assert any(a.key == DRY_RUN_KEY and "would launch" in (a.data or "") for a in art)


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_flow_takes_the_cluster_as_a_gpu_cluster_block(frenzy_home):
    from blocks.cluster import GPUCluster
    from frenzy_flows import submit_training
    from scheduler.cluster import parse_cluster

    block = GPUCluster.from_cluster(parse_cluster("pools:\n  - {name: cpu-block, gpu: cpu, nodes: 1, gpus_per_node: 1}\n"))
    job = {"name": "dry-block", "model": "gpt2-tiny", "seq_len": 64, "global_batch": 8, "train_steps": 5,
           "precision": "fp32"}
    _register("cpu-block")
    d = submit_training(job=job, cluster=block, dry_run=True)
    assert d["launch"] and d["pool"] == "cpu-block" and d["gpu_type"] == "CPU"     # 'cpu' resolved too


def _register(pool: str) -> None:
    """A work pool on the test server (what `frenzy pools sync` makes)."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            pass


A100_NODE = "pools:\n  - {name: a100, gpu: A100-80GB, nodes: 1, gpus_per_node: 8}\n"
MID = "name: mid\nmodel: llama-3.2-1b\nseq_len: 1024\nglobal_batch: 16\ntrain_steps: 10\nprecision: bf16\n"


def test_dry_run_honours_the_plan_filter(tmp_path):
    (tmp_path / "mid.yaml").write_text(MID)
    (tmp_path / "cluster.yaml").write_text(A100_NODE)
    args = ("run", "mid.yaml", "--cluster", "cluster.yaml", "--dry-run", "--json")
    free = json.loads(frenzy(*args, cwd=tmp_path).stdout)
    assert free["launch"] and free["plan_detail"]["tp"] == 1          # unfiltered: a tp=1 plan wins
    proc = frenzy(*args, "--plan", "tp=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(proc.stdout)
    assert d["launch"] and d["plan_detail"]["tp"] == 2 and d["plan_filter"] == "tp=2"
    assert " tp2 " in d["plan"] and " tp2 " in d["fastest_plan"]
    text = frenzy("run", "mid.yaml", "--cluster", "cluster.yaml", "--dry-run", "--plan", "tp=2,zero=1",
                  cwd=tmp_path).stdout
    assert "plans kept by --plan 'tp=2,zero=1'" in text and " tp2 " in text and " z1 " in text
    for bad, says in (("tp=3", "tp=3 must divide the model's 32 attention heads"),
                      ("gpus=64", "no feasible plan matches 'gpus=64'"), ("tq=2", "unknown knob 'tq'")):
        proc = frenzy(*args[:-1], "--plan", bad, cwd=tmp_path)
        assert proc.returncode == 2 and says in proc.stderr, (bad, proc.stderr[-2000:])
        assert proc.stderr.strip().count("\n") == 0
    assert not (tmp_path / ".frenzy").exists()


def test_a_plan_kind_the_trainer_cannot_launch_is_refused_before_prefect_starts(tmp_path):
    """`--plan pp=2` on a GPT model (pipeline stages are built for llama decoders): the run said
    so only from the flow, after starting the embedded Prefect server and syncing pools; the dry
    run then also listed "needs at least 1 x CPU (the cluster has 2)", which is no answer."""
    (tmp_path / "tiny.yaml").write_text("name: pp2\nmodel: gpt2-tiny\nseq_len: 32\nglobal_batch: 4\n"
                                        "train_steps: 2\nprecision: fp32\n")
    run = frenzy("run", "tiny.yaml", "--plan", "pp=2", cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.strip().count("\n") == 0, run.stderr[-2000:]
    assert "plan: no plan that fits can be launched here" in run.stderr and "llama decoders" in run.stderr
    assert not (tmp_path / "home" / ".prefect").exists() and not (tmp_path / ".frenzy").exists()
    dry = frenzy("run", "tiny.yaml", "--plan", "pp=2", "--dry-run", "--json", cwd=tmp_path)
    d = json.loads(dry.stdout)
    assert dry.returncode == 2 and not d["launch"] and "llama decoders" in d["reason"]
    assert d["needs"] == []                 # the cluster has GPUs enough; the plan kind is the reason
