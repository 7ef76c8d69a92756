"""The live replay stops what it started: a pool worker's whole process tree (its flow-run
processes and their trainings), even a descendant that left the worker's process group, and a
process that ignores SIGTERM."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from bench.live_replay import _descendants, stop_tree

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="procfs (Linux) only")

# a parent with two children: one in the parent's group, one in a session of its own that
# ignores SIGTERM (as a training rank between steps might); prints their pids, then waits
TREE = r"""
import os, signal, subprocess, sys, time
a = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
b = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "print(flush=True); time.sleep(600)"], start_new_session=True, stdout=subprocess.PIPE)
b.stdout.readline()                 # its SIGTERM is ignored from here on
print(a.pid, b.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode(errors="replace").rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False


def test_stop_tree_stops_every_descendant():
    p = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True, start_new_session=True)
    kids = [int(x) for x in p.stdout.readline().split()]
    assert set(kids) <= set(_descendants(p.pid))
    t0 = time.time()
    left = stop_tree(p, grace_s=2.0)
    assert left == []
    assert p.poll() is not None
    assert not any(_running(k) for k in kids)
    assert 2.0 <= time.time() - t0 < 10   # one ignored SIGTERM: SIGKILL after the grace, not a hang


def test_stop_tree_of_an_ended_process_is_a_no_op():
    p = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    p.wait()
    assert stop_tree(p, grace_s=0.5) == []
