"""Files the trainer's processes share: written whole or not at all.

Readers of a run folder (ranks, the runner, the nodes of a gang on shared storage) must see a
file's old content or its new one, never half of it; and writers may share a pid (two hosts on
shared storage, two runners in threads of one process), so a temporary file is named per write,
not per process (one writer renamed another's away: a FileNotFoundError, seen in a two-node test
run in one process).
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it (flushed to disk
    first); a failed write leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "x") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
