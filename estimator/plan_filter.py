"""`--plan "tp=2,zero=3"`: restrict the candidate plans to those with the given knobs.

Pure (no torch, no Prefect): parse the filter text once, then keep the plans of every GPU type
whose fields match every knob. Used by `frenzy run --plan` so anyone can launch one plan kind on
purpose (a tensor-parallel run, an offload run, a two-node run).

Knobs: the parallel degrees ``dp tp pp cp``, ``vpp`` (virtual pipeline stages per pp rank:
interleaved 1F1B; the planner enumerates vpp > 1 only when asked), the GPU count ``gpus``, ``nodes`` (GPUs over the
GPU type's GPUs per node, rounded up), ``zero`` (0-3), ``offload`` (none, optimizer,
optimizer+params), ``act_ckpt`` (none, selective, full), ``micro_batch``, ``grad_accum`` and
``gpu`` (the GPU type name, case-insensitive).
"""
from __future__ import annotations

import math
from typing import get_args

from .errors import FrenzyInputError
from .plan import ActCkpt, Offload, Plan

_INT_KNOBS = ("dp", "tp", "pp", "vpp", "cp", "gpus", "nodes", "zero", "micro_batch", "grad_accum")
_CHOICES: dict[str, tuple[str, ...]] = {"offload": get_args(Offload), "act_ckpt": get_args(ActCkpt)}
KNOBS = (*_INT_KNOBS, *_CHOICES, "gpu")
FIELD = "plan"          # the CLI flag the errors name


PlanFilter = dict[str, int | str]


def parse_plan_filter(text: str) -> PlanFilter:
    """``"tp=2, offload=optimizer"`` -> ``{"tp": 2, "offload": "optimizer"}``.

    Raises FrenzyInputError naming the knob: unknown, repeated, without ``=``, or a value
    outside its range."""
    if not isinstance(text, str) or not text.strip():
        raise FrenzyInputError(FIELD, "must be knob=value[,knob=value...] (got an empty filter)")
    out: PlanFilter = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        knob, eq, value = (s.strip() for s in part.partition("="))
        knob = knob.lower()
        if not eq or not knob or not value:
            raise FrenzyInputError(FIELD, f"{part!r} is not knob=value (knobs: {', '.join(KNOBS)})")
        if knob not in KNOBS:
            raise FrenzyInputError(FIELD, f"unknown knob {knob!r} (knobs: {', '.join(KNOBS)})")
        if knob in out:
            raise FrenzyInputError(FIELD, f"knob {knob!r} given twice")
        if knob in _INT_KNOBS:
            try:
                n = int(value)
            except ValueError:
                raise FrenzyInputError(FIELD, f"{knob} must be an integer (got {value!r})") from None
            low = 0 if knob == "zero" else 1
            high = 3 if knob == "zero" else None
            if n < low or (high is not None and n > high):
                rng = f"{low}..{high}" if high is not None else f">= {low}"
                raise FrenzyInputError(FIELD, f"{knob} must be {rng} (got {n})")
            out[knob] = n
        elif knob in _CHOICES:
            if value not in _CHOICES[knob]:
                raise FrenzyInputError(FIELD, f"{knob} must be one of {', '.join(_CHOICES[knob])} (got {value!r})")
            out[knob] = value
        else:
            out[knob] = value
    if not out:
        raise FrenzyInputError(FIELD, "must be knob=value[,knob=value...] (got an empty filter)")
    return out


def nodes_for(gpus: int, gpus_per_node: int) -> int:
    """Nodes ``gpus`` GPUs span when each node holds ``gpus_per_node`` of them (the planner's
    ``Plan.nodes``)."""
    return max(1, math.ceil(gpus / max(1, int(gpus_per_node))))


def plan_nodes(plan: Plan, gpus_per_node: int) -> int:
    """Nodes a plan spans when each node holds ``gpus_per_node`` GPUs of its type."""
    return nodes_for(plan.gpus, gpus_per_node)


def matches(plan: Plan, flt: PlanFilter, gpus_per_node: int = 8) -> bool:
    for knob, want in flt.items():
        if knob == "nodes":
            got: int | str = plan_nodes(plan, gpus_per_node)
        elif knob == "gpu":
            if plan.gpu_type.lower() != str(want).lower():
                return False
            continue
        else:
            got = getattr(plan, knob)
        if got != want:
            return False
    return True


def describe(flt: PlanFilter) -> str:
    return ",".join(f"{k}={v}" for k, v in flt.items())


def check_heads(flt: PlanFilter, spec) -> None:
    """A ``tp`` or ``cp`` the model's attention heads do not split into, or more pipeline
    stages than the model has layers: one line naming the knob and the model's count
    (``spec``: the job's ``ModelSpec``), before any plan is looked at."""
    from .plans import heads_rule

    why = heads_rule(int(flt.get("tp", 1)), int(flt.get("cp", 1)), spec.heads, spec.n_kv, int(flt.get("pp", 1)))
    if why is not None:
        raise FrenzyInputError(FIELD, f"{describe(flt)!r}: {why.removeprefix('plan.')}")
    if int(flt.get("pp", 1)) > spec.layers:
        raise FrenzyInputError(FIELD, f"{describe(flt)!r}: pp={flt['pp']} stages need a layer each and "
                                      f"{spec.name} has {spec.layers}")


def check_gpu(flt: PlanFilter, gpu_types: list[str], gpus: dict | None = None) -> PlanFilter:
    """``flt`` with its ``gpu`` the one type of ``gpu_types`` (the inventory's) it names, as
    ``--gpu`` resolves a name ('h100' is H100-80GB); an unknown, ambiguous or absent type is one
    line naming the filter, not "no plan matches"."""
    want = flt.get("gpu")
    if want is None:
        return flt
    from .catalog import resolve_gpu_name

    try:
        name = resolve_gpu_name(str(want), {**(gpus or {}), **dict.fromkeys(gpu_types)}, field=FIELD)
    except FrenzyInputError as err:
        raise FrenzyInputError(FIELD, f"{describe(flt)!r}: {err.rule}") from None
    if name not in gpu_types:
        raise FrenzyInputError(FIELD, f"{describe(flt)!r}: {name} is not in the inventory "
                                      f"(its types: {', '.join(gpu_types) or 'none'})")
    return {**flt, "gpu": name}


def filter_plans(plans_by_type: dict[str, list[Plan]], flt: PlanFilter | None,
                 gpus_per_node: dict[str, int] | int = 8, spec=None) -> dict[str, list[Plan]]:
    """The plans of each GPU type that match ``flt`` (order kept; a type with none maps to []).

    Raises FrenzyInputError naming the filter when no plan of any type matches it, or (with
    the job's model ``spec``) when its tp or cp does not divide the model's heads."""
    if not flt:
        return plans_by_type
    if spec is not None:
        check_heads(flt, spec)

    def gpn(t: str) -> int:
        return gpus_per_node.get(t, 8) if isinstance(gpus_per_node, dict) else int(gpus_per_node)

    out = {t: [p for p in ps if matches(p, flt, gpn(t))] for t, ps in plans_by_type.items()}
    if not any(out.values()):
        raise no_match_error(flt, sum(len(ps) for ps in plans_by_type.values()), list(plans_by_type))
    return out


def no_match_error(flt: PlanFilter, feasible: int, gpu_types: list[str]) -> FrenzyInputError:
    """The one line for a filter that none of ``feasible`` plans over ``gpu_types`` matches."""
    return FrenzyInputError(FIELD, f"no feasible plan matches {describe(flt)!r} "
                                   f"({feasible} feasible plans over {', '.join(gpu_types) or 'no GPU type'})")


def asks_for_parallel_kind(flt: PlanFilter | None) -> bool:
    """Whether ``flt`` names a plan kind beyond data parallel (tp, pp or cp above 1, or an
    offload): the planner then enumerates those kinds on the CPU pseudo GPU type too."""
    if not flt:
        return False
    return any(int(flt.get(k, 1)) > 1 for k in ("tp", "pp", "vpp", "cp")) or flt.get("offload", "none") != "none"
