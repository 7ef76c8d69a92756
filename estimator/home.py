"""Where Frenzy keeps its state: the ledger, runs and checkpoints, the calibration file, the
embedded Prefect server's database. One place decides it: ``$FRENZY_HOME``, else ``./.frenzy``,
made absolute against the working directory when asked: paths a run returns (checkpoints, the
export, the run folder) stay valid for a caller that changes directory, and for pool workers.

State files are written whole or not at all (``write_atomic``): their readers (a training's
ranks, the runner, the nodes of a gang on shared storage, an estimate reading the calibration
file) must see the old content or the new one, never half of it; and writers may share a pid
(two hosts on shared storage, two runners in threads of one process), so the temporary file is
named per write, not per process (one writer renamed another's away: a FileNotFoundError, seen
in a two-node test run in one process).
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

DEFAULT_HOME = ".frenzy"


def check_can_write_in(field: str, folder: Path) -> None:
    """New files can be made in ``folder``, or, where it does not exist yet, in the nearest
    folder above it that does (the writer makes the rest): a probe file is made there and
    removed, which also catches what access() misses (kernel file systems such as /proc).
    FrenzyInputError naming ``field`` otherwise."""
    import tempfile

    from .errors import FrenzyInputError

    above = Path(folder)
    while not above.exists():
        above = above.parent
    if not above.is_dir():
        raise FrenzyInputError(field, f"{above} is a file, not a folder (cannot write under it)")
    try:
        fd, probe = tempfile.mkstemp(dir=above, prefix=".frenzy-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise FrenzyInputError(field, f"cannot write under {above} ({err.strerror or err})") from None


def frenzy_home() -> Path:
    return Path(os.environ.get("FRENZY_HOME") or DEFAULT_HOME).absolute()


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file renamed over it (flushed to disk
    first); a failed write leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "x", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# path -> (mtime_ns, parsed): calibration files are read on the estimate's hot path, so they are
# parsed once per change of the file, not once per call
_json_cache: dict[str, tuple[int, object]] = {}


def read_json_cached(path: str, parse):
    """``parse(json.load(path))``, re-read only when the file's mtime changes; None when the file
    is absent or does not parse (``parse`` may raise ValueError/TypeError/KeyError/AttributeError
    for a malformed document): then a warning, once per version of the file, says that the
    defaults are used (a corrupt calibration file was ignored without a word)."""
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
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        import warnings
        warnings.warn(f"{path} does not parse ({type(err).__name__}: {err}); the defaults are used "
                      "instead (`frenzy calibrate` rewrites it)", stacklevel=2)
        value = None
    _json_cache[path] = (mtime, value)
    return value


def forget_json_cache() -> None:
    """Drop the parsed copies (after this process rewrote a file within one mtime tick)."""
    _json_cache.clear()
