"""No garbage-collector pass inside a scheduling round.

A round allocates many short-lived objects. With Python's cyclic collector on, a full pass (the
oldest generation: the policy's plan menus, the ledger mirror, everything the process keeps)
lands inside some round and takes it from ~50 ms to 200-360 ms (``bench/live_round.py`` on
PostgreSQL: the round p99 over 200 ms in 8 of 10 runs with the default collector, in none of 4
with this hold; docs/benchmarks.md, "Shrink's reads once a round"). ``collector_held`` turns the
collector off for the round. The
pass that came due meanwhile runs at the first allocation after it, outside the round: at the
latest when the next round's hold is entered (calling ``collector_held`` allocates its
generator before it turns the collector off), with the collector's own thresholds and
heuristics unchanged.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def collector_held() -> Iterator[None]:
    """The cyclic collector off for the block (where a caller already turned it off, it stays off)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
