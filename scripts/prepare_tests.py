"""Build once, before the test suite, what its tests would otherwise build the first time they run
on a machine (`make test` runs this; idempotent, seconds when everything is there):

- DeepSpeed's JIT ops of a CPU run (CPU Adam for ZeRO-Offload, the shared-memory collectives every
  DeepSpeed CPU process loads) into the extension folder the trainer's launches use, through the
  launcher's own build (``trainer.op_builds``): compiling them took ~2 min of the first offload
  test on 2 cores;
- the Airflow environment of tests/test_airflow_dag.py (58 s cold): skipped here, as there, when
  it cannot be built or with FRENZY_AIRFLOW_TEST=0.

A failure is reported and left to the tests (they build on first use, or skip with the reason).
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build_deepspeed_ops() -> None:
    from trainer.launcher import launch_env
    from trainer.op_builds import CPU_ADAM, SHM_COMM, build_ops, clear_stale_build_locks

    # the environment of a CPU DeepSpeed launch (its TORCH_EXTENSIONS_DIR and accelerator) and
    # the launcher's own steps (trainer.op_builds), the ops loaded even when they are there:
    # torch rebuilds one whose sources or flags changed (another checkout's environment, a new
    # DeepSpeed), which a launch's check for the files misses
    env = launch_env(["0"], cpu=True, deepspeed=True)
    for lock in clear_stale_build_locks(env["TORCH_EXTENSIONS_DIR"]):
        print(f"prepare_tests: removed a stale build lock {lock} (a killed process left it)")
    t0 = time.monotonic()
    err = build_ops(env, (SHM_COMM, CPU_ADAM))
    print(f"prepare_tests: DeepSpeed ops not built: {err}" if err else
          f"prepare_tests: DeepSpeed CPU ops ready in {env['TORCH_EXTENSIONS_DIR']} ({time.monotonic() - t0:.0f} s)")


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
