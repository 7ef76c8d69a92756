"""The cluster file: pools of identical nodes, one GPU type per pool (one Prefect work pool each).

Contract (cluster YAML)::

    pools:                          # required, at least one
      - name: a100                  # unique; node ids are <name>-<i>
        gpu: A100-80GB              # a catalog name or a name defined under gpu_types
        nodes: 2
        gpus_per_node: 8
        inter_node_gbps: 200        # optional, Gbit/s per node; default: the GPU class's typical figure
        addresses: [10.0.0.1, 10.0.0.2]   # optional, one per node
        devices: [0, 1, 2, 3]       # optional: physical device indices on each node (default 0..n-1)
        host_ram_gib: 2048          # optional: host memory per node (GiB), what offload plans may fill;
                                    # default 2 x the node's GPU memory (HOST_RAM_PER_GPU_MEMORY)
    gpu_types:                      # optional: GPU types the catalog lacks
      B200-192GB: {memory_gib: 178, bf16_tflops: 2250, mem_bw_gbs: 8000, intra_link: nvlink5}

Every error names the file, the line, the field and the rule, and nothing is half-loaded.
Bounds (``MAX_*`` below, each with its reason): nodes per pool, GPUs per node and per cluster;
GPU rates positive and finite; addresses are host names or IP addresses, nothing a shell or an
SSH command line could read as more than one word.
"""
from __future__ import annotations

import ipaddress
import math
import re
from pathlib import Path
from typing import Any, Iterator

import yaml
from pydantic import BaseModel, ConfigDict, Field

from estimator.catalog import CATALOG, GPU, get_gpu, make_gpu, resolve_gpu_name
from estimator.errors import FrenzyInputError
from estimator.yamlfile import CLUSTER_FILE, line_of, parse_yaml, read_text

from .types import ClusterState, Node

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
POOL_KEYS = ("name", "gpu", "nodes", "gpus_per_node", "inter_node_gbps", "addresses", "devices", "host_ram_gib")

# Size bounds. The ledger keeps one row per GPU and every submission syncs the cluster, so a
# typo such as `nodes: 100000` (800,000 rows, about two minutes of writes) must fail at once.
# The largest published single training clusters hold 24,576 GPUs (Meta's two H100 clusters,
# 2024, 3,072 nodes of 8); the bounds leave headroom above them. At MAX_CLUSTER_GPUS a first
# sync into SQLite takes 10 s and a re-sync 5 s (measured on a 2-core machine).
MAX_NODES_PER_POOL = 4096
# NVLink domains: 8 GPUs per HGX board, 72 in a GB200 NVL72 rack (which a site may describe as
# one node, since the whole rack is one NVLink domain).
MAX_GPUS_PER_NODE = 72
MAX_CLUSTER_GPUS = 32768
# Physical device indices on one node (CUDA_VISIBLE_DEVICES): no node exposes more than this.
MAX_DEVICE_INDEX = 1023
# Host memory per node when the cluster file does not say: twice the node's GPU memory, NVIDIA's
# own sizing of its training servers (DGX-1: 512 GB for 8 x 32 GB; DGX A100 and DGX H100: 2 TB
# for 8 x 80 GB, ~3x) and the usual rule for GPU servers; consumer boxes often have less, so a
# site with offload plans should give host_ram_gib. It bounds what ZeRO-Offload plans may put in
# host memory (estimator.memory.host_offload_bytes).
HOST_RAM_PER_GPU_MEMORY = 2.0
# The largest single-system memory sold (HPE Superdome Flex, 48 TB): a bound, so that a typo in
# MiB or bytes fails.
MAX_HOST_RAM_GIB = 65536
# RFC 1123 host names: dot-separated labels of letters, digits and inner hyphens, 253 at most.
_HOST_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$")


def is_host_address(addr: str) -> bool:
    """An IPv4/IPv6 address or an RFC 1123 host name (so no spaces, quotes, ``;``, ``$``, ...)."""
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        pass
    return 0 < len(addr) <= 253 and all(_HOST_LABEL.match(label) for label in addr.split("."))


def _rate_rule(name: str, v: Any, fields: dict) -> str | None:
    """Why a custom GPU type's numeric field ``name`` is unacceptable, or None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return f"must be a number (got {v!r})"
    if not math.isfinite(v):
        return f"must be finite (got {v!r})"
    if name == "bf16_tflops" and v == 0:
        # the catalog's V100/T4 convention: 0 = no native bf16 (bf16 runs at fp32 speed); then
        # the fp16 rate is what describes the card
        return None if "fp16_tflops" in fields else ("0 means no native bf16 and needs fp16_tflops too; "
                                                      "otherwise give the card's bf16 TFLOP/s (> 0)")
    if v <= 0:
        return f"must be > 0 (got {v!r})"
    return None


class Pool(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # descriptions: the GPUCluster block editor in the Prefect UI shows them under each field
    name: str = Field(..., description="the pool's name; its Prefect work pool has the same name")
    gpu: str = Field(..., description="GPU type: a catalog name such as A100-80GB (case and an "
                                      "unambiguous size suffix may be left out) or a key of gpu_types")
    nodes: int = Field(1, ge=1, le=MAX_NODES_PER_POOL, description="nodes (machines) in the pool")
    gpus_per_node: int = Field(..., ge=1, le=MAX_GPUS_PER_NODE, description="GPUs on each node")
    inter_node_gbps: float | None = Field(None, gt=0, allow_inf_nan=False,
                                          description="network between nodes, Gbit/s per node (empty: the GPU "
                                                      "class's typical figure)")
    addresses: list[str] | None = Field(None, description="host name or IP of each node, in node order "
                                                          "(empty: nodes are only counted)")
    devices: list[int] | None = Field(None, description="physical device indices on each node "
                                                        "(empty: 0 .. gpus_per_node-1)")
    host_ram_gib: float | None = Field(None, gt=0, le=MAX_HOST_RAM_GIB, allow_inf_nan=False,
                                       description="host memory per node, GiB, for offload plans (empty: "
                                                   "2 x the node's GPU memory)")

    def node_ids(self) -> list[str]:
        return [f"{self.name}-{i}" for i in range(self.nodes)]

    def device_indices(self) -> list[int]:
        return list(self.devices) if self.devices is not None else list(range(self.gpus_per_node))

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


class Cluster(BaseModel):
    """Pools plus the cluster's own GPU types (merged over the catalog for this cluster only)."""

    model_config = ConfigDict(extra="forbid")

    pools: list[Pool]
    gpu_types: dict[str, GPU] = Field(default_factory=dict)

    def gpu(self, name: str) -> GPU:
        return get_gpu(name, self.gpu_types)

    def gpu_catalog(self) -> dict[str, GPU]:
        """GPU type -> GPU for every type this cluster uses."""
        return {p.gpu: self.gpu(p.gpu) for p in self.pools}

    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        raise FrenzyInputError("pool", f"unknown pool {name!r}; pools: {', '.join(p.name for p in self.pools)}")

    def nodes(self) -> Iterator[tuple[str, Pool]]:
        """``(node_id, pool)`` for every node, node ids ``<pool>-<i>``."""
        for p in self.pools:
            for nid in p.node_ids():
                yield nid, p

    def inventory(self) -> dict[str, int]:
        """GPU type -> number of GPUs."""
        inv: dict[str, int] = {}
        for p in self.pools:
            inv[p.gpu] = inv.get(p.gpu, 0) + p.gpus
        return inv

    def gpus_per_node(self) -> dict[str, int]:
        """GPU type -> the largest node of that type (what one NVLink/PCIe domain can hold)."""
        out: dict[str, int] = {}
        for p in self.pools:
            out[p.gpu] = max(out.get(p.gpu, 0), p.gpus_per_node)
        return out

    def host_ram_gib(self) -> dict[str, float]:
        """GPU type -> host memory of its smallest node (GiB): the pool's ``host_ram_gib``, else
        ``HOST_RAM_PER_GPU_MEMORY`` x the node's GPU memory. CPU types are left out (their
        "GPU memory" is the host's; offload plans are not made for them)."""
        out: dict[str, float] = {}
        for p in self.pools:
            g = self.gpu(p.gpu)
            if g.is_cpu:
                continue
            ram = p.host_ram_gib if p.host_ram_gib else HOST_RAM_PER_GPU_MEMORY * g.memory_gib * p.gpus_per_node
            out[p.gpu] = min(out.get(p.gpu, ram), ram)
        return out

    def inter_node_gbps(self, pool: str) -> float:
        p = self.pool(pool)
        return p.inter_node_gbps if p.inter_node_gbps else self.gpu(p.gpu).inter_node_gbps

    def initial_state(self) -> ClusterState:
        """Every GPU free, nothing running."""
        nodes = []
        for p in self.pools:
            g = self.gpu(p.gpu)
            for nid in p.node_ids():
                nodes.append(Node(node_id=nid, pool=p.name, gpu_type=p.gpu, gpus=p.gpus_per_node,
                                  free=sorted(p.device_indices()), intra_link=g.intra_link))
        return ClusterState(nodes=nodes, running=[],
                            inter_node_gbps={p.name: self.inter_node_gbps(p.name) for p in self.pools},
                            gpu_memory_gib={t: g.memory_gib for t, g in self.gpu_catalog().items()})


# --- loading ---------------------------------------------------------------------------------

def load_cluster(path: str | Path) -> Cluster:
    """Read and validate a cluster YAML file (see module docstring)."""
    return parse_cluster(read_text(path, "cluster"), source=str(path))


def parse_cluster(text: str, source: str = "cluster") -> Cluster:
    """Validate cluster YAML text; ``source`` names it in errors."""
    return cluster_from_dict(parse_yaml(text, source=source, kind=CLUSTER_FILE), source=source)


def cluster_from_dict(data: Any, source: str = "cluster") -> Cluster:
    """Validate a cluster given as a mapping (a parsed YAML file, a block's value, ...)."""

    def err(obj: Any, key: str | None, field: str, rule: str) -> FrenzyInputError:
        ln = line_of(obj, key)
        return FrenzyInputError(f"{source}{f' line {ln}' if ln else ''}: {field}", rule)

    if not isinstance(data, dict):
        raise FrenzyInputError(source, "must be a mapping with a 'pools' list")
    unknown = set(data) - {"pools", "gpu_types"}
    if unknown:
        k = sorted(unknown)[0]
        raise err(data, k, k, "unknown top-level key; allowed: pools, gpu_types")

    # custom GPU types first: pools may use them
    extra: dict[str, GPU] = {}
    gt = data.get("gpu_types") or {}
    if not isinstance(gt, dict):
        raise err(data, "gpu_types", "gpu_types", "must be a mapping of GPU type name -> fields")
    for name, fields in gt.items():
        name = str(name)
        if name in CATALOG:
            raise err(gt, name, f"gpu_types.{name}", "is already a catalog GPU type; choose another name")
        if not _NAME.match(name):
            raise err(gt, name, f"gpu_types.{name}", "name must be letters, digits, '.', '_' or '-'")
        if not isinstance(fields, dict):
            raise err(gt, name, f"gpu_types.{name}", "must be a mapping of GPU fields (memory_gib, bf16_tflops, ...)")
        for k in fields:
            if k not in GPU.model_fields or k == "name":
                raise err(fields, k, f"gpu_types.{name}.{k}",
                          f"unknown field; allowed: {', '.join(f for f in GPU.model_fields if f != 'name')}")
        for k, v in fields.items():
            if GPU.model_fields[k].annotation is float:
                rule = _rate_rule(k, v, fields)
                if rule:
                    raise err(fields, k, f"gpu_types.{name}.{k}", rule)
        for need in ("memory_gib",):
            if need not in fields:
                raise err(fields, None, f"gpu_types.{name}.{need}", "is required")
        if not any(k in fields for k in ("bf16_tflops", "fp16_tflops")):
            raise err(fields, None, f"gpu_types.{name}.bf16_tflops", "give bf16_tflops or fp16_tflops")
        try:
            extra[name] = make_gpu(name, dict(fields))
        except FrenzyInputError as e:
            raise err(fields, e.field.rsplit(".", 1)[-1], e.field, e.rule) from None

    pools_raw = data.get("pools")
    if not isinstance(pools_raw, list) or not pools_raw:
        raise err(data, "pools", "pools", "must be a non-empty list of {name, gpu, nodes, gpus_per_node}")
    pools: list[Pool] = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(pools_raw):
        where = f"pools[{i}]"
        if not isinstance(raw, dict):
            raise err(data, "pools", where, "must be a mapping {name, gpu, nodes, gpus_per_node}")
        for k in raw:
            if k not in POOL_KEYS:
                raise err(raw, k, f"{where}.{k}", f"unknown key; allowed: {', '.join(POOL_KEYS)}")
        for k in ("name", "gpu", "gpus_per_node"):
            if k not in raw:
                raise err(raw, None, f"{where}.{k}", "is required")
        name = raw["name"]
        if not isinstance(name, str) or not _NAME.match(name):
            raise err(raw, "name", f"{where}.name", "must be 1-63 letters, digits, '.', '_' or '-', starting alphanumeric")
        if name in seen:
            raise err(raw, "name", f"{where}.name", f"duplicate pool name {name!r} (also pools[{seen[name]}])")
        seen[name] = i
        gpu = raw["gpu"]
        try:                # 'h100-80gb' and 'H100' mean H100-80GB, as presets ignore case
            gpu = resolve_gpu_name(gpu, extra)
        except FrenzyInputError as bad:
            raise err(raw, "gpu", f"{where}.gpu", f"{bad.rule} (or define it under gpu_types)") from None
        for k, most, why in (("nodes", MAX_NODES_PER_POOL, "a bound above the largest published training "
                                                           "clusters, 3,072 nodes"),
                             ("gpus_per_node", MAX_GPUS_PER_NODE, "the largest NVLink domain, a GB200 NVL72 rack")):
            v = raw.get(k, 1)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise err(raw, k, f"{where}.{k}", f"must be a whole number >= 1 (got {v!r})")
            if v > most:
                raise err(raw, k, f"{where}.{k}", f"must be at most {most:,} (got {v:,}; {why})")
        nodes = raw.get("nodes", 1)
        gpn = raw["gpus_per_node"]
        bw = raw.get("inter_node_gbps")
        if bw is not None and (isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw)
                               or bw <= 0):
            raise err(raw, "inter_node_gbps", f"{where}.inter_node_gbps",
                      f"must be a finite number > 0 (Gbit/s), got {bw!r}")
        addrs = raw.get("addresses")
        if addrs is not None:
            if not isinstance(addrs, list) or not all(isinstance(a, str) and a for a in addrs):
                raise err(raw, "addresses", f"{where}.addresses", "must be a list of host names/addresses")
            bad = next((a for a in addrs if not is_host_address(a)), None)
            if bad is not None:
                raise err(raw, "addresses", f"{where}.addresses",
                          f"{bad!r} is not a host name (letters, digits, '-' and '.') or an IP address")
            if len(addrs) != nodes:
                raise err(raw, "addresses", f"{where}.addresses", f"needs one address per node ({nodes}), got {len(addrs)}")
            if len(set(addrs)) != len(addrs):
                raise err(raw, "addresses", f"{where}.addresses", "addresses must be distinct")
        ram = raw.get("host_ram_gib")
        if ram is not None and (isinstance(ram, bool) or not isinstance(ram, (int, float)) or not math.isfinite(ram)
                                or not 0 < ram <= MAX_HOST_RAM_GIB):
            raise err(raw, "host_ram_gib", f"{where}.host_ram_gib",
                      f"must be a number of GiB in (0, {MAX_HOST_RAM_GIB:,}] (host memory per node), got {ram!r}")
        devs = raw.get("devices")
        if devs is not None:
            if (not isinstance(devs, list)
                    or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_DEVICE_INDEX for d in devs)
                    or len(set(devs)) != len(devs)):
                raise err(raw, "devices", f"{where}.devices",
                          f"must be a list of distinct device indices from 0 to {MAX_DEVICE_INDEX}")
            if len(devs) != gpn:
                raise err(raw, "devices", f"{where}.devices", f"needs gpus_per_node ({gpn}) indices, got {len(devs)}")
        pools.append(Pool(name=name, gpu=gpu, nodes=nodes, gpus_per_node=gpn,
                          inter_node_gbps=float(bw) if bw is not None else None,
                          addresses=list(addrs) if addrs is not None else None,
                          devices=list(devs) if devs is not None else None,
                          host_ram_gib=float(ram) if ram is not None else None))
    total = sum(p.gpus for p in pools)
    if total > MAX_CLUSTER_GPUS:
        raise err(data, "pools", "pools", f"the cluster has {total:,} GPUs; at most {MAX_CLUSTER_GPUS:,} (a bound "
                                          "above the largest published training clusters, 24,576 GPUs)")
    return Cluster(pools=pools, gpu_types=extra)


def dump_cluster(cluster: Cluster) -> str:
    """The cluster as contract YAML (round-trips through ``parse_cluster``)."""
    data: dict[str, Any] = {"pools": [p.model_dump(exclude_none=True) for p in cluster.pools]}
    if cluster.gpu_types:
        data["gpu_types"] = {n: g.model_dump(exclude={"name"}) for n, g in cluster.gpu_types.items()}
    return yaml.safe_dump(data, sort_keys=False)
