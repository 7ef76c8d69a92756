"""The model of the training program: built from a config or loaded from pretrained weights,
wrapped with LoRA / QLoRA adapters (PEFT), counted, and exported in Hugging Face format.

Weights load where the plan puts them. Under ZeRO-3 the program creates its ``Accelerator``
first, which registers DeepSpeed's config with transformers (``zero3_init_flag``), so
``from_pretrained`` builds the model under ``deepspeed.zero.Init`` and every rank keeps only its
partition on the device (each rank reads the checkpoint shard by shard on the host). Other
plans replicate the model, as their memory estimate assumes.

Dtypes: full fine-tunes with fp32 master weights keep fp32 weights (autocast computes in
``precision``); ``master_weights: none`` casts the model to ``precision``; a LoRA base is frozen
in ``precision`` and its adapters are fp32 (or ``precision`` without master weights); QLoRA's
base is NF4 (bitsandbytes) with ``precision`` compute.

Imports torch, transformers and peft lazily; no pydantic, no prefect.
"""
from __future__ import annotations

import importlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

from .problems import InputProblem

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# files of a tokenizer folder that an export carries along, so the export is usable alone
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "tokenizer.model",
                   "special_tokens_map.json", "added_tokens.json", "vocab.txt")
EXPORT_MARKER = "frenzy_export.json"


def holds_other_files(folder: Path) -> bool:
    """Whether ``folder`` holds files that are not an earlier export (no ``EXPORT_MARKER``):
    an export, which replaces its folder, never deletes such a one."""
    return folder.is_dir() and any(folder.iterdir()) and not (folder / EXPORT_MARKER).is_file()


def torch_dtype(precision: str):
    import torch

    return getattr(torch, _DTYPES[precision])


def uses_adapters(spec: dict[str, Any]) -> bool:
    return spec.get("finetune", {}).get("method", "full") in ("lora", "qlora")


def weights_dtype(spec: dict[str, Any]):
    """The dtype the model's (base) weights are held in during training."""
    ft = spec.get("finetune", {}).get("method", "full")
    if ft != "full" or spec.get("master_weights", "fp32") == "none":
        return torch_dtype(spec["plan"]["precision"])
    return torch_dtype("fp32")


def build_model(spec: dict[str, Any], device):
    """The model to train (before adapters): the user's entry point, the pretrained weights of
    ``init_from``, or a fresh model from the Hugging Face config."""
    import torch

    hf = dict(spec["hf_config"])
    attn = "sdpa" if spec["plan"].get("attention", "flash") == "flash" else "eager"
    if spec.get("entry_point"):
        mod_name, _, fn_name = spec["entry_point"].partition(":")
        try:
            fn = getattr(importlib.import_module(mod_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise InputProblem(f"entry_point: cannot import {spec['entry_point']!r} ({e})") from None
        model = fn(hf)
        if not isinstance(model, torch.nn.Module):
            raise InputProblem(f"entry_point: {spec['entry_point']!r} returned {type(model).__name__}, not a torch module")
        return model
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = weights_dtype(spec)
    if spec.get("init_from"):
        kw: dict[str, Any] = {"dtype": dtype, "attn_implementation": attn, "local_files_only": True}
        if spec["finetune"]["method"] == "qlora":
            from transformers import BitsAndBytesConfig

            kw["quantization_config"] = BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                bnb_4bit_compute_dtype=torch_dtype(spec["plan"]["precision"]))
            kw["device_map"] = {"": device}            # each rank holds the whole 4-bit base
        model = AutoModelForCausalLM.from_pretrained(spec["init_from"], **kw)
    else:
        cfg = AutoConfig.for_model(**hf)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn)
        if dtype != torch.float32:
            model = model.to(dtype)
    model.config.use_cache = False
    return model


def peft_targets(targets: list[str] | None, model_type: str | None = None) -> list[str] | str | None:
    """A job's ``target_modules`` as PEFT takes them: its ``all-linear`` shorthand is a string
    (in a list PEFT would look for a module of that name); none given, the estimator's default
    for a model type PEFT has none for (``estimator.memory.LORA_TYPE_TARGETS``: phi3), else
    None (PEFT's own default, which the estimator's per-architecture defaults are)."""
    from estimator.memory import ALL_LINEAR, LORA_TYPE_TARGETS
    if not targets:
        default = LORA_TYPE_TARGETS.get(model_type) if model_type else None
        return list(default) if default else targets
    return ALL_LINEAR if ALL_LINEAR in targets else targets


def add_adapters(model, spec: dict[str, Any], act_ckpt: bool):
    """LoRA / QLoRA adapters (PEFT) on a frozen base; the base model itself for full training."""
    ft = spec.get("finetune", {})
    if ft.get("method", "full") == "full":
        return model
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    if ft["method"] == "qlora":
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=act_ckpt,
                                                gradient_checkpointing_kwargs={"use_reentrant": False})
    cfg = LoraConfig(r=ft["rank"], lora_alpha=ft["alpha"], lora_dropout=ft["dropout"],
                     target_modules=peft_targets(ft.get("target_modules"), getattr(model.config, "model_type", None)),
                     task_type="CAUSAL_LM")
    try:
        # fp32 adapters on a 16-bit base when the job keeps master weights
        return get_peft_model(model, cfg, autocast_adapter_dtype=spec.get("master_weights", "fp32") == "fp32")
    except ValueError as e:
        raise InputProblem(f"finetune.target_modules: {' '.join(str(e).split())[:300]}") from None


def count_params(model) -> tuple[int, int]:
    """(all parameters, trainable parameters), exact under ZeRO-3 partitioning and 4-bit bases."""
    if hasattr(model, "get_nb_trainable_parameters"):           # PEFT counts ds_numel and 4-bit packing
        trainable, total = model.get_nb_trainable_parameters()
        return int(total), int(trainable)
    total = trainable = 0
    for p in model.parameters():
        n = getattr(p, "ds_numel", None) or p.numel()
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def export(accelerator, model, spec: dict[str, Any], out: Path, *, step: int, main: bool) -> Path | None:
    """Write ``model`` to ``out`` in Hugging Face format (every rank calls: under ZeRO-3 the full
    weights are gathered from the shards, module by module, to rank 0's host memory).

    Full fine-tune: ``save_pretrained`` of the model. LoRA/QLoRA: the adapters alone
    (adapter_config.json + adapter_model.safetensors; ``from_pretrained`` loads the base from
    ``init_from``); with ``merge_adapters`` the merged model goes to ``out`` and the adapters to
    ``out/adapter``. Tokenizer files of ``init_from`` or of the data's tokenizer come along.
    Returns ``out`` on rank 0, None elsewhere."""
    unwrapped = accelerator.unwrap_model(model)
    if not hasattr(unwrapped, "save_pretrained"):
        if main:
            print("frenzy: export skipped: the entry point's model has no save_pretrained", flush=True)
        return None
    state = accelerator.get_state_dict(model)         # collective under ZeRO-3
    if not main:
        return None
    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    adapters = uses_adapters(spec)
    merge = adapters and spec.get("export", {}).get("merge_adapters", False)
    target = tmp / "adapter" if merge else tmp
    unwrapped.save_pretrained(str(target), state_dict=state, safe_serialization=True)
    if merge:
        from peft import AutoPeftModelForCausalLM

        # on the host, from the saved adapters: the same for every plan (and a 4-bit base
        # is merged into its 16-bit original, loaded from init_from)
        merged = AutoPeftModelForCausalLM.from_pretrained(
            str(target), dtype=torch_dtype(spec["plan"]["precision"]), local_files_only=True).merge_and_unload()
        merged.save_pretrained(str(tmp), safe_serialization=True)
    sources = [spec.get("init_from"), spec.get("data", {}).get("tokenizer")]
    for src in [Path(s) for s in sources if s and s != "byte" and Path(s).is_dir()][:1]:
        for name in TOKENIZER_FILES:
            if (src / name).is_file():
                shutil.copy2(src / name, tmp / name)
    (tmp / EXPORT_MARKER).write_text(json.dumps({"step": step, "method": spec.get("finetune", {}).get("method", "full"),
                                                 "merged": bool(merge), "init_from": spec.get("init_from"),
                                                 "job_name": spec.get("job_name"), "time": time.time()}))
    if holds_other_files(out):
        # files appeared there since the preflight check: never delete what is not an export
        raise RuntimeError(f"export: {out} holds files that are not an earlier export; the export is left in {tmp}")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)                                    # a reader never sees a half-written export
    print(f"frenzy: export step {step} -> {out} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return out
