"""The console every `frenzy` table prints to: the terminal's width when there is one; when
piped or captured (CI logs, `| less`), wide enough that tables are not truncated."""
from __future__ import annotations

import sys

from rich.console import Console

PIPED_WIDTH = 160


def console(stderr: bool = False) -> Console:
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else PIPED_WIDTH)
