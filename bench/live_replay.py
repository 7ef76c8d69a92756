"""Live matches simulated: replay a workload of tiny jobs through the real live path and through
`frenzy simulate`'s engine, and compare job completion times.

Live path: a real Prefect server (`prefect server start`), a SQLite ledger, `frenzy scheduler`
(the same round as the simulator), one `frenzy-submit` flow run per job started at its arrival
time, whose training is a flow run of the pool's `frenzy-train-<pool>` deployment executed by a
process worker the bench starts for each pool of the cluster (`prefect worker start --pool
<pool>`, as a site does; its own process tree, stopped at the end): the tiny GPT-2 on the local
CPU "GPUs". Re-sizes and preemptions are decided by the policy and carried out through the
ledger and the control file.

Calibration, before the workload, from two live jobs run alone (measured, never fitted to the
workload's result):
  A. a job the scheduler places (one device): its mean step time (from its run log, the first
     few steps left out; the trainer reports the median, which leaves out the stalls a run
     really has and the simulator must charge), and its start-up overhead,
     everything in its JCT beyond its steps (enqueue -> allocation, launch and model build,
     the final save): the simulator's ``startup_s``;
  B. a job started the same way that the bench asks, through the ledger, to grow onto the
     2-device plan the policy itself would grow a run onto: its step time there, and what the
     re-size cost (stop at a step boundary, checkpoint, relaunch, first step): the
     simulator's ``restart_s``.
The measured step time over the throughput model's prediction, per GPU count, is the
simulator's ``step_ratio`` (its truth; the policy predicts with the model in both worlds, from
the very plans the live jobs were queued with). Then the engine of `frenzy simulate` runs the
same workload (same arrival offsets, steps, plans and policy) and the per-job JCTs are compared.

The workload: the first job is long, sized by asking the policy itself (the smallest run it
would grow onto the idle second device at its first tick, times a margin), alone for a few
ticks so the policy can decide that growth; the others (``--job-s`` seconds on one device)
arrive over ``--span-s`` after that gap. ``--job-s`` includes the start-up, ~23 s a launch
through a worker on a quiet 2-core machine, so the contract's 20-90 s jobs are:

    PYTHONPATH=. python bench/live_replay.py --jobs 12 --span-s 150 --job-s 60 90 --json

Calibration jobs, not the workload's first job: the long job is the first workload job, and its
JCT is the largest term of the average the bench compares, so its own step times would make
that comparison agree by construction. The calibration jobs run under the same control plane
(Prefect server, scheduler, their own flow process) but without the waiting submissions, which
cost ~7 ms of CPU a second each (below).

Where the CPU goes: over the workload phase the bench samples, every second, the CPU-seconds
the kernel charged (``/proc/<pid>/stat`` utime + stime; ``bench/proc_cpu.py``) to the Prefect
server, the scheduler, each submitting flow process by its job's state (before its arrival,
waiting, running, ended) and the trainings it launched, and prints them with what the whole
machine was busy meanwhile (other sessions' processes included: CPU-seconds, unlike wall
times, stay valid on a shared machine). Measured with ``--jobs 8 --span-s 20 --job-s 10 15
--long-steps 6000`` (docs/benchmarks.md): the Prefect server ~0.07 cores, the scheduler ~0.01,
a waiting submission ~0.007 (its wait task's start included), a running job's flow process ~0.07 (MLflow's per-step metrics,
the rank output pump, the progress artifact), the trainings' own processes the rest.

`--json`: the last line is {"jobs", "completed", "live_avg_jct_s", "sim_avg_jct_s", "resizes",
"preemptions", "lost_steps"} (workload jobs only, calibration jobs left out). The submissions
themselves are not runs of the control pool's worker: each is a process of the bench that starts
before the calibration, imports what its flow imports lazily (``WARM_MODULES``) and calls the
`frenzy-submit` flow at its arrival time, so the arrival times are the workload's, and process
start-up does not steal the cores from running trainings. Each training's flow-run process
(started by the pool's worker at its pickup) is the real one: its start-up is in every JCT, the
calibration job's included.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
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
# Calibration job lengths (steps): A long enough for a steady median step time (~10 s at the
# 15.6 ms/step measured before), B long enough that it has stepped on one device before the
# grow request and steps well past its relaunch on two
CALIB_A_STEPS = 600
CALIB_B_STEPS = 1000
CALIB_B_GROW_AT = 300          # B's grow request once the heartbeat reports this many steps
# The long job: the smallest one the policy grows at its first tick, times this. The live
# tick lands up to a poll (0.5 s) plus a round after the simulated one, and the policy's
# predicted remaining time shrinks meanwhile; 10% (~35 s of its run) keeps the decision
# clear of its threshold
LONG_MARGIN = 1.1
GAP_TICKS = 3                  # ticks the long job runs alone before the first other arrival


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


# What a submission imports lazily once its flow runs (Prefect's parameter encoding pulls in
# fastapi; the ledger, SQLAlchemy, the policies, the trainer's runner, MLflow's client and store):
# ~3.6 CPU-s measured per process, which a process would otherwise take from the running trainings
# at its arrival and its training's start. Every submission, calibration ones too, imports them
# before its flow starts, so none of it is inside a JCT the bench compares
WARM_MODULES = ("fastapi.encoders", "prefect.flow_engine", "prefect.task_engine", "prefect.artifacts",
                "ledger", "ledger.queue", "scheduler.policies", "estimator.plan_filter", "frenzy_scheduler",
                "frenzy_scheduler.publish", "frenzy_flows.training", "trainer.runner", "trainer.tracking", "mlflow.tracking",
                "mlflow.store.tracking.sqlalchemy_store")


def _warm_imports() -> None:
    import importlib

    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:           # an optional one missing: the flow imports what it needs
            pass


def start_workers(cluster, env: dict, work: Path, timeout_s: float = 120.0) -> list[subprocess.Popen]:
    """One process worker per pool of ``cluster`` (one per node queue for a pool of several
    nodes), each the command a site runs, in its own session so its flow-run processes and
    their trainings can be stopped with it (``stop_tree``); returns once every pool has a worker
    online."""
    from deployments.pools import node_queue_name
    from frenzy_flows import dispatch

    prefect_bin = str(Path(sys.executable).with_name("prefect"))
    workers = []
    for pool in cluster.pools:
        queues = [node_queue_name(pool.name, i) for i in range(pool.nodes)] if pool.nodes > 1 else [None]
        for q in queues:
            cmd = [prefect_bin, "worker", "start", "--pool", pool.name, *(["--work-queue", q] if q else [])]
            workers.append(subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True, stderr=subprocess.STDOUT,
                                            stdout=open(work / f"worker-{q or pool.name}.log", "w")))
    end = time.time() + timeout_s
    for pool in cluster.pools:
        while dispatch.workers_online(pool.name) < (pool.nodes if pool.nodes > 1 else 1):
            if time.time() > end or any(w.poll() is not None for w in workers):
                raise RuntimeError(f"no worker of pool {pool.name} came online within {timeout_s:.0f} s "
                                   f"(logs in {work})")
            time.sleep(0.5)
    return workers


def _descendants(pid: int) -> list[int]:
    """Every live process under ``pid`` (procfs)."""
    from bench.proc_cpu import descendants

    return [q for q in descendants({pid}) if q != pid]


def stop_tree(p: subprocess.Popen, grace_s: float = 30.0) -> list[int]:
    """Stop ``p`` and every process under it (its session's group and any descendant that left
    it): SIGTERM, then SIGKILL after ``grace_s``. Returns the pids still alive after that. A
    ``p`` already reaped: its group only (its pid may be another process's by now)."""
    tree = [p.pid, *_descendants(p.pid)] if p.poll() is None else []

    def signal_all(sig) -> None:
        for pid in tree:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(p.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def running(pid: int) -> bool:          # a zombie (exited, not yet reaped) counts as stopped
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                return f.read().decode(errors="replace").rsplit(")", 1)[-1].split()[0] != "Z"
        except OSError:
            return False

    def alive() -> list[int]:
        p.poll()
        return [pid for pid in tree if running(pid)]

    signal_all(signal.SIGTERM)
    end = time.time() + grace_s
    while alive() and time.time() < end:
        time.sleep(0.2)
    if alive():
        signal_all(signal.SIGKILL)
        time.sleep(0.5)
    p.poll()
    return alive()


def submit_one(job_file: str, out_file: str, cluster: str, ledger: str, policy: str,
               go_file: str | None, at: float | None) -> int:
    """One submission (run in its own process): the frenzy-submit flow, result JSON to a file.
    With ``go_file``: import first, then wait until the bench writes the workload's start epoch
    there, and submit ``at`` seconds after it."""
    from frenzy_flows import submit_training

    _warm_imports()
    if go_file:
        Path(out_file + ".ready").write_text("")     # imported: the bench says go once all are
        go = Path(go_file)
        parent = os.getppid()
        while not go.exists():
            if os.getppid() != parent:          # the bench died: nobody will say go
                return 1
            time.sleep(0.2)
        start = float(go.read_text())
        time.sleep(max(0.0, start + (at or 0.0) - time.time()))
    job = json.loads(Path(job_file).read_text())
    try:
        res = submit_training(job=job, cluster=cluster, ledger_url=ledger, policy=policy,
                              embedded_scheduler=False, wait_timeout_s=1800)
        Path(out_file).write_text(res.model_dump_json())
        return 0
    except Exception as err:
        Path(out_file).write_text(json.dumps({"status": "failed", "error": str(err)}))
        return 1


def _spawn_submit(work: Path, job: dict, env: dict, cluster: str, ledger: str, policy: str,
                  go: Path | None = None, at: float | None = None):
    jf = work / f"{job['name']}.job.json"
    jf.write_text(json.dumps(job))
    out = work / f"{job['name']}.result.json"
    log = open(work / f"{job['name']}.log", "w")
    cmd = [sys.executable, __file__, "--submit-one", str(jf), "--out", str(out), "--cluster", cluster,
           "--ledger", ledger, "--policy", policy]
    if go is not None:
        cmd += ["--go", str(go), "--at", str(at or 0.0)]
    p = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    return p, out


def _run_alone(work: Path, job: dict, env: dict, cluster: str, ledger: str, policy: str, timeout_s: float,
               procs: list, during=None) -> dict:
    """Submit ``job`` and wait for its result; ``during(queue_row)`` is called every 0.2 s while
    it runs (it returns True once it acted)."""
    from ledger.queue import JobQueue

    p, out = _spawn_submit(work, job, env, cluster, ledger, policy)
    procs.append(p)
    queue = JobQueue(ledger)
    end = time.time() + timeout_s
    acted = during is None
    while p.poll() is None and time.time() < end:
        if not acted:
            row = next((r for r in queue.jobs(("running",), plans=False) if r.name == job["name"]), None)
            acted = row is not None and bool(during(row))
        time.sleep(0.2)
    p.wait(timeout=max(1.0, end - time.time()))
    res = json.loads(out.read_text())
    if res.get("status") != "completed":
        raise RuntimeError(f"calibration job {job['name']} failed: {res.get('error')}")
    return res


# Steps at the start of a launch left out of its mean step time: the first iterations allocate
# and warm up (their time is in the start-up or re-size cost the bench derives from the JCT)
WARMUP_STEPS = 5


def mean_step_s(res: dict) -> float | None:
    """The mean step time of the last launch of a calibration job, from the step lines of its run
    log (each step's own time, as the program measured it). The simulator charges a job steps x
    this, so the stalls a run really has (interference, a slow step now and then) count; the
    trainer's reported figure is the median, which leaves them out: the 2-rank median was 11%
    under the mean in a calibration job measured (0.0128 vs 0.0140 s)."""
    run_dir = res.get("run_dir")
    logs = sorted(Path(run_dir).glob("attempt-*.log"), key=lambda p: p.stat().st_mtime) if run_dir else []
    if not logs:
        return None
    times = []
    for line in logs[-1].read_text(errors="replace").splitlines():
        if line.startswith("FRENZY_MODEL "):       # a launch begins: only the last one counts
            times = []
        elif line.startswith("FRENZY_STEP "):
            try:
                dt = json.loads(line.split(" ", 1)[1]).get("step_time_s")
            except ValueError:
                continue
            if dt:
                times.append(float(dt))
    times = times[WARMUP_STEPS:]
    return sum(times) / len(times) if times else None


def long_job_steps(policy_name: str, plans: list, start_plan, cluster_path: str, tick_s: float,
                   at_least: int):
    """The smallest job (steps) that ``policy_name`` grows, alone on the pool, at its first
    tick after it started on ``start_plan``, asked of the policy itself (one round on a state
    with that run and the other devices idle); and the plan it grows onto. (None, None) when
    it grows no run of any length up to 100x ``at_least``."""
    from scheduler.cluster import load_cluster
    from scheduler.policies import get_policy
    from scheduler.restart import checkpoint_gb
    from scheduler.sim.jobs import model_spec
    from scheduler.sim.engine import SimCluster
    from scheduler.types import ClusterState, JobRequest, Node, RunningJob

    sc = SimCluster.from_cluster(load_cluster(cluster_path))
    node = sc.nodes[0]
    ckpt = checkpoint_gb(model_spec(BASE_JOB["model"]).params)

    def grows(steps: int):
        used = list(range(start_plan.gpus))
        nodes = [Node(node.node_id, node.pool, node.gpu_type, node.gpus,
                      [i for i in range(node.gpus) if i not in used], node.intra_link)]
        req = JobRequest(job_id="long", submit_s=0.0, plans=plans, steps_left=steps, model=BASE_JOB["model"],
                         checkpoint_gb=ckpt)
        rj = RunningJob(job_id="long", plan=start_plan, placement={node.node_id: used}, start_s=0.0,
                        expected_end_s=steps * start_plan.step_time_s, request=req)
        state = ClusterState(nodes=nodes, running=[rj], inter_node_gbps=dict(sc.inter_node_gbps),
                             gpu_memory_gib={t: g.memory_gib for t, g in sc.gpus.items()})
        out = get_policy(policy_name).schedule([], state, tick_s)
        return next((d.plan for d in out if d.job_id == "long" and d.action == "start"), None)

    steps = max(1, at_least)
    while steps <= 100 * max(1, at_least):
        plan = grows(steps)
        if plan is not None:
            return steps, plan
        steps = int(steps * 1.05) + 1
    return None, None


def workload(n: int, span_s: float, step_s: float, startup_s: float, seed: int, long_steps: int,
             gap_s: float, job_s: tuple[float, float] = (20.0, 90.0)) -> list[dict]:
    """The long job at 0 (``long_steps``), then ``n - 1`` jobs of ``job_s`` seconds each on one
    device at the calibrated speed (start-up included), arriving uniformly over ``span_s``
    after ``gap_s``."""
    rng = random.Random(seed)
    jobs = [{**BASE_JOB, "name": "replay-00", "train_steps": long_steps, "_at": 0.0}]
    lo, hi = job_s
    for i in range(1, n):
        target = rng.uniform(lo, hi)
        steps = max(10, int(round((target - startup_s) / step_s)))
        at = gap_s + rng.uniform(0.0, 1.0) * span_s
        jobs.append({**BASE_JOB, "name": f"replay-{i:02d}", "train_steps": steps, "_at": at})
    jobs.sort(key=lambda j: j["_at"])
    return jobs


class LivePlans:
    """The simulator's plan book for the replay: every job gets the plans the live submission
    queued (all replay jobs share one shape), so both worlds' policy sees the same menu."""

    def __init__(self, plans: list):
        self._plans = plans

    def plans(self, model: str, seq_len: int, global_batch: int) -> list:
        return self._plans


def simulate(jobs: list[dict], offsets: dict[str, float], cluster_path: str, policy: str, plans: list,
             step_ratio: dict, startup_s: float, restart_s: float, tick_s: float):
    from scheduler.cluster import load_cluster
    from scheduler.sim.engine import SimCluster, SimConfig, Simulator
    from scheduler.policies import get_policy
    from scheduler.workload import WorkloadJob

    cluster = SimCluster.from_cluster(load_cluster(cluster_path))
    wl = [WorkloadJob(job_id=j["name"], submit_s=offsets[j["name"]], model=j["model"], seq_len=j["seq_len"],
                      global_batch=j["global_batch"], train_tokens=j["train_steps"] * j["global_batch"] * j["seq_len"],
                      requested_gpu_type="CPU", requested_gpus=1) for j in jobs]
    cfg = SimConfig(seed=0, noise=0.0, startup_s=startup_s, tick_s=tick_s, step_ratio=dict(step_ratio),
                    restart_s=restart_s)
    return Simulator(wl, cluster, get_policy(policy), cfg, plan_book=LivePlans(plans)).run()


def compare(jobs: list[dict], results: dict[str, dict], queue, cluster: str, policy: str, plans: list,
            step_ratio: dict, startup: float, restart: float, tick_s: float, say) -> dict:
    """The live rows and results of ``jobs`` against the simulator on the same workload: prints
    the per-job table and the totals, returns the ``--json`` summary."""
    from ledger.queue import ACTIVE, ENDED
    rows = {r.name: r for r in queue.jobs(ACTIVE + ENDED, plans=False) if r.name in results}
    first = min(r.submitted_at for r in rows.values())
    offsets = {n: r.submitted_at - first for n, r in rows.items()}
    live_jct = {n: r.ended_at - r.submitted_at for n, r in rows.items()
                if r.state == "done" and r.ended_at is not None}
    completed = [n for n, res in results.items() if res.get("status") == "completed"]
    lost = sum(max(0, len(results[n].get("losses", [])) - j["train_steps"])
               for j in jobs for n in [j["name"]] if n in completed)
    resizes = sum(r.resizes for r in rows.values())
    preemptions = sum(r.preemptions for r in rows.values())
    starts = sum(len(results[n].get("attempts") or []) for n in results)

    sim = simulate([j for j in jobs if j["name"] in offsets], offsets, cluster, policy, plans,
                   step_ratio, startup, restart, tick_s)
    # the engine counts every stop of a run as a preemption, re-sizes included: split them
    sim_by = {pj["job_id"]: {**pj, "preemptions": pj["preemptions"] - pj["resizes"]} for pj in sim.per_job}
    sim_jct = {n: pj["end_s"] - pj["submit_s"] for n, pj in sim_by.items() if pj["end_s"] is not None}
    say(f"{'job':<11} {'steps':>6} {'arrive s':>8} {'live JCT s':>11} {'sim JCT s':>10} {'error':>7} "
        f"{'starts':>6} {'resizes':>7} {'preempt':>7}  (live / sim)")
    for j in jobs:
        n = j["name"]
        lj, sj = live_jct.get(n), sim_jct.get(n)
        err = f"{(lj - sj) / sj * 100:+.0f}%" if lj is not None and sj else "-"
        r, pj = rows.get(n), sim_by.get(n, {})
        st = len(results.get(n, {}).get("attempts") or [])
        say(f"{n:<11} {j['train_steps']:>6} {offsets.get(n, 0):>8.1f} {lj if lj is None else round(lj, 1)!s:>11} "
            f"{sj if sj is None else round(sj, 1)!s:>10} {err:>7} {st:>3}/{pj.get('starts', '-'):<2} "
            f"{r.resizes if r else '-':>4}/{pj.get('resizes', '-'):<2} {r.preemptions if r else '-':>4}/"
            f"{pj.get('preemptions', '-'):<2}")
    live_avg = sum(live_jct.values()) / len(live_jct) if live_jct else 0.0
    sim_avg = sum(sim_jct[n] for n in live_jct if n in sim_jct) / max(1, sum(n in sim_jct for n in live_jct))
    say(f"live avg JCT {live_avg:.1f} s, simulated {sim_avg:.1f} s "
        f"({(live_avg - sim_avg) / sim_avg * 100 if sim_avg else 0:+.1f}%); {len(completed)}/{len(jobs)} "
        f"completed; live {starts} starts, {resizes} re-sizes, {preemptions} preemptions, {lost} lost steps; "
        f"simulated {sum(pj['starts'] for pj in sim_by.values())} starts, "
        f"{sum(pj['resizes'] for pj in sim_by.values())} re-sizes, "
        f"{sum(pj['preemptions'] for pj in sim_by.values())} preemptions")
    return {"jobs": len(jobs), "completed": len(completed), "live_avg_jct_s": round(live_avg, 2),
            "sim_avg_jct_s": round(sim_avg, 2), "resizes": resizes, "preemptions": preemptions, "lost_steps": lost}


def control_plane_cpu(server, sched, workers, running, queue):
    """Start sampling the CPU-seconds of every process of the workload phase (``bench.proc_cpu``):
    the Prefect server, the scheduler, each submitting flow process by its job's state
    (before its arrival, waiting, running, ended), the pool workers, their flow-run processes
    and the trainings those launched, and this bench itself."""
    from bench.proc_cpu import ProcCpu
    from ledger.queue import ACTIVE, ENDED

    by_pid = {p.pid: j["name"] for j, p, _ in running}
    states: dict[str, str] = {}
    label = {"pending": "waiting", "running": "running", **dict.fromkeys(ENDED, "ended")}

    def read_states() -> None:
        try:
            states.update({r.name: label.get(r.state, r.state)
                           for r in queue.jobs(ACTIVE + ENDED, plans=False)})
        except Exception:            # a busy database: last sample's states stand
            pass

    worker_pids = {w.pid for w in workers}

    def classify(pid: int, root: int, cmd: str) -> str:
        if root == server.pid:
            return "prefect server"
        if root == sched.pid:
            return "scheduler"
        if root == os.getpid():
            return "bench (sampler, this process)"
        if pid == root:
            return "pool worker" if root in worker_pids else "submit flow process"
        if "torchrun" in cmd or "torch.distributed.run" in cmd:
            return "training launcher"
        if "prefect.engine" in cmd:             # what a process worker starts for each flow run
            return "train flow-run processes (worker's)"
        return "training ranks" if root in worker_pids else "submit flow children"

    def phase(root: int) -> str:
        name = by_pid.get(root)
        return "" if name is None else states.get(name, "before arrival")

    return ProcCpu(lambda: [os.getpid(), server.pid, sched.pid, *worker_pids, *by_pid], classify, period_s=1.0,
                   phase=phase, before=read_states).start()


def worker_pickups() -> dict[str, list[float]]:
    """Job name -> seconds from each of its training flow runs' scheduled start to its Running
    state: the worker's poll (``PREFECT_WORKER_QUERY_SECONDS``, 10 s by default) plus the start of
    the flow-run process up to the engine's first state, a part of every start-up a job pays."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    out: dict[str, list[float]] = {}
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["frenzy"])),
                                     limit=200)
    for fr in runs:
        name = next((t.removeprefix("job:") for t in fr.tags if t.startswith("job:")), None)
        if name and fr.start_time and fr.expected_start_time:
            out.setdefault(name, []).append((fr.start_time - fr.expected_start_time).total_seconds())
    return out


def say_pickups(pickups: dict[str, list[float]], names: list[str], say) -> None:
    calib = [f"{n} {v:.1f} s" for n in ("calibrate", "calibrate-resize") for v in pickups.get(n, [])]
    work = [v for n in names for v in pickups.get(n, [])]
    if work:
        say(f"worker pickup (scheduled -> Running) per training flow run: workload mean {sum(work) / len(work):.1f} s "
            f"(min {min(work):.1f}, max {max(work):.1f}, {len(work)} runs); calibration {', '.join(calib) or '-'}")


def say_cpu(cpu, wall_s: float, say, jobs: dict[int, str]) -> None:
    rep = cpu.report()
    ours = sum(rep.values())
    say(f"CPU-seconds in the workload phase ({wall_s:.0f} s wall, {cpu.samples} samples; "
        f"machine busy {cpu.machine_busy():.0f} CPU-s, ours {ours:.0f}, others' {cpu.machine_busy() - ours:.0f}: "
        f"{(cpu.machine_busy() - ours) / wall_s:.2f} cores on average, {cpu.others_peak()} over their busiest 10 s):")
    for group, sec in rep.items():
        say(f"  {group:<40} {sec:>8.1f} CPU-s  {sec / wall_s:>5.2f} cores")
    say("  per job: " + "; ".join(f"{name} " + ", ".join(f"{g.removeprefix('submit ')} {s:.1f}"
                                                        for g, s in cpu.report_of(pid).items())
                                  for pid, name in jobs.items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--span-s", type=float, default=150.0, help="arrivals (after the long job's gap) "
                                                                "spread over this many seconds")
    ap.add_argument("--policy", default="frenzy")
    ap.add_argument("--tick-s", type=float, default=10.0, help="the scheduler's tick, live and simulated")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--job-s", type=float, nargs=2, default=(20.0, 40.0), metavar=("LO", "HI"),
                    help="lengths in seconds on one device of the jobs after the long one (default 20 40)")
    ap.add_argument("--timeout-s", type=float, default=1800.0)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--submit-one", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--cluster", help=argparse.SUPPRESS)
    ap.add_argument("--ledger", help=argparse.SUPPRESS)
    ap.add_argument("--go", help=argparse.SUPPRESS)
    ap.add_argument("--at", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--long-steps", type=int, help=argparse.SUPPRESS)   # smoke runs: a short long job
    args = ap.parse_args(argv)
    if args.submit_one:
        return submit_one(args.submit_one, args.out, args.cluster, args.ledger, args.policy, args.go, args.at)
    if not 2 <= args.jobs <= 40:
        print("live_replay: error: jobs: must be within 2..40", file=sys.stderr)
        return 2
    if not args.span_s > 0 or not args.tick_s > 0 or not 0 < args.job_s[0] <= args.job_s[1]:
        print("live_replay: error: span-s and tick-s must be > 0, job-s LO HI with 0 < LO <= HI", file=sys.stderr)
        return 2

    # a SIGTERM (a timeout) still stops the server, the scheduler and the submissions (finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = Path(tempfile.mkdtemp(prefix="frenzy-live-replay-"))
    cluster = str(work / "cluster.yaml")
    Path(cluster).write_text(CLUSTER_YAML)
    ledger = f"sqlite:///{work / 'ledger.db'}"
    from trainer.ports import free_port

    port = free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREFECT_HOME": str(work / "prefect"),
           # the ledger as a site gives it to its workers (docs/fleet.md): a pool run gets no
           # ledger URL from its dispatcher, since a run's parameters would show a password
           "FRENZY_HOME": str(work / "frenzy"), "FRENZY_LEDGER_URL": ledger, "PREFECT_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_LOGGING_LEVEL": "WARNING"}
    os.environ.update({k: env[k] for k in ("PREFECT_HOME", "FRENZY_HOME", "PREFECT_API_URL",
                                           "PREFECT_SERVER_ANALYTICS_ENABLED")})
    prefect_bin = str(Path(sys.executable).with_name("prefect"))
    procs: list[subprocess.Popen] = []
    workers: list[subprocess.Popen] = []
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    t0 = time.time()
    try:
        server = subprocess.Popen([prefect_bin, "server", "start", "--host", "127.0.0.1", "--port", str(port),
                                   "--no-ui"], env=env, stdout=open(work / "server.log", "w"),
                                  stderr=subprocess.STDOUT)
        procs.append(server)
        _wait_health(api, 180)
        from deployments.pools import sync_pools
        from ledger.queue import JobQueue
        from scheduler.cluster import load_cluster
        from scheduler.sim.engine import SimCluster
        from scheduler.sim.jobs import StepTimes
        from estimator.plan import Plan

        sync_pools(load_cluster(cluster))
        workers += start_workers(load_cluster(cluster), env, work)
        sched = subprocess.Popen([sys.executable, "-m", "frenzy_cli.main", "scheduler", "--ledger", ledger,
                                  "--cluster", cluster, "--policy", args.policy, "--tick-s", str(args.tick_s)],
                                 env=env, cwd=ROOT, stdout=open(work / "scheduler.log", "w"),
                                 stderr=subprocess.STDOUT)
        procs.append(sched)
        say(f"prefect server {api}, scheduler pid {sched.pid}, {len(workers)} pool worker(s) pid "
            f"{', '.join(str(w.pid) for w in workers)}, work dir {work} ({time.time() - t0:.0f} s)")
        queue = JobQueue(ledger)
        sc = SimCluster.from_cluster(load_cluster(cluster))
        model_steps = StepTimes(sc.gpus)

        def predicted(plan) -> float:            # the throughput model's step time (one node)
            return model_steps.at(BASE_JOB["model"], BASE_JOB["seq_len"], plan, 1, None)

        # --- calibration A: one job alone, placed by the scheduler
        calib_a = {**BASE_JOB, "name": "calibrate", "train_steps": CALIB_A_STEPS}
        res_a = _run_alone(work, calib_a, env, cluster, ledger, args.policy, args.timeout_s, procs)
        row_a = queue.get(res_a["job_id"])
        plans = row_a.plans                         # what the live submission queued
        plan1 = Plan.model_validate(res_a["plan"])
        t1_median = float(res_a["measured"]["step_time_s"])
        t1 = mean_step_s(res_a) or t1_median
        jct_a = row_a.ended_at - row_a.submitted_at
        startup = max(0.0, jct_a - CALIB_A_STEPS * t1)
        queued_a = row_a.started_at - row_a.submitted_at
        say(f"calibration A: {plan1.short()}: step {t1:.4f} s measured (mean; median {t1_median:.4f} s) "
            f"vs {predicted(plan1):.4f} s predicted "
            f"(plan {plan1.step_time_s:.4f} s); JCT {jct_a:.1f} s = queue {queued_a:.1f} s "
            f"+ {CALIB_A_STEPS} steps + {jct_a - queued_a - CALIB_A_STEPS * t1:.1f} s "
            f"launch and end: start-up {startup:.1f} s")

        # the long job and the plan the policy grows it onto, asked of the policy itself
        at_least = int(3 * args.job_s[1] / t1)
        smallest, plan2 = long_job_steps(args.policy, plans, plan1, cluster, args.tick_s, at_least)
        if args.long_steps:
            long_steps = args.long_steps
            say(f"long job: {long_steps} steps (--long-steps; the policy grows runs of >= {smallest})")
        elif smallest is None:
            long_steps, plan2 = at_least, next((p for p in plans if p.gpus > plan1.gpus), None)
            say(f"the policy grows no run alone on the pool (up to {100 * at_least} steps): long job "
                f"{long_steps} steps")
        else:
            long_steps = max(at_least, int(smallest * LONG_MARGIN))
            say(f"long job: the policy grows a run of >= {smallest} steps at its first tick onto "
                f"{plan2.short()}; long job {long_steps} steps (~{long_steps * t1:.0f} s on one device)")

        # --- calibration B: alone, asked to grow onto plan2 after CALIB_B_GROW_AT steps
        restart, t2 = startup, None
        if plan2 is not None:
            node = sc.nodes[0].node_id
            asked: dict = {}

            def grow(row) -> bool:
                if row.steps_done < CALIB_B_GROW_AT or row.open_request:
                    return False
                asked["rid"] = queue.request(row.job_id, "grow", plan=plan2,
                                             placement={node: list(range(plan2.gpus))},
                                             reason="calibration: measure a re-size")
                asked["at_step"] = row.steps_done
                return True

            calib_b = {**BASE_JOB, "name": "calibrate-resize", "train_steps": CALIB_B_STEPS}
            res_b = _run_alone(work, calib_b, env, cluster, ledger, args.policy, args.timeout_s, procs, grow)
            row_b = queue.get(res_b["job_id"])
            att = res_b.get("attempts") or []
            if asked.get("rid") and len(att) >= 2 and att[-1]["plan"]["gpus"] == plan2.gpus:
                s0 = int(att[-1]["resumed_from_step"])
                t2_median = float(res_b["measured"]["step_time_s"])
                t2 = mean_step_s(res_b) or t2_median
                jct_b = row_b.ended_at - row_b.submitted_at
                restart = max(0.0, jct_b - startup - s0 * t1 - (CALIB_B_STEPS - s0) * t2)
                say(f"calibration B: grow asked at step {asked['at_step']}, resumed from {s0} on {plan2.short()}: "
                    f"step {t2:.4f} s measured (mean; median {t2_median:.4f} s) vs {predicted(plan2):.4f} s predicted "
                    f"(plan {plan2.step_time_s:.4f} s); "
                    f"JCT {jct_b:.1f} s = start-up {startup:.1f} + {s0} x {t1:.4f} + {CALIB_B_STEPS - s0} x {t2:.4f} "
                    f"+ re-size {restart:.1f} s")
            else:
                say(f"calibration B: no re-size happened (attempts {[a['plan']['gpus'] for a in att]}); "
                    f"the simulator's restart cost stays the start-up, its 2-device step the model's")
        step_ratio = {(plan1.gpu_type, plan1.gpus): t1 / predicted(plan1)}
        if t2 is not None:
            step_ratio[(plan2.gpu_type, plan2.gpus)] = t2 / predicted(plan2)
        say("step_ratio (measured / model): " + ", ".join(f"{n}x{g} {r:.3f}" for (g, n), r in step_ratio.items()))

        # --- the workload
        gap = GAP_TICKS * args.tick_s
        jobs = workload(args.jobs, args.span_s, t1 * plan1.gpus, startup, args.seed, long_steps, gap,
                        tuple(args.job_s))
        go = work / "go"
        running = []
        for j in jobs:
            spec = {k: v for k, v in j.items() if not k.startswith("_")}
            running.append((j, *_spawn_submit(work, spec, env, cluster, ledger, args.policy, go, j["_at"])))
            procs.append(running[-1][1])
        # every submitting process has imported before the clock starts: one still importing
        # would submit late (a loaded machine once delayed the long job's submission by 35 s,
        # after short jobs due 30 s after it, so the policy never saw it alone)
        ready_by = time.time() + 300.0
        while not all(Path(str(out) + ".ready").exists() or p.poll() is not None for _, p, out in running):
            if time.time() > ready_by:
                raise RuntimeError("the submitting processes did not finish importing within 300 s")
            time.sleep(0.5)
        cpu = control_plane_cpu(server, sched, workers, running, queue)
        start = time.time()
        (work / "go.tmp").write_text(repr(start))
        os.replace(work / "go.tmp", go)          # whole or absent: a reader never sees it empty
        say(f"workload: {len(jobs)} jobs, arrivals over {jobs[-1]['_at']:.0f} s ({time.time() - t0:.0f} s)")
        for j, p, out in running:
            p.wait(timeout=max(1.0, args.timeout_s - (time.time() - start)))
        cpu.stop()
        say_cpu(cpu, time.time() - start, say, {p.pid: j["name"] for j, p, _ in running})
        results = {j["name"]: json.loads(out.read_text()) if out.exists() else {"status": "failed"}
                   for j, _, out in running}
        summary = compare(jobs, results, queue, cluster, args.policy, plans, step_ratio, startup, restart,
                          args.tick_s, say)
        try:
            say_pickups(worker_pickups(), [j["name"] for j in jobs], say)
        except Exception as err:        # only a diagnostic
            say(f"worker pickups unreadable: {type(err).__name__}: {err}")
        say(f"(wall {time.time() - t0:.0f} s)")
        say(f"command: PYTHONPATH=. python bench/live_replay.py --jobs {args.jobs} --span-s {args.span_s:g} "
            f"--tick-s {args.tick_s:g} --seed {args.seed} --job-s {args.job_s[0]:g} {args.job_s[1]:g} "
            f"--policy {args.policy}")
        if args.json:
            print(json.dumps(summary), flush=True)
        return 0
    finally:
        left = [pid for w in workers for pid in stop_tree(w)]     # the trainings under them too
        if workers:
            say(f"pool workers stopped with their flow runs and trainings; "
                f"{'left running: pids ' + str(left) if left else 'no process left'}")
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()


if __name__ == "__main__":
    sys.exit(main())
