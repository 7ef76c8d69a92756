"""Model shapes: presets from the models' published configs, Hugging Face config.json reading
(offline), and exact parameter counts per architecture.

One ``ModelSpec`` describes a dense decoder (or BERT encoder) by its dimensions plus the
architectural switches that change the parameter count: GQA (``kv_heads``), SwiGLU vs GeLU MLP,
biases, LayerNorm vs RMSNorm, tied or untied embeddings, learned vs rotary positions. The count
follows the Hugging Face implementation each ``hf_model_type`` builds, so ``params`` equals
``sum(p.numel() for p in AutoModelForCausalLM.from_config(...).parameters())``.

Pure: no torch, no transformers at import (``hf_config`` only returns a dict).
"""
from __future__ import annotations

import json
import operator
import os
import re
from functools import cached_property, lru_cache
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import FrenzyInputError

Arch = Literal["gpt", "llama", "bert", "opt"]

# the Hugging Face model types each arch builds (``hf_config``; the first by default), and those
# of them whose attention normalises queries and keys per head (``ModelSpec.has_qk_norm``)
HF_TYPES = {"gpt": ("gpt2",), "llama": ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                      "phi3"),
            "bert": ("bert",), "opt": ("opt",)}
QK_NORM_TYPES = ("qwen3", "gemma3_text")
# Gemma's RMSNorm computes in fp32 and scales by (1 + weight) before casting back (Llama casts
# first, then scales): other saved tensors (``memory.layer_activation_bytes``); its MLP gates
# with tanh-approximated GELU (the same saved tensors as SwiGLU) and it ties its embeddings
GEMMA_TYPES = ("gemma", "gemma2", "gemma3_text")
# a norm after each sublayer too (post-attention and post-feedforward, beside the usual two)
SANDWICH_NORM_TYPES = ("gemma2", "gemma3_text")
# the types whose config's sliding_window the built model applies: Mistral and Phi-3 to every
# layer, Gemma 2 to every other one, Gemma 3 to all but every ``window_pattern``-th
WINDOW_TYPES = ("mistral", "gemma2", "gemma3_text", "phi3")
# Phi-3 computes q, k and v with one projection (qkv_proj) and the gate and up halves of its MLP
# with another (gate_up_proj), then slices them: the weights, FLOPs and saved tensors of the
# separate projections (the slices are views of one output, which their saved uses keep alive
# whole, as the separate outputs are kept), other module names (LoRA adapts a fused projection
# as one) and tensor shapes (per-tensor optimizer states)
FUSED_PROJ_TYPES = ("phi3",)
PHI3_VOCAB = 32064          # Phi-3's tokenizer (Llama 2's 32,000 + its special tokens)
# the types with Gemma's alternating layer layout (``gemma_layer_types``), and their period
LAYOUT_TYPES = {"gemma2": 2, "gemma3_text": 6}
# the fields only some model types have, and those types
TYPE_FIELDS = {"window_pattern": ("gemma3_text",), "rope_local_theta": ("gemma3_text",),
               "query_pre_attn_scalar": ("gemma2", "gemma3_text"), "attn_softcap": ("gemma2",),
               "logit_softcap": ("gemma2",), "rotary_fraction": ("phi3",)}
# the types whose Hugging Face attention has no SDPA path (Gemma 2 soft-caps its scores, which
# SDPA cannot): they attend with eager kernels (``memory.attention_for``)
EAGER_ONLY_TYPES = ("gemma2",)


# architectures whose Hugging Face configs have no KV-head count: every head its own k and v
NO_GQA_ARCHS = ("bert", "gpt", "opt")


def stage_layers(layers: int, stages: int) -> list[int]:
    """The layers of each of ``stages`` pipeline stages (or interleaved chunks): as even as the
    count allows, the first stages one more (the trainer's stages are these:
    ``trainer.parallel.pipeline.stage_layers``)."""
    base, extra = divmod(layers, stages)
    return [base + (1 if i < extra else 0) for i in range(stages)]


def gemma_layer_types(layers: int, pattern: int) -> tuple[str, ...]:
    """Gemma 2 and 3's layer layout: every ``pattern``-th layer attends globally, the others
    through the sliding window (Gemma 2: every other layer; Gemma3TextConfig's
    ``sliding_window_pattern`` rule)."""
    return tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers))
# The fields a spec's hash covers: the ones that tell models apart. Equal specs agree on them,
# so the hash stays consistent with ==; specs that differ elsewhere only (dropout, ...) meet
# in one bucket and == tells them apart. (Specs key the estimator's caches on every estimate:
# hashing all 24 fields cost more than the cache lookup saved.)
_HASH_FIELDS = operator.itemgetter("name", "layers", "hidden", "heads", "vocab")


MAX_DIM = 2 ** 24    # the longest trained contexts are ~10M tokens; widths and vocabularies far less


class ModelSpec(BaseModel):
    """Dimensions of one transformer. Defaults per ``arch`` fill what is not given."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = "custom"
    arch: Arch = "gpt"
    layers: int = Field(..., description="transformer blocks")
    hidden: int
    heads: int
    kv_heads: int | None = Field(None, description="key/value heads (GQA); default = heads")
    ffn: int | None = Field(None, description="MLP inner size; default 4*hidden (gpt/bert/opt), "
                                             "the LLaMA rule (2/3 * 4h rounded to 256) for llama")
    vocab: int = Field(..., description="token vocabulary; 0: an encoder without one (ViT: patch "
                                        "embedding, no LM head, no logits)")
    tied_embeddings: bool | None = Field(None, description="LM head shares the input embedding")
    max_positions: int | None = Field(None, description="learned position table rows / rope context; "
                                                        "None: not capped (a learned table is sized "
                                                        "to the sequence, see with_positions)")
    gated_mlp: bool | None = Field(None, description="gated (SwiGLU) MLP: 3 h x ffn matrices; "
                                                     "default: llama yes, others no")
    cross_attn_layers: int = Field(0, ge=0, description="encoder-decoder: decoder blocks that add "
                                                        "cross-attention and a norm (nn.Transformer)")
    head_dim: int | None = Field(None, description="default hidden // heads")
    qkv_bias: bool | None = Field(None, description="bias on q/k/v projections (qwen2: yes)")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="residual/MLP/embedding dropout")
    attn_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on attention probs")
    hf_model_type: str | None = Field(None, description="gpt2 | llama | mistral | qwen2 | qwen3 | gemma | "
                                                        "gemma2 | gemma3_text | phi3 | opt | bert")
    # OPT-350m projects a 512-wide embedding to the 1024-wide model and back.
    embed_dim: int | None = Field(None, description="word embedding width when it differs (opt-350m)")
    pre_norm: bool = Field(True, description="LayerNorm before each sublayer (opt-350m: after)")
    type_vocab: int = Field(2, description="BERT token-type embeddings")
    vocab_multiple: int = Field(1, ge=1, description="frameworks that pad the vocabulary "
                                                     "(Megatron: 128) round it up to this multiple")
    rope_theta: float | None = None
    norm_eps: float | None = None
    sliding_window: int | None = None
    window_pattern: int | None = Field(None, description="Gemma 3: every n-th layer attends globally, the "
                                                         "others through the sliding window (the config's "
                                                         "sliding_window_pattern; default 6)")
    query_pre_attn_scalar: int | None = Field(None, description="Gemma 2 / 3: attention scores scale by its "
                                                                "inverse square root (default 256)")
    rope_local_theta: float | None = Field(None, description="Gemma 3: the rotary base of the sliding-window "
                                                             "layers (default 10,000)")
    attn_softcap: float | None = Field(None, gt=0, description="Gemma 2: attention scores soft-capped at this "
                                                              "(tanh; its config's attn_logit_softcapping)")
    logit_softcap: float | None = Field(None, gt=0, description="Gemma 2: output logits soft-capped at this "
                                                               "(its config's final_logit_softcapping)")
    # the same saved tensors and (to the rotary's few FLOPs) the same work as a whole rotary: the
    # rotated part is concatenated with the rest into a new tensor, as the whole one is made
    # (saved-tensor hooks: equal bytes at 1, 0.75, 0.5); kept so the model built is the config's
    rotary_fraction: float | None = Field(None, description="Phi-4-mini: the share of each head the rotary "
                                                            "embedding turns (its partial_rotary_factor; "
                                                            "default 1)")

    def __hash__(self) -> int:
        return hash(_HASH_FIELDS(self.__dict__))

    @model_validator(mode="before")
    @classmethod
    def _check_raw(cls, data: Any) -> Any:
        # Name the field and the rule before pydantic's generic messages.
        if isinstance(data, dict):
            for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "head_dim",
                        "max_positions", "embed_dim", "type_vocab", "sliding_window", "window_pattern",
                    "query_pre_attn_scalar"):
                v = data.get(key)
                if v is None:
                    continue
                if isinstance(v, bool):              # True is 1 to int(): never a dimension
                    raise FrenzyInputError(key, f"must be a positive integer, got {v!r}")
                if not isinstance(v, int):
                    try:
                        iv = int(v)
                    except (TypeError, ValueError, OverflowError):
                        raise FrenzyInputError(key, f"must be a positive integer, got {v!r}") from None
                    if iv != v:
                        raise FrenzyInputError(key, f"must be a positive integer, got {v!r}")
                    data = {**data, key: iv}
                    v = iv
                # vocabulary-free encoders (ViT) and models without token types have 0 rows
                if v < 0 or (v == 0 and key not in ("vocab", "type_vocab")):
                    raise FrenzyInputError(key, f"must be a positive integer, got {v}")
                if v > MAX_DIM:
                    raise FrenzyInputError(key, f"must be at most {MAX_DIM:,} (no transformer's dimension, "
                                                f"vocabulary or position table is larger), got {v:,}")
            for key in ("attn_softcap", "logit_softcap"):
                v = data.get(key)
                if v is not None and (type(v) not in (int, float) or not 0 < v < float("inf")):
                    raise FrenzyInputError(key, f"must be a positive finite number or null, got {v!r}")
            v = data.get("rotary_fraction")
            if v is not None and (type(v) not in (int, float) or not 0 < v <= 1):
                raise FrenzyInputError("rotary_fraction", f"must be a number in (0, 1] or null, got {v!r}")
        return data

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        if self.head_dim is None and self.hidden % self.heads:
            raise FrenzyInputError("heads", f"must divide hidden ({self.hidden} % {self.heads} != 0)")
        kv = self.kv_heads if self.kv_heads is not None else self.heads
        if kv > self.heads or self.heads % kv:
            raise FrenzyInputError("kv_heads", f"must divide heads ({self.heads} % {kv} != 0)")
        if self.vocab == 0 and self.arch != "bert":
            # a decoder's output is next-token logits; only an encoder (ViT: arch bert, patch
            # embeddings) trains without a vocabulary
            raise FrenzyInputError("vocab", f"0 (no vocabulary) is for encoders (arch bert, e.g. ViT); "
                                            f"a {self.arch} decoder predicts tokens from one")
        if self.arch in NO_GQA_ARCHS and self.kv_heads not in (None, self.heads):
            raise FrenzyInputError("kv_heads", f"{self.arch} has no grouped-query attention (kv_heads == heads)")
        if self.model_type in ("mistral", "phi3") and self.qkv_bias:
            raise FrenzyInputError("qkv_bias", f"{self.model_type} has no attention biases (its config builds none)")
        if self.model_type == "phi3" and self.head_dim is not None and self.head_dim * self.heads != self.hidden:
            raise FrenzyInputError("head_dim", f"phi3 heads are hidden / heads wide (got {self.head_dim} x "
                                               f"{self.heads} for hidden {self.hidden})")
        for key, types in TYPE_FIELDS.items():
            if getattr(self, key) is not None and self.model_type not in types:
                raise FrenzyInputError(key, f"only {' and '.join(types)} {'has' if len(types) == 1 else 'have'} it")
        if self.model_type in LAYOUT_TYPES and self.hidden % self.heads:
            # Gemma3TextConfig refuses it whatever head_dim says
            raise FrenzyInputError("heads", f"must divide hidden for {self.model_type} ({self.hidden} % {self.heads} != 0)")
        if self.model_type in LAYOUT_TYPES and self.sliding_window is None:
            raise FrenzyInputError("sliding_window", f"required for {self.model_type} (its local layers' window)")
        if self.hf_model_type is not None and self.hf_model_type not in HF_TYPES[self.arch]:
            # hf_config builds only these; another type would be sized as one of them
            raise FrenzyInputError("hf_model_type", f"must be one of {', '.join(HF_TYPES[self.arch])} for arch "
                                                    f"{self.arch} (got {self.hf_model_type!r})")
        return self

    # ---- resolved dimensions (defaults per arch) ----
    @property
    def n_kv(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def d_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def f(self) -> int:
        if self.ffn is not None:
            return self.ffn
        if self.arch == "llama":          # LLaMA: 2/3 of 4h, rounded up to a multiple of 256
            return 256 * ((int(8 * self.hidden / 3) + 255) // 256)
        return 4 * self.hidden

    @property
    def tied(self) -> bool:
        if self.tied_embeddings is not None:
            return self.tied_embeddings
        # gpt2/opt/bert and Gemma tie; the rest of the llama family is untied by default
        return self.arch != "llama" or self.model_type in GEMMA_TYPES

    @property
    def gated(self) -> bool:
        return self.gated_mlp if self.gated_mlp is not None else self.arch == "llama"

    @property
    def positions(self) -> int:
        """Rows of the position table (2048 when the model does not say: see with_positions)."""
        return self.max_positions if self.max_positions is not None else 2048

    @property
    def has_qkv_bias(self) -> bool:
        if self.qkv_bias is not None:
            return self.qkv_bias
        return self.arch != "llama"

    @property
    def model_type(self) -> str:
        return self.hf_model_type or HF_TYPES[self.arch][0]

    @property
    def largest_block_matrix(self) -> int:
        """Elements of a block's largest weight matrix (per-tensor temporaries: Adafactor's
        update, optimizer-in-backward): an MLP matrix, or Phi-3's fused gate_up_proj (2 ffn x h)
        or qkv_proj."""
        if self.fused_proj:
            h = self.hidden
            return max(2 * self.f * h, (self.heads + 2 * self.n_kv) * self.d_head * h)
        return self.hidden * self.f

    @property
    def fused_proj(self) -> bool:
        """q/k/v in one projection and gate/up in another (``FUSED_PROJ_TYPES``)."""
        return self.model_type in FUSED_PROJ_TYPES

    @property
    def window(self) -> int | None:
        """The sliding attention window the built model applies (``sliding_window`` of
        ``WINDOW_TYPES``; the other types' ``hf_config`` builds none), or None."""
        return self.sliding_window if self.model_type in WINDOW_TYPES else None

    def window_reached(self, seq_len: int) -> bool:
        """Whether sequences of ``seq_len`` reach the window of some layer: Hugging Face then
        attends through an explicit mask there (shorter ones take SDPA's is_causal path)."""
        w = self.window
        return w is not None and seq_len >= w and self.windowed_layers() > 0

    @property
    def layer_types(self) -> tuple[str, ...] | None:
        """Gemma 2 and 3's per-layer attention (``gemma_layer_types``: Gemma 2 every other
        layer global, Gemma 3 every ``window_pattern``-th, default 6), or None: every layer
        alike."""
        p = LAYOUT_TYPES.get(self.model_type)
        if p is None:
            return None
        return gemma_layer_types(self.layers, self.window_pattern or p)

    @property
    def eager_only(self) -> bool:
        """Hugging Face builds no fused (SDPA) attention for it (``EAGER_ONLY_TYPES``)."""
        return self.model_type in EAGER_ONLY_TYPES

    def windowed_layers(self, lo: int = 0, hi: int | None = None) -> int:
        """How many of the layers ``lo..hi-1`` attend through the window."""
        hi = self.layers if hi is None else hi
        if self.window is None:
            return 0
        types = self.layer_types
        return hi - lo if types is None else types[lo:hi].count("sliding_attention")

    def window_share(self, seq_len: int, chunks: int = 1, whole_layer: bool = False) -> float:
        """The share of a stage's layers that attend through an explicit mask at ``seq_len``
        (0 where the window is longer than the sequence). One stage (``chunks`` 1): the model's
        share; cut into ``chunks`` pipeline chunks (pp x vpp): the largest chunk's, so no stage
        is charged less than it holds; ``whole_layer``: the bytes of one block alive at a time
        (full checkpointing's recomputed block), a windowed one where there is any."""
        if not self.window_reached(seq_len):
            return 0.0
        if whole_layer:
            return 1.0
        if chunks <= 1:
            return self.windowed_layers() / self.layers
        shares, lo = [], 0
        for n in stage_layers(self.layers, chunks):
            if n:
                shares.append(self.windowed_layers(lo, lo + n) / n)
            lo += n
        return max(shares)

    @property
    def norms_per_layer(self) -> int:
        """A block's hidden-wide norms: two, four with ``sandwich_norms``."""
        return 4 if self.sandwich_norms else 2

    @property
    def gemma_norms(self) -> bool:
        """RMSNorms that scale in fp32 by (1 + weight), then cast (``GEMMA_TYPES``)."""
        return self.model_type in GEMMA_TYPES

    @property
    def sandwich_norms(self) -> bool:
        """Four norms a block: the output of attention and of the MLP normalised too."""
        return self.model_type in SANDWICH_NORM_TYPES

    @property
    def has_o_bias(self) -> bool:
        """Whether the attention output projection has a bias: llama, qwen3 and Gemma put one
        on it with their ``attention_bias``; qwen2's biases are on q, k and v only."""
        return self.has_qkv_bias and self.model_type in ("llama", "qwen3", *GEMMA_TYPES)

    @property
    def has_qk_norm(self) -> bool:
        """An RMSNorm over each head's queries and keys before the rotary embedding (Qwen3's
        ``q_norm`` / ``k_norm``: ``head_dim`` weights each, applied to every head's slice)."""
        return self.model_type in QK_NORM_TYPES

    @property
    def vocab_padded(self) -> int:
        m = self.vocab_multiple
        return -(-self.vocab // m) * m

    @property
    def e(self) -> int:
        """Word-embedding width."""
        return self.embed_dim or self.hidden

    # ---- parameter counts (exact, as the HF implementation builds them) ----
    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        h, f, dh = self.hidden, self.f, self.d_head
        q = self.heads * dh
        kv = self.n_kv * dh
        if self.arch == "llama":
            attn = h * q + 2 * h * kv + q * h
            if self.has_qkv_bias:
                attn += q + 2 * kv + (h if self.has_o_bias else 0)
            mlp = 3 * h * f
            norms = self.norms_per_layer * h + (2 * dh if self.has_qk_norm else 0)
        else:  # gpt2 / opt / bert: biases everywhere, LayerNorm weight + bias
            attn = h * q + 2 * h * kv + q * h + q + 2 * kv + h
            mlp = (3 * h * f + 2 * f + h) if self.gated else (2 * h * f + f + h)
            norms = 4 * h
        return attn + mlp + norms

    def cross_attn_params(self) -> int:
        """All decoder blocks' cross-attention (q, k, v, out with biases) and its LayerNorm."""
        h = self.hidden
        return self.cross_attn_layers * (4 * h * h + 4 * h + 2 * h)

    def embedding_params(self) -> int:
        """Input side: token (+ position, token-type) embeddings and their norms/projections."""
        h, V = self.hidden, self.vocab_padded
        if self.arch == "gpt":
            return V * h + self.positions * h
        if self.arch == "opt":
            n = V * self.e + (self.positions + 2) * h   # OPT offsets positions by 2
            if self.e != h:
                n += self.e * h                               # project_in (no bias)
            return n
        if self.arch == "bert":
            if V == 0:                                        # ViT-style: positions, final norm
                return self.positions * h
            return V * h + self.positions * h + self.type_vocab * h + 2 * h
        return V * h

    def head_params(self) -> int:
        """Output side: final norm, LM head (0 when tied), BERT pooler."""
        h, V = self.hidden, self.vocab_padded
        if self.arch == "gpt":
            final = 2 * h
        elif self.arch == "opt":
            final = (2 * h if self.pre_norm else 0) + (h * self.e if self.e != h else 0)
        elif self.arch == "bert":
            if V == 0:
                return 2 * h                                  # encoder without vocabulary: final norm
            # pooler (BertModel); an untied output projection (nn.Transformer's decoder Linear,
            # an untied MLM decoder) is its own V x e weight
            return h * h + h + (0 if self.tied else V * self.e)
        else:
            final = h
        return final + (0 if self.tied else V * self.e)

    @cached_property
    def params(self) -> int:
        """Exact parameter count of the published model (BertModel for bert)."""
        return (self.embedding_params() + self.layers * self.layer_params() + self.head_params()
                + self.cross_attn_params())

    @cached_property
    def train_params(self) -> int:
        """Parameters of the model that trains: the causal LM; for bert the masked-LM model
        (BertForMaskedLM: no pooler, plus the MLM transform, its LayerNorm and decoder bias)."""
        if self.arch == "bert" and self.vocab_padded:
            h = self.hidden
            return self.params - (h * h + h) + (h * h + h) + 2 * h + self.vocab_padded
        return self.params

    def largest_layer_params(self) -> int:
        """Largest single parameter tensor group ZeRO-3 gathers at once (embedding or a block)."""
        return max(self.vocab_padded * self.e, self.layer_params() + (
            self.cross_attn_params() // self.layers if self.layers else 0))

    def weight_shapes(self) -> list[tuple[int, ...]]:
        """Shapes of every trainable tensor (for per-tensor optimizer states: Adafactor, 8-bit)."""
        h, f, dh, V = self.hidden, self.f, self.d_head, self.vocab_padded
        q, kv = self.heads * dh, self.n_kv * dh
        per_layer: list[tuple[int, ...]] = []
        if self.arch == "llama" and self.fused_proj:
            per_layer += [(q + 2 * kv, h), (h, q), (2 * f, h), (h, f), (h,), (h,)]
        elif self.arch == "llama":
            per_layer += [(q, h), (kv, h), (kv, h), (h, q), (f, h), (f, h), (h, f), (h,), (h,)]
            if self.sandwich_norms:
                per_layer += [(h,), (h,)]
            if self.has_qkv_bias:
                per_layer += [(q,), (kv,), (kv,)] + ([(h,)] if self.has_o_bias else [])
            if self.has_qk_norm:
                per_layer += [(dh,), (dh,)]
        else:
            per_layer += [(q, h), (kv, h), (kv, h), (h, q), (q,), (kv,), (kv,), (h,),
                          (f, h), (f,), (h, f), (h,), (h,), (h,), (h,), (h,)]
            if self.gated:
                per_layer += [(f, h), (f,)]
        shapes = per_layer * self.layers
        shapes += [(h, h), (h, h), (h, h), (h, h), (h,), (h,), (h,), (h,), (h,), (h,)] * self.cross_attn_layers
        if V:
            shapes.append((V, self.e))
        if self.arch == "gpt":
            shapes += [(self.positions, h), (h,), (h,)]
        elif self.arch == "opt":
            shapes.append((self.positions + 2, h))
            if self.e != h:
                shapes += [(h, self.e), (self.e, h)]
            if self.pre_norm:
                shapes += [(h,), (h,)]
        elif self.arch == "bert" and not V:
            shapes += [(self.positions, h), (h,), (h,)]
        elif self.arch == "bert":
            shapes += [(self.positions, h), (self.type_vocab, h), (h,), (h,),
                       (h, h), (h,), (h,), (h,), (V,)]     # MLM transform, LN, decoder bias
        else:
            shapes.append((h,))
        if not self.tied and V:
            shapes.append((V, self.e))
        return shapes

    # ---- Hugging Face config ----
    def hf_config(self) -> dict[str, Any]:
        """Keyword arguments for ``transformers.AutoConfig.for_model(**d)`` that build exactly
        this model (``model_type`` included). Offline: no hub access."""
        t = self.model_type
        h, V = self.hidden, self.vocab_padded
        if t == "gpt2":
            return dict(model_type="gpt2", n_embd=h, n_layer=self.layers, n_head=self.heads,
                        n_inner=self.f, n_positions=self.positions, vocab_size=V,
                        resid_pdrop=self.dropout, embd_pdrop=self.dropout,
                        attn_pdrop=self.attn_dropout, tie_word_embeddings=self.tied,
                        activation_function="gelu_new", layer_norm_epsilon=self.norm_eps or 1e-5,
                        bos_token_id=V - 1, eos_token_id=V - 1)
        if t == "opt":
            return dict(model_type="opt", hidden_size=h, num_hidden_layers=self.layers,
                        num_attention_heads=self.heads, ffn_dim=self.f, vocab_size=V,
                        max_position_embeddings=self.positions, word_embed_proj_dim=self.e,
                        do_layer_norm_before=self.pre_norm, dropout=self.dropout,
                        attention_dropout=self.attn_dropout, activation_function="relu",
                        tie_word_embeddings=self.tied, enable_bias=True,
                        pad_token_id=1, bos_token_id=2, eos_token_id=2)
        if t == "bert":
            return dict(model_type="bert", hidden_size=h, num_hidden_layers=self.layers,
                        num_attention_heads=self.heads, intermediate_size=self.f, vocab_size=V,
                        max_position_embeddings=self.positions,
                        type_vocab_size=self.type_vocab, hidden_dropout_prob=self.dropout,
                        attention_probs_dropout_prob=self.attn_dropout,
                        tie_word_embeddings=self.tied)
        # llama family (llama, mistral, qwen2, qwen3, gemma, gemma3_text)
        d: dict[str, Any] = dict(model_type=t, hidden_size=h, num_hidden_layers=self.layers,
                                 num_attention_heads=self.heads, num_key_value_heads=self.n_kv,
                                 intermediate_size=self.f, vocab_size=V,
                                 max_position_embeddings=self.positions,
                                 tie_word_embeddings=self.tied, attention_dropout=self.attn_dropout,
                                 rms_norm_eps=self.norm_eps or 1e-5, hidden_act="silu")
        if t in GEMMA_TYPES:
            # tanh GELU (Gemma 3 names it hidden_activation); heads 256 wide unless given;
            # biases on all four attention projections or none; the published 1e-6 norm epsilon
            d.pop("hidden_act")
            d["hidden_act" if t == "gemma" else "hidden_activation"] = "gelu_pytorch_tanh"
            d["head_dim"] = self.d_head
            d["attention_bias"] = self.has_qkv_bias
            d["rms_norm_eps"] = self.norm_eps or 1e-6
            d["pad_token_id"], d["bos_token_id"], d["eos_token_id"] = 0, min(2, V - 1), min(1, V - 1)
        if t in LAYOUT_TYPES:
            d["sliding_window"] = self.sliding_window
            d["layer_types"] = list(self.layer_types)
            if self.query_pre_attn_scalar is not None:
                d["query_pre_attn_scalar"] = self.query_pre_attn_scalar
            if self.rope_local_theta is not None:
                d["rope_local_base_freq"] = self.rope_local_theta
            d["attn_logit_softcapping"], d["final_logit_softcapping"] = self.attn_softcap, self.logit_softcap
        if self.rope_theta is not None:
            d["rope_theta"] = self.rope_theta
        if t == "llama":
            d["attention_bias"] = self.has_qkv_bias
            d["mlp_bias"] = False
            if self.head_dim is not None:
                d["head_dim"] = self.head_dim
        elif t == "mistral":
            d["sliding_window"] = self.sliding_window
            if self.head_dim is not None:
                d["head_dim"] = self.head_dim
        elif t == "qwen2":
            d["use_sliding_window"] = False
        elif t == "qwen3":
            d["head_dim"] = self.d_head                # Qwen3Config's default is 128, not hidden / heads
            d["attention_bias"] = self.has_qkv_bias
            d["use_sliding_window"] = False
        elif t == "phi3":
            # no dropout, whole rotary; Phi3Config's token ids (32000 pads) only for Phi-3's own
            # 32,064-token vocabulary: elsewhere (phi-4's 100,352) 32000 is an ordinary token,
            # whose embedding row a padding index would freeze
            phi3_vocab = V == PHI3_VOCAB
            d.update(sliding_window=self.sliding_window, original_max_position_embeddings=self.positions,
                     resid_pdrop=0.0, embd_pdrop=0.0, partial_rotary_factor=self.rotary_fraction or 1.0,
                     pad_token_id=32000 if phi3_vocab else None, bos_token_id=min(1, V - 1),
                     eos_token_id=32000 if phi3_vocab else V - 1)
        return d

    def dims(self) -> dict[str, Any]:
        """The dimensions as plain keywords (for JSON and `frenzy models`)."""
        return dict(arch=self.arch, layers=self.layers, hidden=self.hidden, heads=self.heads,
                    kv_heads=self.n_kv, ffn=self.f, vocab=self.vocab, tied_embeddings=self.tied)


def _llama(name, layers, hidden, heads, kv, ffn, vocab, *, tied=False, qkv_bias=False,
           hf="llama", max_pos=4096, theta=None, eps=1e-5, **kw) -> ModelSpec:
    return ModelSpec(name=name, arch="llama", layers=layers, hidden=hidden, heads=heads,
                     kv_heads=kv, ffn=ffn, vocab=vocab, tied_embeddings=tied, qkv_bias=qkv_bias,
                     hf_model_type=hf, max_positions=max_pos, rope_theta=theta, norm_eps=eps, **kw)


def _gpt2(name, layers, hidden, heads) -> ModelSpec:
    return ModelSpec(name=name, arch="gpt", layers=layers, hidden=hidden, heads=heads, vocab=50257,
                     max_positions=1024, dropout=0.1, attn_dropout=0.1)


def _opt(name, layers, hidden, heads, ffn, **kw) -> ModelSpec:
    return ModelSpec(name=name, arch="opt", layers=layers, hidden=hidden, heads=heads, ffn=ffn,
                     vocab=50272, max_positions=2048, dropout=0.1, attn_dropout=0.0, **kw)


def _bert(name, layers, hidden, heads) -> ModelSpec:
    return ModelSpec(name=name, arch="bert", layers=layers, hidden=hidden, heads=heads,
                     vocab=30522, max_positions=512, dropout=0.1, attn_dropout=0.1, norm_eps=1e-12)


# Facts from each model's published config.json on the Hugging Face hub.
PRESETS: dict[str, ModelSpec] = {m.name: m for m in [
    ModelSpec(name="gpt2-tiny", arch="gpt", layers=2, hidden=64, heads=4, vocab=256,
              max_positions=256),
    _gpt2("gpt2", 12, 768, 12),
    _gpt2("gpt2-medium", 24, 1024, 16),
    _gpt2("gpt2-large", 36, 1280, 20),
    _gpt2("gpt2-xl", 48, 1600, 25),
    _bert("bert-base-uncased", 12, 768, 12),
    _bert("bert-large-uncased", 24, 1024, 16),
    _opt("opt-125m", 12, 768, 12, 3072),
    _opt("opt-350m", 24, 1024, 16, 4096, embed_dim=512, pre_norm=False),
    _opt("opt-1.3b", 24, 2048, 32, 8192),
    _opt("opt-2.7b", 32, 2560, 32, 10240),
    _opt("opt-6.7b", 32, 4096, 32, 16384),
    _opt("opt-13b", 40, 5120, 40, 20480),
    _opt("opt-30b", 48, 7168, 56, 28672),
    _llama("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
    _llama("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),
    _llama("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
    _llama("llama-3-8b", 32, 4096, 32, 8, 14336, 128256, max_pos=8192, theta=500000.0),
    _llama("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256, max_pos=131072, theta=500000.0),
    _llama("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256, max_pos=131072, theta=500000.0),
    _llama("llama-3.2-1b", 16, 2048, 32, 8, 8192, 128256, tied=True, max_pos=131072,
           theta=500000.0),
    _llama("llama-3.2-3b", 28, 3072, 24, 8, 8192, 128256, tied=True, max_pos=131072,
           theta=500000.0),
    _llama("mistral-7b", 32, 4096, 32, 8, 14336, 32000, hf="mistral", max_pos=32768,
           theta=10000.0, sliding_window=4096),
    _llama("qwen2.5-0.5b", 24, 896, 14, 2, 4864, 151936, tied=True, qkv_bias=True, hf="qwen2",
           max_pos=32768, theta=1000000.0, eps=1e-6),
    _llama("qwen2.5-1.5b", 28, 1536, 12, 2, 8960, 151936, tied=True, qkv_bias=True, hf="qwen2",
           max_pos=32768, theta=1000000.0, eps=1e-6),
    _llama("qwen2.5-3b", 36, 2048, 16, 2, 11008, 151936, tied=True, qkv_bias=True, hf="qwen2",
           max_pos=32768, theta=1000000.0, eps=1e-6),
    _llama("qwen2.5-7b", 28, 3584, 28, 4, 18944, 152064, tied=False, qkv_bias=True, hf="qwen2",
           max_pos=32768, theta=1000000.0, eps=1e-6),
    _llama("qwen2.5-14b", 48, 5120, 40, 8, 13824, 152064, tied=False, qkv_bias=True, hf="qwen2",
           max_pos=32768, theta=1000000.0, eps=1e-5),
    # Qwen3 dense (Qwen/Qwen3-*'s config.json): 128-wide heads whatever hidden / heads is,
    # per-head q/k RMSNorm, no q/k/v bias; the small three tie their embeddings
    *(_llama(f"qwen3-{size}", layers, hidden, heads, 8, ffn, 151936, tied=tied, hf="qwen3",
             head_dim=128, max_pos=40960, theta=1000000.0, eps=1e-6)
      for size, layers, hidden, heads, ffn, tied in (
          ("0.6b", 28, 1024, 16, 3072, True), ("1.7b", 28, 2048, 16, 6144, True),
          ("4b", 36, 2560, 32, 9728, True), ("8b", 36, 4096, 32, 12288, False),
          ("14b", 40, 5120, 40, 17408, False), ("32b", 64, 5120, 64, 25600, False))),
    # Gemma (google/gemma-*'s config.json): 256-wide heads, tied 256K vocabulary, tanh-GELU
    # gated MLP; 2B has one KV head
    _llama("gemma-2b", 18, 2048, 8, 1, 16384, 256000, tied=True, hf="gemma", head_dim=256,
           max_pos=8192, theta=10000.0, eps=1e-6),
    _llama("gemma-7b", 28, 3072, 16, 16, 24576, 256000, tied=True, hf="gemma", head_dim=256,
           max_pos=8192, theta=10000.0, eps=1e-6),
    # Gemma 2 (google/gemma-2-*): Gemma 3's four norms a block, every other layer a 4,096-token
    # window, attention scores soft-capped at 50 and logits at 30; 27B scales its scores by 144
    *(_llama(f"gemma-2-{size}", layers, hidden, heads, kv, ffn, 256000, tied=True, hf="gemma2",
             head_dim=hd, max_pos=8192, theta=10000.0, eps=1e-6, sliding_window=4096,
             query_pre_attn_scalar=qs, attn_softcap=50.0, logit_softcap=30.0)
      for size, layers, hidden, heads, kv, ffn, hd, qs in (
          ("2b", 26, 2304, 8, 4, 9216, 256, 256), ("9b", 42, 3584, 16, 8, 14336, 256, 256),
          ("27b", 46, 4608, 32, 16, 36864, 128, 144))),
    # Phi-3 (microsoft/Phi-3-mini-4k-instruct, Phi-3-medium-4k-instruct, Phi-3.5-mini-instruct,
    # phi-4): fused qkv and gate/up projections, untied 32K (phi-4: 100K) vocabulary; the 4K
    # models attend within a 2,047-token window, Phi-3.5's 262,144 is never reached
    _llama("phi-3-mini", 32, 3072, 32, 32, 8192, 32064, hf="phi3", max_pos=4096, theta=10000.0,
           sliding_window=2047),
    _llama("phi-3-medium", 40, 5120, 40, 10, 17920, 32064, hf="phi3", max_pos=4096, theta=10000.0,
           sliding_window=2047),
    _llama("phi-3.5-mini", 32, 3072, 32, 32, 8192, 32064, hf="phi3", max_pos=131072, theta=10000.0,
           sliding_window=262144),
    _llama("phi-4", 40, 5120, 40, 10, 17920, 100352, hf="phi3", max_pos=16384, theta=250000.0),
    # Phi-4-mini (microsoft/Phi-4-mini-instruct): 200K tied vocabulary, 8 KV heads, rotary on
    # three quarters of each head
    _llama("phi-4-mini", 32, 3072, 24, 8, 8192, 200064, tied=True, hf="phi3", max_pos=131072,
           theta=10000.0, sliding_window=262144, rotary_fraction=0.75),
    # Gemma 3 text (google/gemma-3-270m, -1b): four norms a block, per-head q/k norms, five
    # 512-token sliding-window layers to one global
    *(_llama(f"gemma-3-{size}", layers, hidden, 4, 1, ffn, 262144, tied=True, hf="gemma3_text",
             head_dim=256, max_pos=32768, theta=1000000.0, eps=1e-6, sliding_window=512, window_pattern=6)
      for size, layers, hidden, ffn in (("270m", 18, 640, 2048), ("1b", 26, 1152, 6912))),
]}

_DIM_KEYS = ("arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tied_embeddings")


def _input_error(err: ValidationError, prefix: str = "") -> FrenzyInputError:
    """The FrenzyInputError a validator raised (pydantic wraps it), or one built from the
    first pydantic error."""
    e = err.errors()[0]
    orig = (e.get("ctx") or {}).get("error")
    if isinstance(orig, FrenzyInputError):
        return FrenzyInputError(prefix + orig.field, orig.rule)
    loc = ".".join(map(str, e["loc"]))
    return FrenzyInputError(prefix + loc if loc else (prefix.rstrip(".") or "model"), e["msg"])


# the dimensions each supported config.json must give (the others have defaults)
_HF_REQUIRED = {"gpt2": ("n_layer", "n_embd", "n_head", "vocab_size"),
                "opt": ("num_hidden_layers", "hidden_size", "num_attention_heads", "ffn_dim", "vocab_size"),
                **{t: ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size")
                   for t in ("bert", *HF_TYPES["llama"])}}


# transformers' default KV heads when a config.json leaves the key out (LlamaConfig: all heads),
# and head width (the others derive it from hidden / heads)
_HF_KV_DEFAULT = {"qwen2": 32, "qwen3": 32, "mistral": 8, "gemma": 16, "gemma2": 4, "gemma3_text": 4}
_HF_HEAD_DIM_DEFAULT = {"qwen3": 128, "gemma": 256, "gemma2": 256, "gemma3_text": 256}
_HF_MAX_POS_DEFAULT = {"qwen3": 32768, "gemma": 8192, "gemma2": 8192, "gemma3_text": 131072}


def _gemma_pattern(cfg: dict[str, Any]) -> int | None:
    """A Gemma 2 / 3 config's global-layer period: from ``layer_types`` (transformers 5 writes
    them; refused unless every p-th layer is the global one, the layout the type builds: Gemma
    2 every other one), else Gemma 3's ``sliding_window_pattern`` (default 6), Gemma 2's 2."""
    t = cfg.get("model_type")
    types = cfg.get("layer_types")
    if types is None:
        p = cfg.get("sliding_window_pattern", 6) if t == "gemma3_text" else LAYOUT_TYPES[t]
        if type(p) is not int or p < 1:
            raise FrenzyInputError("sliding_window_pattern", f"must be a positive integer, got {p!r}")
        return p
    if not isinstance(types, list) or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise FrenzyInputError("layer_types", "must be a list of full_attention / sliding_attention")
    if len(types) != cfg.get("num_hidden_layers"):
        raise FrenzyInputError("layer_types", f"must name num_hidden_layers ({cfg.get('num_hidden_layers')}) "
                                              f"layers, got {len(types)}")
    for p in range(1, len(types) + 2) if t == "gemma3_text" else (LAYOUT_TYPES[t],):
        if tuple(types) == gemma_layer_types(len(types), p):
            return p
    raise FrenzyInputError("layer_types", "must make every n-th layer global and the others sliding "
                                          f"(the layouts {t} builds)")


def _phi3_rotary_fraction(cfg: dict[str, Any]) -> float | None:
    """A phi3 config.json's partial_rotary_factor (transformers 5's rope_parameters first, as
    Phi3Config reads it), None for a whole rotary."""
    rope = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is None or (type(partial) in (int, float) and partial == 1):
        return None
    if type(partial) not in (int, float) or not 0 < partial <= 1:
        raise FrenzyInputError("partial_rotary_factor", f"must be a number in (0, 1], got {partial!r}")
    return float(partial)


def _check_phi3(cfg: dict[str, Any]) -> None:
    """What a phi3 config.json may say that the memory model does not describe, refused in one
    line: dropout (its masks)."""
    for key in ("resid_pdrop", "embd_pdrop"):
        if cfg.get(key) not in (None, 0, 0.0):
            raise FrenzyInputError(key, f"must be 0 for phi3 (dropout is not modelled for it; got {cfg.get(key)!r})")


def _from_hf_dict(cfg: dict[str, Any], name: str) -> ModelSpec:
    """Map a Hugging Face config.json to a ModelSpec."""
    t = cfg.get("model_type")
    g = cfg.get
    missing = [k for k in _HF_REQUIRED.get(t, ()) if cfg.get(k) is None]
    if missing:
        raise FrenzyInputError("model", f"config.json (model_type {t!r}) is missing {', '.join(missing)}")
    try:
        if t == "gpt2":
            return ModelSpec(name=name, arch="gpt", layers=g("n_layer"), hidden=g("n_embd"),
                             heads=g("n_head"), ffn=g("n_inner"), vocab=g("vocab_size"),
                             max_positions=g("n_positions", 1024),
                             tied_embeddings=g("tie_word_embeddings", True),
                             dropout=g("resid_pdrop", 0.1), attn_dropout=g("attn_pdrop", 0.1))
        if t == "opt":
            return ModelSpec(name=name, arch="opt", layers=g("num_hidden_layers"),
                             hidden=g("hidden_size"), heads=g("num_attention_heads"),
                             ffn=g("ffn_dim"), vocab=g("vocab_size"),
                             max_positions=g("max_position_embeddings", 2048),
                             embed_dim=(g("word_embed_proj_dim") if g("word_embed_proj_dim")
                                        not in (None, g("hidden_size")) else None),
                             pre_norm=g("do_layer_norm_before", True),
                             tied_embeddings=g("tie_word_embeddings", True),
                             dropout=g("dropout", 0.1), attn_dropout=g("attention_dropout", 0.0))
        if t == "bert":
            return ModelSpec(name=name, arch="bert", layers=g("num_hidden_layers"),
                             hidden=g("hidden_size"), heads=g("num_attention_heads"),
                             ffn=g("intermediate_size"), vocab=g("vocab_size"),
                             max_positions=g("max_position_embeddings", 512),
                             type_vocab=g("type_vocab_size", 2),
                             dropout=g("hidden_dropout_prob", 0.1),
                             attn_dropout=g("attention_probs_dropout_prob", 0.1))
        if t in HF_TYPES["llama"]:
            default_bias = t == "qwen2"
            # Qwen3Config sizes heads at 128 whatever hidden / heads is (and refuses null); the
            # others derive it
            if t in _HF_HEAD_DIM_DEFAULT and "head_dim" in cfg and cfg["head_dim"] is None:
                raise FrenzyInputError("head_dim", f"must be an integer in a {t} config.json "
                                                   f"(its config class refuses null)")
            for key in ("final_logit_softcapping", "attn_logit_softcapping"):
                if t == "gemma3_text" and cfg.get(key) is not None:
                    raise FrenzyInputError(key, f"must be null: soft caps are modelled for gemma2, not {t} "
                                                f"(its SDPA path would skip the score cap)")
            if t in GEMMA_TYPES and cfg.get("use_bidirectional_attention"):
                raise FrenzyInputError("use_bidirectional_attention", "must be false: Frenzy trains causal LMs")
            if t == "phi3":
                _check_phi3(cfg)
            hd = g("head_dim", _HF_HEAD_DIM_DEFAULT.get(t))
            pattern = _gemma_pattern(cfg) if t in LAYOUT_TYPES else None
            h_, a_ = g("hidden_size"), g("num_attention_heads")
            derived = h_ // a_ if type(h_) is int and type(a_) is int and a_ > 0 else None
            rope = g("rope_parameters") if isinstance(g("rope_parameters"), dict) else {}
            # Gemma 3 in transformers 5: a rotary base per layer type
            local_rope = rope.get("sliding_attention") if isinstance(rope.get("sliding_attention"), dict) else {}
            if isinstance(rope.get("full_attention"), dict):
                rope = rope["full_attention"]
            return ModelSpec(name=name, arch="llama", layers=g("num_hidden_layers"),
                             hidden=h_, heads=a_,
                             # each config's own default when the key is absent (null: all heads)
                             kv_heads=(g("num_key_value_heads", _HF_KV_DEFAULT.get(t)) or a_),
                             ffn=g("intermediate_size"), vocab=g("vocab_size"),
                             tied_embeddings=g("tie_word_embeddings", t in GEMMA_TYPES),
                             # Mistral and Phi-3 build no attention biases, whatever the key says
                             qkv_bias=False if t in ("mistral", "phi3") else g("attention_bias", default_bias),
                             head_dim=hd if hd not in (None, derived) else None,
                             max_positions=g("max_position_embeddings", _HF_MAX_POS_DEFAULT.get(t, 4096)),
                             hf_model_type=t,
                             # transformers 5 writes rope_parameters: {rope_theta, rope_type}
                             rope_theta=g("rope_theta") or rope.get("rope_theta"), norm_eps=g("rms_norm_eps"),
                             attn_dropout=g("attention_dropout", 0.0) or 0.0,
                             # Mistral's and Gemma's default window when the key is absent
                             # (null: none, for Mistral); Phi3Config's is none
                             sliding_window=(g("sliding_window", None if t == "phi3" else 4096)
                                             if t in WINDOW_TYPES else None),
                             # Gemma 2's layout is fixed (checked, not kept)
                             window_pattern=pattern if t == "gemma3_text" else None,
                             query_pre_attn_scalar=g("query_pre_attn_scalar") if t in LAYOUT_TYPES else None,
                             attn_softcap=g("attn_logit_softcapping", 50.0) if t == "gemma2" else None,
                             logit_softcap=g("final_logit_softcapping", 30.0) if t == "gemma2" else None,
                             rope_local_theta=((g("rope_local_base_freq") or local_rope.get("rope_theta"))
                                               if t == "gemma3_text" else None),
                             rotary_fraction=_phi3_rotary_fraction(cfg) if t == "phi3" else None)
    except ValidationError as err:
        raise _input_error(err, "model.") from None
    except TypeError as err:
        raise FrenzyInputError("model", f"config.json is missing a dimension ({err})") from None
    raise FrenzyInputError("model", f"config.json model_type {t!r} is not supported "
                                    f"({', '.join(t for types in HF_TYPES.values() for t in types)})")


# A Hugging Face Hub model id: "name" or "org/name" (letters, digits, "-", "_", ".").
HUB_ID = re.compile(r"^(?:[A-Za-z0-9][A-Za-z0-9._-]*/)?[A-Za-z0-9][A-Za-z0-9._-]*$")


def cached_hub_snapshot(repo_id: str, field: str = "model") -> str:
    """The local snapshot folder of Hub model ``repo_id`` in the Hugging Face cache
    (``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``). Never downloads:
    a model that is not cached raises FrenzyInputError naming the cache entry it looked for.
    A partial snapshot counts (the files a download was limited to, e.g. `hf download --include`
    or ``frenzy_flows.hub``, which skips a repo's other weight formats): its config.json decides."""
    try:
        from huggingface_hub import constants, try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on huggingface_hub
        raise FrenzyInputError(field, f"{repo_id!r} looks like a Hub id, which needs huggingface_hub") from None
    entry = os.path.join(constants.HF_HUB_CACHE, "models--" + repo_id.replace("/", "--"))
    try:
        config = try_to_load_from_cache(repo_id, "config.json")
    except (OSError, ValueError):        # an id the hub's own rules refuse
        config = None
    folder = os.path.dirname(config) if isinstance(config, str) else None
    if folder is None and os.path.isdir(os.path.join(entry, "snapshots")):
        raise FrenzyInputError(field, f"the cached {repo_id!r} ({entry}) holds no config.json at revision main "
                                      f"(a download limited to other files?); fetch its config")
    if folder is None:
        raise FrenzyInputError(field, f"{repo_id!r} is neither a preset, a local folder nor a Hub id in the "
                                      f"local Hugging Face cache (no {entry}; nothing downloads unless asked: "
                                      f"`frenzy run --fetch`, fetch_models in the FrenzySettings block, or "
                                      f"`hf download {repo_id}`)")
    return folder


def resolve_model(model: "str | dict[str, Any] | ModelSpec | os.PathLike") -> ModelSpec:
    """A preset name, a path to a Hugging Face config.json (or its model folder), a Hub id
    cached locally, a dict of dimensions, or a ModelSpec -> ModelSpec. Bad input raises
    FrenzyInputError."""
    if type(model) is str and model in PRESETS:       # the common case, first
        return PRESETS[model]
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        d = dict(model)
        if "model_type" in d:
            return _from_hf_dict(d, str(d.get("name", d["model_type"])))
        missing = [k for k in ("layers", "hidden", "heads", "vocab") if d.get(k) is None]
        if missing:
            raise FrenzyInputError(missing[0], "required when the model is given by dimensions")
        try:
            return ModelSpec(**d)
        except ValidationError as err:
            raise _input_error(err) from None
    if isinstance(model, (str, os.PathLike)):
        key = str(model)
        if key in PRESETS:
            return PRESETS[key]
        if key.lower() in PRESETS:
            return PRESETS[key.lower()]
        path = key
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
            if not os.path.isfile(path):     # a folder, just not a model's: say so, not "not found"
                raise FrenzyInputError("model", f"the folder {key} has no config.json (a Hugging Face model "
                                                f"folder holds one)")
        if os.path.isfile(path):
            try:
                with open(path, encoding="utf-8") as fh:
                    cfg = json.load(fh)
            except (OSError, ValueError) as err:         # ValueError: bad JSON, or not UTF-8 text
                raise FrenzyInputError("model", f"cannot read {path}: {err}") from None
            if not isinstance(cfg, dict):
                raise FrenzyInputError("model", f"{path} is not a JSON object")
            name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "config"
            return _from_hf_dict(cfg, name)
        if HUB_ID.match(key) and not key.endswith(".json") and not key.startswith((".", "~")):
            try:
                folder = cached_hub_snapshot(key)   # raises, naming the cache entry, when absent
            except FrenzyInputError as err:
                if "/" in key:
                    raise
                raise FrenzyInputError("model", f"unknown preset {key!r} (see `frenzy models`); as a Hub id: "
                                                f"{err.rule}") from None
            return resolve_model(folder)
        if key.endswith(".json") or os.sep in key:
            raise FrenzyInputError("model", f"config file not found: {key}")
        raise FrenzyInputError("model", f"unknown preset {key!r} (see `frenzy models`)")
    raise FrenzyInputError("model", f"expected a preset name, config path or dimensions, got {type(model).__name__}")


def model_from_kwargs(model: Any = None, **dims: Any) -> ModelSpec:
    """``model=`` or the dimension keywords (``arch``, ``layers``, ...) of the estimate contract."""
    given = {k: v for k, v in dims.items() if v is not None and k in _DIM_KEYS}
    if model is not None:
        spec = resolve_model(model)
        if given:   # explicit dimensions override the preset's
            base = spec.model_dump(exclude_none=True)
            if given.get("arch", spec.arch) != spec.arch:
                # another arch builds its own model type, without the type's own switches
                for key in ("hf_model_type", *TYPE_FIELDS):
                    base.pop(key, None)
                if given["arch"] in NO_GQA_ARCHS:       # nor the preset's KV-head count
                    base.pop("kv_heads", None)
            try:
                spec = ModelSpec(**{**base, **given})
            except ValidationError as err:
                raise _input_error(err) from None
        return spec
    if not given:
        raise FrenzyInputError("model", "give a preset name, a config.json path, or the dimensions "
                                        "(arch, layers, hidden, heads, vocab)")
    return resolve_model(given)


@lru_cache(maxsize=1024)
def _sized(spec: ModelSpec, seq_len: int) -> ModelSpec:
    return ModelSpec(**{**spec.model_dump(exclude_none=True), "max_positions": seq_len})


def seq_len_rule(spec: ModelSpec, seq_len: int) -> str | None:
    """Why ``spec`` cannot take sequences of ``seq_len`` tokens (a learned position table
    shorter than them), in one line, or None."""
    if spec.arch in ("gpt", "opt", "bert") and spec.max_positions is not None and seq_len > spec.max_positions:
        return f"exceeds the learned position table of {spec.name} ({seq_len} > {spec.max_positions})"
    return None


def with_positions(spec: ModelSpec, seq_len: int) -> ModelSpec:
    """Positions are not capped unless the model says so: a model given by its dimensions
    without ``max_positions`` gets a learned table (gpt, opt, bert) of ``seq_len`` rows;
    rotary models (llama) have no table to size."""
    if spec.max_positions is not None or spec.arch == "llama":
        return spec
    return _sized(spec, seq_len)
