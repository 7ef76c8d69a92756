"""The training job a user submits. They name a model, data, sequence length and global batch;
never a GPU. This model is the parameter form of the ``frenzy-submit`` deployment in the UI."""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .plan import Attention, Optimizer, Precision


class DataSpec(BaseModel):
    """Where the training tokens come from."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["synthetic", "text", "jsonl", "datasets"] = Field(
        "synthetic", description="synthetic tokens for smoke runs, a local text/JSONL file, or a datasets folder saved to disk")
    path: str | None = Field(None, description="local file or folder (not for synthetic)")
    text_field: str = Field("text", description="JSONL / datasets column holding the text")
    tokenizer: str = Field("byte", description="'byte' (byte-level, offline) or a local tokenizer folder")

    @model_validator(mode="after")
    def _path_needed(self) -> "DataSpec":
        if self.kind != "synthetic" and not self.path:
            raise ValueError(f"data.path: required when data.kind is {self.kind!r}")
        return self


class FinetuneSpec(BaseModel):
    """How the job trains the model's weights: all of them, or low-rank adapters (PEFT)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["full", "lora", "qlora"] = Field(
        "full", description="full: every weight trains; lora: low-rank adapters on a frozen 16-bit "
                            "base; qlora: adapters on a 4-bit (NF4) base (GPU with bitsandbytes only)")
    rank: int = Field(16, gt=0, le=4096, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha (the update is scaled by alpha / r)")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | None = Field(
        None, description="module names that get adapters (e.g. q_proj, v_proj); default: PEFT's "
                          "default for the architecture")


def steps_for_tokens(train_tokens: int, global_batch: int, seq_len: int) -> int:
    """Optimizer steps that consume ``train_tokens`` (the last step may be partial)."""
    return max(1, math.ceil(train_tokens / (global_batch * seq_len)))


class TrainingJob(BaseModel):
    """A training job as submitted: what to train, on how much data, never which GPU."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("frenzy-job", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    model: str | dict[str, Any] = Field(
        ..., description="a preset name (see `frenzy models`), a path to a Hugging Face config.json, "
                         "or the dimensions {arch, layers, hidden, heads, kv_heads, ffn, vocab, ...}")
    seq_len: int = Field(..., gt=0)
    global_batch: int = Field(..., gt=0, description="sequences per optimizer step, kept on every plan")
    train_steps: int | None = Field(None, gt=0, description="optimizer steps (or give train_tokens)")
    train_tokens: int | None = Field(None, gt=0, description="tokens to train on (or give train_steps)")
    precision: Precision = "bf16"
    master_weights: Literal["fp32", "none"] = Field(
        "fp32", description="fp32: mixed precision with fp32 master weights and optimizer states; "
                            "none: pure 16-bit training (weights, gradients and states in `precision`)")
    finetune: FinetuneSpec = Field(default_factory=FinetuneSpec,
                                   description="full fine-tune (default) or LoRA / QLoRA adapters")
    optimizer: Optimizer = "adamw"
    attention: Attention = "flash"
    lr: float = Field(3e-4, gt=0)
    seed: int = 0
    data: DataSpec = Field(default_factory=DataSpec)
    entry_point: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="custom model: 'module:function' called with the model's Hugging Face config dict, "
                    "returning a torch module whose forward(input_ids=, labels=) gives a loss; "
                    "`model` still gives the dimensions the estimator sizes")
    checkpoint_every: int = Field(50, gt=0, description="save a checkpoint every N steps (and at the end)")
    # constraints (all optional)
    allowed_gpu_types: list[str] | None = Field(None, description="only these GPU types (catalog names)")
    max_gpus: int | None = Field(None, gt=0)
    deadline_s: float | None = Field(None, gt=0, description="wall-clock limit for the training run")

    @model_validator(mode="after")
    def _steps_or_tokens(self) -> "TrainingJob":
        if self.train_steps is None and self.train_tokens is None:
            raise ValueError("train_steps: give train_steps or train_tokens")
        return self

    @property
    def steps(self) -> int:
        if self.train_steps is not None:
            return self.train_steps
        return steps_for_tokens(self.train_tokens, self.global_batch, self.seq_len)
