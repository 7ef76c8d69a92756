"""DeepSpeed's CPU ops, compiled once per machine before the ranks that load them start.

A DeepSpeed CPU run loads two ops that DeepSpeed compiles on first use (about 1-2 min on 2
cores): the shared-memory collectives every DeepSpeed CPU process loads, and CPU Adam for
ZeRO-Offload. torch's extension build guards a build folder with a bare ``lock`` file
(``torch.utils.file_baton.FileBaton``) and every later build waits for that file with no timeout
and no message; a build killed by a signal (a cancelled run, a closed terminal, a killed
``make test``) leaves the file, and every later DeepSpeed run on the machine then hangs before
its first step.

So the launcher builds what is missing itself, in one process under this module's own mark
(``BUILD_MARK`` in the extension folder): an ``flock`` held while it builds, which the kernel
releases when the builder and its build process are gone, and a content that reads "building"
until the build returns. A mark still reading "building" once the flock is ours says the last
build was killed: its locks are stale whatever their age. Locks nobody's mark explains (a build
started elsewhere) are removed only once older than any build (``STALE_BUILD_LOCK_S``).
``scripts/prepare_tests.py`` builds through the same function before the test suite.

No torch here: the build runs in a child process with the launch's environment.
"""
from __future__ import annotations

import fcntl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from . import launcher

# one build here takes ~1-2 min on 2 cores: a lock this old that no mark explains is a killed build's
STALE_BUILD_LOCK_S = 30 * 60
BUILD_MARK = ".frenzy-op-build"
# DeepSpeed's op builder -> the extension (folder and .so) it compiles
SHM_COMM, CPU_ADAM = "ShareMemCommBuilder", "CPUAdamBuilder"
CPU_OP_NAMES = {SHM_COMM: "deepspeed_shm_comm", CPU_ADAM: "cpu_adam"}


def clear_stale_build_locks(ext_dir: str, now: float | None = None, *, all_stale: bool = False) -> list[Path]:
    """Remove the extension folder's build locks older than ``STALE_BUILD_LOCK_S`` (every one
    with ``all_stale``); returns them."""
    now = time.time() if now is None else now
    gone = []
    for lock in Path(ext_dir).glob("*/lock"):
        try:
            if all_stale or now - lock.stat().st_mtime > STALE_BUILD_LOCK_S:
                lock.unlink()
                gone.append(lock)
        except OSError:
            pass
    return gone


class Mark:
    """The build mark, held: its file descriptor (a build process given it holds the flock too),
    whether the last build through it was killed, and ``done()``, which says this build was not."""

    __slots__ = ("fd", "killed", "_file")

    def __init__(self, f, killed: bool):
        self.fd, self.killed, self._file = f.fileno(), killed, f

    def done(self) -> None:
        self._file.seek(0)
        self._file.truncate()
        self._file.flush()


@contextmanager
def build_guard(ext_dir: str, log: Callable[[str], None] = print) -> Iterator[Mark]:
    """Hold the build mark (waiting, said aloud, for a build in progress) and yield it, set to
    "building" until ``Mark.done()``: a build the body does not call it for (an interrupt, a
    killed build process) leaves the mark set, so the next holder knows its locks are stale."""
    path = Path(ext_dir) / BUILD_MARK
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"frenzy: another process is building DeepSpeed's ops ({path} is held): waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        killed = f.read() == "building"
        f.seek(0)
        f.truncate()
        f.write("building")
        f.flush()
        yield Mark(f, killed)


def missing_ops(ext_dir: str, builders: tuple[str, ...]) -> tuple[str, ...]:
    """The builders among ``builders`` whose compiled op is not in ``ext_dir`` yet."""
    return tuple(b for b in builders if not (Path(ext_dir) / CPU_OP_NAMES[b] / f"{CPU_OP_NAMES[b]}.so").is_file())


def build_ops(env: Mapping[str, str], builders: tuple[str, ...],
              log: Callable[[str], None] = print, *, load_existing: bool = False) -> str | None:
    """Compile ``builders``' ops in one child process with the launch environment ``env`` (its
    ``TORCH_EXTENSIONS_DIR`` and ``DS_ACCELERATOR``), under the build mark; stale locks go first.
    With ``load_existing`` the ops found built are loaded too, so torch rebuilds those whose
    sources or flags changed (``scripts/prepare_tests.py``; a launch checks for the files only).
    Returns None when built (or found built once the mark is ours), else the build's last error line
    or "the build was stopped" (the ranks then try, and report).
    The build process holds the mark too, so one that outlives its caller keeps it taken; an
    exception here (a stop) kills the build's whole tree (ninja runs each compiler in a process
    group of its own) and, like a build killed by a signal (``launcher.kill_all``), leaves the
    mark set for the next caller."""
    ext_dir = env["TORCH_EXTENSIONS_DIR"]
    code = ("from deepspeed.accelerator import get_accelerator as g\n"
            f"for name in {builders!r}: g().create_op_builder(name).load()\n")
    with build_guard(ext_dir, log) as mark:
        for lock in clear_stale_build_locks(ext_dir, all_stale=mark.killed):
            log(f"frenzy: removed a stale build lock {lock} (a killed build left it)")
        if not load_existing:
            builders = missing_ops(ext_dir, builders)  # built meanwhile by the mark's last holder?
        if not builders:
            mark.done()
            return None
        for lock in Path(ext_dir).glob("*/lock"):
            log(f"frenzy: another process is building {lock.parent.name} ({lock}; removed once older "
                f"than {STALE_BUILD_LOCK_S // 60} min): waiting for it")
        child = subprocess.Popen([sys.executable, "-c", code], env=dict(env), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, pass_fds=(mark.fd,),
                                 start_new_session=True)
        try:
            with launcher.stopped_with_launches(child):
                _, err = child.communicate()
        except BaseException:
            launcher.kill_tree(child, grace_s=0.0)
            raise
        # what was built is read from the folder, not the exit status: a build stopped by
        # launcher.kill_all is reaped by psutil there, and Popen then reads exit status 0
        if not missing_ops(ext_dir, builders):
            mark.done()
            return None
        if child.returncode > 0:        # failed by itself: torch's build released its own lock
            mark.done()
            return (err.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
    return "the build was stopped"      # the mark stays set: its locks are stale for the next caller


def ensure_cpu_ops(env: Mapping[str, str], *, offload: bool, log: Callable[[str], None] = print) -> str | None:
    """Before a DeepSpeed CPU launch: compile the ops its ranks load that this machine lacks
    (the shared-memory collectives; CPU Adam with ``offload``). None when all are there."""
    builders = (SHM_COMM, CPU_ADAM) if offload else (SHM_COMM,)
    need = missing_ops(env["TORCH_EXTENSIONS_DIR"], builders)
    if not need:
        return None
    log(f"frenzy: compiling DeepSpeed's CPU ops once on this machine ({', '.join(CPU_OP_NAMES[b] for b in need)}; "
        f"~1-2 min)")
    t0 = time.monotonic()
    err = build_ops(env, need, log)
    log(f"frenzy: DeepSpeed's CPU ops not built ({err}); the ranks try themselves" if err else
        f"frenzy: DeepSpeed's CPU ops built in {time.monotonic() - t0:.0f} s")
    return err
