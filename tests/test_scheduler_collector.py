"""The scheduler's collector hold: no pass inside a round, the collector back on after it
(frenzy_scheduler/collector.py)."""
import gc
import weakref

import pytest

from frenzy_scheduler.collector import collector_held


class Node:
    pass


@pytest.fixture
def small_thresholds():
    was_enabled, limits = gc.isenabled(), gc.get_threshold()
    gc.collect()
    gc.set_threshold(10, 10, 10)
    try:
        yield
    finally:
        gc.set_threshold(*limits)
        (gc.enable if was_enabled else gc.disable)()


def garbage_cycle() -> weakref.ref:
    a, b = Node(), Node()
    a.other, b.other = b, a                     # a reference cycle: only the collector frees it
    return weakref.ref(a)


def test_no_pass_during_the_hold_and_the_due_one_after_it(small_thresholds):
    """Passes are told apart by when they start (inside the hold or not), not counted from the
    test's start: another thread of the process (pytest-xdist's) allocates too, so a pass may
    come due before the hold begins."""
    gc.enable()
    where = {"now": "before"}
    passes = []
    gc.callbacks.append(on_pass := lambda phase, info: passes.append(where["now"]) if phase == "start" else None)
    try:
        with collector_held():
            where["now"] = "inside"
            assert not gc.isenabled()
            cycle = garbage_cycle()
            junk = [[] for _ in range(50)]      # far past the young generation's threshold of 10
            assert cycle() is not None and "inside" not in passes   # nothing collected during the hold
            del junk
            where["now"] = "after"
        assert gc.isenabled()
        more = [[] for _ in range(50)]          # the next allocations outside the hold
        assert cycle() is None and "after" in passes    # the pass that came due has run
        del more
    finally:
        gc.callbacks.remove(on_pass)


def test_a_collector_already_off_is_left_as_it_is(small_thresholds):
    gc.disable()
    cycle = garbage_cycle()
    with collector_held():
        junk = [[] for _ in range(50)]
        del junk
    junk = [[] for _ in range(50)]
    assert not gc.isenabled() and cycle() is not None   # the caller's choice: no pass
