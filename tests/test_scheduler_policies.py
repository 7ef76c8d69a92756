"""frenzy and frenzy-paper on hand-built clusters where the right answer is known."""
import copy
from pathlib import Path

import pytest

from estimator.errors import FrenzyInputError
from estimator.plan import Plan
from scheduler.cluster import parse_cluster
from scheduler.policies import POLICIES, get_policy
from scheduler.policies.frenzy import FrenzyPolicy
from scheduler.types import Decision, JobRequest, RunningJob

NOW = 1000.0


def cluster(text):
    return parse_cluster(text).initial_state()


def plan(t, n, mem, step, **kw):
    return Plan(gpu_type=t, gpus=n, dp=kw.pop("dp", n), device_used_gib=mem, step_time_s=step, **kw)


def job(jid, plans, steps=1000, submit=NOW):
    return JobRequest(job_id=jid, submit_s=submit, plans=plans, steps_left=steps)


def occupy(state, node_id, devices, plan_, end):
    """Mark devices of a node busy with a running job ending at ``end``."""
    for n in state.nodes:
        if n.node_id == node_id:
            n.free = [d for d in n.free if d not in devices]
    state.running.append(RunningJob(job_id=f"run-{node_id}-{devices[0]}", plan=plan_,
                                    placement={node_id: list(devices)}, start_s=0, expected_end_s=end))


MIXED = """
pools:
  - {name: a100, gpu: A100-80GB, nodes: 1, gpus_per_node: 8}
  - {name: rtx, gpu: RTX3090-24GB, nodes: 2, gpus_per_node: 8}
"""


def test_big_job_waits_for_a100_instead_of_ooming_on_24gb_cards():
    st = cluster(MIXED)
    occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 600)
    # estimator says the 24 GB plan "fits" with no margin (23.5 GiB): too tight to be safe
    big = job("big", [plan("A100-80GB", 8, 60.0, 1.0), plan("RTX3090-24GB", 8, 23.5, 3.0)])
    assert get_policy("frenzy").schedule([big], st, NOW) == []
    # the published HAS takes the first plan it can serve now: the 24 GB cards
    paper = get_policy("frenzy-paper").schedule([big], st, NOW)
    assert [d.plan.gpu_type for d in paper] == ["RTX3090-24GB"]
    # once the A100s free up, frenzy places it there
    st2 = cluster(MIXED)
    d = get_policy("frenzy").schedule([big], st2, NOW)
    assert len(d) == 1 and d[0].plan.gpu_type == "A100-80GB" and d[0].placement == {"a100-0": list(range(8))}


def test_waits_for_faster_type_only_when_that_finishes_sooner():
    st = cluster(MIXED)
    occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 100)
    plans = [plan("A100-80GB", 8, 20, 1.0), plan("RTX3090-24GB", 8, 10, 4.0)]
    # A100 free in 100 s, then 1000 s of work (done at +1100) beats 4000 s on RTX now
    assert get_policy("frenzy").schedule([job("j", plans)], st, NOW) == []
    # with the A100 busy for 10,000 s more, starting now on the RTX cards is sooner
    st = cluster(MIXED)
    occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 10_000)
    d = get_policy("frenzy").schedule([job("j", plans)], st, NOW)
    assert [x.plan.gpu_type for x in d] == ["RTX3090-24GB"]


A100_ONLY = """
pools:
  - {name: a, gpu: A100-80GB, nodes: 1, gpus_per_node: 8}
"""


def test_small_job_backfills_without_delaying_the_head_reservation():
    st = cluster(A100_ONLY)
    occupy(st, "a-0", [0, 1, 2, 3], plan("A100-80GB", 4, 10, 1), end=NOW + 100)   # 4 free now, 8 at +100
    head = job("head", [plan("A100-80GB", 8, 20, 1.0)], steps=1000, submit=NOW - 50)
    short = job("short", [plan("A100-80GB", 2, 5, 1.0)], steps=50, submit=NOW)       # done by +50
    long_ = job("long", [plan("A100-80GB", 2, 5, 1.0)], steps=5000, submit=NOW)      # would delay head
    pol = FrenzyPolicy(aging_s=1.0)            # strong aging: the old head job is first in line
    d = pol.schedule([head, short, long_], st, NOW)
    assert [x.job_id for x in d] == ["short"]
    assert set(d[0].placement["a-0"]) <= {4, 5, 6, 7}
    # the published HAS has no reservations: both small jobs start, the head job waits longer
    paper = get_policy("frenzy-paper").schedule([head, short, long_], st, NOW)
    assert {x.job_id for x in paper} == {"short", "long"}


def test_shortest_work_first_and_aging():
    st = cluster("pools:\n  - {name: a, gpu: A100-80GB, nodes: 1, gpus_per_node: 1}\n")
    p = plan("A100-80GB", 1, 10, 1.0)
    old_long = job("old-long", [p], steps=10_000, submit=NOW - 10)
    new_short = job("new-short", [p], steps=100, submit=NOW)
    assert [d.job_id for d in FrenzyPolicy().schedule([old_long, new_short], st, NOW)] == ["new-short"]
    # after waiting long enough (aging), the long job goes before a newly arrived short one
    later = NOW + 40 * 3600
    new_short.submit_s = later
    assert [d.job_id for d in FrenzyPolicy(aging_s=600).schedule([old_long, new_short], st, later)] == ["old-long"]
    assert [d.job_id for d in FrenzyPolicy(aging_s=1e9).schedule([old_long, new_short], st, later)] == ["new-short"]
    # frenzy-paper is FIFO
    assert [d.job_id for d in get_policy("frenzy-paper").schedule([new_short, old_long], st, NOW)] == ["old-long"]


def test_fewer_gpus_when_nearly_as_fast_and_single_node_placement():
    st = cluster("pools:\n  - {name: a, gpu: A100-80GB, nodes: 4, gpus_per_node: 8}\n")
    occupy(st, "a-0", [0, 1, 2, 3, 4, 5], plan("A100-80GB", 6, 1, 1), end=NOW + 1e6)
    p4, p8 = plan("A100-80GB", 4, 30, 1.0), plan("A100-80GB", 8, 20, 0.95)
    d = FrenzyPolicy().schedule([job("j", [p8, p4])], st, NOW)
    assert d[0].plan == p4 and len(d[0].placement) == 1            # within 10%: the cheaper plan
    p16 = plan("A100-80GB", 16, 10, 0.4, dp=16)
    d = FrenzyPolicy().schedule([job("j", [p16])], st, NOW)
    assert sorted(d[0].placement) == ["a-1", "a-2"]                 # two whole nodes, not 2 + 6 + 8


def test_oom_resubmission_picks_a_roomier_plan():
    st = cluster(A100_ONLY)
    tight, roomy = plan("A100-80GB", 4, 50, 1.0), plan("A100-80GB", 8, 30, 0.95)
    pol = FrenzyPolicy()
    j = job("j", [tight, roomy])
    assert pol.schedule([j], st, NOW)[0].plan == tight
    j = pol.on_oom(j, tight)
    assert j.restarts == 1
    assert pol.schedule([j], st, NOW)[0].plan == roomy


def test_never_places_a_plan_over_memory_minus_margin():
    st = cluster(A100_ONLY)
    over = plan("A100-80GB", 1, 79.9, 1.0)          # above 80 GB minus the margin
    assert FrenzyPolicy().schedule([job("j", [over])], st, NOW) == []
    ok_if_only = plan("A100-80GB", 1, 70.0, 1.0)    # no safe plan exists: falls back to margin-only fit
    assert len(FrenzyPolicy().schedule([job("j", [ok_if_only])], st, NOW)) == 1


@pytest.mark.parametrize("name", ["frenzy", "frenzy-paper"])
def test_policies_do_not_mutate_inputs_and_never_double_book(name):
    st = cluster(MIXED)
    occupy(st, "rtx-0", [0, 1, 2], plan("RTX3090-24GB", 3, 5, 1), end=NOW + 50)
    jobs = [job(f"j{i}", [plan("A100-80GB", n, 20, 1.0 / n), plan("RTX3090-24GB", n, 10, 3.0 / n)],
                steps=100 * (i + 1), submit=NOW - i) for i, n in enumerate([1, 2, 4, 8, 1, 2, 4])]
    st_before, jobs_before = copy.deepcopy(st), copy.deepcopy(jobs)
    decisions = get_policy(name).schedule(jobs, st, NOW)
    assert st == st_before and jobs == jobs_before
    free = {n.node_id: set(n.free) for n in st.nodes}
    seen = set()
    for d in decisions:
        assert sum(len(v) for v in d.placement.values()) == d.plan.gpus
        for nid, devs in d.placement.items():
            for dev in devs:
                assert dev in free[nid] and (nid, dev) not in seen
                seen.add((nid, dev))
    assert len({d.job_id for d in decisions}) == len(decisions)


def test_registry():
    assert {"frenzy", "frenzy-paper"} <= set(POLICIES)
    assert get_policy("frenzy") is not get_policy("frenzy")
    assert get_policy("frenzy", aging_s=10).aging_s == 10
    with pytest.raises(FrenzyInputError, match="unknown policy 'nope'"):
        get_policy("nope")


def test_frenzy_paper_uses_fewest_gpus_per_type_ranked_by_speed():
    st = cluster(MIXED)
    plans = [plan("A100-80GB", 8, 20, 0.5), plan("A100-80GB", 2, 60, 1.5), plan("RTX3090-24GB", 4, 20, 2.0)]
    d = get_policy("frenzy-paper").schedule([job("j", plans)], st, NOW)
    assert d[0].plan.gpus == 2 and d[0].plan.gpu_type == "A100-80GB"
    assert d[0].placement == {"a100-0": [0, 1]}


def test_short_job_preempts_a_much_longer_one_sparingly():
    st = cluster(A100_ONLY)
    long_plan = plan("A100-80GB", 8, 20, 1.0)
    occupy(st, "a-0", list(range(8)), long_plan, end=NOW + 100 * 3600)   # 100 h left
    st.running[0].start_s = NOW - 3600                                   # past its grace period
    short = job("short", [plan("A100-80GB", 4, 20, 1.0)], steps=1800)    # 30 min of work
    d = FrenzyPolicy().schedule([short], st, NOW)
    assert [(x.action, x.job_id) for x in d] == [("preempt", st.running[0].job_id), ("start", "short")]
    assert sum(len(v) for v in d[1].placement.values()) == 4
    # not when preemption is off, nor against a run still in its grace period
    assert FrenzyPolicy(preemption=False).schedule([short], st, NOW) == []
    st.running[0].start_s = NOW - 60
    assert FrenzyPolicy().schedule([short], st, NOW) == []
    # nor when the running job is about to finish anyway
    st2 = cluster(A100_ONLY)
    occupy(st2, "a-0", list(range(8)), long_plan, end=NOW + 2 * 3600)   # < 4 x (30 + 5) min
    st2.running[0].start_s = NOW - 3600
    assert FrenzyPolicy().schedule([short], st2, NOW) == []


def running(state, req, decision, start, end):
    """Put a job a policy started (``decision``) on the cluster as a running job that carries
    its request (as the simulator and the live scheduler hand runs to policies)."""
    jid = req.job_id
    for nid, devs in decision.placement.items():
        for n in state.nodes:
            if n.node_id == nid:
                n.free = [d for d in n.free if d not in devs]
    state.running.append(RunningJob(job_id=jid, plan=decision.plan, placement=dict(decision.placement),
                                    start_s=start, expected_end_s=end, request=req, reason=decision.reason))


# 4 GPUs at full efficiency; 8 GPUs 43% faster but at 71% parallel efficiency: worth it only
# on GPUs that would otherwise sit idle
ELASTIC = [plan("A100-80GB", 4, 20, 0.30), plan("A100-80GB", 8, 20, 0.21)]


def test_lightly_loaded_job_takes_the_fastest_plan_busy_one_the_cheapest():
    pol = FrenzyPolicy()
    d = pol.schedule([job("j", ELASTIC)], cluster(A100_ONLY), NOW)
    assert d[0].plan.gpus == 8                       # the whole idle node
    busy = cluster(A100_ONLY)
    other = plan("A100-80GB", 2, 20, 1.0)
    occupy(busy, "a-0", [0, 1], other, end=NOW + 3600)
    d = FrenzyPolicy().schedule([job("j", ELASTIC), job("k", [other])], busy, NOW)
    assert {x.job_id: x.plan.gpus for x in d} == {"j": 4, "k": 2}
    assert FrenzyPolicy(idle_factor=0).schedule([job("j", ELASTIC)], cluster(A100_ONLY), NOW)[0].plan.gpus == 4


def test_an_idle_start_takes_at_most_half_of_a_types_free_gpus_or_one_node():
    # 76% parallel efficiency at every width: an idle cluster would give the job all 32 GPUs,
    # and the next arrival of a burst would find none
    four = """
pools:
  - {name: a, gpu: A100-80GB, nodes: 4, gpus_per_node: 8}
"""
    plans = [plan("A100-80GB", 4, 20, 1.0), plan("A100-80GB", 8, 20, 0.66),
             plan("A100-80GB", 16, 20, 0.33), plan("A100-80GB", 32, 20, 0.165)]
    assert FrenzyPolicy(idle_share=1.0).schedule([job("j", plans)], cluster(four), NOW)[0].plan.gpus == 32
    assert FrenzyPolicy().schedule([job("j", plans)], cluster(four), NOW)[0].plan.gpus == 16
    # one node is always allowed (a lone job on a one-node cluster still gets all of it)
    assert FrenzyPolicy(idle_share=0.1).schedule([job("j", plans)], cluster(four), NOW)[0].plan.gpus == 8


def test_running_job_grows_onto_idle_gpus_only_when_nothing_waits_and_it_pays():
    pol = FrenzyPolicy()
    st = cluster(A100_ONLY)
    occupy(st, "a-0", [4, 5, 6, 7], plan("A100-80GB", 4, 20, 1.0), end=NOW + 600)
    j = job("j", ELASTIC, steps=100_000)
    d = pol.schedule([j], st, NOW)
    assert [(x.job_id, x.plan.gpus) for x in d] == [("j", 4)]
    # the other run ended: j restarts on 8 GPUs (8.3 h -> 5.8 h left, restore included)
    st = cluster(A100_ONLY)
    running(st, j, d[0], NOW, NOW + 100_000 * 0.30)
    later = NOW + 600
    g = pol.schedule([], st, later)
    assert [(x.action, x.job_id) for x in g] == [("preempt", "j"), ("start", "j")]
    assert g[1].plan.gpus == 8 and sum(map(len, g[1].placement.values())) == 8

    def knows_j(**kw):            # a fresh policy: the run's request says all it needs
        return FrenzyPolicy(preemption=False, **kw)

    # not while a job waits (one that needs the whole node), nor with grow=False, nor for a run
    # almost done
    waiter = job("w", [plan("A100-80GB", 8, 20, 1.0)])
    assert knows_j().schedule([waiter], st, later) == []
    assert knows_j(grow=False).schedule([], st, later) == []
    assert len(knows_j().schedule([], st, later)) == 2
    st.running[0].expected_end_s = later + 300
    assert knows_j().schedule([], st, later) == []


def test_growth_weighs_the_checkpoint_save_and_restore_of_the_job():
    # growing onto the other 4 GPUs saves 2.5 of 8.3 h; restoring a 20 TB checkpoint on one
    # node at 2 GB/s (save + restore: 5.6 h) would cost more than that
    for ckpt_gb, grows in ((10.0, True), (20_000.0, False)):
        pol = FrenzyPolicy()
        st = cluster(A100_ONLY)
        occupy(st, "a-0", [4, 5, 6, 7], plan("A100-80GB", 4, 20, 1.0), end=NOW + 600)
        j = job("j", ELASTIC, steps=100_000)
        j.checkpoint_gb = ckpt_gb
        d = pol.schedule([j], st, NOW)
        st = cluster(A100_ONLY)
        running(st, j, d[0], NOW, NOW + 100_000 * 0.30)
        assert bool(pol.schedule([], st, NOW + 600)) == grows


def test_a_simpler_plan_within_one_percent_of_the_fastest_is_preferred():
    z2 = plan("A100-80GB", 8, 20, 0.0467, zero=2)
    for ddp_step, want_zero in ((0.0468, 0), (0.0467 * 1.05, 2)):
        ddp = plan("A100-80GB", 8, 30, ddp_step)
        d = FrenzyPolicy().schedule([job("j", [z2, ddp])], cluster(A100_ONLY), NOW)
        assert d[0].plan.zero == want_zero


def test_growth_goes_below_the_idle_efficiency_floor_only_onto_idle_gpus():
    # 8 GPUs are 2x faster than 2 at 50% parallel efficiency: too wasteful for a first start
    # (idle floor 70%), worth a restart once the GPUs would otherwise sit idle (floor 40%)
    plans = [plan("A100-80GB", 2, 20, 0.30), plan("A100-80GB", 8, 20, 0.15)]
    for floor, grows in ((0.4, True), (0.6, False)):
        pol = FrenzyPolicy(grow_min_efficiency=floor, grow_long_min_efficiency=floor)
        j = job("j", plans, steps=100_000)
        d = pol.schedule([j], cluster(A100_ONLY), NOW)
        assert [(x.job_id, x.plan.gpus) for x in d] == [("j", 2)]
        st = cluster(A100_ONLY)
        running(st, j, d[0], NOW, NOW + 100_000 * 0.30)
        g = pol.schedule([], st, NOW + 600)
        assert [(x.action, x.plan and x.plan.gpus) for x in g] == ([("preempt", None), ("start", 8)] if grows else [])


def test_only_runs_with_30_min_or_more_left_grow_below_40_percent_efficiency():
    # 8 GPUs are 1.33x faster than 2 at 33% parallel efficiency: below the 40% growth floor,
    # above the 25% floor of runs with >= 30 min left
    plans = [plan("A100-80GB", 2, 20, 0.40), plan("A100-80GB", 8, 20, 0.30)]
    for steps, grows in ((100_000, True), (5_250, False)):     # 11 h / 25 min left at the round
        pol = FrenzyPolicy()
        j = job("j", plans, steps=steps)
        d = pol.schedule([j], cluster(A100_ONLY), NOW)
        assert [(x.job_id, x.plan.gpus) for x in d] == [("j", 2)]
        st = cluster(A100_ONLY)
        running(st, j, d[0], NOW, NOW + steps * 0.40)
        g = pol.schedule([], st, NOW + 600)
        assert [(x.action, x.plan and x.plan.gpus) for x in g] == ([("preempt", None), ("start", 8)] if grows else [])


def test_a_waiter_recalls_gpus_lent_to_a_run_beyond_its_efficient_plan():
    # big started alone on the whole node at 71% efficiency: 4 of its 8 GPUs are lent
    def setup(left_s, **kw):
        pol = FrenzyPolicy(shrink=False, preempt_ratio=1e9, **kw)   # only the recall may act
        big = job("big", ELASTIC, steps=200_000)
        d = pol.schedule([big], cluster(A100_ONLY), NOW - 3600)
        assert d[0].plan.gpus == 8
        st = cluster(A100_ONLY)
        running(st, big, d[0], NOW - 3600, NOW + left_s)
        return pol, st

    short = job("short", [plan("A100-80GB", 4, 20, 1.0)], steps=1800)   # 30 min, would wait 10 h
    pol, st = setup(10 * 3600)
    s = pol.schedule([short], st, NOW)
    assert [(x.action, x.job_id, x.plan and x.plan.gpus) for x in s] == [
        ("preempt", "big", None), ("start", "big", 4), ("start", "short", 4)]
    assert not set(sum(s[1].placement.values(), [])) & set(sum(s[2].placement.values(), []))
    pol, st = setup(10 * 3600, recall=False)
    assert pol.schedule([short], st, NOW) == []
    # a run with under 15 min left keeps its GPUs: they are free soon anyway
    pol, st = setup(600)
    assert pol.schedule([short], st, NOW) == []
    pol, st = setup(600, recall_min_left_s=0)
    assert [x.job_id for x in pol.schedule([short], st, NOW)] == ["big", "big", "short"]


def test_a_run_with_little_left_gives_lent_gpus_back_when_it_outlasts_the_waiters_wait():
    # big (8 of a node's 8 GPUs, 4 lent) has 10 min left; the other node frees at NOW + t. The
    # waiter would start then: when big outlasts that wait its lent GPUs are recalled now; when
    # big ends first the waiter's start counts on them, and big keeps them
    two = "pools:\n  - {name: a, gpu: A100-80GB, nodes: 2, gpus_per_node: 8}\n"

    def round_with_other_node_free_at(t):
        pol = FrenzyPolicy(shrink=False, preempt_ratio=1e9)     # only the recall may act
        big = job("big", ELASTIC, steps=200_000)
        d = pol.schedule([big], cluster(two), NOW - 3600)
        assert d[0].plan.gpus == 8
        st = cluster(two)
        running(st, big, d[0], NOW - 3600, NOW + 600)
        other = next(n.node_id for n in st.nodes if n.node_id not in d[0].placement)
        occupy(st, other, list(range(8)), plan("A100-80GB", 8, 20, 1.0), end=NOW + t)
        short = job("short", [plan("A100-80GB", 4, 20, 1.0)], steps=1800)
        return [(x.action, x.job_id) for x in pol.schedule([short], st, NOW)]

    assert round_with_other_node_free_at(580) == [("preempt", "big"), ("start", "big"), ("start", "short")]
    assert round_with_other_node_free_at(700) == []           # big ends first: the waiter waits for it


def test_a_job_started_by_preemption_can_grow_later():
    pol = FrenzyPolicy()
    st = cluster(A100_ONLY)
    occupy(st, "a-0", list(range(8)), plan("A100-80GB", 8, 20, 1.0), end=NOW + 100 * 3600)
    st.running[0].start_s = NOW - 3600
    short = job("short", [plan("A100-80GB", 4, 20, 1.0), plan("A100-80GB", 8, 20, 0.6)], steps=1800)
    d = pol.schedule([short], st, NOW)
    assert [(x.action, x.job_id) for x in d][-1] == ("start", "short") and d[-1].plan.gpus == 4
    st = cluster(A100_ONLY)                           # the preempted job was sent elsewhere
    running(st, short, d[-1], NOW, NOW + 1800 + 60)
    g = pol.schedule([], st, NOW + 60)
    assert [(x.action, x.job_id) for x in g] == [("preempt", "short"), ("start", "short")]
    assert g[1].plan.gpus == 8


def test_wide_run_shrinks_for_a_waiting_job_when_the_waiter_gains_more():
    pol = FrenzyPolicy(preempt_ratio=1e9)              # no whole-job preemption: only shrinking
    big = job("big", ELASTIC, steps=200_000)
    d = pol.schedule([big], cluster(A100_ONLY), NOW - 3600)
    assert d[0].plan.gpus == 8
    st = cluster(A100_ONLY)
    running(st, big, d[0], NOW - 3600, NOW + 10 * 3600)
    short = job("short", [plan("A100-80GB", 4, 20, 1.0)], steps=1800)   # 30 min, would wait 10 h
    s = pol.schedule([short], st, NOW)
    assert [(x.action, x.job_id) for x in s] == [("preempt", "big"), ("start", "big"), ("start", "short")]
    assert s[1].plan.gpus == 4 and s[2].plan.gpus == 4
    assert not set(sum(s[1].placement.values(), [])) & set(sum(s[2].placement.values(), []))
    # a waiter that would wait only minutes does not shrink anyone
    st.running[0].expected_end_s = NOW + 120
    assert FrenzyPolicy(preempt_ratio=1e9).schedule([short], st, NOW) == []
    assert FrenzyPolicy(shrink=False, preempt_ratio=1e9).schedule([short], st, NOW + 1) == []


def test_only_runs_past_their_grace_under_the_resize_cap_with_a_known_end_are_shrinkable():
    from scheduler.policies.frenzy.preempt import shrinkable
    pol = FrenzyPolicy(preempt_ratio=1e9, recall=False)   # step 6's shrink alone (a recall takes no grace)
    big = job("big", ELASTIC, steps=200_000)
    d = pol.schedule([big], cluster(A100_ONLY), NOW - 3600)
    short = job("short", [plan("A100-80GB", 4, 20, 1.0)], steps=1800)
    cases = {"shrinkable": {}, "in its grace": {"start_s": NOW - 60}, "at the re-size cap": {"resizes": 16},
             "unknown end": {"expected_end_s": float("nan")}}
    for name, change in cases.items():
        st = cluster(A100_ONLY)
        running(st, big, d[0], NOW - 3600, NOW + 10 * 3600)
        for k, v in change.items():
            setattr(st.running[0], k, v)
        runs = pol._runs(st, {n.node_id: n.gpu_type for n in st.nodes})
        got = shrinkable(runs, NOW, pol.config)
        assert [r.rj.job_id for r, _, _ in got] == (["big"] if name == "shrinkable" else []), name
        if name == "shrinkable":
            (_, rem, steps), = got
            assert rem == 10 * 3600 and steps > 0
        # and the round agrees: only a shrinkable run is shrunk for the waiter
        acts = [(x.action, x.job_id) for x in pol.schedule([short], st, NOW)]
        assert acts == ([("preempt", "big"), ("start", "big"), ("start", "short")] if name == "shrinkable" else []), name


def test_importing_the_registry_does_not_load_scipy():
    """The live submit flow imports the registry; only gavel/sia rounds need numpy/scipy."""
    import subprocess
    import sys
    code = "import sys, scheduler.policies; print('scipy' in sys.modules or 'numpy' in sys.modules)"
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- the configuration and each step alone -------------------------------------------------
OLD_KEYWORDS = """safety_margin_gib mem_headroom aging_s tolerance max_reservations lookahead min_efficiency
preemption preempt_min_wait_s preempt_ratio preempt_grace_s max_preemptions_per_job preempt_heads idle_factor
idle_min_efficiency idle_share grow grow_min_gain grow_min_s grow_min_efficiency grow_long_s
grow_long_min_efficiency recall recall_min_wait_s recall_min_left_s max_grows_per_job grow_max_per_round
restart_s ckpt_gbs shrink shrink_min_wait_s shrink_grace_s shrink_gain""".split()


def test_config_groups_take_every_former_keyword_as_a_flat_override():
    from scheduler.policies.frenzy import FrenzyConfig
    from scheduler.policies.frenzy.config import FLAT
    assert len(OLD_KEYWORDS) == 33 and set(OLD_KEYWORDS) <= set(FLAT)
    cfg = FrenzyConfig().with_overrides(grow=False, aging_s=600, recall_min_left_s=0, max_grows_per_job=3)
    assert (cfg.growth.enabled, cfg.order.aging_s, cfg.recall.min_left_s, cfg.growth.max_resizes_per_job) == (
        False, 600, 0, 3)
    assert FrenzyConfig().growth.enabled and FrenzyConfig().recall.min_left_s == 900
    assert get_policy("frenzy", shrink=False, preempt_ratio=9).config.preempt.ratio == 9
    with pytest.raises(FrenzyInputError, match="bogus"):
        FrenzyConfig().with_overrides(bogus=1)


def test_memory_gate_alone_safe_plans_else_the_roomiest_that_fit():
    from scheduler.policies.frenzy.config import MemoryGate
    from scheduler.policies.frenzy.gate import memory_gate
    mem = {"A100-80GB": 80.0}.get
    safe, tight, over = plan("A100-80GB", 1, 50, 1), plan("A100-80GB", 2, 75, 1), plan("A100-80GB", 4, 81, 1)
    assert memory_gate([safe, tight, over], mem, MemoryGate()) == [safe]
    assert memory_gate([tight, over], mem, MemoryGate()) == [tight]          # no safe plan: fallback
    assert memory_gate([over], mem, MemoryGate()) == []


def test_order_alone_shortest_work_first_and_aging():
    from scheduler.policies.frenzy import FrenzyPolicy
    from scheduler.policies.frenzy.choose import order_queue
    from scheduler.policies.frenzy.config import Ordering
    pol = FrenzyPolicy()
    st = cluster(A100_ONLY)
    pol.schedule([], st, NOW)                                  # learns the cluster's memory
    p = [plan("A100-80GB", 1, 20, 1.0)]
    old, new = job("old", p, steps=10_000, submit=NOW - 7200), job("new", p, steps=2_000)
    pairs = [(j, pol.menu(j.plans)) for j in (old, new)]
    assert [q.job_id for q in order_queue(pairs, NOW, Ordering())] == ["new", "old"]
    assert [q.job_id for q in order_queue(pairs, NOW, Ordering(aging_s=600))] == ["old", "new"]


def fast_busy_slow_free():
    """Two 8-GPU plans: A100s 2x faster, all busy for 10 more min; the RTX cards free now."""
    from scheduler.policies.frenzy.profile import Profile
    from scheduler.policies.frenzy.records import Cand
    fast, slow = plan("A100-80GB", 8, 20, 1.0), plan("RTX3090-24GB", 8, 20, 2.0)
    menu = [Cand(1.0, 8, "A100-80GB", fast), Cand(2.0, 8, "RTX3090-24GB", slow)]
    a, r = Profile(), Profile()
    a.total, r.total = 8, 8
    a.add_release(NOW + 600, 8)
    return fast, slow, menu, {"A100-80GB": a, "RTX3090-24GB": r}, {"A100-80GB": 0, "RTX3090-24GB": 8}


def test_choose_alone_waits_for_a_faster_type_only_when_it_finishes_sooner():
    from scheduler.policies.frenzy.choose import choose
    from scheduler.policies.frenzy.config import Choice
    fast, slow, menu, profiles, free = fast_busy_slow_free()
    assert choose(menu, 1000, profiles, free, NOW, Choice()).cand.plan is fast
    assert choose(menu, 300, profiles, free, NOW, Choice()).cand.plan is slow


def test_a_job_that_can_finish_soon_on_free_gpus_distrusts_its_predicted_wait():
    from scheduler.policies.frenzy.choose import choose, wait_weight
    from scheduler.policies.frenzy.config import Choice
    fast, slow, menu, profiles, free = fast_busy_slow_free()
    cfg = Choice()
    # 800 steps: waiting finishes at +1400 s, the RTX cards now at +1600 s (within short_s)
    w = wait_weight(menu, 800, free, cfg)
    assert w == 1.0 + cfg.wait_inflation
    assert choose(menu, 800, profiles, free, NOW, cfg).cand.plan is fast         # trusting the wait
    assert choose(menu, 800, profiles, free, NOW, cfg, wait_w=w).cand.plan is slow
    # switched off, or a long job (its RTX run would take 2000 s > short_s): it waits
    assert wait_weight(menu, 800, free, Choice(wait_inflation=0.0)) == 1.0
    assert wait_weight(menu, 1000, free, cfg) == 1.0
    assert wait_weight(menu, 800, {"A100-80GB": 0, "RTX3090-24GB": 4}, cfg) == 1.0   # nothing free fits
    # through the policy: the short job starts now on the RTX cards, the default off-switch name works
    st = cluster(MIXED)
    occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 600)
    j = job("j", [plan("A100-80GB", 8, 10, 1.0), plan("RTX3090-24GB", 8, 10, 2.0)], steps=800)
    assert FrenzyPolicy().schedule([j], st, NOW)[0].plan.gpu_type == "RTX3090-24GB"
    assert FrenzyPolicy(wait_inflation=0.0, stopgap=False).schedule([j], st, NOW) == []
    # trusting the wait, it still starts now, as a stopgap (step 3b)
    assert [d.reason for d in FrenzyPolicy(wait_inflation=0.0).schedule([j], st, NOW)] == ["stopgap"]


def test_stopgap_rule_alone_weighs_the_wait_against_the_later_move():
    from scheduler.policies.frenzy.records import Cand, Pick
    from scheduler.policies.frenzy.choose import stopgap_pays
    c = Cand(1.0, 8, "A100-80GB", plan("A100-80GB", 8, 20, 1.0))
    later = Pick(c, NOW + 1800, 3600.0)                        # 30 min wait, 1 h on the fast type
    assert stopgap_pays(later, Pick(c, NOW, 9000.0), 100.0, NOW)        # 1800 x 3600 > 100 x 9000
    soon = Pick(c, NOW + 120, 3600.0)
    assert not stopgap_pays(soon, Pick(c, NOW, 9000.0), 100.0, NOW)     # 120 x 3600 < 100 x 9000
    assert stopgap_pays(soon, Pick(c, NOW, 3700.0), 100.0, NOW)         # no slower than waiting


# --- no idle GPUs while a job that could use them waits ------------------------------------
def test_a_job_starts_now_on_a_slower_type_unless_its_plan_is_due_very_soon():
    fast, slow = plan("A100-80GB", 8, 15, 1.0), plan("RTX3090-24GB", 8, 15, 2.5)
    for busy_for, stopgap, want in ((1800, True, "RTX3090-24GB"), (1800, False, None), (60, True, None)):
        st = cluster(MIXED)
        occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + busy_for)
        d = FrenzyPolicy(stopgap=stopgap).schedule([job("j", [fast, slow], steps=3600)], st, NOW)
        assert [x.plan.gpu_type for x in d] == ([want] if want else []), (busy_for, stopgap)


def test_a_stopgap_must_end_within_five_times_its_predicted_wait():
    """The A100s free in 30 min: a stopgap on the RTX cards (2.5x slower) may run up to 5 x 30
    min = 9,000 s, 3,600 steps; one step more and the job waits for its own plan."""
    fast, slow = plan("A100-80GB", 8, 15, 1.0), plan("RTX3090-24GB", 8, 15, 2.5)
    for steps, kw, want in ((3600, {}, ["stopgap"]), (3610, {}, []), (36_000, {}, []),
                            (36_000, {"stopgap_end_within_wait": 0}, ["stopgap"])):
        st = cluster(MIXED)
        occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 1800)
        d = FrenzyPolicy(**kw).schedule([job("j", [fast, slow], steps=steps)], st, NOW)
        assert [x.reason for x in d] == want, (steps, kw)


def test_a_stopgap_run_moves_up_when_its_plan_frees_while_others_wait():
    fast, slow = plan("A100-80GB", 8, 15, 1.0), plan("RTX3090-24GB", 8, 15, 2.5)
    j = job("j", [fast, slow], steps=3600)
    wide = job("w", [plan("RTX3090-24GB", 16, 15, 1.0)], steps=36_000)   # waits for all 16 RTX GPUs
    for kw, moves in (({"grow_while_waiting": True, "stopgap_move_up": False}, True), ({}, True),
                      ({"stopgap_move_up": False}, False)):
        st = cluster(MIXED)
        occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 1800)
        start = next(d for d in FrenzyPolicy().schedule([j], st, NOW) if d.job_id == "j")
        assert start.plan is slow and start.reason == "stopgap"
        st = cluster(MIXED)                                   # the A100s are free again
        running(st, j, start, NOW, NOW + 3600 * 2.5)
        d = FrenzyPolicy(preempt_yields=False, **kw).schedule([wide], st, NOW + 600)   # 6b alone: its own test
        got = [(x.action, x.job_id, x.plan and x.plan.gpu_type) for x in d]
        # moving up inside the queue pass also frees j's RTX cards for w in the same round
        assert got[:2] == ([("preempt", "j", None), ("start", "j", "A100-80GB")] if moves else []), got
        assert got[2:] == ([("start", "w", "RTX3090-24GB")] if kw == {} else []), got


def test_only_runs_started_as_stopgaps_move_up_unless_every_run_may():
    """The same slow run, started as a stopgap or by the policy's own choice: only the stopgap
    moves to the freed A100s (``move_up_any`` moves both; every slow run moving restarted runs
    the policy had put on slower types on purpose, measured worse)."""
    fast, slow = plan("A100-80GB", 8, 15, 1.0), plan("RTX3090-24GB", 8, 15, 2.5)
    wide = job("w", [plan("RTX3090-24GB", 16, 15, 1.0)], steps=36_000)
    for reason, kw, moves in (("stopgap", {}, True), ("", {}, False), ("", {"stopgap_move_up_any": True}, True)):
        j = job("j", [fast, slow], steps=3600)
        st = cluster(MIXED)
        running(st, j, Decision(job_id="j", plan=slow, placement={"rtx-0": list(range(8))}, reason=reason),
                NOW, NOW + 3600 * 2.5)
        d = FrenzyPolicy(preempt_yields=False, **kw).schedule([wide], st, NOW + 600)
        assert [(x.action, x.job_id) for x in d][:2] == ([("preempt", "j"), ("start", "j")] if moves else []), \
            (reason, kw)


def test_a_stopgap_keeps_its_place_in_the_fast_types_queue_when_it_reserves():
    fast, slow = plan("A100-80GB", 8, 15, 1.0), plan("RTX3090-24GB", 8, 15, 2.5)
    j = job("j", [fast, slow], steps=36_000)
    big = job("big", [plan("A100-80GB", 8, 15, 1.0)], steps=100_000)   # more work: queued behind j
    starts = {}
    for reserve in (False, True):
        st = cluster(MIXED)
        occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 1800)
        running(st, j, Decision(job_id="j", plan=slow, placement={"rtx-0": list(range(8))}, reason="stopgap"),
                NOW - 600, NOW + 36_000 * 2.5)
        pol = FrenzyPolicy(stopgap=True, stopgap_move_up=True, stopgap_reserve=reserve, preempt_yields=False)
        assert [d.job_id for d in pol.schedule([big], st, NOW) if d.action == "start"] == []
        starts[reserve] = pol.waits()["big"].predicted_start_s
    # without the reservation big is due when the A100s free; with it, after j's move onto them
    assert starts[False] == pytest.approx(NOW + 1800, abs=120)
    assert starts[True] > NOW + 1800 + 30_000


def test_waits_say_why_each_job_waits():
    from scheduler.round import run_round
    st = cluster(MIXED)
    occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 1800)
    big = job("big", [plan("A100-80GB", 8, 60.0, 1.0)])             # only fits the A100s
    huge = job("huge", [plan("A100-80GB", 8, 200.0, 1.0)])          # fits nothing here
    res = run_round(FrenzyPolicy(), [big, huge], st, NOW)
    w = res.waits
    assert w["big"].gpu_type == "A100-80GB" and w["big"].gpus == 8
    assert w["big"].predicted_start_s == pytest.approx(NOW + 1800)
    assert w["big"].reason == "reserved for 8xA100-80GB at +30 min"
    assert w["huge"].predicted_start_s == float("inf") and "no plan fits" in w["huge"].reason
    # a short job that could start on the RTX cards now but would run into big's reservation
    st = cluster(MIXED)
    occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 1800)
    occupy(st, "rtx-0", list(range(8)), plan("RTX3090-24GB", 8, 10, 1), end=NOW + 600)
    occupy(st, "rtx-1", list(range(4)), plan("RTX3090-24GB", 4, 10, 1), end=NOW + 600)
    wide = job("wide", [plan("RTX3090-24GB", 16, 10.0, 1.0)], steps=10)        # reserved at +10 min
    long4 = job("long4", [plan("RTX3090-24GB", 4, 10.0, 1.0)], steps=100_000)  # 4 free, runs past it
    # (by default wide, waiting 10 min for a 100 s run, preempts the RTX runs instead)
    assert run_round(FrenzyPolicy(), [wide, long4], st, NOW).preempted == ["run-rtx-0-0", "run-rtx-1-0"]
    res = run_round(FrenzyPolicy(preemption=False), [wide, long4], st, NOW)
    assert "would delay a reservation" in res.waits["long4"].reason


def test_a_run_that_would_finish_as_soon_on_another_type_yields_its_gpus_to_a_waiter():
    # s holds 8 RTX cards for 90,000 s more; from the A100 queue (free in 1,800 s, that wait
    # distrusted 5x) it would finish by ~45,000 s: it gives the RTX cards to w, who can only use them
    fast, slow = plan("A100-80GB", 8, 15, 1.0), plan("RTX3090-24GB", 8, 15, 2.5)
    w = job("w", [plan("RTX3090-24GB", 8, 15, 1.0)], steps=1000)
    for kw, yields in (({}, True), ({"preempt_yields": False}, False)):
        st = cluster(MIXED)
        occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 1800)
        occupy(st, "rtx-1", list(range(8)), plan("RTX3090-24GB", 8, 10, 1), end=NOW + 50_000)
        s = job("s", [fast, slow], steps=36_000)
        # (a stopgap with no end bound: 90,000 s on the RTX cards against a 2,800 s wait)
        start = next(d for d in FrenzyPolicy(stopgap_end_within_wait=0).schedule([s], st, 0.0) if d.job_id == "s")
        running(st, s, start, 0.0, NOW + 36_000 * 2.5)
        d = FrenzyPolicy(preemption=False, shrink=False, **kw).schedule([w], st, NOW)
        got = [(x.action, x.job_id, x.plan and x.plan.gpu_type) for x in d]
        assert got == ([("preempt", "s", None), ("start", "w", "RTX3090-24GB")] if yields else []), got
    # a run with no plan on another type has nowhere to go: it keeps its GPUs
    st = cluster(MIXED)
    occupy(st, "a100-0", list(range(8)), plan("A100-80GB", 8, 10, 1), end=NOW + 1800)
    occupy(st, "rtx-1", list(range(8)), plan("RTX3090-24GB", 8, 10, 1), end=NOW + 50_000)
    only = job("s", [slow], steps=36_000)
    start = FrenzyPolicy().schedule([only], st, 0.0)[0]
    running(st, only, start, 0.0, NOW + 36_000 * 2.5)
    assert FrenzyPolicy(preemption=False, shrink=False).schedule([w], st, NOW) == []


def test_every_waiter_of_a_round_may_preempt_not_only_the_first_four():
    """A burst of six short 8-GPU jobs arrives at six nodes held by long runs on their efficient
    plan (nothing lent, so no recall): each short job checkpoint-preempts one run and starts this
    round (the earlier cap let only the first four of the queue act; the rest waited hours)."""
    six = "pools:\n  - {name: a, gpu: A100-80GB, nodes: 6, gpus_per_node: 8}\n"
    efficient = [plan("A100-80GB", 4, 20, 0.30), plan("A100-80GB", 8, 20, 0.16)]   # 8 GPUs at 94%
    st = cluster(six)
    for i in range(6):
        big = job(f"big{i}", efficient, steps=200_000, submit=NOW - 3600)
        wide = Decision(job_id=big.job_id, plan=efficient[1], placement={f"a-{i}": list(range(8))})
        running(st, big, wide, NOW - 3600, NOW + 10 * 3600)
    shorts = [job(f"s{i}", [plan("A100-80GB", 8, 20, 1.0)], steps=1800) for i in range(6)]
    d = FrenzyPolicy().schedule(shorts, st, NOW)
    assert {x.job_id for x in d if x.action == "start"} == {f"s{i}" for i in range(6)}
    assert {x.job_id for x in d if x.action == "preempt"} == {f"big{i}" for i in range(6)}
    held = [(nid, v) for x in d if x.action == "start" for nid, devs in x.placement.items() for v in devs]
    assert len(held) == len(set(held)) == 48                          # no device given twice
    four = FrenzyPolicy(preempt_heads=4).schedule(shorts, st, NOW)
    assert sum(x.action == "start" for x in four) == 4


@pytest.mark.parametrize("name,kw,says", [
    ("frenzy", {"aging_s": -1}, "frenzy option aging_s: must be a finite number > 0"),
    ("frenzy", {"aging_s": "x"}, "frenzy option aging_s: must be a finite number > 0"),
    ("frenzy", {"max_reservations": 1.5}, "frenzy option max_reservations: must be an integer >= 0"),
    ("frenzy", {"preemption": "no"}, "frenzy option preemption: must be true or false"),
    ("gavel", {"bogus": 1}, "policy option: gavel takes no option 'bogus'"),
])
def test_policy_options_of_the_wrong_kind_are_one_line(name, kw, says):
    """They were taken as they came (a negative aging, 1.5 reservations, the string "no" as a
    switch) or failed deep in a round; other policies raised a bare TypeError."""
    from estimator.errors import FrenzyInputError
    with pytest.raises(FrenzyInputError) as e:
        get_policy(name, **kw)
    assert str(e.value).startswith(says)
