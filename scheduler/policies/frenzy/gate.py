"""Step 1, the memory gate, and the plan menus built on it (``records.Menu``)."""
from __future__ import annotations

import math
from typing import Callable

from estimator.plan import Plan

from .config import Choice, Growth, MemoryGate
from .records import Cand, Menu

INF = math.inf
MemoryOf = Callable[[str], float]       # gpu_type -> device memory (GiB)


def memory_gate(plans: list[Plan], mem_of: MemoryOf, cfg: MemoryGate) -> list[Plan]:
    """The plans a job may run. *Safe*: predicted ``device_used_gib`` x (1 + headroom) plus the
    margin fits the card. Only when a job has no safe plan anywhere, the roomiest plans that fit
    with the margin alone (never a plan that does not fit: a job that only fits 80 GB cards
    waits for them instead of dying of OOM on 24 GB cards)."""
    safe, fallback = [], []
    mems: dict[str, float] = {}
    for p in plans:
        mem = mems.get(p.gpu_type)
        if mem is None:
            mem = mems[p.gpu_type] = mem_of(p.gpu_type)
        if p.device_used_gib * (1.0 + cfg.headroom) + cfg.safety_margin_gib <= mem:
            safe.append(p)
        elif p.device_used_gib + cfg.safety_margin_gib <= mem:
            fallback.append((p.device_used_gib / mem, p))
    if safe or not fallback:
        return safe
    least = min(r for r, _ in fallback)
    return [p for r, p in fallback if r <= least + cfg.fallback_slack]


def complexity(p: Plan) -> tuple:
    """Fewer moving parts first: no model parallelism, no offload, lower ZeRO stage, no
    activation recomputation."""
    return (p.tp * p.pp * p.cp > 1, p.offload != "none", p.zero, p.act_ckpt != "none")


def pareto(by_type: dict[str, list[Plan]], floors: tuple[float, ...], simpler_within: float) -> list[list[Cand]]:
    """Per GPU type the plans a bigger count makes faster, while parallel efficiency vs the
    fewest GPUs of that type stays >= the floor; one list per floor, fastest first (one pass:
    each list is a per-type prefix of the list at the lowest floor). ``by_type``'s lists are
    sorted by (GPUs, step time)."""
    lowest = min(floors)
    out: list[list[Cand]] = [[] for _ in floors]
    for t, ps in by_type.items():
        best = INF
        base_gpu_s = None                             # GPU-seconds per step at the fewest GPUs
        open_ = [True] * len(floors)                  # a floor's chain ends at its first miss
        last_n = 0
        for i, p in enumerate(ps):                    # Pareto: more GPUs only if faster
            if p.gpus != last_n and p.step_time_s < best - 1e-12:
                # one plan per count: the simplest within ``simpler_within`` of its fastest
                last_n = p.gpus
                j = i + 1
                near = p.step_time_s * (1.0 + simpler_within)
                while j < len(ps) and ps[j].gpus == p.gpus and ps[j].step_time_s <= near:
                    if ps[j].step_time_s < best - 1e-12 and complexity(ps[j]) < complexity(p):
                        p = ps[j]
                    j += 1
                gpu_s = p.gpus * p.step_time_s
                if base_gpu_s is None:
                    base_gpu_s = gpu_s
                elif base_gpu_s < lowest * gpu_s:
                    break                             # more GPUs than any speed-up is worth
                c = Cand(p.step_time_s, p.gpus, t, p)
                for k, f in enumerate(floors):
                    if open_[k] and base_gpu_s >= f * gpu_s:
                        out[k].append(c)
                    else:
                        open_[k] = False
                best = p.step_time_s
    for cands in out:
        cands.sort(key=lambda c: (c.step_s, c.gpus))
    return out


def build_menu(plans: list[Plan], mem_of: MemoryOf, gate: MemoryGate, choice: Choice, growth: Growth) -> Menu:
    """A job's menus: gated plans, Pareto per type under the queue, idle and growth floors."""
    by_type: dict[str, list[Plan]] = {}
    for p in memory_gate(plans, mem_of, gate):
        by_type.setdefault(p.gpu_type, []).append(p)
    for ps in by_type.values():
        ps.sort(key=lambda p: (p.gpus, p.step_time_s))
    queue, wide, grow = pareto(by_type, (choice.min_efficiency, choice.idle_min_efficiency,
                                         min(growth.min_efficiency, growth.long_min_efficiency)),
                               choice.simpler_within)
    fewest: dict[str, int] = {}
    top: dict[str, int] = {}
    for c in queue:
        fewest[c.gpu_type] = min(fewest.get(c.gpu_type, c.gpus), c.gpus)
        top[c.gpu_type] = max(top.get(c.gpu_type, 0), c.gpus)
    return Menu(queue=queue, wide=wide, grow=grow, fewest=list(fewest.items()), least=min(fewest.values(), default=0),
                top=top,
                work=min((c.gpus * c.step_s for c in queue), default=INF),
                footprint_gib=min((c.gpus * c.plan.device_used_gib for c in queue), default=0.0))


def base_gpu_s(menu: list[Cand]) -> dict[str, float]:
    """Per GPU type, GPU-seconds per step of the menu's fewest-GPU plan there (the reference of
    parallel efficiency)."""
    fewest: dict[str, tuple[int, float]] = {}
    for step_s, n, g, _ in menu:
        if g not in fewest or n < fewest[g][0]:
            fewest[g] = (n, n * step_s)
    return {g: v[1] for g, v in fewest.items()}
