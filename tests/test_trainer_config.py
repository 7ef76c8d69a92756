"""Launch configuration from a plan: Accelerate + DeepSpeed configs, validation, files."""
from __future__ import annotations

import json

import pytest
import yaml

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.plan import Plan
from trainer.launch_config import (accelerate_config, deepspeed_config, validate_deepspeed_config,
                                   write_launch_files)

JOB = TrainingJob(model="gpt2-tiny", seq_len=64, global_batch=32, train_steps=4)


def plan(**kw) -> Plan:
    base = dict(gpu_type="A100-80GB", gpus=4, dp=4, micro_batch=2, grad_accum=4)
    base.update(kw)
    return Plan(**base)


def test_accelerate_config_plain_data_parallel():
    cfg = accelerate_config(plan(precision="bf16"), main_port=29600)
    assert cfg["distributed_type"] == "MULTI_GPU"
    assert cfg["num_processes"] == 4 and cfg["num_machines"] == 1 and cfg["machine_rank"] == 0
    assert cfg["mixed_precision"] == "bf16" and cfg["main_process_port"] == 29600
    assert "deepspeed_config" not in cfg and cfg["use_cpu"] is False
    single = accelerate_config(plan(gpus=1, dp=1, micro_batch=4, grad_accum=8, precision="fp32"), cpu=True)
    assert single["distributed_type"] == "NO" and single["mixed_precision"] == "no" and single["use_cpu"] is True


def test_accelerate_config_multi_node_needs_address_and_divides():
    cfg = accelerate_config(plan(gpus=8, dp=8, grad_accum=2), num_machines=2, machine_rank=1,
                            main_address="10.0.0.1", main_port=29555)
    assert (cfg["num_machines"], cfg["machine_rank"], cfg["main_process_ip"]) == (2, 1, "10.0.0.1")
    with pytest.raises(FrenzyInputError, match="main_address"):
        accelerate_config(plan(gpus=8, dp=8, grad_accum=2), num_machines=2)
    with pytest.raises(FrenzyInputError, match="num_machines"):
        accelerate_config(plan(gpus=4), num_machines=3, main_address="h")


def test_deepspeed_config_keeps_global_batch_and_maps_knobs():
    p = plan(zero=3, offload="optimizer+params", act_ckpt="full", precision="fp16", micro_batch=1, grad_accum=8)
    ds = deepspeed_config(p, JOB)
    assert ds["train_batch_size"] == 32 == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 4
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert ds["fp16"]["enabled"] is True and ds["bf16"]["enabled"] is False
    assert "activation_checkpointing" in ds
    z2 = deepspeed_config(plan(zero=2, offload="optimizer"), JOB)
    assert "offload_param" not in z2["zero_optimization"] and z2["bf16"]["enabled"] is True
    assert deepspeed_config(plan(zero=0), JOB) is None
    acc = accelerate_config(p)
    assert acc["distributed_type"] == "DEEPSPEED" and acc["deepspeed_config"]["zero3_init_flag"] is True
    assert "mixed_precision" not in acc          # the DeepSpeed file carries precision


def test_deepspeed_config_refuses_a_plan_that_changes_the_global_batch():
    with pytest.raises(FrenzyInputError, match="global_batch"):
        deepspeed_config(plan(zero=2, micro_batch=4), JOB)


def test_deepspeeds_own_config_class_accepts_ours_and_rejects_broken_ones():
    ds = deepspeed_config(plan(zero=2), JOB)
    validate_deepspeed_config(ds, dp=4)
    with pytest.raises(FrenzyInputError, match="deepspeed_config"):
        validate_deepspeed_config(ds, dp=3)                       # batch triple broken
    broken = json.loads(json.dumps(ds))
    broken["zero_optimization"]["stage"] = 7
    with pytest.raises(FrenzyInputError, match="rejected by DeepSpeed"):
        validate_deepspeed_config(broken, dp=4)
    both = json.loads(json.dumps(ds))
    both["fp16"]["enabled"] = True                                 # fp16 and bf16 at once
    with pytest.raises(FrenzyInputError, match="rejected by DeepSpeed"):
        validate_deepspeed_config(both, dp=4)


@pytest.mark.parametrize("bad,field", [
    (dict(cp=2, tp=2, gpus=4, dp=1, grad_accum=16), "plan.cp"),  # Ulysses beside TP: not launched
    (dict(tp=2, gpus=2, dp=2, grad_accum=8), "plan.gpus"),       # gpus must be dp x tp
    (dict(pp=2, gpus=4, dp=2, grad_accum=8, zero=2, offload="optimizer"), "plan.pp"),   # offload beside pipeline parallel
    (dict(offload="optimizer", zero=0), "plan.offload"),
    (dict(offload="optimizer+params", zero=2), "plan.offload"),
])
def test_unrealisable_plans_are_refused_and_nothing_is_written(tmp_path, bad, field):
    with pytest.raises(FrenzyInputError) as e:
        write_launch_files(tmp_path / "run", plan(**bad), JOB)
    assert e.value.field == field
    assert not (tmp_path / "run").exists()


def test_write_launch_files_writes_configs_and_spec(tmp_path):
    p = plan(gpu_type="CPU", gpus=2, dp=2, zero=2, micro_batch=4, grad_accum=4)
    paths = write_launch_files(tmp_path, p, JOB, main_port=29777)
    acc = yaml.safe_load(paths.accelerate.read_text())
    assert acc["distributed_type"] == "DEEPSPEED" and acc["num_processes"] == 2 and acc["use_cpu"] is True
    assert acc["deepspeed_config"]["deepspeed_config_file"] == str(paths.deepspeed.resolve())
    ds = json.loads(paths.deepspeed.read_text())
    assert ds["zero_optimization"]["stage"] == 2 and ds["train_batch_size"] == 32
    spec = json.loads(paths.spec.read_text())
    assert spec["hf_config"]["model_type"] == "gpt2" and spec["hf_config"]["n_layer"] == 2
    assert spec["steps"] == 4 and spec["plan"]["zero"] == 2 and spec["global_batch"] == 32
    # a fallback to a plan without ZeRO removes the stale DeepSpeed file
    paths2 = write_launch_files(tmp_path, p.model_copy(update={"zero": 0}), JOB)
    assert paths2.deepspeed is None and not (tmp_path / "deepspeed.json").exists()
    assert yaml.safe_load(paths2.accelerate.read_text())["distributed_type"] == "MULTI_GPU"
