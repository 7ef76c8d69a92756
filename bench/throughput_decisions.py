"""How the throughput model changes scheduling decisions: simulate one workload block under one
policy and count where jobs first start (per GPU type), how long they wait before their first
start, and the JCT summary. Point PYTHONPATH at another checkout to compare models.

    PYTHONPATH=$PWD python bench/throughput_decisions.py WORKLOAD.csv CLUSTER.yaml POLICY
"""
import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from estimator.errors import FrenzyInputError  # noqa: E402
from scheduler.cluster import load_cluster  # noqa: E402
from scheduler.sim import SimConfig, simulate  # noqa: E402
from scheduler.sim.engine import SimCluster, Simulator  # noqa: E402
from scheduler.workload import read_workload  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("workload", help="workload CSV (from `frenzy workload`)")
ap.add_argument("cluster", help="cluster YAML")
ap.add_argument("policy", nargs="?", default="frenzy")
args = ap.parse_args()
workload, cluster_file, policy = args.workload, args.cluster, args.policy
starts = []
orig = Simulator._start


def rec(self, d, t):
    sj = self.by_id[d.job_id]
    starts.append((d.job_id, d.plan.gpu_type, d.plan.gpus, t - sj.wl.submit_s, sj.starts))
    return orig(self, d, t)


Simulator._start = rec
try:
    cl = load_cluster(cluster_file)
    jobs = read_workload(workload, extra_gpu_types=cl.gpu_types)
except FrenzyInputError as e:
    print(e, file=sys.stderr)
    sys.exit(2)
sc = SimCluster.from_cluster(cl)
t0 = time.time()
res = simulate(jobs, sc, policy, config=SimConfig(seed=0), plan_book=sc.plan_book())
s = res.summary()
first = [x for x in starts if x[4] == 0]
by_type = collections.Counter(x[1] for x in first)
all_by_type = collections.Counter(x[1] for x in starts)
wait_by_type = {g: round(statistics.mean(x[3] for x in first if x[1] == g) / 3600, 2) for g in by_type}
print(json.dumps({"policy": policy, "wall_s": round(time.time() - t0, 1),
                  "summary": {k: v for k, v in s.items() if not isinstance(v, (list, dict))},
                  "first_starts_by_type": dict(by_type), "all_starts_by_type": dict(all_by_type),
                  "mean_wait_h_before_first_start_by_type": wait_by_type,
                  "mean_wait_h": round(statistics.mean(x[3] for x in first) / 3600, 3)}))
print(f"reproduce: PYTHONPATH=$PWD python bench/throughput_decisions.py {workload} {cluster_file} {policy}")
