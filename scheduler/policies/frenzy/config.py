"""``frenzy``'s configuration: one documented dataclass per concern (torchtitan style).

    from scheduler.policies.frenzy import FrenzyConfig, FrenzyPolicy
    cfg = FrenzyConfig()                                  # the defaults every benchmark uses
    cfg = FrenzyConfig().with_overrides(grow=False, aging_s=600)   # flat names, as get_policy takes
    FrenzyPolicy(cfg)

Every constant carries its physical or measured reason beside it (docs/benchmarks.md has the
ablations). The flat names (``FLAT``) are the keyword arguments ``FrenzyPolicy`` took before
it was a package; ``get_policy("frenzy", **flat)`` keeps accepting them.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from estimator.errors import FrenzyInputError


@dataclass(frozen=True, slots=True)
class MemoryGate:
    """Which plans a job may run: step 1 (``gate.memory_gate``)."""

    safety_margin_gib: float = 0.5   # CUDA context jitter, allocator slack beyond the prediction
    headroom: float = 0.35           # predicted x 1.35 must fit: covers a +3 sigma estimator error at
                                     # 10% lognormal error; Fujii et al. 2024 saw no OOM below 80% use
    fallback_slack: float = 0.05     # without safe plans: those within 5% of the job's roomiest one


@dataclass(frozen=True, slots=True)
class Ordering:
    """Queue order: step 2 (``order.order_queue``)."""

    aging_s: float = 4 * 3600.0      # a job waiting this long has its work key halved


@dataclass(frozen=True, slots=True)
class Choice:
    """Plan choice: step 3 (``choose.choose``), including the lightly loaded cluster."""

    tolerance: float = 0.10          # plans within 10% of the earliest completion count as equally fast
    wait_inflation: float = 4.0      # step 3a (``choose.wait_weight``): a job that can finish within
    short_s: float = 1800.0          # ``short_s`` on GPUs free now counts a predicted wait 1 + this
                                     # times: realised waits ran 1.3-1.9x the predicted ones, and a
                                     # short run started now frees its GPUs before the next burst.
                                     # Chosen on training seeds 0-1 (docs/benchmarks.md, ablation): 1 and
                                     # 4 within a point of each other, never waiting (1000) no better,
                                     # short_s 3600 as 1800; ungated, itp01 went -18% -> +34% vs Sia.
                                     # 0 turns the step off
    count_launch: bool = False       # (measured, off) a plan's duration includes the start-up it pays
                                     # (RestartCost.launch_s): Sia-like cluster07 and the small
                                     # blocks within a point, seeds 0-1 (docs/benchmarks.md)
    min_efficiency: float = 0.9      # a bigger GPU count must keep >= 90% parallel efficiency vs the
                                     # fewest GPUs of that type (wasting more never pays in a queue)
    simpler_within: float = 0.01     # per GPU count, a simpler plan within 1% of the fastest is preferred
                                     # (a 0.2% predicted edge is noise in the throughput model)
    idle_factor: float = 2.0         # waiting jobs' fewest GPUs x this <= free GPUs: "lightly loaded"
    idle_min_efficiency: float = 0.7  # ... then jobs take their fastest plan down to 70% efficiency
    idle_share: float = 0.5          # ... on at most one node or this share of a type's free GPUs
                                     # beyond their 90% plan (a burst's next arrivals still find some)


@dataclass(frozen=True, slots=True)
class Stopgap:
    """Work-conserving starts (step 3b, ``choose.start_now``) and their later move (``move_up``).

    ``enabled``: after the queue pass, a waiter starts now on the fastest plan that fits the GPUs
    left free (delaying no reservation), when the head start repays the restart of moving onto
    its own plan later (``choose.stopgap_pays``) and the stopgap run ends within
    ``end_within_wait`` x the predicted wait (``choose.stopgap_ends_in_time``). ``move_up``: a
    run that started as a stopgap (``RunningJob.reason``) competes in the queue pass, in SRPT
    order, for its faster plan when that starts now.

    Measured (``bench/policy_sweep.py``, every ``bench/jct.py`` block, truth seeds 0-3, event and
    60 s round worlds, 72 rows against the faithful Sia; docs/benchmarks.md, "stopgaps that end
    in time"): without stopgaps frenzy was behind on 13 rows (geometric mean -10.94%) and left
    up to 3,600 GPU-hours idle while jobs that could use them waited; stopgaps with every slow
    run moving up (the earlier ``move_up``): behind on 12, cluster02 +9-13% (111 move-up
    restarts of runs frenzy had put on slower types by choice); moving up only stopgaps, no end
    bound: behind on 11, -11.79%, but itp01 on the small cluster at seed 1 +21% against the
    default (13-B models' stopgaps held the RTX 3090s for days when a burst of small jobs came);
    with the end bound: behind on 8, -12.65%."""

    enabled: bool = True
    move_up: bool = True              # a run started as a stopgap moves to its faster plan when that
                                     # starts now and its remaining time, restart included, drops by the
                                     # growth gain: Sia's re-allocation, without its churn
    move_up_any: bool = False         # (measured, off) every run on a plan slower than its fastest queue
                                     # plan moves up, not only stopgaps: cluster02's round world +9-13%
    end_within_wait: float = 5.0      # a stopgap run must end within this x the predicted wait for the
                                     # job's own plan: (1 + Choice.wait_inflation), the measured ratio of
                                     # realised to predicted waits (p90 3.2-5.0, docs/benchmarks.md,
                                     # "itp05 / large-4type in the round world, diagnosed"). Longer
                                     # stopgaps hold slow GPUs through the next burst (unbounded: itp01 /
                                     # small seed 1 +21%); 0: no bound. Tried 2, 3, 5, 10: behind on 13,
                                     # 12, 8, 10 of 72 rows
    reserve: bool = False             # (measured, off) a mover whose faster plan starts later keeps a
                                     # reservation there (one of Backfill.max_reservations), when the
                                     # move, restart included and the steps it makes meanwhile counted,
                                     # is predicted to finish it by the growth gain sooner. With every
                                     # slow run moving up: cluster02's round world +11-14%; with stopgaps
                                     # only and no end bound: behind on 11 of 72, -11.85%
    yield_first: bool = False         # (measured, off) step 6 may preempt a mover (a run slower than
                                     # its fastest queue plan) for a head job with less work than the
                                     # mover has left (ratio 1, plain SRPT, not Preemption.ratio's 4),
                                     # movers first. Identical results where measured (no head preempted
                                     # a mover); with stopgaps only, no end bound: -11.24%, worse


@dataclass(frozen=True, slots=True)
class Backfill:
    """Reservations and the availability profile: steps 4-5 (``profile.Profile``)."""

    max_reservations: int = 8        # head-of-line jobs that hold a reservation per round
    lookahead: int = 128             # jobs whose waiting choice is tracked (as queued load per type);
                                     # deeper jobs are only tried for an immediate start
    overdue_min_s: float = 300.0     # a run past its predicted end is expected to need at least
    overdue_fraction: float = 0.2    # max(5 min, 20% of its predicted run time) more


@dataclass(frozen=True, slots=True)
class Preemption:
    """Whole-run preemption for a head-of-queue job: step 6 (``preempt.preempt_for``)."""

    enabled: bool = True
    min_wait_s: float = 60.0         # only for a head job that would otherwise wait longer than a
                                     # restart's launch (RestartCost.launch_s); at 5 min a burst of
                                     # short jobs queued behind one long run on the fast type (Sia-like
                                     # cluster07, round world: +24% -> +2% vs Sia with step 3a, seed 0)
    ratio: float = 4.0               # ... for GPUs held by runs with > 4x its (duration + min_wait_s) left
    grace_s: float = 300.0           # never a run in its first 5 min (restart costs, thrashing)
    max_per_job: int = 2             # (JobRequest.preemptions)
    heads: int | None = None         # queued jobs (in queue order) that may preempt or shrink, per round;
                                     # None: every job the round tracks (Backfill.lookahead). Each action
                                     # passes its own test (ratio, Shrink.gain); the earlier cap of 4 had
                                     # no reason behind it and left a burst's 5th and later arrivals of a
                                     # round waiting behind wide runs. Every bench block, seeds 0-3, both
                                     # worlds: losses to Sia 9 -> 7 of 72, worst +9.3% -> +8.1%, policy
                                     # time per round unchanged (docs/benchmarks.md, "every waiter may
                                     # preempt or shrink")
    yields: bool = True              # step 6b (``preempt.yield_for``): after the queue pass, a run that
                                     # would finish no later from another type's queue (its wait there
                                     # counted as step 3a counts waits) gives its GPUs to a waiter
                                     # (grace and max_per_job as above). Training seeds 0-1, vs Sia:
                                     # itp01 small +2.2% -> -15.9%, -25.8% -> -34.2%; Sia-like unchanged
                                     # (docs/benchmarks.md, "idle GPUs while jobs wait, measured")


@dataclass(frozen=True, slots=True)
class Shrink:
    """Shrinking one run for a head-of-queue job: step 6 (``preempt.shrink_for``)."""

    enabled: bool = True
    min_wait_s: float = 60.0         # for a head job that would wait > a launch (as Preemption) ...
    grace_s: float = 300.0           # ... never a run in its first 5 min ...
    gain: float = 1.5                # ... and only when the waiter gains 1.5x what the run loses


@dataclass(frozen=True, slots=True)
class Growth:
    """Re-sizing runs onto idle GPUs: step 7 (``grow.grow_runs``)."""

    enabled: bool = True
    min_gain: float = 0.1            # restart a run on a faster plan only if its remaining time drops
    min_s: float = 120.0             # by >= 10% and >= 2 min
    min_efficiency: float = 0.4      # onto plans down to 40% parallel efficiency: idle GPUs are free,
                                     # and a run that grew wide shrinks back for waiters (recall)
    long_s: float = 1800.0           # runs with >= 30 min left down to 25%: their restarts (growing,
    long_min_efficiency: float = 0.25  # recalled, growing back) are small against what width saves
    max_resizes_per_job: int = 16    # growths and shrinks together (RunningJob.resizes); each must pay
                                     # for its restart, this only stops pathologies
    max_per_round: int = 8
    while_waiting: bool = False      # (measured, off: see Stopgap) while jobs wait, a run may still move to a faster plan of its
                                     # queue menu (>= 90% efficiency) on GPUs free after the round,
                                     # delaying no reservation (a stopgap start moving up)


@dataclass(frozen=True, slots=True)
class Recall:
    """Waiters taking back GPUs lent to runs beyond their 90% plan: step 8 (``recall.recall``)."""

    enabled: bool = True
    min_wait_s: float = 60.0         # a waiter recalls only when it would wait > 1 min ...
    min_left_s: float = 900.0        # ... from runs with >= 15 min left or that outlast the waiter's
                                     # predicted wait (others free theirs in time for it). With the
                                     # 15 min floor alone most GPUs lent in a burst were out of reach
                                     # (itp05 / large-4type, round world: ~250 of ~350 in runs with less
                                     # left); every bench block, seeds 0-3, both worlds, vs Sia: behind on
                                     # 8 -> 7 of 72, geometric mean training seeds -14.19% -> -14.37%,
                                     # held-out -13.25% -> -13.37%; worse by > 0.5% on 6 rows, at most
                                     # +4.7% (itp05 large, event world, held-out seed 2, ahead of Sia);
                                     # no floor at all: 11 behind (docs/benchmarks.md, "A minute per
                                     # policy variant")


@dataclass(frozen=True, slots=True)
class RestartCost:
    """What the policy predicts a checkpoint restart costs (``scheduler.restart``, the formula the
    simulator charges)."""

    launch_s: float = 60.0           # launch + model build of a (re)start
    ckpt_gbs: float = 2.0            # checkpoint write / read bandwidth per node spanned (GB/s)


@dataclass(frozen=True, slots=True)
class FrenzyConfig:
    memory: MemoryGate = field(default_factory=MemoryGate)
    order: Ordering = field(default_factory=Ordering)
    choice: Choice = field(default_factory=Choice)
    stopgap: Stopgap = field(default_factory=Stopgap)
    backfill: Backfill = field(default_factory=Backfill)
    preempt: Preemption = field(default_factory=Preemption)
    shrink: Shrink = field(default_factory=Shrink)
    growth: Growth = field(default_factory=Growth)
    recall: Recall = field(default_factory=Recall)
    restart: RestartCost = field(default_factory=RestartCost)

    def with_overrides(self, **flat) -> "FrenzyConfig":
        """A copy with flat overrides (``FLAT`` names, e.g. ``grow=False, aging_s=600``)."""
        groups: dict[str, dict] = {}
        for name, value in flat.items():
            where = FLAT.get(name)
            if where is None:
                raise FrenzyInputError("frenzy option", f"unknown option {name!r}; known: {', '.join(sorted(FLAT))}")
            groups.setdefault(where[0], {})[where[1]] = _checked(name, value, getattr(getattr(self, where[0]), where[1]))
        return replace(self, **{g: replace(getattr(self, g), **kw) for g, kw in groups.items()})


# options that divide by their value: zero is not a setting
_POSITIVE = {"aging_s", "ckpt_gbs", "lookahead"}


def _checked(name: str, value, default):
    """An option's value of its default's kind: a bool for a switch, a whole number >= 0 for a
    count, a finite number >= 0 for a time, factor or fraction (``aging_s="x"`` constructed and
    failed deep in a round; -1, NaN or 1.5 reservations were taken as they came)."""
    from estimator.errors import check_number

    field = f"frenzy option {name}"
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise FrenzyInputError(field, f"must be true or false, got {value!r}")
        return value
    if value is None and name == "preempt_heads":    # None: every job the round tracks
        return None
    integer = isinstance(default, int) or name == "preempt_heads"
    return check_number(field, value, low_open=name in _POSITIVE, integer=integer)


def _flat_names() -> dict[str, tuple[str, str]]:
    """Flat option name -> (group, field): the group's prefix joined to the field, with the
    historic names of the switches and of a few fields."""
    prefix = {"memory": "", "order": "", "choice": "", "stopgap": "stopgap_", "backfill": "", "preempt": "preempt_",
              "shrink": "shrink_", "growth": "grow_", "recall": "recall_", "restart": ""}
    special = {("memory", "headroom"): "mem_headroom", ("preempt", "enabled"): "preemption",
               ("preempt", "max_per_job"): "max_preemptions_per_job", ("shrink", "enabled"): "shrink",
               ("growth", "enabled"): "grow", ("growth", "max_resizes_per_job"): "max_grows_per_job",
               ("recall", "enabled"): "recall", ("stopgap", "enabled"): "stopgap", ("restart", "launch_s"): "restart_s",
               ("memory", "fallback_slack"): "fallback_slack"}
    out = {}
    for g in fields(FrenzyConfig):
        for f in fields(g.default_factory):
            out[special.get((g.name, f.name), prefix[g.name] + f.name)] = (g.name, f.name)
    return out


FLAT: dict[str, tuple[str, str]] = _flat_names()
