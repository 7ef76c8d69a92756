"""Build once, before the test suite, what its tests would otherwise build the first time they run
on a machine (`make test` runs this; idempotent, seconds when everything is there):

- DeepSpeed's JIT ops of a CPU run (CPU Adam for ZeRO-Offload, the shared-memory collectives every
  DeepSpeed CPU process loads) into the extension folder the trainer's launches use: compiling them
  took ~2 min of the first offload test on 2 cores;
- the Airflow environment of tests/test_airflow_dag.py (58 s cold): skipped here, as there, when
  it cannot be built or with FRENZY_AIRFLOW_TEST=0.

A failure is reported and left to the tests (they build on first use, or skip with the reason).
"""
from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DEEPSPEED_CPU_OPS = ("CPUAdamBuilder", "ShareMemCommBuilder")
# torch's extension build (cpp_extension's FileBaton) waits, with no timeout, for a "lock" file a
# build leaves behind when it is killed (an interrupted test run): one older than any build here
# (~2 min on 2 cores) is that, and is removed so the next run builds instead of hanging
STALE_BUILD_LOCK_S = 30 * 60
# this step's own mark in the extension folder: flock-ed while it builds (the kernel releases it when
# the step and its build process are gone) and reading "building" until the build ends, so a mark
# still reading "building" once the flock is ours says the last build was killed: its locks are stale
# whatever their age (a `make test` killed while building otherwise made the next one wait on the
# fresh lock with no end: torch's FileBaton has no timeout)
BUILD_MARK = ".frenzy-prepare-build"


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


@contextmanager
def build_guard(ext_dir: str):
    """Hold this step's build mark (waiting for a concurrent prepare step) and yield (the mark's
    file descriptor, whether the last build through it was killed). The mark is cleared only when
    the body ends normally: an interrupt (Ctrl-C reaches the build process too) leaves it set."""
    path = Path(ext_dir) / BUILD_MARK
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"prepare_tests: another prepare step (or its build) holds {path}: waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        killed = f.read() == "building"
        f.seek(0)
        f.truncate()
        f.write("building")
        f.flush()
        yield f.fileno(), killed
        f.seek(0)
        f.truncate()
        f.flush()


def build_deepspeed_ops() -> None:
    from trainer.launcher import launch_env

    # the environment of a CPU DeepSpeed launch: its TORCH_EXTENSIONS_DIR and accelerator
    env = launch_env(["0"], cpu=True, deepspeed=True)
    ext_dir = env["TORCH_EXTENSIONS_DIR"]
    code = ("from deepspeed.accelerator import get_accelerator as g\n"
            f"for name in {DEEPSPEED_CPU_OPS!r}: g().create_op_builder(name).load()\n")
    t0 = time.monotonic()
    with build_guard(ext_dir) as (mark_fd, killed):
        for lock in clear_stale_build_locks(ext_dir, all_stale=killed):
            print(f"prepare_tests: removed a stale build lock {lock} (a killed build left it)")
        for lock in Path(ext_dir).glob("*/lock"):
            print(f"prepare_tests: another process is building {lock.parent.name} ({lock}; removed "
                  f"once older than {STALE_BUILD_LOCK_S // 60} min): waiting for it")
        # the build process holds the mark too, so a build outliving this step keeps it taken
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                             pass_fds=(mark_fd,))
    if out.returncode != 0:
        print(f"prepare_tests: DeepSpeed ops not built: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
        return
    print(f"prepare_tests: DeepSpeed CPU ops ready in {env['TORCH_EXTENSIONS_DIR']} ({time.monotonic() - t0:.0f} s)")


def build_airflow_env() -> None:
    if os.environ.get("FRENZY_AIRFLOW_TEST") == "0":
        return
    from tests.test_airflow_dag import airflow_venv_path, ensure_airflow_venv

    try:
        path, built_s = ensure_airflow_venv(airflow_venv_path())
    except (RuntimeError, subprocess.TimeoutExpired, OSError) as err:
        print(f"prepare_tests: Airflow environment not built: {err}")
        return
    print(f"prepare_tests: Airflow environment {path} {'built in %.0f s' % built_s if built_s else 'reused'}")


if __name__ == "__main__":
    build_deepspeed_ops()
    build_airflow_env()
