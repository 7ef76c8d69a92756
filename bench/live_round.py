"""A live scheduling round over the ledger: 1,000 pending jobs on 4,096 GPUs of 6 GPU types.

What the live scheduler (``frenzy_scheduler``) does per round, ledger reads and writes
included: read the queue, the running allocations and the free GPUs from the ledger
(``LedgerSource.snapshot``: its ``ledger.mirror`` reads only the rows changed since the last
round), run the policy over all of them (``scheduler.round.run_round``),
and apply every decision in the ledger (``LedgerSource.apply``: re-size / stop requests, new
allocations, the queue rows' wait reasons). The reaper (expired leases, abandoned jobs, overdue
requests), which the service runs every few seconds rather than every round, is timed apart.

The cluster and the jobs are ``bench/sched_round.py``'s (same pools, same estimator plans), so
the policy-only figure here is comparable with that benchmark's. The ledger is seeded with bulk
inserts: nodes ~85% busy under running allocations (one per node), 1,000 pending queue rows.
Between rounds (untimed) 5% of the running jobs end and as many new jobs arrive, as in a live
cluster, so every round has GPUs to place and jobs to place on them.

    python bench/live_round.py                                  # a local SQLite file
    python bench/live_round.py --url postgresql+psycopg://postgres@127.0.0.1:5432/bench
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import gc
import logging
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sqlalchemy import insert, text, update  # noqa: E402

from bench.sched_round import CLUSTER, make_jobs, plan_book, save_plan_book  # noqa: E402
from estimator.plan import Plan  # noqa: E402
from frenzy_scheduler.collector import collector_held  # noqa: E402
from frenzy_scheduler.source import LedgerSource  # noqa: E402
from ledger.queue import Leadership  # noqa: E402
from ledger import Ledger  # noqa: E402
from ledger.core import db_now  # noqa: E402
from ledger.tables import AllocationRow, GpuRow, JobRow, QueueJobRow  # noqa: E402
from scheduler.cluster import parse_cluster  # noqa: E402
from scheduler.policies import get_policy  # noqa: E402
from scheduler.round import run_round  # noqa: E402
from scheduler.sim.jobs import PlanBook  # noqa: E402
from scheduler.types import JobRequest  # noqa: E402

ALIVE_S = 86_400.0        # the seeded submitters "beat" for a day: the reaper must not give them up


def _tables(led: Ledger) -> None:
    """Empty the job-side tables (the topology is kept and re-synced)."""
    with led._tx() as s:
        s.execute(update(GpuRow).values(alloc_id=None))
        for t in ("queue_jobs", "allocations", "plans", "measurements", "jobs"):
            s.execute(text(f"DELETE FROM {t}"))


def queue_rows(jobs: list[JobRequest], now: float) -> tuple[list[dict], list[dict]]:
    """(jobs rows, queue_jobs rows) for pending ``jobs``: what ``JobQueue.enqueue`` writes."""
    jr, qr = [], []
    for j in jobs:
        spec = {"name": j.job_id, "allowed_gpu_types": [j.requested_gpu_type], "max_gpus": j.requested_gpus}
        jr.append(dict(job_id=j.job_id, name=j.job_id, spec={**spec, "train_steps": j.steps_left},
                       status="pending", steps=j.steps_left, submitted_at=now))
        qr.append(dict(job_id=j.job_id, name=j.job_id, job=spec, plans=[p.model_dump(mode="json") for p in j.plans],
                       state="pending", submitted_at=now - (1_000_000.0 - j.submit_s), steps_total=j.steps_left,
                       steps_done=0, model=j.model, checkpoint_gb=0.0, attained_gpu_s=0.0, restarts=0,
                       preemptions=0, resizes=0, allocation_id=None, started_at=None, allocation={}, request={}, request_state="", wait_reason="",
                       error="", alive_until=now + ALIVE_S, updated_at=now))
    return jr, qr


def seed(led: Ledger, book: PlanBook, rng: random.Random, jobs: int, busy: float) -> list[JobRequest]:
    """Bulk-insert the running allocations (each node ~``busy`` taken by one job) and ``jobs``
    pending queue rows; returns the pending jobs."""
    _tables(led)
    with led._read() as s:
        now = db_now(s)
    state = led.cluster_state()
    gpu_ids: dict[tuple[str, int], int] = {}
    with led._read() as s:
        for gid, node, dev in s.execute(GpuRow.__table__.select().with_only_columns(
                GpuRow.id, GpuRow.node_id, GpuRow.device_index)).all():
            gpu_ids[(node, dev)] = gid
    jobs_rows, queue, allocs, taken = [], [], [], {}
    for n in state.nodes:
        k = min(n.gpus, max(0, round(rng.gauss(busy * n.gpus, n.gpus / 3))))
        if not k:
            continue
        devs = sorted(rng.sample(range(n.gpus), k))
        jid, aid = f"run-{n.node_id}", uuid.uuid4().hex
        steps = rng.randint(200, 20_000)
        plan = Plan(gpu_type=n.gpu_type, gpus=k, dp=k, step_time_s=1.0)
        pj = plan.model_dump(mode="json")
        started = now - 600.0
        assignment = {"allocation_id": aid, "plan": pj, "pool": n.pool, "gpu_type": n.gpu_type,
                      "placement": {n.node_id: devs}, "devices": [str(d) for d in devs]}
        jobs_rows.append(dict(job_id=jid, name=jid, spec={"name": jid, "train_steps": steps}, status="placed",
                              steps=steps, submitted_at=started))
        queue.append(dict(job_id=jid, name=jid, job={"name": jid}, plans=[pj], state="running",
                          submitted_at=started - 60.0, steps_total=steps, steps_done=0, model="", checkpoint_gb=0.0,
                          attained_gpu_s=0.0, restarts=0, preemptions=0, resizes=0, allocation_id=aid,
                          allocation=assignment, started_at=started, request={}, request_state="",
                          wait_reason="", error="", alive_until=now + ALIVE_S, updated_at=now))
        allocs.append(dict(id=aid, job_id=jid, pool=n.pool, gpu_type=n.gpu_type, plan=pj,
                           placement={n.node_id: devs}, status="active", created_at=started,
                           lease_expires_at=now + ALIVE_S, expected_end_at=started + steps * 1.0))
        for d in devs:
            taken[gpu_ids[(n.node_id, d)]] = aid
    pending = make_jobs(book, rng, jobs, 0, 1_000_000.0)
    jr, qr = queue_rows(pending, now)
    with led._tx() as s:
        s.execute(insert(JobRow.__table__), jobs_rows + jr)
        s.execute(insert(AllocationRow.__table__), allocs)
        s.execute(insert(QueueJobRow.__table__), queue + qr)
        _assign(s, taken)
    return pending


def _assign(s, taken: dict[int, str]) -> None:
    """Set ``gpus.alloc_id`` for many rows in one statement per allocation."""
    by_alloc: dict[str, list[int]] = {}
    for gid, aid in taken.items():
        by_alloc.setdefault(aid, []).append(gid)
    for aid, ids in by_alloc.items():
        s.execute(update(GpuRow).where(GpuRow.id.in_(ids)).values(alloc_id=aid))


def churn(led: Ledger, source: LedgerSource, book: PlanBook, rng: random.Random, next_id: int,
          frac: float) -> int:
    """Untimed, between rounds: ``frac`` of the running jobs end (released, finished) and as
    many new jobs arrive. Returns the next job number."""
    running = [j for j in source.queue.jobs(("running",)) if j.allocation_id]
    k = max(1, round(frac * len(running)))
    for j in rng.sample(running, min(k, len(running))):
        led.release(j.allocation_id)
        source.queue.finish(j.job_id, "done")
    with led._read() as s:
        now = db_now(s)
    jr, qr = queue_rows(make_jobs(book, rng, k, next_id, 1_000_000.0), now)
    with led._tx() as s:
        s.execute(insert(JobRow.__table__), jr)
        s.execute(insert(QueueJobRow.__table__), qr)
    return next_id + k


class CollectorClock:
    """Time Python's cyclic garbage collector spends from now on (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.s, self.passes, self.full, self._t0 = 0.0, 0, 0, None
        gc.callbacks.append(self._tick)

    def _tick(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.s += time.perf_counter() - self._t0
            self.passes += 1
            self.full += info["generation"] == 2


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="ledger URL (default: a fresh SQLite file in a temporary folder); "
                                                "PostgreSQL: postgresql+psycopg://user@host:5432/db (its tables "
                                                "are emptied first)")
    ap.add_argument("--policy", default="frenzy")
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--busy", type=float, default=0.85, help="mean busy fraction of each node")
    ap.add_argument("--churn", type=float, default=0.05, help="fraction of running jobs that end between rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan-cache", default=None, help="pickle file to keep the estimated plans between runs")
    ap.add_argument("--profile", default=None, help="write a cProfile of the timed rounds to this file")
    ap.add_argument("--collector", choices=["held", "default"], default="held",
                    help="held: as frenzy scheduler runs a round (frenzy_scheduler.collector); default: "
                         "Python's collector left on")
    args = ap.parse_args()
    logging.getLogger("frenzy").setLevel(logging.WARNING)     # one log line per decision otherwise

    tmp = None
    url = args.url
    if url is None:
        tmp = tempfile.TemporaryDirectory(prefix="frenzy-live-round-")
        url = f"sqlite:///{Path(tmp.name) / 'ledger.db'}"
    cluster = parse_cluster(CLUSTER)
    cache = Path(args.plan_cache) if args.plan_cache else None
    book = plan_book(cluster, cache)
    led = Ledger(url)
    t0 = time.perf_counter()
    led.sync_cluster(cluster)
    t_sync = time.perf_counter() - t0
    rng = random.Random(args.seed)
    t0 = time.perf_counter()
    seed(led, book, rng, args.jobs, args.busy)
    t_seed = time.perf_counter() - t0
    save_plan_book(book, cache)
    source = LedgerSource(led)
    # the service's writes are fenced by its leadership lease (one read of the lease row in
    # each write transaction): this round leads and writes fenced, as the service does
    lead = Leadership(led, "live-round-bench", ttl_s=24 * 3600.0)
    if not lead.acquire():
        raise SystemExit(f"another scheduler leads this ledger: {lead.current()}")
    source.queue.fence = lead.fence()
    atexit.register(lead.release)     # a crashed run must not hold a day's lease on a shared ledger
    policy = get_policy(args.policy)
    total = sum(n.gpus for n in led.cluster_state().nodes)
    print(f"ledger: {led._write_engine.dialect.name}; cluster {total} GPUs, {len(cluster.inventory())} GPU types "
          f"(synced in {t_sync:.1f} s); {args.jobs} pending jobs seeded in {t_seed:.1f} s; busy ~{args.busy:.0%}; "
          f"{args.rounds} rounds, {args.churn:.1%} churn between rounds")

    prof = None
    if args.profile:
        import cProfile
        prof = cProfile.Profile()
    rows = []
    next_id = args.jobs
    collector = CollectorClock()      # from the first round on: the rounds and the churn between them
    for r in range(args.rounds + 1):
        t_reap0 = time.perf_counter()
        source.reap()
        t_reap = time.perf_counter() - t_reap0
        if prof is not None and r > 0:
            prof.enable()
        # as the service runs a round: the collector held off, its due pass right after (untimed)
        with (collector_held() if args.collector == "held" else contextlib.nullcontext()):
            t = time.perf_counter()
            snap = source.snapshot()
            t_read = time.perf_counter()
            result = run_round(policy, snap.pending, snap.state, time.time())
            t_policy = time.perf_counter()
            source.apply(result, time.time())
            t_end = time.perf_counter()
        if prof is not None:
            prof.disable()
        rows.append({"total": (t_end - t) * 1e3, "read": (t_read - t) * 1e3, "policy": (t_policy - t_read) * 1e3,
                     "write": (t_end - t_policy) * 1e3, "reap": t_reap * 1e3, "pending": len(snap.pending),
                     "running": len(snap.state.running), "starts": len(result.started),
                     "stops": len(result.stops)})
        next_id = churn(led, source, book, rng, next_id, args.churn)
    if prof is not None:
        prof.dump_stats(args.profile)
    warm = rows[1:]
    print(f"{'':<10}{'first ms':>10}{'median ms':>11}{'p99 ms':>9}{'max ms':>9}")
    for k, label in (("total", "round"), ("read", "  read"), ("policy", "  policy"), ("write", "  write"),
                     ("reap", "reap")):
        xs = [w[k] for w in warm]
        print(f"{label:<10}{rows[0][k]:>10.1f}{statistics.median(xs):>11.1f}{pct(xs, 0.99):>9.1f}{max(xs):>9.1f}")
    print(f"garbage collector: {collector.s:.2f} s in {collector.passes} passes ({collector.full} full) over the "
          f"rounds and the untimed churn between them")
    print(f"per round: {statistics.mean(w['pending'] for w in warm):.0f} pending, "
          f"{statistics.mean(w['running'] for w in warm):.0f} running, "
          f"{statistics.mean(w['starts'] for w in warm):.1f} started, {statistics.mean(w['stops'] for w in warm):.1f} "
          f"stop/re-size requests; the source's mirror read everything {source.mirror.full_reads} time(s), "
          f"else only the rows changed since its last read")
    shown = "" if args.url is None else f" --url {args.url}"
    print(f"\nreproduce: python bench/live_round.py{shown} --policy {args.policy} --jobs {args.jobs} "
          f"--rounds {args.rounds} --busy {args.busy} --churn {args.churn} --seed {args.seed} "
          f"--collector {args.collector}")


if __name__ == "__main__":
    main()
