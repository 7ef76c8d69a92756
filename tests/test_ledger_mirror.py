"""``ledger.mirror``: the incrementally refreshed copy of what a round reads stays exact.

After writes through other handles, another process, and (PostgreSQL) transactions that commit
out of the order they began in, a refreshed mirror equals a fresh full read; every column a
round reads moves a row's change marker, liveness renewals do not; a DELETE makes the next
refresh read everything. On SQLite and (with FRENZY_TEST_POSTGRES_URL) PostgreSQL."""
import multiprocessing as mp

import pytest
import sqlalchemy as sa

from estimator.plan import Plan
from ledger import Ledger
from ledger.mirror import LedgerMirror
from ledger.queue import JobQueue
from ledger.tables import AllocationRow, GpuRow, NodeRow, PoolRow, QueueJobRow
from scheduler.cluster import parse_cluster

from .test_ledger_basic import drop_schema, pg_schema_url

CLUSTER = parse_cluster("""
pools:
  - {name: a100, gpu: A100-80GB, nodes: 2, gpus_per_node: 4}
  - {name: rtx, gpu: RTX3090-24GB, nodes: 1, gpus_per_node: 2}
""")
# the columns a round never reads: renewing them must not make the next refresh read the row
LIVENESS = {"queue_jobs": {"alive_until", "updated_at"}, "allocations": {"lease_expires_at"}}


def plan(gpus: int, gpu_type: str = "A100-80GB") -> Plan:
    return Plan(gpu_type=gpu_type, gpus=gpus, dp=gpus, step_time_s=0.5)


@pytest.fixture(params=["sqlite", "postgres"])
def url(request, tmp_path):
    if request.param == "sqlite":
        u = f"sqlite:///{tmp_path / 'ledger.db'}"
        Ledger(u).sync_cluster(CLUSTER)
        yield u
        return
    base = request.getfixturevalue("postgres_url")
    u, schema = pg_schema_url(base)
    Ledger(u).sync_cluster(CLUSTER)
    yield u
    Ledger(u)._write_engine.dispose()
    drop_schema(base, schema)


def view(m: LedgerMirror):
    """What a round reads, comparable: the cluster, and the active queue rows."""
    st = m.cluster_state()
    running = sorted(((r.job_id, r.plan, r.placement, r.start_s, r.expected_end_s) for r in st.running))
    jobs = {k: (j, m.static[k]) for k, j in m.jobs.items()}
    return st.nodes, running, st.inter_node_gbps, st.gpu_memory_gib, jobs


def full_read(url: str):
    m = LedgerMirror(Ledger(url))
    m.refresh()
    return view(m)


def _other_process(url: str, q) -> None:
    led = Ledger(url)
    queue = JobQueue(led)
    queue.enqueue("from-other", "from-other", {"name": "x"}, [plan(1)], steps=50)
    a = led.allocate_best_fit("other-run", plan(2))
    q.put(a.id)


def test_refresh_after_other_handles_and_processes_equals_a_full_read(url):
    led = Ledger(url)
    mirror = LedgerMirror(led)
    mirror.refresh()
    assert view(mirror) == full_read(url)
    other = Ledger(url)                       # another handle of this process
    queue = JobQueue(other)
    for i in range(3):
        queue.enqueue(f"j{i}", f"j{i}", {"name": f"j{i}", "max_gpus": 2}, [plan(2), plan(1, "RTX3090-24GB")],
                      steps=100)
    got = queue.start_all([("j0", plan(2), {"a100-0": [0, 1]})], lease_s=60.0,
                          assignment=lambda a, p: {"allocation_id": a.id})
    v0 = mirror.version
    assert mirror.refresh() and mirror.version > v0
    assert view(mirror) == full_read(url)
    assert {j.state for j in mirror.jobs.values()} == {"pending", "running"}

    ctx = mp.get_context("spawn")              # another process, its own engines and clock
    q = ctx.Queue()
    p = ctx.Process(target=_other_process, args=(url, q))
    p.start()
    other_alloc = q.get(timeout=120)
    p.join(120)
    assert p.exitcode == 0
    mirror.refresh()
    assert view(mirror) == full_read(url)
    assert "from-other" in mirror.jobs and other_alloc in mirror.allocs

    # ends, requeues, requests, waits, releases, progress: all seen
    other.release(got[0][1].id)
    queue.finish("j0", "done")
    queue.set_waits({"j1": {"predicted_start_s": 123.0, "gpu_type": "A100-80GB", "gpus": 2, "reason": "r"}})
    queue.touch("j2", steps_done=7)
    other.release(other_alloc)
    mirror.refresh()
    assert view(mirror) == full_read(url)
    assert "j0" not in mirror.jobs and mirror.jobs["j1"].wait_reason == "r"
    assert mirror.jobs["j2"].steps_done == 7 and other_alloc not in mirror.allocs
    # topology changes too
    other.remove_pools(["rtx"])
    mirror.refresh()
    assert view(mirror) == full_read(url)
    assert {n.pool for n in mirror.cluster_state().nodes} == {"a100"}
    assert mirror.full_reads == 1              # everything above was read incrementally


def test_ledger_cluster_state_is_fresh_after_other_handles_write(url):
    led, other = Ledger(url), Ledger(url)
    assert sum(len(n.free) for n in led.cluster_state().nodes) == 10
    a = other.allocate_best_fit("x", plan(4))
    st = led.cluster_state()
    assert sum(len(n.free) for n in st.nodes) == 6 and [r.job_id for r in st.running] == ["x"]
    other.release(a.id)
    assert sum(len(n.free) for n in led.cluster_state().nodes) == 10 and led.cluster_state().running == []


def test_every_column_a_round_reads_moves_the_marker_and_liveness_does_not(url):
    led = Ledger(url)
    queue = JobQueue(led)
    queue.enqueue("j", "j", {"name": "j"}, [plan(1)], steps=10)
    alloc = led.allocate_best_fit("j", plan(1))
    keys = {PoolRow: ("name", "a100"), NodeRow: ("node_id", "a100-0"),
            GpuRow: ("id", None), AllocationRow: ("id", alloc.id), QueueJobRow: ("job_id", "j")}
    eng = led._write_engine
    for model, (key, value) in keys.items():
        t = model.__table__
        with eng.begin() as c:
            if value is None:
                value = c.execute(sa.select(t.c[key]).limit(1)).scalar_one()
            row = c.execute(sa.select(t).where(t.c[key] == value)).mappings().one()
        for col in t.c:
            if col.name in ("chg", key) or col.foreign_keys:
                continue
            with eng.begin() as c:
                before = c.execute(sa.select(t.c.chg).where(t.c[key] == value)).scalar_one()
                # write the column to what it holds: a trigger fires on the column being set
                c.execute(t.update().where(t.c[key] == value).values({col.name: row[col.name]}))
            with eng.begin() as c:
                after = c.execute(sa.select(t.c.chg).where(t.c[key] == value)).scalar_one()
            moves = col.name not in LIVENESS.get(t.name, set())
            assert (after != before) == moves, f"{t.name}.{col.name}: marker {'did not move' if moves else 'moved'}"


def test_a_delete_makes_the_next_refresh_read_everything(url):
    led = Ledger(url)
    queue = JobQueue(led)
    queue.enqueue("gone", "gone", {"name": "gone"}, [plan(1)], steps=10)
    mirror = LedgerMirror(led)
    mirror.refresh()
    assert "gone" in mirror.jobs
    with led._tx() as s:
        s.execute(sa.text("DELETE FROM queue_jobs WHERE job_id = 'gone'"))
    mirror.refresh()
    assert "gone" not in mirror.jobs and mirror.full_reads == 2
    assert view(mirror) == full_read(url)


def test_postgres_commits_out_of_begin_order_are_not_missed(postgres_url):
    """A transaction that began (took its id) before the mirror's refresh but commits after a
    later one: its rows carry an older marker than rows already read, and are still seen."""
    u, schema = pg_schema_url(postgres_url)
    try:
        led = Ledger(u)
        led.sync_cluster(CLUSTER)
        mirror = LedgerMirror(led)
        mirror.refresh()
        eng = sa.create_engine(u)
        slow = eng.connect()
        tx = slow.begin()
        slow.execute(sa.text("UPDATE gpus SET alloc_id = 'slow' WHERE node_id = 'rtx-0'"))   # takes its id now
        a = led.allocate_best_fit("fast", plan(4))                                            # a later id, committed first
        mirror.refresh()
        assert a.id in mirror.allocs
        assert [n.free for n in mirror.cluster_state().nodes if n.node_id == "rtx-0"] == [[0, 1]]
        tx.commit()
        slow.close()
        mirror.refresh()
        assert [n.free for n in mirror.cluster_state().nodes if n.node_id == "rtx-0"] == [[]]
        assert view(mirror) == full_read(u) and mirror.full_reads == 1
        eng.dispose()
        led._write_engine.dispose()
    finally:
        drop_schema(postgres_url, schema)
