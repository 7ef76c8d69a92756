"""DeepSpeed's JIT ops: stale build locks removed, and the CPU ops compiled once per machine,
before the ranks that load them start.

DeepSpeed compiles its ops on first use (the CPU ones about 1-2 min on 2 cores: the shared-memory
collectives every DeepSpeed CPU process loads, CPU Adam for ZeRO-Offload). torch guards each op's
build folder with a bare ``lock`` file (``torch.utils.file_baton.FileBaton``) that its holder keeps
open until it removes it, and *every* load of the op, built or not, takes it or waits for it with
no timeout and no message. A process killed while holding it (a cancelled run's first build, a
rank stopped while it loads the op, a killed ``make test``) leaves the file, and every later
DeepSpeed run on the machine then hangs before its first step.

So before a DeepSpeed launch the launcher removes the locks no live process holds open
(``clear_stale_build_locks``; looked at twice, a second apart, since a holder releasing closes its
file just before it removes it), whoever left them, and on the CPU compiles the ops the machine
lacks in one child process (``ensure_ops``): the run log says so instead of the ranks going
silent for minutes. The holder check sees this machine's processes only, so the launcher's
extension folder is per machine (``trainer.launcher.extensions_dir``: the host name is in its
default path, a shared home directory does not share it; and per Python environment).
``scripts/prepare_tests.py`` builds through ``build_ops`` before the test suite.

No torch here: the build runs in a child process with the launch's environment.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil

from . import launcher

# a holder releasing the lock closes its file and then removes it: a lock still there, unheld,
# this long after it was first seen unheld is a dead holder's
RELEASE_SETTLE_S = 1.0
# DeepSpeed's op builder -> the extension (folder and .so) it compiles
SHM_COMM, CPU_ADAM = "ShareMemCommBuilder", "CPUAdamBuilder"
CPU_OP_NAMES = {SHM_COMM: "deepspeed_shm_comm", CPU_ADAM: "cpu_adam"}


def _held(locks: list[Path]) -> set[Path]:
    """The ``locks`` a live process of this user has open (torch's FileBaton keeps its file
    open while it holds it)."""
    want = {os.path.realpath(p): p for p in locks}
    held: set[Path] = set()
    uid = os.getuid()
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"] is not None and proc.info["uids"].real == uid:
                held.update(want[f.path] for f in proc.open_files() if f.path in want)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return held


def clear_stale_build_locks(ext_dir: str, settle_s: float = RELEASE_SETTLE_S) -> list[Path]:
    """Remove the extension folder's build locks that no live process holds (seen unheld twice,
    ``settle_s`` apart); returns them."""
    locks = sorted(Path(ext_dir).glob("*/lock"))
    held = _held(locks) if locks else set()
    unheld = [p for p in locks if p not in held]
    if not unheld:
        return []
    time.sleep(settle_s)
    gone = []
    for lock in set(unheld) - _held(unheld):
        try:
            lock.unlink()
            gone.append(lock)
        except FileNotFoundError:       # released meanwhile
            pass
    return sorted(gone)


def missing_ops(ext_dir: str, builders: tuple[str, ...]) -> tuple[str, ...]:
    """The builders among ``builders`` whose compiled op is not in ``ext_dir`` yet."""
    return tuple(b for b in builders if not (Path(ext_dir) / CPU_OP_NAMES[b] / f"{CPU_OP_NAMES[b]}.so").is_file())


def build_ops(env: Mapping[str, str], builders: tuple[str, ...]) -> str | None:
    """Load ``builders``' ops in one child process with the launch environment ``env`` (its
    ``TORCH_EXTENSIONS_DIR`` and ``DS_ACCELERATOR``): torch compiles those missing or whose
    sources or flags changed. Returns None when all are built, else the build's last error line
    or "the build was stopped" (the ranks then try, and report). An exception here (a stop)
    kills the build's whole tree (ninja runs each compiler in a process group of its own), and
    ``launcher.kill_all`` stops it with the launches; the lock it leaves is a dead holder's."""
    code = ("from deepspeed.accelerator import get_accelerator as g\n"
            f"for name in {builders!r}: g().create_op_builder(name).load()\n")
    child = subprocess.Popen([sys.executable, "-c", code], env=dict(env), stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        with launcher.stopped_with_launches(child):
            _, err = child.communicate()
    except BaseException:
        launcher.kill_tree(child, grace_s=0.0)
        raise
    # what was built is read from the folder, not the exit status: a build stopped by
    # launcher.kill_all is reaped by psutil there, and Popen then reads exit status 0
    if not missing_ops(env["TORCH_EXTENSIONS_DIR"], builders):
        return None
    if child.returncode > 0:
        return (err.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
    return "the build was stopped"


def ensure_ops(env: Mapping[str, str], *, cpu: bool, offload: bool,
               log: Callable[[str], None] = print) -> str | None:
    """Before a DeepSpeed launch: remove the stale build locks its ranks would wait on, and on
    the CPU (``cpu``) compile the ops its ranks load that this machine lacks (the shared-memory
    collectives; CPU Adam with ``offload``). None when nothing is missing, else ``build_ops``'s
    error."""
    ext_dir = env["TORCH_EXTENSIONS_DIR"]
    for lock in clear_stale_build_locks(ext_dir):
        log(f"frenzy: removed a stale build lock {lock} (a process killed while building or loading the op left it)")
    need = missing_ops(ext_dir, (SHM_COMM, CPU_ADAM) if offload else (SHM_COMM,)) if cpu else ()
    if not need:
        return None
    log(f"frenzy: compiling DeepSpeed's CPU ops once on this machine ({', '.join(CPU_OP_NAMES[b] for b in need)}; "
        f"~1-2 min)")
    t0 = time.monotonic()
    for lock in Path(ext_dir).glob("*/lock"):
        log(f"frenzy: another process is building or loading {lock.parent.name} ({lock}): waiting for it")
    err = build_ops(env, need)
    log(f"frenzy: DeepSpeed's CPU ops not built ({err}); the ranks try themselves" if err else
        f"frenzy: DeepSpeed's CPU ops built in {time.monotonic() - t0:.0f} s")
    return err
