"""User files fail early and clearly: the one YAML reader (estimator.yamlfile) behind the job file
(`frenzy run`), the cluster file and the workload mix; the cluster file's bounds. Every error is
one line naming the file or field (and the line), exit status 2, before anything is written."""
from __future__ import annotations

import json

import pytest

from estimator.errors import FrenzyInputError
from estimator.yamlfile import (CLUSTER_FILE, JOB_FILE, MAX_BYTES, MAX_VALUES, WORKLOAD_MIX, line_of, load_yaml,
                                parse_yaml)
from frenzy_cli.main import main
from frenzy_cli.run import load_job
from scheduler.cluster import (MAX_CLUSTER_GPUS, MAX_GPUS_PER_NODE, MAX_NODES_PER_POOL, cluster_from_dict,
                               is_host_address, parse_cluster)
from scheduler.workload import load_mix

TINY = "model: gpt2-tiny\nseq_len: 64\nglobal_batch: 8\ntrain_steps: 2\n"


def alias_bomb(levels: int = 9) -> str:
    """A "billion laughs" document: 9 references per level, 9**levels strings once expanded."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nallowed_gpu_types: *a{levels - 1}\n"


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ------------------------------------------------------------------ the reader

def test_an_alias_bomb_is_refused_before_it_is_built():
    with pytest.raises(FrenzyInputError, match=f"more than {MAX_VALUES:,} values") as e:
        parse_yaml(TINY + alias_bomb(), source="bomb.yaml", kind=JOB_FILE)
    assert _one_line(e).startswith("bomb.yaml line 10:")   # a5, the first to pass the bound (9**6 values)
    # a few aliases are fine: anchors and merge keys are how people share pool defaults
    ok = parse_yaml("d: &d {gpu: A100-80GB, gpus_per_node: 8}\npools:\n  - {<<: *d, name: a}\n  - {<<: *d, name: b}\n")
    assert [p["gpu"] for p in ok["pools"]] == ["A100-80GB", "A100-80GB"]


@pytest.mark.parametrize("text", ["x: &x [*x]\n", "x: &x {a: *x}\n"])
def test_an_alias_that_contains_itself_is_refused(text):
    with pytest.raises(FrenzyInputError, match="refers to itself"):
        parse_yaml("model: m\n" + text, source="r.yaml")


def test_malformed_yaml_names_the_line(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text("model: gpt2-tiny\nseq_len: 64\n  global_batch: 8\n")
    with pytest.raises(FrenzyInputError) as e:
        load_job(str(f))
    assert _one_line(e).startswith(f"{f} line 3: is not valid YAML (")


def test_non_utf8_is_one_line_with_the_line(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_bytes(b"model: gpt2-tiny\nname: caf\xe9\n")
    with pytest.raises(FrenzyInputError) as e:
        load_job(str(f))
    assert _one_line(e) == f"{f} line 2: is not UTF-8 text (byte 0xe9 at offset 26)"


def test_a_key_given_twice_is_refused():
    with pytest.raises(FrenzyInputError) as e:
        parse_yaml(TINY + "seq_len: 128\n", source="j.yaml")
    assert _one_line(e) == "j.yaml line 5: key 'seq_len' is given twice (first on line 2)"


def test_size_limit_and_non_files(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"#" * (MAX_BYTES + 1))
    with pytest.raises(FrenzyInputError, match="larger than 2 MiB"):
        load_yaml(big, kind=JOB_FILE)
    with pytest.raises(FrenzyInputError, match="not a regular file"):
        load_yaml(tmp_path, kind=JOB_FILE)
    with pytest.raises(FrenzyInputError, match="does not exist"):
        load_yaml(tmp_path / "nope.yaml")


def test_mappings_know_their_lines():
    data = parse_yaml(TINY + "data:\n  kind: synthetic\n")
    assert line_of(data, "seq_len") == 2 and line_of(data["data"], "kind") == 6 and line_of(data, "nope") == 1


@pytest.mark.parametrize("text,kind,rule", [
    ("pools: []\n", WORKLOAD_MIX, "is a cluster file, not a workload mix (see examples/workload-mix.yaml)"),
    ("reference_gpu: A100-40GB\nseq_len: {1024: 1}\n", JOB_FILE, "is a workload mix, not a job file"),
    (TINY, CLUSTER_FILE, "is a job file, not a cluster file"),
    ("colour: red\n", WORKLOAD_MIX, "is not a workload mix: it has none of reference_gpu, classes"),
    ("", CLUSTER_FILE, "is empty"),
    ("- a\n", JOB_FILE, "must be a mapping"),
])
def test_a_file_of_another_kind_is_named(text, kind, rule):
    with pytest.raises(FrenzyInputError) as e:
        parse_yaml(text, source="f.yaml", kind=kind)
    assert rule in _one_line(e)


# ------------------------------------------------------------------ the three files through the CLI

def test_workload_mix_given_a_cluster_file_says_so(tmp_path, capsys):
    rc = main(["workload", "--trace", "data/traces/elasticflow/cluster01.csv", "--mix", "examples/cluster.yaml",
               "--out", str(tmp_path / "w.csv")])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip() == ("frenzy workload: error: examples/cluster.yaml: is a cluster file, "
                                       "not a workload mix (see examples/workload-mix.yaml)")
    assert not (tmp_path / "w.csv").exists()
    with pytest.raises(FrenzyInputError, match="is a cluster file"):
        load_mix("examples/cluster.yaml")


def test_job_field_errors_carry_the_line(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text(TINY + "data:\n  kind: synthetic\n  path: 5\n")
    with pytest.raises(FrenzyInputError) as e:
        load_job(str(f))
    assert e.value.field == "data.path" and e.value.rule.endswith(f"({f} line 7)")
    f.write_text("name: x\nmodel: gpt2-tiny\n")       # a missing field has no line to point at
    with pytest.raises(FrenzyInputError) as e:
        load_job(str(f))
    assert e.value.field == "seq_len" and "line" not in e.value.rule


def test_bad_files_exit_2_before_anything_is_written(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("FRENZY_HOME", str(home))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    job = tmp_path / "job.yaml"
    job.write_text(TINY + alias_bomb())
    assert main(["run", str(job)]) == 2
    assert "alias bomb" in capsys.readouterr().err
    job.write_text(TINY + "precision: fp32\n")
    cluster = tmp_path / "c.yaml"
    cluster.write_text("pools:\n  - {name: cpu, gpu: CPU, gpus_per_node: 2, nodes: 100000}\n")
    assert main(["run", str(job), "--cluster", str(cluster)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"frenzy run: error: {cluster} line 2: pools[0].nodes: must be at most 4,096 (got 100,000; "
                   "a bound above the largest published training clusters, 3,072 nodes)"]
    assert main(["pools", "sync", "--cluster", str(cluster)]) == 2
    assert not home.exists() and not (tmp_path / "prefect").exists()


# ------------------------------------------------------------------ cluster bounds

def _pool(**kw) -> str:
    fields = {"name": "a", "gpu": "A100-80GB", "gpus_per_node": 8, **kw}
    return "pools:\n  - {" + ", ".join(f"{k}: {v}" for k, v in fields.items()) + "}\n"


@pytest.mark.parametrize("text,field,rule", [
    (_pool(nodes=MAX_NODES_PER_POOL + 1), "line 2: pools[0].nodes", f"at most {MAX_NODES_PER_POOL:,}"),
    (_pool(gpus_per_node=MAX_GPUS_PER_NODE + 1), "line 2: pools[0].gpus_per_node", "NVL72"),
    ("pools:\n" + "".join(f"  - {{name: p{i}, gpu: H100-80GB, nodes: {MAX_NODES_PER_POOL}, gpus_per_node: 8}}\n"
                          for i in range(2)), "line 1: pools", f"has 65,536 GPUs; at most {MAX_CLUSTER_GPUS:,}"),
    (_pool(inter_node_gbps=".inf"), "pools[0].inter_node_gbps", "finite number > 0"),
    (_pool(devices="[0, 1, 2, 3, 4, 5, 6, 5000]"), "pools[0].devices", "from 0 to 1023"),
    ("gpu_types:\n  X1: {memory_gib: 80, bf16_tflops: 0}\n" + _pool(gpu="X1"),
     "line 2: gpu_types.X1.bf16_tflops", "0 means no native bf16 and needs fp16_tflops"),
    ("gpu_types:\n  X1: {memory_gib: 80, bf16_tflops: .inf}\n" + _pool(gpu="X1"),
     "gpu_types.X1.bf16_tflops", "must be finite"),
    ("gpu_types:\n  X1: {memory_gib: 1.0e+300, bf16_tflops: 100}\n" + _pool(gpu="X1"),   # a unit typo was taken
     "line 2: gpu_types.X1.memory_gib", "less than or equal to 65536"),
    ("gpu_types:\n  X1: {memory_gib: .nan, bf16_tflops: 100}\n" + _pool(gpu="X1"),
     "gpu_types.X1.memory_gib", "must be finite"),
    ("gpu_types:\n  X1: {memory_gib: 80, bf16_tflops: 100, mem_bw_gbs: 0}\n" + _pool(gpu="X1"),
     "gpu_types.X1.mem_bw_gbs", "must be > 0"),
    ("gpu_types:\n  X1: {memory_gib: 80, bf16_tflops: fast}\n" + _pool(gpu="X1"),
     "gpu_types.X1.bf16_tflops", "must be a number"),
])
def test_cluster_bounds(text, field, rule):
    with pytest.raises(FrenzyInputError) as e:
        parse_cluster(text, source="c.yaml")
    assert field in e.value.field and rule in e.value.rule, e.value
    _one_line(e)


def test_cluster_bounds_hold_for_blocks_too():
    with pytest.raises(FrenzyInputError, match="at most 4,096"):
        cluster_from_dict({"pools": [{"name": "a", "gpu": "CPU", "gpus_per_node": 1, "nodes": 100_000}]})


def test_a_card_without_bf16_is_described_by_its_fp16_rate():
    c = parse_cluster("gpu_types:\n  V100-X: {memory_gib: 31, bf16_tflops: 0, fp16_tflops: 125, fp32_tflops: 15.7}\n"
                      + _pool(gpu="V100-X"))
    assert not c.gpu("V100-X").supports_bf16 and c.gpu("V100-X").fp16_tflops == 125


@pytest.mark.parametrize("addr", ["10.0.0.1; rm -rf /", "$(id)", "node`hostname`", "a b", "node|x", "-oProxyCommand=x",
                                  "'node'", "node..lab", "n" * 64, "node&"])
def test_addresses_with_shell_metacharacters_are_refused(addr):
    assert not is_host_address(addr)
    with pytest.raises(FrenzyInputError) as e:
        parse_cluster(_pool(nodes=1, addresses=f"[{json.dumps(addr)}]"), source="c.yaml")
    assert e.value.field == "c.yaml line 2: pools[0].addresses" and "is not a host name" in e.value.rule


@pytest.mark.parametrize("addr", ["10.0.0.1", "fe80::1", "::1", "gpu-node-07", "gpu07.lab.example.org", "H100-A"])
def test_host_names_and_ip_addresses_are_accepted(addr):
    assert is_host_address(addr)


def test_the_largest_allowed_cluster_loads():
    c = parse_cluster(_pool(nodes=MAX_NODES_PER_POOL, gpus_per_node=8))
    assert c.inventory() == {"A100-80GB": MAX_CLUSTER_GPUS}
