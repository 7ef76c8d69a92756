"""Plans and step times for simulated jobs, computed by the live estimator and cached.

A 15,000-job trace has only a few hundred distinct job shapes (model, seq_len, global_batch), so
plans are enumerated once per shape (``estimator.plans.plans_for_job``, the same call the
submit flow makes) and step times once per (plan, node span, network bandwidth)
(``estimator.throughput.step_time``).
"""
from __future__ import annotations

from functools import lru_cache

from estimator.errors import DoesNotFitError
from estimator.plan import Plan

# The simulator hands policies every plan the memory model says fits physically; each policy
# applies its own safety margin (that choice is part of what is being compared). The estimator
# fills each configuration with the largest micro-batch that fits under the margin it is given,
# so it is asked at several margins (fractions of the card's memory): the menu then holds both
# the packed, fastest variant of a configuration and roomier ones with smaller micro-batches.
SIM_MARGIN_FRACTIONS = (0.0, 0.12, 0.27)


def _training_job(model: str, seq_len: int, global_batch: int):
    from estimator.job import TrainingJob
    return TrainingJob(name="sim", model=model, seq_len=seq_len, global_batch=global_batch,
                       train_steps=1)


def pareto(plans: list[Plan]) -> list[Plan]:
    """Per (GPU type, count), drop plans that are both slower and bigger than another one.

    What is left is what any policy could want: the fastest plan, and plans that trade speed
    for memory headroom (useful after an out-of-memory failure).
    """
    groups: dict[tuple[str, int], list[Plan]] = {}
    for p in plans:
        groups.setdefault((p.gpu_type, p.gpus), []).append(p)
    out: list[Plan] = []
    for group in groups.values():
        group.sort(key=lambda p: (p.step_time_s, p.device_used_gib))
        best_mem = float("inf")
        for p in group:
            if p.device_used_gib < best_mem - 1e-9:
                out.append(p)
                best_mem = p.device_used_gib
    out.sort(key=lambda p: p.step_time_s)
    return out


class PlanBook:
    """All plans of each job shape on one cluster that Frenzy's trainer can launch there (none
    the planner marks ``not_launchable``), Pareto-pruned, fastest first: what a live submission
    may run, so the simulator's policies choose from the same menu."""

    def __init__(self, inventory: dict[str, int], gpus_per_node: dict[str, int],
                 margin_fractions: tuple[float, ...] = SIM_MARGIN_FRACTIONS,
                 memory_gib: dict[str, float] | None = None, gpus: dict | None = None,
                 host_ram_gib: dict[str, float] | None = None):
        """``gpus``: the cluster's GPU types (``Cluster.gpu_catalog()``: its custom types with
        the catalog's), looked up before the catalog. ``host_ram_gib``: host memory per node of
        each type (``Cluster.host_ram_gib()``): offload plans whose offloaded states do not fit
        it are not run; None: not checked."""
        self.inventory = dict(inventory)
        self.gpus_per_node = dict(gpus_per_node)
        self.margin_fractions = margin_fractions
        self.gpus = dict(gpus or {})
        self.host_ram_gib = dict(host_ram_gib or {})
        if memory_gib is None:
            from estimator.catalog import get_gpu
            memory_gib = {t: get_gpu(t, self.gpus).memory_gib for t in inventory}
        self.memory_gib = memory_gib
        self._cache: dict[tuple[str, int, int], list[Plan]] = {}

    def plans(self, model: str, seq_len: int, global_batch: int) -> list[Plan]:
        key = (model, seq_len, global_batch)
        hit = self._cache.get(key)
        if hit is None:
            from estimator.plans import enumerate_plans
            job = _training_job(model, seq_len, global_batch)
            found: list[Plan] = []
            for gpu_type, count in self.inventory.items():
                for frac in self.margin_fractions:
                    try:
                        # the planner marks what the trainer cannot launch (its own launch
                        # rules, and offload states beyond the node's host memory)
                        found += [p for p in enumerate_plans(job, gpu_type, max_gpus=count,
                                                             gpus_per_node=self.gpus_per_node.get(gpu_type, 8),
                                                             safety_margin_gib=frac * self.memory_gib[gpu_type],
                                                             gpus=self.gpus or None,
                                                             host_ram_gib=self.host_ram_gib.get(gpu_type))
                                  if p.not_launchable is None]
                    except DoesNotFitError:
                        break            # a bigger margin will not fit either
            hit = pareto(found)
            self._cache[key] = hit
        return hit

    def __len__(self) -> int:
        return len(self._cache)


@lru_cache(maxsize=4096)
def fastest_plan_at(model: str, seq_len: int, global_batch: int, gpu_type: str, gpus: int,
                    gpus_per_node: int = 8) -> Plan | None:
    """The fastest plan of exactly ``gpus`` GPUs of ``gpu_type`` that fits (estimator's default
    safety margin): what a competent author would run when asking for that type and count."""
    from estimator.plans import enumerate_plans
    try:
        plans = enumerate_plans(_training_job(model, seq_len, global_batch), gpu_type,
                                max_gpus=gpus, gpus_per_node=gpus_per_node)
    except DoesNotFitError:
        return None
    exact = [p for p in plans if p.gpus == gpus]
    return min(exact, key=lambda p: p.step_time_s) if exact else None


@lru_cache(maxsize=None)
def model_spec(model: str):
    from estimator.models import resolve_model
    return resolve_model(model)


class StepTimes:
    """Predicted step time of a plan on the placement it actually got (node span, slowest
    network among the pools it touches), from the live throughput model, memoised."""

    def __init__(self, gpus: dict):
        self.gpus = gpus                  # gpu_type -> estimator.catalog.GPU
        self._memo: dict[tuple[int, str, int, int, float], tuple[Plan, float]] = {}

    def at(self, model: str, seq_len: int, plan: Plan, nodes: int, inter_node_gbps: float | None) -> float:
        key = (id(plan), model, seq_len, nodes, inter_node_gbps or 0.0)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is plan:
            return hit[1]
        from estimator.throughput import step_time
        t = step_time(model_spec(model), plan, self.gpus[plan.gpu_type], seq_len=seq_len,
                      nodes=nodes, inter_node_gbps=inter_node_gbps)
        self._memo[key] = (plan, t)       # keep the plan alive so its id is not reused
        return t
