"""`frenzy simulate` (trace-driven cluster simulation) and `frenzy workload` (ITP trace -> LLM
training workload CSV). Each command has its own help text (``SIMULATE_HELP``,
``WORKLOAD_HELP``), printed verbatim so the examples stay runnable as shown."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .paths import check_output_file, write_failed

WORKLOAD_HELP = """\
Map the jobs of a Microsoft ITP trace (arrival time, duration, GPU count) to LLM training jobs
(model, sequence length, global batch, tokens) with a mix file and a seed, and write the
workload CSV that `frenzy simulate` reads. The seven ITP traces ship in data/traces/elasticflow/.

examples:
  frenzy workload --trace data/traces/elasticflow/cluster01.csv \\
      --mix examples/workload-mix.yaml --seed 1 --max-jobs 300 --out w01.csv
  frenzy workload --trace data/traces/elasticflow/cluster05.csv \\
      --mix examples/workload-mix.yaml --seed 0 --max-jobs 400 --time-scale 8 --out w05.csv
"""

SIMULATE_HELP = """\
Simulate a workload CSV (from `frenzy workload`) on a cluster file under one scheduling policy,
or several side by side, and report job completion times, queueing, GPU utilisation and
scheduler time per round.

examples:
  frenzy simulate --workload w01.csv --cluster examples/clusters/small-3type.yaml \\
      --policy frenzy --json
  frenzy simulate --workload w01.csv --cluster examples/clusters/small-3type.yaml \\
      --compare frenzy,frenzy-paper,gavel,sia,fifo-user --plot jct.png
"""


def register(sub) -> None:
    p = sub.add_parser("simulate", help="simulate a workload on a cluster under one or more policies",
                       description=SIMULATE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True, help="workload CSV (see `frenzy workload`)")
    p.add_argument("--cluster", required=True, help="cluster YAML (pools of GPU types)")
    p.add_argument("--policy", default="frenzy", help="scheduling policy (default: frenzy; a name it does not know is refused with the "
                        "list of known ones)")
    p.add_argument("--compare", help="comma-separated policies to run side by side (overrides --policy)")
    p.add_argument("--seed", type=int, default=0, help="seed of the truth noise (default 0)")
    p.add_argument("--noise", type=float, default=0.1,
                   help="lognormal sigma of real vs predicted step time and peak memory (default 0.1)")
    p.add_argument("--startup-s", type=float, default=60.0,
                   help="seconds every (re)start spends launching / restoring before training (default 60)")
    p.add_argument("--tick-s", type=float, default=300.0,
                   help="periodic tick of event-driven policies while jobs wait (default 300)")
    p.add_argument("--world-round-s", type=float, default=None,
                   help="a round-based world: arrivals seen and GPUs freed only every N s (Sia's simulator: 60)")
    p.add_argument("--plot", help="with --compare: write the JCT CDF and queue-length figure here (PNG)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (with --compare: a list, one object per policy)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(handler=handle_simulate)

    w = sub.add_parser("workload", help="map an ITP trace to an LLM training workload CSV",
                       description=WORKLOAD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    w.add_argument("--trace", required=True, help="ElasticFlow/ITP trace CSV (job_id,submission_time,duration,num_gpu)")
    w.add_argument("--mix", required=True, help="mix YAML (see examples/workload-mix.yaml)")
    w.add_argument("--seed", type=int, default=0, help="seed of the model/shape draws (default 0)")
    w.add_argument("--out", required=True, help="workload CSV to write")
    w.add_argument("--max-jobs", type=int, help="keep the first N trace jobs (after --start-s)")
    w.add_argument("--start-s", type=float, help="first trace submission_time to keep")
    w.add_argument("--end-s", type=float, help="keep trace jobs submitted before this time")
    w.add_argument("--time-scale", type=float,
                   help="divide arrival times by this (>1 compresses them: heavier load)")
    w.set_defaults(handler=handle_workload)


def _policies(args) -> list[str]:
    from estimator.errors import FrenzyInputError
    from scheduler.policies import policy_factory
    flag = "compare" if args.compare else "policy"
    names = [n.strip() for n in (args.compare or args.policy).split(",")]
    if not any(names):
        raise FrenzyInputError(flag, "give at least one policy")
    if not all(names):
        raise FrenzyInputError(flag, f"an empty policy name in {args.compare or args.policy!r}")
    for n in names:
        policy_factory(n)                 # raises naming the known policies
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise FrenzyInputError(flag, f"{', '.join(twice)} named twice (a policy's run is the same every time)")
    return names


def handle_simulate(args) -> int:
    from estimator.errors import FrenzyInputError
    from scheduler.cluster import load_cluster
    from scheduler.sim import SimConfig, simulate
    from scheduler.sim.engine import SimCluster
    from scheduler.workload import read_workload

    show = not args.no_progress and sys.stderr.isatty()
    try:        # the simulator's own checks (finite, physical), named as the flags, before anything runs
        cfg = SimConfig(seed=args.seed, noise=args.noise, startup_s=args.startup_s, tick_s=args.tick_s,
                        progress=show, world_round_s=args.world_round_s)
    except FrenzyInputError as err:
        raise FrenzyInputError(err.field.replace("_", "-"), err.rule) from None
    if args.plot and not args.compare:
        raise FrenzyInputError("plot", "needs --compare (one figure compares policies)")
    if args.plot:
        plot = check_output_file("plot", args.plot)
        if plot.suffix.lower() not in ("", ".png"):
            raise FrenzyInputError("plot", f"writes a PNG: the name must end in .png (got {plot.suffix!r})")
        args.plot = str(plot.with_suffix(".png"))     # what matplotlib writes for a bare name
    names = _policies(args)
    # validate everything before simulating anything
    cluster = load_cluster(args.cluster)
    jobs = read_workload(args.workload, extra_gpu_types=cluster.gpu_types)
    sim_cluster = SimCluster.from_cluster(cluster)
    book = sim_cluster.plan_book()
    results = [simulate(jobs, sim_cluster, name, config=cfg, plan_book=book) for name in names]
    if args.json:
        payload = [r.summary() for r in results]
        print(json.dumps(payload[0] if not args.compare else payload, indent=None))
        # the contract's keys only on stdout: why jobs did not finish goes to stderr (an
        # average over no completed job reads 0.0 there)
        for r in results:
            note = unfinished_note(r)
            if note:
                print(note, file=sys.stderr)
    else:
        print_table(results, title=f"{args.workload} on {args.cluster} (seed {args.seed}, noise {args.noise})")
    if args.plot:
        from scheduler.sim.plot import plot_comparison
        try:
            out = plot_comparison(results, args.plot, title=f"{args.workload} on {args.cluster}")
        except OSError as err:
            raise write_failed("plot", args.plot, err) from None
        print(f"wrote {out}", file=sys.stderr)
    return 0


def print_table(results, title: str = "") -> None:
    from .console import console
    from rich.table import Table

    t = Table(title=title or None, title_justify="left")
    cols = ["policy", "jobs", "done", "avg JCT h", "p50 h", "p99 h", "makespan h", "avg queue h",
            "GPU util", "OOM", "sched ms p50", "p99", "lower bound h", "preempt", "sim s"]
    for c in cols:
        t.add_column(c, justify="left" if c == "policy" else "right")
    for r in results:
        t.add_row(r.policy, str(r.jobs), str(r.completed), f"{r.avg_jct_s / 3600:.2f}",
                  f"{r.p50_jct_s / 3600:.2f}", f"{r.p99_jct_s / 3600:.2f}", f"{r.makespan_s / 3600:.1f}",
                  f"{r.avg_queue_s / 3600:.2f}", f"{r.gpu_util:.2f}", str(r.oom_events),
                  f"{r.sched_ms_p50:.2f}", f"{r.sched_ms_p99:.2f}", f"{r.lower_bound_avg_jct_s / 3600:.2f}",
                  str(r.preemptions), f"{r.sim_wall_s:.1f}")
    con = console()
    con.print(t)
    for r in results:
        note = unfinished_note(r)
        if note:
            con.print(note)
    con.print("GPU-hours idle while a job that could use them waited: "
              + "; ".join(f"{r.policy} {sum(r.idle_waiting_gpu_h.values()):.1f}"
                          + (" (" + ", ".join(f"{g} {v:.1f}" for g, v in r.idle_waiting_gpu_h.items()) + ")"
                             if r.idle_waiting_gpu_h else "") for r in results))
    common = common_jct(results)
    if common:
        n, avgs = common
        con.print(f"avg JCT over the {n} jobs every policy finished: "
                  + ", ".join(f"{p} {v / 3600:.2f} h" for p, v in avgs.items()))


def unfinished_note(r) -> str | None:
    """Why a run's jobs did not all finish, or None when they did."""
    if r.completed >= r.jobs:
        return None
    parts = [(r.rejected, "rejected: no plan fits the cluster's GPUs, or its hosts' memory for offload"),
             (r.failed, "failed: gave up after repeated out-of-memory runs"),
             (r.stranded, "stranded: still queued or running when the simulation stopped")]
    why = "; ".join(f"{n} {text}" for n, text in parts if n)
    return f"{r.policy}: {r.completed}/{r.jobs} done, {r.jobs - r.completed} not ({why or 'reason not recorded'})"


def common_jct(results) -> tuple[int, dict[str, float]] | None:
    """(jobs every policy finished, policy -> their mean JCT in s) when the policies finished
    different sets of jobs (their own averages then compare different jobs); else None."""
    done = [{j["job_id"]: j["end_s"] - j["submit_s"] for j in r.per_job if j["state"] == "done"}
            for r in results]
    if len(results) < 2 or all(set(d) == set(done[0]) for d in done):
        return None
    ids = set.intersection(*(set(d) for d in done))
    if not ids:
        return 0, {}
    return len(ids), {r.policy: sum(d[i] for i in ids) / len(ids) for r, d in zip(results, done)}


def handle_workload(args) -> int:
    from estimator.errors import FrenzyInputError, check_number
    from scheduler.workload import MAX_SCALE, load_mix, map_trace, read_trace, write_workload

    out = check_output_file("out", args.out)
    for name, path in (("trace", args.trace), ("mix", args.mix)):
        if out.exists() and Path(path).exists() and out.resolve() == Path(path).resolve():
            raise FrenzyInputError("out", f"{args.out} is the --{name} file; writing it would destroy the input")
    check_number("seed", args.seed, low_open=False, integer=True)     # as `frenzy simulate --seed`
    mix = load_mix(args.mix)
    for attr, flag, val, kw in (("max_jobs", "max-jobs", args.max_jobs, {"integer": True}),
                                ("start_s", "start-s", args.start_s, {"low_open": False}),
                                ("end_s", "end-s", args.end_s, {}),
                                ("time_scale", "time-scale", args.time_scale, {"high": MAX_SCALE})):
        if val is not None:
            setattr(mix, attr, check_number(flag, val, **kw))
    skipped: list[str] = []
    trace = read_trace(args.trace, skipped)
    if skipped:
        print(f"frenzy workload: left out {len(skipped)} trace row{'s' if len(skipped) != 1 else ''} of jobs that "
              f"never ran on a GPU (duration 0 or num_gpu 0), e.g. {skipped[0]!r}", file=sys.stderr)
    show = sys.stderr.isatty()
    if show:
        from .console import console
        from rich.progress import Progress
        with Progress(console=console(stderr=True), transient=True) as prog:
            task = prog.add_task("mapping trace jobs", total=len(trace))
            jobs = map_trace(trace, mix, args.seed, progress=lambda n: prog.update(task, completed=n))
    else:
        jobs = map_trace(trace, mix, args.seed)
    try:
        write_workload(jobs, args.out)
    except OSError as err:
        raise write_failed("out", args.out, err) from None
    n_gpu = sum(j.requested_gpus for j in jobs)
    print(f"wrote {len(jobs)} jobs to {args.out} (seed {args.seed}, reference {mix.reference_gpu}, "
          f"{n_gpu} requested GPUs in total)", file=sys.stderr)
    return 0
