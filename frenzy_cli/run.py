"""`frenzy run JOB.yaml`: the main job. Runs the `frenzy-submit` flow on Prefect's embedded
default (an ephemeral server with SQLite under a project-local PREFECT_HOME) and prints the
memory estimate, the candidate plans per GPU type, the assignment and the loss per step."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("run", help="estimate, select GPUs, assign and train a job (job YAML)",
                       description=__doc__)
    p.add_argument("job", help="job YAML (see examples/tiny-job.yaml)")
    p.add_argument("--cluster", help="cluster YAML (pools per GPU type); default: the GPUs NVML "
                                     "finds here, else a local CPU pool")
    p.add_argument("--policy", help="scheduling policy (default: the settings block's, else frenzy)")
    p.add_argument("--ledger", help="ledger SQLAlchemy URL (default: env FRENZY_LEDGER_URL, else SQLite under "
                                    "FRENZY_HOME, .frenzy/)")
    p.add_argument("--safety-margin-gib", type=float, default=None,
                   help="GPU memory kept free beyond the prediction (GiB)")
    p.add_argument("--settings", help="a FrenzySettings block name (site defaults: ledger URL, "
                                      "safety margin, policy, fallback order, default precision and optimizer)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.add_argument("--plan", help='only plans with these knobs, e.g. "tp=2", "offload=optimizer,zero=3", '
                                  '"nodes=2" (knobs: dp tp pp vpp cp gpus nodes zero offload act_ckpt '
                                  'micro_batch grad_accum gpu)')
    p.add_argument("--fetch", action="store_true",
                   help="first download the Hugging Face Hub models the job names into this machine's cache "
                        "(configs, safetensors weights, tokenizer; HF_TOKEN or `hf auth login` for gated ones); "
                        "without it nothing downloads")
    p.add_argument("--dry-run", action="store_true",
                   help="print what would launch (GPU type, count, plan, memory, predicted step time "
                        "and duration, pool, worker) and start nothing: no Prefect server, no ledger, so no "
                        "settings block either (its policy and margin: give --policy / --safety-margin-gib)")
    p.set_defaults(handler=handle)


def load_job(path: str):
    """The job file as a TrainingJob; every problem is one FrenzyInputError line (the safe YAML
    reader's size, encoding, syntax and alias checks, then the job model's fields, with the
    line of the offending field)."""
    from pydantic import ValidationError

    from estimator.errors import FrenzyInputError, from_validation_error
    from estimator.job import TrainingJob
    from estimator.yamlfile import JOB_FILE, line_of, load_yaml

    raw = load_yaml(path, kind=JOB_FILE, what="job")
    try:
        return TrainingJob.model_validate(raw)
    except ValidationError as err:
        bad = from_validation_error(err)
        node, line = raw, None
        for key in err.errors()[0].get("loc", ()):     # the deepest key of the field's path in the file
            if isinstance(node, dict) and key in node:
                line, node = line_of(node, key) or line, node[key]
            elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
                node = node[key]
            else:
                break
        raise FrenzyInputError(bad.field, f"{bad.rule} ({path} line {line})" if line else bad.rule) from None


def embedded_prefect_env(json_mode: bool) -> None:
    """Project-local state for the embedded default; never the user's ~/.prefect."""
    from estimator.home import frenzy_home

    home = frenzy_home().resolve()
    os.environ["FRENZY_HOME"] = str(home)      # absolute: pool workers and training ranks share it
    os.environ.setdefault("PREFECT_HOME", str(home / "prefect"))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect makes one level only
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    if json_mode:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def handle(args) -> int:
    from estimator.errors import FrenzyInputError
    from ledger.core import check_url_arg

    try:
        check_url_arg("--ledger", args.ledger)      # a password on the command line shows in `ps`
        return _handle(args)
    except FrenzyInputError as err:
        if args.json:     # --json: stdout is one JSON object, also for bad input (exit 2 as always)
            print(json.dumps({"status": "failed", "error": str(err), "field": err.field}))
        raise


def _handle(args) -> int:
    job = load_job(args.job)
    from estimator.plan_filter import filter_plans, parse_plan_filter

    plan_filter = parse_plan_filter(args.plan) if getattr(args, "plan", None) else None
    # Bad input fails here, in a line, before the slow Prefect start-up: the cluster file, and
    # a job that no GPU of the cluster can hold (the flow's first task asks the same question).
    from estimator.errors import DoesNotFitError
    from estimator.plans import DEFAULT_SAFETY_MARGIN_GIB, plans_for_job
    from scheduler.discover import cluster_or_local
    from trainer.pretrained import check_job

    if args.fetch:
        from frenzy_flows.hub import fetch_hub_models

        for repo in fetch_hub_models(job, log=lambda line: print(f"frenzy: {line}", file=sys.stderr)):
            print(f"frenzy: {repo} is in this machine's Hugging Face cache", file=sys.stderr)
    check_job(job)          # starting point, config/weights, LoRA targets, QLoRA support

    topology = cluster_or_local(args.cluster)
    # With a settings block its margin is only known once Prefect is up: check against none.
    margin = (args.safety_margin_gib if args.safety_margin_gib is not None
              else 0.0 if args.settings else DEFAULT_SAFETY_MARGIN_GIB)
    try:
        plans = plans_for_job(job, topology.inventory(), gpus_per_node=topology.gpus_per_node(),
                              host_ram_gib=topology.host_ram_gib(), plan_filter=plan_filter,
                              safety_margin_gib=margin, gpus=topology.gpu_catalog())
    except DoesNotFitError:
        if not args.dry_run:
            raise
        plans = None        # the dry run says what would not launch, and the counts it needs
    if plans is not None:
        plans = filter_plans(plans, plan_filter, topology.gpus_per_node())
        # data, tokenizer, entry point, optimizer, allow-lists (the job file's folder is a data
        # root): a dry run refuses what the run would
        from trainer import allowlist
        from trainer.fallback import launch_refusal, realisable
        from trainer.runner import preflight_job

        allowlist.configure(data_roots=[Path(args.job).resolve().parent])
        every = [p for ps in plans.values() for p in ps]
        runnable = [p for p in every if realisable(p)]
        if not runnable and not args.dry_run:      # the flow's select_resources would refuse it, later
            from estimator.errors import FrenzyInputError

            raise FrenzyInputError("plan" if plan_filter else "job", launch_refusal(every))
        preflight_job(job, min(runnable or every, key=lambda p: p.step_time_s))
    if args.dry_run:    # writes nothing: Prefect is imported (never contacted) with a throwaway home
        import tempfile
        with tempfile.TemporaryDirectory(prefix="frenzy-dry-run-") as tmp:
            os.environ.setdefault("PREFECT_HOME", tmp)
            from frenzy_flows.dryrun import print_dry_run
            return print_dry_run(job, topology, args)

    embedded_prefect_env(args.json)     # before prefect is first imported
    from . import stopping

    # Signals stop what this process started from here on (see frenzy_cli.stopping).
    stopper = stopping.Stopper().install()
    final = None
    try:
        stopper.server = stopping.start_embedded_server()
        if stopper.server is not None:
            stopper.watch_server()
        code, final = _submit(args, job, topology, stopper)
        return code
    except KeyboardInterrupt:
        reason = stopper.reason or "SIGINT"
        final = f"interrupted ({reason}) before training started; nothing left running"
        if args.json:
            print(json.dumps({"status": "failed", "error": f"interrupted ({reason})"}))
        return stopper.exit_code or 130
    finally:
        stopper.uninstall()
        if stopper.reason is not None:
            stopping.stop_server(stopper.server)      # before the last line: it logs its stop
        if final:
            stopper.say(final)


def _submit(args, job, topology, stopper) -> tuple[int, str | None]:
    """Submit and report; returns the exit status and, after a stop, the line that says why."""
    from estimator.errors import FrenzyInputError
    from deployments.pools import sync_pools
    from frenzy_flows import submit_training

    from . import report

    sync_pools(topology)
    if stopper.server is not None and not args.settings:
        # this project's own embedded server forgot the leases of runs killed with it: free
        # the GPU slots its database still counts but the ledger holds no GPUs for
        from frenzy_flows.dispatch import reconcile_gpu_slots
        from ledger import Ledger

        try:
            reconcile_gpu_slots(Ledger(args.ledger), [p.name for p in topology.pools])
        except Exception as err:     # the slot wait reconciles again; never fail a run on it
            print(f"frenzy run: could not reconcile GPU slots with the ledger: {err}", file=sys.stderr)
    try:
        result = submit_training(job, cluster=args.cluster, policy=args.policy,
                                 ledger_url=args.ledger, settings=args.settings,
                                 safety_margin_gib=args.safety_margin_gib,
                                 **({"plan_filter": args.plan} if getattr(args, "plan", None) else {}))
    except FrenzyInputError:
        raise
    except Exception as err:
        if stopper.reason is not None:      # the stop made the run fail (killed on the way out)
            err = f"interrupted ({stopper.reason}): {err}"
        if args.json:
            print(json.dumps({"status": "failed", "error": str(err)}))
        if stopper.reason is not None:
            return stopper.exit_code or 1, f"failed: {err}"
        print(f"frenzy run: failed: {err}", file=sys.stderr)
        return 1, None
    if args.json:
        print(result.model_dump_json())
    else:
        report.print_result(result)
    if stopper.reason is not None:
        step = (result.stop or {}).get("step")
        return stopper.exit_code or 1, (f"{stopper.reason}: training stopped"
                                        + (f" after step {step} with a checkpoint" if step else "")
                                        + "; GPUs released")
    return 0, None
