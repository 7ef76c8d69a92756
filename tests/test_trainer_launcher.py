"""The process-group launcher, with real child processes (no torch): streaming, deadline,
killing the whole tree (also descendants in sessions of their own, as torch elastic's ranks)."""
from __future__ import annotations

import os
import sys
import textwrap
import threading
import time
import types

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


def test_kill_tree_of_a_reaped_child_stops_its_group_and_nothing_found_by_its_old_pid(tmp_path, monkeypatch):
    """The child exited and was reaped: its pid may be another process's by now (pid numbers wrap,
    32768 on many hosts), so no process is looked up by it; its group (its session, which the
    kernel's pid numbering keeps while a member lives) is still stopped."""
    import subprocess
    import sys

    from trainer import launcher

    pidfile = tmp_path / "pid"
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pidfile)!r}, "w").write(str(g.pid))
        """)], start_new_session=True)
    assert child.wait(timeout=30) == 0                      # exits at once, leaves its grandchild
    grandchild = psutil.Process(int(pidfile.read_text()))
    looked_up = []
    monkeypatch.setattr(launcher, "psutil", types.SimpleNamespace(   # psutil, its Process recorded
        Process=lambda pid: looked_up.append(pid) or psutil.Process(pid), NoSuchProcess=psutil.NoSuchProcess,
        AccessDenied=psutil.AccessDenied, wait_procs=psutil.wait_procs))
    launcher.kill_tree(child, grace_s=0.0)
    assert looked_up == []
    grandchild.wait(timeout=10)                             # raises while it still runs
    assert not grandchild.is_running()


def test_launch_env_sets_devices_attempt_and_cpu_mode():
    env = launch_env(["2", "3"], cpu=False, attempt=2, base={"PATH": "/bin"})
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3" and env["FRENZY_ATTEMPT"] == "2"
    assert "ACCELERATE_USE_CPU" not in env and env["HF_HUB_OFFLINE"] == "1"
    cpu = launch_env(["cpu0", "cpu1"], cpu=True, base={})
    assert cpu["CUDA_VISIBLE_DEVICES"] == "" and cpu["ACCELERATE_USE_CPU"] == "true"
    ds = launch_env(["cpu0"], cpu=True, deepspeed=True, base={})
    assert ds["DS_ACCELERATOR"] == "cpu" and "ACCELERATE_USE_CPU" not in ds
    assert "torch_extensions" in ds["TORCH_EXTENSIONS_DIR"]


def test_deepspeed_ops_are_kept_per_machine_and_python_environment(monkeypatch, tmp_path):
    """Two environments (two checkouts' .venv) sharing one folder rebuilt the ops every time the
    other had run: torch's build flags hold the environment's include paths."""
    import socket
    import sys

    from trainer.launcher import extensions_dir

    here = extensions_dir()
    assert here.parent.name == socket.gethostname() and here.parent.parent.name == "torch_extensions"
    assert launch_env([], cpu=True, deepspeed=True, base={})["TORCH_EXTENSIONS_DIR"] == str(here)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))
    other = extensions_dir()
    assert other != here and other.parent == here.parent and other.name.startswith(".venv-")
    assert launch_env([], cpu=True, deepspeed=True, base={"TORCH_EXTENSIONS_DIR": "/x"})["TORCH_EXTENSIONS_DIR"] == "/x"


def test_a_build_lock_is_removed_only_once_its_holder_is_gone(tmp_path):
    """torch's build lock is a bare file its holder keeps open; a process killed while holding
    it (building or loading an op) leaves it, and every later load waits on it forever. A lock
    a live process holds is kept; the same lock once its holder is killed is removed."""
    import subprocess

    from trainer import op_builds

    held, left = tmp_path / "cpu_adam" / "lock", tmp_path / "deepspeed_shm_comm" / "lock"
    for p in (held, left):
        p.parent.mkdir()
    left.touch()                                            # its holder died long ago
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time\n"
                               f"fd = os.open({str(held)!r}, os.O_CREAT | os.O_EXCL)\n"
                               "print('held', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert op_builds.clear_stale_build_locks(str(tmp_path), settle_s=0.05) == [left]
        assert held.exists() and not left.exists()
    finally:
        holder.kill()                                       # killed while holding it
        holder.wait()
    assert op_builds.clear_stale_build_locks(str(tmp_path), settle_s=0.05) == [held]
    assert op_builds.clear_stale_build_locks(str(tmp_path), settle_s=0.05) == []


def test_a_launch_builds_only_the_ops_its_machine_lacks(tmp_path):
    """``ensure_ops`` compiles nothing when the ops are there (no DeepSpeed import, no child)
    but still removes a dead holder's lock beside them, asks CPU Adam only of offload plans,
    builds nothing for a GPU launch, and reports a failed build in one line, not raised."""
    from trainer import op_builds

    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "DS_ACCELERATOR": "cpu"}
    for b in (op_builds.SHM_COMM, op_builds.CPU_ADAM):
        name = op_builds.CPU_OP_NAMES[b]
        (tmp_path / name).mkdir()
        (tmp_path / name / f"{name}.so").touch()
    (tmp_path / "cpu_adam" / "lock").touch()                # a rank killed while it loaded the op
    said: list[str] = []
    assert op_builds.ensure_ops(env, cpu=True, offload=True, log=said.append) is None
    assert not (tmp_path / "cpu_adam" / "lock").exists() and len(said) == 1 and "stale build lock" in said[0]
    (tmp_path / "cpu_adam" / "cpu_adam.so").unlink()
    said.clear()
    assert op_builds.ensure_ops(env, cpu=True, offload=False, log=said.append) is None and said == []
    assert op_builds.ensure_ops(env, cpu=False, offload=True, log=said.append) is None and said == []
    assert op_builds.missing_ops(str(tmp_path), (op_builds.SHM_COMM, op_builds.CPU_ADAM)) == (op_builds.CPU_ADAM,)
    # a build that cannot run (no such accelerator): its error line comes back, nothing raised
    err = op_builds.ensure_ops({**env, "DS_ACCELERATOR": "no-such-accelerator"}, cpu=True, offload=True,
                               log=said.append)
    assert err and "compiling DeepSpeed's CPU ops once" in said[0] and "not built" in said[-1]


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


def test_ranks_of_a_launcher_that_died_on_its_own_are_stopped(tmp_path):
    """The launcher SIGKILLed (the OOM killer, a stray kill) left its ranks running: they lead
    sessions of their own and watch only the runner, so they held the GPUs the retry was given
    and wrote into its run folder."""
    pidfile = str(tmp_path / "pids")
    code = f"""
    import os, signal, subprocess, sys, time
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open({pidfile!r}, "w").write(f"{{g.pid}}")
    time.sleep(2.5)                    # the runner has seen its rank by now (it looks every second)
    os.kill(os.getpid(), signal.SIGKILL)
    """
    rc, _, _ = run_process_group(py(code), None, 60.0, grace_s=2)
    assert rc == -9
    rank = int(open(pidfile).read())
    assert not psutil.pid_exists(rank) or psutil.Process(rank).status() == psutil.STATUS_ZOMBIE
