"""`frenzy calibrate [--ledger URL]`: fit, per GPU type, from the measured runs in the ledger,
(1) the estimator's memory overhead terms (CUDA context, allocator fragmentation, NCCL per
communicator), written to $FRENZY_HOME/calibration.json, and (2) the throughput model's named
factors (sustained tensor-core utilisation, share of memory bandwidth), written to
$FRENZY_HOME/throughput_calibration.json. Every estimate, plan and simulation then uses them."""
from __future__ import annotations

import json
import math
import statistics


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="fit memory overhead terms and throughput factors per GPU type "
                                         "from measured runs", description=__doc__)
    p.add_argument("--ledger", help="ledger SQLAlchemy URL (default: FRENZY_LEDGER_URL, else "
                                    "SQLite under $FRENZY_HOME)")
    p.add_argument("--dry-run", action="store_true", help="print the fit, write nothing")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=handle)


def _job_specs(led) -> dict[str, dict]:
    from ledger.tables import JobRow
    from sqlmodel import select
    with led._read() as s:
        return {r.job_id: dict(r.spec or {}) for r in s.exec(select(JobRow)).all()}


def throughput_measurements(rows, specs: dict[str, dict], nodes_of=lambda row: 1):
    """Ledger measurement rows -> (throughput Measurements, skipped count). A row is usable when
    its job's model and sequence length resolve, its GPU type is in the catalog and it measured a
    positive step time."""
    from estimator.catalog import get_gpu
    from estimator.errors import FrenzyInputError
    from estimator.models import resolve_model
    from estimator.plan import Plan
    from estimator.job import trains_adapters
    from estimator.plans import plan_adapters
    from estimator.throughput import Measurement

    out, skipped = [], 0
    for r in rows:
        step = r.measured_step_time_s or (r.measured or {}).get("step_time_s")
        spec = specs.get(r.job_id) or {}
        try:
            if not step or step <= 0 or not math.isfinite(step) or "model" not in spec:
                raise ValueError("no step time or job spec")
            gpu = get_gpu(r.gpu_type)
            if gpu.is_cpu:
                raise ValueError("CPU runs say nothing about GPU factors")
            plan = Plan.model_validate({k: v for k, v in (r.plan or {}).items() if k in Plan.model_fields})
            # a LoRA run's step is charged its adapters' terms, as the planner charged it
            adapters = plan_adapters(spec, plan) if trains_adapters(spec) else None
            out.append(Measurement(spec=resolve_model(spec["model"]), plan=plan, gpu=gpu,
                                   seq_len=int(spec.get("seq_len") or 1024), step_s=float(step),
                                   nodes=nodes_of(r), adapters=adapters))
        except (FrenzyInputError, ValueError, TypeError, KeyError):
            skipped += 1
    return out, skipped


def fit_throughput(measured) -> dict[str, dict]:
    """Per GPU type: runs, default and fitted factors, median predicted/measured before and after."""
    from estimator.throughput import DEFAULT_FACTORS, fit_factors, step_time

    fitted = fit_factors(measured)
    report: dict[str, dict] = {}
    for name in sorted({m.gpu.name for m in measured}):
        ms = [m for m in measured if m.gpu.name == name]

        def med(f, ms=ms):
            return statistics.median(step_time(m.spec, m.plan, m.gpu, seq_len=m.seq_len, nodes=m.nodes, factors=f,
                                                   adapters=m.adapters)
                                     / m.step_s for m in ms)
        report[name] = {"runs": len(ms), "util": fitted.util[name], "util_default": ms[0].gpu.util,
                        "mem_eff": fitted.mem_eff[name], "mem_eff_default": DEFAULT_FACTORS.mem_bw_eff,
                        "median_ratio_before": round(med(DEFAULT_FACTORS), 4),
                        "median_ratio_after": round(med(fitted), 4)}
    return {"factors": fitted, "per_gpu": report}


def handle(args) -> int:
    from estimator.overheads import DEFAULT, calibration_path, fit_calibration, write_calibration
    from estimator.throughput import calibration_file, write_calibration as write_throughput
    from ledger.core import check_url_arg, ledger_field, open_existing

    check_url_arg("--ledger", args.ledger)      # a password on the command line shows in `ps`
    led = open_existing(ledger_field(args.ledger), args.ledger)
    rows = led.measurements()
    specs = _job_specs(led) if rows else {}
    fits = fit_calibration(rows, specs)

    def nodes_of(r) -> int:
        try:
            return max(1, len(led.allocation(r.alloc_id).placement)) if r.alloc_id else 1
        except Exception:   # an allocation the ledger no longer has: one node
            return 1
    measured, skipped = throughput_measurements(rows, specs, nodes_of)
    tput = fit_throughput(measured) if measured else {"per_gpu": {}}
    path = tpath = None
    if fits and not args.dry_run:
        path = write_calibration({g: {k: v for k, v in f.items() if k not in ("runs", "outliers")}
                                  for g, f in fits.items()})
    if tput["per_gpu"] and not args.dry_run:
        tpath = write_throughput(tput["factors"], list(tput["per_gpu"]))
    if args.json:
        print(json.dumps({"measurements": len(rows), "fits": fits,
                          "written": str(path) if path else None,
                          "throughput": {"usable": len(measured), "skipped": skipped, "fits": tput["per_gpu"],
                                         "written": str(tpath) if tpath else None}}))
        return 0
    from .console import console
    from rich.table import Table
    con = console()
    if not fits and not tput["per_gpu"]:
        con.print(f"no measured GPU runs among {len(rows)} ledger measurements: "
                  "nothing to fit (defaults stay in use)")
        return 0
    if fits:
        t = Table(title="fitted overhead terms per GPU type (defaults in brackets)")
        cols = ("cuda_context_gib", "fragmentation", "fragmentation_recompute", "fragmentation_recompute_expandable",
                "fragmentation_adapters", "nccl_per_comm_gib")
        t.add_column("gpu type")
        t.add_column("runs", justify="right")
        for c in cols:
            t.add_column(f"{c} [{getattr(DEFAULT, c)}]", justify="right")
        for g, f in fits.items():
            t.add_row(g, str(f["runs"]), *(f"{f[c]:.3f}" if c in f else "-" for c in cols))
        con.print(t)
        for g, f in fits.items():
            if f.get("outliers"):
                con.print(f"{g}: {f['outliers']} run(s) left out of the context / NCCL fit: their device used "
                          f"is more than one process holds outside its allocator (another process on the GPU?)")
        con.print(f"written to {path}" if path else f"dry run: {calibration_path()} unchanged")
    if tput["per_gpu"]:
        t = Table(title=f"fitted throughput factors per GPU type ({len(measured)} runs with step times, "
                        f"{skipped} skipped)")
        for c in ("gpu type", "runs", "util (default)", "mem_eff (default)", "median pred/meas before -> after"):
            t.add_column(c, justify="left" if c == "gpu type" else "right")
        for g, f in tput["per_gpu"].items():
            t.add_row(g, str(f["runs"]), f"{f['util']:.2f} ({f['util_default']:.2f})",
                      f"{f['mem_eff']:.2f} ({f['mem_eff_default']:.2f})",
                      f"{f['median_ratio_before']:.2f} -> {f['median_ratio_after']:.2f}")
        con.print(t)
        con.print(f"written to {tpath}" if tpath else f"dry run: {calibration_file()} unchanged")
    return 0
