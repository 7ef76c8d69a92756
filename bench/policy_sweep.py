"""Try a variant of the ``frenzy`` policy on every `bench/jct.py` block against the baselines'
cached results, in about a minute on 2 cores.

    python bench/policy_sweep.py                                   # the defaults vs sia (fills the cache)
    python bench/policy_sweep.py --set preempt_ratio=2.0           # a variant (flat option names)
    python bench/policy_sweep.py --set recall_min_left_s=120 --seeds 2,3   # held-out seeds only

Every block of `bench/jct.py` (its workloads, built the same way), truth seeds 0-3 by default (0
and 1 are the seeds frenzy's rules were chosen on; 2 and 3 are held out), the event world and
the 60 s round world. The baseline's runs (slow: Sia's ILP on 1,024 GPUs) and frenzy's default
runs are kept in ``out/jct/policy-sweep-cache.json`` keyed by block, seed and world, so a variant
costs only its own simulations (about 1 s each). Per row: the baseline, frenzy's default, the
variant, each relative; then the rows where the variant is behind the baseline, the rows where
it is worse than the default by more than ``--worse`` (a fraction), and the geometric mean of
variant / baseline. A variant is judged on seeds 0-1 and kept only if the held-out seeds agree
(docs/benchmarks.md, "JCT against Sia").

The cache is not cleared when the code changes: ``--fresh`` recomputes it (after a change to the
simulator, the estimator or a baseline).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
from multiprocessing import Pool
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.jct import CLUSTERS, OUT, TUNING_SEEDS, WORKLOADS, _seed_run, make_workload  # noqa: E402

CACHE = OUT / "policy-sweep-cache.json"
ROUND_S = 60.0


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_set(pairs: list[str]) -> dict:
    out = {}
    for p in pairs:
        name, eq, value = p.partition("=")
        if not eq or not name:
            raise SystemExit(f"policy_sweep: error: --set {p!r}: must be NAME=VALUE")
        out[name] = _value(value)
    if out:
        from estimator.errors import FrenzyInputError
        from scheduler.policies import get_policy
        try:
            get_policy("frenzy", **out)       # an unknown option fails here, before any run
        except (FrenzyInputError, TypeError, ValueError) as err:
            raise SystemExit(f"policy_sweep: error: --set: {err}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a frenzy option (flat name, as get_policy takes); repeatable")
    ap.add_argument("--baseline", default="sia")
    ap.add_argument("--seeds", default="0,1,2,3")
    ap.add_argument("--worlds", default="event,60", help="event and/or a round length in s")
    ap.add_argument("--only", default="", help="blocks whose 'workload/cluster' name contains this")
    ap.add_argument("--worse", type=float, default=0.005)
    ap.add_argument("--fresh", action="store_true", help="recompute the cached runs")
    ap.add_argument("--json", action="store_true", help="last line: the summary as JSON")
    args = ap.parse_args(argv)
    options = parse_set(args.set)
    seeds = [int(s) for s in args.seeds.split(",")]
    worlds = [None if w == "event" else float(w) for w in args.worlds.split(",")]
    blocks = [(w, c) for w in WORKLOADS for c in w.flags if args.only in f"{w.name}/{c}"]
    if not blocks:
        raise SystemExit(f"policy_sweep: error: --only {args.only!r}: no block matches")
    cache = {} if args.fresh or not CACHE.exists() else json.loads(CACHE.read_text())
    rows, tasks = [], []
    for w, c in blocks:
        wl, _ = make_workload(w, c)
        for s in seeds:
            for world in worlds:
                key = f"{w.name}/{c}/{s}/{'event' if world is None else f'round{world:g}'}"
                rows.append(key)
                for name, policy, opts in ((args.baseline, args.baseline, {}), ("frenzy", "frenzy", {})):
                    if f"{key}/{name}" not in cache:
                        tasks.append((f"{key}/{name}", (str(wl), CLUSTERS[c], policy, s, world, opts)))
                if options:
                    tasks.append((f"{key}/variant", (str(wl), CLUSTERS[c], "frenzy", s, world, options)))
    with Pool(min(2, os.cpu_count() or 1)) as pool:
        results = pool.map(_seed_run, [t for _, t in tasks])
    variant = {}
    for (key, _), r in zip(tasks, results):
        if key.endswith("/variant"):
            variant[key[:-len("/variant")]] = r
        else:
            cache[key] = r
    CACHE.parent.mkdir(parents=True, exist_ok=True)
    CACHE.write_text(json.dumps(cache))

    behind, worse, logs = [], [], []
    print(f"{'block/seed/world':58s} {args.baseline:>8s} {'frenzy':>8s} {'vs':>7s}"
          + (f" {'variant':>8s} {'vs':>7s} {'vs frenzy':>9s}" if options else ""))
    for key in rows:
        base = cache[f"{key}/{args.baseline}"][0]
        default = cache[f"{key}/frenzy"][0]
        mine = variant[key][0] if options else default
        seed = int(key.split("/")[2])
        mark = "" if seed in TUNING_SEEDS else " (held out)"
        line = f"{key + mark:58s} {base / 3600:8.4f} {default / 3600:8.4f} {default / base - 1:+7.1%}"
        if options:
            line += f" {mine / 3600:8.4f} {mine / base - 1:+7.1%} {mine / default - 1:+9.1%}"
            if mine / default - 1 > args.worse:
                worse.append(key)
        if mine > base:
            behind.append(key)
        logs.append(math.log(mine / base))
        print(line)
    geo = math.exp(sum(logs) / len(logs)) - 1
    who = "variant" if options else "frenzy"
    ooms = sum((variant[k] if options else cache[f"{k}/frenzy"])[1] for k in rows)
    print(f"\n{who} behind {args.baseline} on {len(behind)} of {len(rows)}: {', '.join(behind) or '-'}")
    if options:
        print(f"variant worse than frenzy's defaults by > {args.worse:.1%} on {len(worse)} of {len(rows)}")
    print(f"geometric mean of {who} / {args.baseline}: {geo:+.2%}; {who}'s OOM events: {ooms}")
    print("command: python bench/policy_sweep.py " + " ".join(
        [f"--set {p}" for p in args.set] + ([f"--seeds {args.seeds}"] if args.seeds != "0,1,2,3" else [])
        + ([f"--only {args.only}"] if args.only else [])))
    if args.json:
        print(json.dumps({"rows": len(rows), "behind": len(behind), "worse": len(worse),
                          "geo_mean": round(geo, 4), "oom_events": ooms, "options": options}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
