"""Training tokens for the training program: synthetic, a text file, JSONL, or a `datasets`
folder saved to disk; tokenised offline (byte-level, or a tokenizer from a local folder).

Also ``check_data``: the same loaders' preconditions, checked in the orchestrator before any
process starts, so a missing file or an unloadable tokenizer fails with a message naming it.
Torch is imported lazily (the checks run where torch may be absent or unwanted).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from estimator.errors import FrenzyInputError

BYTE_VOCAB = 256
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def _datasets_folder_ok(p: Path) -> bool:
    # save_to_disk writes state.json + dataset_info.json (Dataset) or dataset_dict.json (DatasetDict)
    return (p / "state.json").is_file() or (p / "dataset_dict.json").is_file()


def load_tokenizer(name: str):
    """A tokenizer from a local folder, offline. Raises FrenzyInputError naming the folder."""
    p = Path(name)
    if not p.is_dir():
        raise FrenzyInputError("data.tokenizer", f"must be 'byte' or a local tokenizer folder; {name!r} is not a folder")
    if not any((p / f).is_file() for f in _TOKENIZER_FILES):
        raise FrenzyInputError("data.tokenizer", f"folder {name!r} holds no tokenizer files ({', '.join(_TOKENIZER_FILES)})")
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as e:
        msg = " ".join(str(e).split())[:200]
        raise FrenzyInputError("data.tokenizer", f"cannot load tokenizer from {name!r} offline: {msg}") from None


def _tokenizer(data: dict[str, Any]):
    """None for byte-level tokens, else the local tokenizer ``data`` names."""
    name = data.get("tokenizer", "byte")
    return None if name == "byte" else load_tokenizer(name)


def check_data(data: dict[str, Any], *, vocab: int, seq_len: int) -> int:
    """Fail before launch if the data or tokenizer cannot be used, naming the file or setting.
    Returns the tokens read: a text or JSONL file's all (each line checked), a datasets folder's
    (often large) first rows only, until they hold ``seq_len + 1``."""
    kind = data.get("kind", "synthetic")
    path = data.get("path")
    if kind in ("text", "jsonl"):
        if not path or not Path(path).is_file():
            raise FrenzyInputError("data.path", f"{kind} file not found: {path!r}")
    elif kind == "datasets":
        if not path or not Path(path).is_dir():
            raise FrenzyInputError("data.path", f"datasets folder not found: {path!r}")
        if not _datasets_folder_ok(Path(path)):
            raise FrenzyInputError("data.path", f"{path!r} is not a folder written by datasets' save_to_disk "
                                                "(no state.json or dataset_dict.json)")
        try:
            import datasets  # noqa: F401
        except ImportError:
            raise FrenzyInputError("data.kind", "'datasets' needs the datasets package (pip install datasets)") from None
    if kind == "synthetic":
        return 0
    tok = _tokenizer(data)          # loaded once for the vocabulary check and the count
    tv = BYTE_VOCAB if tok is None else len(tok)
    if tv > vocab:
        raise FrenzyInputError("data.tokenizer", f"its vocabulary ({tv}) is larger than the model's vocab ({vocab})")
    # read here, once: a wrong datasets column or too little text fails before launch, not
    # inside the training's ranks
    n, any_text = 0, False
    for text in _texts(data):
        any_text = any_text or bool(text.strip())
        n += len(_tokens([text], tok))          # the training stream: the document and its separator
        if kind == "datasets" and n >= seq_len + 1 and any_text:
            break
    if not any_text:
        raise FrenzyInputError("data.path", f"{path!r} holds no text")
    if n < seq_len + 1:
        raise FrenzyInputError("data.path", f"{path!r} holds {n} token{'s' if n != 1 else ''}, fewer than "
                                            f"seq_len + 1 = {seq_len + 1}")
    return n


def _as_text(value: Any, where: str, field: str) -> str:
    """A document's text; null or a number trained on the text "None" / "3"."""
    if not isinstance(value, str):
        raise FrenzyInputError("data.text_field", f"{where}: {field!r} is {type(value).__name__}, not a string")
    return value


def _texts(data: dict[str, Any]) -> Iterator[str]:
    """The documents of ``data``, one at a time (a datasets folder row by row: its column is not
    loaded whole)."""
    kind, path, field = data.get("kind"), data.get("path"), data.get("text_field", "text")
    if kind == "text":
        raw = Path(path).read_bytes()
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:   # a binary file, an archive, another encoding: not text to learn
            line = raw.count(b"\n", 0, e.start) + 1
            raise FrenzyInputError("data.path", f"{path}:{line} is not UTF-8 text (byte {e.start}); "
                                                "convert it to UTF-8") from None
        return
    if kind == "jsonl":
        with open(path, "rb") as f:
            for i, raw_line in enumerate(f, 1):
                try:
                    line = raw_line.decode("utf-8")
                except UnicodeDecodeError:
                    raise FrenzyInputError("data.path", f"{path}:{i} is not UTF-8 text; convert it to UTF-8") from None
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise FrenzyInputError("data.path", f"{path}:{i} is not JSON ({e.msg})") from None
                if not isinstance(rec, dict) or field not in rec:
                    raise FrenzyInputError("data.text_field", f"{path}:{i} has no field {field!r}")
                yield _as_text(rec[field], f"{path}:{i}", field)
        return
    if kind == "datasets":
        import datasets

        ds = datasets.load_from_disk(path)
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else ds[next(iter(ds))]
        if field not in ds.column_names:
            raise FrenzyInputError("data.text_field", f"datasets folder {path!r} has no column {field!r} "
                                                      f"(columns: {', '.join(ds.column_names)})")
        for i, row in enumerate(ds.select_columns([field])):
            yield _as_text(row[field], f"{path} row {i}", field)
        return
    raise FrenzyInputError("data.kind", f"unknown kind {kind!r}")


def token_stream(data: dict[str, Any]) -> list[int]:
    """All documents tokenised and concatenated (documents separated by EOS / a newline byte)."""
    return _tokens(_texts(data), _tokenizer(data))


def _tokens(texts: list[str], tok) -> list[int]:
    out: list[int] = []
    if tok is None:
        for t in texts:
            out.extend(t.encode("utf-8"))
            out.append(10)
        return out
    sep = [tok.eos_token_id] if tok.eos_token_id is not None else []
    for t in texts:
        out.extend(tok.encode(t, add_special_tokens=False))
        out.extend(sep)
    return out


# Synthetic held-out sequences are numbered from here: far beyond any training sequence.
SYNTHETIC_EVAL_OFFSET = 1 << 40


def split_windows(windows: int, holdout: float) -> tuple[int, int]:
    """(training windows, held-out windows) of a token stream cut into ``windows`` sequences,
    ``holdout`` of them (at least one) held out at the end; at least one left to train on."""
    held = min(windows - 1, max(1, round(windows * holdout)))
    return windows - held, held


class TokenSource:
    """Sequence number -> ``seq_len`` tokens, deterministic, independent of the parallel plan.

    Optimizer step ``s`` always consumes sequences ``[s * G, (s + 1) * G)`` (G: global batch),
    however they are split over ranks and micro-batches, so a resumed or re-planned run sees
    exactly the data the failed one would have.

    ``holdout`` (a fraction in (0, 1)) keeps the last windows of a file's token stream out of
    training; ``part="eval"`` reads those (synthetic data: a disjoint range of sequences).
    """

    def __init__(self, data: dict[str, Any], *, seq_len: int, vocab: int, seed: int,
                 holdout: float | None = None, part: str = "train"):
        import torch

        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed
        self.kind = data.get("kind", "synthetic")
        self.tokens = None
        self.offset = SYNTHETIC_EVAL_OFFSET if (part == "eval" and holdout is not None) else 0
        self.windows = None                      # None: unbounded (synthetic)
        if self.kind != "synthetic":
            self.tokens = torch.tensor(token_stream(data), dtype=torch.long)
            total = max(1, (len(self.tokens) - 1) // seq_len)
            self.first, self.windows = 0, total
            if holdout is not None:
                if total < 2:
                    raise FrenzyInputError("eval.fraction", f"the data holds {total} sequence of seq_len tokens: "
                                                            "nothing left to hold out")
                train, held = split_windows(total, holdout)
                self.first, self.windows = (0, train) if part == "train" else (train, held)

    def __len__(self) -> int:
        return self.windows if self.windows is not None else 1 << 62

    def coverage(self, steps: int, global_batch: int) -> str | None:
        """What the run reads of a file's data, in one line (None for synthetic data): the
        sequences it holds and how many times ``steps`` optimizer steps of ``global_batch``
        sequences pass over them. A small file repeats silently otherwise (one window of
        seq_len + 1 tokens is a valid dataset: every step then trains on that one sequence)."""
        if self.windows is None:
            return None
        read = steps * global_batch
        passes = read / self.windows
        line = (f"data: {self.windows} training sequences of {self.seq_len} tokens; {steps} steps x "
                f"{global_batch} = {read} sequences read, {passes:.2f} passes")
        if passes > 1:
            line += " (the data repeats: more data, or fewer steps, to see new text)"
        return line

    def sequence(self, n: int):
        import torch

        if self.tokens is None:
            # Learnable synthetic text: arithmetic progressions modulo the vocabulary, with a
            # random start and a small random stride per sequence, so the loss really falls.
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.offset + n)
            start = int(torch.randint(0, self.vocab, (1,), generator=g))
            stride = int(torch.randint(1, 8, (1,), generator=g))
            return (start + stride * torch.arange(self.seq_len)) % self.vocab
        w = self.first + n % self.windows
        return self.tokens[w * self.seq_len: w * self.seq_len + self.seq_len]

    def batch(self, first: int, count: int):
        import torch

        return torch.stack([self.sequence(first + i) for i in range(count)])


def eval_source(spec: dict[str, Any], *, vocab: int) -> TokenSource | None:
    """The held-out sequences of the training spec's ``eval`` section (None: no evaluation)."""
    ev = spec.get("eval")
    if not ev:
        return None
    if ev.get("data"):
        return TokenSource(ev["data"], seq_len=spec["seq_len"], vocab=vocab, seed=spec["seed"] + 1)
    return TokenSource(spec["data"], seq_len=spec["seq_len"], vocab=vocab, seed=spec["seed"],
                       holdout=ev["fraction"], part="eval")


def check_eval(ev: dict[str, Any] | None, data: dict[str, Any], *, vocab: int, seq_len: int,
               tokens: int | None = None) -> None:
    """The eval split's preconditions, before launch: its file exists and is usable, or the
    fraction leaves sequences on both sides. ``tokens``: the training file's count, when
    ``check_data`` read it already."""
    if not ev:
        return
    if ev.get("data"):
        try:
            check_data(ev["data"], vocab=vocab, seq_len=seq_len)
        except FrenzyInputError as e:
            raise FrenzyInputError("eval." + e.field, e.rule) from None
        return
    if data.get("kind", "synthetic") in ("text", "jsonl"):
        n = len(token_stream(data)) if tokens is None else tokens
        windows = max(1, (n - 1) // seq_len)
        if windows < 2:
            raise FrenzyInputError("eval.fraction", f"{data.get('path')!r} holds {windows} sequence of "
                                                    f"{seq_len} tokens: nothing left to hold out")
