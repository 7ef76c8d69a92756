"""`FrenzySettings` block: site-wide defaults for submissions, editable in the Prefect UI.

Secrets (the ledger URL, which usually carries a database password, and a Hugging Face token)
are ``SecretStr``: Prefect stores them encrypted, shows ``********`` in the UI and API, and
their repr/str/JSON never contain the value. Read them only with ``*_value()`` at the place
that connects.
"""
from __future__ import annotations

from typing import Iterable, Literal

from prefect.blocks.core import Block
from pydantic import Field, SecretStr, field_validator

from blocks.known_fields import KnownFields
from blocks.schema import tidy_block_schema
from estimator.plan import Optimizer, Plan, Precision

FallbackStep = Literal["act_ckpt", "zero", "offload", "more_gpus", "next_gpu_type"]
# The order, cheapest change first (trainer/fallback.py follows it).
DEFAULT_FALLBACK_ORDER: tuple[FallbackStep, ...] = ("act_ckpt", "zero", "offload", "more_gpus", "next_gpu_type")


def fallback_step(base: Plan, candidate: Plan) -> FallbackStep | None:
    """Which kind of fallback ``candidate`` is relative to the plan that ran out of memory
    (the largest change wins: a plan with offload usually also changed checkpointing)."""
    if candidate.gpu_type != base.gpu_type:
        return "next_gpu_type"
    if candidate.gpus != base.gpus:
        return "more_gpus"
    if candidate.offload != base.offload:
        return "offload"
    if candidate.zero != base.zero:
        return "zero"
    if candidate.act_ckpt != base.act_ckpt:
        return "act_ckpt"
    return None


class FrenzySettings(KnownFields, Block):
    """Defaults every Frenzy submission on this Prefect server uses unless the job says otherwise."""

    _block_type_name = "Frenzy Settings"
    _block_type_slug = "frenzy-settings"
    _description = ("Frenzy defaults: GPU ledger URL, memory safety margin, default precision and "
                    "optimizer, scheduling policy, the out-of-memory fallback order and the MLflow server.")

    ledger_url: SecretStr | None = Field(
        None, title="Ledger URL", description="SQLAlchemy URL of the GPU ledger, e.g. postgresql+psycopg://user:pw@host/db "
                          "(empty: SQLite under FRENZY_HOME)")
    safety_margin_gib: float | None = Field(
        None, ge=0, le=1024, allow_inf_nan=False, title="Safety margin (GiB)", description="GPU memory kept free beyond the prediction, GiB (empty: Frenzy's default)")
    default_precision: Precision = Field("bf16", description="precision for jobs that do not set one")
    default_optimizer: Optimizer = Field("adamw", description="optimizer for jobs that do not set one")
    policy: str = Field("frenzy", description="scheduling policy, e.g. frenzy, sia, gavel, tiresias (a name "
                                                     "it does not know is refused on save, with the list)")
    # a plain default (pydantic copies it per instance), not a factory: the schema then carries
    # it and a new block in the UI starts with every kind selected instead of none (none = every
    # fallback forbidden)
    fallback_order: list[FallbackStep] = Field(
        list(DEFAULT_FALLBACK_ORDER), title="Out-of-memory fallback order",
        description="out-of-memory fallbacks to try, in order; leave a kind out to forbid it")
    hf_token: SecretStr | None = Field(None, title="Hugging Face token",
                                       description="Hugging Face token for gated or private Hub models (used when "
                                                   "fetch_models is on)")
    fetch_models: bool = Field(False, title="Fetch Hub models",
                               description="download the Hugging Face Hub models a job names (configs, safetensors "
                                           "weights, tokenizer) into each machine's Hugging Face cache before use; "
                                           "off: nothing downloads, a model must already be in the cache")
    data_roots: list[str] = Field(
        default_factory=list, description="folders jobs may read data from, besides the job file's folder, "
                                          "the working directory and FRENZY_HOME")
    entry_point_modules: list[str] = Field(
        default_factory=list, description="modules (and their submodules) a job's entry_point may name, "
                                          "besides the trainer's own")
    mlflow_tracking_uri: str | None = Field(
        None, title="MLflow tracking URI", description="MLflow tracking server URL (e.g. http://mlflow:5000) for jobs that name none "
                          "(empty: SQLite under FRENZY_HOME)")

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, name: str) -> str:
        from scheduler.policies import policy_factory
        policy_factory(name)        # a mistyped policy fails when the block is made, not at a submission
        return name

    @classmethod
    def model_json_schema(cls, *args, **kwargs):
        # the block editor's form: optional fields without the "None" type tab (blocks/schema.py)
        return tidy_block_schema(super().model_json_schema(*args, **kwargs))

    def ledger_url_value(self) -> str | None:
        return self.ledger_url.get_secret_value() if self.ledger_url else None

    def hf_token_value(self) -> str | None:
        return self.hf_token.get_secret_value() if self.hf_token else None

    def order_fallbacks(self, base: Plan, candidates: Iterable[Plan]) -> list[Plan]:
        """``candidates`` (e.g. ``trainer.fallback.fallback_plans``) filtered to the allowed kinds
        and sorted by ``fallback_order``; the original order is kept within a kind."""
        rank = {step: i for i, step in enumerate(self.fallback_order)}
        keep = [(rank[s], i, p) for i, p in enumerate(candidates)
                if (s := fallback_step(base, p)) is not None and s in rank]
        return [p for _, _, p in sorted(keep, key=lambda t: (t[0], t[1]))]
