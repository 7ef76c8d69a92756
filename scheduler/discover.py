"""The default cluster: the GPUs NVML finds on this machine, else one local CPU pool.

``pynvml`` (from the ``nvidia-ml-py`` distribution) is imported lazily, and any NVML failure
(no driver, no library, no GPU) falls back to the CPU pool, so this works everywhere.
"""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from estimator.catalog import from_nvml_name, make_gpu

from .cluster import Cluster, Pool

CPU_POOL = "cpu"
CPU_DEVICES_MAX = 2        # CPU training processes: enough to exercise data parallelism, no more


@dataclass(frozen=True, slots=True)
class NvmlGpu:
    index: int
    name: str
    memory_gib: float


def nvml_gpus() -> list[NvmlGpu]:
    """The GPUs NVML sees (empty when there is no NVIDIA driver or library)."""
    try:
        import pynvml  # lazily: CPU machines need no NVML
    except Exception:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            if isinstance(name, bytes):
                name = name.decode()
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**30
            out.append(NvmlGpu(index=i, name=str(name), memory_gib=round(mem, 2)))
        return out
    except Exception:
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _pool_name(gpu_type: str) -> str:
    return "local-" + re.sub(r"[^a-z0-9]+", "-", gpu_type.lower()).strip("-")


def cpu_cluster(devices: int | None = None) -> Cluster:
    n = devices or max(1, min(CPU_DEVICES_MAX, os.cpu_count() or 1))
    return Cluster(pools=[Pool(name=CPU_POOL, gpu="CPU", nodes=1, gpus_per_node=n)])


def cluster_from_gpus(gpus: list[NvmlGpu]) -> Cluster:
    """One single-node pool per GPU type, with the NVML device indices of that type."""
    by_type: dict[str, list[int]] = {}
    extra = {}
    for g in gpus:
        t = from_nvml_name(g.name, g.memory_gib)
        if t is None:
            # An unknown card: a custom type with NVML's memory and a conservative speed guess
            # (T4-class) until a cluster file describes it.
            t = re.sub(r"[^A-Za-z0-9]+", "-", g.name.replace("NVIDIA", "")).strip("-") + f"-{round(g.memory_gib)}GB"
            extra[t] = make_gpu(t, {"memory_gib": g.memory_gib, "bf16_tflops": 65.0})
        by_type.setdefault(t, []).append(g.index)
    pools = [Pool(name=_pool_name(t), gpu=t, nodes=1, gpus_per_node=len(idx), devices=sorted(idx))
             for t, idx in by_type.items()]
    return Cluster(pools=pools, gpu_types=extra)


def local_cluster(*, use_gpus: bool = True) -> Cluster:
    """NVML's GPUs grouped by type when there are any (and ``use_gpus``), else the CPU pool
    (GPU type ``CPU``, one node, ``min(2, cpu_count)`` training processes).

    ``FRENZY_FORCE_CPU=1`` forces the CPU pool even on a GPU machine.
    """
    if use_gpus and os.environ.get("FRENZY_FORCE_CPU", "") not in ("1", "true", "yes"):
        gpus = nvml_gpus()
        if gpus:
            return cluster_from_gpus(gpus)
    return cpu_cluster()


# Addresses that name the control machine itself (a pool listing only these lives here).
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})


def is_control_machine_pool(cluster: Cluster, pool_name: str, here: Cluster | None = None) -> bool:
    """Whether ``pool_name`` is the control machine's own pool, so that training it in this
    process really runs on the pool's devices: one node, no address but this machine's, and a
    GPU type this machine has: a CPU type (every machine has its CPU; the laptop quickstart's
    ``cpu`` pool), or a type NVML finds here on at least the pool's number of devices
    (``here``: this machine's cluster, default ``local_cluster()``). Any other pool trains only
    on its own workers: in this process it would run on the wrong device and report it as the
    pool's GPU type."""
    pool = cluster.pool(pool_name)
    if pool.nodes != 1:
        return False
    local_names = _LOOPBACK | {socket.gethostname(), socket.getfqdn()}
    if pool.addresses and any(a not in local_names for a in pool.addresses):
        return False
    if cluster.gpu(pool.gpu).is_cpu:
        return True
    here = here if here is not None else local_cluster()
    return any(p.gpu == pool.gpu and p.gpus_per_node >= pool.gpus_per_node for p in here.pools)


def cluster_or_local(path: str | None) -> Cluster:
    """The cluster a submission runs on: the cluster file when one is given, else this machine."""
    from .cluster import load_cluster

    return load_cluster(path) if path else local_cluster()
