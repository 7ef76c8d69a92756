"""Digests of every decision and wait answer ``frenzy`` gives, to show a speed-up changed none.

Run it before and after a change: equal digests mean every round's decisions (job, action,
plan, placement, reason) and every pending job's wait answer (predicted start, GPU type and
count, reason) are the same. Stronger than comparing ``frenzy simulate --json`` summaries,
which a changed decision can leave equal. Blocks:

* ``sched_round``: ``bench/sched_round.py``'s 31 rounds (1,000 pending jobs, 4,096 GPUs);
* ``w01/small``: itp01, 150 jobs at 4x load, on examples/clusters/small-3type.yaml;
* ``sia07/round60`` and ``sia07/event``: the Sia-like cluster07 window (``bench/jct.py``'s) on
  examples/clusters/sia-3type.yaml, round world (``--world-round-s 60``) and event world;
* ``l01/large``: itp01, 400 jobs at 4x load, on the 1,024-GPU examples/clusters/large-4type.yaml.

    python bench/decision_digest.py [--quick] [--plan-cache FILE]    # --quick: no l01/large
"""
from __future__ import annotations

import argparse
import hashlib
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.jct import OUT, TRACES, run_cli  # noqa: E402
from bench.sched_round import CLUSTER, busy_state, make_jobs, plan_book, save_plan_book  # noqa: E402
from scheduler.policies.frenzy.policy import FrenzyPolicy  # noqa: E402

WORKLOADS = {   # name -> `frenzy workload` flags
    "w01": ["--trace", TRACES / "cluster01.csv", "--mix", "examples/workload-mix.yaml", "--seed", 1,
            "--max-jobs", 150, "--time-scale", 4],
    "sia07": ["--trace", TRACES / "cluster07.csv", "--mix", "bench/mix-sia-like.yaml", "--seed", 0,
              "--start-s", 434661, "--end-s", 463461],
    "l01": ["--trace", TRACES / "cluster01.csv", "--mix", "examples/workload-mix.yaml", "--seed", 1,
            "--max-jobs", 400, "--time-scale", 4],
}


class Digest:
    """Every ``FrenzyPolicy.schedule`` call's decisions and the policy's wait answers, hashed."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.rounds = self.decisions = 0

    def add(self, decisions, waits) -> None:
        self.rounds += 1
        self.decisions += len(decisions)
        self.h.update(repr([(d.job_id, d.action, d.plan.model_dump() if d.plan is not None else None,
                             sorted((k, list(v)) for k, v in d.placement.items()), d.reason)
                            for d in decisions]).encode())
        self.h.update(repr(sorted((j, w.predicted_start_s, w.gpu_type, w.gpus, w.reason)
                                  for j, w in waits.items())).encode())

    def watch(self):
        """Record every round of every ``FrenzyPolicy`` until the returned undo is called."""
        schedule = FrenzyPolicy.schedule

        def recorded(policy, pending, state, now):
            out = schedule(policy, pending, state, now)
            self.add(out, policy.waits())
            return out
        FrenzyPolicy.schedule = recorded
        return lambda: setattr(FrenzyPolicy, "schedule", schedule)


def sched_rounds(cache: Path | None, rounds: int = 30) -> None:
    """``bench/sched_round.py``'s rounds for ``frenzy`` (same seeds, arrivals and occupancy)."""
    from scheduler.cluster import parse_cluster
    from scheduler.policies import get_policy
    cluster = parse_cluster(CLUSTER)
    base = cluster.initial_state()
    book = plan_book(cluster, cache)
    rng, now = random.Random(0), 1_000_000.0
    jobs = make_jobs(book, rng, 1000, 0, now)
    policy, rng, next_id = get_policy("frenzy"), random.Random(1), 1000
    for r in range(rounds + 1):
        policy.schedule(jobs, busy_state(base, rng, now + r, 0.85), now + r)
        k = max(1, len(jobs) // 20)
        drop = set(rng.sample(range(len(jobs)), k))
        jobs = [j for i, j in enumerate(jobs) if i not in drop] + make_jobs(book, rng, k, next_id, now + r)
        next_id += k
    save_plan_book(book, cache)


def simulate(workload: str, cluster: str, world: float | None = None) -> str:
    from scheduler.cluster import load_cluster
    from scheduler.sim import SimConfig, simulate as sim
    from scheduler.sim.engine import SimCluster
    from scheduler.workload import read_workload
    path = OUT / "digest" / f"{workload}.csv"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        run_cli(["workload", *WORKLOADS[workload], "--out", path])
    c = load_cluster(cluster)
    r = sim(read_workload(path, extra_gpu_types=c.gpu_types), SimCluster.from_cluster(c), "frenzy",
            config=SimConfig(seed=0, noise=0.1, world_round_s=world))
    return f"avg JCT {r.avg_jct_s:.6f} s, {r.completed}/{r.jobs} done, {r.oom_events} OOM"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="leave out the 1,024-GPU block (the slowest)")
    ap.add_argument("--plan-cache", default=None, help="pickle file to keep bench/sched_round.py's plans")
    args = ap.parse_args()
    cache = Path(args.plan_cache) if args.plan_cache else None
    blocks = [("sched_round", lambda: sched_rounds(cache)),
              ("w01/small", lambda: simulate("w01", "examples/clusters/small-3type.yaml")),
              ("sia07/round60", lambda: simulate("sia07", "examples/clusters/sia-3type.yaml", 60.0)),
              ("sia07/event", lambda: simulate("sia07", "examples/clusters/sia-3type.yaml"))]
    if not args.quick:
        blocks.append(("l01/large", lambda: simulate("l01", "examples/clusters/large-4type.yaml")))
    for name, run in blocks:
        d = Digest()
        undo = d.watch()
        try:
            summary = run() or ""
        finally:
            undo()
        print(f"{name:14s} rounds {d.rounds:5d}  decisions {d.decisions:5d}  digest {d.h.hexdigest()[:16]}  {summary}",
              flush=True)
    print(f"\nreproduce: python bench/decision_digest.py{' --quick' if args.quick else ''}")


if __name__ == "__main__":
    main()
