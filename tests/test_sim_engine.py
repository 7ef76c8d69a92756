"""The simulator's event loop, truth model and metrics, on hand-built plans and clusters.

The throughput model is replaced by a table here (``TableSteps``) so every expected time is
computable by hand; tests of the simulator over the real estimator live in test_sim_live.py.
"""
from __future__ import annotations

import json
import math

import pytest

from estimator.catalog import get_gpu
from estimator.plan import Plan
from scheduler.policies.fifo_user import FifoUser
from scheduler.policies.tiresias import Tiresias
from scheduler.sim import SimConfig
from scheduler.sim.engine import SimCluster, Simulator
from scheduler.sim.metrics import CONTRACT_KEYS, percentile
from scheduler.sim.truth import memory_factor, step_factor
from scheduler.types import Node
from scheduler.workload import WorkloadJob

A100 = "A100-40GB"
R3090 = "RTX3090-24GB"


def cluster(spec: dict[str, tuple[int, int]], gbps: float = 100.0) -> SimCluster:
    """{gpu_type: (nodes, gpus_per_node)} -> SimCluster with pools named after the type."""
    nodes = []
    for gtype, (n, per) in spec.items():
        for i in range(n):
            nodes.append(Node(f"{gtype}-{i}", gtype, gtype, per, list(range(per))))
    return SimCluster(nodes=nodes, gpus={t: get_gpu(t) for t in spec},
                      inter_node_gbps={t: gbps for t in spec})


def plan(gtype: str, gpus: int, step: float, mem: float, tp: int = 1) -> Plan:
    return Plan(gpu_type=gtype, gpus=gpus, dp=gpus // tp, tp=tp, micro_batch=1,
                grad_accum=max(1, 64 // (gpus // tp)), device_used_gib=mem, step_time_s=step)


class Book:
    """A PlanBook stand-in: the same plan list for every job shape, or per model."""

    def __init__(self, plans):
        self._plans = plans

    def plans(self, model, seq_len, global_batch):
        return self._plans[model] if isinstance(self._plans, dict) else self._plans


class TableSteps:
    """Step time = the plan's predicted one, x ``multi_node_penalty`` when it spans nodes."""

    def __init__(self, multi_node_penalty: float = 1.0):
        self.penalty = multi_node_penalty
        self.calls: list[tuple[int, int, float | None]] = []

    def at(self, model, seq_len, plan, nodes, gbps):
        self.calls.append((plan.gpus, nodes, gbps))
        return plan.step_time_s * (self.penalty if nodes > 1 else 1.0)


def job(jid: str, submit: float, steps: int, *, gpus: int = 1, gtype: str = A100, model: str = "gpt2") -> WorkloadJob:
    return WorkloadJob(job_id=jid, submit_s=submit, model=model, seq_len=1024, global_batch=64,
                       train_tokens=steps * 64 * 1024, requested_gpu_type=gtype, requested_gpus=gpus)


def run(jobs, clu, policy, plans, *, noise=0.0, steps=None, **cfg):
    sim = Simulator(jobs, clu, policy, SimConfig(noise=noise, **cfg), Book(plans), steps or TableSteps())
    return sim, sim.run()


def test_single_job_runs_startup_plus_steps():
    sim, res = run([job("a", 10.0, 100)], cluster({A100: (1, 8)}), FifoUser(), [plan(A100, 1, 2.0, 10)],
                   startup_s=60.0)
    assert res.completed == 1
    assert res.avg_jct_s == pytest.approx(60 + 100 * 2.0)
    assert res.avg_queue_s == 0.0
    assert res.makespan_s == pytest.approx(260.0)
    # 1 of 8 GPUs busy for the whole makespan
    assert res.gpu_util == pytest.approx(1 / 8)
    assert res.lower_bound_avg_jct_s == pytest.approx(260.0)
    assert list(res.summary()) == list(CONTRACT_KEYS)
    json.dumps(res.summary())


def test_fifo_without_backfill_blocks_behind_the_head():
    clu = cluster({A100: (1, 2)})
    plans = [plan(A100, 1, 1.0, 10), plan(A100, 2, 0.6, 8)]
    jobs = [job("big-running", 0, 1000, gpus=1), job("head", 1, 100, gpus=2), job("small", 2, 10, gpus=1)]
    sim, res = run(jobs, clu, FifoUser(), plans, startup_s=0.0)
    by = {r["job_id"]: r for r in res.per_job}
    assert res.completed == 3
    # the 2-GPU head waits for the 1-GPU job; the small job must not jump the queue
    assert by["head"]["first_start_s"] == pytest.approx(1000.0)
    assert by["small"]["first_start_s"] >= by["head"]["end_s"] - 1e-9


def test_out_of_memory_fails_after_startup_and_fifo_user_doubles_gpus():
    # find a job id whose (seeded, clipped lognormal) memory error is > +5%
    jid = next(f"j{i}" for i in range(1000) if memory_factor(0, f"j{i}", 0.1) > 1.06)
    cap = get_gpu(A100).memory_gib
    plans = [plan(A100, 1, 1.0, cap * 0.97), plan(A100, 2, 0.55, cap * 0.6)]
    sim, res = run([job(jid, 0, 100, gpus=1)], cluster({A100: (1, 8)}), FifoUser(), plans,
                   noise=0.1, startup_s=30.0)
    assert res.oom_events == 1
    assert res.completed == 1
    sj = sim.by_id[jid]
    assert sj.req.requested_gpus == 2 and sj.starts == 2
    real = 0.55 * step_factor(0, jid, A100, 0.1)
    # failed run: 30 s start-up, then the 2-GPU retry: 30 s + 100 real steps
    assert res.avg_jct_s == pytest.approx(30 + 30 + 100 * real)


def test_noise_is_seeded_per_job_and_independent_of_order():
    f1 = [memory_factor(3, f"j{i}", 0.1) for i in range(200)]
    assert f1 == [memory_factor(3, f"j{i}", 0.1) for i in range(200)]
    assert f1 != [memory_factor(4, f"j{i}", 0.1) for i in range(200)]
    logs = [math.log(f) for f in f1]
    assert abs(sum(logs) / len(logs)) < 0.03 and 0.07 < (sum(x * x for x in logs) / len(logs)) ** 0.5 < 0.13
    assert max(abs(x) for x in logs) <= 0.3 + 1e-12          # clipped at 3 sigma
    assert memory_factor(0, "x", 0.0) == 1.0 and step_factor(0, "x", A100, 0.0) == 1.0


def test_placement_spanning_nodes_runs_at_the_multi_node_step_time():
    clu = cluster({A100: (2, 8)}, gbps=200.0)
    steps = TableSteps(multi_node_penalty=1.5)
    sim, res = run([job("wide", 0, 100, gpus=16)], clu, FifoUser(), [plan(A100, 16, 1.0, 20)],
                   steps=steps, startup_s=0.0)
    assert (16, 2, 200.0) in steps.calls
    assert res.avg_jct_s == pytest.approx(150.0)


def test_unplaceable_and_unfit_jobs_end_the_simulation():
    clu = cluster({A100: (1, 8)})
    plans = {"gpt2": [plan(A100, 1, 1.0, 10)], "llama-2-70b": []}
    jobs = [job("ok", 0, 10), job("huge", 0, 10, model="llama-2-70b")]
    sim, res = run(jobs, clu, FifoUser(), plans, startup_s=0.0)
    assert res.completed == 1 and res.rejected == 1 and res.jobs == 2


def test_bad_policy_decision_is_an_error():
    from scheduler.types import Decision, Policy

    class Greedy(Policy):
        name = "greedy"

        def schedule(self, pending, state, now):
            return [Decision(j.job_id, j.plans[0], {state.nodes[0].node_id: [0]}) for j in pending]

    with pytest.raises(ValueError, match="busy GPUs"):
        run([job("a", 0, 10), job("b", 0, 10)], cluster({A100: (1, 8)}), Greedy(), [plan(A100, 1, 1.0, 5)])


def test_a_runs_start_reason_reaches_the_policy_in_the_next_rounds():
    """The simulator hands each run to the policy with its start decision's reason
    (``RunningJob.reason``), as the live scheduler does from the ledger: frenzy's stopgaps are
    found that way."""
    from scheduler.types import Decision, Policy

    class Tagging(Policy):
        name = "tagging"

        def __init__(self):
            self.seen: list[tuple[str, str]] = []      # (job, reason) of every run it was shown

        def schedule(self, pending, state, now):
            self.seen += [(r.job_id, r.reason) for r in state.running]
            node = state.nodes[0]
            return [Decision(j.job_id, j.plans[0], {node.node_id: [d]}, reason=f"why-{j.job_id}")
                    for d, j in zip(node.free, pending)]

    pol = Tagging()
    run([job("a", 0, 10), job("b", 5, 10)], cluster({A100: (1, 8)}), pol, [plan(A100, 1, 1.0, 5)],
        startup_s=0.0)
    assert ("a", "why-a") in pol.seen


def test_tiresias_preempts_a_long_job_for_a_new_one_and_resumes_it():
    clu = cluster({A100: (1, 1)})
    plans = [plan(A100, 1, 1.0, 10)]
    # the long job attains > 1 GPU-hour, drops to queue 1; the newcomer (queue 0) preempts it
    jobs = [job("long", 0, 10_000), job("new", 5_000, 100)]
    sim, res = run(jobs, clu, Tiresias(), plans, startup_s=10.0, tick_s=60.0)
    by = {r["job_id"]: r for r in res.per_job}
    assert res.completed == 2 and res.preemptions >= 1
    assert by["new"]["first_start_s"] < 5_000 + 400         # within a tick or two
    assert by["new"]["end_s"] < by["long"]["end_s"]
    # the long job keeps its completed steps: total = 10,000 steps + one extra start-up each restart
    long = sim.by_id["long"]
    assert by["long"]["end_s"] == pytest.approx(10_000 + 10.0 * long.starts + (by["new"]["end_s"] - by["new"]["first_start_s"]), rel=0.02)


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) == 0.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)


def test_resumed_job_pays_checkpoint_save_and_restore():
    from scheduler.restart import CKPT_BYTES_PER_PARAM
    from scheduler.sim.jobs import model_spec
    clu = cluster({A100: (1, 1)})
    jobs = [job("long", 0, 10_000, model="llama-3.2-1b"), job("new", 5_000, 100, model="llama-3.2-1b")]
    sim, res = run(jobs, clu, Tiresias(), [plan(A100, 1, 1.0, 10)], startup_s=10.0, tick_s=60.0,
                   ckpt_gbs_per_node=1.0)
    long = sim.by_id["long"]
    assert long.preemptions == 1 and long.starts == 2
    restore = 2 * CKPT_BYTES_PER_PARAM * model_spec("llama-3.2-1b").params / 1e9
    by = {r["job_id"]: r for r in res.per_job}
    ran_new = by["new"]["end_s"] - by["new"]["first_start_s"]
    assert restore > 30 and by["long"]["end_s"] == pytest.approx(10_000 + 2 * 10.0 + restore + ran_new, abs=0.01)


def test_round_based_policy_acts_only_on_round_boundaries():
    from scheduler.policies.gavel import Gavel
    sim, res = run([job("a", 100.0, 10)], cluster({A100: (1, 8)}), Gavel(), [plan(A100, 1, 1.0, 10)],
                   startup_s=0.0)
    assert res.per_job[0]["first_start_s"] == pytest.approx(360.0)


class RoundLog(FifoUser):
    """fifo-user that records when it was asked for a round."""

    def __init__(self, grows_runs: bool):
        super().__init__()
        self.grows_runs = grows_runs
        self.rounds: list[float] = []

    def schedule(self, pending, state, now):
        self.rounds.append(now)
        return super().schedule(pending, state, now)


def test_a_policy_that_grows_runs_gets_ticks_while_gpus_sit_idle():
    # one job on 1 of 8 GPUs for 1,000 s, nothing waiting: only its arrival and end make rounds,
    # unless the policy re-sizes runs onto idle GPUs (then a tick every tick_s while it runs)
    for grows, want in ((False, [0.0, 1000.0]), (True, [0.0, 300.0, 600.0, 900.0, 1000.0])):
        pol = RoundLog(grows)
        run([job("a", 0.0, 1000)], cluster({A100: (1, 8)}), pol, [plan(A100, 1, 1.0, 10)],
            startup_s=0.0, tick_s=300.0)
        assert pol.rounds == want


def test_a_round_based_world_sees_arrivals_and_frees_gpus_only_at_round_boundaries():
    # one GPU; a runs 100 s, b 50 s. Event world: a 10-110, b 110-160. Round world (60 s): a is
    # seen at 60 and ends its last step at 160 (its JCT), but frees the GPU only at 180
    jobs = [job("a", 10.0, 100), job("b", 20.0, 50)]
    for world, a_start, b_start in ((None, 10.0, 110.0), (60.0, 60.0, 180.0)):
        _, res = run(jobs, cluster({A100: (1, 1)}), FifoUser(), [plan(A100, 1, 1.0, 10)], startup_s=0.0,
                     world_round_s=world)
        by = {r["job_id"]: r for r in res.per_job}
        assert by["a"]["first_start_s"] == pytest.approx(a_start)
        assert by["a"]["end_s"] == pytest.approx(a_start + 100)
        assert by["b"]["first_start_s"] == pytest.approx(b_start)


def test_gpu_utilisation_counts_gpus_held_to_the_round_after_the_last_step():
    """A round-based world holds a run's GPUs to the round after its last step, past the
    makespan (the last step): utilisation over the makespan went above 1 (1.14 on a day-long
    round)."""
    for world in (None, 60.0, 3600.0):
        _, res = run([job("a", 0.0, 100)], cluster({A100: (1, 1)}), FifoUser(), [plan(A100, 1, 1.0, 10)],
                     startup_s=0.0, world_round_s=world)
        assert 0 < res.gpu_util <= 1.0, world
    assert res.gpu_util == pytest.approx(1.0)       # held from 0 to the round at 3,600 s (36 before)
    assert res.makespan_s == pytest.approx(100.0)   # the makespan still ends at the last step


def test_the_plan_book_holds_only_plans_the_trainer_can_launch_within_the_nodes_host_memory():
    """Llama-2-70B on one node of 4 x RTX 3090 (192 GiB of host memory): only an optimizer +
    parameter offload plan fits the GPUs, and it needs ~1.7 TB of host memory; every policy
    'completed' it in 25-30 h. Plans the trainer cannot launch were run too."""
    from scheduler.sim.jobs import PlanBook
    from trainer.fallback import realisable

    inv, gpn = {R3090: 4}, {R3090: 4}
    assert PlanBook(inv, gpn).plans("llama-2-70b", 2048, 32)               # host memory unchecked
    assert PlanBook(inv, gpn, host_ram_gib={R3090: 192.0}).plans("llama-2-70b", 2048, 32) == []
    assert PlanBook(inv, gpn, host_ram_gib={R3090: 4096.0}).plans("llama-2-70b", 2048, 32)
    book = PlanBook({A100: 16}, {A100: 8})
    assert all(realisable(p) for p in book.plans("llama-2-7b", 2048, 64))


def test_idle_gpu_hours_while_a_job_that_could_use_them_waits_are_counted():
    # FIFO without backfill: from t=1 the 2-GPU head waits, one GPU free, and the head's own
    # 1-GPU plan could have used it; once the head starts, nothing is free
    clu = cluster({A100: (1, 2)})
    plans = [plan(A100, 1, 1.0, 10), plan(A100, 2, 0.6, 8)]
    jobs = [job("big-running", 0, 1000, gpus=1), job("head", 1, 100, gpus=2), job("small", 2, 10, gpus=1)]
    _, res = run(jobs, clu, FifoUser(), plans, startup_s=0.0)
    assert res.idle_waiting_gpu_h == pytest.approx({A100: 999.0 / 3600})
    # a job that needs more GPUs than are free could not have used them: nothing counted
    _, res = run(jobs, clu, FifoUser(), [plan(A100, 2, 0.6, 8)], startup_s=0.0)
    assert res.idle_waiting_gpu_h == {}


def test_measured_step_ratio_and_restart_cost_replace_the_models():
    """What a live cluster measured (``bench/live_replay.py``): the step ratio scales the truth
    per (GPU type, GPU count), not what the policy predicts; ``restart_s`` replaces start-up
    plus checkpoint move for a start that resumes."""
    clu = cluster({A100: (1, 1)})
    jobs = [job("long", 0, 10_000, model="llama-3.2-1b"), job("new", 5_000, 100, model="llama-3.2-1b")]
    sim, res = run(jobs, clu, Tiresias(), [plan(A100, 1, 1.0, 10)], startup_s=10.0, tick_s=60.0,
                   ckpt_gbs_per_node=1.0, step_ratio={(A100, 1): 0.5, (A100, 2): 9.0}, restart_s=3.0)
    long = sim.by_id["long"]
    by = {r["job_id"]: r for r in res.per_job}
    assert long.preemptions == 1 and long.starts == 2 and by["long"]["starts"] == 2
    ran_new = by["new"]["end_s"] - by["new"]["first_start_s"]
    assert ran_new == pytest.approx(10.0 + 100 * 0.5)
    # 10,000 steps at half the table's step time, one start-up and one measured restart
    assert by["long"]["end_s"] == pytest.approx(10_000 * 0.5 + 10.0 + 3.0 + ran_new, abs=0.01)


@pytest.mark.parametrize("kw,field", [({"noise": float("nan")}, "noise"), ({"tick_s": 0.0}, "tick_s"),
                                      ({"startup_s": 1e12}, "startup_s"), ({"world_round_s": float("inf")}, "world_round_s"),
                                      ({"idle_rounds_limit": 0}, "idle_rounds_limit")])
def test_sim_config_refuses_numbers_that_would_never_end(kw, field):
    """Python callers get the checks `frenzy simulate` has (NaN or 10^12 s spun the event loop)."""
    from estimator.errors import FrenzyInputError
    with pytest.raises(FrenzyInputError) as e:
        SimConfig(**kw)
    assert e.value.field == field


def test_a_measured_step_ratio_that_is_not_a_positive_number_is_refused():
    """A NaN ratio stalled the event loop; a negative one trained in negative time."""
    from estimator.errors import FrenzyInputError
    for bad in (float("nan"), -1.0, 0.0):
        with pytest.raises(FrenzyInputError, match="step_ratio"):
            SimConfig(step_ratio={("H100-80GB", 1): bad})
