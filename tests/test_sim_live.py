"""`frenzy simulate` / `frenzy workload` end to end over the real estimator, throughput model,
cluster loader and policies (small inputs: each test runs in about a second)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from frenzy_cli.main import main
from scheduler.sim.metrics import CONTRACT_KEYS
from scheduler.workload import WORKLOAD_COLUMNS, read_workload

CLUSTER = "examples/clusters/small-3type.yaml"
TRACE_ROWS = """job_id,submission_time,duration,num_gpu
a,100,3600,1
b,400,7200,2
c,900,1800,1
d,1000,20000,8
e,1500,900,1
f,2000,5000,4
g,2600,3000,1
h,3000,12000,16"""


@pytest.fixture
def workload(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_ROWS)
    out = tmp_path / "w.csv"
    assert main(["workload", "--trace", str(trace), "--mix", "examples/workload-mix.yaml",
                 "--seed", "3", "--out", str(out)]) == 0
    return out


def test_workload_cli_refuses_to_overwrite_its_inputs_and_bad_flags(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_ROWS)
    base = ["workload", "--trace", str(trace), "--mix", "examples/workload-mix.yaml"]
    assert main([*base, "--out", str(trace)]) == 2
    assert "is the --trace file" in capsys.readouterr().err and trace.read_text() == TRACE_ROWS
    assert main([*base, "--out", "examples/workload-mix.yaml"]) == 2
    assert "is the --mix file" in capsys.readouterr().err
    # a path with a literal "~" (`--out=~/t.csv`: the shell leaves it) is the same file for the
    # check and the write, so the guard still sees the input
    (tmp_path / "~").mkdir()
    (tmp_path / "~" / "t.csv").write_text(TRACE_ROWS)
    import os
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert main(["workload", "--trace", "~/t.csv", "--mix", os.path.join(here, "examples/workload-mix.yaml"),
                     "--out", "~/t.csv"]) == 2
    finally:
        os.chdir(here)
    assert "is the --trace file" in capsys.readouterr().err and (tmp_path / "~" / "t.csv").read_text() == TRACE_ROWS
    for flag, value, says in (("--max-jobs", "0", "max-jobs: must be an integer > 0"),
                              ("--max-jobs", "-1", "max-jobs: must be an integer > 0"),
                              ("--time-scale", "nan", "time-scale: must be a finite number > 0")):
        assert main([*base, flag, value, "--out", str(tmp_path / "o.csv")]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "o.csv").exists()


def test_workload_cli_writes_the_contract_reproducibly(workload, tmp_path):
    text = workload.read_text()
    assert text.splitlines()[0] == ",".join(WORKLOAD_COLUMNS)
    jobs = read_workload(workload)
    assert [j.requested_gpus for j in jobs] == [1, 2, 1, 8, 1, 4, 1, 16]
    assert jobs[0].submit_s == 0 and jobs[-1].submit_s == 2900
    again = tmp_path / "again.csv"
    main(["workload", "--trace", str(tmp_path / "trace.csv"), "--mix", "examples/workload-mix.yaml",
          "--seed", "3", "--out", str(again)])
    assert again.read_text() == text


def test_simulate_json_has_exactly_the_contract_keys(workload, capsys):
    assert main(["simulate", "--workload", str(workload), "--cluster", CLUSTER, "--policy", "frenzy",
                 "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == list(CONTRACT_KEYS)
    assert out["policy"] == "frenzy" and out["jobs"] == 8 and out["completed"] == 8
    assert out["avg_jct_s"] >= out["lower_bound_avg_jct_s"] > 0
    assert out["p50_jct_s"] <= out["p99_jct_s"] and 0 < out["gpu_util"] <= 1
    assert out["oom_events"] == 0


def test_simulate_is_deterministic_per_seed(workload, capsys):
    args = ["simulate", "--workload", str(workload), "--cluster", CLUSTER, "--policy", "fifo-user",
            "--json", "--no-progress", "--noise", "0.3"]
    main(args + ["--seed", "1"])
    a = json.loads(capsys.readouterr().out)
    main(args + ["--seed", "1"])
    b = json.loads(capsys.readouterr().out)
    main(args + ["--seed", "2"])
    c = json.loads(capsys.readouterr().out)
    strip = lambda d: {k: v for k, v in d.items() if not k.startswith("sched_ms")}
    assert strip(a) == strip(b)
    assert strip(a) != strip(c)


def test_compare_prints_a_table_and_draws_the_figure(workload, tmp_path, capsys):
    png = tmp_path / "cmp.png"
    assert main(["simulate", "--workload", str(workload), "--cluster", CLUSTER, "--compare",
                 "frenzy,frenzy-paper,gavel,sia,tiresias,fifo-user", "--plot", str(png),
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    for name in ("frenzy-paper", "gavel", "sia", "tiresias", "fifo-user"):
        assert name in out
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


def test_compare_json_is_one_object_per_policy(workload, capsys):
    main(["simulate", "--workload", str(workload), "--cluster", CLUSTER, "--compare", "gavel,sia",
          "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert [o["policy"] for o in out] == ["gavel", "sia"] and all(o["completed"] == 8 for o in out)


def test_bad_workload_row_is_reported_with_its_line_and_nothing_runs(workload, tmp_path, capsys):
    lines = workload.read_text().splitlines()
    lines[2] = lines[2].replace(lines[2].split(",")[2], "gpt-17", 1)
    bad = tmp_path / "bad.csv"
    bad.write_text("\n".join(lines) + "\n")
    assert main(["simulate", "--workload", str(bad), "--cluster", CLUSTER, "--json"]) == 2
    err = capsys.readouterr()
    assert f"{bad}:3: model" in err.err and "unknown model 'gpt-17'" in err.err
    assert "Traceback" not in err.err and err.out == ""


def test_bad_cluster_gpu_type_is_reported_with_its_line(workload, tmp_path, capsys):
    c = tmp_path / "c.yaml"
    c.write_text("pools:\n  - {name: a, gpu: A100-40GB, nodes: 1, gpus_per_node: 8}\n"
                 "  - {name: b, gpu: Z900-1TB, nodes: 1, gpus_per_node: 8}\n")
    assert main(["simulate", "--workload", str(workload), "--cluster", str(c), "--json"]) == 2
    err = capsys.readouterr().err
    assert "Z900-1TB" in err and "line 3" in err and "Traceback" not in err


def test_unknown_policy_and_bad_noise_exit_2(workload, capsys):
    assert main(["simulate", "--workload", str(workload), "--cluster", CLUSTER, "--policy", "magic"]) == 2
    assert "unknown policy 'magic'" in capsys.readouterr().err
    assert main(["simulate", "--workload", str(workload), "--cluster", CLUSTER, "--noise", "-1"]) == 2


def test_bad_world_round_exits_2_before_anything_runs(workload, capsys):
    assert main(["simulate", "--workload", str(workload), "--cluster", CLUSTER, "--world-round-s", "0"]) == 2
    assert "world-round-s: must be a finite number >= 1" in capsys.readouterr().err
    # a round a second at the finest: a 1e-9 s tick made a one-job workload run for ever
    assert main(["simulate", "--workload", str(workload), "--cluster", CLUSTER, "--tick-s", "1e-9"]) == 2
    assert "tick-s: must be a finite number >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("flag,value", [("--noise", "inf"), ("--noise", "1e6"), ("--noise", "nan"),
                                        ("--startup-s", "nan"), ("--startup-s", "1e12"), ("--tick-s", "nan"),
                                        ("--world-round-s", "inf")])
def test_numbers_that_are_not_finite_or_physical_exit_2_before_anything_runs(workload, capsys, flag, value):
    """NaN, inf and absurd sizes: one line naming the flag (they made the event loop spin for
    ever or overflowed the truth's lognormal draw)."""
    assert main(["simulate", "--workload", str(workload), "--cluster", CLUSTER, flag, value, "--no-progress"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"{flag.lstrip('-')}: must be a finite number" in line


def test_plot_name_is_checked_before_simulating(workload, tmp_path, capsys):
    args = ["simulate", "--workload", str(workload), "--cluster", CLUSTER, "--compare", "frenzy,fifo-user"]
    assert main([*args, "--plot", str(tmp_path / "p.txt")]) == 2
    assert "must end in .png" in capsys.readouterr().err
    assert main([*args, "--plot", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    # under a file, or where no file can be made: one line before the simulation (they were a
    # traceback after it); likewise the workload's --out
    for bad in (workload / "jct.png", "/proc/frenzy-jct.png"):
        assert main([*args, "--plot", str(bad), "--no-progress"]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("frenzy simulate: error: plot:") and ("cannot be written" in line or "cannot write" in line)
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_ROWS)
    assert main(["workload", "--trace", str(trace), "--mix", "examples/workload-mix.yaml",
                 "--out", str(workload / "w.csv")]) == 2
    assert f"out: {workload} is a file, not a folder" in capsys.readouterr().err


def test_policy_lists_name_each_policy_once(workload, capsys):
    base = ["simulate", "--workload", str(workload), "--cluster", CLUSTER]
    assert main([*base, "--compare", "frenzy,frenzy"]) == 2
    assert "compare: frenzy named twice" in capsys.readouterr().err
    assert main([*base, "--compare", "frenzy,,gavel"]) == 2
    assert "compare: an empty policy name" in capsys.readouterr().err
    assert main([*base, "--workload", str(workload.parent)]) == 2
    assert "is a folder, not a file" in capsys.readouterr().err
    trace = workload.parent / "trace.csv"
    assert main(["workload", "--trace", str(trace), "--mix", "examples/workload-mix.yaml", "--seed", "-3",
                 "--out", str(workload.parent / "o.csv")]) == 2
    assert "seed: must be an integer >= 0" in capsys.readouterr().err


def test_a_cluster_of_custom_gpu_types_simulates_and_json_says_why_jobs_did_not_finish(workload, tmp_path, capsys):
    """The cluster file's own gpu_types loaded, and `frenzy plan` used them, but the simulator
    planned with the catalog alone: the first arrival failed on the unknown type."""
    custom = tmp_path / "custom.yaml"
    custom.write_text("pools: [{name: b, gpu: B200-192GB, nodes: 1, gpus_per_node: 8}]\n"
                      "gpu_types: {B200-192GB: {memory_gib: 178, bf16_tflops: 2250, mem_bw_gbs: 8000, "
                      "intra_link: nvlink5}}\n")
    assert main(["simulate", "--workload", str(workload), "--cluster", str(custom), "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["completed"] == out["jobs"] == 8
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text("pools: [{name: t, gpu: T4-16GB, nodes: 1, gpus_per_node: 1}]\n")
    assert main(["simulate", "--workload", str(workload), "--cluster", str(tiny), "--json", "--no-progress"]) == 0
    got = capsys.readouterr()
    assert json.loads(got.out)["completed"] < 8 and "rejected: no plan fits the cluster" in got.err


def test_a_workload_row_beyond_a_jobs_bounds_is_refused(tmp_path, capsys):
    bad = tmp_path / "huge.csv"
    bad.write_text("job_id,submit_s,model,seq_len,global_batch,train_tokens,requested_gpu_type,requested_gpus\n"
                   "j1,0,gpt2,1024,8,1000000000000000000,A100-40GB,1\n")
    assert main(["simulate", "--workload", str(bad), "--cluster", CLUSTER, "--no-progress"]) == 2
    assert "train_tokens: must be <= 1,000,000,000,000,000" in capsys.readouterr().err


def test_a_mix_whose_scale_makes_jobs_beyond_bounds_names_the_trace_job(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text(TRACE_ROWS)
    mix = tmp_path / "mix.yaml"
    mix.write_text(Path("examples/workload-mix.yaml").read_text() + "\nduration_scale: 1.0e+5\n")
    assert main(["workload", "--trace", str(trace), "--mix", str(mix), "--out", str(tmp_path / "o.csv")]) == 2
    assert "trace job" in capsys.readouterr().err and not (tmp_path / "o.csv").exists()


def test_a_row_the_model_cannot_take_is_refused_with_the_models_rule(tmp_path, capsys):
    """gpt2 at 4,096 tokens was simulated and reported "rejected: no plan fits the cluster"."""
    bad = tmp_path / "w.csv"
    bad.write_text(",".join(WORKLOAD_COLUMNS) + "\nj1,0,gpt2,4096,16,1000000,A100-40GB,1\n")
    assert main(["simulate", "--workload", str(bad), "--cluster", CLUSTER, "--no-progress"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert f"{bad}:2: seq_len" in line and "position table" in line


def test_a_workload_saved_with_a_byte_order_mark_reads(tmp_path):
    """A spreadsheet's "CSV UTF-8" starts with a BOM: its header was refused as not the columns."""
    f = tmp_path / "w.csv"
    f.write_bytes(("\ufeff" + ",".join(WORKLOAD_COLUMNS) + "\nj1,0,gpt2,1024,16,1000000,A100-40GB,1\n").encode())
    [job] = read_workload(f)
    assert job.job_id == "j1" and job.seq_len == 1024
