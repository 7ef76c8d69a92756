"""Output files the CLI writes, checked before any work: a bad path is one line naming the flag,
not a traceback after a long simulation."""
from __future__ import annotations

import os
from pathlib import Path

from estimator.errors import FrenzyInputError
from estimator.home import check_can_write_in


def check_output_file(flag: str, path: str | os.PathLike) -> Path:
    """``path`` as a file this process may create or replace: not a folder, and under a folder
    (or one it can make) it may write in. Raises FrenzyInputError naming ``flag`` otherwise."""
    out = Path(path)          # as given, as the inputs are read and the writer writes it
    if out.is_dir():
        raise FrenzyInputError(flag, f"{path} is a folder; give a file name")
    if out.exists() and not os.access(out, os.W_OK):
        raise FrenzyInputError(flag, f"{path} exists and cannot be written (no permission)")
    check_can_write_in(flag, out.absolute().parent)
    return out


def write_failed(flag: str, path: str | os.PathLike, err: OSError) -> FrenzyInputError:
    """The one-line error of a write that failed after all (a full disk, a race)."""
    return FrenzyInputError(flag, f"could not write {path}: {err.strerror or err}")
