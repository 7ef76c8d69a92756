"""Figures as a person reads them, in the CLI's tables and the UI's artifacts alike: memory in
the unit that keeps it readable, step times with a unit, durations in days/hours/minutes.
Plain functions, importable without Prefect (`frenzy estimate` answers in milliseconds)."""
from __future__ import annotations


def format_memory(gib: float | None) -> str:
    """A GiB figure in the unit that keeps it readable: '1.50 GiB', '6.1 MiB', '512 KiB'
    (a tiny model's 0.006 GiB must not print as 0.000 GiB)."""
    if gib is None:
        return "not measured"
    v = float(gib)
    if abs(v) >= 1.0:
        return f"{v:.2f} GiB"
    mib = v * 1024
    if abs(mib) >= 100:
        return f"{mib:.0f} MiB"
    if abs(mib) >= 1.0:
        return f"{mib:.1f} MiB"
    if v == 0:
        return "0 MiB"
    return f"{mib * 1024:.0f} KiB"


def format_seconds(seconds: float | None) -> str:
    """A step time with a unit: '0.812 s', '46.7 ms'."""
    if seconds is None:
        return "not measured"
    s = float(seconds)
    return f"{s * 1000:.1f} ms" if abs(s) < 1 else f"{s:.3g} s"


def format_duration(seconds: float) -> str:
    """'2d 3h', '1h 05m', '4m 10s', '12.3s'."""
    s = float(seconds)
    if s < 60:
        return f"{s:.1f}s"
    m, s = divmod(int(round(s)), 60)
    h, m = divmod(m, 60)
    d, h = divmod(h, 24)
    if d:
        return f"{d}d {h}h"
    if h:
        return f"{h}h {m:02d}m"
    return f"{m}m {s:02d}s"
