"""TCP ports a process binds seconds after choosing them: an attempt's rendezvous port (node 0
publishes it, ``accelerate launch`` binds it), a server a test or a benchmark starts.

Why not ``bind(("", 0))`` and close: the kernel hands that port out of its ephemeral range, the
range every other ``bind(0)`` listener (gloo's pair sockets, a test's server, another attempt)
also draws from. Between the choice and the launcher's bind (a DeepSpeed op check, the ledger,
accelerate's start: seconds) another process can get the same port, and the launch dies with
accelerate's "another process is utilizing it" (seen with two test processes on one machine).

So a port is drawn at random from ``PORT_FLOOR`` up to ``PORT_CEILING`` and below the ephemeral
range, where the kernel never assigns ports by itself, checked free by binding it, and reserved
for ``RESERVATION_S`` by a file in a folder of the user's own under the temp dir, all under one
lock on that folder: two Frenzy processes of one user on one host never draw the same port at
once. The reservation is only a hint to other Frenzy processes; the port is the launcher's once
it binds it. Without a usable folder (not writable, not the user's own) the bind check alone
decides; where no room is left below the ephemeral range the kernel chooses.
"""
from __future__ import annotations

import errno
import os
import random
import socket
import stat
import tempfile
import time
from pathlib import Path

try:
    import fcntl
except ImportError:                 # not POSIX: no lock, the exclusive file creation alone
    fcntl = None

LOOPBACK = "127.0.0.1"
# The kernel's ephemeral range (Linux; its default is 32768-60999). Elsewhere the range is not
# read and 32768 is assumed: macOS uses 49152-65535, above it.
EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL_LOW = 32768
# The lowest port drawn: above the well-known services' ports a host commonly runs
# (PostgreSQL 5432, Prefect 4200, MLflow 5000, 8000-8888 web servers, Redis 6379); a port
# something already listens on is skipped by the bind check anyway.
PORT_FLOOR = 20000
# The first port not drawn: Kubernetes' NodePort range starts at 30000, and kube-proxy may
# redirect a node's traffic to such a port without holding a socket on it (the bind check
# would pass while peers dialling node 0 reached a service).
PORT_CEILING = 30000
# A launch binds its port within seconds of choosing it (a cold DeepSpeed op build comes
# before the choice, not after); an attempt that never binds frees its reservation after this.
RESERVATION_S = 600.0
DRAWS = 64          # random draws before falling back to the kernel's choice
LOCK_FILE = ".lock"


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return DEFAULT_EPHEMERAL_LOW


def reservations_dir() -> Path:
    """Per user (the uid in its name; ``_own_folder`` checks it is really ours)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"frenzy-ports-{uid}"


def _own_folder(folder: Path) -> bool:
    """Make ``folder`` if absent; True when it is a real folder (no link) of this user that only
    this user can write: another user's planted folder or link is not used."""
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        st = os.lstat(folder)
    except OSError:
        return False
    mine = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    return stat.S_ISDIR(st.st_mode) and mine and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _sweep(folder: Path, now: float) -> None:
    """Remove reservations older than ``RESERVATION_S`` (under the folder's lock): the folder
    holds only the last minutes' launches."""
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if entry.name == LOCK_FILE:
            continue
        try:
            if now - entry.stat(follow_symlinks=False).st_mtime >= RESERVATION_S:
                os.unlink(entry.path)
        except OSError:
            pass                                # gone already


def _reserve(folder: Path, port: int) -> bool:
    """Create the port's reservation file; False when it exists (another process holds it)."""
    try:
        os.close(os.open(folder / str(port), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
        return True
    except FileExistsError:
        return False


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


def _draw(address: str, high: int, folder: Path | None) -> int | None:
    """Random ports of [PORT_FLOOR, high] until one is bindable (and reserved, with a folder)."""
    draw = random.SystemRandom()                # not the seeded global generator a job may set
    for _ in range(DRAWS):
        port = draw.randint(PORT_FLOOR, high)
        if folder is not None and not _reserve(folder, port):
            continue
        if _bindable(address, port):
            return port
        if folder is not None:                  # in use by something else: not ours to hold
            (folder / str(port)).unlink(missing_ok=True)
    return None


def free_port(address: str = LOOPBACK) -> int:
    """A TCP port free on ``address`` now and reserved against this user's other Frenzy
    processes on this host for ``RESERVATION_S`` (for the rendezvous of one attempt; in a
    multi-node launch node 0 asks on its own address and publishes the answer)."""
    high = min(PORT_CEILING, ephemeral_low()) - 1
    if high <= PORT_FLOOR:                      # no room below the ephemeral range
        return _kernel_port(address)
    folder = reservations_dir()
    if not _own_folder(folder):
        return _draw(address, high, None) or _kernel_port(address)
    try:
        lock = os.open(folder / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        return _draw(address, high, None) or _kernel_port(address)
    try:
        if fcntl is not None:
            fcntl.flock(lock, fcntl.LOCK_EX)    # sweep and draw as one step (milliseconds)
        _sweep(folder, time.time())
        return _draw(address, high, folder) or _kernel_port(address)
    finally:
        os.close(lock)                          # closing releases the lock
