"""Placement: which free GPUs of which nodes a plan gets. Shared by every policy and the ledger.

``FreeIndex`` is a working copy of the cluster's free GPUs, bucketed per GPU type by how many
GPUs each node has free, so best-fit lookups cost O(GPUs per node) instead of O(nodes): a round
builds one index (O(nodes)) and then places many jobs cheaply. Committing a placement changes
the index, never the ``ClusterState`` it was built from.

Two placement rules:

* ``place_best_fit`` (the published HAS): a node that fits exactly, else the node left with the
  least free GPUs that still fits, else a greedy fill over the nodes with the most free GPUs.
* ``place_compact`` (ours): the same single-node best fit, and for multi-node plans the fewest
  nodes: whole free nodes first, the remainder best-fit into the tightest node that holds it
  (fewer nodes = fewer slow inter-node hops, and big holes stay whole for the next big job).

Both keep every tensor-parallel group inside one node (``granule``: a node contributes a
multiple of it), so intra-layer all-reduces never cross the network.
"""
from __future__ import annotations

from typing import Iterable

from .types import Node

Placement = dict[str, list[int]]


def placement_gpus(placement: Placement) -> int:
    return sum(len(v) for v in placement.values())


class FreeIndex:
    __slots__ = ("free", "type_of", "pool_of", "buckets", "total", "cap")

    def __init__(self, nodes: Iterable[Node]):
        self.free: dict[str, list[int]] = {}
        self.type_of: dict[str, str] = {}
        self.pool_of: dict[str, str] = {}
        self.buckets: dict[str, list[dict[str, None]]] = {}   # type -> [k] -> ordered set of nodes with k free
        self.total: dict[str, int] = {}
        self.cap: dict[str, int] = {}
        nodes = list(nodes)
        for n in nodes:
            self.cap[n.gpu_type] = max(self.cap.get(n.gpu_type, 0), n.gpus, len(n.free))
        for t, c in self.cap.items():
            self.buckets[t] = [dict() for _ in range(c + 1)]
            self.total[t] = 0
        for n in nodes:
            free = sorted(n.free)
            self.free[n.node_id] = free
            self.type_of[n.node_id] = n.gpu_type
            self.pool_of[n.node_id] = n.pool
            self.buckets[n.gpu_type][len(free)][n.node_id] = None
            self.total[n.gpu_type] += len(free)

    # --- queries -------------------------------------------------------------------------
    def free_gpus(self, gpu_type: str) -> int:
        return self.total.get(gpu_type, 0)

    def largest_free(self, gpu_type: str) -> int:
        b = self.buckets.get(gpu_type)
        if not b:
            return 0
        for k in range(len(b) - 1, 0, -1):
            if b[k]:
                return k
        return 0

    def best_fit_node(self, gpu_type: str, n: int, exclude: set[str] | None = None) -> str | None:
        """The node with exactly ``n`` free GPUs, else the one with the fewest free >= n."""
        b = self.buckets.get(gpu_type)
        if not b or n > len(b) - 1:
            return None
        for k in range(max(1, n), len(b)):
            for nid in b[k]:
                if not exclude or nid not in exclude:
                    return nid
        return None

    def _take(self, nid: str, k: int) -> list[int]:
        return self.free[nid][:k]

    # --- placement rules -----------------------------------------------------------------
    def place_best_fit(self, gpu_type: str, n: int, granule: int = 1) -> Placement | None:
        """The published HAS best fit (exact node, least-remaining node, greedy multi-node)."""
        return self._place(gpu_type, n, granule, tight_tail=False)

    def place_compact(self, gpu_type: str, n: int, granule: int = 1) -> Placement | None:
        """Fewest nodes: one node when possible (best fit), else whole nodes + a tight tail."""
        return self._place(gpu_type, n, granule, tight_tail=True)

    def _place(self, gpu_type: str, n: int, granule: int, tight_tail: bool) -> Placement | None:
        """One node when one holds ``n`` (best fit), else spread over nodes (``_fill``)."""
        if n <= 0 or self.total.get(gpu_type, 0) < n:
            return None
        nid = self.best_fit_node(gpu_type, n)
        if nid is not None:
            return {nid: self._take(nid, n)}
        return self._fill(gpu_type, n, granule, tight_tail)

    def _fill(self, gpu_type: str, n: int, granule: int, tight_tail: bool) -> Placement | None:
        b = self.buckets[gpu_type]
        g = max(1, granule)
        if n % g:
            g = 1
        out: Placement = {}
        left = n
        for k in range(len(b) - 1, 0, -1):
            usable = k - k % g
            if usable <= 0:
                continue
            for nid in b[k]:
                if tight_tail and left <= usable:
                    # the rest fits in one node: the tightest one that holds it, not this big one
                    tail = self._tightest(gpu_type, left, g, exclude=out)
                    if tail is not None:
                        out[tail] = self._take(tail, left)
                        return out
                take = min(usable, left)
                out[nid] = self._take(nid, take)
                left -= take
                if left == 0:
                    return out
        return None

    def _tightest(self, gpu_type: str, need: int, granule: int, exclude: Placement) -> str | None:
        b = self.buckets[gpu_type]
        for k in range(need, len(b)):
            if k - k % granule < need:
                continue
            for nid in b[k]:
                if nid not in exclude:
                    return nid
        return None

    # --- updates -------------------------------------------------------------------------
    def commit(self, placement: Placement) -> None:
        """Mark the placement's GPUs taken (they must be free)."""
        for nid, devs in placement.items():
            t = self.type_of[nid]
            free = self.free[nid]
            before = len(free)
            taken = set(devs)
            if not taken <= set(free):
                raise ValueError(f"node {nid}: devices {sorted(taken - set(free))} are not free")
            self.free[nid] = [d for d in free if d not in taken]
            del self.buckets[t][before][nid]
            self.buckets[t][len(self.free[nid])][nid] = None
            self.total[t] -= len(devs)

    def release(self, placement: Placement) -> None:
        """Give the placement's GPUs back (what-if planning)."""
        for nid, devs in placement.items():
            t = self.type_of[nid]
            free = self.free[nid]
            before = len(free)
            self.free[nid] = sorted(set(free) | set(devs))
            del self.buckets[t][before][nid]
            self.buckets[t][len(self.free[nid])][nid] = None
            self.total[t] += len(self.free[nid]) - before


def nodes_spanned(placement: Placement) -> int:
    return sum(1 for v in placement.values() if v)


def gpu_memory_gib(state, gpu_type: str) -> float:
    """Device memory of ``gpu_type`` for this cluster (its custom types too), else the catalog's;
    ``inf`` for a type nobody describes (then the plans' own feasibility is all we have)."""
    mem = getattr(state, "gpu_memory_gib", None) or {}
    if gpu_type in mem:
        return mem[gpu_type]
    from estimator.catalog import CATALOG
    g = CATALOG.get(gpu_type)
    return g.memory_gib if g is not None else float("inf")
