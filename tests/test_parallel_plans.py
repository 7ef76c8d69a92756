"""Plans beyond data parallel, launched for real on the CPU (gloo): tensor parallel through
DeepSpeed's AutoTP with ZeRO beside it, sequence parallel through DeepSpeed Ulysses, CPU
offload, and re-planning a checkpoint across
layouts. Every multi-process run's losses are compared with a single-process run of the same
job from the same weights (CPU-only: gloo ranks, fp32)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.plan import Plan
from trainer.launch_config import accelerate_config, check_realisable, deepspeed_config, validate_deepspeed_config
from trainer.parallel import layout_of, plan_world, uses_deepspeed

TINY = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 172, "vocab_size": 256, "max_position_embeddings": 256,
        "tie_word_embeddings": False}
MATCH = 1e-4            # the bar: fp32 sums in another order differ ~1e-6 here


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    """Tiny Llama weights saved once: every run starts from them (ZeRO-3's partitioned
    construction draws another random initialisation than a plain one, so a fair comparison
    starts from the same saved weights)."""
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama", TINY)


def save_tiny_llama(out: Path, config: dict) -> Path:
    """A Llama of ``config`` from seed 0, saved with save_pretrained to ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**config)).save_pretrained(str(out))
    return out


def job(weights: Path, **kw) -> TrainingJob:
    base = dict(init_from=str(weights), seq_len=32, global_batch=4, train_steps=3, lr=3e-3, checkpoint_every=1,
                precision="fp32", tracking={"enabled": False}, export={"enabled": False},
                schedule={"warmup_steps": 0})
    base.update(kw)
    return TrainingJob(**base)


def plan(gpus: int = 1, **kw) -> Plan:
    kw.setdefault("dp", gpus // (kw.get("tp", 1) * kw.get("pp", 1) * kw.get("cp", 1)))
    per_rank = 4 // kw["dp"]
    kw.setdefault("micro_batch", per_rank)
    kw.setdefault("grad_accum", per_rank // kw["micro_batch"])
    return Plan(gpu_type="CPU", gpus=gpus, precision="fp32", **kw)


def train(j: TrainingJob, p: Plan, run_dir: Path):
    from trainer.runner import run_training

    lines: list[str] = []
    res = run_training(j, p, run_dir=run_dir, acquire=lambda q: [f"cpu{i}" for i in range(q.gpus)],
                       release=lambda: None, log=lines.append, backoff_s=0.1, grace_s=5, max_transient_retries=0)
    assert res.status == "completed", "\n".join(lines[-40:])
    return res, lines


@pytest.fixture(scope="module")
def reference_run(weights, tmp_path_factory):
    """The single-process run every layout must reproduce (its checkpoints of steps 2 and 3 kept)."""
    res, _ = train(job(weights), plan(1), tmp_path_factory.mktemp("ref") / "run")
    return res


@pytest.fixture(scope="module")
def reference(reference_run) -> list[float]:
    return reference_run.losses


@pytest.fixture(scope="module")
def tp_run(weights, tmp_path_factory):
    """tp=2 without ZeRO for the reference's 3 steps (a checkpoint each step, the newest two
    kept): the tp=2 check of that layout, and its step-2 checkpoint is the tensor-parallel start
    of the re-plan to data parallel (the learning rate is constant, so a 2-step run's final
    checkpoint is this run's step 2, as the reference's step 2 stands for its 2-step run)."""
    return train(job(weights), plan(2, tp=2, zero=0), tmp_path_factory.mktemp("tp") / "run")


@pytest.fixture(scope="module")
def pp_run(weights, tmp_path_factory):
    """pp=2 over 2 micro-batches for the reference's 3 steps: the pp=2 check, and its step-2
    checkpoint is the pipelined start of the re-plan to one process (as ``tp_run``'s)."""
    return train(job(weights), plan(2, pp=2, micro_batch=2), tmp_path_factory.mktemp("pp") / "run")


def assert_matches(losses: list[float], ref: list[float]) -> None:
    assert len(losses) == len(ref)
    worst = max(abs(a - b) for a, b in zip(losses, ref))
    print(f"losses {losses} reference {ref}: max |difference| {worst:.2e}")      # the figure (pytest -s)
    assert worst <= MATCH, (losses, ref)


# ------------------------------------------------------------------------------- pure pieces
def test_tensor_parallel_launch_files(weights):
    j = job(weights)
    p = plan(4, tp=2, zero=2)
    check_realisable(p)
    assert uses_deepspeed(p) and uses_deepspeed(plan(2, tp=2)) and not uses_deepspeed(plan(2))
    ds = deepspeed_config(plan(2, tp=2), j)
    assert ds["tensor_parallel"] == {"autotp_size": 2} and ds["zero_optimization"]["stage"] == 0
    # DeepSpeed derives the total (its batch check counts TP ranks differently per ZeRO stage)
    assert "train_batch_size" not in ds and ds["train_micro_batch_size_per_gpu"] == 4
    assert ds["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    validate_deepspeed_config(deepspeed_config(p, j), dp=p.dp)
    acc = accelerate_config(p, cpu=True)
    assert acc["distributed_type"] == "DEEPSPEED" and acc["num_processes"] == 4
    assert deepspeed_config(plan(2), j) is None


def test_layouts_the_trainer_refuses_name_the_setting():
    for bad, field in ((Plan(gpu_type="CPU", gpus=3, dp=1, tp=2), "plan.gpus"),):
        with pytest.raises(FrenzyInputError) as e:
            check_realisable(bad)
        assert e.value.field == field


def test_rank_layout_keeps_tensor_parallel_groups_consecutive():
    p = plan(4, tp=2)
    assert plan_world(p) == 4
    assert [(layout_of(p, r).dp_rank, layout_of(p, r).tp_rank) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [layout_of(plan(4, cp=2), r).dp_rank for r in range(4)] == [0, 0, 1, 1]
    with pytest.raises(ValueError):
        layout_of(p, 4)


# ------------------------------------------------------------------------------- real runs
@pytest.mark.slow
@pytest.mark.parametrize("zero", [0, 3])
def test_tensor_parallel_2_matches_one_process(weights, reference, tmp_path, zero, request):
    res, lines = request.getfixturevalue("tp_run") if zero == 0 else \
        train(job(weights), plan(2, tp=2, zero=zero), tmp_path / "run")
    assert_matches(res.losses, reference)
    assert any("dp=1 tp=2" in line for line in lines)
    ck = Path(res.checkpoint_dir)
    fmt = json.loads((ck / "frenzy_ckpt.json").read_text())["format"]
    assert fmt["tp"] == 2 and fmt["deepspeed"] and fmt["zero"] == zero
    assert (ck / "consolidated.safetensors").is_file()            # full weights for another layout


@pytest.mark.slow
@pytest.mark.parametrize("zero, offload", [(2, "optimizer"), (3, "optimizer+params")])
def test_offload_2_processes_match_one_process(weights, reference, tmp_path, zero, offload):
    """ZeRO-Offload: optimizer states (and with ZeRO-3 the parameters) on the host, stepped by
    DeepSpeed's CPU Adam (its op compiles on first use, ~2 min, then cached)."""
    res, lines = train(job(weights), plan(2, zero=zero, offload=offload), tmp_path / "run")
    assert_matches(res.losses, reference)
    assert res.optimizer_impl == "deepspeed.ops.adam.DeepSpeedCPUAdam"
    ds = json.loads((tmp_path / "run" / "deepspeed.json").read_text())["zero_optimization"]
    assert ds["offload_optimizer"]["device"] == "cpu"
    assert ("offload_param" in ds) == (offload == "optimizer+params")


def _resume_under(ck: Path, j: TrainingJob, p: Plan, run_dir: Path):
    import shutil

    shutil.copytree(ck, run_dir / "checkpoints" / ck.name)
    return train(j, p, run_dir)


@pytest.mark.slow
def test_a_tensor_parallel_checkpoint_resumes_under_data_parallel(weights, reference_run, tp_run, tmp_path):
    """Re-plan across layouts: tp=2 for 2 steps (``tp_run``'s step 2), then the same job (same
    global batch) goes on under dp=2 (ZeRO-1) from the consolidated weights; its step 3 equals
    that of the single-process run re-planned the same way at step 2 (both restart the
    optimizer state)."""
    first, _ = tp_run
    assert_matches(first.losses[:2], reference_run.losses[:2])
    tp_ck = Path(first.run_dir) / "checkpoints" / "step-00000002"
    assert (tp_ck / "consolidated.safetensors").is_file()
    j = job(weights)
    target = plan(2, zero=1)
    moved, lines = _resume_under(tp_ck, j, target, tmp_path / "from-tp")
    assert any(line.startswith("FRENZY_RESUME") and '"mode": "weights"' in line for line in lines)
    ref_ck = Path(reference_run.run_dir) / "checkpoints" / "step-00000002"
    same, _ = _resume_under(ref_ck, j, target, tmp_path / "from-one")
    assert len(moved.losses) == len(same.losses) == 1               # step 3 only: the count went on
    assert_matches(moved.losses, same.losses)
    assert moved.final_plan.dp == 2 and moved.final_plan.global_batch == j.global_batch


@pytest.mark.slow
def test_sequence_parallel_2_through_ulysses_matches_one_process(weights, reference, tmp_path):
    """cp=2: each rank holds half of every sequence. The weights come from from_pretrained,
    which returns a model in eval mode where Ulysses is silently bypassed (each half would
    attend only to itself): matching the reference shows the program trains in train mode."""
    res, lines = train(job(weights), plan(2, cp=2), tmp_path / "run")
    assert_matches(res.losses, reference)
    assert any("dp=1 tp=1 cp=2" in line for line in lines)


@pytest.mark.slow
def test_pipeline_2_matches_one_process(reference, pp_run):
    """pp=2 (torch.distributed.pipelining, 1F1B over 2 micro-batches): the single-process
    losses; one checkpoint file per stage and the consolidated weights beside them."""
    res, lines = pp_run
    assert_matches(res.losses, reference)
    assert any("dp=1 pp=2" in line and "Schedule1F1B" in line for line in lines)
    ck = Path(res.checkpoint_dir)
    assert (ck / "stage-00.pt").is_file() and (ck / "stage-01.pt").is_file()
    assert (ck / "consolidated.safetensors").is_file()
    assert json.loads((ck / "frenzy_ckpt.json").read_text())["format"]["pp"] == 2


@pytest.mark.slow
def test_data_parallel_2_x_pipeline_2_matches_one_process(weights, reference, tmp_path):
    """dp=2 x pp=2 (4 ranks, consecutive ranks one pipeline): gradients averaged over the two
    replicas of each stage."""
    res, lines = train(job(weights), plan(4, pp=2, micro_batch=1), tmp_path / "run")
    assert_matches(res.losses, reference)
    assert any("dp=2 pp=2" in line for line in lines)


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_on_one_process(weights, reference_run, pp_run, tmp_path):
    """Re-plan pp=2 -> dp=1: two pipelined steps (``pp_run``'s step 2), then step 3 on one
    process from the consolidated weights equals the single-process run re-planned the same way
    (optimizer restarted in both)."""
    first, _ = pp_run
    assert_matches(first.losses[:2], reference_run.losses[:2])
    pp_ck = Path(first.run_dir) / "checkpoints" / "step-00000002"
    assert (pp_ck / "stage-00.pt").is_file() and (pp_ck / "consolidated.safetensors").is_file()
    # one process under ZeRO-1: a layout change for both checkpoints, so both restart the optimizer
    j, target = job(weights), plan(1, zero=1)
    moved, lines = _resume_under(pp_ck, j, target, tmp_path / "from-pp")
    assert any(line.startswith("FRENZY_RESUME") and '"mode": "weights"' in line for line in lines)
    ref_ck = Path(reference_run.run_dir) / "checkpoints" / "step-00000002"
    same, _ = _resume_under(ref_ck, j, target, tmp_path / "from-one")
    assert len(moved.losses) == len(same.losses) == 1
    assert_matches(moved.losses, same.losses)


def test_pipeline_stages_reproduce_the_whole_model_and_its_loss():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.parallel.pipeline import build_stage_module, causal_lm_loss, pipe_layout, stage_layers

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY, "num_hidden_layers": 3}))
    x = torch.randint(0, TINY["vocab_size"], (2, 16))
    whole = model(input_ids=x, labels=x)
    stages = [build_stage_module(model, s, 2) for s in range(2)]
    logits = stages[1](stages[0](x))
    assert torch.equal(logits, whole.logits) and torch.equal(causal_lm_loss(logits, x), whole.loss)
    names = [set(s.full_names()) for s in stages]
    assert not names[0] & names[1] and names[0] | names[1] == {n for n, _ in model.named_parameters()}
    assert [stage_layers(3, 2, s) for s in range(2)] == [(0, 2), (2, 3)]
    assert [tuple(pipe_layout({"dp": 2, "pp": 2}, r))[2:] for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_pipeline_plans_the_trainer_launches_and_refuses():
    from trainer.checkpoints import full_resume_possible
    from trainer.launch_config import check_pipeline_model

    check_realisable(plan(2, pp=2, micro_batch=2))
    check_realisable(plan(4, pp=2, micro_batch=1))                  # dp=2 x pp=2
    for bad in (plan(2, pp=2, zero=1, micro_batch=2), plan(4, pp=2, tp=2, micro_batch=4)):
        with pytest.raises(FrenzyInputError, match="pipeline parallel runs beside data parallel only") as e:
            check_realisable(bad)
        assert e.value.field == "plan.pp"
    with pytest.raises(FrenzyInputError, match="built for llama decoders"):
        check_pipeline_model(plan(2, pp=2, micro_batch=2), "gpt")
    pp2 = {"deepspeed": False, "zero": 0, "world": 2, "offload": "none", "pp": 2}
    assert full_resume_possible(pp2, dict(pp2))
    assert not full_resume_possible(pp2, {**pp2, "pp": 1, "world": 1})     # weights only
    assert not full_resume_possible({**pp2, "pp": 1, "world": 1}, pp2)
