"""`frenzy estimate`, `frenzy plan`, `frenzy models` (in-process, real argument parsing)."""
import json

import pytest

from frenzy_cli.main import main


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_estimate_json_contract(capsys):
    rc, out, _ = run(capsys, "estimate", "--model", "llama-3.1-8b", "--seq-len", "4096",
                     "--micro-batch", "1", "--zero", "3", "--dp", "8", "--gpu", "H100-80GB", "--json")
    assert rc == 0
    d = json.loads(out)
    for k in ("params", "allocated_peak_gib", "reserved_peak_gib", "device_used_gib",
              "breakdown_gib", "stages"):
        assert k in d
    assert d["params"] == 8_030_261_248
    assert set(d["breakdown_gib"]) == {"weights", "gradients", "optimizer", "activations", "other"}
    assert d["fits"] is True


def test_estimate_dimensions_and_table(capsys):
    rc, out, _ = run(capsys, "estimate", "--arch", "llama", "--layers", "4", "--hidden", "256",
                     "--heads", "8", "--kv-heads", "2", "--vocab", "1000", "--seq-len", "128",
                     "--pp", "2", "--grad-accum", "4", "--sp", "false")
    assert rc == 0
    assert "stage" in out and "breakdown" in out


def test_estimate_bad_input_exits_2_one_line(capsys):
    rc, out, err = run(capsys, "estimate", "--model", "llama-2-7b", "--tp", "3")
    assert rc == 2 and out == ""
    assert err.strip().count("\n") == 0 and "tp" in err and "Traceback" not in err
    rc, _, err = run(capsys, "estimate", "--model", "gpt2", "--sp", "--json")
    assert rc == 2 and "sp" in err
    rc, _, err = run(capsys, "estimate", "--model", "missing/config.json")
    assert rc == 2 and "not found" in err


def test_models_lists_presets(capsys):
    rc, out, _ = run(capsys, "models", "--json")
    assert rc == 0
    names = {r["name"]: r for r in json.loads(out)}
    assert names["gpt2"]["params"] == 124_439_808 and "qwen2.5-7b" in names


def test_plan_json_and_does_not_fit(capsys):
    rc, out, _ = run(capsys, "plan", "--model", "gpt2", "--seq-len", "1024", "--global-batch",
                     "16", "--gpu", "T4-16GB", "--gpu", "A100-80GB", "--json")
    assert rc == 0
    d = json.loads(out)
    assert set(d) == {"T4-16GB", "A100-80GB"} and d["A100-80GB"]
    p = d["A100-80GB"][0]
    assert p["micro_batch"] * p["grad_accum"] * p["dp"] == 16
    rc, _, err = run(capsys, "plan", "--model", "llama-2-70b", "--seq-len", "4096",
                     "--global-batch", "8", "--gpu", "T4-16GB", "--max-gpus", "1")
    assert rc == 2 and "misses by" in err


@pytest.mark.parametrize("extra,says", [
    (["--max-gpus", "1000000000000"], "max_gpus: must be an integer >= 1 and <= 32,768"),
    (["--safety-margin-gib", "nan"], "safety_margin_gib: must be a finite number >= 0"),
    (["--cluster", "examples/cluster.yaml", "--gpu", "V100-16GB"], "--gpu: V100-16GB not in the cluster"),
    (["--seq-len", "4096"], "seq_len: exceeds the learned position table of gpt2 (4096 > 1024)"),
])
def test_plan_names_the_real_reason_in_one_line(capsys, extra, says):
    """A huge --max-gpus ran for minutes; NaN margins, a --gpu outside the cluster and a
    sequence beyond the model's positions all said "fits no GPU in the inventory"."""
    rc, _, err = run(capsys, "plan", "--model", "gpt2", "--seq-len", "1024", "--global-batch", "8", *extra)
    assert rc == 2
    [line] = err.strip().splitlines()
    assert says in line


def test_a_job_whose_allowed_types_are_not_in_the_inventory_names_them():
    from estimator.errors import FrenzyInputError
    from estimator.plans import plans_for_job
    job = {"model": "gpt2", "seq_len": 512, "global_batch": 8, "allowed_gpu_types": ["H100-80GB"]}
    with pytest.raises(FrenzyInputError, match=r"allowed_gpu_types: none of H100-80GB is in the inventory \(A10-24GB\)"):
        plans_for_job(job, {"A10-24GB": 4})


def test_plan_on_a_cluster_with_its_own_gpu_type(capsys, tmp_path):
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text("gpu_types:\n  MI300X-192GB: {memory_gib: 192, bf16_tflops: 1300}\n"
                       "pools:\n  - {name: mi, gpu: MI300X-192GB, nodes: 1, gpus_per_node: 8}\n")
    rc, out, err = run(capsys, "plan", "--model", "gpt2", "--seq-len", "512", "--global-batch",
                       "8", "--cluster", str(cluster), "--json")
    assert rc == 0, err
    plans = json.loads(out)["MI300X-192GB"]
    assert plans and all(p["gpu_type"] == "MI300X-192GB" and p["gpus"] <= 8 for p in plans)


def test_adapter_flags_without_lora_are_refused_and_with_lora_they_count(capsys):
    for cmd in (["estimate", "--model", "gpt2", "--seq-len", "1024", "--lora-rank", "8"],
                ["plan", "--model", "gpt2", "--seq-len", "1024", "--global-batch", "8", "--lora-rank", "8"],
                ["estimate", "--model", "gpt2", "--seq-len", "1024", "--lora-dropout", "0.1"]):
        rc, out, err = run(capsys, *cmd)
        assert rc == 2 and out == "" and err.strip().count("\n") == 0
        assert "--finetune" in err and "--lora-" in err and "Traceback" not in err
    base = ["estimate", "--model", "llama-3.2-1b", "--seq-len", "1024", "--finetune", "lora", "--json"]
    rc, out, _ = run(capsys, *base)
    default = json.loads(out)["allocated_peak_gib"]
    rc, out, _ = run(capsys, *base, "--lora-rank", "256")
    assert rc == 0 and json.loads(out)["allocated_peak_gib"] > default   # rank 256 holds more than 16


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    import subprocess
    import sys
    cmd = [sys.executable, "-m", "frenzy_cli.main", "plan", "--model", "llama-3.1-8b", "--seq-len", "4096",
           "--global-batch", "64", "--json"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(10)                  # the output is ~86 kB, more than a pipe holds: the writer blocks
    p.stdout.close()
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141 and "Traceback" not in err and "BrokenPipe" not in err


def test_a_bad_flag_value_is_one_line_not_the_usage_block(capsys):
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--model", "gpt2", "--seq-len", "abc"])
    assert e.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("frenzy estimate: error: argument --seq-len: invalid int value: 'abc'")


def test_plan_says_what_estimate_warns_and_shows_cp(capsys):
    """`frenzy plan` gave no out-of-coverage warning, and its table had no cp column although
    the fastest long-sequence plans are context parallel."""
    argv = ("plan", "--model", "llama-3.2-1b", "--seq-len", "196608", "--global-batch", "8",
            "--gpu", "H200-141GB", "--max-gpus", "8")
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0
    plans = json.loads(out)["H200-141GB"]          # stdout keeps its shape: type -> plans
    assert "beyond any measured source" in err and err.startswith("frenzy plan: warning:")
    rc, out, _ = run(capsys, *argv)
    assert rc == 0 and "beyond any measured source" in out
    header = next(line for line in out.splitlines() if "gpus" in line and "dp" in line)
    assert " cp " in header
    assert any(p["cp"] > 1 for p in plans)


def test_closest_plan_names_its_whole_layout(capsys):
    rc, _, err = run(capsys, "plan", "--model", "llama-3.1-8b", "--seq-len", "262144", "--global-batch", "8",
                     "--gpu", "H100-80GB", "--max-gpus", "64")
    assert rc == 2
    import re
    m = re.search(r"closest plan: (\d+) x H100-80GB \(dp=(\d+) tp=(\d+) pp=(\d+) cp=(\d+)", err)
    assert m, err
    gpus, dp, tp, pp, cp = map(int, m.groups())
    assert gpus == dp * tp * pp * cp


def test_max_gpus_caps_a_cluster_too(capsys):
    """--max-gpus was ignored beside --cluster (0 accepted, 1 still listed 8-GPU plans)."""
    import os
    cluster = os.path.join(os.path.dirname(__file__), "..", "examples", "cluster.yaml")
    rc, out, _ = run(capsys, "plan", "--model", "gpt2", "--seq-len", "512", "--global-batch", "8",
                     "--cluster", cluster, "--max-gpus", "1", "--json")
    assert rc == 0
    plans = [p for ps in json.loads(out).values() for p in ps]
    assert plans and all(p["gpus"] == 1 for p in plans)
    rc, _, err = run(capsys, "plan", "--model", "gpt2", "--seq-len", "512", "--global-batch", "8",
                     "--cluster", cluster, "--max-gpus", "0")
    assert rc == 2 and "max_gpus" in err and err.strip().count("\n") == 0
