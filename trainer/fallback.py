"""Out-of-memory fallbacks: the plans to try, in order, after a plan ran out of memory.

Pure (no torch): every candidate is re-estimated by the estimator (``estimator.estimate`` for
a changed knob, ``estimator.plans.enumerate_plans`` for other GPU counts and types), so every
fallback is one the estimator believes fits, with its predictions filled, and keeps the job's
global batch. The order is the issue's, cheapest change first:

1. more activation checkpointing (none -> selective -> full), same GPUs;
2. a higher ZeRO stage (only where it saves memory: ZeRO shards over data-parallel ranks);
3. CPU offload (optimizer states, then optimizer + parameters with ZeRO-3);
4. more GPUs of the same type (as many as the inventory holds);
5. the next GPU type with more memory than this one, smallest first.

Steps 1-3 are cumulative (each keeps what the previous one changed) and each must lower the
predicted per-GPU memory, since the plan before it really ran out of memory whatever the
prediction said. Only plans the trainer can realise (``launch_config.check_realisable``) are
proposed.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.plan import Plan

from .launch_config import check_realisable

_CKPT_ORDER = ("none", "selective", "full")
_OFFLOAD_ORDER = ("none", "optimizer", "optimizer+params")


def _why_not(p: Plan) -> tuple[str, str] | None:
    """Why the trainer cannot launch ``p``, as (joiner, reason): its own rule, shortened
    ("pp2: ..."), else the reason the planner marked on it (the model's heads, host memory)."""
    try:
        check_realisable(p)
    except ValueError as err:
        knob = str(getattr(err, "field", "plan")).removeprefix("plan.")
        rule = str(getattr(err, "rule", err)).split(": ", 1)[-1].split(" (")[0].strip()
        return " ", f"{knob}{getattr(p, knob, '')}: {rule}"
    return (": ", p.not_launchable) if p.not_launchable else None


def realisable(p: Plan) -> bool:
    """Whether the trainer can run ``p``."""
    return _why_not(p) is None


def not_launchable(p: Plan) -> str | None:
    """Why the trainer cannot launch ``p`` ("cannot launch ..."), or None."""
    why = _why_not(p)
    return None if why is None else "cannot launch" + why[0] + why[1]


def launch_refusal(plans: list[Plan]) -> str:
    """The one clause for plans that fit but none of which the trainer can launch here, with
    their reasons (at most three)."""
    reasons = sorted({why[1] for why in map(_why_not, plans) if why is not None})
    return ("no plan that fits can be launched here (" + "; ".join(reasons[:3])
            + ("; ..." if len(reasons) > 3 else "") + ")")


def _key(p: Plan) -> tuple:
    """What makes two fallbacks the same plan (predictions aside)."""
    return (p.gpu_type, p.gpus, p.dp, p.tp, p.zero, p.offload, p.act_ckpt, p.micro_batch)


def _memory(p: Plan) -> float:
    return p.device_used_gib or p.reserved_peak_gib or p.allocated_peak_gib


def reestimate(job: TrainingJob, p: Plan, *, safety_margin_gib: float | None = None) -> Plan | None:
    """``p`` with the estimator's predictions (memory, step time), or None when the estimator
    does not believe it fits its GPU type (``device_used_gib`` over capacity minus the margin)."""
    from estimator.catalog import get_gpu
    from estimator.memory import attention_for
    from estimator.models import resolve_model
    from estimator.plans import DEFAULT_SAFETY_MARGIN_GIB, estimate_plan, plan_adapters
    from estimator.throughput import step_time

    margin = DEFAULT_SAFETY_MARGIN_GIB if safety_margin_gib is None else safety_margin_gib
    try:
        gpu = get_gpu(p.gpu_type)
        est = estimate_plan(job, p)
    except FrenzyInputError:
        return None
    if est.device_used_gib > gpu.memory_gib - margin:
        return None
    spec = resolve_model(job.model)
    # a model that attends eager whatever the plan says is timed as it runs (``attention_for``)
    q = p.model_copy(update={"attention": attention_for(spec, p.attention),
                             "allocated_peak_gib": round(est.allocated_peak_gib, 4),
                             "reserved_peak_gib": round(est.reserved_peak_gib, 4),
                             "device_used_gib": round(est.device_used_gib, 4)})
    st = step_time(spec, q, gpu, seq_len=job.seq_len, adapters=plan_adapters(job, q))
    return q.model_copy(update={"step_time_s": st})


def fallback_plans(job: TrainingJob, plan: Plan, *, inventory: dict[str, int] | None = None,
                   gpus_per_node: int | dict[str, int] = 8, safety_margin_gib: float | None = None
                   ) -> Iterator[Plan]:
    """Yield the fallback plans for ``plan`` (which ran out of memory), best first.

    ``inventory`` maps GPU type -> GPUs available (default: just ``plan.gpus`` of this type, so
    only steps 1-3 apply). Steps 1-3 re-estimate the changed plan with ``estimator.estimate``;
    steps 4-5 take the fastest realisable plan of ``estimator.plans.enumerate_plans``. Lazy:
    the runner takes the next one only after another OOM.
    """
    from estimator.catalog import get_gpu
    from estimator.plan_filter import nodes_for
    from estimator.plans import enumerate_plans

    inventory = dict(inventory or {plan.gpu_type: plan.gpus})
    kw = {} if safety_margin_gib is None else {"safety_margin_gib": safety_margin_gib}

    def per_node(t: str) -> int:
        return gpus_per_node.get(t, 8) if isinstance(gpus_per_node, dict) else gpus_per_node

    def feasible(gpu_type: str, max_gpus: int) -> list[Plan]:  # fastest first
        try:
            got = enumerate_plans(job, gpu_type, max_gpus=max_gpus, gpus_per_node=per_node(gpu_type), **kw)
        except FrenzyInputError:       # nothing fits on this type, or an unknown type
            return []
        return [p for p in got if realisable(p) and p.global_batch == job.global_batch]

    seen: set[tuple] = {_key(plan)}

    def fresh(p: Plan) -> bool:
        k = _key(p)
        if k in seen:
            return False
        seen.add(k)
        return True

    # Steps 1-3: the same GPUs and micro-batch, less memory per GPU, cumulative.
    original = reestimate(job, plan, safety_margin_gib=0.0)   # the prediction for what just failed
    limit = first_limit = _memory(original) if original is not None else _memory(plan)
    current = plan
    ladder: list[dict[str, Any]] = [{"act_ckpt": ck} for ck in _CKPT_ORDER[_CKPT_ORDER.index(plan.act_ckpt) + 1:]]
    ladder += [{"zero": z} for z in range(plan.zero + 1, 4)]
    ladder += [{"offload": off} for off in _OFFLOAD_ORDER[_OFFLOAD_ORDER.index(plan.offload) + 1:]]
    for change in ladder:
        upd = dict(change)
        if upd.get("offload") == "optimizer" and current.zero == 0:
            upd["zero"] = 2                  # offload moves ZeRO's partition; stage 2 is the usual pairing
        if upd.get("offload") == "optimizer+params":
            upd["zero"] = 3
        if upd.get("zero", current.zero) < current.zero:
            continue
        found = reestimate(job, current.model_copy(update=upd), safety_margin_gib=safety_margin_gib)
        if found is None or not realisable(found) or (limit and _memory(found) >= limit):
            continue                         # does not fit, or saves nothing (ZeRO at dp=1)
        if fresh(found):
            current, limit = found, _memory(found)
            yield found

    # Step 4: more GPUs of the same type (doubling, as the inventory allows), keeping the
    # checkpointing/ZeRO reached so far; offload dropped again where the estimator says it fits.
    have = inventory.get(plan.gpu_type, plan.gpus)
    n = plan.gpus * 2
    while n <= have:
        if job.global_batch % n == 0:
            per_rank = job.global_batch // n
            mb = max(d for d in range(1, min(per_rank, plan.micro_batch) + 1) if per_rank % d == 0)
            geometry = {"gpus": n, "dp": n, "micro_batch": mb, "grad_accum": per_rank // mb,
                        "nodes": nodes_for(n, per_node(plan.gpu_type))}
            for knobs in ({"offload": "none"}, {}):
                found = reestimate(job, current.model_copy(update={**geometry, **knobs}),
                                   safety_margin_gib=safety_margin_gib)
                if found is not None and realisable(found) and _memory(found) < first_limit:
                    if fresh(found):
                        yield found
                    break
        n *= 2

    # Step 5: the next GPU types with more memory, smallest first, fastest plan on each.
    try:
        here = get_gpu(plan.gpu_type).memory_gib
    except FrenzyInputError:
        here = 0.0
    bigger = []
    for t, n in inventory.items():
        if t == plan.gpu_type or n <= 0:
            continue
        try:
            mem = get_gpu(t).memory_gib
        except FrenzyInputError:
            continue
        if mem > here:
            bigger.append((mem, t, n))
    for _, t, n in sorted(bigger):
        plans = feasible(t, n)
        if plans and fresh(plans[0]):
            yield plans[0]
