"""Output files the CLI writes, checked before any work: a bad path is one line naming the flag,
not a traceback after a long simulation."""
from __future__ import annotations

import os
from pathlib import Path

from estimator.errors import FrenzyInputError


def check_output_file(flag: str, path: str | os.PathLike) -> Path:
    """``path`` as a file this process may create or replace: not a folder, under a folder (or
    one it can make) it may write in. Raises FrenzyInputError naming ``flag`` otherwise."""
    out = Path(path)          # as given, as the inputs are read and the writer writes it
    if out.is_dir():
        raise FrenzyInputError(flag, f"{path} is a folder; give a file name")
    if out.exists() and not os.access(out, os.W_OK):
        raise FrenzyInputError(flag, f"{path} exists and cannot be written (no permission)")
    for parent in out.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise FrenzyInputError(flag, f"{parent} is a file, not a folder: {path} cannot be written")
            if not os.access(parent, os.W_OK | os.X_OK) or _virtual(parent):
                raise FrenzyInputError(flag, f"cannot write under {parent} (no permission)")
            break
    return out


def _virtual(folder: Path) -> bool:
    """A kernel file system (/proc, /sys) refuses new files even where access() says yes."""
    try:
        import psutil
    except ImportError:                  # pragma: no cover - psutil is a dependency
        return False
    target = str(folder.resolve())
    best = None
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if (target == mp or target.startswith(mp.rstrip("/") + "/")) and (best is None or len(mp) > len(best[0])):
            best = (mp, part.fstype)
    return best is not None and best[1] in ("proc", "sysfs", "cgroup", "cgroup2", "debugfs", "securityfs")


def write_failed(flag: str, path: str | os.PathLike, err: OSError) -> FrenzyInputError:
    """The one-line error of a write that failed after all (a full disk, a race)."""
    return FrenzyInputError(flag, f"could not write {path}: {err.strerror or err}")
