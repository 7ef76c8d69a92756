"""The estimator on published measurements of other people's runs (the public data set).

Each row of the CSV (35 measured runs from 10 sources, every value traced in SOURCES.md) is
turned into `estimator.estimate()` keywords: the CSV's columns, the implementation profile its
`framework` column maps to, and the run's documented settings that have no CSV column (pure
bf16, LoRA, loss kernel, ...; taken from the row's `notes`, cited below). The prediction of the
metric the source measured (allocated / reserved / device used) is compared with the figure.

    python bench/estimator_public.py [--csv PATH] [--json] [--columns-only]

``--columns-only`` scores the CSV's columns alone (no profile, no documented settings): the
estimator as the issue found it. With ``--json`` the last line is
``{"rows", "expressible", "median_abs_err", "p90_abs_err", "worst_under"}`` (errors as fractions).

Other CSVs in the schema score the same way. The settings read by hand from each shipped row's
source (``RUN_SETTINGS``, ``CAVEATS``) apply to a row only when its number and model are that
shipped row's. Any other row's settings without a column are read from its ``framework`` and
``notes`` by ``settings_from_text`` (pure bf16, fused or 8-bit paged AdamW, torch.compile,
chunked or Liger fused-linear cross-entropy, optimizer in backward, activation offloading, LoRA
rank and targets, DeepSpeed's overlap_comm, a model without an LM head; a negated mention, "no
compile", "optimizer_in_bwd=False", is not read as on), and the row's output says what was read.
``--notes-only`` scores the shipped rows that way too: how far those readings carry to runs no
one read by hand. Values are read as other sources spell them: header names in any case,
precisions 'bf16-true' (pure bf16), 'bf16-mixed', '16-mixed', 'amp'; optimizers
'adamw_torch_fused', 'paged_adamw_8bit', 'adamw_bnb_8bit'; act_ckpt true / false; attention
'sdpa', 'fa2'; metric 'nvidia-smi', 'max_memory_reserved'; offload 'cpu'; zero 'ZeRO-3'; arch
as a Hugging Face model type (mistral, qwen2, gemma, phi3 -> llama's builder of that type; vit,
roberta -> bert); a blank cell is the plain setting. A file that is not a CSV of the schema
(missing columns, undecodable) is one line and exit 2; a row that cannot be read or expressed
is listed as not expressible with its reason.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from bench.public_csv import ACT_CKPT, ATTENTION, TRUE_FALSE, CsvProblem, integer, named, read_rows  # noqa: E402
from estimator import estimate  # noqa: E402
from estimator.errors import FrenzyInputError  # noqa: E402
from estimator.profiles import get_profile, profile_for_label  # noqa: E402

DEFAULT_CSV = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                           "estimator-public", "published.csv")
if not os.path.exists(DEFAULT_CSV):   # a worktree one level deeper than the main checkout
    DEFAULT_CSV = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data",
                               "estimator-public", "published.csv")

METRIC = {"allocated": "allocated_peak_gib", "active": "allocated_peak_gib",
          "reserved": "reserved_peak_gib", "device_used": "device_used_gib"}

# GPU column -> catalog type (only needed for reserved / device-used rows and the fit flag).
GPUS = [(r"H200", "H200-141GB"), (r"H100", "H100-80GB"), (r"A100 40GB", "A100-40GB"),
        (r"A100|A800", "A100-80GB"), (r"L40S", "L40S-48GB"), (r"RTX 4090", "RTX4090-24GB"),
        (r"A10G", "A10G-24GB"), (r"V100", "V100-32GB")]

# Settings of each run that the CSV has no column for, as its notes document them.
_TT = dict(master_weights="none")            # torchtune: pure bf16 (notes rows 1-10)
# nn.Transformer: 32 decoder layers; the tables were measured with PyTorch 2.1, whose foreach
# Adam builds its denominator out of place (estimator.memory: foreach-legacy)
_LIGHT = dict(model_extra={"cross_attn_layers": 32}, adamw_impl="foreach-legacy")
RUN_SETTINGS: dict[int, dict] = {
    # torchtune 3B, cumulative rows: compile (2+, fused kernels), chunked CE (3+), AC (4+, column),
    # optimizer in backward (5+), activation offloading (6+), 8-bit AdamW (7; config default
    # bitsandbytes PagedAdamW8bit)
    1: dict(_TT),
    2: dict(_TT, fused_kernels=True),
    3: dict(_TT, fused_kernels=True, loss="chunked"),
    4: dict(_TT, fused_kernels=True, loss="chunked"),
    5: dict(_TT, fused_kernels=True, loss="chunked", optimizer_in_backward=True),
    6: dict(_TT, fused_kernels=True, loss="chunked", optimizer_in_backward=True, act_offload=True),
    # row 7's 17.6 GiB exceeds the ~10 GiB paged states would leave on the allocator, so its
    # 8-bit states are counted: a non-paged 8-bit AdamW, modelled as bitsandbytes' AdamW8bit (the
    # library the recipe's docstring names; one fused in-place kernel per tensor, no temporaries)
    7: dict(_TT, fused_kernels=True, loss="chunked", optimizer_in_backward=True, act_offload=True,
            optimizer="adamw8bit"),
    # 8B full on a 4090: PagedAdamW8bit, optimizer in backward, AC, chunked CE, compile
    8: dict(_TT, fused_kernels=True, loss="chunked", optimizer_in_backward=True,
            optimizer="adamw8bit-paged"),
    # 70B: FSDP2 + CPU offload, fused AdamW, AC, chunked CE, compile
    9: dict(_TT, fused_kernels=True, loss="chunked", adamw_impl="fused"),
    # 8B LoRA r8 on q,v; fused AdamW; AC; chunked CE; compile
    10: dict(_TT, fused_kernels=True, loss="chunked", adamw_impl="fused",
             finetune="lora", lora_rank=8, lora_targets=("q_proj", "v_proj")),
    # PEFT suite: model loaded in bf16, use_amp False -> pure bf16; torch AdamW (foreach)
    11: dict(master_weights="none"),
    12: dict(master_weights="none", finetune="lora", lora_rank=32,
             lora_targets=("q_proj", "v_proj")),
    # torchao ViT-H: fused AdamW, BF16 AMP over fp32 params, compile
    13: dict(adamw_impl="fused", fused_kernels=True),
    14: dict(fused_kernels=True),
    # ViT-g: pure bf16, fused AdamW; DeepSpeed Adam with bf16 states; torchao CPU offload
    15: dict(master_weights="none", adamw_impl="fused", model_extra={"gated_mlp": True}),
    # (row 16: deepspeed.initialize with overlap_comm on, so two ZeRO-2 reduce buffers)
    16: dict(master_weights="none", model_extra={"gated_mlp": True}, overlap_comm=True),
    17: dict(master_weights="none", adamw_impl="fused", model_extra={"gated_mlp": True}),
    # DeepSpeed-Chat: FusedAdam; the reward model has no LM head; the April 2023 logs ran
    # transformers 4.2x, whose OPTAttention clamps the masked scores (torch.max) and so saves them
    18: dict(adamw_impl="fused", score_clamp=True),
    19: dict(adamw_impl="fused", loss="none", score_clamp=True),
    # bf16_master_weight example: baseline / pure bf16; its ds config sets reduce_bucket_size 5e7
    20: dict(zero_bucket_elems=5e7),
    21: dict(master_weights="none", zero_bucket_elems=5e7),
    # HF + DeepSpeed + Liger fused linear cross-entropy (rows 22-24, 26)
    # Liger: fused linear cross-entropy (its fused RMSNorm / SwiGLU kernels are not credited:
    # rows 25 -> 26 show far less activation saving than the compile inventory would give)
    22: dict(loss="fused-linear"),
    23: dict(loss="fused-linear"),
    24: dict(loss="fused-linear"),
    25: dict(),
    26: dict(loss="fused-linear"),
    # Colossal-AI's example runs transformers of 2023, whose LlamaForCausalLM upcasts the
    # logits in forward and returns them in fp32
    27: dict(loss="fp32-logits"),
    # llm.c: fused AdamW, compile; ZeRO-1 is torch's ZeroRedundancyOptimizer under DDP
    28: dict(adamw_impl="fused", fused_kernels=True),
    29: dict(adamw_impl="fused", fused_kernels=True),
    # LitGPT bf16-true: pure bf16, torch AdamW foreach
    30: dict(master_weights="none"),
    # DDP (its buckets copy the gradients); FSDP NO_SHARD all-reduces the flat gradient in place
    31: dict(_LIGHT), 32: dict(_LIGHT, gradient_as_bucket_view=True), 33: dict(_LIGHT),
    34: dict(_LIGHT), 35: dict(_LIGHT),
}

# The shipped rows the two tables above and below were read from: a row of another CSV gets
# them only when its number and model say it is that run (other rows: ``settings_from_text``)
_LLAMA_3B, _LLAMA_8B = "meta-llama/Llama-3.2-3B(-Instruct)", "meta-llama/Llama-3.1-8B(-Instruct)"
_VIT_G = "timm/vit_giant_patch14_dinov2.lvd142m (ViT-g/14, 1.1B)"
_DS_SIMPLE = "DeepSpeedExamples SimpleTransformerModel 6.86B (hidden 4096, 32 layers)"
_GPT2_XL = "GPT-2 XL (1558M, llm.c train_gpt2.py GPT class)"
_NN_TRANSFORMER = "lightning.pytorch.demos.Transformer (nn.Transformer, 1.01B)"
SHIPPED_MODELS: dict[int, str] = {
    **dict.fromkeys(range(1, 8), _LLAMA_3B), 8: _LLAMA_8B, 9: "meta-llama/Llama-3.1-70B-Instruct", 10: _LLAMA_8B,
    11: "meta-llama/Llama-3.2-3B", 12: "meta-llama/Llama-3.2-3B",
    13: "timm/vit_huge_patch14_224.orig_in21k (ViT-H/14, 632M)",
    14: "timm/vit_huge_patch14_224.orig_in21k (ViT-H/14, 632M)", 15: _VIT_G, 16: _VIT_G, 17: _VIT_G,
    18: "facebook/opt-1.3b", 19: "facebook/opt-350m (reward model: OPTModel + v_head)", 20: _DS_SIMPLE,
    21: _DS_SIMPLE, **dict.fromkeys(range(22, 27), "meta-llama/Llama-3.1-8B"),
    27: "LLaMA-2-7B (LlamaConfig defaults, random init)", 28: _GPT2_XL, 29: _GPT2_XL,
    30: "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T", **dict.fromkeys(range(31, 36), _NN_TRANSFORMER),
}

# Rows whose metric or configuration the source leaves unclear (kept in the output).
CAVEATS = {
    7: "8-bit AdamW implementation not stated: the config default PagedAdamW8bit would keep its "
       "states outside the allocator (about 10 GiB, below the measured 17.6), so bitsandbytes' "
       "AdamW8bit (counted states, no step temporaries) is modelled; torchao's AdamW8bit steps "
       "each tensor through a compiled fp32 update whose temporaries (the 394M-element tied "
       "embedding: 1.47 GiB per fp32 copy) only a GPU run shows",
    8: "metric not named ('Peak Memory per GPU'); paged 8-bit states outside the allocator",
    9: "metric not named ('Peak Memory per GPU')",
    10: "metric not named ('Peak Memory per GPU'); below the stated run's floor (bf16 base "
        "14.96 + checkpointed block inputs 1.0 + bf16 logits 1.0 GiB)",
    11: "768 is the maximum (padded) length; the peak includes eval generation",
    12: "768 is the maximum (padded) length; the peak includes eval generation",
    15: "224 px crops assumed (img_size override not stated)",
    16: "224 px crops assumed; DeepSpeed 'untuned'",
    17: "224 px crops assumed",
    19: "reward model: chosen + rejected = 8 sequences per forward",
    # rows 22-24: one source, one config at 8K / 32K / 128K tokens; reserved only
    22: "reserved only (no allocated figure): the source's own fit puts 12.6 GiB at zero "
        "tokens, above the modelled ZeRO-3 + offload states and buffers (5.3 GiB allocated); "
        "the gap is not attributed (the whole bf16 model's high-water at init, about 15.2 GiB "
        "reserved, would count only if the model was loaded outside zero.Init and the peak "
        "was not reset after init; the source states neither)",
    24: "128K is well beyond the data set's 512-8192 target range (SOURCES.md); the measured "
        "reserved is below the modelled allocated: Liger's fused RMSNorm/SwiGLU (not credited, "
        "see docs/benchmarks.md) match its per-token slope",
    28: "measurement method not stated (nvidia-smi likely); GB vs GiB ambiguous (2.4%)",
    29: "measurement method not stated (nvidia-smi likely); GB vs GiB ambiguous (2.4%)",
    30: "512 is the maximum (padded) length; the peak includes validation",
    31: "encoder-decoder nn.Transformer", 32: "encoder-decoder nn.Transformer",
    33: "encoder-decoder nn.Transformer", 34: "encoder-decoder nn.Transformer",
    35: "encoder-decoder nn.Transformer",
}


def _map(value: str, table: list[tuple[str, str]]) -> str | None:
    for pat, out in table:
        if re.search(pat, value, re.IGNORECASE):
            return out
    return None


# the estimator's archs, and the Hugging Face model types its llama builder makes
ARCHS = {"gpt": ("gpt", None), "gpt2": ("gpt", None), "llama": ("llama", None), "bert": ("bert", None),
         "roberta": ("bert", None), "vit": ("bert", None), "opt": ("opt", None),
         **{t: ("llama", t) for t in ("mistral", "qwen2", "qwen3", "gemma", "gemma2", "phi3")},
         "qwen2.5": ("llama", "qwen2"), "gemma3": ("llama", "gemma3_text"),
         "gemma3_text": ("llama", "gemma3_text"), "phi-3": ("llama", "phi3"), "phi4": ("llama", "phi3")}
_LLAMA_TYPES = tuple(k for k, (arch, _) in ARCHS.items() if arch == "llama")
# precision column -> (precision, master weights): Lightning's 'bf16-true' is pure bf16
PRECISIONS = {"bf16": ("bf16", None), "bfloat16": ("bf16", None), "bf16-mixed": ("bf16", None),
              "amp_bf16": ("bf16", None), "bf16-true": ("bf16", "none"), "pure bf16": ("bf16", "none"),
              "fp16": ("fp16", None), "float16": ("fp16", None), "16-mixed": ("fp16", None),
              "fp16-mixed": ("fp16", None), "amp": ("fp16", None), "amp_fp16": ("fp16", None),
              "16-true": ("fp16", "none"), "fp32": ("fp32", None), "float32": ("fp32", None),
              "32": ("fp32", None), "32-true": ("fp32", None), "tf32": ("fp32", None)}
# optimizer column -> (optimizer, AdamW implementation): bitsandbytes' and HF Trainer's names
OPTIMIZERS = {"adamw": ("adamw", None), "adamw_torch": ("adamw", None), "adamw_hf": ("adamw", None),
              "adamw_torch_fused": ("adamw", "fused"), "fused_adamw": ("adamw", "fused"),
              "fusedadam": ("adamw", "fused"), "adam": ("adam", None), "sgd": ("sgd", None),
              "adafactor": ("adafactor", None), "adamw8bit": ("adamw8bit", None),
              "adamw_8bit": ("adamw8bit", None), "adamw_bnb_8bit": ("adamw8bit", None),
              "8bit-adam": ("adamw8bit", None), "adam8bit": ("adamw8bit", None),
              "adamw8bit-paged": ("adamw8bit-paged", None), "paged_adamw_8bit": ("adamw8bit-paged", None),
              "pagedadamw8bit": ("adamw8bit-paged", None)}
OFFLOAD = {"none": "none", "optimizer": "optimizer", "cpu": "optimizer", "optimizer+params": "optimizer+params",
           "params": "optimizer+params", "full": "optimizer+params"}
FINETUNE = {"full": "full", "lora": "lora", "qlora": "qlora"}
METRICS = {**{m: m for m in METRIC}, "device": "device_used", "device-used": "device_used",
           "nvidia-smi": "device_used", "nvml": "device_used", "max_memory_reserved": "reserved",
           "max_memory_allocated": "allocated", "active_bytes": "allocated"}


# (pattern, estimate() keyword, value): a setting as the libraries that run it name it
TEXT_SETTINGS = [
    (r"pure bf16|bf16[- ]true|no fp32 master", "master_weights", "none"),
    (r"no (LM|language[- ]model) head|reward model", "loss", "none"),
    (r"liger|fused[- ]linear[- ]cross", "loss", "fused-linear"),
    (r"CEWithChunkedOutputLoss|chunked[- ](cross[- ]entropy|CE\b|loss)", "loss", "chunked"),
    (r"torch\.compile|compile[ds]?\b(\s*[=:]\s*(true|1)|\s+on\b)|--compile\s+1|\bcompiled\b", "fused_kernels", True),
    (r"optimizer_in_bwd\s*=\s*true|optimizer[ -]in[ -]backward|fuse optimizer step into backward",
     "optimizer_in_backward", True),
    (r"activation[ _]offload(ing)?\b(\s*=\s*true)?|enable_activation_offloading\s*=\s*true", "act_offload", True),
    (r"AdamW\(fused(=True)?\)|\bfused[ =](torch )?AdamW|AdamW[ ,]+fused\b|adamw_torch_fused|\bfused=True", "adamw_impl",
     "fused"),
    (r"PagedAdamW8bit|paged_adamw_8bit", "optimizer", "adamw8bit-paged"),
    (r"overlap_comm", "overlap_comm", True),
]


# a mention turned off: before it ("no compile", "without Liger", "non-fused"), or after it as a
# setting ("optimizer_in_bwd=False", "use_liger_kernel=False", '"overlap_comm": false', "compile 0",
# "compiled: no", "torch.compile disabled")
_NEGATED_BEFORE = re.compile(r"(\b(no|not|without|w/o)\s+|\bnon[- ]?)$")
_NEGATED_AFTER = re.compile(r"""[\w"']*\s*[=:]\s*["']?(false|0|off|no|none|disabled)\b|[\w"']*\s+(false|off|disabled)\b""")


def _said(text: str, pattern: str) -> re.Match | None:
    """The first mention of ``pattern`` in ``text`` that is not negated."""
    for m in re.finditer(pattern, text, re.IGNORECASE):
        before, after = text[max(0, m.start() - 10):m.start()].lower(), text[m.end():m.end() + 24].lower()
        if _NEGATED_BEFORE.search(before) or _NEGATED_AFTER.match(after):
            continue
        return m
    return None


def settings_from_text(row: dict[str, str], finetune: str, profile: str = "hf") -> tuple[dict, list[str]]:
    """`estimate()` keywords for the settings a row documents only in its ``framework`` label and
    ``notes`` (no column holds them), and what was read, for the output. Each reading is the
    setting's usual name in the libraries that run it; ``profile``: the row's (its optimizer
    implementation decides whether a PyTorch version matters)."""
    text = f"{row['framework']} ; {row.get('notes', '')}"
    kw: dict = {}
    for pattern, key, value in TEXT_SETTINGS:
        if key not in kw or key == "loss" and value == "none":    # the first reading wins; no head: no loss
            if _said(text, pattern):
                kw[key] = value
    # numbers and versions the notes give
    model_extra: dict = {}
    if _said(text, r"cross[- ]attention") and (m := re.search(r"\b(\d+)\s+decoder\b", text)):
        model_extra["cross_attn_layers"] = int(m.group(1))          # an encoder-decoder's decoder blocks
    if _said(text, r"SwiGLU|gated (MLP|hidden)") and row["arch"].lower() not in ("llama", *_LLAMA_TYPES):
        model_extra["gated_mlp"] = True                             # a gated MLP outside llama's builder
    if model_extra:
        kw["model_extra"] = model_extra
    if m := re.search(r"reduce_bucket_size\W{0,3}(\d[\d,_]*(?:\.\d+)?(?:e[+-]?\d+)?)", text, re.IGNORECASE):
        kw["zero_bucket_elems"] = float(m.group(1).replace(",", "").replace("_", ""))   # DeepSpeed's, elements
    if _said(text, r"NO_SHARD"):
        kw["gradient_as_bucket_view"] = True                        # FSDP NO_SHARD: no DDP bucket copy
    # PyTorch 2.0 / 2.1's foreach Adam(W) built its denominator out of place (estimator.memory)
    version = re.search(r"\b(?:PyTorch|torch)\s*(?:==|\s)\s*(\d+)\.(\d+)", text, re.IGNORECASE)
    foreach = get_profile(profile).adamw_impl == "foreach"      # torch's own AdamW, not a framework's
    if (version and (int(version.group(1)), int(version.group(2))) in ((2, 0), (2, 1)) and foreach
            and "adamw_impl" not in kw and row["optimizer"].lower() in ("adam", "adamw", "adamw_torch", "")):
        kw["adamw_impl"] = "foreach-legacy"
    if finetune in ("lora", "qlora"):
        # "lora_r=16", "LoRA rank 8", "r=32", "r8"; not a process rank ("rank 0") or "r=0.1"
        m = (re.search(r"lora[ _]?(?:r|rank)\s*[=:]?\s*([1-9]\d*)(?![\w.])", text, re.IGNORECASE)
             or re.search(r"(?<![\w.])r\s*=\s*([1-9]\d*)(?![\w.])", text)
             or re.search(r"(?<![\w.])(?:rank\s+|r)([1-9]\d*)(?![\w.])(?=[^.;]*\blora\b)|\blora\b[^.;]*?"
                          r"(?<![\w.])(?:rank\s+|r)([1-9]\d*)(?![\w.])", text, re.IGNORECASE))
        if m:
            kw["lora_rank"] = int(next(g for g in m.groups() if g))
        targets = [t for t in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                   if re.search(rf"\b{t}\b", text)]
        if targets and not re.search(r"all[- ]linear|all linear layers", text, re.IGNORECASE):
            kw["lora_targets"] = tuple(targets)
    said = [f"{k}={v if not isinstance(v, (tuple, dict)) else _show(v)}" for k, v in kw.items()]
    return kw, said


def _show(v: tuple | dict) -> str:
    return ",".join(v) if isinstance(v, tuple) else ",".join(f"{k}={x}" for k, x in v.items())


def shipped_row(row: dict[str, str]) -> int | None:
    """The shipped row this row is (its number and model), or None."""
    try:
        n = int(row["row"])
    except ValueError:
        return None
    return n if SHIPPED_MODELS.get(n) == row["model"] else None


def row_kwargs(row: dict[str, str], columns_only: bool = False, notes_only: bool = False,
               previous: dict | None = None) -> tuple[dict, list[str]]:
    """`estimate()` keywords of one CSV row (cells stripped, header names lower-case), and the
    settings read from its text (empty for a shipped row, whose settings were read by hand).
    ``previous``: the settings read from the row before, which a row of a cumulative table
    ("as previous + ...", same source) keeps under its own."""
    arch, model_type = ARCHS.get(row["arch"].lower(), (None, None))
    if arch is None:
        raise FrenzyInputError("arch", f"{row['arch']!r} is not one the estimator builds "
                                       f"({', '.join(sorted(ARCHS))})")

    def cell(col: str, blank: int | None = None) -> int:
        return integer(col, row[col], blank)

    heads = cell("heads")
    model = {"arch": arch, "layers": cell("layers"), "hidden": cell("hidden"),
             "heads": heads, "kv_heads": cell("kv_heads", heads), "vocab": cell("vocab")}
    if row["ffn"]:
        model["ffn"] = cell("ffn")
    if row["tied_embeddings"]:
        model["tied_embeddings"] = named("tied_embeddings", row["tied_embeddings"], TRUE_FALSE)
    if model_type:
        model["hf_model_type"] = model_type
    precision, master = named("precision", row["precision"], PRECISIONS)
    optimizer, adamw_impl = named("optimizer", row["optimizer"], OPTIMIZERS, blank=("adamw", None))
    kw: dict = dict(seq_len=cell("seq_len"), micro_batch=cell("micro_batch"),
                    grad_accum=cell("grad_accum", 1), dp=cell("dp", 1), tp=cell("tp", 1),
                    pp=cell("pp", 1), cp=cell("cp", 1),
                    sp=named("sp", row["sp"], TRUE_FALSE, blank=False),
                    vpp=cell("vpp", 1), zero=integer("zero", re.sub(r"^zero[-_ ]*", "", row["zero"], flags=re.I), 0),
                    offload=named("offload", row["offload"], OFFLOAD, blank="none"), precision=precision,
                    optimizer=optimizer, act_ckpt=named("act_ckpt", row["act_ckpt"], ACT_CKPT, blank="none"),
                    attention=named("attention", row["attention"], ATTENTION, blank="flash"))
    gpu = _map(row["gpu"], GPUS)
    if gpu:
        kw["gpu"] = gpu
    said: list[str] = []
    if not columns_only:
        kw["framework"] = profile_for_label(row["framework"])   # estimator.profiles' mapping
        finetune = named("finetune", row["finetune"], FINETUNE, blank="full")
        if finetune != "full":
            kw["finetune"] = finetune
        if master:
            kw["master_weights"] = master
        if adamw_impl:
            kw["adamw_impl"] = adamw_impl
        shipped = None if notes_only else shipped_row(row)
        if shipped is not None:
            extra = dict(RUN_SETTINGS.get(shipped, {}))
        else:
            extra, said = settings_from_text(row, finetune, kw["framework"])
            if previous and re.search(r"\bas (the )?previous\b", row.get("notes", ""), re.IGNORECASE):
                kept = {k: v for k, v in previous.items() if k not in extra
                        and not (finetune == "full" and k.startswith("lora_"))}
                extra = {**kept, **extra}
                said = [f"as the row before: {', '.join(sorted(kept))}"] * bool(kept) + said
            row["_read"] = dict(extra)          # for the next row of a cumulative table (``score``)
        model.update(extra.pop("model_extra", {}))
        kw.update(extra)
    if model["arch"] != "llama" and model["kv_heads"] == model["heads"]:
        model.pop("kv_heads")                 # no grouped-query attention outside llama
    kw["model"] = model
    return kw, said


# what the scorer reads of a row (``notes``, ``source`` and ``rank`` are text it only shows)
COLUMNS = ("row", "model", "arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "tied_embeddings",
           "seq_len", "micro_batch", "grad_accum", "dp", "tp", "pp", "cp", "sp", "vpp", "zero", "offload",
           "precision", "optimizer", "act_ckpt", "attention", "gpu", "metric", "measured_gib", "framework",
           "finetune")


def score(path: str, columns_only: bool = False, notes_only: bool = False) -> tuple[list[dict], dict]:
    out = []
    before: dict | None = None               # the row before: its source and its text's settings
    for row in read_rows(path, COLUMNS):
        shipped = shipped_row(row)
        rec = {"row": row["row"] or "?", "model": row["model"][:38], "metric": row["metric"],
               "measured": float("nan"), "framework": row["framework"][:24],
               "caveat": CAVEATS.get(shipped, "") if shipped is not None else "",
               "predicted": None, "err": None, "profile": "-"}
        out.append(rec)
        try:                                  # the row's cells: a bad one is the row's reason
            try:
                rec["measured"] = measured = float(row["measured_gib"].replace(",", ""))
            except ValueError:
                raise FrenzyInputError("measured_gib", f"{row['measured_gib']!r} is not a number") from None
            if not (measured > 0 and measured < float("inf")):
                raise FrenzyInputError("measured_gib", f"must be a positive number, got {row['measured_gib']!r}")
            metric = named("metric", row["metric"], METRICS)
            previous = before["read"] if before and before["source"] == row.get("source") else None
            kw, said = row_kwargs(row, columns_only, notes_only, previous)
        except FrenzyInputError as exc:
            rec["why"] = str(exc)[:110]
            continue
        finally:
            before = {"source": row.get("source"), "read": row.get("_read")}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                e = estimate(**kw)
        except Exception as exc:   # noqa: BLE001 - a row the estimator cannot express
            rec["why"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:110]
            continue
        pred = getattr(e, METRIC[metric])
        unknown = not columns_only and profile_for_label(row["framework"], default="") == ""
        label = f"framework {row['framework']!r} names no profile: scored as {kw['framework']}" if unknown else ""
        rec.update(predicted=pred, err=pred / measured - 1.0, profile=kw.get("framework", "-"), warnings=list(e.warnings),
                   caveat="; ".join(x for x in (rec["caveat"], label,
                                                "read from its text: " + ", ".join(said) if said else "") if x))
        before = {"source": row.get("source"), "read": row.get("_read")}
    errs = [r["err"] for r in out if r["err"] is not None]
    abs_errs = sorted(abs(x) for x in errs)
    summary = {"rows": len(out), "expressible": len(errs),
               "median_abs_err": round(statistics.median(abs_errs), 4) if errs else None,
               "p90_abs_err": round(abs_errs[min(len(abs_errs) - 1,
                                                 int(round(0.9 * (len(abs_errs) - 1))))], 4)
               if errs else None,
               "worst_under": round(min(0.0, min(errs)), 4) if errs else None}
    return out, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=DEFAULT_CSV, help="the public CSV (default: shared data set)")
    ap.add_argument("--json", action="store_true", help="last line: the summary as JSON")
    ap.add_argument("--columns-only", action="store_true",
                    help="score the CSV columns only (no profile, no documented settings)")
    ap.add_argument("--notes-only", action="store_true",
                    help="every row's settings read from its framework and notes, shipped rows too")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.csv):
        print(f"csv: file not found: {args.csv}", file=sys.stderr)
        return 2
    try:
        rows, summary = score(args.csv, args.columns_only, args.notes_only)
    except CsvProblem as e:
        print(f"csv: {e}", file=sys.stderr)
        return 2
    print(f"{'row':>3} {'model':38} {'profile':10} {'metric':11} {'meas':>7} {'pred':>7} "
          f"{'err':>7}  note")
    for r in rows:
        if r["err"] is None:
            print(f"{r['row']:>3} {r['model']:38} {'-':10} {r['metric']:11} {r['measured']:7.2f} "
                  f"{'-':>7} {'-':>7}  not expressible: {r['why']}")
            continue
        note = "; ".join(x for x in [r["caveat"]] + r["warnings"] if x)
        print(f"{r['row']:>3} {r['model']:38} {r['profile']:10} {r['metric']:11} "
              f"{r['measured']:7.2f} {r['predicted']:7.2f} {r['err'] * 100:+6.1f}%  {note}")
    cmd = ("python bench/estimator_public.py"
           + ("" if os.path.abspath(args.csv) == os.path.abspath(DEFAULT_CSV) else f" --csv {shlex.quote(args.csv)}")
           + (" --columns-only" if args.columns_only else "") + (" --notes-only" if args.notes_only else "")
           + (" --json" if args.json else ""))
    pct = (lambda v: "-" if v is None else f"{v * 100:.1f}%")
    print(f"\n{summary['expressible']}/{summary['rows']} rows expressible; median |error| "
          f"{pct(summary['median_abs_err'])}, p90 {pct(summary['p90_abs_err'])}, "
          f"worst under-prediction {pct(summary['worst_under'])}")
    print(f"command: {cmd}")
    if args.json:
        print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
