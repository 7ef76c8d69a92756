"""What the two public-set scorers (``estimator_public.py``, ``throughput_public.py``) share:
reading a CSV as other sources write it, and reading its cells.

A file: a byte-order mark, CRLF, a cp1252 export (Excel), header names in any case or spacing,
quoted line breaks inside a cell, long notes; a file that is not a CSV of the schema as a whole
(undecodable layout, a runaway quote, a column named twice, missing columns) is one
``CsvProblem``. A cell: integers written '64', '64.0', '6.7e9' or '107,000'; words looked up in
a table of the spellings sources use (``named``); a bad cell is a ``FrenzyInputError`` naming
the column, which the scorers report as that row's reason.
"""
from __future__ import annotations

import csv
import io
import math
from pathlib import Path
from typing import Iterable, TypeVar

from estimator.errors import FrenzyInputError

T = TypeVar("T")

# spellings both scorers read the same way
ACT_CKPT = {"none": "none", "false": "none", "no": "none", "0": "none", "off": "none",
            "full": "full", "true": "full", "yes": "full", "1": "full", "on": "full",
            "selective": "selective"}
ATTENTION = {"flash": "flash", "flash2": "flash", "flash-2": "flash", "fa": "flash", "fa2": "flash",
             "fa3": "flash", "flash_attn": "flash", "flash-attn": "flash", "flash_attn_2": "flash",
             "flash_attention_2": "flash", "flash_attention_3": "flash", "flashattention": "flash",
             "flashattention-2": "flash", "flashattention2": "flash", "sdpa": "flash", "xformers": "flash",
             "mem_efficient": "flash", "fused": "flash",
             "eager": "eager", "math": "eager", "vanilla": "eager", "standard": "eager", "unfused": "eager"}
TRUE_FALSE = {"true": True, "yes": True, "y": True, "1": True, "false": False, "no": False, "n": False, "0": False}


class CsvProblem(ValueError):
    """A file that is not a CSV of the schema as a whole (one line, exit 2)."""


def read_rows(path: str | Path, required: Iterable[str] = ()) -> list[dict[str, str]]:
    """The CSV's rows as dicts, header names lower-case and stripped, cells stripped, blank
    lines skipped; a short row's missing cells are empty. ``required``: columns the file must
    have (``CsvProblem`` naming them)."""
    raw = Path(path).read_bytes()
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        text = raw.decode("cp1252", errors="replace")
    csv.field_size_limit(1 << 24)          # long notes are notes; a runaway quote is caught below
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        table = list(reader)
    except csv.Error as e:
        raise CsvProblem(f"{path}: not a readable CSV at line {reader.line_num}: {e}") from None
    if not table:
        raise CsvProblem(f"{path}: empty file")
    header = [h.strip().lower() for h in table[0]]
    dup = sorted({h for h in header if h and header.count(h) > 1})
    if dup:
        raise CsvProblem(f"{path}: column {dup[0]!r} appears more than once in the header")
    missing = [c for c in required if c not in header]
    if missing:
        raise CsvProblem(f"{path}: missing column{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                         "(the schema of the shared published.csv)")
    rows = []
    for cells in table[1:]:
        if any(c.strip() for c in cells):
            rows.append({**dict.fromkeys(header, ""), **{h: c.strip() for h, c in zip(header, cells)}})
    return rows


def integer(col: str, text: str, blank: int | None = None) -> int:
    """An integer cell: '64', '64.0', '6.7e9', '107,000'; '6.5' is not one. A blank cell is
    ``blank`` when given."""
    t = text.strip().replace(",", "").replace("_", "")
    if not t and blank is not None:
        return blank
    try:
        return int(t)
    except ValueError:
        pass
    try:
        x = float(t)
    except ValueError:
        raise FrenzyInputError(col, f"must be an integer, got {text!r}") from None
    if not math.isfinite(x) or x != int(x):
        raise FrenzyInputError(col, f"must be an integer, got {text!r}")
    return int(x)


def named(col: str, text: str, names: dict[str, T], blank: T | None = None) -> T:
    """The value ``names`` gives a cell's word (any case, stripped); a blank cell is ``blank``
    when given."""
    key = text.strip().lower()
    if not key and blank is not None:
        return blank
    if key not in names:
        raise FrenzyInputError(col, f"unknown value {text!r}; one of {', '.join(sorted(set(names)))}")
    return names[key]
