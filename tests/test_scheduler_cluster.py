"""Cluster files, discovery, and the state policies start from."""
import pytest

from estimator.errors import FrenzyInputError
from scheduler.cluster import Cluster, dump_cluster, load_cluster, parse_cluster
from scheduler.discover import NvmlGpu, cluster_from_gpus, cpu_cluster, local_cluster

GOOD = """\
gpu_types:
  B200-192GB: {memory_gib: 178, bf16_tflops: 2250, mem_bw_gbs: 8000, intra_link: nvlink5, intra_link_gbps: 7200}
pools:
  - name: h100
    gpu: H100-80GB
    nodes: 2
    gpus_per_node: 8
    inter_node_gbps: 400
    addresses: [10.0.0.1, 10.0.0.2]
  - name: b200
    gpu: B200-192GB
    nodes: 1
    gpus_per_node: 4
  - name: rtx
    gpu: RTX3090-24GB
    nodes: 3
    gpus_per_node: 4
    devices: [0, 1, 2, 3]
"""


def test_load_good_file(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(GOOD)
    c = load_cluster(f)
    assert [p.name for p in c.pools] == ["h100", "b200", "rtx"]
    assert c.inventory() == {"H100-80GB": 16, "B200-192GB": 4, "RTX3090-24GB": 12}
    assert c.gpus_per_node() == {"H100-80GB": 8, "B200-192GB": 4, "RTX3090-24GB": 4}
    assert [n for n, _ in c.nodes()] == ["h100-0", "h100-1", "b200-0", "rtx-0", "rtx-1", "rtx-2"]
    assert c.gpu("B200-192GB").memory_gib == 178
    assert c.inter_node_gbps("h100") == 400
    assert c.inter_node_gbps("rtx") == c.gpu("RTX3090-24GB").inter_node_gbps   # class default
    st = c.initial_state()
    assert len(st.nodes) == 6 and st.running == []
    assert all(n.free == list(range(n.gpus)) for n in st.nodes)
    assert st.gpu_memory_gib["B200-192GB"] == 178
    assert st.nodes[0].intra_link == "nvlink4"
    # the contract YAML round-trips
    assert parse_cluster(dump_cluster(c)) == c


def test_example_cluster_loads():
    c = load_cluster("examples/cluster.yaml")
    assert sum(c.inventory().values()) > 0


@pytest.mark.parametrize("text,field,rule", [
    ("pools: []\n", "line 1: pools", "non-empty list"),
    ("pools:\n  - {name: a, gpu: A100-80GB, gpus_per_node: 8}\n  - {name: a, gpu: A100-80GB, gpus_per_node: 8}\n",
     "line 3: pools[1].name", "duplicate pool name 'a'"),
    ("pools:\n  - name: a\n    gpu: B300\n    gpus_per_node: 8\n", "line 3: pools[0].gpu", "unknown GPU type 'B300'"),
    ("pools:\n  - {name: a, gpu: A100-80GB, gpus_per_node: 0}\n", "line 2: pools[0].gpus_per_node", ">= 1"),
    ("pools:\n  - {name: a, gpu: A100-80GB, gpus_per_node: 8, nodes: -1}\n", "pools[0].nodes", ">= 1"),
    ("pools:\n  - {name: a, gpu: A100-80GB}\n", "pools[0].gpus_per_node", "is required"),
    ("pools:\n  - {name: 'bad name', gpu: A100-80GB, gpus_per_node: 1}\n", "pools[0].name", "letters"),
    ("pools:\n  - {name: a, gpu: A100-80GB, gpus_per_node: 1, colour: red}\n", "pools[0].colour", "unknown key"),
    ("pools:\n  - {name: a, gpu: A100-80GB, gpus_per_node: 1, inter_node_gbps: -5}\n",
     "pools[0].inter_node_gbps", "> 0"),
    ("pools:\n  - {name: a, gpu: A100-80GB, gpus_per_node: 2, nodes: 2, addresses: [x]}\n",
     "pools[0].addresses", "one address per node"),
    ("pools:\n  - {name: a, gpu: A100-80GB, gpus_per_node: 2, devices: [0, 0]}\n", "pools[0].devices", "distinct"),
    ("gpu_types:\n  A100-80GB: {memory_gib: 1, bf16_tflops: 1}\npools:\n  - {name: a, gpu: A100-80GB, gpus_per_node: 1}\n",
     "line 2: gpu_types.A100-80GB", "already a catalog GPU type"),
    ("gpu_types:\n  X1: {bf16_tflops: 1}\npools:\n  - {name: a, gpu: X1, gpus_per_node: 1}\n",
     "gpu_types.X1.memory_gib", "is required"),
    ("gpu_types:\n  X1: {memory_gib: -3, bf16_tflops: 1}\npools:\n  - {name: a, gpu: X1, gpus_per_node: 1}\n",
     "gpu_types.X1.memory_gib", "must be > 0"),
    ("pools: [\n", "c.yaml line", "not valid YAML"),
    ("- just a list\n", "c.yaml", "must be a mapping"),
    ("pools:\n  - {name: a, gpu: A100-80GB, gpus_per_node: 1}\nnodes: 3\n", "line 3: nodes", "unknown top-level key"),
])
def test_bad_cluster_files_name_line_field_rule(text, field, rule):
    with pytest.raises(FrenzyInputError) as e:
        parse_cluster(text, source="c.yaml")
    assert field in e.value.field, e.value
    assert rule in e.value.rule, e.value
    assert "\n" not in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(FrenzyInputError, match="does not exist"):
        load_cluster(tmp_path / "nope.yaml")


def test_cpu_fallback_and_forced_cpu(monkeypatch):
    monkeypatch.setenv("FRENZY_FORCE_CPU", "1")
    c = local_cluster()
    assert [p.gpu for p in c.pools] == ["CPU"]
    assert 1 <= c.pools[0].gpus_per_node <= 2 and c.pools[0].nodes == 1
    assert cpu_cluster(2).inventory() == {"CPU": 2}


def test_nvml_gpus_group_by_type_with_device_indices():
    gpus = [NvmlGpu(0, "NVIDIA A100-SXM4-80GB", 80.0), NvmlGpu(1, "NVIDIA GeForce RTX 3090", 24.0),
            NvmlGpu(2, "NVIDIA A100-SXM4-80GB", 80.0), NvmlGpu(3, "NVIDIA Mystery X9", 31.5)]
    c = cluster_from_gpus(gpus)
    by_type = {p.gpu: p for p in c.pools}
    assert by_type["A100-80GB"].devices == [0, 2] and by_type["A100-80GB"].gpus_per_node == 2
    assert by_type["RTX3090-24GB"].devices == [1]
    custom = [t for t in by_type if t not in ("A100-80GB", "RTX3090-24GB")]
    assert len(custom) == 1 and c.gpu(custom[0]).memory_gib == 31.5
    st = c.initial_state()
    assert {n.node_id: n.free for n in st.nodes}[by_type["A100-80GB"].name + "-0"] == [0, 2]
    again = Cluster.model_validate(c.model_dump())      # the custom type survives a round trip
    assert again == c and again.gpu(custom[0]).memory_gib == 31.5
