"""A dry run: what a submission would launch, touching nothing.

The same steps as the `frenzy-submit` flow up to the placement: the estimator's feasible plans
per GPU type, the submit flow's own filter of what the trainer can launch
(``tasks.select_resources``), the scheduler's round on the idle cluster (``scheduler.round.run_round``, as ``frenzy scheduler`` runs it),
but on an idle cluster (every GPU free), with no Prefect server asked (unless the caller hands
in a worker count), no ledger read or written, no pool synced, no process started.

When nothing fits, ``needs`` names the nearest GPU types (the cluster's first, then the catalog's
with the fewest GPUs) with the least GPU count a feasible plan needs: "needs at least 4 x A100-80GB".
"""
from __future__ import annotations

import time
from typing import Any, Callable

from estimator.errors import DoesNotFitError, FrenzyInputError
from estimator.job import TrainingJob
from estimator.plan import Plan
from scheduler.cluster import Cluster

from frenzy_cli.units import format_duration, format_memory, format_seconds
from trainer.fallback import not_launchable

# The largest GPU count the "needs at least" search tries per type: Llama 3 405B, the largest
# published dense pretraining run, used 16,384 H100s. The search costs ~20 ms per type.
MAX_SEARCH_GPUS = 16384

# Catalog types named besides the cluster's when nothing fits: enough to show the next step up
# (more memory per GPU) without listing the whole catalog.
NEAREST_OTHER_TYPES = 3

DRY_RUN_KEY = "frenzy-dry-run"


def _least_gpus(job: TrainingJob, gpu_type: str, gpus_per_node: int, margin: float,
                gpus: dict | None, host_ram_gib: float | None = None) -> tuple[int, bool] | None:
    """(least GPU count of a feasible plan on ``gpu_type``, whether the trainer can launch such
    a plan), or None when no count up to ``MAX_SEARCH_GPUS`` holds the job."""
    from estimator.plans import enumerate_plans

    plans = enumerate_plans(job, gpu_type, max_gpus=MAX_SEARCH_GPUS, gpus_per_node=gpus_per_node,
                            safety_margin_gib=margin, gpus=gpus, host_ram_gib=host_ram_gib)
    if not plans:
        return None
    least = min(p.gpus for p in plans)
    return least, any(p.gpus == least and not_launchable(p) is None for p in plans)


def nearest_fits(job: TrainingJob, cluster: Cluster, margin: float, *,
                 other_types: bool = True) -> list[dict[str, Any]]:
    """Per GPU type the least GPU count that holds ``job``: every type of the cluster (``gpus``
    None where none does), then (``other_types``) up to ``NEAREST_OTHER_TYPES`` catalog types,
    fewest GPUs first."""
    from estimator.catalog import GPU_NAMES

    out: list[dict[str, Any]] = []
    from scheduler.cluster import Cluster, Pool

    inv, gpn, catalog, hosts = cluster.inventory(), cluster.gpus_per_node(), cluster.gpu_catalog(), cluster.host_ram_gib()
    for gpu_type, have in inv.items():
        least = _least_gpus(job, gpu_type, gpn.get(gpu_type, 8), margin, catalog, hosts.get(gpu_type))
        out.append({"gpu_type": gpu_type, "gpus": least[0] if least else None, "have": have,
                    "launchable": bool(least and least[1]), "in_cluster": True})
    others = []
    for gpu_type in GPU_NAMES if other_types else ():
        if gpu_type in inv or (job.allowed_gpu_types and gpu_type not in job.allowed_gpu_types):
            continue
        # a catalog type on nodes of 8 with the cluster file's default host memory
        host = Cluster(pools=[Pool(name="probe", gpu=gpu_type, gpus_per_node=8)]).host_ram_gib().get(gpu_type)
        least = _least_gpus(job, gpu_type, 8, margin, None, host)
        if least:
            others.append({"gpu_type": gpu_type, "gpus": least[0], "have": 0,
                           "launchable": least[1], "in_cluster": False})
    others.sort(key=lambda d: (d["gpus"], d["gpu_type"]))
    return out + others[:NEAREST_OTHER_TYPES]


def _needs_line(n: dict[str, Any]) -> str:
    if n["gpus"] is None:
        return f"{n['gpu_type']}: no count up to {MAX_SEARCH_GPUS:,} GPUs holds it"
    where = f"the cluster has {n['have']}" if n["in_cluster"] else "not in the cluster"
    tail = "" if n["launchable"] else "; only plans the trainer cannot launch here"
    return f"needs at least {n['gpus']} x {n['gpu_type']} ({where}{tail})"


def _worker_text(pool: str, addresses: list[str], workers: Callable[[str], int] | None, own: bool) -> str:
    """Who would run the training: the pool's workers; without one, this process only for the
    control machine's own pool (``own``), else the submit flow waits for one, then fails."""
    where = f" on {', '.join(addresses)}" if addresses else ""
    without = ("the submit flow trains in-process (the control machine's own pool)" if own else
               "the submit flow waits for one (up to its wait_timeout_s), then fails; it never trains "
               "this pool's plan on the control machine")
    if workers is None:
        return (f"a worker of pool {pool}{where} (`prefect worker start --pool {pool}`); not checked: "
                f"a dry run asks no server. With none online {without}.")
    n = workers(pool)
    if n:
        return f"{n} worker{'s' if n != 1 else ''} online in pool {pool}{where}"
    return f"no worker online in pool {pool}{where}: {without}"


def _gang_text(pool: str, node_ids: list[str]) -> str:
    """A placement over several nodes trains as a gang: one flow run per node, each on its
    node's work queue (``frenzy_flows.gang``)."""
    return (f" Across {len(node_ids)} nodes: one flow run per node, each node's worker started with "
            + ", ".join(f"`prefect worker start --pool {pool} --work-queue {n}`" for n in node_ids) + ".")


def dry_run(job: TrainingJob, cluster: Cluster, *, safety_margin_gib: float, policy: str = "frenzy",
            workers: Callable[[str], int] | None = None, plan_filter: str | None = None,
            registered: list[str] | None = None) -> dict[str, Any]:
    """What ``job`` would launch on ``cluster``: one JSON-able dict (``launch`` true with the
    GPU type, count, plan, memory, predicted step time and duration, pool, placement and worker;
    or ``launch`` false with ``reason`` and ``needs``). ``workers``: pool -> online workers, when a
    server may be asked (the flow's dry run); None leaves the worker unchecked. ``plan_filter``:
    the submission's ``--plan`` knobs (``estimator.plan_filter``), applied as the submit flow
    applies them: a filter that names a bad knob or matches no feasible plan raises
    FrenzyInputError, as the same submission would. ``registered``: the work pools the server
    has (the flow's dry run), among which the submission chooses; None: every pool of the
    cluster (no server to ask)."""
    from prefect.logging import disable_run_logger

    from estimator.catalog import get_gpu
    from estimator.plans import plans_for_job
    from scheduler.discover import is_control_machine_pool
    from scheduler.types import JobRequest

    from scheduler.policies import get_policy
    from scheduler.round import run_round

    from frenzy_flows.tasks import select_resources

    from estimator.plan_filter import filter_plans, parse_plan_filter

    flt = parse_plan_filter(plan_filter) if plan_filter else None    # bad knobs: before any estimate
    base: dict[str, Any] = {"dry_run": True, "job": job.name, "model": job.model if isinstance(job.model, str)
                            else "custom", "steps": job.steps, "policy": policy,
                            "safety_margin_gib": safety_margin_gib,
                            **({"plan_filter": plan_filter} if plan_filter else {})}
    try:
        plans_by_type = plans_for_job(job, cluster.inventory(), gpus_per_node=cluster.gpus_per_node(),
                                      host_ram_gib=cluster.host_ram_gib(), plan_filter=flt,
                                      safety_margin_gib=safety_margin_gib, gpus=cluster.gpu_catalog())
    except DoesNotFitError as err:
        return {**base, "launch": False, "reason": str(err),
                "needs": nearest_fits(job, cluster, safety_margin_gib)}
    plans_by_type = filter_plans(plans_by_type, flt, cluster.gpus_per_node())
    try:
        with disable_run_logger():
            candidates = select_resources.fn(job, plans_by_type, cluster,
                                             [p.name for p in cluster.pools] if registered is None else registered)
    except FrenzyInputError as err:
        # plans fit, but none is runnable here (pools, constraints, launchability): neither a type
        # the cluster already has enough of nor another type is the answer, only the cluster's
        # types that would need more GPUs than it has
        needs = [n for n in nearest_fits(job, cluster, safety_margin_gib, other_types=False)
                 if n["gpus"] is None or n["gpus"] > n["have"]]
        return {**base, "launch": False, "reason": str(err), "needs": needs}
    plans = [p for ps in candidates.values() for p in ps]
    request = JobRequest(job_id=f"{job.name}-dry-run", submit_s=time.time(), plans=plans,
                         steps_left=job.steps, model=base["model"], checkpoint_gb=0.0)
    decision = next((d for d in run_round(get_policy(policy), [request], cluster.initial_state(), time.time()).starts
                     if d.plan is not None), None)
    if decision is None:
        return {**base, "launch": False, "needs": [],
                "reason": f"policy {policy} starts nothing on the idle cluster (it would wait)"}
    plan: Plan = decision.plan
    node_ids = list(decision.placement)
    pool = next(p for nid, p in cluster.nodes() if nid == node_ids[0])
    addresses = [pool.addresses[pool.node_ids().index(n)] for n in node_ids
                 if pool.addresses and n in pool.node_ids()]
    fastest = min(plans, key=lambda p: p.step_time_s)
    duration_s = plan.step_time_s * job.steps
    return {**base, "launch": True, "gpu_type": plan.gpu_type, "gpus": plan.gpus, "plan": plan.short(),
            "memory_per_gpu_gib": plan.device_used_gib, "memory_per_gpu": format_memory(plan.device_used_gib),
            "gpu_memory_gib": get_gpu(plan.gpu_type, cluster.gpu_catalog()).memory_gib,
            "step_time_s": plan.step_time_s, "duration_s": duration_s, "duration": format_duration(duration_s),
            "pool": pool.name, "placement": {k: list(v) for k, v in decision.placement.items()},
            "worker": _worker_text(pool.name, addresses, workers, is_control_machine_pool(cluster, pool.name))
            + (_gang_text(pool.name, node_ids) if len(node_ids) > 1 else ""),
            "launchable_plans": len(plans), "fastest_plan": fastest.short(),
            "plan_detail": plan.model_dump(mode="json")}


def dry_run_lines(d: dict[str, Any]) -> list[str]:
    """The dry run for a person, one fact a line."""
    head = f"dry run of {d['job']} ({d['model']}, {d['steps']} steps, policy {d['policy']}): nothing started"
    if not d["launch"]:
        return [head, f"would not launch: {d['reason']}"] + [f"  {_needs_line(n)}" for n in d["needs"]]
    lines = [head,
             f"would launch: {d['gpus']} x {d['gpu_type']}  ({d['plan']})",
             f"memory per {'process' if d['gpu_type'] == 'CPU' else 'GPU'}: {d['memory_per_gpu']} predicted"
             f" of {format_memory(d['gpu_memory_gib'])}",
             f"predicted step time: {format_seconds(d['step_time_s'])}; {d['steps']} steps in about {d['duration']}",
             f"pool: {d['pool']}; placement: "
             + "; ".join(f"{node} devices {','.join(map(str, ids))}" for node, ids in d["placement"].items()),
             f"worker: {d['worker']}"]
    if d.get("plan_filter"):
        lines.append(f"plans kept by --plan {d['plan_filter']!r}: {d['launchable_plans']} launchable")
    if d["fastest_plan"] != d["plan"]:
        lines.append(f"(the fastest launchable plan is {d['fastest_plan']}; the policy chose the one above)")
    return lines


def dry_run_markdown(d: dict[str, Any]) -> str:
    lines = dry_run_lines(d)
    return f"# Dry run\n\n{lines[0]}.\n\n" + "\n".join(f"- {x}" for x in lines[1:]) + "\n"


def dry_run_artifact(d: dict[str, Any]) -> None:
    """Markdown artifact ``frenzy-dry-run`` (the flow's ``dry_run=True``)."""
    from prefect.artifacts import create_markdown_artifact

    create_markdown_artifact(markdown=dry_run_markdown(d), key=DRY_RUN_KEY,
                             description=f"what {d['job']} would launch (nothing started)")


def print_dry_run(job: TrainingJob, cluster: Cluster, args) -> int:
    """`frenzy run JOB --dry-run [--json]`: exit 0 when it would launch, 2 when nothing fits."""
    import json

    from estimator.plans import DEFAULT_SAFETY_MARGIN_GIB

    margin = args.safety_margin_gib if args.safety_margin_gib is not None else DEFAULT_SAFETY_MARGIN_GIB
    d = dry_run(job, cluster, safety_margin_gib=margin, policy=args.policy or "frenzy",
                plan_filter=getattr(args, "plan", None))
    if args.json:
        d = {k: v for k, v in d.items() if k != "needs"} | (
            {"needs": [{**n, "text": _needs_line(n)} for n in d["needs"]]} if "needs" in d else {})
        print(json.dumps(d))
    else:
        print("\n".join(dry_run_lines(d)))
    return 0 if d["launch"] else 2          # the same job without --dry-run is refused with 2



def dry_run_in_flow(job: TrainingJob, cluster: Cluster, *, safety_margin_gib: float, policy: str,
                    plan_filter: str | None = None) -> dict[str, Any]:
    """The `frenzy-submit` flow's ``dry_run=True``: the dry run with the pools' online workers
    counted on the flow's server, shown as the ``frenzy-dry-run`` artifact and in the log."""
    from prefect import get_client, get_run_logger

    from frenzy_flows.dispatch import workers_online

    with get_client(sync_client=True) as client:     # as the submission chooses: registered pools only
        registered = [p.name for p in client.read_work_pools()]
    d = dry_run(job, cluster, safety_margin_gib=safety_margin_gib, policy=policy, workers=workers_online,
                plan_filter=plan_filter, registered=registered)
    dry_run_artifact(d)
    log = get_run_logger()
    for line in dry_run_lines(d):
        log.info("%s", line)
    return d
