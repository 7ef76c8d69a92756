"""Live matches simulated: replay a workload of tiny jobs through the real live path and through
`frenzy simulate`, and compare job completion times.

Live path: a real Prefect server (`prefect server start`), a SQLite ledger, `frenzy scheduler`
(the same round as the simulator), one `frenzy-submit` flow run per job started at its arrival
time (each trains in its own process on the local CPU "GPUs": the tiny GPT-2), re-sizes and
preemptions through the ledger and the control file. A first live job, run alone, calibrates the
simulator: its measured step time against the throughput model's prediction (a factor applied
to every predicted step time) and its start-up (allocation to first step). Then `frenzy
simulate`'s engine runs the same workload (same arrival offsets, same steps, same policy) and
the per-job JCTs are compared.

    PYTHONPATH=. python bench/live_replay.py --jobs 12 --span-s 180 --json

`--json`: the last line is {"jobs", "completed", "live_avg_jct_s", "sim_avg_jct_s", "resizes",
"preemptions", "lost_steps"}. Deviation from the full contract: trainings run in the submitting
flow's process (no separate pool workers), to fit a 2-core machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLUSTER_YAML = "pools:\n  - {name: local-cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n"
BASE_JOB = {"model": "gpt2-tiny", "seq_len": 64, "global_batch": 8, "precision": "fp32", "lr": 0.003,
            "checkpoint_every": 1000}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, timeout_s: float) -> None:
    end = time.time() + timeout_s
    while time.time() < end:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"Prefect server at {url} did not answer within {timeout_s:.0f} s")


def submit_one(job_file: str, out_file: str, cluster: str, ledger: str, policy: str) -> int:
    """One submission (run in its own process): the frenzy-submit flow, result JSON to a file."""
    from frenzy_flows import submit_training

    job = json.loads(Path(job_file).read_text())
    try:
        res = submit_training(job=job, cluster=cluster, ledger_url=ledger, policy=policy,
                              embedded_scheduler=False, wait_timeout_s=1800)
        Path(out_file).write_text(res.model_dump_json())
        return 0
    except Exception as err:
        Path(out_file).write_text(json.dumps({"status": "failed", "error": str(err)}))
        return 1


def _spawn_submit(work: Path, job: dict, env: dict, cluster: str, ledger: str, policy: str):
    jf = work / f"{job['name']}.job.json"
    jf.write_text(json.dumps(job))
    out = work / f"{job['name']}.result.json"
    log = open(work / f"{job['name']}.log", "w")
    p = subprocess.Popen([sys.executable, __file__, "--submit-one", str(jf), "--out", str(out),
                          "--cluster", cluster, "--ledger", ledger, "--policy", policy],
                         env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return p, out


def workload(n: int, span_s: float, step_s: float, startup_s: float, seed: int,
             job_s: tuple[float, float] = (20.0, 90.0)) -> list[dict]:
    """``n`` jobs of ``job_s`` seconds each (default 20-90) on one device at the calibrated
    speed, arrivals spread over ``span_s``; the first is a long job (3x the longest) that the
    policy may grow and later shrink or preempt."""
    rng = random.Random(seed)
    jobs = []
    lo, hi = job_s
    for i in range(n):
        target = 3 * hi if i == 0 else rng.uniform(lo, hi)
        steps = max(10, int(round((target - startup_s) / step_s)))
        at = 0.0 if i == 0 else rng.uniform(0.05, 1.0) * span_s
        jobs.append({**BASE_JOB, "name": f"replay-{i:02d}", "train_steps": steps, "_at": at})
    jobs.sort(key=lambda j: j["_at"])
    return jobs


def simulate(jobs: list[dict], offsets: dict[str, float], cluster_path: str, policy: str,
             factor: float, startup_s: float, tick_s: float):
    from scheduler.cluster import load_cluster
    from scheduler.sim.engine import SimCluster, SimConfig, Simulator
    from scheduler.sim.jobs import StepTimes
    from scheduler.policies import get_policy
    from scheduler.workload import WorkloadJob

    class Calibrated(StepTimes):
        def at(self, model, seq_len, plan, nodes, gbps):
            return super().at(model, seq_len, plan, nodes, gbps) * factor

    cluster = SimCluster.from_cluster(load_cluster(cluster_path))
    wl = [WorkloadJob(job_id=j["name"], submit_s=offsets[j["name"]], model=j["model"], seq_len=j["seq_len"],
                      global_batch=j["global_batch"], train_tokens=j["train_steps"] * j["global_batch"] * j["seq_len"],
                      requested_gpu_type="CPU", requested_gpus=1) for j in jobs]
    cfg = SimConfig(seed=0, noise=0.0, startup_s=startup_s, tick_s=tick_s)
    return Simulator(wl, cluster, get_policy(policy), cfg, step_times=Calibrated(cluster.gpus)).run()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--span-s", type=float, default=180.0, help="arrivals spread over this many seconds")
    ap.add_argument("--policy", default="frenzy")
    ap.add_argument("--tick-s", type=float, default=10.0, help="the scheduler's tick, live and simulated")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--job-s", type=float, nargs=2, default=(20.0, 90.0), metavar=("LO", "HI"),
                    help="job lengths in seconds on one device (default 20 90)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--submit-one", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--ledger", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.submit_one:
        return submit_one(args.submit_one, args.out, args.cluster, args.ledger, args.policy)
    if not 1 <= args.jobs <= 40:
        print("live_replay: error: jobs: must be within 1..40", file=sys.stderr)
        return 2
    if not args.span_s > 0 or not args.tick_s > 0 or not 0 < args.job_s[0] <= args.job_s[1]:
        print("live_replay: error: span-s and tick-s must be > 0, job-s LO HI with 0 < LO <= HI", file=sys.stderr)
        return 2

    work = Path(tempfile.mkdtemp(prefix="frenzy-live-replay-"))
    cluster = str(work / "cluster.yaml")
    Path(cluster).write_text(CLUSTER_YAML)
    ledger = f"sqlite:///{work / 'ledger.db'}"
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(work / "prefect"),
           "FRENZY_HOME": str(work / "frenzy"), "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING"}
    os.environ.update({k: env[k] for k in ("PREFECT_HOME", "FRENZY_HOME", "PREFECT_API_URL",
                                           "PREFECT_SERVER_ANALYTICS_ENABLED")})
    prefect_bin = str(Path(sys.executable).with_name("prefect"))
    procs: list[subprocess.Popen] = []
    say = (lambda *a: print(*a, file=sys.stderr)) if args.json else print
    t0 = time.time()
    try:
        server = subprocess.Popen([prefect_bin, "server", "start", "--host", "127.0.0.1", "--port", str(port),
                                   "--no-ui"], env=env, stdout=open(work / "server.log", "w"),
                                  stderr=subprocess.STDOUT)
        procs.append(server)
        _wait_health(api, 180)
        from deployments.pools import sync_pools
        from scheduler.cluster import load_cluster

        sync_pools(load_cluster(cluster))
        sched = subprocess.Popen([sys.executable, "-m", "frenzy_cli.main", "scheduler", "--ledger", ledger,
                                  "--cluster", cluster, "--policy", args.policy, "--tick-s", str(args.tick_s)],
                                 env=env, cwd=ROOT, stdout=open(work / "scheduler.log", "w"),
                                 stderr=subprocess.STDOUT)
        procs.append(sched)
        say(f"prefect server {api}, scheduler pid {sched.pid}, work dir {work} ({time.time() - t0:.0f} s)")

        # calibration: one job alone
        calib = {**BASE_JOB, "name": "calibrate", "train_steps": 60}
        p, out = _spawn_submit(work, calib, env, cluster, ledger, args.policy)
        procs.append(p)
        p.wait(timeout=args.timeout_s)
        res = json.loads(out.read_text())
        if res.get("status") != "completed":
            raise RuntimeError(f"calibration job failed: {res.get('error')}")
        from ledger.queue import JobQueue
        queue = JobQueue(ledger)
        row = queue.get(res["job_id"])
        plan = res["plan"]
        measured = float(res["measured"]["step_time_s"])
        # the simulator's own prediction for the plan the calibration job ran: its plan book's
        # plan of the same shape (the simulator's jobs train in its default precision, so the
        # live plan itself is not one it would run), through its throughput model call
        from scheduler.sim.engine import SimCluster
        from scheduler.sim.jobs import StepTimes

        sc = SimCluster.from_cluster(load_cluster(cluster))
        book = sc.plan_book().plans(calib["model"], calib["seq_len"], calib["global_batch"])
        shape = ("gpus", "zero", "act_ckpt", "micro_batch", "grad_accum")
        twin = next((p for p in book if all(getattr(p, k) == plan[k] for k in shape)),
                    min((p for p in book if p.gpus == plan["gpus"]), key=lambda p: p.step_time_s))
        predicted = StepTimes(sc.gpus).at(calib["model"], calib["seq_len"], twin, 1, None)
        factor = measured / predicted if predicted > 0 else 1.0
        run_s = row.ended_at - row.started_at
        startup = max(0.0, run_s - calib["train_steps"] * measured)
        step_one = measured * plan["gpus"]           # a one-device step, for sizing the jobs
        say(f"calibration: {plan['gpus']}xCPU step {measured:.4f} s measured vs {predicted:.4f} s "
            f"predicted by the simulator (factor {factor:.3f}), start-up {startup:.1f} s")

        jobs = workload(args.jobs, args.span_s, step_one, startup, args.seed, tuple(args.job_s))
        start = time.time()
        running = []
        for j in jobs:
            delay = start + j["_at"] - time.time()
            if delay > 0:
                time.sleep(delay)
            spec = {k: v for k, v in j.items() if not k.startswith("_")}
            running.append((j, *_spawn_submit(work, spec, env, cluster, ledger, args.policy)))
            procs.append(running[-1][1])
        for j, p, out in running:
            p.wait(timeout=max(1.0, args.timeout_s - (time.time() - start)))
        results = {j["name"]: json.loads(out.read_text()) for j, _, out in running}
        rows = {r.name: r for r in queue.jobs(("done", "failed", "pending", "running")) if r.name in results}
        first = min(r.submitted_at for r in rows.values())
        offsets = {n: r.submitted_at - first for n, r in rows.items()}
        live_jct = {n: r.ended_at - r.submitted_at for n, r in rows.items()
                    if r.state == "done" and r.ended_at is not None}
        completed = [n for n, res in results.items() if res.get("status") == "completed"]
        lost = sum(max(0, len(results[n].get("losses", [])) - j["train_steps"])
                   for j in jobs for n in [j["name"]] if n in completed)
        resizes = sum(r.resizes for r in rows.values())
        preemptions = sum(r.preemptions for r in rows.values())

        sim = simulate([j for j in jobs if j["name"] in offsets], offsets, cluster, args.policy, factor,
                       startup, args.tick_s)
        sim_jct = {pj["job_id"]: pj["end_s"] - pj["submit_s"] for pj in sim.per_job if pj["end_s"] is not None}
        say(f"{'job':<11} {'steps':>6} {'live JCT s':>11} {'sim JCT s':>10} {'error':>7} "
            f"{'resizes':>7} {'preempt':>7}")
        for j in jobs:
            n = j["name"]
            lj, sj = live_jct.get(n), sim_jct.get(n)
            err = f"{(lj - sj) / sj * 100:+.0f}%" if lj is not None and sj else "-"
            r = rows.get(n)
            say(f"{n:<11} {j['train_steps']:>6} {lj if lj is None else round(lj, 1)!s:>11} "
                f"{sj if sj is None else round(sj, 1)!s:>10} {err:>7} {r.resizes if r else '-':>7} "
                f"{r.preemptions if r else '-':>7}")
        live_avg = sum(live_jct.values()) / len(live_jct) if live_jct else 0.0
        sim_avg = sum(sim_jct[n] for n in live_jct if n in sim_jct) / max(1, sum(n in sim_jct for n in live_jct))
        say(f"live avg JCT {live_avg:.1f} s, simulated {sim_avg:.1f} s "
            f"({(live_avg - sim_avg) / sim_avg * 100 if sim_avg else 0:+.1f}%); {len(completed)}/{len(jobs)} "
            f"completed, {resizes} re-sizes, {preemptions} preemptions, {lost} lost steps "
            f"(wall {time.time() - t0:.0f} s)")
        say(f"command: PYTHONPATH=. python bench/live_replay.py --jobs {args.jobs} --span-s {args.span_s:g} "
            f"--tick-s {args.tick_s:g} --seed {args.seed} --job-s {args.job_s[0]:g} {args.job_s[1]:g} "
            f"--policy {args.policy}")
        if args.json:
            print(json.dumps({"jobs": len(jobs), "completed": len(completed), "live_avg_jct_s": round(live_avg, 2),
                              "sim_avg_jct_s": round(sim_avg, 2), "resizes": resizes,
                              "preemptions": preemptions, "lost_steps": lost}))
        return 0
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


if __name__ == "__main__":
    sys.exit(main())
