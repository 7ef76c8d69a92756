"""Scheduler cost per round: 1,000 pending jobs on 4,096 GPUs of 6 GPU types.

Every registered policy (or those named with --policies) schedules the same rounds: a cluster
that is partly busy (random per-node occupancy, running jobs with predicted ends), 1,000
pending jobs with real plans from the estimator (LLM presets, several sequence lengths and
batches; plans Pareto-pruned as the simulator hands them to policies). Between rounds 5% of the
pending jobs are replaced by new arrivals and the occupancy is redrawn, as in a live cluster.
The first round of each policy (cold caches) is reported apart; median and p99 are over the
following rounds.

    python bench/sched_round.py                       # all registered policies
    python bench/sched_round.py --policies frenzy,frenzy-paper --rounds 50
"""
from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from estimator.plan import Plan  # noqa: E402
from scheduler.cluster import parse_cluster  # noqa: E402
from scheduler.policies import POLICIES, get_policy  # noqa: E402
from scheduler.sim.jobs import PlanBook  # noqa: E402  (the simulator's plan cache: same plans policies see)
from scheduler.types import ClusterState, JobRequest, Node, RunningJob  # noqa: E402

CLUSTER = """
pools:
  - {name: h100, gpu: H100-80GB, nodes: 64, gpus_per_node: 8}
  - {name: a100-80, gpu: A100-80GB, nodes: 96, gpus_per_node: 8}
  - {name: a100-40, gpu: A100-40GB, nodes: 96, gpus_per_node: 8}
  - {name: l40s, gpu: L40S-48GB, nodes: 64, gpus_per_node: 8}
  - {name: a10, gpu: A10-24GB, nodes: 192, gpus_per_node: 4}
  - {name: rtx3090, gpu: RTX3090-24GB, nodes: 96, gpus_per_node: 8}
"""
MODELS = {"gpt2": 3, "gpt2-xl": 2, "qwen2.5-1.5b": 2, "llama-3.2-1b": 2, "llama-3.2-3b": 2,
          "llama-2-7b": 2, "llama-3.1-8b": 2, "mistral-7b": 1, "llama-2-13b": 1, "qwen2.5-14b": 1,
          "llama-3.1-70b": 1}
SEQ = [1024, 2048, 4096]
BATCH = [16, 32, 64, 128]
GPU_COUNTS = [1, 1, 1, 2, 4, 8, 8, 16, 32, 64]


# what a plan cache file holds: the plan book's version (2: plans Frenzy's trainer launches,
# offload plans within the nodes' host memory; 1: every feasible plan) and its plans
PLAN_BOOK_VERSION = 2


def plan_book(cluster, cache: Path | None) -> PlanBook:
    """The simulator's plan book for ``cluster`` (its custom GPU types, host memory), filled
    from ``cache`` when that file holds a book of this version (an older one is ignored)."""
    from scheduler.sim.engine import SimCluster

    book = SimCluster.from_cluster(cluster).plan_book()
    if cache is not None and cache.exists():
        kept = pickle.loads(cache.read_bytes())
        if isinstance(kept, dict) and kept.get("version") == PLAN_BOOK_VERSION:
            book._cache.update(kept["plans"])
        else:
            print(f"plan cache {cache}: an older plan book's; planning afresh", file=sys.stderr)
    return book


def save_plan_book(book: PlanBook, cache: Path | None) -> None:
    if cache is not None:
        cache.write_bytes(pickle.dumps({"version": PLAN_BOOK_VERSION, "plans": book._cache}))


def make_jobs(book: PlanBook, rng: random.Random, n: int, start: int, now: float) -> list[JobRequest]:
    names, weights = list(MODELS), list(MODELS.values())
    out = []
    while len(out) < n:
        model = rng.choices(names, weights)[0]
        plans = book.plans(model, rng.choice(SEQ), rng.choice(BATCH))
        if not plans:
            continue
        i = start + len(out)
        p0 = plans[0]
        out.append(JobRequest(job_id=f"job-{i}", submit_s=now - rng.uniform(0, 7200), plans=plans,
                              steps_left=rng.randint(200, 20_000), requested_gpu_type=p0.gpu_type,
                              requested_gpus=rng.choice(GPU_COUNTS), model=model))
    return out


def busy_state(base: ClusterState, rng: random.Random, now: float, busy: float) -> ClusterState:
    """Each node keeps a random number of GPUs busy (mean ``busy``) under running jobs."""
    nodes, running = [], []
    for n in base.nodes:
        k = min(n.gpus, max(0, round(rng.gauss(busy * n.gpus, n.gpus / 3))))
        taken = rng.sample(range(n.gpus), k)
        nodes.append(Node(node_id=n.node_id, pool=n.pool, gpu_type=n.gpu_type, gpus=n.gpus,
                          free=sorted(set(range(n.gpus)) - set(taken)), intra_link=n.intra_link))
        if taken:
            plan = Plan(gpu_type=n.gpu_type, gpus=k, dp=k, step_time_s=1.0)
            running.append(RunningJob(job_id=f"run-{n.node_id}", plan=plan, placement={n.node_id: sorted(taken)},
                                      start_s=now - 600, expected_end_s=now + rng.expovariate(1 / 7200)))
    return ClusterState(nodes=nodes, running=running, inter_node_gbps=dict(base.inter_node_gbps),
                        gpu_memory_gib=dict(base.gpu_memory_gib))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default=",".join(POLICIES), help="comma-separated registry names")
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--busy", type=float, default=0.85, help="mean busy fraction of each node")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan-cache", default=None, help="pickle file to keep the estimated plans between runs")
    args = ap.parse_args()

    cluster = parse_cluster(CLUSTER)
    base = cluster.initial_state()
    total = sum(n.gpus for n in base.nodes)
    cache = Path(args.plan_cache) if args.plan_cache else None
    book = plan_book(cluster, cache)
    t0 = time.perf_counter()
    rng = random.Random(args.seed)
    now = 1_000_000.0
    jobs0 = make_jobs(book, rng, args.jobs, 0, now)
    plans_per_job = statistics.mean(len(j.plans) for j in jobs0)
    print(f"cluster: {total} GPUs, {len(base.nodes)} nodes, {len(cluster.inventory())} GPU types; "
          f"{args.jobs} pending jobs ({plans_per_job:.1f} plans each, {len(book)} job shapes, "
          f"built in {time.perf_counter() - t0:.1f} s); busy ~{args.busy:.0%}; {args.rounds} rounds")
    print(f"{'policy':<14}{'first ms':>10}{'median ms':>11}{'p99 ms':>9}{'max ms':>9}{'started/round':>15}")
    for name in [p for p in args.policies.split(",") if p]:
        pol = get_policy(name)
        rng = random.Random(args.seed + 1)        # every policy sees the same rounds
        jobs = list(jobs0)
        next_id = args.jobs
        times, started = [], []
        for r in range(args.rounds + 1):
            state = busy_state(base, rng, now + r, args.busy)
            t = time.perf_counter()
            decisions = pol.schedule(jobs, state, now + r)
            times.append((time.perf_counter() - t) * 1000)
            started.append(sum(1 for d in decisions if d.action == "start"))
            k = max(1, len(jobs) // 20)            # 5% new arrivals replace as many old jobs
            drop = set(rng.sample(range(len(jobs)), k))
            jobs = [j for i, j in enumerate(jobs) if i not in drop] + make_jobs(book, rng, k, next_id, now + r)
            next_id += k
        save_plan_book(book, cache)
        warm = sorted(times[1:])
        p99 = warm[min(len(warm) - 1, round(0.99 * (len(warm) - 1)))]
        print(f"{name:<14}{times[0]:>10.1f}{statistics.median(warm):>11.1f}{p99:>9.1f}{max(warm):>9.1f}"
              f"{statistics.mean(started[1:]):>15.1f}")
    print(f"\nreproduce: python bench/sched_round.py --policies {args.policies} --jobs {args.jobs} "
          f"--rounds {args.rounds} --busy {args.busy} --seed {args.seed}")


if __name__ == "__main__":
    main()
