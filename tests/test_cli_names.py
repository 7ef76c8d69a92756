"""GPU names as people type them, `--top 0`, the simulator's unfinished jobs."""
from __future__ import annotations

import json

import pytest

from estimator.errors import FrenzyInputError
from frenzy_cli.main import main


def test_gpu_names_ignore_case_and_the_size_suffix_when_unambiguous():
    from estimator.catalog import resolve_gpu_name

    assert resolve_gpu_name("h100-80gb") == "H100-80GB"
    assert resolve_gpu_name("H100") == "H100-80GB" and resolve_gpu_name("rtx3090") == "RTX3090-24GB"
    assert resolve_gpu_name("cpu") == "CPU" and resolve_gpu_name("A100-80GB") == "A100-80GB"
    with pytest.raises(FrenzyInputError, match="ambiguous: one of A100-40GB, A100-80GB"):
        resolve_gpu_name("a100")
    with pytest.raises(FrenzyInputError, match="unknown GPU type 'B300'"):
        resolve_gpu_name("B300")


def test_estimate_and_plan_take_lower_case_and_short_gpu_names(capsys):
    assert main(["estimate", "--model", "gpt2", "--gpu", "h100-80gb", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["gpu"] == "H100-80GB"
    assert main(["plan", "--model", "gpt2", "--seq-len", "512", "--global-batch", "8", "--gpu", "H100",
                 "--max-gpus", "2", "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)) == ["H100-80GB"]
    assert main(["plan", "--model", "gpt2", "--seq-len", "512", "--global-batch", "8", "--gpu", "a100"]) == 2
    assert "ambiguous" in capsys.readouterr().err


def test_cluster_files_take_lower_case_gpu_names():
    from scheduler.cluster import parse_cluster

    c = parse_cluster("pools:\n  - {name: h, gpu: h100-80gb, nodes: 1, gpus_per_node: 8}\n"
                      "  - {name: r, gpu: RTX3090, nodes: 1, gpus_per_node: 4}\n")
    assert [p.gpu for p in c.pools] == ["H100-80GB", "RTX3090-24GB"]
    with pytest.raises(FrenzyInputError, match=r"pools\[0\].gpu: GPU type 'a100' is ambiguous"):
        parse_cluster("pools:\n  - {name: a, gpu: a100, nodes: 1, gpus_per_node: 8}\n")


def test_plan_top_zero_is_one_line_error(capsys):
    assert main(["plan", "--model", "gpt2", "--seq-len", "512", "--global-batch", "8", "--top", "0"]) == 2
    err = capsys.readouterr()
    assert err.out == "" and err.err.count("\n") == 1 and "--top: must be at least 1" in err.err


def _sim(policy, states, jcts):
    from scheduler.sim.metrics import SimResult

    per_job = [{"job_id": f"j{i}", "state": s, "submit_s": 0.0, "end_s": jct} for i, (s, jct) in enumerate(zip(states, jcts))]
    done = [j for j in per_job if j["state"] == "done"]
    return SimResult(policy=policy, jobs=len(states), completed=len(done),
                     avg_jct_s=sum(j["end_s"] for j in done) / len(done), p50_jct_s=0, p99_jct_s=0, makespan_s=0,
                     avg_queue_s=0, gpu_util=0, oom_events=0, sched_ms_p50=0, sched_ms_p99=0,
                     lower_bound_avg_jct_s=0, rejected=states.count("rejected"), failed=states.count("failed"),
                     stranded=states.count("pending"), per_job=per_job)


def test_simulator_says_why_jobs_did_not_finish_and_compares_the_same_jobs(capsys):
    from frenzy_cli.simulate import common_jct, print_table, unfinished_note

    a = _sim("frenzy", ["done", "done", "done", "rejected"], [3600.0, 7200.0, 36000.0, 0.0])
    b = _sim("sia", ["done", "done", "pending", "failed"], [3600.0, 10800.0, 0.0, 0.0])
    assert unfinished_note(a) == "frenzy: 3/4 done, 1 not (1 rejected: no plan fits the cluster's GPUs, or its hosts' memory for offload)"
    assert "1 failed: gave up after repeated out-of-memory runs" in unfinished_note(b)
    assert "1 stranded: still queued or running" in unfinished_note(b)
    # frenzy's own average (4.67 h) includes a 10 h job sia never finished: compare j0 and j1 only
    assert common_jct([a, b]) == (2, {"frenzy": 5400.0, "sia": 7200.0})
    assert common_jct([a, a]) is None
    print_table([a, b])
    out = capsys.readouterr().out
    assert "avg JCT over the 2 jobs every policy finished: frenzy 1.50 h, sia 2.00 h" in out


def test_estimate_and_plan_tables_scale_units_for_tiny_models(capsys):
    assert main(["estimate", "--model", "gpt2-tiny", "--seq-len", "64", "--micro-batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "MiB" in out and "KiB" in out and "0.00" not in out
    assert main(["plan", "--model", "gpt2-tiny", "--seq-len", "64", "--global-batch", "8", "--gpu", "CPU"]) == 0
    out = capsys.readouterr().out
    assert "memory used" in out and " ms " in out and "0.00" not in out


def test_boolean_estimate_flags_take_a_bare_form_like_sp(capsys):
    """`--sp` alone meant true; `--tied-embeddings` alone was a usage error (exit 2). The model
    unties its embeddings by default, so a bare flag read as 'the model's default' would differ."""
    def params(*flags):
        assert main(["estimate", "--model", "llama-3.1-8b", *flags, "--json"]) == 0
        return json.loads(capsys.readouterr().out)["params"]

    assert params("--tied-embeddings") == params("--tied-embeddings", "true") < params("--tied-embeddings", "false")
    assert params() == params("--tied-embeddings", "false")                   # untied unless told
