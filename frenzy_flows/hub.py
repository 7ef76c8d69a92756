"""Hugging Face Hub models a job names, fetched into this machine's Hugging Face cache before
they are used, when the site allows it.

Off by default: nothing downloads, and a Hub id that is not in the local cache is a one-line
error saying how to fetch it (``estimator.models.cached_hub_snapshot``). A site turns fetching on
in its `FrenzySettings` block (``fetch_models``), with ``hf_token`` for gated or private repos;
`frenzy run --fetch` does the same from a shell (the token then comes from ``HF_TOKEN`` or `hf
auth login`). Each machine that reads the model fetches it: the submit flow's (it sizes the model
from its config.json and checks the weights it starts from) and every training node's, whose
queue row and GPU lease are kept alive meanwhile (a download takes minutes). A node of a
multi-node run fetches before it joins its gang: a download longer than the rendezvous wait
fails that launch, and the gang's retry finds the model cached.

What is fetched: for ``init_from`` (pretrained weights) the configs, safetensors weights and
tokenizer files; for a ``model`` named by Hub id without weights, its configs only. Never the
other weight formats a repo may also carry (``original/`` consolidated checkpoints, ``.bin``,
``.gguf``...), which would double the download. ``HF_ENDPOINT`` (a mirror) is honoured.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from estimator.errors import FrenzyInputError

# what from_pretrained and a tokenizer read (configs, safetensors shards and their index,
# sentencepiece / tiktoken / vocab files)
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
CONFIG_PATTERNS = ["config.json", "generation_config.json"]
# other weight formats of the same model: Meta's original/ checkpoints, Mistral's consolidated
# safetensors (beside the Hugging Face shards), PyTorch / GGUF / ONNX / Flax / TF files
SKIPPED = ["original/*", "consolidated*", "*.pth", "*.pt", "*.bin", "*.gguf", "*.onnx", "*.msgpack", "*.h5",
           "*.ckpt"]


def hub_models(job: Any) -> dict[str, tuple[str, bool]]:
    """The Hub ids ``job`` names, each with the field that names it and whether its weights
    are read: ``{repo_id: (field, weights)}``. Presets, local folders and files are left out."""
    from estimator.models import HUB_ID, PRESETS

    out: dict[str, tuple[str, bool]] = {}
    for field, value, weights in (("init_from", job.init_from, True), ("model", job.model, False)):
        if not isinstance(value, str) or value in PRESETS or value in out:
            continue
        if Path(value).expanduser().exists() or not HUB_ID.match(value) or value.startswith("."):
            continue
        if value.endswith(".json"):
            continue
        out[value] = (field, weights)
    return out


def _cached(repo_id: str, field: str, weights: bool) -> bool:
    from estimator.models import cached_hub_snapshot

    try:
        folder = Path(cached_hub_snapshot(repo_id, field))
    except FrenzyInputError:
        return False
    if not weights:
        return True
    from trainer.pretrained import weight_files

    try:
        return bool(weight_files(folder))
    except FrenzyInputError:        # an index whose shards are not all there yet
        return False


def fetch_hub_models(job: Any, *, token: str | None = None,
                     log: Callable[[str], None] = lambda _line: None) -> list[str]:
    """Download the Hub models ``job`` names that this machine's cache lacks (``token``: for
    gated or private repos; None: ``HF_TOKEN`` or the stored login). Returns the repo ids
    fetched. A repo that cannot be fetched is one FrenzyInputError naming the job's field."""
    fetched = []
    for repo_id, (field, weights) in hub_models(job).items():
        if _cached(repo_id, field, weights):
            continue
        from huggingface_hub import snapshot_download

        what = "weights, configs and tokenizer" if weights else "config"
        log(f"fetching {repo_id} ({what}) from the Hugging Face Hub into this machine's cache")
        try:
            snapshot_download(repo_id, token=token or None, endpoint=os.environ.get("HF_ENDPOINT") or None,
                              allow_patterns=WEIGHT_PATTERNS if weights else CONFIG_PATTERNS,
                              ignore_patterns=SKIPPED)
        except Exception as err:      # the hub's errors (gated, not found, offline, network) in one line
            raise FrenzyInputError(field, f"could not fetch {repo_id} from the Hugging Face Hub: {_why(err)}") from None
        if not _cached(repo_id, field, weights):
            raise FrenzyInputError(field, f"{repo_id} on the Hugging Face Hub holds no "
                                          + ("safetensors weights" if weights else "config.json"))
        fetched.append(repo_id)
    return fetched


def _why(err: Exception) -> str:
    name = type(err).__name__
    if name == "GatedRepoError":
        return ("the repo is gated: accept its licence on the Hub and give a token that has access "
                "(hf_token in the FrenzySettings block, or HF_TOKEN)")
    if name == "RepositoryNotFoundError":
        return "no such repo, or it is private and the token has no access"
    if name == "OfflineModeIsEnabled":
        return "HF_HUB_OFFLINE is set on this machine"
    first = " ".join(str(err).split())
    return f"{name}: {first[:200]}"
