"""Where a job starts from, and every check of its fine-tune settings that can run before any
GPU is allocated or Prefect is started (``frenzy run`` and ``submit_training`` call
``check_job`` first; the runner's preflight calls it again).

* ``start_folder``: ``init_from`` -> a local folder holding ``config.json`` and safetensors
  weights: the folder itself, or the snapshot of a Hub id in the local Hugging Face cache (never
  downloaded; a missing cache entry is named in the error). A missing folder whose parent has a
  ``HOW-TO-MAKE`` file (the examples' tiny models) names the command that makes it.
* ``check_job``: the starting point exists and its weights match its config (names and shapes
  from the safetensors headers against a model built from the config on the ``meta`` device:
  no weight is read); ``model``, when given next to ``init_from``, is the same architecture;
  every LoRA target module matches a module of the model (PEFT's own matching rule); QLoRA has
  bitsandbytes and a CUDA build of torch; pure 16-bit training is bf16.

Every failure is a ``FrenzyInputError`` naming the field. Torch, transformers and PEFT are
imported only for jobs that need them (pretrained weights or adapters).
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob

WEIGHTS_INDEX = "model.safetensors.index.json"
# A file next to model folders that a command makes: its first line is that command.
HOW_TO_MAKE = "HOW-TO-MAKE"


def start_folder(init_from: str) -> Path:
    """The local model folder ``init_from`` names (a folder, or a Hub id in the local cache)."""
    from estimator.models import HUB_ID, cached_hub_snapshot

    p = Path(init_from).expanduser()
    if not p.exists():
        if HUB_ID.match(init_from) and not init_from.startswith("."):
            p = Path(cached_hub_snapshot(init_from, field="init_from"))
        else:
            raise FrenzyInputError("init_from", f"model folder {init_from} does not exist{_how_to_make(p)}")
    if not p.is_dir():
        raise FrenzyInputError("init_from", f"{init_from} is not a folder (give a Hugging Face model folder "
                                            "as save_pretrained writes it)")
    if not (p / "config.json").is_file():
        raise FrenzyInputError("init_from", f"{p} holds no config.json")
    if not weight_files(p):
        raise FrenzyInputError("init_from", f"{p} holds no safetensors weights (model.safetensors or "
                                            f"{WEIGHTS_INDEX} with its shards)")
    return p.resolve()


def _how_to_make(missing: Path) -> str:
    """A hint for a model folder that a command makes (examples' tiny models): the first line of
    ``HOW-TO-MAKE`` in the folder that should hold it."""
    hint = missing.parent / HOW_TO_MAKE
    try:
        line = hint.read_text().strip().splitlines()[0].strip()
    except (OSError, IndexError):
        return ""
    return f"; make it with `{line}`" if line else ""


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a model folder (the shards an index lists, or the single file)."""
    index = folder / WEIGHTS_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, json.JSONDecodeError, KeyError, AttributeError) as e:
            raise FrenzyInputError("init_from", f"{index} is not a safetensors index ({e})") from None
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FrenzyInputError("init_from", f"{folder} lacks weight shard {missing[0]} listed in {WEIGHTS_INDEX}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    return [single] if single.is_file() else []


def _meta_model(job: TrainingJob, folder: Path | None):
    """The job's model on the ``meta`` device (shapes only, no memory)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from estimator.models import resolve_model

    if folder is not None:
        cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    else:
        cfg = AutoConfig.for_model(**resolve_model(job.model).hf_config())
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def check_weights(model, folder: Path) -> None:
    """Every tensor the config's model expects is in the weights, with the same shape."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in weight_files(folder):
        try:
            with safe_open(str(f), framework="pt") as st:
                for k in st.keys():
                    shapes[k] = tuple(st.get_slice(k).get_shape())
        except Exception as e:   # not a safetensors file at all
            raise FrenzyInputError("init_from", f"{f} is not a readable safetensors file ({type(e).__name__})") from None
    prefix = getattr(model, "base_model_prefix", "") + "."

    def lookup(name: str):
        # a base-model checkpoint (GPT2Model, LlamaModel) has its keys without the prefix
        return shapes.get(name, shapes.get(name.removeprefix(prefix), shapes.get(prefix + name)))

    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, tensor in model.state_dict().items():
        got = lookup(name)
        if got is None:
            if tied and name.endswith("lm_head.weight"):
                continue
            raise FrenzyInputError("init_from", f"weights do not match config.json: {name} is missing from "
                                                f"{folder.name}'s safetensors ({len(shapes)} tensors there)")
        if got != tuple(tensor.shape):
            raise FrenzyInputError("init_from", f"weights do not match config.json: {name} is {list(got)} in the "
                                                f"safetensors, the config makes it {list(tensor.shape)}")


def check_adapters(job: TrainingJob, model) -> None:
    """LoRA targets: each one names a module of the model, and PEFT can wrap them."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import check_target_module_exists

    from estimator.memory import ALL_LINEAR

    from .modeling import peft_targets

    ft = job.finetune
    names = [n for n, _ in model.named_modules() if n]
    for target in ft.target_modules or []:
        if target == ALL_LINEAR:
            continue                    # PEFT's shorthand, checked by get_peft_model below
        one = LoraConfig(r=ft.rank, target_modules=[target])
        if not any(check_target_module_exists(one, n) for n in names):
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names if "." in n})
            raise FrenzyInputError("finetune.target_modules", f"{target!r} matches no module of the model "
                                                              f"(module names end in: {', '.join(leaves[:20])})")
    try:
        get_peft_model(model, LoraConfig(r=ft.rank, lora_alpha=ft.alpha, lora_dropout=ft.dropout,
                                         target_modules=peft_targets(ft.target_modules,
                                                                     getattr(model.config, "model_type", None)),
                                         task_type="CAUSAL_LM"))
    except (ValueError, TypeError) as e:
        raise FrenzyInputError("finetune.target_modules", " ".join(str(e).split())[:300]) from None


def check_qlora_support() -> None:
    """QLoRA needs bitsandbytes and a CUDA build of torch (its 4-bit kernels are GPU kernels)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise FrenzyInputError("finetune.method", "qlora needs bitsandbytes with GPU support, and bitsandbytes "
                                                  "is not installed here (pip install bitsandbytes on a CUDA machine)")
    import torch

    if torch.version.cuda is None:
        raise FrenzyInputError("finetune.method", f"qlora needs a GPU: this torch build ({torch.__version__}) "
                                                  "has no CUDA, so bitsandbytes' 4-bit kernels cannot run")


def check_job(job: TrainingJob) -> Path | None:
    """All checks of the module docstring; returns the starting folder (None: random init)."""
    from estimator.models import resolve_model

    if job.master_weights == "none" and job.precision == "fp16":
        raise FrenzyInputError("master_weights", "'none' (pure 16-bit training) runs in bf16; fp16 needs fp32 "
                               "master weights for loss scaling")
    adapters = job.finetune.method != "full"
    if adapters and job.entry_point:
        raise FrenzyInputError("finetune.method", f"{job.finetune.method} wraps a Hugging Face model; "
                                                  "entry_point models train in full")
    if job.finetune.method == "qlora":
        if not job.init_from:
            raise FrenzyInputError("init_from", "qlora quantizes pretrained weights: give init_from")
        check_qlora_support()
    folder = start_folder(job.init_from) if job.init_from else None
    if folder is not None and job.entry_point:
        raise FrenzyInputError("init_from", "pretrained weights load into a Hugging Face model; not with entry_point")
    if folder is not None and job.model != job.init_from:
        given, weights = resolve_model(job.model), resolve_model(str(folder))
        if given.params != weights.params or given.dims() != weights.dims():
            raise FrenzyInputError("model", f"differs from init_from's config.json ({given.params:,} vs "
                                            f"{weights.params:,} parameters); leave model out to size the weights' model")
    if folder is None and not adapters:
        return None
    model = _meta_model(job, folder)
    if folder is not None:
        check_weights(model, folder)
    if adapters:
        check_adapters(job, model)
    return folder
