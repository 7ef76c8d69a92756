"""A run launched in parts (re-sized, preempted, handed on to another pool) reports one loss
per step: each part's losses start after the step it resumed from, and steps an earlier part
trained past that point were trained again and give way."""
from __future__ import annotations

from estimator.plan import Plan
from frenzy_flows.training import merge_segments
from trainer.runner import Attempt, EvalLoss, Measured, TrainResult

PLAN = Plan(gpu_type="CPU", gpus=1, dp=1, tp=1, pp=1, zero=0, micro_batch=1, grad_accum=1,
            global_batch=1, act_ckpt="none", device_used_gib=1.0, step_time_s=0.1)


def part(resumed: int, losses: list[float], number: int, evals=()) -> TrainResult:
    return TrainResult(status="stopped", losses=losses, final_plan=PLAN, measured=Measured(), checkpoint_dir=None,
                       attempts=[Attempt(plan=PLAN, outcome="stopped", resumed_from_step=resumed, number=number)],
                       eval_losses=[EvalLoss(step=s, loss=v) for s, v in evals])


def test_parts_that_resume_where_the_last_stopped_are_joined_in_order():
    got = merge_segments([part(0, [5.0, 4.0, 3.0], 1, [(2, 4.5)]), part(3, [2.0, 1.0], 2, [(4, 1.5)])])
    assert got.losses == [5.0, 4.0, 3.0, 2.0, 1.0]
    assert [a.number for a in got.attempts] == [1, 2]
    assert [(e.step, e.loss) for e in got.eval_losses] == [(2, 4.5), (4, 1.5)]


def test_steps_a_later_part_trained_again_are_its_own():
    # the second part found only the checkpoint of step 2 (or, on a machine without the run
    # folder, none: it starts over): its steps replace the first part's from there
    got = merge_segments([part(0, [5.0, 4.0, 3.0, 2.9], 1, [(4, 3.5)]), part(2, [3.1, 2.8], 2)])
    assert got.losses == [5.0, 4.0, 3.1, 2.8]
    assert got.eval_losses == []
    over = merge_segments([part(0, [5.0, 4.0], 1), part(0, [5.1, 4.1, 3.1], 2)])
    assert over.losses == [5.1, 4.1, 3.1]


def test_a_run_resumed_from_another_runs_checkpoint_counts_from_there():
    got = merge_segments([part(10, [2.0, 1.9], 1), part(12, [1.8], 2)])
    assert got.losses == [2.0, 1.9, 1.8]
