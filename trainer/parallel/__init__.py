"""Parallel layouts the training program launches beyond data parallel: which engine runs a
plan, and where each rank sits in it.

Plain data in, plain data out (a plan as a dict or a ``Plan``): imported by the training
program (torch, no pydantic) and by the launch-file writer alike.

Rank order (the one DeepSpeed's AutoTP mesh uses, ``(data_parallel, tensor_parallel)``): the
ranks of one tensor-parallel group are consecutive, so ``dp_rank = rank // tp`` and every rank
of a group is fed the same batch (AutoTP's first forward checks that it is).
"""
from __future__ import annotations

from typing import Any, NamedTuple


def _get(plan: Any, key: str, default: int = 1) -> Any:
    if isinstance(plan, dict):
        return plan.get(key, default)
    return getattr(plan, key, default)


def uses_deepspeed(plan: Any) -> bool:
    """Whether the plan runs under DeepSpeed's engine: ZeRO 1-3, or tensor parallel through
    AutoTP (which is DeepSpeed's, with ZeRO 0-3 beside it), or sequence parallel through
    DeepSpeed Ulysses (``trainer.parallel.ulysses``). Never a pipeline (``pp > 1``): it runs the
    program's own path (``trainer.parallel.pipeline``), ZeRO-1 through torch's
    ``ZeroRedundancyOptimizer``, ZeRO-2/3 through FSDP2."""
    if int(_get(plan, "pp")) > 1:
        return False
    return int(_get(plan, "zero", 0)) > 0 or int(_get(plan, "tp")) > 1 or int(_get(plan, "cp")) > 1


def pipeline_layers_rule(layers: int, pp: int, vpp: int = 1) -> tuple[str, str] | None:
    """Why a model of ``layers`` decoder layers cannot be cut into ``pp`` pipeline stages of
    ``vpp`` chunks each, as (plan field, one line), or None: every stage needs a layer, and an
    interleaved pipeline's ``pp x vpp`` chunks must be equal (each rank holds ``vpp`` of them;
    the estimator's interleaved activation term assumes equal chunks, as Megatron-LM does)."""
    if pp > 1 and layers < pp:
        return "plan.pp", f"{pp} stages but the model has {layers} layers"
    if vpp > 1 and layers % (pp * vpp):
        return "plan.vpp", (f"pp x vpp = {pp * vpp} must divide the model's {layers} layers "
                            f"(every rank holds vpp equal chunks)")
    return None


class Layout(NamedTuple):
    """One rank's coordinates in a dp x tp (or dp x cp) plan: the ranks of a tensor- or
    sequence-parallel group are consecutive and share a batch."""

    dp: int
    tp: int
    dp_rank: int
    tp_rank: int
    cp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.cp


def layout_of(plan: Any, rank: int) -> Layout:
    dp, tp, cp = int(_get(plan, "dp")), int(_get(plan, "tp")), int(_get(plan, "cp"))
    inner = tp * cp
    if not 0 <= rank < dp * inner:
        raise ValueError(f"rank {rank} outside a dp {dp} x tp {tp} x cp {cp} layout")
    return Layout(dp, tp, rank // inner, rank % tp, cp)


def plan_world(plan: Any) -> int:
    """Processes a plan runs: dp x tp x pp x cp."""
    return int(_get(plan, "dp")) * int(_get(plan, "tp")) * int(_get(plan, "pp")) * int(_get(plan, "cp"))


def builds_full_model(plan: Any) -> bool:
    """ZeRO-3 beside AutoTP: the model is built whole on each rank, not partitioned while it is
    built (transformers' partitioned loading refuses an AutoTP config: "Weight conversions ...
    with DeepSpeed Tensor Parallelism are not yet implemented", transformers 5.24); DeepSpeed
    then shards it at initialize, TP first, ZeRO-3 over the data-parallel ranks next."""
    return int(_get(plan, "zero", 0)) == 3 and int(_get(plan, "tp")) > 1


class without_partitioned_build:
    """Context: transformers' view of the DeepSpeed config hidden while the model is built
    (``builds_full_model``), restored after, so the export still gathers through it."""

    def __init__(self, accelerator, plan: Any):
        self.accelerator, self.active = accelerator, builds_full_model(plan)

    def __enter__(self):
        if self.active:
            from transformers.integrations.deepspeed import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        return self

    def __exit__(self, *exc):
        if self.active:
            self.accelerator.state.deepspeed_plugin.set_deepspeed_weakref()
        return False
