"""Offload plans need host memory: ZeRO-Offload keeps the offloaded optimizer states (and the
parameters) of every training process of a node in that node's RAM. The planner marks the
offload plans whose offloaded bytes a node cannot hold, with the figures; the cluster file says
how much a node has (``host_ram_gib``), else a documented default."""
from __future__ import annotations

import pytest

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.memory import GIB, host_offload_bytes, validate_knobs
from estimator.models import resolve_model
from estimator.plans import enumerate_plans, plans_for_job
from scheduler.cluster import HOST_RAM_PER_GPU_MEMORY, parse_cluster

TWO_L4 = "pools:\n  - {name: l4, gpu: L4-24GB, nodes: 1, gpus_per_node: 2}\n"
BIG = TrainingJob(model="llama-3.1-70b", seq_len=2048, global_batch=32, train_steps=1)


def test_host_bytes_are_deepspeeds_per_parameter_count():
    spec = resolve_model("llama-3.1-70b")
    kw = dict(seq_len=2048, micro_batch=1, grad_accum=16, dp=2, precision="bf16", optimizer="adamw")
    none = validate_knobs(spec, zero=3, offload="none", **kw)
    opt = validate_knobs(spec, zero=3, offload="optimizer", **kw)
    both = validate_knobs(spec, zero=3, offload="optimizer+params", **kw)
    assert host_offload_bytes(spec, none) == 0.0
    # fp32 master + fp32 gradient + Adam's two moments = 16 B, + the bf16 parameters = 18 B; x1.5
    # buffers; each of the dp=2 processes holds half
    assert host_offload_bytes(spec, opt) == pytest.approx(16 * 1.5 * spec.params / 2, rel=0.01)
    assert host_offload_bytes(spec, both) == pytest.approx(18 * 1.5 * spec.params / 2, rel=0.01)
    tp2 = validate_knobs(spec, zero=3, offload="optimizer", **{**kw, "dp": 1}, tp=2)
    assert host_offload_bytes(spec, tp2) == pytest.approx(host_offload_bytes(spec, opt), rel=0.01)


def test_estimate_reports_the_host_memory_of_an_offload_plan():
    from estimator import estimate

    est = estimate("llama-2-7b", seq_len=1024, micro_batch=1, dp=8, zero=3, offload="optimizer")
    assert est.host_offload_gib == pytest.approx(16 * 1.5 * resolve_model("llama-2-7b").params / 8 / GIB, rel=0.01)
    assert estimate("llama-2-7b", seq_len=1024, micro_batch=1, dp=8, zero=3).host_offload_gib == 0.0


def test_70b_on_two_l4_no_longer_fits_by_offloading_everything():
    cluster = parse_cluster(TWO_L4)
    host = cluster.host_ram_gib()["L4-24GB"]
    unchecked = enumerate_plans(BIG, "L4-24GB", max_gpus=2, gpus_per_node=2)
    assert unchecked and all(p.offload != "none" and p.not_launchable is None for p in unchecked)   # before
    plans = enumerate_plans(BIG, "L4-24GB", max_gpus=2, gpus_per_node=2, host_ram_gib=host)
    assert plans and all(p.not_launchable for p in plans)
    why = plans[0].not_launchable
    assert why.startswith("plan.offload:") and "GiB of host memory per node" in why and f"{host:,.0f} GiB" in why
    assert "\n" not in why


def test_offload_plans_that_the_nodes_hold_stay_launchable():
    job = TrainingJob(model="llama-2-7b", seq_len=2048, global_batch=32, train_steps=1)
    cluster = parse_cluster("pools:\n  - {name: g, gpu: RTX3090-24GB, nodes: 1, gpus_per_node: 8}\n")
    plans = plans_for_job(job, cluster.inventory(), gpus_per_node=cluster.gpus_per_node(),
                          host_ram_gib=cluster.host_ram_gib())["RTX3090-24GB"]
    ok = [p for p in plans if p.offload != "none" and p.not_launchable is None]
    assert ok                                           # 7B x 16 B x 1.5 = 156 GiB < 384 GiB
    small = parse_cluster("pools:\n  - {name: g, gpu: RTX3090-24GB, nodes: 1, gpus_per_node: 8, host_ram_gib: 64}\n")
    tight = plans_for_job(job, small.inventory(), gpus_per_node=small.gpus_per_node(),
                          host_ram_gib=small.host_ram_gib())["RTX3090-24GB"]
    assert all(p.not_launchable for p in tight if p.offload != "none")
    assert any(p.offload != "none" for p in tight)     # still shown, with the reason


def test_cluster_host_ram_default_and_field():
    c = parse_cluster(TWO_L4 + "  - {name: big, gpu: H100-80GB, nodes: 2, gpus_per_node: 8, host_ram_gib: 2048}\n"
                      "  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")
    from estimator.catalog import get_gpu

    assert c.host_ram_gib() == {"L4-24GB": pytest.approx(HOST_RAM_PER_GPU_MEMORY * 2 * get_gpu("L4-24GB").memory_gib),
                                "H100-80GB": 2048.0}
    for bad in ("0", "-1", "true", "1e9", ".nan"):
        with pytest.raises(FrenzyInputError, match="host_ram_gib"):
            parse_cluster(f"pools:\n  - {{name: a, gpu: A100-80GB, gpus_per_node: 8, host_ram_gib: {bad}}}\n")


def test_dry_run_refuses_with_the_host_memory_reason():
    from frenzy_flows.dryrun import dry_run

    d = dry_run(BIG, parse_cluster(TWO_L4), safety_margin_gib=1.0)
    assert d["launch"] is False
    assert "L4-24GB: no plan that fits can be launched here" in d["reason"]
    assert "GiB of host memory per node" in d["reason"]
