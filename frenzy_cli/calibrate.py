"""`frenzy calibrate [--ledger URL]`: fit the estimator's overhead terms (CUDA context,
allocator fragmentation, NCCL per communicator) per GPU type from the measured runs in the
ledger, and write them to $FRENZY_HOME/calibration.json, which every estimate then uses."""
from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="fit memory overhead terms per GPU type from measured runs",
                       description=__doc__)
    p.add_argument("--ledger", help="ledger SQLAlchemy URL (default: FRENZY_LEDGER_URL, else "
                                    "SQLite under $FRENZY_HOME)")
    p.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=handle)


def handle(args) -> int:
    from estimator.overheads import DEFAULT, calibration_path, fit_calibration, write_calibration
    from ledger.core import Ledger, check_url_arg

    check_url_arg("--ledger", args.ledger)      # a password on the command line shows in `ps`
    rows = Ledger(args.ledger).measurements()
    fits = fit_calibration(rows)
    path = None
    if fits and not args.dry_run:
        path = write_calibration({g: {k: v for k, v in f.items() if k != "runs"}
                                  for g, f in fits.items()})
    if args.json:
        print(json.dumps({"measurements": len(rows), "fits": fits,
                          "written": str(path) if path else None}))
        return 0
    from .console import console
    from rich.table import Table
    con = console()
    if not fits:
        con.print(f"no measured GPU runs among {len(rows)} ledger measurements: "
                  "nothing to fit (defaults stay in use)")
        return 0
    t = Table(title="fitted overhead terms per GPU type (defaults in brackets)")
    cols = ("cuda_context_gib", "fragmentation", "fragmentation_recompute", "nccl_per_comm_gib")
    t.add_column("gpu type")
    t.add_column("runs", justify="right")
    for c in cols:
        t.add_column(f"{c} [{getattr(DEFAULT, c)}]", justify="right")
    for g, f in fits.items():
        t.add_row(g, str(f["runs"]), *(f"{f[c]:.3f}" if c in f else "-" for c in cols))
    con.print(t)
    con.print(f"written to {path}" if path else f"dry run: {calibration_path()} unchanged")
    return 0
