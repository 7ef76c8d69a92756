"""bench/throughput_public.py: the public-set scorer (bad rows reported, never a crash) and the
throughput model's physical terms (precision variants, bandwidth-bound work, fused attention)."""
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest

from estimator.catalog import get_gpu
from estimator.errors import FrenzyInputError
from estimator.plan import Plan
from estimator.throughput import step_time, step_time_breakdown

ROOT = Path(__file__).resolve().parents[1]
spec_ = importlib.util.spec_from_file_location("throughput_public", ROOT / "bench" / "throughput_public.py")
tp = importlib.util.module_from_spec(spec_)
sys.modules["throughput_public"] = tp        # dataclasses look their module up while loading
spec_.loader.exec_module(tp)

HEADER = ("row,source,model,params,layers,hidden,heads,kv_heads,ffn,vocab,seq_len,micro_batch,grad_accum,"
          "dp,tp,pp,zero,act_ckpt,precision,gpu,gpus_per_node,nodes,measured_tokens_per_s_per_gpu,notes")
GOOD = "1,src-a,m1,1315950592,24,2048,16,16,8192,50368,2048,14,1,8,1,1,3,none,bf16,{gpu},8,1,{meas},attention=flash"


def _csv(tmp_path, lines):
    p = tmp_path / "t.csv"
    p.write_text("\n".join([HEADER, *lines]) + "\n")
    return p


def test_bad_rows_are_reported_not_expressible_with_the_reason(tmp_path, capsys):
    p = _csv(tmp_path, [
        GOOD.format(gpu="H100-80GB", meas=45000),
        GOOD.format(gpu="A100-80GB", meas=20000),
        GOOD.format(gpu="Z9000-1TB", meas=1000),                                  # unknown GPU
        "4,src-b,m1,1315950592,24,2048,16,16,8192,50368,2048,14,1,8,1,1,3,none,bf16,A100-80GB,8,1,,x",  # empty
        "5,src-b,m1,1315950592,24,2048,16,16,8192,50368,2048,14,1,4,1,1,3,none,bf16,A100-80GB,8,1,9,x",  # 4 != 8
        "6,src-b,m1,1315950592,24,2048,16,16,8192,50368,2048,14,1,8,1,1,3,none,fp8,A100-80GB,8,1,9,x",  # no FP8
        "7,src-b,m1,1315950592,24,2048,16,16,8192,50368,2048,14,1,8,1,1,3,none,int4,A100-80GB,8,1,9,x",
        "8,src-b,m1,lots,24,2048,16,16,8192,50368,2048,14,1,8,1,1,3,none,bf16,A100-80GB,8,1,9,x",
    ])
    assert tp.main(["--csv", str(p), "--json"]) == 0
    out = capsys.readouterr().out
    s = json.loads(out.strip().splitlines()[-1])
    assert s["rows"] == 8 and s["expressible"] == 2
    assert set(s) == {"rows", "expressible", "median_ratio", "p10_ratio", "p90_ratio", "per_gpu_median_ratio",
                      "rank_pairs", "rank_pairs_correct"}
    assert s["rank_pairs"] == 1 and s["rank_pairs_correct"] == 1
    for reason in ("unknown GPU type 'Z9000-1TB'", "measured_tokens_per_s_per_gpu", "gpus_per_node",
                   "A100-80GB has no FP8", "precision", "params: must be an integer"):
        assert reason in out, reason
    assert "reproduce: PYTHONPATH=$PWD python bench/throughput_public.py --csv" in out


def test_rows_the_source_flags_are_scored_and_reported_apart(tmp_path, capsys):
    """A CAUTION row counts in every headline figure; the per-type medians are shown once more
    without it (text only), so a type whose median rests on a flagged measurement is visible."""
    flagged = GOOD.format(gpu="A100-80GB", meas=5000).replace("attention=flash",
                                                               '"CAUTION anomalous; attention=flash"')
    p = _csv(tmp_path, [GOOD.format(gpu="A100-80GB", meas=20000), flagged])
    rows = tp.load(p)
    assert [r.caution for r in rows] == [False, True]
    tp.predict(rows)
    s = tp.summary(rows)
    assert s["expressible"] == 2 and s["_caution_rows"] == 1
    both = sorted(r.ratio for r in rows)
    assert s["per_gpu_median_ratio"]["A100-80GB"] == pytest.approx(sum(both) / 2, rel=1e-3)
    assert s["_per_gpu_no_caution"]["A100-80GB"] == pytest.approx(rows[0].ratio, rel=1e-3)
    assert tp.main(["--csv", str(p), "--terms"]) == 0
    out = capsys.readouterr().out
    assert "without the 1 row the source flags (CAUTION): A100-80GB" in out
    assert "compute" in out and "memory" in out and "--terms" in out


def test_a_what_if_factor_rescores_every_row_and_bad_names_are_refused(tmp_path, capsys):
    p = _csv(tmp_path, [GOOD.format(gpu="A100-80GB", meas=20000)])
    assert tp.main(["--csv", str(p), "--json"]) == 0
    base = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["median_ratio"]
    # more bytes per norm / residual element: more memory-bound time, a lower predicted speed
    assert tp.main(["--csv", str(p), "--json", "--factor", "norm_residual_bytes_per_h=500"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["median_ratio"] < base
    assert "--factor norm_residual_bytes_per_h=500" in out
    assert tp.main(["--csv", str(p), "--factor", "util=0.5"]) == 2
    assert tp.main(["--csv", str(p), "--factor", "mem_bw_eff=fast"]) == 2
    assert "not a scalar throughput factor" in capsys.readouterr().err


def test_peak_bound_predicts_every_row_faster_and_flags_measurements_beyond_it(tmp_path, capsys):
    """--peak: every GPU at its datasheet peaks, no fixed overheads. No row can be predicted slower
    than with the defaults; a measurement faster than the bound scores below 1."""
    p = _csv(tmp_path, [GOOD.format(gpu="A100-80GB", meas=20000), GOOD.format(gpu="RTX4090-24GB", meas=1000)])
    rows, peak = tp.load(p), tp.load(p)
    tp.predict(rows)
    tp.predict(peak, tp.at_peak(tp.DEFAULT_FACTORS))
    for d, b in zip(rows, peak):
        assert b.predicted > d.predicted
    fast = b.predicted * 1.5                      # measured 1.5x beyond the bound of the last row
    p2 = _csv(tmp_path, [GOOD.format(gpu="RTX4090-24GB", meas=fast)])
    assert tp.main(["--csv", str(p2), "--json", "--peak"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out.strip().splitlines()[-1])["median_ratio"] == pytest.approx(1 / 1.5, rel=1e-3)
    assert "--peak --json" in out


def test_missing_column_and_missing_file(tmp_path, capsys):
    p = tmp_path / "short.csv"
    p.write_text("row,model,gpu\n1,m,H100-80GB\n")
    assert tp.main(["--csv", str(p), "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["rows"] == 1 and s["expressible"] == 0 and s["median_ratio"] is None
    assert tp.main(["--csv", str(tmp_path / "nope.csv")]) == 2


def test_public_set_scores_and_holds_out_sources(capsys):
    if not tp.DEFAULT_CSV.is_file():
        pytest.skip("the shared public set is not next to this checkout")
    assert tp.main(["--json", "--calibrate-on", "mosaicml,lambdal"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["rows"] == s["expressible"] == 29
    assert s["rank_pairs_correct"] == s["rank_pairs"] > 30
    assert 0.9 <= s["median_ratio"] <= 1.1
    cal = s["calibration"]
    assert cal["held_out_rows"] + cal["fit_rows"] == 29 and cal["held_out_rows"] > 0


L8 = NS(params=8.03e9, layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256,
        tied_embeddings=False, arch="llama")


def _p(gpu, **kw):
    return Plan(gpu_type=gpu, gpus=1, micro_batch=kw.pop("mb", 2), **kw)


def test_fp8_and_tf32_use_their_tensor_rates_where_the_gpu_has_them():
    h = get_gpu("H100-80GB")
    bf16 = step_time_breakdown(L8, _p("H100-80GB"), h, seq_len=4096)
    fp8 = step_time_breakdown(L8, _p("H100-80GB", matmul_precision="fp8"), h, seq_len=4096)
    assert fp8.compute < 0.75 * bf16.compute and fp8.memory == pytest.approx(bf16.memory)
    a = get_gpu("A100-80GB")
    fp32 = step_time(L8, _p("A100-80GB", precision="fp32"), a, seq_len=1024)
    tf32 = step_time(L8, _p("A100-80GB", precision="fp32", matmul_precision="tf32"), a, seq_len=1024)
    assert tf32 < fp32 / 3
    with pytest.raises(FrenzyInputError, match="matmul_precision"):
        step_time(L8, _p("A100-80GB", matmul_precision="fp8"), a, seq_len=1024)
    with pytest.raises(FrenzyInputError, match="matmul_precision"):
        step_time(L8, _p("V100-32GB", precision="fp32", matmul_precision="tf32"), get_gpu("V100-32GB"), seq_len=1024)


def test_memory_bound_work_follows_the_gpus_own_bandwidth():
    # H200 = H100 compute with 1.43x the bandwidth: the memory-bound part shrinks by that ratio
    h1 = step_time_breakdown(L8, _p("H100-80GB"), get_gpu("H100-80GB"), seq_len=2048)
    h2 = step_time_breakdown(L8, _p("H200-141GB"), get_gpu("H200-141GB"), seq_len=2048)
    assert h1.memory / h2.memory == pytest.approx(4800 / 3350)
    assert h2.total < h1.total
    # a bandwidth-heavy job (eager attention, narrow layers) ranks the 936 GB/s RTX 3090 ahead of
    # the 600 GB/s A10 although the A10 has 1.8x its tensor peak
    bert = NS(params=335e6, layers=24, hidden=1024, heads=16, ffn=4096, vocab=30522, arch="bert")
    t3090 = step_time(bert, _p("RTX3090-24GB", mb=28, precision="fp16", attention="eager"),
                      get_gpu("RTX3090-24GB"), seq_len=384)
    ta10 = step_time(bert, _p("A10-24GB", mb=28, precision="fp16", attention="eager"), get_gpu("A10-24GB"), seq_len=384)
    assert t3090 < ta10


def test_eager_attention_moves_score_traffic_and_causal_fused_attention_skips_half():
    g = get_gpu("A100-80GB")
    flash = step_time_breakdown(L8, _p("A100-80GB"), g, seq_len=4096)
    eager = step_time_breakdown(L8, _p("A100-80GB", attention="eager"), g, seq_len=4096)
    assert eager.memory > 2 * flash.memory and eager.compute > flash.compute
    enc = NS(**{**vars(L8), "arch": "bert"})                   # same shape, no causal mask
    assert step_time_breakdown(enc, _p("A100-80GB"), g, seq_len=4096).compute > flash.compute


def test_zero3_gathers_hide_under_compute_when_the_link_is_fast():
    g = get_gpu("H100-80GB")
    p = Plan(gpu_type="H100-80GB", gpus=8, dp=8, zero=3, micro_batch=4)
    nv = step_time_breakdown(L8, p, g, seq_len=4096)
    slow = step_time_breakdown(L8, p, g, seq_len=4096, nodes=8, inter_node_gbps=25)
    assert nv.dp_comm < 0.05 * nv.total < slow.dp_comm


def test_other_sources_spellings_are_read_as_what_they_mean(tmp_path, capsys):
    """A CSV from other sources: a BOM, header names in another case, GPU names as NVML writes
    them, llm-foundry's precision names, true / false checkpointing, attention kernels by name,
    '64.0' and '107,000' as numbers, blank plain settings. Each reads as the canonical row does."""
    canonical = _csv(tmp_path, [GOOD.format(gpu="A100-80GB", meas=20000)])
    ref = tp.load(canonical)
    tp.predict(ref)
    header = HEADER.upper().replace(",", ", ")
    variants = [
        "1,src-a,m1,1315950592,24,2048,16,16,8192,50368,2048,14.0,1,8,1,1,3,false,amp_bf16,NVIDIA A100-SXM4-80GB,8,1,"
        '"20,000",attention=fa2',
        "2,src-a,m1,1.315950592e9,24,2048,16,,8192,50368,2048,14,,8,,,3,,BF16,a100-80gb,8,1,20000,attention=sdpa",
    ]
    p = tmp_path / "other.csv"
    p.write_text("\ufeff" + "\r\n".join([header, *variants]) + "\r\n", encoding="utf-8")
    rows = tp.load(p)
    tp.predict(rows)
    assert [r.reason for r in rows] == ["", ""]
    for r in rows:
        assert r.gpu == "A100-80GB" and r.plan == ref[0].plan and r.predicted == pytest.approx(ref[0].predicted)
    ambiguous = [GOOD.format(gpu=g, meas=9) for g in ("NVIDIA A100", "H100 PCIe", "Tesla V100-SXM2")]
    rows = tp.load(_csv(tmp_path, ambiguous))
    assert "ambiguous" in rows[0].reason and "PCIe" in rows[1].reason and "ambiguous" in rows[2].reason
    assert tp.load(_csv(tmp_path, [GOOD.format(gpu="Tesla V100-SXM2-32GB", meas=9)]))[0].gpu == "V100-32GB"


def test_files_and_rows_no_model_has_are_one_line_not_a_traceback(tmp_path, capsys):
    impossible = [
        GOOD.format(gpu="A100-80GB", meas=9).replace(",24,2048,", ",24,1" + "0" * 40 + ","),   # hidden 1e40
        GOOD.format(gpu="A100-80GB", meas=9).replace(",8,1,1,3,", ",1,1,8,3,").replace("{", ""),  # pp 8 ok
        GOOD.format(gpu="A100-80GB", meas=9).replace(",16,16,8192,", ",16,32,8192,"),            # kv > heads
        GOOD.format(gpu="A100-80GB", meas=9).replace(",8,1,1,3,", ",1,8,1,3,").replace(",16,16,", ",12,12,"),
    ]
    rows = tp.load(_csv(tmp_path, impossible))
    tp.predict(rows)
    assert "beyond any model" in rows[0].reason and rows[1].reason == ""
    assert rows[2].reason.startswith("kv_heads") and rows[3].reason.startswith("tp")
    latin = tmp_path / "latin.csv"                              # an Excel export: notes in cp1252
    latin.write_bytes(("\n".join([HEADER, GOOD.format(gpu="A100-80GB", meas=9) + " 5 \xb5s"]) + "\n").encode("cp1252"))
    assert tp.main(["--csv", str(latin), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["expressible"] == 1
    dup = tmp_path / "dup.csv"
    dup.write_text(HEADER + ",gpu\n")
    runaway = tmp_path / "runaway.csv"
    runaway.write_text(HEADER + "\n" + '1,"' + "x" * (1 << 25) + "\n")
    for bad, words in ((dup, "more than once"), (runaway, "not a readable CSV")):
        assert tp.main(["--csv", str(bad), "--json"]) == 2
        err = capsys.readouterr().err
        assert words in err and len(err.strip().splitlines()) == 1
