"""Fencing: a run whose GPU lease is lost stops at its next step boundary with a checkpoint,
and its result says so (``failed``, the reason), instead of training on on GPUs the ledger
may have given to another job.

A real (tiny) training on one CPU rank; the lease is taken away the way the reaper does it
(its expiry moved into the past by the database's clock, then ``expire_leases``), from a second
ledger handle, as another process would."""
from __future__ import annotations

import threading
import time

import pytest
from sqlmodel import update

pytestmark = [pytest.mark.slow]

JOB = {"name": "fenced", "model": "gpt2-tiny", "seq_len": 32, "global_batch": 4, "train_steps": 400,
       "precision": "fp32", "checkpoint_every": 1000}


def test_a_run_whose_lease_is_reaped_stops_at_a_step_with_a_checkpoint(tmp_path, frenzy_home):
    from estimator.job import TrainingJob
    from estimator.plans import plans_for_job
    from frenzy_flows.results import Assignment
    from frenzy_flows.training import run_allocated_training
    from ledger import Ledger
    from ledger.tables import AllocationRow
    from scheduler.cluster import parse_cluster
    from trainer.fallback import realisable

    cluster = parse_cluster("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 1}\n")
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    led = Ledger(url)
    led.sync_cluster(cluster)
    job = TrainingJob.model_validate(JOB)
    plan = next(p for p in plans_for_job(job, cluster.inventory(), gpus_per_node=cluster.gpus_per_node(),
                                         gpus=cluster.gpu_catalog())["CPU"] if realisable(p) and p.zero == 0)
    alloc = led.allocate("fenced", plan, {"cpu-0": [0]})
    steps: list[int] = []
    lines: list[str] = []
    out: dict = {}

    def go():
        out["result"] = run_allocated_training(job, "fenced", plan, Assignment.from_allocation(alloc, plan),
                                               ledger_url=url, log=lines.append,
                                               on_step=lambda s, t, loss: steps.append((s, time.monotonic())))
    t = threading.Thread(target=go)
    t.start()
    end = time.time() + 240
    while len(steps) < 3 and time.time() < end and t.is_alive():
        time.sleep(0.05)
    assert len(steps) >= 3, lines[-20:]

    reaper = Ledger(url)                                 # another process's view of the ledger
    with reaper._tx() as s:
        s.execute(update(AllocationRow).where(AllocationRow.id == alloc.id).values(lease_expires_at=0.0))
    assert reaper.expire_leases() == [alloc.id]          # its GPUs are free for others now
    lost_at = time.monotonic()
    t.join(120)
    assert not t.is_alive()

    res = out["result"]
    assert res.status == "failed", lines[-20:]
    assert "GPU lease lost" in res.error and "checkpoint" in res.error
    assert res.stop is not None and res.stop.reason == "lease-lost"
    # it stopped soon after losing the lease (the watcher looks every second), far from its 400
    # steps, and left a checkpoint at that step to resume from
    assert res.stop.step < job.train_steps
    stopped_at = dict(steps)[res.stop.step]
    assert stopped_at - lost_at < 5.0, (stopped_at - lost_at, res.stop.step)
    assert res.checkpoint_dir is not None and res.checkpoint_dir.endswith(f"step-{res.stop.step:08d}")
    assert reaper.allocation(alloc.id).status == "expired"
