"""The process-group launcher, with real child processes (no torch): streaming, deadline,
killing the whole tree (also descendants in sessions of their own, as torch elastic's ranks)."""
from __future__ import annotations

import os
import sys
import textwrap
import threading
import time

import psutil
import pytest

from trainer.launcher import launch_env, run_process_group


def py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_lines_are_streamed_as_they_come_and_rc_returned():
    seen: list[tuple[float, str]] = []
    t0 = time.monotonic()
    rc, oom, tail = run_process_group(
        py("""
        import time
        print("first", flush=True); time.sleep(1.0); print("second", flush=True)
        raise SystemExit(7)
        """), None, 30, lambda l: seen.append((time.monotonic() - t0, l)))
    assert rc == 7 and oom is False
    assert [l for _, l in seen] == ["first", "second"] and tail == ["first", "second"]
    assert seen[1][0] - seen[0][0] > 0.5            # streamed, not collected at the end


def test_oom_marker_is_detected():
    rc, oom, tail = run_process_group(
        py("import sys; print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB'); sys.exit(1)"),
        None, 30)
    assert rc == 1 and oom is True


def test_shell_strings_are_refused():
    with pytest.raises(TypeError):
        run_process_group("echo hi", None, 5)


def _spawn_tree_code(pidfile: str) -> str:
    # A child that starts a grandchild in a session of its own (like torch elastic's ranks),
    # writes both pids and then stays silent.
    return f"""
    import subprocess, sys, time
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open({pidfile!r}, "w").write(f"{{g.pid}}")
    time.sleep(600)
    """


def test_deadline_kills_a_silent_tree_including_other_sessions(tmp_path):
    pidfile = str(tmp_path / "pids")
    t0 = time.monotonic()
    rc, oom, _ = run_process_group(py(_spawn_tree_code(pidfile)), None, 2.0, grace_s=2)
    took = time.monotonic() - t0
    assert rc is None and oom is False
    assert took < 15
    grandchild = int(open(pidfile).read())
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_exception_in_caller_kills_tree(tmp_path):
    """A KeyboardInterrupt (Prefect cancellation) reaching the waiting thread kills everything."""
    pidfile = str(tmp_path / "pids")
    import _thread
    import signal

    # interrupt_main() only raises KeyboardInterrupt under Python's own SIGINT handler; a
    # library imported earlier in the session (Prefect's engine, uvicorn) may have replaced it
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupt_soon():
        for _ in range(100):
            if os.path.exists(pidfile) and open(pidfile).read():
                break
            time.sleep(0.1)
        _thread.interrupt_main()

    threading.Thread(target=interrupt_soon, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_process_group(py(_spawn_tree_code(pidfile)), None, 60, grace_s=2)
    finally:
        signal.signal(signal.SIGINT, previous)
    grandchild = int(open(pidfile).read())
    time.sleep(0.2)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_launch_env_sets_devices_attempt_and_cpu_mode():
    env = launch_env(["2", "3"], cpu=False, attempt=2, base={"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["FRENZY_ATTEMPT"] == "2"
    assert "ACCELERATE_USE_CPU" not in env and env["HF_HUB_OFFLINE"] == "1"
    cpu = launch_env(["cpu0", "cpu1"], cpu=True, base={})
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu["ACCELERATE_USE_CPU"] == "true"
    ds = launch_env(["cpu0"], cpu=True, deepspeed=True, base={})
    assert ds["DS_ACCELERATOR"] == "cpu" and "ACCELERATE_USE_CPU" not in ds
    assert "torch_extensions" in ds["TORCH_EXTENSIONS_DIR"]


def test_stale_extension_build_locks_are_removed_by_age(tmp_path):
    """A killed DeepSpeed op build leaves torch's lock file, on which every later build waits
    forever; a lock no build mark explains is removed once older than any build, not before."""
    import os

    from trainer import op_builds

    old, new = tmp_path / "cpu_adam" / "lock", tmp_path / "shm" / "lock"
    for p in (old, new):
        p.parent.mkdir()
        p.touch()
    now = time.time()
    os.utime(old, (now - op_builds.STALE_BUILD_LOCK_S - 60, now - op_builds.STALE_BUILD_LOCK_S - 60))
    assert op_builds.clear_stale_build_locks(str(tmp_path), now) == [old]
    assert not old.exists() and new.exists()


def test_a_killed_build_is_known_by_its_mark_and_a_live_one_by_its_flock(tmp_path):
    """A run (or `make test`) killed while DeepSpeed's ops compile leaves torch's lock file,
    fresh: the next build sees the mark still set and removes the lock at once instead of
    hanging on it; a build process outliving its caller keeps the mark taken, so nothing removes
    the lock of a live build."""
    import fcntl
    import subprocess

    from trainer import op_builds

    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    with op_builds.build_guard(str(tmp_path)) as mark:
        assert not mark.killed                              # no build through the mark before
        mark.done()
    assert op_builds.clear_stale_build_locks(str(tmp_path)) == [] and lock.exists()   # fresh: kept
    with pytest.raises(KeyboardInterrupt):
        with op_builds.build_guard(str(tmp_path)):
            raise KeyboardInterrupt                         # a stop during the build
    with op_builds.build_guard(str(tmp_path)) as mark:
        assert mark.killed
        assert op_builds.clear_stale_build_locks(str(tmp_path), all_stale=mark.killed) == [lock]
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(mark.fd,))
        mark.done()
    try:
        with open(tmp_path / op_builds.BUILD_MARK) as f:
            with pytest.raises(BlockingIOError):            # the caller is done, its build is not
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        child.kill()
        child.wait()
    with op_builds.build_guard(str(tmp_path)) as mark:
        assert not mark.killed                              # the last build ended normally
    with op_builds.build_guard(str(tmp_path)) as mark:
        assert mark.killed                                  # ... and this one did not say so


def test_a_launch_builds_only_the_ops_its_machine_lacks(tmp_path):
    """``ensure_cpu_ops`` compiles nothing when the ops are there (no DeepSpeed import, no child),
    asks CPU Adam only of offload plans, and a failed build is reported in one line, not raised."""
    from trainer import op_builds

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    for b in (op_builds.SHM_COMM, op_builds.CPU_ADAM):
        name = op_builds.CPU_OP_NAMES[b]
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").touch()
    said: list[str] = []
    assert op_builds.ensure_cpu_ops(env, offload=True, log=said.append) is None and said == []
    (tmp_path / "cpu_adam" / "cpu_adam.so").unlink()
    assert op_builds.ensure_cpu_ops(env, offload=False, log=said.append) is None and said == []
    assert op_builds.missing_ops(str(tmp_path), (op_builds.SHM_COMM, op_builds.CPU_ADAM)) == (op_builds.CPU_ADAM,)
    # a build that cannot run (no such accelerator): its error line comes back, nothing raised
    err = op_builds.ensure_cpu_ops({**env, "DS_ACCELERATOR": "no-such-accelerator"}, offload=True,
                                   log=said.append)
    assert err and "compiling DeepSpeed's CPU ops once" in said[0] and "not built" in said[-1]
    assert (tmp_path / op_builds.BUILD_MARK).read_text() == ""     # it returned: not a killed build


def test_a_gpu_launch_reports_expandable_segments_and_a_users_own_setting_wins(monkeypatch):
    """The trainer reports the allocator mode it ran (``measured["allocator"]``, which
    ``frenzy calibrate`` fits apart): expandable for the launcher's GPU ranks, the user's own
    ``PYTORCH_CUDA_ALLOC_CONF`` or the newer ``PYTORCH_ALLOC_CONF`` where set."""
    from trainer.launcher import launch_env
    from trainer.train import allocator_mode

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert allocator_mode() == "default"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", launch_env(["0"], cpu=False)["PYTORCH_CUDA_ALLOC_CONF"])
    assert allocator_mode() == "expandable"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert allocator_mode() == "default"
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments: True")
    assert allocator_mode() == "expandable"


def test_kill_all_stops_a_process_the_run_waits_on():
    """An op build the run waits on (``trainer.op_builds``) is stopped with the launches when
    the orchestrating process has to stop, and is forgotten once the wait ends."""
    import subprocess

    from trainer import launcher

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        with launcher.stopped_with_launches(child):
            assert child in launcher.live_launches()
            assert launcher.kill_all(grace_s=1.0) == 1
            child.wait(timeout=10)                              # stopped (psutil reaped it)
        assert child not in launcher.live_launches()
    finally:
        child.kill()
        child.wait()
