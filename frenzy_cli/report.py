"""Human-readable rendering of a submission's result (rich tables)."""
from __future__ import annotations

from rich.console import Console
from rich.markup import escape

from .console import console as make_console
from rich.table import Table

from frenzy_flows.artifacts import CHOSEN_MARK, device_used_label, why_not_chosen

from .units import format_memory, format_seconds

PLANS_PER_TYPE = 5


def print_result(result, console: Console | None = None) -> None:
    console = console or make_console()
    est = result.estimate
    plan = result.initial_plan
    # the candidate it was: the result counts the nodes of its placement, which may be more
    # than the planner's count
    plan = next((p for ps in result.plans.values() for p in ps if p.same_knobs(plan)), plan)

    t = Table(title=f"Memory estimate per GPU: {result.job_name} on {plan.short()}",
              title_justify="left", min_width=72)
    t.add_column("term")
    t.add_column("memory", justify="right")
    used_label = device_used_label(plan.gpu_type)
    rows = list(est.get("breakdown_gib", {}).items()) + [
        ("allocated peak", est["allocated_peak_gib"]), ("reserved peak", est["reserved_peak_gib"]),
        (used_label, est["device_used_gib"])]
    for name, gib in rows:
        t.add_row(name, format_memory(gib),
                  style="bold" if name in ("allocated peak", used_label) else None)
    console.print(f"parameters: {est.get('params', 0):,}")
    console.print(t)

    t = Table(title="Candidate plans per GPU type (fastest first)", title_justify="left")
    for col in ("GPU type", "GPUs", "dp/tp/pp", "ZeRO", "offload", "ckpt", "micro x accum",
                "memory", "step", "choice"):
        t.add_column(col, justify="right" if col not in ("GPU type", "ckpt", "offload", "choice") else "left")
    for gpu_type, plans in result.plans.items():
        shown = plans[:PLANS_PER_TYPE]
        if plan in plans and plan not in shown:
            shown.append(plan)
        for p in shown:
            mark = CHOSEN_MARK if p == plan else ""
            if not mark and p.step_time_s < plan.step_time_s:
                mark = why_not_chosen(p, plan, short=True)
            t.add_row(gpu_type, str(p.gpus), f"{p.dp}/{p.tp}/{p.pp}" + (f" vpp{p.vpp}" if p.vpp > 1 else ""), str(p.zero),
                      p.offload, p.act_ckpt, f"{p.micro_batch} x {p.grad_accum}", format_memory(p.device_used_gib),
                      format_seconds(p.step_time_s), mark, style="bold green" if p == plan else None)
        if len(plans) > len(shown):
            t.add_row(gpu_type, f"(+{len(plans) - len(shown)} more)", "", "", "", "", "", "", "", "")
    console.print(t)

    # text that is not ours (error messages quoting C++ sources as "[.../pair.cc:537]", pool
    # and node names, paths) is escaped: Rich read it as markup and raised
    a = result.allocation
    console.print(f"[bold]Assignment[/]: {escape(a.gpu_type)} pool [cyan]{escape(a.pool)}[/], "
                  "placement " + "; ".join(f"{escape(node)} devices {','.join(map(str, ids))}"
                                           for node, ids in a.placement.items())
                  + f", allocation {a.allocation_id}")
    for i, att in enumerate(result.attempts, 1):
        console.print(f"  attempt {i}: {att.get('outcome')} on {escape(str(att.get('plan', {}).get('gpu_type')))}"
                      f" (resumed from step {att.get('resumed_from_step', 0)})"
                      + (f" - {escape(str(att['error']))}" if att.get("error") else ""))

    t = Table(title="Training loss per step", title_justify="left", min_width=32)
    t.add_column("step", justify="right")
    t.add_column("loss", justify="right")
    for step, loss in enumerate(result.losses, 1):
        t.add_row(str(step), f"{loss:.4f}")
    console.print(t)
    m = result.measured
    if m:
        mem = (f"allocated {format_memory(m.get('allocated_peak_gib'))}, "
               f"reserved {format_memory(m.get('reserved_peak_gib'))}"
               if m.get("memory_measured") else "memory not measured (CPU)")
        console.print(f"measured: step {format_seconds(m.get('step_time_s', 0))}, "
                      f"{m.get('tokens_per_s', 0):,.0f} tokens/s, {mem}")
    if result.losses:
        console.print(f"final loss {result.losses[-1]:.4f}"
                      + (f", eval loss {result.eval_losses[-1]['loss']:.4f} at step {result.eval_losses[-1]['step']}"
                         if result.eval_losses else ""))
    console.print(f"status: [bold]{result.status}[/]; checkpoints: {escape(str(result.checkpoint_dir or 'none written'))}"
                  + (f"; export: {escape(str(result.export_dir))}" if result.export_dir else ""))
