"""The one scheduling round (scheduler.round) that the simulator and the live scheduler share:
decisions checked against the cluster and sorted into stops, starts and re-sizes."""
from __future__ import annotations

import pytest

from estimator.plan import Plan
from scheduler.round import check_decisions, next_round_s, run_round, wants_tick
from scheduler.types import ClusterState, Decision, JobRequest, Node, Policy, RunningJob, Wait

A100 = "A100-40GB"


def plan(gpus: int, gtype: str = A100) -> Plan:
    return Plan(gpu_type=gtype, gpus=gpus, dp=gpus, grad_accum=max(1, 8 // gpus), step_time_s=1.0)


def state(running: list[RunningJob]) -> ClusterState:
    busy = {i for r in running for i in r.placement.get("n0", [])}
    return ClusterState(nodes=[Node("n0", "a100", A100, 8, [i for i in range(8) if i not in busy])],
                        running=running)


class Fixed(Policy):
    name = "fixed"

    def __init__(self, decisions, waits=None):
        self.decisions, self._waits = decisions, waits or {}

    def schedule(self, pending, state, now):
        return self.decisions

    def waits(self):
        return self._waits


def run(rid: str, gpus: int, first: int = 0) -> RunningJob:
    return RunningJob(rid, plan(gpus), {"n0": list(range(first, first + gpus))}, 0.0, 100.0)


def req(jid: str) -> JobRequest:
    return JobRequest(jid, 0.0, [plan(2)], 10)


def test_a_preempt_and_start_of_one_running_job_is_a_resize_that_frees_its_gpus_first():
    st = state([run("long", 4)])
    # "long" shrinks from 4 to 2 GPUs; "new" starts on the 2 it gave back plus 4 free ones
    ds = [Decision("long", None, {}, "preempt", reason="recall"),
          Decision("long", plan(2), {"n0": [0, 1]}),
          Decision("new", plan(6), {"n0": [2, 3, 4, 5, 6, 7]})]
    r = check_decisions("p", ds, [req("new")], st)
    assert [d.job_id for d in r.stops] == ["long"]
    assert [d.job_id for d in r.starts] == ["long", "new"]
    assert r.resizes["long"].kind == "shrink" and r.resizes["long"].old_plan.gpus == 4
    assert r.preempted == [] and [d.job_id for d in r.started] == ["new"]


def test_a_preempt_without_restart_goes_back_to_the_queue():
    r = check_decisions("p", [Decision("long", None, {}, "preempt")], [], state([run("long", 4)]))
    assert r.preempted == ["long"] and not r.resizes


@pytest.mark.parametrize("ds, rule", [
    ([Decision("new", plan(2), {"n0": [0, 1]})], "busy GPUs"),
    ([Decision("new", plan(2), {"n9": [0, 1]})], "unknown node"),
    ([Decision("new", plan(2, "H100-80GB"), {"n0": [6, 7]})], "placed on A100-40GB node"),
    ([Decision("new", plan(2), {"n0": [6]})], "needs 2 GPUs"),
    ([Decision("ghost", plan(2), {"n0": [6, 7]})], "not pending"),
    ([Decision("new", plan(1), {"n0": [6]}), Decision("new", plan(1), {"n0": [7]})], "not pending"),
    ([Decision("gone", None, {}, "preempt")], "not running"),
])
def test_a_decision_that_breaks_the_state_is_a_policy_bug(ds, rule):
    with pytest.raises(ValueError, match=rule):
        check_decisions("p", ds, [req("new")], state([run("long", 4)]))


def test_run_round_reports_waits_only_of_jobs_that_did_not_start():
    waits = {"new": Wait("new", 50.0, A100, 2, "x"), "later": Wait("later", 90.0, A100, 8, "busy")}
    pol = Fixed([Decision("new", plan(2), {"n0": [4, 5]})], waits)
    r = run_round(pol, [req("new"), req("later")], state([run("long", 4)]), 0.0)
    assert list(r.waits) == ["later"] and r.policy_ms >= 0


def test_when_rounds_run():
    class Grows(Fixed):
        grows_runs = True

    class Rounds(Fixed):
        round_s = 60.0

    assert wants_tick(Fixed([]), pending=1, running=0, any_free=False)
    assert not wants_tick(Fixed([]), pending=0, running=3, any_free=True)
    assert wants_tick(Grows([]), pending=0, running=3, any_free=True)
    assert not wants_tick(Grows([]), pending=0, running=3, any_free=False)
    assert next_round_s(Fixed([]), 10.0, 300.0, after_round=True) == 310.0
    assert next_round_s(Rounds([]), 130.0, 300.0, after_round=False) == 180.0
    assert next_round_s(Rounds([]), 120.0, 300.0, after_round=False) == 120.0
    assert next_round_s(Rounds([]), 120.0, 300.0, after_round=True) == 180.0
