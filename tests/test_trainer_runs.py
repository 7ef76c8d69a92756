"""Real training runs on the CPU: `accelerate launch` with 2 gloo processes, DeepSpeed ZeRO-2,
an injected OOM that falls back and resumes, a killed rank that is retried and resumes, a
deadline, a user entry point, and bad input refused before any process starts."""
from __future__ import annotations

import json
import os
import shutil
import signal
import textwrap
from pathlib import Path

import psutil
import pytest

from estimator.errors import FrenzyInputError
from estimator.job import DataSpec, TrainingJob
from estimator.plan import Plan
from trainer.fallback import reestimate
from trainer.runner import run_training


class Devices:
    """A tiny allocator standing in for the ledger: records every acquire and release."""

    def __init__(self, count: int = 2, give: int | None = None):
        self.count, self.give = count, give
        self.acquired: list[Plan] = []
        self.released = 0

    def acquire(self, plan: Plan) -> list[str]:
        self.acquired.append(plan)
        n = plan.gpus if self.give is None else self.give
        return [f"cpu{i}" for i in range(min(n, self.count))]

    def release(self) -> None:
        self.released += 1


def job(**kw) -> TrainingJob:
    base = dict(model="gpt2-tiny", seq_len=64, global_batch=8, train_steps=6, lr=3e-3, checkpoint_every=2)
    base.update(kw)
    return TrainingJob(**base)


def cpu_plan(j: TrainingJob, gpus: int = 1, **kw) -> Plan:
    per_rank = j.global_batch // gpus
    p = Plan(gpu_type="CPU", gpus=gpus, dp=gpus, micro_batch=min(4, per_rank), grad_accum=per_rank // min(4, per_rank), **kw)
    return reestimate(j, p, safety_margin_gib=0.0) or p


def train(j, plan, tmp_path, devices=None, **kw):
    devices = devices or Devices()
    lines: list[str] = []
    steps: list[tuple[int, int, float]] = []
    attempts = []
    res = run_training(j, plan, run_dir=tmp_path / "run", acquire=devices.acquire, release=devices.release,
                       log=lines.append, on_step=lambda s, t, l: steps.append((s, t, l)),
                       on_attempt=attempts.append, backoff_s=0.1, grace_s=5, **kw)
    return res, devices, lines, steps, attempts


def training_processes(of: psutil.Process | None = None, ranks_only: bool = False) -> list[psutil.Process]:
    """The live ``trainer.train`` processes below ``of`` (this process): a child that has exited
    and is not reaped yet (a zombie, whose command line cannot be read) is not training."""
    found = []
    for p in (of or psutil.Process()).children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:                                # gone or a zombie
            continue
        if "trainer.train" in cmd and not (ranks_only and "accelerate" in cmd):
            found.append(p)
    return found


def no_training_processes_left():
    return training_processes() == []


@pytest.mark.slow
def test_two_process_accelerate_trains_tiny_gpt2_with_falling_loss(tmp_path):
    j = job(train_steps=8)
    plan = cpu_plan(j, gpus=2)
    res, dev, lines, steps, attempts = train(j, plan, tmp_path)
    assert res.status == "completed", res.error
    assert len(res.losses) == 8 and [s for s, _, _ in steps] == list(range(1, 9))
    assert sum(res.losses[-2:]) / 2 < res.losses[0] - 0.1          # it learns
    assert [a.outcome for a in res.attempts] == ["ok"] and attempts == res.attempts
    assert dev.acquired == [plan] and dev.released == 1
    assert res.measured.memory_measured is False and res.measured.allocated_peak_gib is None
    assert res.measured.step_time_s > 0 and res.measured.tokens_per_s > 0
    assert len(res.measured.per_rank) == 2                          # both ranks reported
    assert res.checkpoint_dir.endswith("step-00000008")
    assert any("frenzy: rank 0/2" in l for l in lines)
    assert (tmp_path / "run" / "accelerate.yaml").read_text().count("num_processes: 2") == 1
    assert no_training_processes_left()


@pytest.mark.slow
def test_deepspeed_zero2_on_cpu_resuming_a_plain_checkpoint(tmp_path, monkeypatch):
    """ZeRO-2 through DeepSpeed (first run builds its shm comm op, ~30 s-2 min, cached in
    TORCH_EXTENSIONS_DIR), continuing a run that a plain plan started: the checkpoint format
    differs, so the weights are carried over (optimizer restarts) and the step count goes on.
    A lock a process killed while loading the op left in the extension folder (on which every
    load would wait forever) is removed by the launch before its ranks start."""
    from trainer.launcher import launch_env
    from trainer.op_builds import CPU_OP_NAMES, SHM_COMM

    short = job(train_steps=2)
    first, *_ = train(short, cpu_plan(short, gpus=1), tmp_path)
    assert first.status == "completed" and first.checkpoint_dir.endswith("step-00000002")
    j = job(train_steps=4)
    plan = cpu_plan(j, gpus=2).model_copy(update={"zero": 2})
    # the lock goes into a private copy of the machine's extension folder: in the shared one, a
    # launch of another test process (pytest-xdist) could sweep it first
    shared = Path(launch_env([], cpu=True, deepspeed=True)["TORCH_EXTENSIONS_DIR"]) / CPU_OP_NAMES[SHM_COMM]
    own = tmp_path / "torch_extensions"
    if shared.is_dir():
        shutil.copytree(shared, own / shared.name)          # the built op (torch loads it, no rebuild)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(own))
    lock = own / CPU_OP_NAMES[SHM_COMM] / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    try:
        res, dev, lines, steps, _ = train(j, plan, tmp_path, deadline_s=240)   # waiting on it: never ends
    finally:
        lock.unlink(missing_ok=True)
    assert res.status == "completed", "\n".join(lines[-30:])
    assert any(f"removed a stale build lock {lock}" in l for l in lines)
    assert res.attempts[0].resumed_from_step == 2
    assert any(l.startswith("FRENZY_RESUME") and '"mode": "weights"' in l for l in lines)
    assert [s for s, _, _ in steps] == [3, 4]
    assert res.losses[-1] < first.losses[0]                          # continued from trained weights
    ck = tmp_path / "run" / "checkpoints" / "step-00000004"
    assert (ck / "pytorch_model").is_dir()                           # DeepSpeed's sharded state
    assert len(list((ck / "pytorch_model").glob("*zero_pp_rank_*optim_states.pt"))) == 2
    assert json.loads((ck / "frenzy_ckpt.json").read_text())["format"]["zero"] == 2
    assert json.loads((tmp_path / "run" / "deepspeed.json").read_text())["zero_optimization"]["stage"] == 2


@pytest.mark.slow
def test_a_crash_after_the_result_does_not_fail_a_finished_training(tmp_path, monkeypatch):
    monkeypatch.setenv("FRENZY_INJECT_ABORT_AT_EXIT", "1")
    j = job(train_steps=2)
    res, dev, lines, steps, attempts = train(j, cpu_plan(j, gpus=1), tmp_path, inventory={"CPU": 1})
    assert res.status == "completed", res.error
    assert [a.outcome for a in res.attempts] == ["ok"]              # not retried
    assert any("finished training but its processes exited with" in l for l in lines)
    assert dev.released == 1


@pytest.mark.slow
def test_injected_oom_falls_back_and_resumes_with_the_same_global_batch(tmp_path, monkeypatch):
    monkeypatch.setenv("FRENZY_INJECT_OOM_AT_STEP", "3")
    j = job(train_steps=5)
    plan = cpu_plan(j, gpus=1)
    res, dev, lines, steps, attempts = train(j, plan, tmp_path, inventory={"CPU": 1})
    assert res.status == "completed", res.error
    assert [a.outcome for a in res.attempts] == ["oom", "ok"]
    first, second = res.attempts
    assert first.plan == plan and first.resumed_from_step == 0 and "OutOfMemoryError" in first.error
    assert second.resumed_from_step == 2                             # checkpoint_every=2: lost 0 finished steps
    fb = second.plan
    assert fb != plan and fb.act_ckpt != "none" and fb.global_batch == plan.global_batch == j.global_batch
    assert res.final_plan == fb
    assert dev.acquired == [plan, fb] and dev.released == 2
    assert any(l.startswith("FRENZY_RESUME") and '"mode": "full"' in l for l in lines)
    assert [s for s, _, _ in steps] == [1, 2, 3, 4, 5]               # step 3 ran only on the fallback
    assert len(res.losses) == 5
    assert json.loads((tmp_path / "run" / "attempts.json").read_text())[0]["outcome"] == "oom"


@pytest.mark.slow
def test_killed_rank_is_retried_and_resumes_from_checkpoint(tmp_path):
    # Step reports reach ``on_step`` through a thread of their own, after the step: on a loaded
    # machine the report of step 3 came after a run of 8 tiny steps had ended (nothing left to
    # kill). 40 steps leave the kill seconds of room; it still lands mid-run.
    j = job(train_steps=40)
    plan = cpu_plan(j, gpus=2)
    killed = []

    def kill_a_rank(step, total, loss):
        if step == 3 and not killed:
            ranks = training_processes(ranks_only=True)
            assert ranks, "no training process found"
            os.kill(ranks[-1].pid, signal.SIGKILL)
            killed.append(ranks[-1].pid)

    dev = Devices()
    res = run_training(j, plan, run_dir=tmp_path / "run", acquire=dev.acquire, release=dev.release,
                       log=lambda l: None, on_step=kill_a_rank, backoff_s=0.1, grace_s=5)
    assert killed
    assert res.status == "completed", res.error
    assert [a.outcome for a in res.attempts] == ["failed", "ok"], [(a.outcome, a.error) for a in res.attempts]
    assert res.attempts[1].plan == plan                              # transient: same plan
    resumed = res.attempts[1].resumed_from_step
    assert resumed >= 2 and resumed % 2 == 0 and resumed < 40          # a checkpoint, not the end
    assert len(res.losses) == 40 and dev.released == 2
    assert no_training_processes_left()


@pytest.mark.slow
def test_a_stop_after_a_retry_reports_only_the_steps_the_run_kept(tmp_path):
    """Attempt 1 logs past its last checkpoint and dies; attempt 2 resumes from that checkpoint
    and is stopped (a re-size, a preemption) before it gets as far: the result held the dead
    attempt's later steps, so a merged curve repeated them and the tracker reported a step the
    run never kept."""
    from trainer import control

    j = job(train_steps=60, checkpoint_every=50)      # no checkpoint before the kill: resumes at 0
    plan = cpu_plan(j, gpus=2)
    run_dir = tmp_path / "run"
    killed = []

    def kill_then_stop(step, total, loss):
        if step >= 4 and not killed:
            ranks = training_processes(ranks_only=True)
            assert ranks, "no training process found"
            os.kill(ranks[-1].pid, signal.SIGKILL)
            killed.append(step)
            # the retry finds the stop at its first step boundary
            control.request_stop(run_dir, reason="resize")

    dev = Devices()
    res = run_training(j, plan, run_dir=run_dir, acquire=dev.acquire, release=dev.release,
                       log=lambda l: None, on_step=kill_then_stop, backoff_s=0.1, grace_s=5)
    assert killed and res.status == "stopped", (res.status, res.error, [a.outcome for a in res.attempts])
    kept = res.stop.step
    assert kept < killed[0] and res.attempts[-1].resumed_from_step == 0
    assert len(res.losses) == kept          # steps 1..kept, none of the dead attempt's beyond it
    assert no_training_processes_left()


@pytest.mark.slow
def test_deadline_stops_the_run_and_leaves_nothing(tmp_path):
    j = job(train_steps=100000, checkpoint_every=100000)
    # 1 s: the deadline passes before the program has even imported torch, so it cannot act on
    # the deadline's stop request (with 6 s a quick start did, and the run ended "stopped": the
    # case test_deadline_stops_with_checkpoint_and_export_then_resubmission_resumes covers)
    res, dev, *_ = train(j, cpu_plan(j, gpus=1), tmp_path, deadline_s=1)
    assert res.status == "timeout" and [a.outcome for a in res.attempts] == ["timeout"]
    assert dev.released == 1 and no_training_processes_left()


@pytest.mark.slow
def test_user_entry_point_model(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        import torch

        class Bigram(torch.nn.Module):
            def __init__(self, vocab):
                super().__init__()
                self.table = torch.nn.Embedding(vocab, vocab)

            def forward(self, input_ids=None, labels=None):
                logits = self.table(input_ids)
                return torch.nn.functional.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))

        def build(cfg):
            return Bigram(cfg["vocab_size"])
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FRENZY_ENTRY_POINT_MODULES", "mymodels")      # the site allows the module
    j = job(train_steps=4, entry_point="mymodels:build", lr=0.1)
    res, *_ = train(j, cpu_plan(j, gpus=1), tmp_path)
    assert res.status == "completed", res.error
    assert res.losses[-1] < res.losses[0]


@pytest.mark.slow
def test_a_deterministic_error_in_the_program_is_not_retried(tmp_path, monkeypatch):
    (tmp_path / "brokenmodels.py").write_text(textwrap.dedent("""
        import torch

        class Broken(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = torch.nn.Linear(2, 2)

            def forward(self, input_ids=None, labels=None):
                raise ValueError("shapes do not line up in the user's model")

        def build(cfg):
            return Broken()
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("FRENZY_ENTRY_POINT_MODULES", "brokenmodels")
    j = job(train_steps=3, entry_point="brokenmodels:build")
    res, dev, *_ = train(j, cpu_plan(j, gpus=1), tmp_path)
    assert res.status == "failed"
    assert [a.outcome for a in res.attempts] == ["failed"]            # no retry of a user bug
    assert "ValueError" in res.error and "line up" in res.error
    assert dev.released == 1


def test_bad_input_fails_before_any_process(tmp_path):
    dev = Devices()
    missing = job(data=DataSpec(kind="text", path=str(tmp_path / "nope.txt")))
    with pytest.raises(FrenzyInputError) as e:
        run_training(missing, cpu_plan(missing), run_dir=tmp_path / "a", acquire=dev.acquire,
                     release=dev.release, log=print)
    assert e.value.field == "data.path" and "nope.txt" in str(e.value)
    bad_entry = job(entry_point="no_such_module_xyz:build")
    with pytest.raises(FrenzyInputError) as e:
        run_training(bad_entry, cpu_plan(bad_entry), run_dir=tmp_path / "b", acquire=dev.acquire,
                     release=dev.release, log=print)
    assert e.value.field == "entry_point" and "no_such_module_xyz" in str(e.value)
    assert dev.acquired == [] and dev.released == 0                  # nothing was taken
    # more processes than allocated devices: refused, the allocation released, nothing launched
    short = Devices(give=1)
    two = job()
    with pytest.raises(FrenzyInputError) as e:
        run_training(two, cpu_plan(two, gpus=2), run_dir=tmp_path / "c", acquire=short.acquire,
                     release=short.release, log=print)
    assert e.value.field == "plan.gpus" and short.released == 1
    assert not (tmp_path / "c" / "accelerate.yaml").exists()
    long_seq = job(seq_len=1024)
    with pytest.raises(FrenzyInputError, match="seq_len"):
        run_training(long_seq, cpu_plan(long_seq), run_dir=tmp_path / "d", acquire=dev.acquire,
                     release=dev.release, log=print)


@pytest.mark.slow
def test_ranks_stop_when_the_orchestrator_is_killed_hard(tmp_path):
    """SIGKILL to the orchestrating process (no finally runs): the ranks notice and exit."""
    import subprocess
    import sys

    script = tmp_path / "orchestrate.py"
    script.write_text(textwrap.dedent(f"""
        from estimator.job import TrainingJob
        from estimator.plan import Plan
        from trainer.runner import run_training
        job = TrainingJob(model="gpt2-tiny", seq_len=64, global_batch=8, train_steps=100000, checkpoint_every=100000)
        plan = Plan(gpu_type="CPU", gpus=2, dp=2, micro_batch=4, grad_accum=1)
        run_training(job, plan, run_dir={str(tmp_path / "run")!r}, acquire=lambda p: ["cpu0", "cpu1"],
                     release=lambda: None, log=lambda l: print(l, flush=True))
        """))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    orch = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    ranks = []
    try:
        for line in orch.stdout:                            # wait until training really runs
            if line.startswith("FRENZY_STEP"):
                ranks = training_processes(psutil.Process(orch.pid), ranks_only=True)
                break
        assert len(ranks) == 2
        orch.kill()
        orch.wait()
        gone, alive = psutil.wait_procs(ranks, timeout=20)
        assert alive == []
    finally:
        # orch's own object while it runs: once reaped, its pid may be another process's
        for p in ([psutil.Process(orch.pid)] if orch.poll() is None else []) + ranks:
            try:
                for c in p.children(recursive=True) + [p]:
                    c.kill()
            except psutil.NoSuchProcess:
                pass
        orch.wait()


def test_orchestrator_watch_exits_a_silent_rank_when_its_launcher_dies():
    """The rank-side watch on its own: a silent process (no pipe to break) stops within seconds."""
    import subprocess
    import sys
    import time

    proxy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    child = subprocess.Popen([sys.executable, "-c", "import time; from trainer.train import watch_orchestrator; "
                              "watch_orchestrator(poll_s=0.2); time.sleep(60)"],
                             env={**os.environ, "FRENZY_PARENT_PID": str(proxy.pid), "PYTHONPATH": os.getcwd()},
                             stderr=subprocess.PIPE, text=True)
    try:
        time.sleep(1.5)
        assert child.poll() is None                         # parent alive: keeps running
        proxy.kill()
        proxy.wait()
        assert child.wait(timeout=10) == 4
        assert "orchestrator" in child.stderr.read()
    finally:
        for p in (proxy, child):
            if p.poll() is None:
                p.kill()
