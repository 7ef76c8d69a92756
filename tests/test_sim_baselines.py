"""The peer baselines on hand-built clusters where the right answer is known."""
from __future__ import annotations

import pytest

from scheduler.policies.fifo_user import FifoUser, user_plan
from scheduler.policies.gavel import Gavel
from scheduler.policies.sia import Sia, config_counts
from scheduler.policies.tiresias import Tiresias
from scheduler.sim import SimConfig
from scheduler.sim.engine import Simulator
from scheduler.types import ClusterState, JobRequest, RunningJob

from tests.test_sim_engine import A100, R3090, Book, TableSteps, cluster, job, plan

H100 = "H100-80GB"


def req(jid, plans, *, gpus=1, gtype=A100, submit=0.0):
    return JobRequest(job_id=jid, submit_s=submit, plans=list(plans), steps_left=100,
                      requested_gpu_type=gtype, requested_gpus=gpus)


def state_of(clu) -> ClusterState:
    return ClusterState(nodes=clu.nodes, inter_node_gbps=clu.inter_node_gbps)


def check_valid(decisions, state):
    used = set()
    for d in decisions:
        if d.action != "start":
            continue
        n = sum(len(v) for v in d.placement.values())
        assert n == d.plan.gpus
        for node_id, devs in d.placement.items():
            node = next(x for x in state.nodes if x.node_id == node_id)
            assert node.gpu_type == d.plan.gpu_type
            for dev in devs:
                assert dev in node.free and (node_id, dev) not in used
                used.add((node_id, dev))


def test_user_plan_is_the_requested_type_and_count():
    plans = [plan(A100, 1, 2.0, 30), plan(A100, 2, 1.1, 20), plan(H100, 1, 0.7, 30)]
    assert user_plan(req("a", plans, gpus=2)).gpus == 2
    assert user_plan(req("a", plans, gpus=2)).gpu_type == A100
    # more than the type offers: its largest count
    assert user_plan(req("a", plans, gpus=8)).gpus == 2
    assert user_plan(req("a", plans, gtype="T4-16GB")) is None


def test_gavel_lp_puts_the_job_that_gains_most_on_the_fast_type():
    clu = cluster({H100: (1, 1), R3090: (1, 1)})
    # job x: 10x faster on H100; job y: only 1.2x faster on H100
    x = req("x", [plan(H100, 1, 0.1, 10), plan(R3090, 1, 1.0, 10)])
    y = req("y", [plan(H100, 1, 0.5, 10), plan(R3090, 1, 0.6, 10)])
    g = Gavel()
    alloc, plans = g.allocation([x, y], [H100, R3090], {H100: 1, R3090: 1})
    assert alloc[0, 0] == pytest.approx(1.0) and alloc[1, 1] == pytest.approx(1.0)
    st = state_of(clu)
    out = g.schedule([x, y], st, 0.0)
    check_valid(out, st)
    assert {(d.job_id, d.plan.gpu_type) for d in out} == {("x", H100), ("y", R3090)}


def test_gavel_respects_capacity_and_memory():
    clu = cluster({A100: (1, 4)})
    jobs = [req(f"j{i}", [plan(A100, 2, 1.0, 10)], gpus=2) for i in range(3)]
    jobs.append(req("nofit", [plan(H100, 2, 1.0, 60)], gpus=2))        # no plan on A100
    st = state_of(clu)
    out = Gavel().schedule(jobs, st, 0.0)
    check_valid(out, st)
    assert len(out) == 2 and "nofit" not in {d.job_id for d in out}


def test_gavel_time_shares_in_rounds():
    """Three equal 1-GPU jobs on 2 GPUs: every job gets GPU time within a few rounds."""
    clu = cluster({A100: (1, 2)})
    jobs = [job(f"j{i}", 0, 3000) for i in range(3)]
    sim = Simulator(jobs, clu, Gavel(), SimConfig(noise=0.0, startup_s=0.0), Book([plan(A100, 1, 1.0, 10)]),
                    TableSteps())
    res = sim.run()
    assert res.completed == 3 and res.preemptions >= 1
    starts = sorted(r["first_start_s"] for r in res.per_job)
    assert starts[-1] <= 2 * 360.0


def test_sia_config_set_and_ilp_capacity():
    assert config_counts(8, 32) == [1, 2, 4, 8, 16, 24, 32]
    assert config_counts(4, 2) == [1, 2]
    clu = cluster({A100: (1, 8), R3090: (1, 4)})
    plans = [plan(A100, n, 1.0 / n ** 0.9, 10) for n in (1, 2, 4, 8)] + \
            [plan(R3090, n, 2.0 / n ** 0.9, 10) for n in (1, 2, 4)] + [plan(A100, 3, 0.5, 10)]
    jobs = [req(f"j{i}", plans) for i in range(5)]
    st = state_of(clu)
    out = Sia().schedule(jobs, st, 0.0)
    check_valid(out, st)
    assert len(out) == 5                                # everyone gets something (lambda_n)
    assert all(d.plan.gpus != 3 for d in out)           # 3 is not a Sia configuration
    used = {A100: 0, R3090: 0}
    for d in out:
        used[d.plan.gpu_type] += d.plan.gpus
    assert used[A100] <= 8 and used[R3090] <= 4 and sum(used.values()) >= 10


def test_sia_keeps_a_running_job_unless_the_gain_beats_the_restart_penalty():
    clu = cluster({A100: (1, 2)})
    plans = [plan(A100, 1, 1.0, 10), plan(A100, 2, 0.99, 10)]      # 2 GPUs barely help
    r = req("r", plans)
    st = state_of(clu)
    s = Sia()
    first = s.schedule([r], st, 0.0)
    assert len(first) == 1
    d = first[0]
    node = st.nodes[0]
    node.free = [i for i in node.free if i not in d.placement[node.node_id]]
    st.running = [RunningJob("r", d.plan, d.placement, 0.0, 100.0)]
    again = s.schedule([], st, 60.0)
    assert again == []                                  # no churn


def test_every_baseline_finishes_a_small_mixed_workload_with_valid_decisions():
    clu = cluster({A100: (2, 4), R3090: (2, 4)})
    plans = [plan(A100, n, 1.0 / n, 20) for n in (1, 2, 4, 8)] + [plan(R3090, n, 2.0 / n, 20) for n in (1, 2, 4, 8)]
    jobs = [job(f"j{i}", 100.0 * i, 500 + 37 * i, gpus=(1, 2, 4)[i % 3]) for i in range(12)]
    for pol in (FifoUser(), Tiresias(), Gavel(), Sia()):
        sim = Simulator(jobs, clu, pol, SimConfig(noise=0.05, startup_s=30.0), Book(plans), TableSteps())
        res = sim.run()
        assert res.completed == 12, pol.name
        assert res.avg_jct_s >= res.lower_bound_avg_jct_s - 1e-6, pol.name
        assert 0 < res.gpu_util <= 1.0


def test_sia_does_not_swap_two_jobs_that_want_the_same_only_node():
    """Two jobs that both fit only one 8-GPU node: the running one keeps it (no livelock)."""
    clu = cluster({H100: (1, 8), R3090: (1, 4)})
    a = [plan(H100, 8, 1.0, 70)]
    jobs = [job("a", 0, 1000), job("b", 10, 1000)]
    sim = Simulator(jobs, clu, Sia(), SimConfig(noise=0.0, startup_s=60.0), Book(a), TableSteps())
    res = sim.run()
    assert res.completed == 2 and res.preemptions == 0
    by = {r["job_id"]: r for r in res.per_job}
    assert by["b"]["first_start_s"] == pytest.approx(by["a"]["end_s"], abs=60.0)


def test_faithful_sia_never_runs_a_configuration_the_estimator_says_does_not_fit():
    from scheduler.policies.sia import SiaNoProfile
    clu = cluster({A100: (1, 4)})
    cap = clu.gpus[A100].memory_gib
    tight = plan(A100, 2, 0.4, cap * 1.1)       # fastest, but predicted not to fit
    roomy = plan(A100, 1, 1.0, 10)
    for pol, ooms in ((Sia(), 0), (SiaNoProfile(), 1)):
        sim = Simulator([job("a", 0, 100)], clu, pol, SimConfig(noise=0.0, startup_s=10.0),
                        Book([tight, roomy]), TableSteps())
        res = sim.run()
        assert (res.completed, res.oom_events) == (1, ooms), pol.name


def test_sia_profiling_delays_a_new_jobs_first_round():
    clu = cluster({A100: (1, 4)})
    for profile_s, first in ((0.0, 0.0), (300.0, 300.0)):
        sim = Simulator([job("a", 0, 100)], clu, Sia(profile_s=profile_s), SimConfig(noise=0.0, startup_s=10.0),
                        Book([plan(A100, 1, 1.0, 10)]), TableSteps())
        assert sim.run().per_job[0]["first_start_s"] == pytest.approx(first)


def test_sia_starts_every_job_within_a_round_when_gpus_exist():
    """Sia's paper: a job never queues while GPUs exist for it; it gets some configuration at
    the first round after it arrives (rounds every 60 s)."""
    clu = cluster({A100: (2, 4), R3090: (2, 4)})
    plans = [plan(A100, n, 1.0 / n, 10) for n in (1, 2, 4)] + [plan(R3090, n, 2.5 / n, 10) for n in (1, 2, 4)]
    jobs = [job(f"j{i}", 37.0 * i, 400 + 50 * i) for i in range(10)]      # 10 jobs, 16 GPUs
    sim = Simulator(jobs, clu, Sia(), SimConfig(noise=0.0, startup_s=30.0), Book(plans), TableSteps())
    res = sim.run()
    assert res.completed == 10
    for r in res.per_job:
        assert r["first_start_s"] - r["submit_s"] <= 60.0 + 1e-6, r


def test_sia_reallocates_at_a_round_and_the_move_pays_the_restart():
    """A lone job takes the whole node; when a second arrives Sia re-allocates at the next round:
    the first restarts on fewer GPUs (a checkpoint restart, paying start-up again) and the
    second starts within the round."""
    clu = cluster({A100: (1, 4)})
    plans = [plan(A100, n, 1.0 / n, 10) for n in (1, 2, 4)]
    jobs = [job("a", 0.0, 2000), job("b", 100.0, 2000)]
    startup = 30.0
    sim = Simulator(jobs, clu, Sia(), SimConfig(noise=0.0, startup_s=startup), Book(plans), TableSteps())
    res = sim.run()
    by = {r["job_id"]: r for r in res.per_job}
    assert res.completed == 2
    assert by["a"]["preemptions"] >= 1                      # re-sized, not left alone
    assert by["b"]["first_start_s"] - by["b"]["submit_s"] <= 60.0 + 1e-6
    # without the restart a would finish no later than alone on 4 GPUs the whole time plus
    # the time it ran on fewer; the re-size costs it at least one more start-up
    alone = Simulator([jobs[0]], clu, Sia(), SimConfig(noise=0.0, startup_s=startup), Book(plans), TableSteps()).run()
    assert by["a"]["end_s"] >= alone.per_job[0]["end_s"] + startup - 1e-6
