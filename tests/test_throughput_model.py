"""Throughput model: behaviour of each term (directions and ratios, not pinned numbers)."""
import math
from types import SimpleNamespace as NS

import pytest

from estimator.catalog import get_gpu
from estimator.plan import Plan
from estimator.throughput import (DEFAULT_FACTORS, flops_per_token, job_duration_s, step_time,
                                  step_time_breakdown, tokens_per_s)

L8 = NS(params=8.03e9, layers=32, hidden=4096, vocab=128256, tied_embeddings=False)
G2 = NS(params=124e6, layers=12, hidden=768, vocab=50257, tied_embeddings=True)


def plan(g="A100-80GB", dp=1, tp=1, pp=1, zero=0, mb=4, ga=1, ckpt="none", **kw):
    return Plan(gpu_type=g, gpus=dp * tp * pp, dp=dp, tp=tp, pp=pp, zero=zero, micro_batch=mb,
                grad_accum=ga, act_ckpt=ckpt, **kw)


def st(p, spec=G2, seq=1024, **kw):
    return step_time_breakdown(spec, p, get_gpu(p.gpu_type), seq_len=seq, **kw)


def test_attention_is_as_wide_as_the_heads_not_the_hidden_size():
    """Qwen3-0.6B: 16 heads of 128 over a 1,024 hidden size, so its attention core (scores and
    values over heads x head width) is twice what hidden x seq would give; a step spends more
    than for the same model with 64-wide heads (whose projections are half as wide too), and
    more than for a model of the same parameters whose heads alone are narrower (the step's
    attention follows the head width, not only the parameter count)."""
    from estimator.models import PRESETS

    q3 = PRESETS["qwen3-0.6b"]
    attn = flops_per_token(q3, 4096) - flops_per_token(q3, 0)
    assert attn == pytest.approx(12 * q3.layers * 16 * 128 * 4096)
    narrow = q3.model_copy(update={"head_dim": None, "name": "narrow heads"})
    p = plan(g="H100-80GB", mb=1, precision="bf16")
    assert st(p, q3, seq=4096).compute > st(p, narrow, seq=4096).compute
    same_params = dict(params=q3.params, layers=28, hidden=1024, vocab=151936, tied_embeddings=True, heads=16,
                       kv_heads=8, ffn=3072, arch="llama")
    assert st(p, NS(**same_params, d_head=128), seq=4096).compute > st(p, NS(**same_params, d_head=64), seq=4096).compute


def test_a_sliding_window_the_sequence_reaches_costs_the_causal_skip():
    """Mistral-7B (window 4,096) under SDPA: at 8,192 tokens the explicit mask leaves the
    kernel every score tile (twice a causal kernel's); at 4,095 tokens the window changes
    nothing."""
    from estimator.models import PRESETS

    mistral = PRESETS["mistral-7b"]
    plain = mistral.model_copy(update={"sliding_window": None, "name": "no window"})
    p = plan(g="H100-80GB", mb=1, precision="bf16")
    assert st(p, mistral, seq=8192).compute > st(p, plain, seq=8192).compute
    assert st(p, mistral, seq=4095).compute == st(p, plain, seq=4095).compute


def test_flops_per_token_6p_plus_attention_and_recompute_ordering():
    f0 = flops_per_token(G2, 1024)
    assert f0 == pytest.approx(6 * 124e6 + 12 * 12 * 768 * 1024)
    fs, ff = flops_per_token(G2, 1024, "selective"), flops_per_token(G2, 1024, "full")
    assert f0 < fs < ff == pytest.approx(f0 * 4 / 3)
    # untied embeddings: the input table is a lookup, not FLOPs
    assert flops_per_token(L8, 0) == pytest.approx(6 * (8.03e9 - 128256 * 4096))


def test_faster_gpu_is_faster_and_compute_scales_with_tokens():
    a = st(plan("A100-80GB")).total
    h = st(plan("H100-80GB")).total
    r = st(plan("RTX3090-24GB")).total
    assert h < a < r
    one = st(plan(mb=8, ga=1))
    two = st(plan(mb=8, ga=2))
    assert two.compute == pytest.approx(2 * one.compute)


def test_data_parallel_scales_and_pays_communication():
    one = st(plan(dp=1, mb=8, ga=4), spec=L8, seq=2048)
    four = st(plan(dp=4, mb=8, ga=1), spec=L8, seq=2048)
    assert four.compute == pytest.approx(one.compute / 4)
    assert four.dp_comm > 0 and one.dp_comm == 0
    # the same DP group across nodes (slow network) costs more than inside an NVLink node
    across = st(plan(dp=4, mb=8, ga=1), spec=L8, seq=2048, nodes=4, inter_node_gbps=25)
    assert across.dp_comm > four.dp_comm


def test_zero3_communicates_more_than_zero1_and_pcie_more_than_nvlink():
    z1 = st(plan(dp=8, zero=1, mb=1, ga=4), spec=L8, seq=2048)
    z3 = st(plan(dp=8, zero=3, mb=1, ga=4), spec=L8, seq=2048)
    assert z3.dp_comm > z1.dp_comm
    nv = st(plan("A100-80GB", tp=4, mb=1, ga=4), spec=L8, seq=2048).tp_comm
    pcie = st(plan("A10-24GB", tp=4, mb=1, ga=4), spec=L8, seq=2048).tp_comm
    assert pcie > nv > 0


def test_pipeline_bubble_shrinks_with_more_microbatches():
    few = st(plan(pp=4, mb=1, ga=4), spec=L8, seq=2048)
    many = st(plan(pp=4, mb=1, ga=32), spec=L8, seq=2048)
    assert few.bubble / (few.compute + few.memory) == pytest.approx(3 / 4)
    assert many.bubble / (many.compute + many.memory) == pytest.approx(3 / 32)
    assert few.pp_comm > 0


def test_interleaving_divides_the_bubble_and_multiplies_the_pipeline_sends():
    """Interleaved 1F1B (vpp chunks per rank): bubble fraction (pp - 1) / (vpp m), and fill and
    drain cross pp vpp - 1 chunk boundaries instead of pp - 1."""
    plain = st(plan(pp=4, mb=1, ga=8), spec=L8, seq=2048)
    inter = st(plan(pp=4, mb=1, ga=8, vpp=2), spec=L8, seq=2048)
    assert inter.bubble / (inter.compute + inter.memory) == pytest.approx(3 / (2 * 8))
    assert inter.compute == plain.compute and inter.bubble == pytest.approx(plain.bubble / 2)
    assert inter.pp_comm == pytest.approx(plain.pp_comm * 7 / 3)
    assert inter.total < plain.total
    # one micro-batch goes round the ranks alone: nothing to interleave with
    one, one_v = st(plan(pp=4, mb=8, ga=1), spec=L8, seq=2048), st(plan(pp=4, mb=8, ga=1, vpp=2), spec=L8, seq=2048)
    assert one_v.bubble == pytest.approx(one.bubble)
    two_v = st(plan(pp=4, mb=4, ga=2, vpp=2), spec=L8, seq=2048)      # (4 - 2) + 1 / 2 of 2 slots
    assert two_v.bubble / (two_v.compute + two_v.memory) == pytest.approx(2.5 / 2)


def test_offload_and_recompute_cost_time():
    base = st(plan(dp=2, zero=2, mb=2, ga=2), spec=L8, seq=2048).total
    off = st(plan(dp=2, zero=2, mb=2, ga=2, offload="optimizer"), spec=L8, seq=2048).total
    ck = st(plan(dp=2, zero=2, mb=2, ga=2, ckpt="full"), spec=L8, seq=2048).total
    assert off > base and ck > base


def test_factors_recalibrate_utilisation():
    p = plan("A100-80GB", mb=8, ga=2)
    g = get_gpu("A100-80GB")
    slow = DEFAULT_FACTORS.with_(util={"A100-80GB": g.util / 2})
    a = step_time_breakdown(G2, p, g, seq_len=1024)
    b = step_time_breakdown(G2, p, g, seq_len=1024, factors=slow)
    # the tensor-math part doubles; operand traffic and memory-bound kernels do not change
    assert 1.3 * a.compute < b.compute < 2 * a.compute
    assert b.memory == pytest.approx(a.memory)
    starved = step_time_breakdown(G2, p, g, seq_len=1024, factors=DEFAULT_FACTORS.with_(mem_eff={g.name: 0.2}))
    assert starved.memory > 3 * a.memory and starved.compute > a.compute


def test_duration_and_tokens_per_s_are_consistent():
    p = plan("H100-80GB", dp=2, mb=4, ga=2)
    g = get_gpu("H100-80GB")
    t = step_time(G2, p, g, seq_len=512)
    assert job_duration_s(G2, p, g, seq_len=512, steps=100) == pytest.approx(100 * t)
    assert tokens_per_s(G2, p, g, seq_len=512) == pytest.approx(4 * 2 * 2 * 512 / t)


def test_fp32_slower_than_bf16_and_bf16_on_v100_slow():
    g = get_gpu("A100-80GB")
    assert step_time(G2, plan(precision="fp32"), g, seq_len=1024) > step_time(G2, plan(), g, seq_len=1024)
    v = get_gpu("V100-32GB")
    assert step_time(G2, plan("V100-32GB"), v, seq_len=1024) > \
        2 * step_time(G2, plan("V100-32GB", precision="fp16"), v, seq_len=1024)


def test_eager_attention_and_narrow_layers_cost_time():
    g = get_gpu("H200-141GB")
    flash = step_time(G2, plan("H200-141GB", mb=8), g, seq_len=1024)
    eager = step_time(G2, plan("H200-141GB", mb=8, attention="eager"), g, seq_len=1024)
    assert eager > 1.2 * flash
    # the same FLOPs in wider layers run at a higher share of peak (bf16 tensor cores)
    narrow = NS(params=12 * 48 * 1024**2, layers=48, hidden=1024, vocab=0)   # same parameters
    wide = NS(params=12 * 3 * 4096**2, layers=3, hidden=4096, vocab=0)
    t_n = step_time_breakdown(narrow, plan("H200-141GB", mb=4), g, seq_len=512)
    t_w = step_time_breakdown(wide, plan("H200-141GB", mb=4), g, seq_len=512)
    assert t_n.compute > 1.15 * t_w.compute


def _h200_runs(name):
    import json
    from pathlib import Path

    from estimator.models import resolve_model
    from estimator.throughput import Measurement

    data = json.loads((Path(__file__).resolve().parents[1] / "bench" / name).read_text())
    g = get_gpu("H200-141GB")
    out = []
    for r in data["results"]:
        c = r["config"]
        p = Plan(gpu_type=g.name, gpus=1, micro_batch=c["micro_batch"], grad_accum=c.get("grad_accum", 1),
                 act_ckpt=c["act_ckpt"], attention=c["attention"],
                 precision={"amp": "bf16", "master": "bf16", "fp32": "fp32"}[c["regime"]], optimizer=c["optimizer"])
        out.append(Measurement(resolve_model(c["model"]), p, g, c["seq_len"], r["step_s"]))
    return out


def test_calibrated_model_tracks_held_out_h200_step_times():
    """Single-GPU Hugging Face training runs measured on an H200: the per-GPU factors refit on
    one file (30 runs) predict the other (24 held-out runs): median within 20%, most within 1.5x,
    and closer than the uncalibrated defaults."""
    import statistics

    from estimator.throughput import fit_factors

    fit, held = _h200_runs("estimator_measured_h200.json"), _h200_runs("estimator_measured_h200_heldout.json")
    assert len(fit) >= 20 and len(held) >= 20
    f = fit_factors(fit)
    assert set(f.util) == {"H200-141GB"} and 0.1 <= f.util["H200-141GB"] <= 1.0

    def ratios(fac):
        return [step_time(m.spec, m.plan, m.gpu, seq_len=m.seq_len, factors=fac) / m.step_s for m in held]

    before, after = ratios(DEFAULT_FACTORS), ratios(f)
    assert 0.8 <= statistics.median(after) <= 1.2
    assert sum(0.67 <= x <= 1.5 for x in after) >= 0.75 * len(after)
    med_abs_log = lambda rs: statistics.median(abs(math.log(x)) for x in rs)  # noqa: E731
    assert med_abs_log(after) < med_abs_log(before)


def test_memoised_stage_terms_match_a_fresh_computation_and_follow_the_factors():
    """The per-(spec, GPU, factors) stage cache: step_time is the breakdown's total, a second call
    (cached terms) equals the first, other factors objects and plan-like objects without the
    optional fields get their own terms, not a cached neighbour's."""
    p = plan("H100-80GB", dp=8, zero=3, mb=2, ga=4)
    g = get_gpu("H100-80GB")
    first = step_time_breakdown(L8, p, g, seq_len=2048, nodes=1, factors=DEFAULT_FACTORS)
    again = step_time(L8, p, g, seq_len=2048, nodes=1, factors=DEFAULT_FACTORS)
    assert again == pytest.approx(first.total, rel=1e-12)
    slow = DEFAULT_FACTORS.with_(util={g.name: 0.3})
    assert step_time(L8, p, g, seq_len=2048, factors=slow) > again * 1.5
    assert step_time(L8, p, g, seq_len=2048, factors=DEFAULT_FACTORS) == again
    bare = NS(dp=8, tp=1, pp=1, micro_batch=2, grad_accum=4, zero=3)   # no cp, precision, act_ckpt, ...
    assert step_time(L8, bare, g, seq_len=2048, factors=DEFAULT_FACTORS) == pytest.approx(again, rel=1e-12)
    # another GPU with the same plan is not served the H100's cached terms
    assert step_time(L8, p, get_gpu("A100-80GB"), seq_len=2048, factors=DEFAULT_FACTORS) > again * 1.5


def test_ulysses_all_to_alls_grow_with_cp_and_the_sequence_and_recompute_repeats_them():
    """cp (DeepSpeed Ulysses) pays four all-to-alls per layer forward and four backward (a third
    set under full recomputation); nothing at cp = 1. Per rank a cp-way exchange sends (cp-1)/cp
    of the rank's s/cp tokens, so the total over a step grows with cp (at a fixed global batch)
    and with the sequence."""
    def cp_comm(cp, seq=8192, ckpt="none", g="A100-80GB"):
        p = Plan(gpu_type=g, gpus=8, dp=8 // cp, cp=cp, micro_batch=1, grad_accum=cp, act_ckpt=ckpt)
        return st(p, spec=L8, seq=seq).cp_comm
    assert cp_comm(1) == 0.0
    assert 0 < cp_comm(2) < cp_comm(4) < cp_comm(8)
    assert cp_comm(2, seq=16384) == pytest.approx(2 * cp_comm(2, seq=8192))
    assert cp_comm(2, ckpt="full") == pytest.approx(1.5 * cp_comm(2))
    assert cp_comm(2, g="A10-24GB") > cp_comm(2)           # PCIe is slower than NVLink


def test_sequence_parallel_costs_what_data_parallel_costs_plus_its_all_to_alls():
    """Each Ulysses rank attends over the whole sequence for heads / cp heads: per token of its
    slice the attention work of the full length, not of s / cp. So dp=1 cp=2 at micro-batch 2
    (2 x s/2 rows per GEMM) computes exactly what dp=2 at micro-batch 1 does, reduces its gradients
    over the same two ranks, and adds only the all-to-alls."""
    seq = 16384
    cp = st(Plan(gpu_type="H100-80GB", gpus=2, dp=1, cp=2, micro_batch=2, grad_accum=4), spec=L8, seq=seq)
    dp = st(Plan(gpu_type="H100-80GB", gpus=2, dp=2, micro_batch=1, grad_accum=4), spec=L8, seq=seq)
    assert cp.compute == pytest.approx(dp.compute) and cp.memory == pytest.approx(dp.memory)
    assert dp.dp_comm > 0 and cp.dp_comm == pytest.approx(dp.dp_comm)   # reduced over dp x cp ranks
    assert cp.total == pytest.approx(dp.total + cp.cp_comm) and cp.cp_comm > 0
