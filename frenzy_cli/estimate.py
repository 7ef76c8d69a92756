"""`frenzy estimate`, `frenzy plan`, `frenzy models`: the memory estimator from the shell.

Flags are the keywords of ``estimator.estimate`` with ``-`` for ``_`` (all but the
implementation hooks ``zero_bucket_elems``, ``gradient_as_bucket_view`` and ``model_factory``,
which Python callers pass); ``--json`` prints one
JSON object instead of tables. Answers in milliseconds (no torch, no Prefect imported)."""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Iterator

from estimator.errors import FrenzyInputError


def _bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {v!r}")


def register(sub) -> None:
    e = sub.add_parser("estimate", help="per-GPU training memory of one configuration",
                       description="Per-GPU training memory (GiB) of one configuration.")
    m = e.add_argument_group("model (a preset / config.json, or the dimensions)")
    m.add_argument("--model", help="preset name (see `frenzy models`) or path to a HF config.json")
    m.add_argument("--arch", choices=["gpt", "llama", "bert", "opt"])
    for name in ("layers", "hidden", "heads", "kv-heads", "ffn", "vocab"):
        m.add_argument(f"--{name}", type=int)
    m.add_argument("--tied-embeddings", type=_bool, nargs="?", const=True, metavar="BOOL",
                   help="LM head shares the input embedding (bare: true; default: the model's)")
    j = e.add_argument_group("job and parallelism")
    j.add_argument("--seq-len", type=int, default=1024)
    j.add_argument("--micro-batch", type=int, default=1)
    j.add_argument("--grad-accum", type=int, default=1)
    for name in ("dp", "tp", "pp", "cp", "vpp"):
        j.add_argument(f"--{name}", type=int, default=1)
    j.add_argument("--sp", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
                   help="Megatron sequence parallelism (needs --tp > 1)")
    k = e.add_argument_group("memory")
    k.add_argument("--zero", type=int, default=0, help="ZeRO stage 0-3 (3 = FSDP full shard)")
    k.add_argument("--offload", default="none", help="none | optimizer | optimizer+params")
    k.add_argument("--precision", default="bf16", help="fp32 | fp16 | bf16")
    k.add_argument("--optimizer", default="adamw",
                   help="adamw | adam | sgd | adafactor | adamw8bit | adamw8bit-paged")
    k.add_argument("--act-ckpt", default="none", help="none | selective | full")
    k.add_argument("--attention", default="flash", help="flash | eager")
    k.add_argument("--mp-style", default="auto",
                   help="auto (zero 0: amp, zero>=1: master) | amp | master")
    from estimator.profiles import FRAMEWORKS
    t = e.add_argument_group("implementation and techniques")
    t.add_argument("--framework", default="frenzy",
                   help="implementation profile: " + " | ".join(FRAMEWORKS))
    t.add_argument("--master-weights", default="auto", help="auto | fp32 | none (pure 16-bit)")
    t.add_argument("--finetune", default="full", help="full | lora | qlora")
    t.add_argument("--lora-rank", type=int, help="adapter rank (default 16; with --finetune lora | qlora)")
    t.add_argument("--lora-targets", help="comma-separated projections, or all-linear (default: PEFT's; qkv_proj for phi3)")
    t.add_argument("--lora-dropout", type=float,
                   help="dropout on the adapters' input (PEFT's default 0; a Frenzy job's 0.05)")
    t.add_argument("--loss", default="auto", help="auto (the framework's own loss path) | standard | chunked | "
                                                  "fused-linear | fp32-logits | none")
    t.add_argument("--act-offload", type=_bool, nargs="?", const=True, default=False, metavar="BOOL")
    t.add_argument("--optimizer-in-backward", type=_bool, nargs="?", const=True, default=False,
                   metavar="BOOL")
    t.add_argument("--adamw-impl", default="auto", help="auto | foreach | foreach-legacy (PyTorch 2.0/2.1: two step temporaries) | fused | for-loop")
    t.add_argument("--fused-kernels", type=_bool, nargs="?", const=True, default=False,
                   metavar="BOOL", help="torch.compile / Liger fused norm and activation kernels")
    t.add_argument("--overlap-comm", type=_bool, nargs="?", const=True, default=None, metavar="BOOL",
                   help="DeepSpeed overlap_comm (default: DeepSpeed's, on at zero 3; off in Frenzy's trainer)")
    t.add_argument("--score-clamp", type=_bool, nargs="?", const=True, default=False, metavar="BOOL",
                   help="eager attention of transformers 4.2x (OPT, first Llama) keeps its clamped scores")
    t.add_argument("--allocator", default="auto",
                   help="auto (the framework's) | default | expandable (PYTORCH_CUDA_ALLOC_CONF="
                        "expandable_segments:True, what Frenzy's launcher sets): reserved and device used")
    e.add_argument("--gpu", help="catalog GPU type, e.g. A100-80GB (adds fits / overheads)")
    e.add_argument("--method", default="analytic", help="analytic | traced")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(handler=handle_estimate)

    p = sub.add_parser("plan", help="feasible parallel plans of a job per GPU type",
                       description="Feasible plans (fastest first) of a job on each GPU type.")
    p.add_argument("--model", required=True, help="preset name or path to a HF config.json")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--global-batch", type=int, required=True)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--optimizer", default="adamw")
    p.add_argument("--attention", default="flash")
    p.add_argument("--master-weights", default="fp32", help="fp32 | none (pure 16-bit)")
    p.add_argument("--finetune", default="full", help="full | lora | qlora")
    p.add_argument("--lora-rank", type=int, help="adapter rank (default 16; with --finetune lora | qlora)")
    p.add_argument("--cluster", help="cluster YAML (GPU types and counts); default: 8 of every "
                                     "catalog GPU type")
    p.add_argument("--gpu", action="append", help="only this GPU type (repeatable)")
    p.add_argument("--max-gpus", type=int, default=None,
                   help="GPUs per type without --cluster (default 8); with --cluster, the most GPUs "
                        "of a type one plan may use (default: all the cluster has)")
    p.add_argument("--safety-margin-gib", type=float, default=None)
    p.add_argument("--top", type=int, default=5, help="plans shown per GPU type (table only)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=handle_plan)

    ms = sub.add_parser("models", help="list the model presets",
                        description="Model presets with their dimensions and exact parameter counts.")
    ms.add_argument("--json", action="store_true")
    ms.set_defaults(handler=handle_models)


_EST_KEYS = ("model", "arch", "layers", "hidden", "heads", "kv_heads", "ffn", "vocab",
             "tied_embeddings", "seq_len", "micro_batch", "grad_accum", "dp", "tp", "pp", "cp",
             "sp", "vpp", "zero", "offload", "precision", "optimizer", "act_ckpt", "attention",
             "gpu", "method", "mp_style", "framework", "master_weights", "finetune", "lora_rank",
             "lora_targets", "lora_dropout", "loss", "act_offload", "optimizer_in_backward", "adamw_impl",
             "fused_kernels", "overlap_comm", "score_clamp", "allocator")


def _adapter_flags_need_lora(args) -> None:
    """``--lora-*`` with a full fine-tune would be ignored silently: a one-line error instead."""
    if args.finetune in ("lora", "qlora"):
        return
    given = [f"--{k.replace('_', '-')}" for k in ("lora_rank", "lora_targets", "lora_dropout")
             if getattr(args, k, None) is not None]
    if given:
        raise FrenzyInputError("--finetune", f"{', '.join(given)}: adapter settings need --finetune lora "
                                             f"or qlora (got {args.finetune!r})")


@contextlib.contextmanager
def _user_warnings() -> Iterator[list[str]]:
    """The text of the UserWarnings raised inside (a calibration file that does not parse), in
    the list it yields, filled as the block ends (also when it raises): the commands say them
    in their own output instead of Python's two-line warning."""
    import warnings

    said: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield said
        finally:
            said.extend(str(w.message) for w in caught if issubclass(w.category, UserWarning))


def handle_estimate(args) -> int:
    from estimator import estimate
    from estimator.catalog import resolve_gpu_name

    _adapter_flags_need_lora(args)
    if args.gpu is not None:
        args.gpu = resolve_gpu_name(args.gpu, field="--gpu")

    kw = {k: getattr(args, k) for k in _EST_KEYS if getattr(args, k) is not None}
    with _user_warnings() as with_warnings:
        est = estimate(**kw)
    if args.json:
        doc = est.model_dump(mode="json")
        # what Python warned of while estimating (a calibration file that does not parse) is
        # said here as in the table
        doc["warnings"] = with_warnings + [n for n in doc["warnings"] if n not in with_warnings]
        print(json.dumps(doc))
        return 0
    from .console import console
    from rich.table import Table
    con = console()
    for w in with_warnings:
        con.print(f"[yellow]warning:[/] {w}")
    for note in est.warnings:
        if note not in with_warnings:
            con.print(f"[yellow]warning:[/] {note}")
    from .units import format_memory
    con.print(f"[bold]{est.model}[/]  {est.params:,} parameters  ({est.method}, "
              f"framework {est.framework})")
    t = Table(title="per-GPU memory", show_header=True)
    t.add_column("stage")
    t.add_column("layers", justify="right")
    t.add_column("allocated", justify="right")
    t.add_column("reserved", justify="right")
    t.add_column("device used", justify="right")
    for s in est.stages:
        t.add_row(str(s.stage), str(s.layers), format_memory(s.allocated_peak_gib),
                  format_memory(s.reserved_peak_gib), format_memory(s.device_used_gib))
    if len(est.stages) > 1:
        t.add_row("peak", "", format_memory(est.allocated_peak_gib), format_memory(est.reserved_peak_gib),
                  format_memory(est.device_used_gib), style="bold")
    con.print(t)
    b = Table(title="breakdown at the peak")
    for k in est.breakdown_gib:
        b.add_column(k, justify="right")
    b.add_row(*(format_memory(v) for v in est.breakdown_gib.values()))
    con.print(b)
    if est.host_offload_gib:
        con.print(f"host memory for ZeRO-Offload: {format_memory(est.host_offload_gib)} per training process")
    if est.gpu:
        verdict = "[green]fits[/]" if est.fits else "[red]does not fit[/]"
        con.print(f"{est.gpu} ({format_memory(est.gpu_memory_gib)}): {verdict}")
    return 0


def _inventory(args) -> tuple[dict[str, int], dict[str, int] | int, dict | None, dict[str, float]]:
    """(GPU type -> count, GPUs per node, the cluster's own GPU types or None, GPU type -> host
    memory per node)."""
    from estimator.catalog import GPU_NAMES, resolve_gpu_name
    from estimator.errors import check_number
    from scheduler.cluster import MAX_CLUSTER_GPUS
    if args.max_gpus is not None:
        check_number("max_gpus", args.max_gpus, low=1, low_open=False, high=MAX_CLUSTER_GPUS, integer=True,
                     what="the largest cluster a file may describe")
    if args.cluster:
        from scheduler.cluster import load_cluster
        cl = load_cluster(args.cluster)
        if args.gpu:
            args.gpu = [resolve_gpu_name(g, cl.gpu_types, field="--gpu") for g in args.gpu]
        inv = cl.inventory()
        if args.max_gpus is not None:
            inv = {g: min(n, args.max_gpus) for g, n in inv.items()}
        return inv, cl.gpus_per_node(), cl.gpu_catalog(), cl.host_ram_gib()
    if args.gpu:
        args.gpu = [resolve_gpu_name(g, field="--gpu") for g in args.gpu]
    types = args.gpu or list(GPU_NAMES)
    if args.max_gpus is None:
        args.max_gpus = 8
    # nodes of 8 GPUs with the cluster file's default host memory
    from scheduler.cluster import Cluster, Pool
    hosts = Cluster(pools=[Pool(name=f"p{i}", gpu=g, gpus_per_node=8) for i, g in enumerate(types)]).host_ram_gib()
    return {g: args.max_gpus for g in types}, 8, None, hosts


def handle_plan(args) -> int:
    from estimator.plans import plan_warnings, plans_for_job

    _adapter_flags_need_lora(args)
    if args.top < 1:
        raise FrenzyInputError("--top", f"must be at least 1 (plans shown per GPU type), got {args.top}; "
                                        "--json prints every plan")

    finetune = {"method": args.finetune}
    if args.lora_rank is not None:
        finetune["rank"] = args.lora_rank
    job = {"model": args.model, "seq_len": args.seq_len, "global_batch": args.global_batch,
           "precision": args.precision, "optimizer": args.optimizer, "attention": args.attention,
           "master_weights": args.master_weights, "finetune": finetune}
    inv, gpn, gpus, hosts = _inventory(args)
    if args.gpu and args.cluster:
        missing = [g for g in args.gpu if g not in inv]
        if missing:
            raise FrenzyInputError("--gpu", f"{', '.join(missing)} not in the cluster {args.cluster} "
                                            f"(its types: {', '.join(inv)})")
        inv = {g: n for g, n in inv.items() if g in args.gpu}
    try:
        with _user_warnings() as notes:
            plans = plans_for_job(job, inv, gpus_per_node=gpn, safety_margin_gib=args.safety_margin_gib,
                                  gpus=gpus, host_ram_gib=hosts)
    except FrenzyInputError:
        for n in notes:         # a refusal may come of what was warned (a calibration file ignored)
            print(f"frenzy plan: warning: {n}", file=sys.stderr)
        raise
    notes += [n for n in plan_warnings(job) if n not in notes]
    if args.json:
        # stdout keeps its documented shape (GPU type -> plans); what the estimates say beside
        # their figures goes to stderr, one line each
        for n in notes:
            print(f"frenzy plan: warning: {n}", file=sys.stderr)
        print(json.dumps({g: [p.model_dump(mode="json") for p in ps] for g, ps in plans.items()}))
        return 0
    from .console import console
    from .units import format_memory, format_seconds
    from rich.table import Table
    con = console()
    for n in notes:
        con.print(f"[yellow]warning:[/] {n}")
    for g, ps in plans.items():
        if not ps:
            con.print(f"[dim]{g}: no feasible plan[/]")
            continue
        t = Table(title=f"{g}: {len(ps)} feasible plans (launchable first, fastest first)")
        for col in ("gpus", "dp", "tp", "pp", "cp", "zero", "offload", "ckpt", "mb x accum", "memory used",
                    "step", "launch here"):
            t.add_column(col, justify="right" if col != "launch here" else "left")
        for p in ps[: args.top]:
            pp = f"{p.pp} x {p.vpp} chunks" if p.vpp > 1 else str(p.pp)
            t.add_row(str(p.gpus), str(p.dp), str(p.tp), pp, str(p.cp), str(p.zero), p.offload,
                      p.act_ckpt, f"{p.micro_batch} x {p.grad_accum}", format_memory(p.device_used_gib),
                      format_seconds(p.step_time_s),
                      "yes" if p.not_launchable is None else f"no: {p.not_launchable}")
        con.print(t)
    return 0


def handle_models(args) -> int:
    from estimator.models import PRESETS
    rows = [{"name": n, "params": m.params, **m.dims(), "hf_model_type": m.model_type}
            for n, m in PRESETS.items()]
    if args.json:
        print(json.dumps(rows))
        return 0
    from .console import console
    from rich.table import Table
    t = Table(title=f"{len(rows)} model presets")
    for col in ("name", "params", "arch", "layers", "hidden", "heads", "kv", "ffn", "vocab", "tied"):
        t.add_column(col, justify="right" if col not in ("name", "arch") else "left")
    for r in rows:
        t.add_row(r["name"], f"{r['params']:,}", r["arch"], str(r["layers"]), str(r["hidden"]),
                  str(r["heads"]), str(r["kv_heads"]), str(r["ffn"]), str(r["vocab"]),
                  "yes" if r["tied_embeddings"] else "no")
    console().print(t)
    return 0
