"""Simultaneous best-fit requests get every free GPU: 8 one-GPU requests on 8 free GPUs get 8
grants (PostgreSQL used to skip the rows other transactions had locked, over every free GPU of
the type, and granted 1-2), and 16 requests on 8 GPUs get exactly 8, never a GPU twice."""
import threading

import pytest

from estimator.plan import Plan
from ledger import Ledger
from scheduler.cluster import parse_cluster

from .test_ledger_basic import drop_schema, pg_schema_url

CLUSTER = parse_cluster("pools:\n  - {name: a, gpu: A100-80GB, nodes: 2, gpus_per_node: 4}\n")


def race(url: str, requests: int, gpus: int = 1) -> list:
    Ledger(url).sync_cluster(CLUSTER)
    start = threading.Barrier(requests)
    out: list = [None] * requests
    errors: list[str] = []

    def one(i: int) -> None:
        led = Ledger(url)
        start.wait()
        try:
            out[i] = led.allocate_best_fit(f"j{i}", Plan(gpu_type="A100-80GB", gpus=gpus, dp=gpus))
        except Exception as e:  # surface in the main thread
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    granted = [a for a in out if a is not None]
    held = [(n, d) for a in granted for n, ds in a.placement.items() for d in ds]
    assert len(held) == len(set(held)), "a GPU was granted twice"
    assert Ledger(url).holders() == {g: a.id for a in granted for g in
                                     [(n, d) for n, ds in a.placement.items() for d in ds]}
    return granted


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'ledger.db'}"
        return
    base = request.getfixturevalue("postgres_url")
    u, schema = pg_schema_url(base)
    yield u
    Ledger(u)._write_engine.dispose()
    drop_schema(base, schema)


def test_8_simultaneous_requests_on_8_free_gpus_get_8(url):
    assert len(race(url, 8)) == 8


def test_16_simultaneous_requests_on_8_gpus_get_exactly_8(url):
    assert len(race(url, 16)) == 8


def test_mixed_sizes_fill_the_gpus(url):
    granted = race(url, 6, gpus=2)                 # 6 x 2 GPUs on 8: exactly 4 fit
    assert len(granted) == 4
