"""Interleaved pipeline parallel (``vpp > 1``): the refusals, the estimator's terms and the
planner's gate (fast), and a 2-process CPU run of a 4-layer tiny Llama (pp=2 x vpp=2: four
chunks, rank 0 holding layers 0 and 2, rank 1 layers 1 and 3) against one process, with a
re-plan of its checkpoint to one process (slow; CPU-only: gloo ranks, fp32)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from estimator.errors import FrenzyInputError
from tests.test_parallel_plans import TINY, _resume_under, assert_matches, job, plan, save_tiny_llama, train
from trainer.launch_config import check_pipeline_model, check_realisable

DEEP = {**TINY, "num_hidden_layers": 4}      # pp x vpp = 4 chunks of one layer


# ------------------------------------------------------------------------------- pure pieces
def test_interleaving_the_trainer_refuses_names_the_field_and_rule():
    for ga in (1, 2, 3, 4, 6, 8):             # micro-batch counts torch 2.13 runs at pp=2
        check_realisable(plan(2, pp=2, vpp=2, micro_batch=1, grad_accum=ga))
    cases = [(plan(1, vpp=2), "need pp > 1"),
             # torch runs rounds of max(1, 5 // 2) = 2 micro-batches: 5 is refused
             (plan(2, pp=2, vpp=2, micro_batch=1, grad_accum=5), "rounds of max(1, grad_accum // pp) = 2")]
    for bad, rule in cases:
        with pytest.raises(FrenzyInputError, match=re.escape(rule)) as e:
            check_realisable(bad)
        assert e.value.field == "plan.vpp" and "\n" not in str(e.value)
    with pytest.raises(FrenzyInputError, match=r"pp x vpp = 4 must divide the model's 6 layers") as e:
        check_pipeline_model(plan(2, pp=2, vpp=2, micro_batch=1), "llama", 6)
    assert e.value.field == "plan.vpp"
    check_pipeline_model(plan(2, pp=2, vpp=2, micro_batch=1), "llama", 8)


def test_a_checkpoint_resumes_fully_only_under_the_same_interleaving():
    from trainer.checkpoints import full_resume_possible

    v2 = {"deepspeed": False, "zero": 0, "world": 2, "offload": "none", "pp": 2, "vpp": 2}
    assert full_resume_possible(v2, dict(v2))
    assert not full_resume_possible(v2, {**v2, "vpp": 1})          # other layers per stage file
    assert not full_resume_possible({**v2, "vpp": 1}, v2)


def test_interleaved_chunks_in_rank_order_reproduce_the_whole_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainer.parallel.pipeline import build_stage_module, rank_chunks

    assert rank_chunks(2, 2, 0) == [0, 2] and rank_chunks(2, 2, 1) == [1, 3]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**DEEP))
    x = torch.randint(0, DEEP["vocab_size"], (2, 16))
    h = x
    for chunk in range(4):                       # the path a micro-batch takes round the ranks
        h = build_stage_module(model, chunk, 4)(h)
    assert torch.equal(h, model(input_ids=x).logits)


def test_the_estimator_carries_vpp_into_memory_and_the_planner_enumerates_it_only_when_asked():
    from estimator.plan_filter import parse_plan_filter
    from estimator.plans import estimate_plan, plans_for_job

    big = {"model": "llama-3.2-1b", "seq_len": 4096, "global_batch": 8, "train_steps": 1}
    plain = estimate_plan(big, plan_of("H100-80GB", pp=4, vpp=1))
    inter = estimate_plan(big, plan_of("H100-80GB", pp=4, vpp=2))
    # the first rank keeps 1 + (pp - 1) / (pp vpp) times the 1F1B activations
    assert inter.stages[0].allocated_peak_gib > plain.stages[0].allocated_peak_gib
    # fewer micro-batches than ranks: torch's warm-up holds each once, chunks or not, so the
    # first rank holds what plain 1F1B holds (Korthikanti's factor alone would say 1.375 x)
    few = {**big, "global_batch": 2}
    one_f1b = estimate_plan(few, plan_of("H100-80GB", pp=4, vpp=1, grad_accum=2))
    interleaved = estimate_plan(few, plan_of("H100-80GB", pp=4, vpp=2, grad_accum=2))
    assert interleaved.stages[0].allocated_peak_gib == pytest.approx(one_f1b.stages[0].allocated_peak_gib)
    flt = parse_plan_filter("pp=2,vpp=2")
    assert flt == {"pp": 2, "vpp": 2}
    asked = plans_for_job(big, {"H100-80GB": 8}, plan_filter=flt)["H100-80GB"]
    assert asked and all(p.pp == 2 and p.vpp == 2 for p in asked)
    assert any(p.not_launchable is None for p in asked)
    unasked = plans_for_job(big, {"H100-80GB": 8})["H100-80GB"]
    assert all(p.vpp == 1 for p in unasked)
    assert '"vpp":2' in asked[0].model_dump_json()


def test_interleaved_in_flight_activations_follow_torchs_warm_up():
    from estimator.memory import _interleaved_inflight

    # first rank, micro-batches a multiple of pp: Korthikanti et al.'s pp (1 + (pp - 1) / (pp vpp))
    assert _interleaved_inflight(4, 2, 8, 0) == pytest.approx(4 * (1 + 3 / 8))
    # later ranks hold less; one micro-batch is held once, whatever the chunks
    assert [_interleaved_inflight(4, 2, 8, r) for r in range(4)] == [5.5, 4.5, 3.5, 2.5]
    assert _interleaved_inflight(4, 2, 1, 0) == 1.0 and _interleaved_inflight(2, 2, 2, 0) == 2.0


def plan_of(gpu: str, pp: int, vpp: int, grad_accum: int = 8):
    from estimator.plan import Plan

    return Plan(gpu_type=gpu, gpus=pp, pp=pp, vpp=vpp, micro_batch=1, grad_accum=grad_accum)


# ------------------------------------------------------------------------------- real launches
@pytest.fixture(scope="module")
def deep_weights(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama-4", DEEP)


@pytest.mark.slow
def test_interleaved_pipeline_2x2_matches_one_process_and_resumes_on_one(deep_weights, tmp_path):
    """pp=2 x vpp=2 over 4 micro-batches (ScheduleInterleaved1F1B): the single-process losses;
    one file per pipeline rank and the consolidated weights; then re-plan to one process at
    step 2: step 3 equals the single-process run re-planned the same way (optimizer restarted)."""
    ref, _ = train(job(deep_weights), plan(1), tmp_path / "one")
    res, lines = train(job(deep_weights), plan(2, pp=2, vpp=2, micro_batch=1), tmp_path / "vpp")
    assert_matches(res.losses, ref.losses)
    assert any("dp=1 pp=2 vpp=2" in line and "ScheduleInterleaved1F1B" in line for line in lines)
    ck = Path(res.checkpoint_dir)
    assert (ck / "stage-00.pt").is_file() and (ck / "stage-01.pt").is_file()
    assert (ck / "consolidated.safetensors").is_file()
    assert json.loads((ck / "frenzy_ckpt.json").read_text())["format"]["vpp"] == 2

    j, target = job(deep_weights), plan(1, zero=1)
    step2 = Path(res.run_dir) / "checkpoints" / "step-00000002"
    moved, lines = _resume_under(step2, j, target, tmp_path / "from-vpp")
    assert any(line.startswith("FRENZY_RESUME") and '"mode": "weights"' in line for line in lines)
    same, _ = _resume_under(Path(ref.run_dir) / "checkpoints" / "step-00000002", j, target, tmp_path / "from-one")
    assert len(moved.losses) == len(same.losses) == 1
    assert_matches(moved.losses, same.losses)
