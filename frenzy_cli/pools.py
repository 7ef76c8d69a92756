"""`frenzy pools sync|status`: mirror a cluster file into Prefect work pools (one per GPU type,
with GPU template variables, a `gpu:<pool>` concurrency limit and a training deployment), and
show each pool's GPUs, GPUs in use, queued runs and workers online.

Talks to the Prefect server in PREFECT_API_URL (or the active Prefect profile). Without one it
uses the same embedded server database as `frenzy run` (PREFECT_HOME under ./.frenzy)."""
from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager


def register(sub) -> None:
    p = sub.add_parser("pools", help="sync the cluster's GPU pools into Prefect; show pool status",
                       description=__doc__)
    ps = p.add_subparsers(dest="pools_command", metavar="SUBCOMMAND")

    s = ps.add_parser("sync", help="create/update one work pool per cluster pool (idempotent)")
    s.add_argument("--cluster", required=True, help="cluster YAML (pools: [{name, gpu, nodes, "
                   "gpus_per_node}]) or block:<name> for a saved GPUCluster block")
    s.add_argument("--type", dest="pool_type", default="process", choices=["process", "kubernetes"],
                   help="work pool type (default: process); kubernetes requests nvidia.com/gpu and "
                        "selects nodes by GPU product")
    s.add_argument("--prune", action="store_true",
                   help="also remove the Frenzy pools this cluster does not name (work pool, gpu:<pool> "
                        "limit, deployment, and the pool in the GPU ledger); without it a sync leaves "
                        "other clusters' pools alone")
    s.add_argument("--settings", metavar="BLOCK",
                   help="FrenzySettings block whose ledger URL to sync (default: FRENZY_LEDGER_URL, else "
                        "SQLite under FRENZY_HOME)")
    s.add_argument("--json", action="store_true", help="print the sync report as JSON")
    s.set_defaults(handler=handle_sync)

    st = ps.add_parser("status", help="per pool: GPUs, in use, queued jobs, workers online")
    st.add_argument("pool", nargs="*", help="only these pools (default: every Frenzy pool)")
    st.add_argument("--json", action="store_true", help="print one JSON list instead of a table")
    st.set_defaults(handler=handle_status)
    p.set_defaults(handler=lambda args: (p.print_help(), 2)[1])


def _prefect_env() -> str | None:
    """Same project-local defaults as `frenzy run`; returns the API URL in use, or None for the
    embedded server."""
    from .run import embedded_prefect_env

    embedded_prefect_env(json_mode=True)
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    return str(url) if url else None


def load_cluster_arg(ref: str):
    """A cluster YAML path, or ``block:<name>`` for a GPUCluster block on the server."""
    if not ref.startswith("block:"):
        from scheduler.cluster import load_cluster
        return load_cluster(ref)
    from blocks import GPUCluster

    name = ref.split(":", 1)[1]
    return _load_block(GPUCluster, name, "--cluster").to_cluster()


def _load_block(cls, name: str, flag: str):
    """The ``cls`` block ``name`` from the server; one line naming ``flag`` when there is none,
    or when its saved document no longer validates (Prefect raises a ValueError either way)."""
    from estimator.errors import FrenzyInputError

    try:
        return cls.load(name)
    except ValueError as err:
        if "Unable to find block document" in str(err):
            raise FrenzyInputError(flag, f"no {cls.__name__} block named {name!r} on the Prefect server") from None
        raise FrenzyInputError(flag, f"the {cls.__name__} block {name!r} does not load: "
                                     f"{' '.join(str(err).split())[:200]}") from None


def handle_sync(args) -> int:
    # A file is read before Prefect starts (a bad one touches nothing); a block needs the server.
    cluster = None if args.cluster.startswith("block:") else load_cluster_arg(args.cluster)
    url = _prefect_env()
    from deployments.pools import pool_specs, sync_pools
    from ledger import Ledger

    lines: list[str] = []
    with _server_answers(url):
        _ping(url)                            # a server that is down: nothing is written, the ledger neither
        if cluster is None:
            cluster = load_cluster_arg(args.cluster)
        pool_specs(cluster)                   # bad pool names: one line before anything is written
        ledger_url = _ledger_url(args.settings)
        # Prefect's checks (the pool type, the worker template, the GPU types, the train flow)
        # come before any write: the ledger is synced once Prefect took the cluster, so a
        # refusal leaves both as they were (the ledger was pruned before Prefect refused)
        report = sync_pools(cluster, pool_type=args.pool_type, log=lines.append, prune=args.prune)
        ledger_pruned = Ledger(ledger_url).sync_cluster(cluster, prune=args.prune)
    lines.append(f"ledger: {len(cluster.pools)} pool(s) synced"
                 + (f"; deactivated {', '.join(ledger_pruned)}" if ledger_pruned else ""))
    if args.json:
        print(json.dumps({"api_url": url, "pool_type": report.pool_type, "pools": report.pools,
                          "limits": report.limits, "deployments": report.deployments, "queues": report.queues,
                          "ledger_pruned": ledger_pruned}))
        return 0
    for line in lines:
        print(line)
    if url is None:
        print(f"(no PREFECT_API_URL: wrote to the embedded server database under {os.environ['PREFECT_HOME']}, "
              "which `frenzy run` uses; workers need a running server: `prefect server start`)",
              file=sys.stderr)
    return 0


def _ping(url: str | None) -> None:
    """One request to the server's health endpoint (the embedded server, ``url`` None, is
    started on demand and needs none)."""
    if url:
        import httpx
        httpx.get(url.rstrip("/") + "/health", timeout=15.0)


@contextmanager
def _server_answers(url: str | None):
    """A Prefect server that does not answer (down, a wrong PREFECT_API_URL) is one line naming
    the URL, not an HTTP client's traceback."""
    import httpx

    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout) as err:
        from estimator.errors import FrenzyInputError
        raise FrenzyInputError("PREFECT_API_URL", f"no Prefect server answers at {url or 'the embedded server'} "
                                                  f"({err}); start one (`prefect server start`) or fix the URL") from None


def _ledger_url(settings: str | None) -> str | None:
    """The ledger URL from a FrenzySettings block (a secret: never taken on the command line)."""
    if not settings:
        return None
    from blocks import FrenzySettings

    return _load_block(FrenzySettings, settings, "--settings").ledger_url_value()


def handle_status(args) -> int:
    url = _prefect_env()
    from deployments.pools import pools_status

    with _server_answers(url):
        rows = pools_status(args.pool or None)
    if args.json:
        print(json.dumps([r.__dict__ for r in rows]))
        return 0
    from .console import console
    from rich.table import Table

    t = Table(title="Frenzy GPU pools", title_justify="left")
    for col in ("pool", "type", "GPU type", "GPUs", "in use", "queued", "running", "workers", "state"):
        t.add_column(col, justify="right" if col in ("GPUs", "in use", "queued", "running", "workers") else "left")
    for r in rows:
        workers = str(r.workers_online) if r.workers_online else "[red]0 (no workers online)[/red]"
        t.add_row(r.name, r.pool_type, r.gpu_type, "-" if r.gpus is None else str(r.gpus),
                  "-" if r.in_use is None else str(r.in_use), str(r.queued), str(r.running), workers, r.state)
    console().print(t)
    if not rows:
        print("no Frenzy pools on this server; run `frenzy pools sync --cluster <file>`", file=sys.stderr)
    idle_control = [r for r in rows if r.gpu_type == "control" and not r.workers_online]
    if idle_control:
        print(f"no worker polls the control pool {idle_control[0].name!r}: submissions from the UI or a "
              f"schedule stay Scheduled; start one: prefect worker start --pool {idle_control[0].name}",
              file=sys.stderr)
    return 0
