"""`frenzy queue`: the jobs the live scheduler has queued or running: for a pending job its
predicted start, the GPU type and count it waits for and why; for a running one its GPUs,
progress and any re-size in flight. The same rows the scheduler publishes as the
`frenzy-queue` artifact."""
from __future__ import annotations

import json
import os


def register(sub) -> None:
    p = sub.add_parser("queue", help="show the live scheduler's queue (pending jobs and why they wait)",
                       description=__doc__)
    p.add_argument("--ledger", help="ledger SQLAlchemy URL without a password (default: env "
                                    "FRENZY_LEDGER_URL, else SQLite under .frenzy/)")
    p.add_argument("--all", action="store_true", help="also jobs that ended (done, failed, stopped) and why")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from frenzy_scheduler.source import queue_table
    from ledger.core import check_url_arg, default_ledger_file, ledger_field, open_existing
    from ledger.queue import ACTIVE, ENDED, JobQueue, Leadership

    check_url_arg("--ledger", args.ledger)
    if not args.ledger and not os.environ.get("FRENZY_LEDGER_URL") and not default_ledger_file().exists():
        return _show([], None, args.json)     # a fresh checkout: nothing has been queued (and nothing is made)
    queue = JobQueue(open_existing(ledger_field(args.ledger), args.ledger))
    states = ACTIVE + (ENDED if args.all else ())
    now = queue.now()
    rows = queue_table(queue.jobs(states), now)
    lead = Leadership(queue.ledger, "observer", 1.0).current()
    leader = lead["holder"] if lead and not lead["expired"] else None
    return _show(rows, leader, args.json)


def _show(rows: list[dict], leader: str | None, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"scheduler": leader, "jobs": rows}))
        return 0
    from rich.table import Table

    from .console import console

    cols = ("job", "state", "predicted_start_in_s", "gpu_type", "gpus", "steps", "why", "preemptions", "resizes")
    t = Table(title=f"frenzy queue (scheduler: {leader or 'none running'})")
    for c in cols:
        t.add_column(c.replace("_", " "))
    for r in rows:
        t.add_row(*("" if r.get(c) is None else str(r.get(c)) for c in cols))
    console().print(t)
    return 0
