"""``frenzy``: our heterogeneity-aware assignment. One pass over the pending jobs per round, no
solver; per job O(plans x log running jobs). Each step is a function of its own module, with
its configuration in one dataclass of ``config.FrenzyConfig``:

1. Memory gate (``gate.memory_gate``, ``MemoryGate``). A plan is *safe* when its predicted
   ``device_used_gib`` times (1 + headroom) plus a fixed margin fits the card; only when a job
   has no safe plan anywhere does it fall back to plans that fit with the margin alone (never
   to a plan that does not fit). ``gate.build_menu`` keeps, per GPU type, the plans a bigger
   count makes faster, under three parallel-efficiency floors (queue, idle start, growth).
2. Order (``choose.order_queue``, ``Ordering``). Shortest predicted remaining work first
   (GPU-seconds of the job's cheapest plan), divided by ``1 + wait / aging_s``.
3. Plan choice (``choose.choose``, ``Choice``). For every candidate (GPU type, count) the
   earliest start is read off an availability profile per GPU type (``profile.Profile``: the
   GPUs free now plus the running jobs' predicted ends, minus reservations). The job takes the
   plan with the earliest predicted completion; among plans within ``tolerance`` of it, the one
   using the fewest GPU-seconds. If that plan cannot start now, the job waits for it. Plans keep
   ``min_efficiency`` (90%) parallel efficiency; when the cluster is lightly loaded
   (``choose.lightly_loaded``) jobs take their fastest plan that starts now, down to
   ``idle_min_efficiency`` (70%), on at most one node or ``idle_share`` of a type's free GPUs
   beyond their 90% plan (``choose.idle_menu``).
   3a. Distrust of predicted waits (``choose.wait_weight``, ``Choice.wait_inflation`` and
   ``short_s``). A job that could finish within 30 min on GPUs free now counts a predicted
   wait 5x: predicted starts are optimistic (later, shorter jobs overtake), and GPUs a
   short run takes now are free again before the next burst. Longer jobs trust the wait.
   3b. Stopgaps (``policy._stopgaps``, ``Stopgap``). After the queue pass, a waiter starts now
   on GPUs nobody chose (delaying no reservation) when the head start repays moving onto its
   own plan later and the stopgap run ends within 5x the predicted wait (step 3a's factor);
   such a run (``RunningJob.reason == "stopgap"``) moves up to its faster plan, in SRPT order,
   once that plan starts now.
4. Backfill (``Backfill``). Jobs that must wait get a reservation (the first
   ``max_reservations``, in priority order); later jobs start now only where they delay no
   reservation: conservative backfilling over the profile.
5. Queued load. Beyond the reservations, a waiting job adds its GPU-seconds to its GPU type's
   queue, and later jobs see that type's wait grow: a burst spreads over the slower types.
6. Preemption and shrinking, sparingly (``preempt.preempt_for``, ``preempt.shrink_for``,
   ``Preemption``, ``Shrink``). A queued job (any the round tracks) that would wait over 1 min may
   checkpoint-preempt runs with over 4x its remaining work (never in their first 5 min, at
   most twice per job); failing that, shrink one run onto fewer GPUs of its type when the time
   it saves is 1.5x what that run loses. 6b, after the queue pass (``preempt.yield_for``,
   ``Preemption.yields``): a run that would finish no later from another GPU type's queue (its
   wait there counted as step 3a counts waits, a restart included) yields its GPUs to a waiter.
7. Elastic growth (``grow.grow_runs``, ``Growth``). When no job is left waiting, runs (longest
   remaining first) restart on a faster plan on the idle GPUs if their remaining time, restart
   and checkpoint restore included (``resize.restart_cost``, ``RestartCost``), drops by >= 10%
   and >= 2 min; down to 40% parallel efficiency, 25% for runs with >= 30 min left.
8. Recall (``recall.recall``, ``Recall``). Each waiting job (wait > 1 min) may take back GPUs
   lent to a run beyond that run's 90% plan, the run shrinking to a smaller plan of its menu,
   when the waiter's gain beats the run's loss (counted while the waiter runs, plus two
   restarts); runs that end before the waiter's predicted start and within 15 min keep theirs.
9. Placement. Fewest nodes, best fit (``FreeIndex.place_compact``); tensor-parallel groups
   inside one node.

Nothing is remembered about runs between rounds: a running job's plans, checkpoint size and
re-size count come from ``RunningJob.request`` and ``RunningJob.resizes``, its preemptions from
``JobRequest.preemptions``. ``waits()`` says why each waiting job waits (the live queue view).
"""
from .config import (Backfill, Choice, FrenzyConfig, Growth, MemoryGate, Ordering, Preemption, Recall,
                     RestartCost, Shrink)
from .policy import FrenzyPolicy

__all__ = ["Backfill", "Choice", "FrenzyConfig", "FrenzyPolicy", "Growth", "MemoryGate", "Ordering",
           "Preemption", "Recall", "RestartCost", "Shrink"]
