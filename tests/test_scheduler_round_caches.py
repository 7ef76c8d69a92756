"""What ``frenzy`` keeps between calls within a round to go faster changes no answer: each
cache gives what computing afresh gives, and is dropped when what it was computed from moves."""
import random

import pytest

from estimator.plan import Plan
from scheduler.cluster import parse_cluster
from scheduler.policies.frenzy import FrenzyPolicy
from scheduler.policies.frenzy.choose import DeepBound, choose, wait_weight
from scheduler.policies.frenzy.config import Choice
from scheduler.policies.frenzy.profile import Profile
from scheduler.policies.frenzy.records import Cand, Menu
from scheduler.types import JobRequest, RunningJob

NOW = 1_700_000_000.0            # a wall-clock epoch, as the live scheduler's rounds have


def random_profile(rng: random.Random, total: int) -> tuple[Profile, int]:
    """A profile with releases, reservations and sometimes queued backlog, and the GPUs free now."""
    p = Profile()
    p.total = total
    free = rng.randint(0, total)
    for _ in range(rng.randint(0, 6)):
        p.add_release(NOW + rng.choice([rng.uniform(1, 5000), 100.0]), rng.randint(1, 4))
    for _ in range(rng.randint(0, 4)):
        s = NOW + rng.choice([0.0, rng.uniform(0, 3000)])
        p.reserve(s, s + rng.uniform(10, 4000), rng.randint(1, total))
    p.busy_gs = sum(n * (t - NOW) for t, n in zip(p.times, p.counts))
    if rng.random() < 0.3:
        p.backlog = rng.uniform(0, 50_000)
    return p, free


def test_profile_horizon_is_where_fits_now_stops():
    rng = random.Random(7)
    for _ in range(400):
        p, free = random_profile(rng, 16)
        for n in range(1, 17):
            h = p.horizon(n, NOW, free)
            ends = [rng.uniform(0, 6000) for _ in range(8)]
            if NOW < h < float("inf"):
                ends += [h - NOW, (h - NOW) * (1 + 1e-12), (h - NOW) * (1 - 1e-12)]   # at the boundary
            for dur in ends:
                assert p.fits_now(n, dur, NOW, free) == (NOW + dur <= h), (n, free, dur, h)


def random_menu(rng: random.Random, types: list[str]) -> Menu:
    cands = []
    for g in rng.sample(types, rng.randint(1, len(types))):
        step = rng.uniform(0.2, 4.0)
        for n in sorted(rng.sample([1, 2, 4, 8, 16], rng.randint(1, 3))):
            cands.append(Cand(step * (0.95 ** n), n, g, Plan(gpu_type=g, gpus=n, dp=n, step_time_s=step)))
    cands.sort(key=lambda c: (c.step_s, c.gpus))
    fewest: dict[str, int] = {}
    for c in cands:
        fewest[c.gpu_type] = min(fewest.get(c.gpu_type, c.gpus), c.gpus)
    return Menu(queue=cands, wide=cands, grow=cands, fewest=list(fewest.items()), least=min(fewest.values()), top={}, work=1.0,
                footprint_gib=1.0)


def test_deep_bound_says_exactly_when_choose_gives_a_deep_job_nothing():
    rng = random.Random(11)
    types = ["a", "b", "c"]
    nothing = something = 0
    for _ in range(300):
        profiles, free = {}, {}
        for g in types:
            profiles[g], free[g] = random_profile(rng, 16)
        launch = rng.choice([0.0, 60.0])
        cfg = Choice()
        bound = DeepBound(profiles, free, NOW, cfg, launch)
        for _ in range(5):
            menu = random_menu(rng, types)
            for steps in (1, rng.randint(2, 50), rng.randint(50, 5000)):
                w = wait_weight(menu.queue, steps, free, cfg)
                pick = choose(menu.queue, steps, profiles, free, NOW, cfg, True, False, w, launch)
                assert bound.gives_nothing(menu, steps) == (pick is None)
                nothing += pick is None
                something += pick is not None
    assert nothing > 100 and something > 100      # both ways exercised
    # at the boundary: a run that ends exactly when a reservation needs its GPUs starts now
    prof = Profile()
    prof.total = 8
    prof.reserve(NOW + 1000, NOW + 2000, 8)
    menu = one_plan_menu(cand("a", 8, 1.0))
    for steps, starts in ((1000, True), (1001, False)):
        assert (choose(menu.queue, steps, {"a": prof}, {"a": 8}, NOW, Choice(), True) is not None) == starts
        assert DeepBound({"a": prof}, {"a": 8}, NOW, Choice()).gives_nothing(menu, steps) == (not starts)


def one_plan_menu(*cands: Cand) -> Menu:
    menu = random_menu(random.Random(0), ["a"])
    menu.queue[:] = list(cands)
    fewest: dict[str, int] = {}
    for c in cands:
        fewest[c.gpu_type] = min(fewest.get(c.gpu_type, c.gpus), c.gpus)
    menu.fewest[:] = list(fewest.items())
    return menu


def cand(g: str, gpus: int, step_s: float) -> Cand:
    return Cand(step_s, gpus, g, Plan(gpu_type=g, gpus=gpus, dp=gpus, step_time_s=step_s))


def test_deep_bound_is_recomputed_when_a_profile_or_the_free_gpus_change():
    """A stale answer would rule out a job that can now start (or keep one that no longer can)."""
    prof = Profile()
    prof.total = 8
    prof.reserve(NOW + 100, NOW + 5000, 8)        # every GPU reserved from +100 s
    free = {"a": 8}
    menu = one_plan_menu(cand("a", 4, 1.0))
    bound = DeepBound({"a": prof}, free, NOW, Choice())
    assert bound.gives_nothing(menu, 1000)        # 1,000 s would run into the reservation
    assert not bound.gives_nothing(menu, 50)
    prof.add_release(NOW + 50, 8)                 # 8 more GPUs from +50 s: the reservation no longer needs these
    assert not bound.gives_nothing(menu, 1000)
    assert choose(menu.queue, 1000, {"a": prof}, free, NOW, Choice(), True) is not None
    free["a"] = 2                                 # the GPUs were taken meanwhile
    assert bound.gives_nothing(menu, 50)
    assert choose(menu.queue, 50, {"a": prof}, free, NOW, Choice(), True) is None


def test_deep_bound_stays_exact_while_one_type_at_a_time_changes():
    """The bound keeps each menu's per-type answers and recomputes only the types that changed:
    a long random sequence of changes to one type (a release, a reservation, GPUs taken or
    freed, queued backlog) between questions about menus over several types, each answer
    checked against ``choose`` itself."""
    rng = random.Random(11)
    types = ["a", "b", "c"]
    profiles, free = {}, {}
    for g in types:
        profiles[g], free[g] = random_profile(rng, 16)
    cfg = Choice()
    bound = DeepBound(profiles, free, NOW, cfg)
    menus = [random_menu(rng, types) for _ in range(6)]
    nothing = something = 0
    for _ in range(1500):
        g = rng.choice(types)
        change = rng.randrange(5)
        if change == 0:
            profiles[g].add_release(NOW + rng.uniform(1, 5000), rng.randint(1, 4))
        elif change == 1:
            t = NOW + rng.uniform(0, 3000)
            profiles[g].reserve(t, t + rng.uniform(10, 4000), rng.randint(1, 16))
        elif change == 2:
            free[g] = rng.randint(0, 16)
        elif change == 3:
            profiles[g].backlog += rng.uniform(0, 5000)
        for _ in range(3):
            menu = rng.choice(menus)
            steps = rng.choice([1, rng.randint(2, 50), rng.randint(50, 5000)])
            w = wait_weight(menu.queue, steps, free, cfg)
            pick = choose(menu.queue, steps, profiles, free, NOW, cfg, True, False, w)
            assert bound.gives_nothing(menu, steps) == (pick is None)
            nothing += pick is None
            something += pick is not None
    assert nothing > 100 and something > 100      # both ways exercised


def test_deep_bound_is_recomputed_when_a_types_queued_backlog_grows():
    """The fast type frees in 100 s: waiting for it beats the slow type's free GPUs, so a deep job
    gets nothing. Once jobs ahead queue 16,000 GPU-seconds for the fast type, its wait is ~2,100 s
    and starting now on the slow type comes within tolerance: the job gets a plan."""
    fast, slow = Profile(), Profile()
    fast.total = slow.total = 8
    fast.add_release(NOW + 100, 8)
    fast.busy_gs = 8 * 100.0
    profiles, free = {"a": fast, "b": slow}, {"a": 0, "b": 8}
    menu = one_plan_menu(cand("a", 8, 1.0), cand("b", 8, 2.0))
    bound = DeepBound(profiles, free, NOW, Choice())
    assert bound.gives_nothing(menu, 1000)
    assert choose(menu.queue, 1000, profiles, free, NOW, Choice(), True) is None
    fast.backlog = 16_000.0
    assert choose(menu.queue, 1000, profiles, free, NOW, Choice(), True).cand.gpu_type == "b"
    assert not bound.gives_nothing(menu, 1000)


CLUSTER = """
pools:
  - {name: fast, gpu: A100-80GB, nodes: 2, gpus_per_node: 8}
  - {name: slow, gpu: RTX3090-24GB, nodes: 2, gpus_per_node: 8}
"""


def a100_job(jid: str, gpus: int, steps: int, submit: float) -> JobRequest:
    """A job only the A100s hold (30 GiB: too big for 24 GB cards)."""
    p = Plan(gpu_type="A100-80GB", gpus=gpus, dp=gpus, device_used_gib=30.0, step_time_s=1.0)
    return JobRequest(job_id=jid, submit_s=submit, plans=[p], steps_left=steps)


def blocked_round():
    """The A100s: node 0 busy until +1,000 s, 4 GPUs of node 1 until +3,000 s, 4 free. The head
    job needs all 16 and reserves them from +3,000 s (the only reservation). Behind it, old long
    4-GPU jobs (aged ahead of the short ones) would run past +3,000 s: they cannot start now,
    which the shortcut knows without trying their plans; short 2-GPU jobs backfill the 4 GPUs."""
    st = parse_cluster(CLUSTER).initial_state()
    busy = {"fast-0": list(range(8)), "fast-1": [0, 1, 2, 3]}
    ends = {"fast-0": NOW + 1000, "fast-1": NOW + 3000}
    for n in st.nodes:
        if n.node_id in busy:
            n.free = [d for d in n.free if d not in busy[n.node_id]]
            k = len(busy[n.node_id])
            st.running.append(RunningJob(job_id=f"run-{n.node_id}", plan=Plan(gpu_type=n.gpu_type, gpus=k, dp=k),
                                         placement={n.node_id: busy[n.node_id]}, start_s=NOW - 600,
                                         expected_end_s=ends[n.node_id]))
    pending = [a100_job("head", 16, 100, NOW)]
    pending += [a100_job(f"long{i}", 4, 5000, NOW - 40 * 3600) for i in range(5)]
    pending += [a100_job(f"short{i}", 2, 1000, NOW) for i in range(3)]
    return pending, st


def answers(pol, pending, st):
    ds = pol.schedule(pending, st, NOW)
    return ([(d.job_id, d.action, d.plan, d.placement, d.reason) for d in ds],
            sorted((w.job_id, w.predicted_start_s, w.gpu_type, w.gpus, w.reason) for w in pol.waits().values()))


def no_shortcut(m):
    m.setattr(DeepBound, "gives_nothing", lambda self, menu, steps: False)


def test_deep_jobs_that_cannot_start_now_are_ruled_out_and_short_ones_still_backfill(monkeypatch):
    ruled = []
    gives_nothing = DeepBound.gives_nothing
    monkeypatch.setattr(DeepBound, "gives_nothing",
                        lambda self, menu, steps: gives_nothing(self, menu, steps) and not ruled.append(steps))
    pending, st = blocked_round()
    starts, waits = answers(FrenzyPolicy(lookahead=1, max_reservations=1, preemption=False, shrink=False), pending, st)
    assert [(j, p.gpus) for j, _, p, _, _ in starts] == [("short0", 2), ("short1", 2)]
    why = {w[0]: w[4] for w in waits}
    assert why["head"].startswith("reserved for 16xA100-80GB")
    assert all(why[f"long{i}"].startswith("no free GPUs") for i in range(5))
    assert ruled.count(5000) == 5                  # every long job was ruled out without choose
    with monkeypatch.context() as m:
        no_shortcut(m)
        assert answers(FrenzyPolicy(lookahead=1, max_reservations=1, preemption=False, shrink=False), pending, st) == (starts, waits)


def busy_cluster(rng: random.Random):
    st = parse_cluster(CLUSTER).initial_state()
    for n in st.nodes:
        k = rng.randint(0, n.gpus)
        taken = sorted(rng.sample(range(n.gpus), k))
        n.free = [d for d in n.free if d not in taken]
        if taken:
            p = Plan(gpu_type=n.gpu_type, gpus=k, dp=k, step_time_s=1.0)
            st.running.append(RunningJob(job_id=f"run-{n.node_id}", plan=p, placement={n.node_id: taken},
                                         start_s=NOW - 600, expected_end_s=NOW + rng.uniform(60, 20_000)))
    return st


def queue(rng: random.Random, k: int) -> list[JobRequest]:
    """Jobs that need all 16 GPUs of a type (their reservations hold the GPUs free now), and
    jobs on a few GPUs of either type; submitted over 40 h (aging mixes the order), 20 to
    20,000 steps."""
    jobs = []
    for i in range(k):
        kind = rng.choice(["A100-80GB", "RTX3090-24GB", "any", "any"])
        base = rng.uniform(0.3, 3.0)
        types = [(g, f) for g, f in (("A100-80GB", 1.0), ("RTX3090-24GB", 2.2)) if kind in (g, "any")]
        counts = (16,) if kind != "any" else (1, 2, 4, 8)
        plans = [Plan(gpu_type=g, gpus=n, dp=n, device_used_gib=10.0, step_time_s=base * f / n ** 0.9)
                 for g, f in types for n in counts]
        jobs.append(JobRequest(job_id=f"j{i}", submit_s=NOW - rng.uniform(0, 40 * 3600), plans=plans,
                               steps_left=int(10 ** rng.uniform(1.3, 4.3))))
    return jobs


def test_the_deep_queue_shortcut_changes_no_decision_on_random_rounds(monkeypatch):
    """Small lookahead, a reservation per type or two, so much of the queue is deep: every
    round's decisions and wait answers are those of the policy that tries every deep job."""
    fired = []
    gives_nothing = DeepBound.gives_nothing
    for seed in range(20):
        rng = random.Random(seed)
        st, pending = busy_cluster(rng), queue(rng, 60)
        for lookahead, reservations in ((2, 2), (4, 4)):
            with monkeypatch.context() as m:
                m.setattr(DeepBound, "gives_nothing",
                          lambda self, menu, steps: fired.append(gives_nothing(self, menu, steps)) or fired[-1])
                fast = answers(FrenzyPolicy(lookahead=lookahead, max_reservations=reservations), pending, st)
            with monkeypatch.context() as m:
                no_shortcut(m)
                assert answers(FrenzyPolicy(lookahead=lookahead, max_reservations=reservations), pending, st) == fast
    assert sum(fired) >= 5                        # the shortcut did rule jobs out
