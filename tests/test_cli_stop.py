"""SIGINT/SIGTERM to a real `frenzy run`: it stops the training at a step boundary with a
checkpoint, releases the GPUs, stops the embedded Prefect server and exits 130/143 with a
one-line reason, within 30 s, leaving no process behind."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]

# long enough that the signal always lands mid-training (the tiny model steps in ~0.1 s on a CPU)
LONG_JOB = """name: stop-me
model: gpt2-tiny
seq_len: 64
global_batch: 8
train_steps: 100000
precision: fp32
optimizer: adamw
lr: 0.003
checkpoint_every: 20
data:
  kind: synthetic
"""


def marked(marker: str) -> list[psutil.Process]:
    """Every process whose environment carries ``marker`` (all descendants inherit it: the
    embedded server and the ranks, whatever session or group they are in)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("FRENZY_TEST_MARKER") == marker:
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return out


def start(tmp_path: Path, marker: str) -> subprocess.Popen:
    job = tmp_path / "long.yaml"
    job.write_text(LONG_JOB)
    # one CPU device: the scheduler has nothing to grow the run onto, so the signal lands in a
    # training step, not in a re-size's relaunch (that path has its own tests)
    cluster = tmp_path / "one-cpu.yaml"
    cluster.write_text("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 1}\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "FRENZY_"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONPATH=str(ROOT), FRENZY_TEST_MARKER=marker)
    # a session of its own, like a shell job: a group signal reaches what a terminal's Ctrl-C reaches
    return subprocess.Popen([sys.executable, "-m", "frenzy_cli.main", "run", str(job), "--cluster", str(cluster)],
                            cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def wait_for_checkpoint(tmp_path: Path, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"frenzy run exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        if list((tmp_path / ".frenzy" / "runs").glob("**/checkpoints/step-*/frenzy_ckpt.json")):
            return
        time.sleep(0.5)
    raise AssertionError("no checkpoint appeared")


def active_allocations(tmp_path: Path) -> list:
    from ledger import Ledger

    url = f"sqlite:///{tmp_path / '.frenzy' / 'ledger.db'}"
    return Ledger(url).allocations(active_only=True)


@pytest.mark.slow
@pytest.mark.parametrize("sig, code, to_group", [(signal.SIGINT, 130, True), (signal.SIGTERM, 143, False)])
def test_signal_stops_run(tmp_path, sig, code, to_group):
    marker = uuid.uuid4().hex
    proc = start(tmp_path, marker)
    try:
        wait_for_checkpoint(tmp_path, proc)
        assert len(marked(marker)) >= 3          # the CLI, the embedded server, the launcher and ranks
        t0 = time.monotonic()
        if to_group:                             # Ctrl-C at a terminal: the whole foreground group
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, err[-3000:]
    assert took < 30, took
    last = err.strip().splitlines()[-1]
    assert last.startswith("frenzy run: ") and signal.Signals(sig).name in last, err[-2000:]
    # the run stopped at a step boundary with a checkpoint (the run folder's record); the last
    # line says so, or, when the flow's reporting after the stop outlasts the watchdog on a
    # loaded machine, that it exited on the bound
    records = [json.loads(p.read_text()) for p in (tmp_path / ".frenzy" / "runs").glob("*/result.json")]
    assert records and records[0]["status"] == "stopped" and records[0]["stop"]["step"] > 0, records
    assert ("with a checkpoint" in last and "GPUs released" in last) or "exiting" in last, last
    assert "Traceback" not in err, err[-6000:]
    # the embedded server's own output went to its log, not to the run's terminal
    assert "embedded Prefect server started" in (tmp_path / ".frenzy" / "prefect" / "embedded-server.log").read_text()
    time.sleep(1.0)
    left = marked(marker)
    assert not left, [(p.pid, p.cmdline()[:4]) for p in left]
    assert active_allocations(tmp_path) == []
