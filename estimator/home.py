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
