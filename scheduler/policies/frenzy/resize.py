"""What re-sizing a run costs and the decisions that do it (steps 6-8 share them)."""
from __future__ import annotations

from scheduler.placement import FreeIndex
from scheduler.restart import checkpoint_move_s
from scheduler.types import Decision, JobRequest

from .config import RestartCost
from .records import Cand, GpuCounts, Run


def restart_cost(ckpt_gb: float, gpu_type: str, gpus: int, per_node: GpuCounts, cfg: RestartCost) -> float:
    """Predicted cost of restarting a run on ``gpus`` GPUs of ``gpu_type``: launch plus its
    checkpoint's save and restore over the nodes a compact placement spans (the formula the
    simulator charges)."""
    nodes = -(-gpus // max(1, per_node.get(gpu_type, 1)))
    return cfg.launch_s + checkpoint_move_s(ckpt_gb, nodes, cfg.ckpt_gbs)


def steps_left(run: Run, rem: float, now: float, launch_s: float) -> float:
    """A run's remaining optimizer steps, from its predicted remaining time (less what is left
    of its own start-up) and its step time."""
    rj = run.rj
    ready = max(0.0, rj.start_s + launch_s - now)
    return max(1.0, (rem - ready) / max(rj.plan.step_time_s, 1e-9))


def shrink_to_fit(idx: FreeIndex, run: Run, run_cand: Cand, job: JobRequest, cand: Cand,
                  reason: str) -> list[Decision]:
    """Restart ``run`` on ``run_cand`` (fewer GPUs) and start ``job`` on ``cand`` in what that
    frees: the three decisions, or [] with ``idx`` unchanged when either does not place."""
    rj = run.rj
    idx.release(rj.placement)
    run_place = idx.place_compact(run_cand.gpu_type, run_cand.gpus, run_cand.plan.tp)
    if run_place is not None:
        idx.commit(run_place)
        place = idx.place_compact(cand.gpu_type, cand.gpus, cand.plan.tp)
        if place is not None:
            idx.commit(place)
            why = f"{reason} for {job.job_id}"
            return [Decision(job_id=rj.job_id, plan=None, placement={}, action="preempt", reason=why),
                    Decision(job_id=rj.job_id, plan=run_cand.plan, placement=run_place, reason=why),
                    Decision(job_id=job.job_id, plan=cand.plan, placement=place, reason=f"start after {reason}")]
        idx.release(run_place)
    idx.commit(rj.placement)
    return []
