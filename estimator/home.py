"""Where Frenzy keeps its state: the ledger, runs and checkpoints, the calibration file, the
embedded Prefect server's database. One place decides it: ``$FRENZY_HOME``, else ``./.frenzy``,
made absolute against the working directory when asked: paths a run returns (checkpoints, the
export, the run folder) stay valid for a caller that changes directory, and for pool workers."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_HOME = ".frenzy"


def frenzy_home() -> Path:
    return Path(os.environ.get("FRENZY_HOME") or DEFAULT_HOME).absolute()


# path -> (mtime_ns, parsed): calibration files are read on the estimate's hot path, so they are
# parsed once per change of the file, not once per call
_json_cache: dict[str, tuple[int, object]] = {}


def read_json_cached(path: str, parse):
    """``parse(json.load(path))``, re-read only when the file's mtime changes; None when the file
    is absent or does not parse (``parse`` may raise ValueError/TypeError/KeyError/AttributeError
    for a malformed document)."""
    import json

    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        return None
    hit = _json_cache.get(path)
    if hit is not None and hit[0] == mtime:
        return hit[1]
    try:
        with open(path, encoding="utf-8") as fh:
            value = parse(json.load(fh))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    _json_cache[path] = (mtime, value)
    return value


def forget_json_cache() -> None:
    """Drop the parsed copies (after this process rewrote a file within one mtime tick)."""
    _json_cache.clear()
