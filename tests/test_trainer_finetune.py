"""Real fine-tunes: pretrained weights (a model folder, a Hub id in the local cache), LoRA through
PEFT, schedules, the eval split, the Hugging Face export, MLflow tracking, the control file (stop
at a step boundary, relaunch on another data-parallel plan with the identical loss sequence),
deadline stops and resubmission resume; bad input refused in one line before any GPU is taken."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.plan import Plan

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "finetune-lora.yaml"
TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "max_position_embeddings": 256,
        "tie_word_embeddings": False}


def _maker():
    spec = importlib.util.spec_from_file_location("make_tiny_model", ROOT / "examples" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def example_model() -> Path:
    """The examples' tiny pretrained model (what `make setup` makes), made once if missing."""
    maker = _maker()
    if not maker.is_made(maker.DEFAULT_OUT):
        maker.make(maker.DEFAULT_OUT)
    return maker.DEFAULT_OUT


@pytest.fixture(scope="session")
def random_model(tmp_path_factory) -> Path:
    """A tiny Llama saved with save_pretrained (random weights: enough for the checks)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("models") / "tiny"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**TINY)).save_pretrained(str(out))
    return out


def job(**kw) -> TrainingJob:
    base = dict(seq_len=32, global_batch=4, train_steps=4, lr=3e-3, checkpoint_every=2, precision="fp32",
                tracking={"enabled": False})
    base.update(kw)
    return TrainingJob(**base)


def cpu_plan(j: TrainingJob, gpus: int = 1, micro_batch: int = 2, zero: int = 0) -> Plan:
    per_rank = j.global_batch // gpus
    return Plan(gpu_type="CPU", gpus=gpus, dp=gpus, micro_batch=micro_batch, grad_accum=per_rank // micro_batch,
                precision=j.precision, zero=zero)


def train(j: TrainingJob, plan: Plan, run_dir: Path, **kw):
    from trainer.runner import run_training

    lines: list[str] = []
    res = run_training(j, plan, run_dir=run_dir, acquire=lambda p: [f"cpu{i}" for i in range(p.gpus)],
                       release=lambda: None, log=lines.append, backoff_s=0.1, grace_s=5, **kw)
    return res, lines


# ------------------------------------------------------------------------------- pure pieces
def test_lr_schedules_are_functions_of_the_step():
    from trainer.optim import lr_at

    assert lr_at(1, 1e-3, 1000) == pytest.approx(1e-5)                      # default: 10% warm-up, <= 100
    assert lr_at(100, 1e-3, 1000) == 1e-3 == lr_at(1000, 1e-3, 1000)
    lin = {"kind": "linear", "warmup_steps": 10, "min_lr_ratio": 0.1}
    cos = {"kind": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.0}
    assert lr_at(5, 1.0, 110, lin) == pytest.approx(0.5)
    assert lr_at(10, 1.0, 110, lin) == pytest.approx(1.0)
    assert lr_at(60, 1.0, 110, lin) == pytest.approx(0.55)                  # half way down to 0.1
    assert lr_at(110, 1.0, 110, lin) == pytest.approx(0.1)
    assert lr_at(60, 1.0, 110, cos) == pytest.approx(0.5)
    assert lr_at(110, 1.0, 110, cos) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(1, 1.0, 10, {"warmup_steps": 0}) == 1.0


def test_optimizer_implementation_per_device_and_plan():
    from trainer.optim import optimizer_impl

    assert optimizer_impl("adamw", device_type="cuda", zero=3, offload="none") == "deepspeed.ops.adam.FusedAdam"
    assert optimizer_impl("adamw", device_type="cuda", zero=1, offload="none") == "deepspeed.ops.adam.FusedAdam"
    assert optimizer_impl("adamw", device_type="cuda", zero=3, offload="optimizer") == "deepspeed.ops.adam.DeepSpeedCPUAdam"
    assert optimizer_impl("adamw", device_type="cuda", zero=0, offload="none") == "torch.optim.AdamW(fused)"
    assert optimizer_impl("adam", device_type="cpu", zero=3, offload="none") == "torch.optim.Adam(fused)"
    # never torch's default (foreach) AdamW for the Adam family
    for dev in ("cuda", "cpu"):
        for z in range(4):
            assert "fused" in optimizer_impl("adamw", device_type=dev, zero=z, offload="none").lower()


def test_launch_files_carry_the_training_controls():
    from blocks import FrenzySettings
    from trainer.launch_config import accelerate_config, deepspeed_config
    from trainer.tracking import tracking_uri, with_tracking_default

    j = job(model="gpt2-tiny", precision="bf16", master_weights="none", optim={"grad_clip": 0.5})
    z3 = Plan(gpu_type="H100-80GB", gpus=2, dp=2, micro_batch=2, grad_accum=1, zero=3, precision="bf16")
    ds = deepspeed_config(z3, j)
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True   # the export gathers
    assert deepspeed_config(z3, job(model="gpt2-tiny", optim={"grad_clip": None}))["gradient_clipping"] == 0.0
    ddp = Plan(gpu_type="H100-80GB", gpus=2, dp=2, micro_batch=2, grad_accum=1, precision="bf16")
    assert accelerate_config(ddp, master_weights="none")["mixed_precision"] == "no"         # weights are bf16
    assert accelerate_config(ddp)["mixed_precision"] == "bf16"
    site = FrenzySettings(mlflow_tracking_uri="http://mlflow.internal:5000")
    assert tracking_uri(with_tracking_default(j, site)) == "http://mlflow.internal:5000"
    own = job(model="gpt2-tiny", tracking={"uri": "sqlite:////tmp/x.db"})
    assert with_tracking_default(own, site).tracking.uri == "sqlite:////tmp/x.db"           # the job's wins


def test_a_runs_segments_log_into_one_mlflow_run(tmp_path):
    """A re-size or a preemption relaunches the training in a new segment: each segment had
    started an MLflow run of its own, so one job showed as several runs, its loss curve cut up.
    The run's folder records its MLflow run; later segments continue it (params stay the first
    segment's, each segment's plan a tag); another store, or a deleted run, gets a new one."""
    from mlflow.tracking import MlflowClient

    from trainer.tracking import RUN_FILE, Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    j = job(model="gpt2-tiny", name="seg", tracking={"uri": uri})
    p2, p1 = cpu_plan(j, gpus=2), cpu_plan(j, gpus=1)
    lines: list[str] = []
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ids = []
    for seg, (plan, steps) in enumerate([(p2, (1, 2)), (p1, (3, 4))], start=1):
        t = Tracker(j, plan, run_dir, lines.append)
        for step in steps:
            t.on_line("FRENZY_STEP", {"step": step, "loss": 5.0 - step, "step_time_s": 0.1, "tokens": 64})
        t.finish("stopped" if seg == 1 else "completed", measured={}, final_plan=plan, export_dir=None,
                 steps=steps[-1])
        ids.append(t.run_id)
    assert ids[0] == ids[1] and json.loads((run_dir / RUN_FILE).read_text())["run_id"] == ids[0]
    client = MlflowClient(uri)
    run = client.get_run(ids[0])
    assert [m.step for m in client.get_metric_history(ids[0], "loss")] == [1, 2, 3, 4]
    assert run.info.status == "FINISHED" and run.data.params["plan.gpus"] == "2"
    assert run.data.tags["frenzy.segments"] == "2" and run.data.tags["frenzy.segment.2.plan"] == p1.short()
    assert run.data.tags["frenzy.final_plan"] == p1.short() and not lines          # no MLflow error logged
    assert len(client.search_runs([run.info.experiment_id])) == 1
    # a deleted run, or a record of another store, starts a new run
    client.delete_run(ids[0])
    assert Tracker(j, p1, run_dir, lines.append).run_id != ids[0]
    other = job(model="gpt2-tiny", name="seg", tracking={"uri": f"sqlite:///{tmp_path / 'other.db'}"})
    assert Tracker(other, p1, run_dir, lines.append).run_id not in ids


def test_control_file_requests_are_atomic_and_acted_on_once(tmp_path):
    from trainer import control

    assert control.read_request(tmp_path) is None
    rid = control.request_stop(tmp_path, "resize", "r-1")
    assert json.loads((tmp_path / control.CONTROL_FILE).read_text()) == {"action": "stop", "reason": "resize",
                                                                         "request_id": "r-1"}
    req = control.read_request(tmp_path)
    assert req == {"action": "stop", "reason": "resize", "request_id": rid, "export": False}
    control.acknowledge(tmp_path, req, step=3)
    assert control.read_request(tmp_path) is None                           # a relaunch does not stop again
    control.request_stop(tmp_path, "deadline", export=True)
    assert control.read_request(tmp_path)["export"] is True
    (tmp_path / control.CONTROL_FILE).write_text("{half a fi")              # a broken writer
    assert control.read_request(tmp_path) is None
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []   # no temporary left
    with pytest.raises(ValueError):
        control.request(tmp_path, "pause", reason="x")


def _fake_run(root: Path, name: str, job_doc: dict, step: int, t: float, status: str | None):
    from trainer import checkpoints as ck
    from trainer import resume

    d = root / name
    c = ck.checkpoint_path(d, step)
    c.mkdir(parents=True)
    (c / ck.MARKER).write_text(json.dumps({"step": step, "format": {}, "time": t}))
    (d / resume.JOB_FILE).write_text(json.dumps({"job": job_doc}))
    if status:
        resume.record_result(d, status)
    return c


def test_resubmission_finds_the_newest_unfinished_run_of_the_same_training(tmp_path):
    from trainer import resume

    j = job(model="gpt2-tiny", name="nightly")
    doc = j.model_dump(mode="json")
    _fake_run(tmp_path, "nightly-a", doc, 4, 100.0, "stopped")
    newest = _fake_run(tmp_path, "nightly-b", doc, 6, 200.0, None)          # orchestrator died: no result
    _fake_run(tmp_path, "nightly-c", doc, 8, 300.0, "completed")            # finished: starts no resume
    _fake_run(tmp_path, "nightly-d", {**doc, "seq_len": 64}, 9, 400.0, "failed")   # another training
    _fake_run(tmp_path, "other-e", {**doc, "name": "other"}, 9, 500.0, "failed")
    run_dir = resume.prepare_run_dir(j, "nightly-new", tmp_path)
    assert json.loads((run_dir / resume.POINTER_FILE).read_text())["checkpoint"] == str(newest.resolve())
    ck = resume.resume_checkpoint(j, run_dir)
    assert ck.step == 6 and ck.path == newest.resolve()
    # more steps is the same training; an explicit resume_from wins
    assert resume.previous_checkpoint(j.model_copy(update={"train_steps": 99}), tmp_path).step == 6
    explicit = j.model_copy(update={"resume_from": "nightly-a"})
    assert resume.prepare_run_dir(explicit, "nightly-x", tmp_path) and \
        resume.resume_checkpoint(explicit, tmp_path / "nightly-x").step == 4
    with pytest.raises(FrenzyInputError) as e:
        resume.explicit_checkpoint("no-such-run", tmp_path)
    assert e.value.field == "resume_from"


def test_job_fields_and_their_rules():
    j = TrainingJob(init_from="org/model", seq_len=8, global_batch=2, train_steps=1)
    assert j.model == "org/model"                                            # sized as the weights that load
    assert TrainingJob(model="gpt2-tiny", seq_len=8, global_batch=2, train_steps=1).init_from is None
    bad = [({"eval": {"fraction": 1.0}}, "eval.fraction"), ({"eval": {"fraction": 0}}, "eval.fraction"),
           ({"eval": {"every": 5}}, "eval"), ({"optim": {"betas": [0.9, 1.0]}}, "optim.betas"),
           ({"schedule": {"kind": "step"}}, "schedule.kind")]
    from pydantic import ValidationError

    from estimator.errors import from_validation_error

    for extra, field in bad:
        with pytest.raises(ValidationError) as e:
            TrainingJob(model="gpt2-tiny", seq_len=8, global_batch=2, train_steps=1, **extra)
        assert from_validation_error(e.value).field.startswith(field), extra
    with pytest.raises(ValidationError, match="init_from"):
        TrainingJob(seq_len=8, global_batch=2, train_steps=1)


def test_hub_id_resolves_only_through_the_local_cache(tmp_path, monkeypatch, random_model):
    import shutil

    from huggingface_hub import constants

    from estimator.models import resolve_model
    from trainer.pretrained import start_folder

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    entry = tmp_path / "hub" / "models--someorg--tiny"
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text("abc123")
    shutil.copytree(random_model, entry / "snapshots" / "abc123")
    assert resolve_model("someorg/tiny").params == resolve_model(str(random_model)).params
    assert start_folder("someorg/tiny") == (entry / "snapshots" / "abc123").resolve()
    with pytest.raises(FrenzyInputError) as e:
        start_folder("someorg/absent")
    assert e.value.field == "init_from" and "models--someorg--absent" in str(e.value)


def test_loss_curve_and_mlflow_link_artifacts():
    from frenzy_flows.artifacts import loss_curve_rows, tracking_markdown

    rows = loss_curve_rows([3.0, 2.0, 1.5], [{"step": 6, "loss": 2.2}], first_step=5)
    assert rows == [{"step": 5, "loss": 3.0, "eval_loss": None}, {"step": 6, "loss": 2.0, "eval_loss": 2.2},
                    {"step": 7, "loss": 1.5, "eval_loss": None}]
    long = loss_curve_rows([1.0] * 1000, [{"step": 333, "loss": 0.5}], max_rows=100)
    assert len(long) <= 102 and {r["step"] for r in long} >= {1, 333, 1000}
    md = tracking_markdown({"mlflow_run_id": "r1", "mlflow_tracking_uri": "http://mlflow:5000",
                            "mlflow_url": "http://mlflow:5000/#/experiments/1/runs/r1", "status": "completed",
                            "eval_losses": [{"step": 4, "loss": 1.25}], "export_dir": "/x/export"})
    assert "(http://mlflow:5000/#/experiments/1/runs/r1)" in md and "1.2500" in md and "/x/export" in md
    assert tracking_markdown({}) is None


# ------------------------------------------------------------------------------- bad input
def test_starting_point_checks_name_the_field(tmp_path, random_model, monkeypatch):
    import shutil

    from trainer.pretrained import check_job

    with pytest.raises(FrenzyInputError) as e:
        check_job(job(init_from=str(tmp_path / "nope")))
    assert e.value.field == "init_from" and "does not exist" in str(e.value)
    (tmp_path / "HOW-TO-MAKE").write_text("make setup\n")
    with pytest.raises(FrenzyInputError, match="make it with `make setup`"):
        check_job(job(init_from=str(tmp_path / "nope")))
    # config/weights mismatch: a config that makes wider layers than the weights hold
    bad = tmp_path / "mismatch"
    shutil.copytree(random_model, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 96}))
    with pytest.raises(FrenzyInputError) as e:
        check_job(job(init_from=str(bad)))
    assert e.value.field == "init_from" and "do not match" in str(e.value) and "mlp" in str(e.value)
    empty = tmp_path / "noweights"
    empty.mkdir()
    shutil.copy(random_model / "config.json", empty / "config.json")
    with pytest.raises(FrenzyInputError, match="no safetensors"):
        check_job(job(init_from=str(empty)))
    with pytest.raises(FrenzyInputError) as e:
        check_job(job(init_from=str(random_model), model="gpt2-tiny"))
    assert e.value.field == "model"
    # LoRA targets that match nothing; one valid target list passes
    with pytest.raises(FrenzyInputError) as e:
        check_job(job(init_from=str(random_model), finetune={"method": "lora", "target_modules": ["q_proj", "c_attn"]}))
    assert e.value.field == "finetune.target_modules" and "'c_attn'" in str(e.value)
    assert check_job(job(init_from=str(random_model), finetune={"method": "lora", "target_modules": ["q_proj"]})) \
        == random_model.resolve()
    # QLoRA where bitsandbytes' GPU kernels are not available
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        importlib.machinery.PathFinder.find_spec(name))
    with pytest.raises(FrenzyInputError) as e:
        check_job(job(init_from=str(random_model), finetune={"method": "qlora"}))
    assert e.value.field == "finetune.method" and "bitsandbytes" in str(e.value)


def test_cli_refuses_bad_fine_tunes_in_one_line_before_prefect(tmp_path, random_model, monkeypatch, capsys):
    from frenzy_cli.main import main

    monkeypatch.setenv("FRENZY_HOME", str(tmp_path / "home"))
    cases = {
        "missing": (f"init_from: {tmp_path / 'absent'}\n", "init_from"),
        "fraction": (f"init_from: {random_model}\neval: {{fraction: 1.5}}\n", "eval.fraction"),
        "targets": (f"init_from: {random_model}\nfinetune: {{method: lora, target_modules: [nope]}}\n",
                    "finetune.target_modules"),
        "qlora": (f"init_from: {random_model}\nfinetune: {{method: qlora}}\n", "finetune.method"),
    }
    for name, (body, field) in cases.items():
        f = tmp_path / f"{name}.yaml"
        f.write_text("seq_len: 32\nglobal_batch: 4\ntrain_steps: 2\nprecision: fp32\n" + body)
        assert main(["run", str(f)]) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and f"error: {field}:" in err and "Traceback" not in err, (name, err)
    assert not (tmp_path / "home" / "prefect").exists()                      # nothing started


# ------------------------------------------------------------------------------- real runs
@pytest.mark.slow
def test_example_finetune_cli_exports_adapters_tracks_and_reloads(tmp_path, example_model):
    """`frenzy run examples/finetune-lora.yaml --json`, as the README says (from the checkout)."""
    import torch
    from mlflow.tracking import MlflowClient
    from transformers import AutoModelForCausalLM

    from trainer.data import TokenSource

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "FRENZY_", "MLFLOW_"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT), FRENZY_HOME=str(tmp_path / "home"))
    proc = subprocess.run([sys.executable, "-m", "frenzy_cli.main", "run", str(EXAMPLE.relative_to(ROOT)), "--json"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["status"] == "completed"
    export = Path(doc["export_dir"])
    assert (export / "adapter_config.json").is_file() and (export / "adapter_model.safetensors").is_file()
    # LoRA on q, k, v, o of 2 layers: r x (in + out) per projection (k, v project to 2 KV heads x 16)
    cfg = json.loads((example_model / "config.json").read_text())
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["hidden_size"] // cfg["num_attention_heads"]
    lora = cfg["num_hidden_layers"] * 8 * ((h + h) + (h + kv) + (h + kv) + (h + h))
    assert doc["trainable_params"] == lora and doc["params"] > 10 * lora
    assert [e["step"] for e in doc["eval_losses"]] == [10, 20, 30, 40]
    assert doc["eval_losses"][-1]["loss"] < doc["eval_losses"][0]["loss"]    # the fine-tune learns the text
    client = MlflowClient(doc["mlflow_tracking_uri"])
    assert doc["mlflow_tracking_uri"].startswith(f"sqlite:///{tmp_path / 'home'}")
    assert len(client.get_metric_history(doc["mlflow_run_id"], "loss")) == 40
    assert [m.value for m in client.get_metric_history(doc["mlflow_run_id"], "eval_loss")] == \
        pytest.approx([e["loss"] for e in doc["eval_losses"]])
    run = client.get_run(doc["mlflow_run_id"])
    assert run.data.params["job.finetune.method"] == "lora"
    assert run.data.params["model.trainable_params"] == str(lora) and run.info.status == "FINISHED"
    # the export reloads with from_pretrained and gives the run's last eval loss
    spec = json.loads((Path(doc["run_dir"]) / "train_spec.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(export)).eval()
    held = TokenSource(spec["data"], seq_len=spec["seq_len"], vocab=256, seed=spec["seed"],
                       holdout=spec["eval"]["fraction"], part="eval")
    x = held.batch(0, min(len(held), spec["eval"]["max_sequences"]))
    with torch.no_grad():
        loss = model(input_ids=x, labels=x).loss.item()
    assert loss == pytest.approx(doc["eval_losses"][-1]["loss"], abs=2e-6)


LLAMA_DIMS = {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 256}


@pytest.mark.slow
def test_stop_request_then_relaunch_on_one_rank_gives_the_same_losses(tmp_path):
    """2 gloo ranks stop on a control-file request after the same step; the relaunch on 1 rank
    with grad_accum 2 (same global batch, same sequences per step) continues the loss sequence
    of an uninterrupted run exactly."""
    from trainer import control
    from trainer.runner import run_training

    # 60 steps: the request, written when the parent reads step 2, must reach the ranks before
    # the run ends; 6 tiny steps could all finish first on a loaded machine (seen in CI)
    steps = 60
    j = job(model=LLAMA_DIMS, train_steps=steps, checkpoint_every=100, export={"enabled": False})
    ref, _ = train(j, cpu_plan(j, gpus=1, micro_batch=2), tmp_path / "ref")
    assert ref.status == "completed" and len(ref.losses) == steps

    run_dir = tmp_path / "run"

    def on_step(step, total, loss):
        if step == 2:
            control.request_stop(run_dir, "resize", "req-1")

    first = run_training(j, cpu_plan(j, gpus=2, micro_batch=2), run_dir=run_dir,
                         acquire=lambda p: [f"cpu{i}" for i in range(p.gpus)], release=lambda: None,
                         log=lambda line: None, on_step=on_step)
    assert first.status == "stopped" and first.stop.reason == "resize" and first.stop.request_id == "req-1"
    k = first.stop.step
    assert 2 <= k < steps and first.checkpoint_dir.endswith(f"step-{k:08d}")
    assert first.export_dir is None                                          # a re-size exports nothing
    second, _ = train(j, cpu_plan(j, gpus=1, micro_batch=2), run_dir)        # same folder, other plan
    assert second.status == "completed" and second.attempts[0].resumed_from_step == k
    assert first.losses + second.losses == pytest.approx(ref.losses, abs=1e-5)


@pytest.mark.slow
def test_deadline_stops_with_checkpoint_and_export_then_resubmission_resumes(tmp_path, example_model):
    from trainer import resume

    data = {"kind": "text", "path": str(ROOT / "examples" / "data" / "finetune.txt")}
    j = job(name="deadline-lora", init_from=str(example_model), data=data, train_steps=100000,
            checkpoint_every=100000, finetune={"method": "lora", "rank": 4, "dropout": 0.0},
            eval={"fraction": 0.1}, schedule={"kind": "cosine"})
    runs = tmp_path / "runs"
    first_dir = resume.prepare_run_dir(j, "deadline-lora-1", runs)
    res, lines = train(j, cpu_plan(j), first_dir, deadline_s=30)
    assert res.status == "stopped" and res.stop.reason == "deadline", (res.error, lines[-20:])
    k = res.stop.step
    assert res.checkpoint_dir.endswith(f"step-{k:08d}") and len(res.losses) == k
    assert (Path(res.export_dir) / "adapter_config.json").is_file()         # the stop exported the model
    assert any(l.startswith("frenzy: data: ") and "the data repeats" in l for l in lines)   # 100,000 steps of a small file
    assert res.eval_losses[-1].step == k
    # resubmitted under the same name: continues from step k instead of starting again
    again = j.model_copy(update={"train_steps": k + 2})
    second_dir = resume.prepare_run_dir(again, "deadline-lora-2", runs)
    res2, _ = train(again, cpu_plan(again), second_dir)
    assert res2.status == "completed" and res2.attempts[0].resumed_from_step == k
    assert res2.resumed_from.endswith(f"step-{k:08d}") and len(res2.losses) == 2
    assert math.isfinite(res2.losses[0]) and abs(res2.losses[0] - res.losses[-1]) < 0.5   # no restart from the base


@pytest.mark.slow
def test_zero3_loads_pretrained_weights_sharded_and_exports_them_consolidated(tmp_path, random_model):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    j = job(init_from=str(random_model), train_steps=2, eval={"fraction": 0.5, "max_sequences": 5})
    res, lines = train(j, cpu_plan(j, gpus=2, micro_batch=2, zero=3), tmp_path / "z3")
    assert res.status == "completed", (res.error, lines[-30:])
    assert len(res.eval_losses) == 1 and math.isfinite(res.eval_losses[0].loss)   # 5 sequences over 2 ranks
    assert res.optimizer_impl == "torch.optim.AdamW(fused)"                  # CPU: torch's fused kernel
    trained = AutoModelForCausalLM.from_pretrained(res.export_dir)
    start = load_file(str(random_model / "model.safetensors"))
    got = trained.state_dict()
    assert set(start) <= set(got) and all(got[k].shape == v.shape for k, v in start.items())
    changed = [k for k, v in start.items() if not torch.equal(got[k], v)]
    assert len(changed) > len(start) // 2                                    # trained from the loaded weights
    assert res.params == sum(v.numel() for v in start.values())
