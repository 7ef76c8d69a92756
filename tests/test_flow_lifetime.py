"""Every path from the ledger's grant to the end of the submit flow releases the allocation:
a failure injected at each step between them (artifacts, events, the GPU slots, the progress
artifact, the run folder, the training) leaves no active allocation and no busy Prefect slot."""
from __future__ import annotations

import contextlib

import pytest

pytestmark = [pytest.mark.prefect, pytest.mark.usefixtures("prefect_server")]

TINY = {"name": "life-tiny", "model": "gpt2-tiny", "seq_len": 64, "global_batch": 8,
        "train_steps": 4, "precision": "fp32", "lr": 0.003, "checkpoint_every": 2}


class Injected(RuntimeError):
    pass


def boom(*args, **kwargs):
    raise Injected("injected failure")


@contextlib.contextmanager
def boom_cm(*args, **kwargs):
    raise Injected("injected failure")
    yield  # pragma: no cover


def _steps():
    """(name, target object, attribute, replacement): one step of the lifetime each."""
    import trainer.resume
    import trainer.runner
    from frenzy_flows import artifacts, dispatch, events

    return [
        ("plans artifact", artifacts, "plans_table", boom),
        ("placed event", events, "placed", boom),
        ("gpu slots", dispatch, "hold_gpu_slots", boom_cm),
        ("progress artifact", artifacts, "progress_start", boom),
        ("run folder", trainer.resume, "prepare_run_dir", lambda *a, **k: (_ for _ in ()).throw(
            PermissionError(13, "Read-only file system"))),
        ("training", trainer.runner, "run_training", boom),
    ]


@pytest.fixture
def registered(tmp_path):
    from deployments.pools import sync_pools
    from scheduler.cluster import load_cluster

    path = tmp_path / "cpu.yaml"
    path.write_text("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")
    sync_pools(load_cluster(path))
    return str(path)


def _nothing_held():
    from prefect import get_client

    from ledger import Ledger

    with get_client(sync_client=True) as client:
        slots = client.read_global_concurrency_limit_by_name("gpu:cpu").active_slots
    return Ledger().allocations(active_only=True), slots


@pytest.mark.parametrize("step", range(6), ids=["plans", "placed", "slots", "progress", "run-folder", "training"])
def test_failure_at_each_step_releases_the_allocation(step, registered, frenzy_home, monkeypatch):
    from frenzy_flows import submit_training
    from ledger import Ledger

    name, target, attr, replacement = _steps()[step]
    granted = []
    real_assign, real_claim = Ledger.allocate, Ledger.claim_many

    def spy(self, *a, **k):
        alloc = real_assign(self, *a, **k)
        granted.append(alloc.id)
        return alloc

    def spy_many(self, *a, **k):            # the live scheduler's round starts jobs in one batch
        out = real_claim(self, *a, **k)
        granted.extend(x.id for x in out if not isinstance(x, str))
        return out

    monkeypatch.setattr(Ledger, "allocate", spy)
    monkeypatch.setattr(Ledger, "claim_many", spy_many)
    monkeypatch.setattr(target, attr, replacement)
    with pytest.raises(Exception):
        submit_training(job=TINY, cluster=registered)
    assert granted, f"the {name} step was reached without an allocation"
    assert _nothing_held() == ([], 0), name


def test_tiny_deadline_is_not_the_slot_wait_and_releases(registered, frenzy_home):
    """A job deadline shorter than any wait (0.001 s) used to be the slot-wait timeout: the
    run failed waiting for free slots and kept its allocation."""
    from frenzy_flows import submit_training

    with pytest.raises(RuntimeError, match="deadline"):
        submit_training(job={**TINY, "deadline_s": 0.001}, cluster=registered)
    assert _nothing_held() == ([], 0)
