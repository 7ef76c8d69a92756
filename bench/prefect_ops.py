"""What Frenzy's Prefect plumbing costs: pool sync, pool status, the plan table artifact, and a
dispatch round trip through a real process worker.

    python bench/prefect_ops.py [--runs 3]

Starts its own temporary Prefect server (prefect_test_harness, SQLite) and one process worker
polling every second; the dispatched flow is a stand-in that returns at once, so the round trip
is Prefect's overhead (schedule -> worker pickup -> flow subprocess -> result), not training.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prefect import flow

ROOT = Path(__file__).resolve().parent.parent


@flow(name="frenzy-train-bench")
def standin(job: dict, plan: dict, assignment: dict | None = None, job_id: str | None = None) -> dict:
    return {"cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "job_id": job_id}


def _t(fn, *a, **kw):
    t0 = time.perf_counter()
    out = fn(*a, **kw)
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="dispatch round trips to time")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    os.chdir(ROOT)
    home = tempfile.mkdtemp(prefix="frenzy-bench-")
    os.environ.update(PREFECT_HOME=home, PREFECT_SERVER_ANALYTICS_ENABLED="false",
                      PREFECT_LOGGING_LEVEL="WARNING", FRENZY_HOME=os.path.join(home, "frenzy"))

    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from deployments.pools import pools_status, sync_pools
    from estimator.job import TrainingJob
    from estimator.plan import Plan
    from frenzy_flows import artifacts, dispatch
    from scheduler.cluster import load_cluster

    rows: list[tuple[str, str]] = []
    with prefect_test_harness(server_startup_timeout=120):
        cluster = load_cluster(ROOT / "examples/cluster.yaml")
        quiet = dict(log=lambda *_: None)
        t, _ = _t(sync_pools, cluster, **quiet)
        rows.append(("pools sync, 3 pools, first (create)", f"{t:.2f} s"))
        t, _ = _t(sync_pools, cluster, **quiet)
        rows.append(("pools sync, 3 pools, again (idempotent)", f"{t:.2f} s"))
        t, st = _t(pools_status)
        rows.append((f"pools status ({len(st)} pools)", f"{t:.3f} s"))

        plans = {g: [Plan(gpu_type=g, gpus=n, dp=n, device_used_gib=10.0 + n, step_time_s=1.0 / n)
                     for n in (1, 2, 4, 8, 16, 32)] for g in ("H100-80GB", "A100-40GB", "RTX3090-24GB")}
        chosen = plans["H100-80GB"][3]

        @flow
        def show():
            return _t(artifacts.plans_table, plans, chosen, steps=1000)[0]
        rows.append(("plan table artifact, 18 plans (in a flow)", f"{show() * 1000:.0f} ms"))

        pool = "bench-cpu"
        sync_pools({"pools": [{"name": pool, "gpu": "CPU", "nodes": 1, "gpus_per_node": 2}]},
                   entrypoint="bench/prefect_ops.py:standin", control_pool=False, **quiet)
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_WORKER_QUERY_SECONDS": "1"}
        worker = subprocess.Popen([str(Path(sys.executable).parent / "prefect"), "worker", "start", "--pool", pool],
                                  cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True)
        try:
            while not dispatch.has_workers(pool):
                time.sleep(0.5)
            job = TrainingJob(name="bench", model="gpt2-tiny", seq_len=16, global_batch=2, train_steps=1)
            plan = Plan(gpu_type="CPU", gpus=2, dp=2)
            times = []
            for i in range(args.runs):
                t, out = _t(dispatch.dispatch_to_pool, job, plan, {"pool": pool, "devices": ["0", "1"]},
                            timeout_s=120, job_id=f"b{i}", poll_s=0.2)
                assert out["cuda"] == "0,1", out
                times.append(t)
            rows.append((f"dispatch round trip via a process worker (median of {args.runs}; poll 1 s)",
                         f"{statistics.median(times):.2f} s (min {min(times):.2f}, max {max(times):.2f})"))
        finally:
            worker.kill()
            worker.wait()

    width = max(len(r[0]) for r in rows)
    print(f"{'measurement':<{width}}  value")
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"\nreproduce: python bench/prefect_ops.py --runs {args.runs}   (cpu count {os.cpu_count()})")


if __name__ == "__main__":
    main()
