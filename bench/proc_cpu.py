"""CPU-seconds per process of a process tree, grouped, over a phase of a benchmark.

Valid on a shared machine: what other processes load the cores with changes how long our
processes wait, not the CPU time the kernel charges to them (``utime + stime`` of
``/proc/<pid>/stat``). A sampler thread reads every descendant of the roots it is given every
``period_s``; a process that exits between two samples keeps its last reading (so at most one
period of each exiting process is missed). ``classify(pid, root, cmdline)`` names the group a
process is charged to (``root``: the tracked root it descends from), optionally per phase
(``phase(root)``: e.g. whether that root's job is waiting or running at this sample; "" for
none).

Linux only (procfs). No project imports: the benchmarks pass their own classification.
"""
from __future__ import annotations

import os
import threading
from collections import defaultdict
from typing import Callable

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(pid: int) -> tuple[int, float] | None:
    """(ppid, CPU-seconds of the process itself) from /proc, None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()      # the command name may hold spaces and ')'
    # fields after the name: state(0) ppid(1) ... utime(11) stime(12)
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _TICK


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def descendants(roots: set[int]) -> dict[int, int]:
    """pid -> the root of ``roots`` it descends from, for every live process under them (the
    roots themselves included)."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None:
                parent[int(name)] = st[0]
    out = {}
    for pid in parent:
        p, seen = pid, 0
        while p not in roots and p in parent and seen < 64:
            p, seen = parent[p], seen + 1
        if p in roots:
            out[pid] = p
    return out


def machine_busy_s() -> float:
    """CPU-seconds every core of the machine spent busy since boot (all processes, ours or not)."""
    with open("/proc/stat") as f:
        cpu = [int(x) for x in f.readline().split()[1:]]
    idle = cpu[3] + (cpu[4] if len(cpu) > 4 else 0)          # idle + iowait
    return (sum(cpu[:8]) - idle) / _TICK


class ProcCpu:
    """Sample the CPU time of the descendants of ``roots()`` (pids) every ``period_s`` between
    ``start()`` and ``stop()``; ``report()`` -> {group: CPU-seconds} over that window."""

    def __init__(self, roots: Callable[[], list[int]], classify: Callable[[int, int, str], str],
                 period_s: float = 1.0, phase: Callable[[int], str] | None = None,
                 before: Callable[[], None] | None = None):
        self.roots, self.classify, self.period_s, self.phase = roots, classify, period_s, phase
        self.before = before              # called before each sample (e.g. to read job states)
        self._last: dict[int, float] = {}             # pid -> CPU-seconds at its last sample
        self._group: dict[int, str] = {}              # pid -> group (decided at first sight)
        self._cmd: dict[int, str] = {}
        self.totals: dict[str, float] = defaultdict(float)
        self.per_root: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="proc-cpu", daemon=True)
        self._busy0 = self._busy1 = self._busy_prev = 0.0
        self.series: list[tuple[float, float]] = []      # per period: (machine busy, ours) CPU-s
        self.samples = 0

    def _tree(self) -> dict[int, int]:
        """pid -> the tracked root it descends from, for every live descendant."""
        return descendants(set(self.roots()))

    def sample(self) -> None:
        if self.before is not None:
            self.before()
        ours = sum(self.totals.values())
        for pid, root in self._tree().items():
            st = _stat(pid)
            if st is None:
                continue
            now = st[1]
            if pid not in self._group:
                self._cmd[pid] = _cmdline(pid)
                self._group[pid] = self.classify(pid, root, self._cmd[pid])
            prev = self._last.get(pid)
            self._last[pid] = now
            if prev is None:              # first sight: the CPU it used before the window is not ours
                if self.samples == 0:
                    continue
                prev = 0.0                # born inside the window: all of it counts
            group = self._group[pid]
            tag = self.phase(root) if self.phase is not None else ""
            if tag:
                group = f"{group} ({tag})"
            self.totals[group] += now - prev
            self.per_root[root][group] += now - prev
        busy = machine_busy_s()
        if self.samples:
            # (machine busy, ours) over the period: what everyone else took meanwhile
            self.series.append((busy - self._busy_prev, sum(self.totals.values()) - ours))
        self._busy_prev = busy
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.sample()
            except Exception:           # a racing /proc read: the next sample catches up
                pass

    def start(self) -> "ProcCpu":
        self._busy0 = machine_busy_s()
        self.sample()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5 * self.period_s)
        self.sample()
        self._busy1 = machine_busy_s()

    def report(self) -> dict[str, float]:
        return {k: round(v, 1) for k, v in sorted(self.totals.items(), key=lambda kv: -kv[1])}

    def report_of(self, root: int) -> dict[str, float]:
        """{group: CPU-seconds} of the processes under one root."""
        return {k: round(v, 1) for k, v in sorted(self.per_root.get(root, {}).items(), key=lambda kv: -kv[1])}

    def others_peak(self, window: int = 10) -> float:
        """The most CPU-seconds per second that other processes took over ``window`` periods."""
        other = [max(0.0, b - o) for b, o in self.series]
        if not other:
            return 0.0
        w = max(1, min(window, len(other)))
        return round(max(sum(other[i:i + w]) for i in range(len(other) - w + 1)) / (w * self.period_s), 2)

    def machine_busy(self) -> float:
        """CPU-seconds the whole machine was busy in the window (ours and everyone else's)."""
        return round(self._busy1 - self._busy0, 1)
