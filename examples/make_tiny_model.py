"""Make the tiny pretrained model the fine-tune examples start from (no network, ~10 s on a CPU).

    python examples/make_tiny_model.py            # -> examples/.models/tiny-llama (git-ignored)

A Llama-shaped causal LM (2 layers, hidden 64, byte-level vocabulary of 256) pre-trained for a
few hundred steps on text that ships with Python (the docstrings of standard-library modules),
saved with ``save_pretrained`` (config.json + model.safetensors), as a Hub model folder is. The
fine-tune example (examples/finetune-lora.yaml) then adapts it to other text with LoRA.
Idempotent: a folder that already holds the model of this recipe is left alone.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / ".models" / "tiny-llama"
RECIPE = {"version": 1, "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 172, "vocab": 256,
          "seq_len": 64, "batch": 8, "steps": 120, "lr": 5e-3, "seed": 0}
CORPUS_MODULES = ("json", "pathlib", "argparse", "collections", "functools", "itertools", "random",
                  "statistics", "textwrap", "string", "shutil", "subprocess", "threading", "logging")


def corpus() -> bytes:
    """Plain English text from the standard library's docstrings (the same on every machine
    with this Python version)."""
    parts = []
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        parts.append(mod.__doc__ or "")
        for attr in sorted(dir(mod)):
            doc = getattr(getattr(mod, attr, None), "__doc__", None)
            if isinstance(doc, str) and len(doc) > 80 and not attr.startswith("_"):
                parts.append(doc)
    return "\n".join(parts).encode("utf-8", errors="replace")


def is_made(out: Path) -> bool:
    try:
        return json.loads((out / "frenzy_recipe.json").read_text()) == RECIPE and (out / "model.safetensors").is_file()
    except (OSError, json.JSONDecodeError):
        return False


def make(out: Path) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    r = RECIPE
    torch.manual_seed(r["seed"])
    cfg = LlamaConfig(hidden_size=r["hidden"], num_hidden_layers=r["layers"], num_attention_heads=r["heads"],
                      num_key_value_heads=r["kv_heads"], intermediate_size=r["ffn"], vocab_size=r["vocab"],
                      max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=None,
                      eos_token_id=10, pad_token_id=None, use_cache=False)
    model = LlamaForCausalLM(cfg)
    tokens = torch.tensor(list(corpus()), dtype=torch.long)
    windows = (len(tokens) - 1) // r["seq_len"]
    opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], weight_decay=0.0)
    g = torch.Generator().manual_seed(r["seed"])
    for step in range(1, r["steps"] + 1):
        idx = torch.randint(0, windows, (r["batch"],), generator=g)
        x = torch.stack([tokens[i * r["seq_len"]:(i + 1) * r["seq_len"]] for i in idx.tolist()])
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 40 == 0 or step == 1:
            print(f"pretraining step {step}/{r['steps']}: loss {loss.item():.3f}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "frenzy_recipe.json").write_text(json.dumps(RECIPE))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"model folder (default: {DEFAULT_OUT})")
    args = ap.parse_args(argv)
    if is_made(args.out):
        print(f"{args.out}: already made")
        return 0
    make(args.out)
    print(f"{args.out}: tiny pretrained model saved")
    return 0


if __name__ == "__main__":
    sys.exit(main())
