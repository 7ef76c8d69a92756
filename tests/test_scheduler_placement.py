"""Placement rules on hand-built nodes where the right answer is known."""
import copy

import pytest

from scheduler.placement import FreeIndex, nodes_spanned, placement_gpus
from scheduler.types import Node


def nodes(*free_counts, gpus=8, t="A100-80GB"):
    return [Node(node_id=f"n-{i}", pool="p", gpu_type=t, gpus=gpus, free=list(range(gpus - k, gpus)))
            for i, k in enumerate(free_counts)]


def test_exact_fit_first_then_least_remaining():
    idx = FreeIndex(nodes(8, 3, 5, 4))
    assert idx.place_best_fit("A100-80GB", 4) == {"n-3": [4, 5, 6, 7]}      # exact
    assert idx.place_best_fit("A100-80GB", 2) == {"n-1": [5, 6]}            # least left (3)
    assert list(idx.place_compact("A100-80GB", 5)) == ["n-2"]


def test_greedy_multi_node_fill_vs_compact():
    ns = nodes(6, 6, 3, 2)
    paper = FreeIndex(ns).place_best_fit("A100-80GB", 8)
    ours = FreeIndex(ns).place_compact("A100-80GB", 8)
    assert placement_gpus(paper) == placement_gpus(ours) == 8
    # greedy: largest nodes first (6 + 2 from the second 6-node)
    assert paper == {"n-0": [2, 3, 4, 5, 6, 7], "n-1": [2, 3]}
    # compact: 6 from one node and the tail of 2 in the tightest node that holds it
    assert ours == {"n-0": [2, 3, 4, 5, 6, 7], "n-3": [6, 7]}
    assert nodes_spanned(ours) == 2


def test_tensor_parallel_groups_stay_in_one_node():
    # 3 + 3 + 2 free = 8, but tp=2 groups can only use 2 + 2 + 2
    idx = FreeIndex(nodes(3, 3, 2))
    assert idx.place_compact("A100-80GB", 8, granule=2) is None
    p = idx.place_compact("A100-80GB", 6, granule=2)
    assert all(len(v) % 2 == 0 for v in p.values()) and placement_gpus(p) == 6


def test_not_enough_or_wrong_type():
    idx = FreeIndex(nodes(2, 2))
    assert idx.place_best_fit("A100-80GB", 5) is None
    assert idx.place_compact("H100-80GB", 1) is None
    assert idx.free_gpus("A100-80GB") == 4 and idx.largest_free("A100-80GB") == 2


def test_commit_and_release_update_buckets_not_the_nodes():
    ns = nodes(8, 4)
    before = copy.deepcopy(ns)
    idx = FreeIndex(ns)
    p = idx.place_compact("A100-80GB", 4)
    assert p == {"n-1": [4, 5, 6, 7]}
    idx.commit(p)
    assert idx.free_gpus("A100-80GB") == 8 and idx.best_fit_node("A100-80GB", 1) == "n-0"
    with pytest.raises(ValueError):
        idx.commit(p)                      # already taken
    idx.release(p)
    assert idx.free_gpus("A100-80GB") == 12
    assert ns == before                    # the ClusterState's nodes are untouched
