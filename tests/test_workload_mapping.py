"""Workload CSV contract, its validation (line numbers + rule), and the ITP trace mapping."""
from __future__ import annotations

import csv

import pytest

from estimator.errors import FrenzyInputError
from scheduler.workload import (WORKLOAD_COLUMNS, Mix, MixClass, load_mix, map_trace, read_trace,
                                read_workload, write_workload)

HEADER = ",".join(WORKLOAD_COLUMNS)
GOOD = "j1,0,gpt2,1024,32,3276800,A100-40GB,1"


def write(tmp_path, *rows, header=HEADER, name="w.csv"):
    p = tmp_path / name
    p.write_text("\n".join([header, *rows]) + "\n")
    return p


def test_reads_a_valid_workload(tmp_path):
    jobs = read_workload(write(tmp_path, GOOD, "j2,5.5,llama-2-7b,4096,64,26214400,RTX3090-24GB,8"))
    assert [j.job_id for j in jobs] == ["j1", "j2"]
    assert jobs[0].steps == 100 and jobs[1].submit_s == 5.5 and jobs[1].requested_gpus == 8


@pytest.mark.parametrize("row, line_col, rule", [
    ("j2,0,gpt-5,1024,32,100,A100-40GB,1", ":3: model", "unknown model 'gpt-5'"),
    ("j2,-1,gpt2,1024,32,100,A100-40GB,1", ":3: submit_s", "must be a time from 0 to"),
    ("j2,0,gpt2,1024,32,0,A100-40GB,1", ":3: train_tokens", "must be > 0"),
    ("j2,0,gpt2,1024,32,100,B300-288GB,1", ":3: requested_gpu_type", "unknown GPU type 'B300-288GB'"),
    ("j2,0,gpt2,1024,x,100,A100-40GB,1", ":3: global_batch", "must be an integer"),
    ("j1,0,gpt2,1024,32,100,A100-40GB,1", ":3: job_id", "duplicate job_id"),
    ("j2,0,gpt2,1024,32,100,A100-40GB", ":3", "expected 8 columns"),
])
def test_bad_rows_name_line_column_and_rule(tmp_path, row, line_col, rule):
    path = write(tmp_path, GOOD, row)
    with pytest.raises(FrenzyInputError) as err:
        read_workload(path)
    msg = str(err.value)
    assert f"{path}{line_col}" in msg and rule in msg


def test_bad_header_and_empty_file(tmp_path):
    with pytest.raises(FrenzyInputError, match=r":1: header"):
        read_workload(write(tmp_path, GOOD, header="job,submit,model"))
    with pytest.raises(FrenzyInputError, match="no jobs"):
        read_workload(write(tmp_path))


def _trace(tmp_path):
    p = tmp_path / "trace.csv"
    p.write_text("job_id,submission_time,duration,num_gpu\n"
                 "a,1000,3600,1\nb,1100,7200,8\nc,1500,600,2\nd,9000,100000,32")   # no final newline
    return p


def fake_step(model, seq, gb, gpu_type, gpus, per_node):
    """Stand-in for the estimator: 70B does not fit below 32 GPUs; time ~ tokens / GPUs."""
    if model == "llama-2-70b" and gpus < 32:
        return None
    return seq * gb / (1000.0 * gpus)


MIX = Mix(reference_gpu="A100-40GB",
          classes=[MixClass(1, {"gpt2": 1, "opt-125m": 1}), MixClass(8, {"llama-2-7b": 1}),
                   MixClass(64, {"llama-2-70b": 1, "llama-2-13b": 1})],
          seq_len={1024: 1, 2048: 1}, global_batch={32: 1, 64: 1})


def test_mapping_is_reproducible_and_matches_the_trace(tmp_path):
    trace = read_trace(_trace(tmp_path))
    assert len(trace) == 4
    w1 = map_trace(trace, MIX, seed=7, ref_step=fake_step)
    assert w1 == map_trace(trace, MIX, seed=7, ref_step=fake_step)
    assert [j.submit_s for j in w1] == [0, 100, 500, 8000]
    assert [j.requested_gpus for j in w1] == [1, 8, 2, 32]
    assert all(j.requested_gpu_type == "A100-40GB" for j in w1)
    for j, t in zip(w1, trace):
        step = fake_step(j.model, j.seq_len, j.global_batch, "A100-40GB", t.num_gpu, 8)
        assert j.steps * step == pytest.approx(t.duration, rel=0.01, abs=step)
    assert w1[0].model in ("gpt2", "opt-125m") and w1[1].model == "llama-2-7b"
    seeds = {tuple(j.model + str(j.seq_len) + str(j.global_batch) for j in map_trace(trace, MIX, seed=s, ref_step=fake_step))
             for s in range(20)}
    assert len(seeds) > 1


def test_mapping_redraws_until_the_request_fits_and_scales_time(tmp_path):
    trace = read_trace(_trace(tmp_path))
    only70 = Mix(reference_gpu="A100-40GB", classes=[MixClass(64, {"llama-2-70b": 1})],
                 seq_len={1024: 1}, global_batch={32: 1}, time_scale=2.0)
    with pytest.raises(FrenzyInputError, match="no model"):
        map_trace(trace, only70, seed=0, ref_step=fake_step)      # 1-GPU jobs cannot hold 70B
    only70.start_s, only70.end_s = 5000, None
    w = map_trace(trace, only70, seed=0, ref_step=fake_step)
    assert len(w) == 1 and w[0].model == "llama-2-70b" and w[0].submit_s == 0
    two = Mix(reference_gpu="A100-40GB", classes=[MixClass(64, {"gpt2": 1})], seq_len={1024: 1},
              global_batch={32: 1}, time_scale=2.0, max_jobs=2)
    assert [j.submit_s for j in map_trace(trace, two, seed=0, ref_step=fake_step)] == [0, 50]


def test_written_workload_reads_back(tmp_path):
    w = map_trace(read_trace(_trace(tmp_path)), MIX, seed=1, ref_step=fake_step)
    out = tmp_path / "w.csv"
    write_workload(w, out)
    assert next(csv.reader(out.open())) == list(WORKLOAD_COLUMNS)
    assert read_workload(out) == w


def test_writing_a_workload_creates_its_folder(tmp_path):
    # `frenzy workload --out out/jct/w.csv` (and bench/jct.py --part seeds) in a fresh checkout
    w = map_trace(read_trace(_trace(tmp_path)), MIX, seed=1, ref_step=fake_step)
    out = tmp_path / "new" / "deeper" / "w.csv"
    write_workload(w, out)
    assert read_workload(out) == w


def test_mix_file_errors(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("reference_gpu: A100-40GB\nclasses:\n  - {max_gpus: 1, models: {gpt-9: 1}}\n"
                 "seq_len: {1024: 1}\nglobal_batch: {32: 1}\n")
    with pytest.raises(FrenzyInputError, match=r"classes\[0\]\.models: unknown model 'gpt-9'"):
        load_mix(p)
    p.write_text("reference_gpu: Z100\n")
    with pytest.raises(FrenzyInputError, match="reference_gpu"):
        load_mix(p)
    p.write_text("reference_gpu: [\n")
    with pytest.raises(FrenzyInputError, match="not valid YAML"):
        load_mix(p)


@pytest.mark.parametrize("line,says", [
    ("classes:\n  - {max_gpus: abc, models: {gpt2: 1}}", r"classes\[0\]\.max_gpus: must be an integer > 0 .*, got 'abc'"),
    ("classes:\n  - {max_gpus: 0, models: {gpt2: 1}}", r"classes\[0\]\.max_gpus: must be an integer > 0 .*, got 0"),
    ("time_scale: .nan", "time_scale: must be a finite number > 0 .*, got nan"),
    ("time_scale: abc", "time_scale: must be a finite number > 0 .*, got 'abc'"),
    ("max_jobs: abc", "max_jobs: must be an integer > 0"),
    ("start_s: abc", "start_s: must be a finite number >= 0"),
    ("gpus_per_node: 0", "gpus_per_node: must be an integer > 0"),
    ("global_batch: {16: .nan}", r"global_batch\.16 \(its weight\): must be a finite number >= 0"),
])
def test_mix_numbers_are_one_line_naming_the_key(tmp_path, line, says):
    """Types and ranges of a mix file's numbers (they were Python errors, or accepted: a
    0-GPU node, a NaN time scale)."""
    p = tmp_path / "m.yaml"
    base = {"reference_gpu": "reference_gpu: A100-40GB", "classes": "classes:\n  - {max_gpus: 8, models: {gpt2: 1}}",
            "rest": "seq_len: {1024: 1}\nglobal_batch: {32: 1}"}
    key = "classes" if line.startswith("classes") else "rest"
    if line.startswith("global_batch"):
        base["rest"] = "seq_len: {1024: 1}"
    base[key] = line if key == "classes" else base["rest"] + "\n" + line
    p.write_text("\n".join(base.values()) + "\n")
    with pytest.raises(FrenzyInputError, match=says):
        load_mix(p)


def test_a_mix_number_yaml_reads_as_text_is_taken_as_a_number(tmp_path):
    p = tmp_path / "m.yaml"
    p.write_text("reference_gpu: A100-40GB\nclasses:\n  - {max_gpus: 8, models: {gpt2: 1}}\n"
                 "seq_len: {1024: 1}\nglobal_batch: {32: 1}\ntime_scale: 1e3\n")
    assert load_mix(p).time_scale == 1000.0


@pytest.mark.parametrize("row,says", [
    ("a,nan,100,1", "submission_time: must be a finite number >= 0"), ("a,0,inf,1", "duration: must be a finite number > 0"),
    ("a,0,100,1.5", "num_gpu: must be a whole number of GPUs, got '1.5'"), ("a,0,100,1,9", "expected 4 columns"),
])
def test_trace_rows_that_are_not_finite_or_whole_are_one_line(tmp_path, row, says):
    p = tmp_path / "t.csv"
    p.write_text("job_id,submission_time,duration,num_gpu\n" + row + "\n")
    with pytest.raises(FrenzyInputError, match=says):
        read_trace(p)
    p.write_bytes(b"\xce\xfa\x00\x01binary")
    with pytest.raises(FrenzyInputError, match="is not UTF-8 text"):
        read_trace(p)


def test_trace_rows_of_jobs_that_never_ran_on_a_gpu_are_left_out_and_counted(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text("job_id,submission_time,duration,num_gpu\nfailed,0,0,1\ncpu,5,600,0\nok,9,600,2.0\n")
    skipped: list[str] = []
    jobs = read_trace(p, skipped)
    assert [(j.job_id, j.num_gpu) for j in jobs] == [("ok", 2)] and skipped == ["failed", "cpu"]


def test_workload_rows_take_gpu_names_and_models_as_the_rest_of_the_cli_does(tmp_path):
    """'a100-40gb' and a config.json path: refused by the workload reader, taken by `frenzy
    estimate` and the cluster file."""
    import json as _json

    from scheduler.workload import read_workload

    cfg = tmp_path / "config.json"
    cfg.write_text(_json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2,
                                "vocab_size": 128, "n_positions": 256}))
    p = tmp_path / "w.csv"
    header = "job_id,submit_s,model,seq_len,global_batch,train_tokens,requested_gpu_type,requested_gpus\n"
    p.write_text(header + f"a,0,{cfg},128,8,100000,a100-40gb,1\nb,1,gpt2,128,8,100000,H100,1\n")
    jobs = read_workload(p)
    assert [(j.model, j.requested_gpu_type) for j in jobs] == [(str(cfg), "A100-40GB"), ("gpt2", "H100-80GB")]
    p.write_text(header + "a,0,gpt2,128,8,100000,A100,1\n")
    with pytest.raises(FrenzyInputError, match="ambiguous: one of A100-40GB, A100-80GB"):
        read_workload(p)
    # the file model's own rule, as for a preset (not "rejected: no plan fits" after the run)
    p.write_text(header + f"a,0,{cfg},512,8,100000,A100-40GB,1\n")
    with pytest.raises(FrenzyInputError, match=r"seq_len: exceeds the learned position table .*512 > 256"):
        read_workload(p)


def test_example_mix_loads():
    mix = load_mix("examples/workload-mix.yaml")
    assert mix.reference_gpu == "A100-40GB" and mix.class_for(64).max_gpus == 64
    assert mix.class_for(3).max_gpus == 8


def test_sia_like_mapping_caps_gpu_counts_and_shortens_durations(tmp_path):
    trace = read_trace(_trace(tmp_path))
    short = Mix(reference_gpu="A100-40GB", classes=[MixClass(64, {"gpt2": 1})], seq_len={1024: 1},
                global_batch={32: 1}, max_gpus=16, duration_scale=0.1)
    w = map_trace(trace, short, seed=0, ref_step=fake_step)
    assert [j.requested_gpus for j in w] == [1, 8, 2, 16]            # 32 capped at 16
    for j, t in zip(w, trace):
        step = fake_step(j.model, j.seq_len, j.global_batch, "A100-40GB", j.requested_gpus, 8)
        assert j.steps * step == pytest.approx(0.1 * t.duration, rel=0.01, abs=step)
    p = tmp_path / "mix.yaml"
    p.write_text("reference_gpu: A100-40GB\nclasses: [{max_gpus: 8, models: {gpt2: 1}}]\n"
                 "seq_len: {1024: 1}\nglobal_batch: {32: 1}\nduration_scale: 0\n")
    with pytest.raises(FrenzyInputError, match="duration_scale"):
        load_mix(p)
    assert load_mix("bench/mix-sia-like.yaml").max_gpus == 16


def test_a_mistyped_mix_key_an_empty_window_and_a_repeated_trace_job_are_refused(tmp_path):
    """A misspelt key was ignored without a word; end_s before start_s selected nothing; a trace
    job listed twice became two jobs."""
    p = tmp_path / "m.yaml"
    base = "reference_gpu: A100-40GB\nclasses:\n  - {max_gpus: 8, models: {gpt2: 1}}\nseq_len: {1024: 1}\nglobal_batch: {32: 1}\n"
    p.write_text(base + "time_scal: 4\n")
    with pytest.raises(FrenzyInputError, match="time_scal: unknown key"):
        load_mix(p)
    p.write_text(base + "start_s: 100\nend_s: 50\n")
    with pytest.raises(FrenzyInputError, match="end_s: must be after start_s"):
        load_mix(p)
    t = tmp_path / "t.csv"
    t.write_text("job_id,submission_time,duration,num_gpu\na,0,100,1\na,5,100,1\n")
    with pytest.raises(FrenzyInputError, match="duplicate job_id 'a'"):
        read_trace(t)
