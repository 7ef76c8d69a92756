"""`frenzy scheduler`: the cluster's live scheduler, a long-lived process a site starts once
(beside `prefect worker start`). It runs the same cluster-wide round as `frenzy simulate`
(``scheduler.round.run_round``) over the ledger: on every submission and completion and on a
tick, it places queued jobs and re-sizes or preempts running ones through requests their runs
act on. Exactly one scheduler acts at a time: a second one stands by and takes over within the
leadership TTL when the first dies. With a Prefect server configured (PREFECT_API_URL, in the
environment or the active Prefect profile) it emits an event for every decision and keeps the
queue as the `frenzy-queue` artifact."""
from __future__ import annotations

import logging
import signal
import sys


def register(sub) -> None:
    p = sub.add_parser("scheduler", help="run the live scheduler (one per cluster; others stand by)",
                       description=__doc__)
    p.add_argument("--ledger", help="ledger SQLAlchemy URL (default: env FRENZY_LEDGER_URL, else "
                                    "SQLite under .frenzy/)")
    p.add_argument("--cluster", help="cluster YAML to sync into the ledger first (default: use the "
                                     "pools already in the ledger)")
    p.add_argument("--policy", default="frenzy", help="scheduling policy (default: frenzy; a name it does not know is refused with the "
                        "list of known ones)")
    p.add_argument("--tick-s", type=float, default=None,
                   help="round tick while jobs wait or GPUs idle (default: 30)")
    p.add_argument("--ttl-s", type=float, default=None, help="leadership lease TTL (default: 15)")
    p.add_argument("--poll-s", type=float, default=None, help="how often the ledger is read (default: 0.5)")
    p.add_argument("--max-s", type=float, default=None, help="exit after this many seconds (default: run until stopped)")
    p.add_argument("--no-publish", action="store_true",
                   help="no Prefect events or queue artifact even when a Prefect server is configured")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from estimator.errors import FrenzyInputError, check_number
    from scheduler.policies import policy_factory

    from scheduler.round import MIN_TICK_S
    for name in ("tick_s", "ttl_s", "poll_s", "max_s"):
        if getattr(args, name) is not None:
            check_number(name.replace("_", "-"), getattr(args, name),
                         **(dict(low=MIN_TICK_S, low_open=False, what="seconds") if name == "tick_s" else {}))
    policy_factory(args.policy)
    topology = None
    if args.cluster:
        from scheduler.cluster import load_cluster

        topology = load_cluster(args.cluster)

    from frenzy_scheduler import service as svc_mod
    from ledger import Ledger

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)      # one line per Prefect API call otherwise
    ledger = Ledger(args.ledger)
    if topology is not None:
        ledger.sync_cluster(topology)
    if not ledger.cluster_state().nodes:
        raise FrenzyInputError("cluster", "the ledger has no pools: give --cluster (a cluster YAML) once")
    publish = on_queue = None
    if not args.no_publish and _prefect_api_url():
        from frenzy_scheduler.publish import emit_decision, publish_queue

        publish, on_queue = emit_decision, publish_queue
    kw = {k: v for k, v in (("tick_s", args.tick_s), ("ttl_s", args.ttl_s), ("poll_s", args.poll_s))
          if v is not None}
    svc = svc_mod.SchedulerService(ledger, args.policy, publish=publish, on_queue=on_queue, **kw)
    got = {"signal": None}

    def on_term(signum, _frame):
        got["signal"] = signum
        svc.stop()

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print(f"frenzy scheduler: {svc.leadership.holder} on {ledger.url.split('@')[-1]} "
          f"(policy {args.policy}, lease TTL {svc.ttl_s:.0f} s, tick {svc.tick_s:.0f} s)", file=sys.stderr)
    svc.run(max_s=args.max_s)
    if got["signal"] is not None:
        print(f"frenzy scheduler: stopped by signal {got['signal']}, leadership given up", file=sys.stderr)
        return 128 + int(got["signal"])
    return 0


def _prefect_api_url() -> str | None:
    """The Prefect API this process would talk to (Prefect's settings: the environment's
    PREFECT_API_URL, else the active profile's), or None (no server)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else None
