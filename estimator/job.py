"""The training job a user submits. They name a model, data, sequence length and global batch;
never a GPU. This model is the parameter form of the ``frenzy-submit`` deployment in the UI."""
from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from .plan import Attention, Optimizer, Precision


def _not_bool(v: Any) -> Any:
    # YAML's `true` is an int to pydantic (train_steps: true trained 1 step): refuse it
    if isinstance(v, bool):
        raise ValueError(f"must be an integer, not a boolean ({v!r})")
    return v


Int = Annotated[int, BeforeValidator(_not_bool)]
"""An integer field that refuses booleans (pydantic's lax mode reads true as 1)."""

# Bounds of a job's numbers, each far beyond any published training run, so a typo or an
# overflow fails in one line here instead of deep in the planner or in a rank:
MAX_SEQ_LEN = 2 ** 24          # 16.8M tokens per sequence (the longest trained contexts are ~10M)
MAX_GLOBAL_BATCH = 2 ** 20     # sequences per step (LLM pre-training uses at most ~16k)
MAX_STEPS = 10 ** 9            # optimizer steps (large pre-training runs take ~10^6)
MAX_TOKENS = 10 ** 15          # training tokens (the largest public runs use ~4 x 10^13)
MAX_GPUS = 2 ** 20             # GPUs of a job, a type or one parallel dimension: beyond any cluster
                               # (the largest hold ~10^5); past it plan enumeration only spins
MAX_SEED = 2 ** 63 - 1         # torch.manual_seed takes a 64-bit integer; numpy wants < 2^63
MAX_DEADLINE_S = 366 * 86400.0  # a year of wall clock


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
        if self.kind == "synthetic" and self.path:
            # a path without a kind trained on synthetic tokens without a word
            raise ValueError("data.path: synthetic data reads no file; give data.kind (text, jsonl or datasets)")
        return self


def trains_adapters(spec: dict[str, Any] | None) -> bool:
    """Whether a job spec (a ``TrainingJob`` as a dict, e.g. the ledger's) trains LoRA / QLoRA
    adapters rather than every weight; a bare method name is read as ``finetune.method``."""
    ft = (spec or {}).get("finetune") or "full"
    return (ft.get("method", "full") if isinstance(ft, dict) else ft) != "full"


# a job's LoRA rank when it names none (``finetune.rank``), shared by the estimator's knobs and
# the planner: an estimate that names no rank describes the adapters such a job trains
DEFAULT_LORA_RANK = 16


class FinetuneSpec(BaseModel):
    """How the job trains the model's weights: all of them, or low-rank adapters (PEFT)."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["full", "lora", "qlora"] = Field(
        "full", description="full: every weight trains; lora: low-rank adapters on a frozen 16-bit "
                            "base; qlora: adapters on a 4-bit (NF4) base (GPU with bitsandbytes only)")
    rank: Int = Field(DEFAULT_LORA_RANK, gt=0, le=4096, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, allow_inf_nan=False, description="LoRA alpha (the update is scaled by alpha / r)")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: list[str] | None = Field(
        None, description="module names that get adapters (e.g. q_proj, v_proj), or all-linear (PEFT's "
                          "every linear layer but the output head); default: PEFT's default for the "
                          "architecture (q_proj, v_proj for Llama-family models; qkv_proj for phi3, "
                          "which PEFT has none for)")

    @field_validator("target_modules", mode="before")
    @classmethod
    def _one_name(cls, value):
        # PEFT takes target_modules="all-linear" (a string); a job file may write it so too
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _adapters_need_lora(self) -> "FinetuneSpec":
        # adapter settings under a full fine-tune would be ignored silently: say so instead (a
        # stored full job repeats the defaults, so only settings that differ from them count)
        if self.method == "full":
            given = [n for n in ("rank", "alpha", "dropout", "target_modules")
                     if getattr(self, n) != type(self).model_fields[n].default]
            if given:
                raise ValueError(f"{', '.join(given)}: adapter settings need method lora or qlora "
                                 f"(got method full)")
        return self


class OptimSpec(BaseModel):
    """Hyper-parameters of the job's ``optimizer`` (AdamW/Adam: all; SGD: weight decay; the
    momentum of SGD is 0.9) and gradient clipping."""

    model_config = ConfigDict(extra="forbid")

    betas: tuple[float, float] = Field((0.9, 0.95), description="Adam(W) beta1, beta2, each in [0, 1)")
    eps: float = Field(1e-8, gt=0, allow_inf_nan=False, description="Adam(W) epsilon")
    weight_decay: float = Field(0.1, ge=0, allow_inf_nan=False, description="decoupled weight decay (AdamW), L2 (others)")
    grad_clip: float | None = Field(1.0, gt=0, allow_inf_nan=False,
                                    description="clip the global gradient norm to this; null: no clipping")

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(betas):
            if not 0 <= b < 1:
                raise ValueError(f"beta{i + 1} must be in [0, 1) (got {b})")
        return betas


class ScheduleSpec(BaseModel):
    """The learning-rate schedule: linear warm-up from 0 to ``lr``, then constant or a decay to
    ``min_lr_ratio * lr`` at the last step. A function of the step alone (a resumed or re-sized
    run needs no scheduler state)."""

    model_config = ConfigDict(extra="forbid")

    kind: Literal["constant", "linear", "cosine"] = Field("constant", description="after the warm-up")
    warmup_steps: Int | None = Field(None, ge=0, le=MAX_STEPS, description="default: 10% of the steps, at most 100")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="the decay's end as a fraction of lr")


class EvalSpec(BaseModel):
    """A held-out split evaluated every ``every`` steps and after the last one: the mean token
    loss is reported (``eval_losses``) and tracked."""

    model_config = ConfigDict(extra="forbid")

    fraction: float | None = Field(None, gt=0, lt=1, description="hold out this fraction of the "
                                                                 "training data's sequences")
    data: DataSpec | None = Field(None, description="or evaluate on a separate data set")
    every: Int | None = Field(None, gt=0, le=MAX_STEPS, description="evaluate every N optimizer steps (and at the end); "
                                                      "null: at the end only")
    max_sequences: Int = Field(64, gt=0, le=MAX_GLOBAL_BATCH, description="evaluate on at most this many held-out sequences")

    @model_validator(mode="after")
    def _one_source(self) -> "EvalSpec":
        if (self.fraction is None) == (self.data is None):
            raise ValueError("give either eval.fraction (in (0, 1)) or eval.data")
        return self


class ExportSpec(BaseModel):
    """The trained model in Hugging Face format (``from_pretrained(export_dir)`` loads it),
    written at the end; a control-file request writes one at a step too."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="write the export at the end of training")
    dir: str | None = Field(None, description="where (default: <run folder>/export)")
    merge_adapters: bool = Field(False, description="LoRA/QLoRA: write the base with the adapters merged "
                                                    "(the adapters alone go to <dir>/adapter)")


class TrackingSpec(BaseModel):
    """MLflow tracking of the run: parameters, plan, estimate, losses, throughput, memory."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    uri: str | None = Field(None, description="MLflow tracking URI (a server URL, sqlite:///..., file:...); "
                                              "default: the FrenzySettings block's, else SQLite under FRENZY_HOME")
    experiment: str = Field("frenzy", min_length=1, description="MLflow experiment name")


def steps_for_tokens(train_tokens: int, global_batch: int, seq_len: int) -> int:
    """Optimizer steps that consume ``train_tokens`` (the last step may be partial)."""
    return max(1, math.ceil(train_tokens / (global_batch * seq_len)))


class TrainingJob(BaseModel):
    """A training job as submitted: what to train, on how much data, never which GPU."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field("frenzy-job", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
    model: str | dict[str, Any] | None = Field(
        None, description="a preset name (see `frenzy models`), a path to a Hugging Face config.json "
                          "or model folder, a Hub id in the local HF cache, or the dimensions {arch, "
                          "layers, hidden, heads, kv_heads, ffn, vocab, ...}; default: init_from's config")
    init_from: str | None = Field(
        None, min_length=1, description="start from these weights: a local Hugging Face model folder "
                                        "(config.json + safetensors) or a Hub id already in the local "
                                        "HF cache (nothing is downloaded); null: random initialisation")
    resume_from: str | None = Field(
        None, min_length=1, description="continue from this checkpoint: a run folder, a checkpoint folder "
                                        "or a job id under FRENZY_HOME/runs (default: the newest unfinished "
                                        "run of a job with the same name)")
    seq_len: Int = Field(..., gt=0, le=MAX_SEQ_LEN, description="tokens per training sequence")
    global_batch: Int = Field(..., gt=0, le=MAX_GLOBAL_BATCH,
                              description="sequences per optimizer step, kept on every plan")
    train_steps: Int | None = Field(None, gt=0, le=MAX_STEPS, description="optimizer steps (or give train_tokens)")
    train_tokens: Int | None = Field(None, gt=0, le=MAX_TOKENS, description="tokens to train on (or give train_steps)")
    precision: Precision = "bf16"
    master_weights: Literal["fp32", "none"] = Field(
        "fp32", description="fp32: mixed precision with fp32 master weights and optimizer states; "
                            "none: pure 16-bit training (weights, gradients and states in `precision`)")
    finetune: FinetuneSpec = Field(default_factory=FinetuneSpec,
                                   description="full fine-tune (default) or LoRA / QLoRA adapters")
    optimizer: Optimizer = "adamw"
    attention: Attention = "flash"
    lr: float = Field(3e-4, gt=0, allow_inf_nan=False, description="peak learning rate (after the warm-up)")
    optim: OptimSpec = Field(default_factory=OptimSpec, description="optimizer hyper-parameters, gradient clipping")
    schedule: ScheduleSpec = Field(default_factory=ScheduleSpec, description="learning-rate schedule")
    seed: Int = Field(0, ge=0, le=MAX_SEED, description="seed of the initialisation and the data order")
    data: DataSpec = Field(default_factory=DataSpec)
    entry_point: str | None = Field(
        None, pattern=r"^[A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*$",
        description="custom model: 'module:function' called with the model's Hugging Face config dict, "
                    "returning a torch module whose forward(input_ids=, labels=) gives a loss; "
                    "`model` still gives the dimensions the estimator sizes")
    checkpoint_every: Int = Field(50, gt=0, le=MAX_STEPS, description="save a checkpoint every N steps (and at the end)")
    eval: EvalSpec | None = Field(None, description="held-out evaluation (null: none)")
    export: ExportSpec = Field(default_factory=ExportSpec, description="Hugging Face export of the result")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="MLflow tracking")
    # constraints (all optional)
    allowed_gpu_types: list[str] | None = Field(
        None, description="only these GPU types: catalog names as --gpu takes them ('h100' is H100-80GB; "
                          "a family such as 'A100' allows each of its types), or a cluster's own types")
    max_gpus: Int | None = Field(None, gt=0, le=MAX_GPUS, description="use at most this many GPUs")
    deadline_s: float | None = Field(None, gt=0, le=MAX_DEADLINE_S, allow_inf_nan=False,
                                     description="wall-clock limit for the training run")

    @field_validator("allowed_gpu_types")
    @classmethod
    def _gpu_type_names(cls, v: list[str] | None) -> list[str] | None:
        # catalog names as a person writes them, made the catalog's (a lower-case or short name
        # matched no pool and silently dropped the type); a family allows all of its types; a
        # name the catalog does not know is kept for the cluster's own types, and the planner
        # refuses it if the cluster has no such type either (plans.check_allowed_gpu_types)
        if v is None:
            return None
        from .catalog import gpu_names_meant
        from .errors import FrenzyInputError
        out: list[str] = []
        for name in v:
            if not name.strip():
                raise ValueError("allowed_gpu_types: must hold GPU type names, got an empty one")
            try:
                meant = gpu_names_meant(name, field="allowed_gpu_types")
            except FrenzyInputError:        # not the catalog's: a cluster's own type, or a typo
                meant = [name]
            out += [n for n in meant if n not in out]
        return out

    @model_validator(mode="before")
    @classmethod
    def _model_from_init(cls, data: Any) -> Any:
        # The estimator sizes `model`: omitted, it is the config of the weights that will load.
        if isinstance(data, dict) and data.get("model") is None and data.get("init_from"):
            data = {**data, "model": data["init_from"]}
        return data

    @model_validator(mode="after")
    def _steps_or_tokens(self) -> "TrainingJob":
        if self.model is None:
            raise ValueError("model: give a model (preset, config, dimensions) or init_from (weights)")
        if self.train_steps is None and self.train_tokens is None:
            raise ValueError("train_steps: give train_steps or train_tokens")
        if self.train_steps is not None and self.train_tokens is not None:
            # one would be ignored: say which the user meant, rather than train the steps
            raise ValueError("train_steps: give train_steps or train_tokens, not both")
        return self

    @property
    def steps(self) -> int:
        if self.train_steps is not None:
            return self.train_steps
        return steps_for_tokens(self.train_tokens, self.global_batch, self.seq_len)
