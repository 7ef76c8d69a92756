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


@pytest.fixture(scope="module")
def one_process_replanned(weights, reference_run, tmp_path_factory):
    """The single-process run re-planned at step 2 onto one ZeRO-1 process (a layout change:
    the optimizer restarts): the step 3 a pipelined checkpoint re-planned the same way gives."""
    ref_ck = Path(reference_run.run_dir) / "checkpoints" / "step-00000002"
    res, _ = _resume_under(ref_ck, job(weights), plan(1, zero=1), tmp_path_factory.mktemp("replan") / "from-one")
    return res


def assert_matches(losses: list[float], ref: list[float], tol: float = MATCH) -> None:
    assert len(losses) == len(ref)
    worst = max(abs(a - b) for a, b in zip(losses, ref))
    print(f"losses {losses} reference {ref}: max |difference| {worst:.2e}")      # the figure (pytest -s)
    assert worst <= tol, (losses, ref)


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
    DeepSpeed's CPU Adam (its op compiles on first use, ~2 min, then cached; `make test` builds it
    beforehand: scripts/prepare_tests.py)."""
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
def test_a_tensor_parallel_checkpoint_resumes_under_data_parallel(weights, reference_run, tp_run,
                                                                 one_process_replanned, tmp_path):
    """Re-plan across layouts: tp=2 for 2 steps (``tp_run``'s step 2), then the same job (same
    global batch) goes on under dp=2 (ZeRO-1) from the consolidated weights; its step 3 equals
    that of the single-process run re-planned at step 2 onto ZeRO-1 (both restart the optimizer
    state; dp=2 reproduces one process, as every layout here: the comparison run is the module's
    one-process re-plan, not a second dp=2 launch)."""
    first, _ = tp_run
    assert_matches(first.losses[:2], reference_run.losses[:2])
    tp_ck = Path(first.run_dir) / "checkpoints" / "step-00000002"
    assert (tp_ck / "consolidated.safetensors").is_file()
    j = job(weights)
    target = plan(2, zero=1)
    moved, lines = _resume_under(tp_ck, j, target, tmp_path / "from-tp")
    assert any(line.startswith("FRENZY_RESUME") and '"mode": "weights"' in line for line in lines)
    assert len(moved.losses) == len(one_process_replanned.losses) == 1    # step 3 only: the count went on
    assert_matches(moved.losses, one_process_replanned.losses)
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
def test_a_pipeline_checkpoint_resumes_on_one_process(weights, reference_run, pp_run, one_process_replanned,
                                                      tmp_path):
    """Re-plan pp=2 -> dp=1: two pipelined steps (``pp_run``'s step 2), then step 3 on one
    process from the consolidated weights equals the single-process run re-planned the same way
    (optimizer restarted in both)."""
    first, _ = pp_run
    assert_matches(first.losses[:2], reference_run.losses[:2])
    pp_ck = Path(first.run_dir) / "checkpoints" / "step-00000002"
    assert (pp_ck / "stage-00.pt").is_file() and (pp_ck / "consolidated.safetensors").is_file()
    # one process under ZeRO-1: a layout change for both checkpoints, so both restart the optimizer
    moved, lines = _resume_under(pp_ck, job(weights), plan(1, zero=1), tmp_path / "from-pp")
    assert any(line.startswith("FRENZY_RESUME") and '"mode": "weights"' in line for line in lines)
    assert len(moved.losses) == len(one_process_replanned.losses) == 1
    assert_matches(moved.losses, one_process_replanned.losses)


@pytest.mark.slow
def test_dp2_x_pp2_with_zero1_matches_one_process_and_resumes(weights, reference, one_process_replanned, tmp_path):
    """dp=2 x pp=2 with ZeRO-1 (4 ranks; ZeroRedundancyOptimizer over each stage's two
    replicas): the single-process losses. Its step-2 checkpoint (one file per stage with the
    stage's whole optimizer state, gathered from the shards) resumes fully under the same plan
    to the uninterrupted run's step 3, and onto one process from the consolidated weights to
    the single-process run's re-plan."""
    p = plan(4, pp=2, zero=1, micro_batch=1)
    res, lines = train(job(weights), p, tmp_path / "run")
    assert_matches(res.losses, reference)
    assert any("dp=2 pp=2 vpp=1 zero=1" in line for line in lines)
    assert res.optimizer_impl.startswith("torch.distributed.optim.ZeroRedundancyOptimizer(")
    step2 = Path(res.run_dir) / "checkpoints" / "step-00000002"
    assert json.loads((step2 / "frenzy_ckpt.json").read_text())["format"]["zero"] == 1
    assert_resumes_fully(res, step2, job(weights), p, tmp_path / "again")
    moved, lines = _resume_under(step2, job(weights), plan(1, zero=1), tmp_path / "one")
    assert any(line.startswith("FRENZY_RESUME") and '"mode": "weights"' in line for line in lines)
    assert_matches(moved.losses, one_process_replanned.losses)


@pytest.mark.slow
@pytest.mark.parametrize("zero", [2, 3])
def test_dp2_x_pp2_with_fsdp2_zero_matches_one_process(weights, reference, tmp_path, zero):
    """dp=2 x pp=2 with ZeRO-2/3 (4 ranks; FSDP2 over each stage's two replicas, reducing and
    resharding after every micro-batch's backward): the single-process losses, and the stage files hold
    whole tensors gathered from the shards. ZeRO-3's step-2 checkpoint resumes fully under the
    same plan (weights and optimizer states scattered back to the shards) to the uninterrupted
    run's step 3, weights and all (a restarted Adam moves every weight by ~lr instead)."""
    import torch
    from safetensors.torch import load_file

    p = plan(4, pp=2, zero=zero, micro_batch=1)
    res, lines = train(job(weights), p, tmp_path / "run")
    assert_matches(res.losses, reference)
    assert any(f"dp=2 pp=2 vpp=1 zero={zero}" in line for line in lines)
    assert res.optimizer_impl.startswith("torch.distributed.fsdp.fully_shard(")
    step2 = Path(res.run_dir) / "checkpoints" / "step-00000002"
    whole = load_file(str(step2 / "consolidated.safetensors"))       # what another layout loads
    shapes = {"model.embed_tokens.weight": (256, 64), "lm_head.weight": (256, 64),
              "model.layers.1.mlp.down_proj.weight": (64, 172)}
    assert {k: tuple(whole[k].shape) for k in shapes} == shapes
    states = torch.load(step2 / "stage-01.pt", weights_only=False)["optimizer"]["state"]
    assert tuple(states["0.lm_head.weight"]["exp_avg"].shape) == (256, 64)
    if zero == 3:
        assert_resumes_fully(res, step2, job(weights), p, tmp_path / "again")


@pytest.mark.slow
def test_pp2_x_tp2_matches_one_process_and_replans_to_one(weights, reference_run, one_process_replanned, tmp_path):
    """pp=2 x tp=2 (4 ranks: each stage's layers, embeddings and head sharded over its 2 tp
    ranks by torch's DTensor tensor parallel, 1F1B over 2 micro-batches): the single-process
    losses, and its global gradient norm before clipping (``grad_norm`` of the step lines; the
    norm ~1.5 > grad_clip 1, so every step clips) that of the single process. Its step-2
    checkpoint holds whole tensors gathered from the tp shards: it resumes fully under the same
    plan to the uninterrupted step 3, and a re-plan onto one process from the consolidated
    weights gives the single-process re-plan's step 3."""
    from safetensors.torch import load_file

    p = plan(4, pp=2, tp=2, micro_batch=2)
    res, lines = train(job(weights), p, tmp_path / "run")
    assert_matches(res.losses, reference_run.losses)
    norms = grad_norms(res.run_dir)
    assert len(norms) == 3 and min(norms) > 1.0
    assert_matches(norms, grad_norms(reference_run.run_dir))
    assert any("dp=1 pp=2 vpp=1 zero=0 tp=2" in line and "Schedule1F1B" in line for line in lines)
    assert res.optimizer_impl == "torch.distributed.tensor.parallel(torch.optim.AdamW(fused))"
    step2 = Path(res.run_dir) / "checkpoints" / "step-00000002"
    assert json.loads((step2 / "frenzy_ckpt.json").read_text())["format"]["tp"] == 2
    whole = load_file(str(step2 / "consolidated.safetensors"))
    shapes = {"model.embed_tokens.weight": (256, 64), "lm_head.weight": (256, 64),
              "model.layers.0.self_attn.k_proj.weight": (32, 64), "model.layers.1.mlp.down_proj.weight": (64, 172)}
    assert {k: tuple(whole[k].shape) for k in shapes} == shapes
    assert_resumes_fully(res, step2, job(weights), p, tmp_path / "again")
    moved, lines = _resume_under(step2, job(weights), plan(1, zero=1), tmp_path / "one")
    assert any(line.startswith("FRENZY_RESUME") and '"mode": "weights"' in line for line in lines)
    assert_matches(moved.losses, one_process_replanned.losses)


@pytest.mark.slow
def test_qwen3_per_head_norms_learn_alike_under_pp2_x_tp2(tmp_path):
    """Qwen3 normalises each head's queries and keys with one whole ``head_dim`` weight
    (``replicated_with_grad_allreduce`` in its tensor-parallel plan): under pp=2 x tp=2 each tp
    rank sees only its heads, so its gradient is a partial sum the step adds over the tp ranks.
    The losses, and those norm weights after 3 steps, are the single process's (without the sum
    the losses still agree to 1e-6 here, Adam's first steps reading mostly the gradient's sign:
    the weights tell)."""
    from safetensors.torch import load_file

    w = save_tiny_llama(tmp_path / "tiny-qwen3", {**TINY, "model_type": "qwen3", "head_dim": 32,
                                                   "attention_bias": False, "use_sliding_window": False})
    ref, _ = train(job(w), plan(1), tmp_path / "ref")
    res, _ = train(job(w), plan(4, pp=2, tp=2, micro_batch=2), tmp_path / "run")
    assert_matches(res.losses, ref.losses)
    step3 = "checkpoints/step-00000003"
    one = load_file(str(Path(ref.run_dir) / step3 / "model.safetensors"))
    four = load_file(str(Path(res.run_dir) / step3 / "consolidated.safetensors"))
    start = load_file(str(w / "model.safetensors"))
    norms = [k for k in one if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * TINY["num_hidden_layers"]             # q_norm and k_norm per layer
    assert min(float((one[k] - start[k]).abs().max()) for k in norms) > 1e-3      # they learned
    assert max(float((one[k] - four[k]).abs().max()) for k in norms) <= 1e-6


GEMMA3 = {**TINY, "model_type": "gemma3_text", "head_dim": 32, "sliding_window": 16, "tie_word_embeddings": True,
          # the 32-token rows reach the local layer's window; the global layer rotates at another base
          "layer_types": ["sliding_attention", "full_attention"]}
# caps of 0.5 bind on these tiny logits: without the last stage's cap pp=2's losses are 4e-3 off
GEMMA2 = {**TINY, "model_type": "gemma2", "head_dim": 32, "sliding_window": 16, "tie_word_embeddings": True,
          "final_logit_softcapping": 0.5, "attn_logit_softcapping": 0.5}


@pytest.mark.parametrize("cfg", [GEMMA3, GEMMA2], ids=["gemma3", "gemma2"])
def test_gemma_pipeline_stages_compute_the_models_logits(cfg):
    """Gemma 3: scaled tied embedding, four norms a block, per-head q/k norms, a local layer with a
    sliding window and a global one, each with its own rotary base (a stage rotates each layer
    by its own type). Gemma 2: soft-capped scores and logits (the model caps the logits after
    the head, so the last stage must too), eager attention. Two stages chained compute the
    whole model's logits. (Launched for real under pp=2, pp=2 x tp=2, tp=2 for Gemma 3 and
    dp=2 ZeRO-3, their losses agreed with one process's to 1e-6: run by hand,
    docs/parallel-plans.md; the Llama and Qwen3 runs here launch the same path.)"""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.parallel.pipeline import build_stage_module

    torch.manual_seed(0)
    attn = "eager" if cfg["model_type"] == "gemma2" else "sdpa"
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg, attn_implementation=attn))
    ids = torch.randint(0, cfg["vocab_size"], (2, 32))
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        staged = build_stage_module(model, 1, 2)(build_stage_module(model, 0, 2)(ids))
    assert torch.allclose(staged, whole, atol=1e-5), float((staged - whole).abs().max())


def test_autotp_is_refused_where_it_keeps_gemmas_embedding_whole(tmp_path):
    """AutoTP leaves Gemma's and Gemma 2's scaled embedding (and the head tied to it) whole on
    every rank, which no tp estimate counts: tp without pipeline stages is refused in one line,
    by the planner and by the trainer; the pipeline's tensor parallel and Gemma 3 are not."""
    from estimator.models import resolve_model
    from estimator.plans import not_launchable_reason
    from trainer.launch_config import training_spec

    gemma = {**TINY, "model_type": "gemma", "head_dim": 32, "tie_word_embeddings": True}
    for cfg in (gemma, GEMMA2):
        why = not_launchable_reason(plan(2, tp=2), resolve_model(cfg))
        assert why is not None and why.startswith("plan.tp:") and cfg["model_type"] in why
        assert not_launchable_reason(plan(4, pp=2, tp=2, micro_batch=2), resolve_model(cfg)) is None
    assert not_launchable_reason(plan(2, tp=2), resolve_model(GEMMA3)) is None
    with pytest.raises(FrenzyInputError) as e:
        training_spec(job(tmp_path, model=gemma, init_from=None), plan(2, tp=2), tmp_path)
    assert e.value.field == "plan.tp"


def grad_norms(run_dir) -> list[float]:
    """The ``grad_norm`` of every step line in a run's first attempt log."""
    from trainer.loglines import parse_line
    from trainer.runner import attempt_log

    parsed = [parse_line(line) for line in attempt_log(Path(run_dir), 1).read_text().splitlines()]
    return [p[1]["grad_norm"] for p in parsed if p is not None and p[0] == "FRENZY_STEP"]


def test_the_pipeline_norm_counts_every_gradient_value_once():
    """The global gradient norm divides each rank's squares by the ranks holding the same
    values: a plain tensor is equal over the stage's dp x tp ranks, a tp-sharded DTensor over
    its dp replicas, FSDP2's shards (a ``_StridedShard`` over dp beside tp) over none."""
    from types import SimpleNamespace

    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from trainer.parallel.pipeline import copies

    def grad(*placements, sizes):
        return SimpleNamespace(placements=placements, device_mesh=SimpleNamespace(size=lambda d: sizes[d]))

    assert copies(object(), 8) == 8
    assert copies(grad(Shard(0), sizes=[2]), 4) == 2                                   # tp only, dp=2
    assert copies(grad(_StridedShard(0, split_factor=2), Shard(0), sizes=[2, 2]), 4) == 1   # FSDP2 x tp
    assert copies(grad(Shard(0), sizes=[2]), 2) == 1 and copies(grad(Replicate(), sizes=[2]), 4) == 4
    assert copies(grad(Partial(), sizes=[2]), 4) is None          # no norm: every rank stops (Pipeline.step)


def test_tensor_parallel_stage_optimizer_keeps_dtensors_and_plain_tensors_apart(tmp_path):
    """A Qwen2-style stage (q/k/v biases) under the pipeline's tensor parallel holds DTensors
    (matrices and the sharded biases) beside plain tensors (norms); torch's optimizers refuse a
    group mixing them (``got mixed torch.Tensor and DTensor``), so each group is one kind. One
    process (a 1-rank tp mesh) makes the same DTensors as tp=2, without a launch."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.optim import make_optimizer
    from trainer.parallel.pipeline import build_stage_module, causal_lm_loss, tensor_parallel, vocab_parallel_loss

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY, "model_type": "qwen2"}))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        chunk = build_stage_module(model, 0, 1)
        tensor_parallel(model, [chunk], init_device_mesh("cpu", (1,), mesh_dim_names=("tp",)))
        opt, _ = make_optimizer("adamw", chunk, lr=1e-3, optim={"weight_decay": 0.1}, device_type="cpu",
                                zero=0, offload="none")
        kinds = [({hasattr(p, "device_mesh") for p in g["params"]}, {p.dim() >= 2 for p in g["params"]},
                  g["weight_decay"]) for g in opt.param_groups]
        assert kinds == [({True}, {True}, 0.1), ({True}, {False}, 0.0), ({False}, {False}, 0.0)]
        x = torch.randint(0, TINY["vocab_size"], (2, 8))
        with vocab_parallel_loss(True):
            causal_lm_loss(chunk(x), x).backward()
        opt.step()                                       # raised on a mixed group before the split
    finally:
        dist.destroy_process_group()


def assert_resumes_fully(res, step2: Path, j: TrainingJob, p: Plan, run_dir: Path) -> None:
    """The run ``res``'s step-2 checkpoint, resumed under its own plan, gives the uninterrupted
    run's step 3: its loss is that of step 2's weights; its update needs the optimizer states
    restored from the shards (a restarted Adam moves every weight by ~lr instead)."""
    from safetensors.torch import load_file

    again, lines = _resume_under(step2, j, p, run_dir)
    assert any(line.startswith("FRENZY_RESUME") and '"mode": "full"' in line for line in lines)
    assert_matches(again.losses, res.losses[2:])
    ends = [load_file(str(Path(r.checkpoint_dir) / "consolidated.safetensors")) for r in (res, again)]
    worst = max(float((ends[0][k] - ends[1][k]).abs().max()) for k in ends[0])
    print(f"step-3 weights, resumed vs uninterrupted: max |difference| {worst:.2e}")
    assert set(ends[0]) == set(ends[1]) and worst <= 1e-6


@pytest.mark.parametrize("extra", [
    {},
    # a sliding window shorter than the 16 tokens: the stages must attend through it too (they
    # built plain causal masks: the model trained without its window)
    {"model_type": "mistral", "sliding_window": 4},
    # full and sliding layers mixed (layer_types): each stage's layers get their own kind
    {"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1},
], ids=["llama", "mistral-window", "qwen2-mixed-layers"])
def test_pipeline_stages_reproduce_the_whole_model_and_its_loss(extra):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.parallel.pipeline import build_stage_module, causal_lm_loss, pipe_layout, stage_layers

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**{**TINY, "num_hidden_layers": 3, **extra}))
    x = torch.randint(0, TINY["vocab_size"], (2, 16))
    whole = model(input_ids=x, labels=x)
    stages = [build_stage_module(model, s, 2) for s in range(2)]
    logits = stages[1](stages[0](x))
    assert torch.equal(logits, whole.logits) and torch.equal(causal_lm_loss(logits, x), whole.loss)
    names = [set(s.full_names()) for s in stages]
    assert not names[0] & names[1] and names[0] | names[1] == {n for n, _ in model.named_parameters()}
    assert [stage_layers(3, 2, s) for s in range(2)] == [(0, 2), (2, 3)]
    assert [tuple(pipe_layout({"dp": 2, "pp": 2}, r))[2:4] for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # beside tensor parallel a tp group is consecutive ranks, a pipeline's stages tp ranks apart
    lays = [pipe_layout({"dp": 2, "pp": 2, "tp": 2}, r) for r in range(8)]
    assert [(x.dp_rank, x.stage, x.tp_rank) for x in lays] == [(d, s, t) for d in range(2) for s in range(2)
                                                               for t in range(2)]
    assert all(lays[0].rank_of(x.dp_rank, x.stage, x.tp_rank) == r for r, x in enumerate(lays))


def test_pipeline_plans_the_trainer_launches_and_refuses():
    from trainer.checkpoints import full_resume_possible
    from trainer.launch_config import check_pipeline_model

    check_realisable(plan(2, pp=2, micro_batch=2))
    check_realisable(plan(4, pp=2, micro_batch=1))                  # dp=2 x pp=2
    zero1 = plan(4, pp=2, zero=1, micro_batch=1)                    # ... with ZeRO-1: the program's own path
    check_realisable(zero1)
    assert not uses_deepspeed(zero1) and accelerate_config(zero1, cpu=True)["distributed_type"] == "MULTI_GPU"
    assert deepspeed_config(zero1, job(Path("unused"))) is None
    for zero in (2, 3):                                              # ... with ZeRO-2/3: FSDP2 per stage
        sharded = plan(4, pp=2, zero=zero, micro_batch=1)
        check_realisable(sharded)
        assert not uses_deepspeed(sharded) and deepspeed_config(sharded, job(Path("unused"))) is None
    for zero in (0, 2, 3):                                           # pp x tp (x dp): DTensor tp per stage
        check_realisable(plan(8, pp=2, tp=2, zero=zero, micro_batch=2))
        assert not uses_deepspeed(plan(8, pp=2, tp=2, zero=zero, micro_batch=2))
    for bad in (plan(4, pp=2, zero=2, offload="optimizer", micro_batch=1), plan(4, pp=2, cp=2, micro_batch=4)):
        with pytest.raises(FrenzyInputError, match="pipeline parallel runs beside data and tensor parallel and "
                                                   "ZeRO 0-3 only, without offload or cp") as e:
            check_realisable(bad)
        assert e.value.field == "plan.pp" and "\n" not in str(e.value)
    with pytest.raises(FrenzyInputError, match="ZeRO-1 beside pipeline and tensor parallel is not run") as e:
        check_realisable(plan(8, pp=2, tp=2, zero=1, micro_batch=2))
    assert e.value.field == "plan.zero" and "\n" not in str(e.value)
    from trainer.launch_config import check_heads

    for p, backend in ((plan(8, pp=2, tp=4, micro_batch=2), "torch's DTensor tensor parallel"),
                       (plan(4, tp=4), "DeepSpeed AutoTP")):                # TINY: 2 KV heads
        with pytest.raises(FrenzyInputError, match=f"tp=4 must divide .* 2 KV heads \\({backend} gives"):
            check_heads(p, 4, 2)
    with pytest.raises(FrenzyInputError, match="built for llama decoders"):
        check_pipeline_model(plan(2, pp=2, micro_batch=2), "gpt")
    pp2 = {"deepspeed": False, "zero": 0, "world": 2, "offload": "none", "pp": 2}
    assert full_resume_possible(pp2, dict(pp2))
    assert not full_resume_possible(pp2, {**pp2, "pp": 1, "world": 1})     # weights only
    assert not full_resume_possible({**pp2, "pp": 1, "world": 1}, pp2)
    assert not full_resume_possible({**pp2, "zero": 1}, pp2)          # ZeroRedundancyOptimizer's state
    assert not full_resume_possible({**pp2, "tp": 2, "world": 4}, {**pp2, "world": 4})   # stage files by name
    with pytest.raises(FrenzyInputError, match="4 stages but the model has 2 layers") as e:
        check_pipeline_model(plan(4, pp=4, micro_batch=4), "llama", 2)
    assert e.value.field == "plan.pp"


def test_the_planner_launches_pipelines_beside_zero1_and_counts_the_sharded_states():
    """ZeRO-1 pp plans are launchable; their estimate is the zero-0 pipeline's with the
    optimizer states divided by dp (torch's ZeroRedundancyOptimizer keeps fp32 weights and
    gradients and adds no DeepSpeed reduce bucket)."""
    from estimator.plan_filter import parse_plan_filter
    from estimator.plans import estimate_plan, plans_for_job

    big = {"model": "llama-3.2-1b", "seq_len": 2048, "global_batch": 16, "train_steps": 1}
    found = plans_for_job(big, {"H100-80GB": 8}, plan_filter=parse_plan_filter("pp=2,zero=1"))["H100-80GB"]
    assert found and all(p.pp == 2 and p.zero == 1 for p in found)
    assert any(p.not_launchable is None and p.dp > 1 for p in found)
    at = dict(gpu_type="H100-80GB", gpus=4, dp=2, pp=2, micro_batch=1, grad_accum=8, precision="bf16")
    z0, z1 = (estimate_plan(big, Plan(**at, zero=z)).breakdown_gib for z in (0, 1))
    assert z1["weights"] == pytest.approx(z0["weights"]) and z1["gradients"] == pytest.approx(z0["gradients"])
    assert z1["optimizer"] == pytest.approx(z0["optimizer"] / 2) and z1["other"] == pytest.approx(z0["other"])


def test_the_planner_launches_pipelines_beside_fsdp2_zero_and_counts_its_shards():
    """ZeRO-2/3 pp plans (FSDP2 over each stage's replicas) are enumerated and launchable. Their
    estimate shards over dp: ZeRO-3 divides the ZeRO-1 pipeline's weights and gradients by dp
    (its optimizer states already are); ZeRO-2 is FSDP's SHARD_GRAD_OP, the weights' shards
    plus the whole stage unsharded at the forward/backward peak, gradients divided by dp."""
    from estimator.plan_filter import parse_plan_filter
    from estimator.plans import estimate_plan, plans_for_job

    big = {"model": "llama-3.2-1b", "seq_len": 2048, "global_batch": 16, "train_steps": 1}
    for zero in (2, 3):
        found = plans_for_job(big, {"H100-80GB": 8}, plan_filter=parse_plan_filter(f"pp=2,zero={zero}"))["H100-80GB"]
        assert found and all(p.pp == 2 and p.zero == zero for p in found)
        assert any(p.not_launchable is None and p.dp > 1 for p in found)
    at = dict(gpu_type="H100-80GB", gpus=4, dp=2, pp=2, micro_batch=1, grad_accum=8, precision="bf16")
    z1, z2, z3 = (estimate_plan(big, Plan(**at, zero=z)).breakdown_gib for z in (1, 2, 3))
    assert z3["weights"] == pytest.approx(z1["weights"] / 2) and z3["gradients"] == pytest.approx(z1["gradients"] / 2)
    assert z3["optimizer"] == pytest.approx(z1["optimizer"]) == pytest.approx(z2["optimizer"])
    assert z2["weights"] == pytest.approx(z1["weights"] * 1.5) and z2["gradients"] == pytest.approx(z3["gradients"])


def test_the_planner_launches_pipeline_x_tensor_parallel_and_counts_what_it_runs():
    """pp x tp plans are enumerated launchable (ZeRO-1 beside them refused in one line). The
    throughput model charges what the trainer sends: the stage boundaries' scatter-gather (1/tp
    of the activations sent per tp rank, two all-gathers per chunk boundary and micro-batch on
    the tp link), the first stage's embedding all-gather and the last stage's head input-gradient
    all-reduce, and once per step a tied model's gradient summed between the first and last
    stage. A tied model's two embedding copies are summed whole at the step (the first stage
    holds two whole gradients then, the last one)."""
    from estimator.catalog import get_gpu
    from estimator.models import resolve_model
    from estimator.plan_filter import parse_plan_filter
    from estimator.plans import estimate_plan, plans_for_job
    from estimator.throughput import DEFAULT_FACTORS, step_time_breakdown

    big = {"model": "llama-3.2-1b", "seq_len": 2048, "global_batch": 16, "train_steps": 1}
    found = plans_for_job(big, {"H100-80GB": 8}, plan_filter=parse_plan_filter("pp=2,tp=2"))["H100-80GB"]
    assert any(p.not_launchable is None and p.dp > 1 for p in found)
    assert all(p.not_launchable.startswith("plan.zero: ZeRO-1 beside") for p in found if p.zero == 1)
    spec, gpu = resolve_model("llama-3.2-1b"), get_gpu("H100-80GB")
    untied = spec.model_copy(update={"tied_embeddings": False})
    at = dict(gpu_type="H100-80GB", dp=1, micro_batch=1, grad_accum=4, precision="bf16")

    def times(model, tp, pp, vpp=1):
        return step_time_breakdown(model, Plan(gpus=tp * pp, tp=tp, pp=pp, vpp=vpp, **at), gpu, seq_len=2048,
                                   factors=DEFAULT_FACTORS)

    one, two, inter = times(spec, 2, 1), times(spec, 2, 2), times(spec, 2, 2, 2)
    # per micro-batch a layer's 4 all-reduces move 8 all-gathers' volume ((n-1)/n of the
    # activations each); beside pp a rank adds 2 vpp + 1/pp all-gathers (2 per chunk boundary,
    # the embeddings' 1 and the head's all-reduce 2, spread over the pp ranks)
    gather = one.tp_comm / (4 * spec.layers) / 8
    assert (two.tp_comm - one.tp_comm / 2) / 4 == pytest.approx((2 + 1 / 2) * gather)
    assert (inter.tp_comm - one.tp_comm / 2) / 4 == pytest.approx((4 + 1 / 2) * gather)
    # the tied gradient's all-reduce over the first and last stage: the whole V x hidden (bf16)
    # once per step, beside tp after gathering it from the (2) tp shards
    tie1, tie2 = (times(spec, tp, 2).pp_comm - times(untied, tp, 2).pp_comm for tp in (1, 2))
    intra = gpu.intra_link_gbps * DEFAULT_FACTORS.nvlink_eff
    assert spec.tied and tie1 == pytest.approx(spec.vocab * spec.hidden * 2 * 8 / 1e9 / intra)
    assert tie2 == pytest.approx(1.5 * tie1)
    assert two.pp_comm - tie2 == pytest.approx((times(spec, 1, 2).pp_comm - tie1) / 2)   # 1/tp sent per rank
    small = {**big, "seq_len": 64, "global_batch": 2}       # the step binds: few activations
    tp2 = estimate_plan(small, Plan(gpu_type="H100-80GB", gpus=4, dp=1, tp=2, pp=2, micro_batch=1, grad_accum=2,
                                    precision="bf16"))
    whole = spec.vocab_padded * spec.e * 4 / 2 ** 30           # the tied weight's fp32 gradient
    assert spec.tied and tp2.breakdown_gib["other"] == pytest.approx(2 * whole)
