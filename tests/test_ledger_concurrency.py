"""50 concurrent submitters against one ledger: nobody ever holds a GPU someone else holds.

Each worker submits jobs and claims GPUs (best fit, or an explicit placement read from a
possibly stale cluster state, which may conflict), holds them briefly, and releases most of
them. Checked live (a shared map of holders, marked after the claim commits and cleared before
the release starts, so an overlap means two allocations really held one GPU at once) and
afterwards from the database (per GPU, the allocation intervals never overlap; every job is
either placed with exactly its GPUs or pending with none).
"""
import multiprocessing as mp
import random
import threading
import time

import pytest

from estimator.plan import Plan
from ledger import Ledger, LedgerConflict
from scheduler.cluster import parse_cluster

from .test_ledger_basic import drop_schema, pg_schema_url

CLUSTER = parse_cluster("""
pools:
  - {name: a, gpu: A100-80GB, nodes: 3, gpus_per_node: 4}
  - {name: b, gpu: A100-80GB, nodes: 1, gpus_per_node: 2}
""")
WORKERS = 50
ROUNDS = 4


def worker(url: str, wid: int, holders: dict | None, lock, errors: list) -> list[str]:
    led = Ledger(url)
    rng = random.Random(wid)
    jobs = []
    for r in range(ROUNDS):
        jid = f"w{wid}-r{r}"
        jobs.append(jid)
        led.submit_job(jid, jid, {"train_steps": 10})
        n = rng.choice([1, 1, 2, 4])
        plan = Plan(gpu_type="A100-80GB", gpus=n, dp=n, step_time_s=1.0)
        alloc = None
        try:
            if rng.random() < 0.5:
                alloc = led.allocate_best_fit(jid, plan)
            else:
                st = led.cluster_state()       # stale by the time we claim: conflicts expected
                cand = [nd for nd in st.nodes if len(nd.free) >= n]
                if cand:
                    nd = rng.choice(cand)
                    alloc = led.allocate(jid, plan, {nd.node_id: nd.free[:n]})
        except LedgerConflict:
            alloc = None
        if alloc is None:
            continue
        gpus = [(node, d) for node, ds in alloc.placement.items() for d in ds]
        if holders is not None:
            with lock:
                for g in gpus:
                    if g in holders:
                        errors.append(f"{g} held by {holders[g]} and {alloc.id}")
                    holders[g] = alloc.id
        time.sleep(rng.random() * 0.01)
        keep = r == ROUNDS - 1 and rng.random() < 0.3
        if not keep:
            if holders is not None:
                with lock:
                    for g in gpus:
                        holders.pop(g, None)
            led.release(alloc.id)
            if rng.random() < 0.2:
                led.release(alloc.id)          # idempotent double release
    return jobs


def check_ledger(led: Ledger, all_jobs: list[str]) -> None:
    allocs = led.allocations(active_only=False)
    assert len(allocs) >= 20               # plenty of claims happened (GPUs are scarce: 14 for 50 workers)
    intervals: dict[tuple[str, int], list[tuple[float, float, str]]] = {}
    for a in allocs:
        end = float("inf") if a.status == "active" else led_ended(led, a.id)
        for node, ds in a.placement.items():
            for d in ds:
                intervals.setdefault((node, d), []).append((a.created_at, end, a.id))
    for gpu, iv in intervals.items():
        iv.sort()
        for (s0, e0, a0), (s1, e1, a1) in zip(iv, iv[1:]):
            assert s1 >= e0, f"GPU {gpu} held by {a0} and {a1} at once"
    active = [a for a in allocs if a.status == "active"]
    holders = led.holders()
    expected = {(n, d): a.id for a in active for n, ds in a.placement.items() for d in ds}
    assert holders == expected
    per_job: dict[str, int] = {}
    for a in active:
        per_job[a.job_id] = per_job.get(a.job_id, 0) + 1
    assert all(v == 1 for v in per_job.values())
    placed = set(per_job)
    pending = set(all_jobs) - placed
    assert placed | pending == set(all_jobs) and not placed & pending
    free = sum(len(n.free) for n in led.cluster_state().nodes)
    assert free + len(holders) == 14


def led_ended(led: Ledger, alloc_id: str) -> float:
    from sqlmodel import Session
    from ledger.tables import AllocationRow
    with Session(led._read_engine) as s:
        return s.get(AllocationRow, alloc_id).ended_at


def run_threads(url: str) -> None:
    led = Ledger(url)
    led.sync_cluster(CLUSTER)
    holders, lock, errors, jobs = {}, threading.Lock(), [], []
    out_lock = threading.Lock()

    def run(w):
        try:
            js = worker(url, w, holders, lock, errors)
        except Exception as e:  # surface worker crashes in the main thread
            errors.append(f"worker {w}: {type(e).__name__}: {e}")
            return
        with out_lock:
            jobs.extend(js)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(WORKERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:5]
    assert len(jobs) == WORKERS * ROUNDS
    check_ledger(led, jobs)


def test_50_threads_sqlite(tmp_path):
    run_threads(f"sqlite:///{tmp_path / 'ledger.db'}")


@pytest.mark.postgres
def test_50_threads_postgres(postgres_url):
    url, schema = pg_schema_url(postgres_url)
    try:
        run_threads(url)
    finally:
        Ledger(url)._write_engine.dispose()
        drop_schema(postgres_url, schema)


def _proc(url, w, q):
    try:
        q.put(("ok", worker(url, w, None, None, [])))
    except Exception as e:
        q.put(("err", f"{type(e).__name__}: {e}"))


def run_processes(url: str, n: int) -> None:
    from frenzy_scheduler.service import stop_embedded_schedulers

    stop_embedded_schedulers()      # fork copies no lock a scheduler thread of this process holds
    Ledger(url).sync_cluster(CLUSTER)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_proc, args=(url, w, q)) for w in range(n)]
    for p in procs:
        p.start()
    results = [q.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    errs = [r for kind, r in results if kind == "err"]
    assert not errs, errs
    jobs = [j for kind, js in results for j in js]
    check_ledger(Ledger(url), jobs)


@pytest.mark.slow
def test_50_processes_sqlite(tmp_path):
    run_processes(f"sqlite:///{tmp_path / 'ledger.db'}", WORKERS)


@pytest.mark.slow
@pytest.mark.postgres
def test_50_processes_postgres(postgres_url):
    url, schema = pg_schema_url(postgres_url)
    try:
        run_processes(url, WORKERS)
    finally:
        drop_schema(postgres_url, schema)
