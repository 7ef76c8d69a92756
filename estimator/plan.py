"""A parallel plan: how one job runs on one GPU type. Shared by estimator, scheduler and trainer."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Precision = Literal["fp32", "fp16", "bf16"]
Optimizer = Literal["adamw", "adam", "sgd", "adafactor", "adamw8bit", "adamw8bit-paged"]
ActCkpt = Literal["none", "selective", "full"]
Offload = Literal["none", "optimizer", "optimizer+params"]
Attention = Literal["flash", "eager"]
MatmulPrecision = Literal["default", "tf32", "fp8"]   # fp32 GEMMs on TF32 tensor cores; FP8 GEMMs


# The fields that say how a plan runs (not what was predicted of it, nor where it was placed).
PLAN_KNOBS = ("gpu_type", "gpus", "dp", "tp", "pp", "vpp", "cp", "zero", "offload", "act_ckpt",
              "micro_batch", "grad_accum", "precision", "optimizer", "attention", "matmul_precision")


class Plan(BaseModel):
    """One candidate way to run a job: GPU type and count, parallel degrees, memory knobs.

    ``gpus == dp * tp * pp * cp`` (``vpp`` chunks per pipeline rank add no GPUs); ``micro_batch * grad_accum * dp == global_batch``.
    Predictions (``device_used_gib``, ``step_time_s``) are filled by the estimator and the
    throughput model; the scheduler never recomputes them.
    """

    model_config = ConfigDict(frozen=True)

    gpu_type: str
    gpus: int = Field(ge=1)
    dp: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    cp: int = Field(1, ge=1)
    # virtual pipeline stages per pp rank (interleaved 1F1B): each rank holds vpp non-adjacent
    # chunks of layers; 1 = plain 1F1B
    vpp: int = Field(1, ge=1)
    # the nodes its GPUs span: the planner's count (GPUs over the GPU type's GPUs per node,
    # rounded up: ``plan_filter.nodes_for``, what ``--plan nodes=N`` matches); in a run's result
    # the nodes its placement spans (a gang runs one process group per node)
    nodes: int = Field(1, ge=1)
    zero: int = Field(0, ge=0, le=3)
    offload: Offload = "none"
    act_ckpt: ActCkpt = "none"
    micro_batch: int = Field(1, ge=1)
    grad_accum: int = Field(1, ge=1)
    precision: Precision = "bf16"
    optimizer: Optimizer = "adamw"
    attention: Attention = "flash"
    matmul_precision: MatmulPrecision = "default"
    # predictions
    allocated_peak_gib: float = 0.0
    reserved_peak_gib: float = 0.0
    device_used_gib: float = 0.0
    step_time_s: float = 0.0
    # why this machine's trainer cannot launch the plan (None: it can); the planner shows such
    # plans after the launchable ones, marked
    not_launchable: str | None = None

    def same_knobs(self, other: "Plan | None") -> bool:
        """The same way to run (GPU type, count, degrees, memory knobs), whatever the predictions
        filled in, the node count the placement gave it or the launch verdict: a chosen plan
        found again among the candidates, whose predictions may have been refilled."""
        return other is not None and all(getattr(self, k) == getattr(other, k) for k in PLAN_KNOBS)

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.dp

    def short(self) -> str:
        return (f"{self.gpus}x{self.gpu_type} dp{self.dp} tp{self.tp} pp{self.pp}{'' if self.vpp == 1 else f' vpp{self.vpp}'} z{self.zero}"
                f"{'' if self.offload == 'none' else ' off:' + self.offload} ckpt:{self.act_ckpt}"
                f" mb{self.micro_batch}x{self.grad_accum}"
                f"{'' if self.not_launchable is None else ' (not launchable here)'}")
