"""TCP ports a process binds seconds after choosing them: an attempt's rendezvous port (node 0
publishes it, ``accelerate launch`` binds it), a server a test or a benchmark starts.

Why not ``bind(("", 0))`` and close: the kernel hands that port out of its ephemeral range, the
range every other ``bind(0)`` listener (gloo's pair sockets, a test's server, another attempt)
also draws from. Between the choice and the launcher's bind (a DeepSpeed op check, the ledger,
accelerate's start: seconds) another process can get the same port, and the launch dies with
accelerate's "another process is utilizing it" (seen with two test processes on one machine).

So a port is drawn at random *below* the ephemeral range, where the kernel never assigns ports
by itself, checked free by binding it, and reserved for ``RESERVATION_S`` by a file created
exclusively in a per-user folder under the temp dir: two Frenzy processes on one host never draw
the same port at once. The reservation is only a hint to other Frenzy processes; the port is
the launcher's once it binds it. Where no such range exists the kernel's choice is used.
"""
from __future__ import annotations

import errno
import os
import random
import socket
import tempfile
import time
from pathlib import Path

LOOPBACK = "127.0.0.1"
# The kernel's ephemeral range (Linux); its default is 32768-60999. macOS and the BSDs use
# 49152-65535, above the range used here too.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768
# The lowest port drawn: above the well-known services' ports a host commonly runs
# (PostgreSQL 5432, Prefect 4200, MLflow 5000, 8000-8888 web servers, Redis 6379); a port
# something already listens on is skipped by the bind check anyway.
PORT_FLOOR = 20000
# A launch binds its port within seconds of choosing it (a cold DeepSpeed op build comes
# before the choice, not after); an attempt that never binds frees its reservation after this.
RESERVATION_S = 600.0
DRAWS = 64          # random draws before falling back to the kernel's choice


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def reservations_dir() -> Path:
    """Per user: another user's folder of the same name is not writable here."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"frenzy-ports-{uid}"


def _reserve(port: int, now: float) -> bool:
    """Create the port's reservation file; False when another process holds a fresh one."""
    folder = reservations_dir()
    folder.mkdir(mode=0o700, exist_ok=True)
    path = folder / str(port)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:
                if now - path.stat().st_mtime < RESERVATION_S:
                    return False
                path.unlink()                       # stale: its launch bound it long ago or died
            except FileNotFoundError:
                pass                                # its holder just removed it: try again
    return False


def _sweep(now: float) -> None:
    """Remove reservations older than ``RESERVATION_S``, so the folder holds only the last
    minutes' launches."""
    try:
        entries = list(os.scandir(reservations_dir()))
    except OSError:
        return
    for entry in entries:
        try:
            if now - entry.stat().st_mtime >= RESERVATION_S:
                os.unlink(entry.path)
        except OSError:
            pass                                # gone already, or not ours to remove


def _bindable(address: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _kernel_port(address: str) -> int:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def free_port(address: str = LOOPBACK) -> int:
    """A TCP port free on ``address`` now and reserved against other Frenzy processes on this
    host for ``RESERVATION_S`` (for the rendezvous of one attempt; in a multi-node launch node 0
    asks on its own address and publishes the answer)."""
    high = ephemeral_low() - 1
    if high <= PORT_FLOOR:                      # no room below the ephemeral range
        return _kernel_port(address)
    now = time.time()
    _sweep(now)
    draw = random.SystemRandom()                # not the seeded global generator a job may set
    for _ in range(DRAWS):
        port = draw.randint(PORT_FLOOR, high)
        try:
            reserved = _reserve(port, now)
        except OSError:                         # no writable temp dir: the bind check alone
            reserved = True
        if reserved and _bindable(address, port):
            return port
    return _kernel_port(address)
