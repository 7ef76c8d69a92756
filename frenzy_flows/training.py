"""Run a job's training on an allocation, keeping the ledger in step: lease heartbeats while it
runs, a new allocation when an out-of-memory fallback needs other GPUs, the measurement next to
the prediction at the end, and every GPU released whatever happens.

Live re-sizing: while the training runs, a watcher thread beats the job's queue row every
``REQUEST_POLL_S`` (progress, liveness) and reads the request the scheduler left there. A
re-size or preemption is written into the run's control file (``trainer.control``): the
training stops at the next step boundary on every rank with a checkpoint; the GPUs are released;
a re-size takes its target GPUs and relaunches on the new plan (same global batch) in the same
run folder, so it resumes from that checkpoint; a preempted job goes back to the queue and
relaunches on the allocation the scheduler gives it next. Only where this process trains: a
target on another pool (a stopgap moving up to its faster GPU type), another node of the pool,
or several nodes is handed back to the submit flow (``TrainResult.handoff``), which launches it
on that pool's or node's workers, or as a gang.

Fencing: the same watcher checks, every period, that the run's GPU lease still holds (the
lease thread's verdict, and one indexed read of the allocation by the database's clock). A
lost lease (reaped after missed heartbeats, released by someone else, the database away for a
whole lease) means the GPUs may already be another job's: the watcher asks the training to
stop at the next step boundary (a checkpoint is kept), and the result is ``failed`` with the
reason, never ``completed``.

Called in-process by the submit flow's `train` task (embedded default) and by the
`train_on_pool` flow that pool workers run: one implementation for both."""
from __future__ import annotations

import contextlib
import math
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from estimator.plan import Plan

from frenzy_flows.results import Assignment, predicted_figures

# The watcher's period: a scheduler's request reaches the training within this plus one step.
REQUEST_POLL_S = 1.0
# How long a stopped run tries to take its re-size target: GPUs another job gives up in the
# same round free when that job's own stop lands (one step plus a checkpoint on the tiny model
# takes a few seconds; 60 s covers checkpoints of a few GB). Then it waits in the queue.
RESIZE_TAKE_S = 60.0
# How often a waiting submission looks at its queue row (a read): its start reaches it within
# this of the scheduler's round.
WAIT_POLL_S = 0.5
# How often a waiting submission beats its row (a write: 12 beats in the queue's 60 s alive
# window, ``ledger.queue.DEFAULT_ALIVE_S``). A beat every poll was a write transaction per waiting
# job every 0.5 s: 2,000 a second for 1,000 waiting jobs on one PostgreSQL
WAIT_BEAT_S = 5.0


def wait_for_allocation(queue, job_id: str, *, timeout_s: float, log: Callable[[str], None],
                        what: str | None = None) -> Assignment:
    """Wait until the scheduler placed ``job_id`` (its queue row turned ``running``), beating
    the row meanwhile; ``TimeoutError`` naming what it waited for (and the job given up, its
    allocation released if one came in the meantime)."""
    from ledger.queue import ENDED, Leadership

    end = time.monotonic() + timeout_s
    said = None
    beat_at = -math.inf
    while True:
        now = time.monotonic()
        if now - beat_at >= WAIT_BEAT_S:
            row, beat_at = queue.touch(job_id, plans=False), now
        else:
            row = queue.get(job_id, plans=False)
        if row is None:
            raise RuntimeError(f"job {job_id} is not in the scheduler's queue")
        if row.state == "running" and row.allocation_id:
            return Assignment.model_validate(row.allocation)
        if row.state in ENDED:
            raise RuntimeError(f"job {job_id} ended {row.state} while waiting for GPUs: {row.error or 'no reason given'}")
        if row.wait_reason and row.wait_reason != said:
            said = row.wait_reason
            log(f"waiting for GPUs: {said}")
        if time.monotonic() > end:
            lead = Leadership(queue.ledger, "observer", 1.0).current()
            who = (f"the scheduler {lead['holder']}" if lead and not lead["expired"]
                   else "a scheduler (none holds the leadership: start `frenzy scheduler`)")
            msg = (f"job {what or job_id} got no GPUs within {timeout_s:.0f} s: waited for {who} to place it; "
                   f"its last answer: {row.wait_reason or 'none'}")
            queue.finish(job_id, "failed", error=msg)
            late = queue.get(job_id)
            if late is not None and late.allocation_id:
                queue.ledger.release(late.allocation_id)
            raise TimeoutError(msg)
        time.sleep(WAIT_POLL_S)


class RequestWatcher:
    """Beats the job's queue row and forwards the scheduler's re-size / stop requests into the
    run's control file (module docstring). A run without a queue row (a `frenzy-train` run
    started by hand) is watched by nobody: the thread ends at once."""

    def __init__(self, queue, job_id: str, run_dir: Path, log: Callable[[str], None],
                 fence: Callable[[], str | None] | None = None):
        self.queue, self.job_id, self.run_dir, self.log = queue, job_id, run_dir, log
        self.step = 0
        self.forwarded: dict[str, dict[str, Any]] = {}
        # fence(): why the run's lease is lost, or None while it holds (module docstring)
        self.fence = fence
        self.fenced: dict[str, str] | None = None          # {"request_id", "reason"} once fenced
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"frenzy-watch-{job_id[:16]}", daemon=True)

    def __enter__(self) -> "RequestWatcher":
        try:       # the flow run the scheduler cancels if this run stops answering its requests
            from prefect.runtime import flow_run

            self.queue.attach_run(self.job_id, str(flow_run.id) if flow_run.id else None)
        except Exception as err:           # a database hiccup: the watcher still runs
            self.log(f"frenzy: could not record the flow run on the queue row: {err}")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=REQUEST_POLL_S * 5)

    def _run(self) -> None:
        # The thread must outlive any one failure: it is the run's heartbeat, its answer to the
        # scheduler and its lease fence. An error of one period (a database failover, a lock
        # timeout) is said and the next period tries again; it killed the thread, and with it
        # the fence of a run whose GPUs the ledger could then give to another job.
        watched = True                          # False: no queue row (a run started by hand)
        while not self._stop.wait(REQUEST_POLL_S):
            try:
                self._check_fence()
            except Exception as err:
                self.log(f"frenzy: lease check failed: {type(err).__name__}: {err}")
            if not watched:
                continue
            try:
                watched = self._beat()
            except Exception as err:
                self.log(f"frenzy: queue heartbeat failed: {type(err).__name__}: {err}")

    def _beat(self) -> bool:
        """One period: the heartbeat, and the scheduler's open request forwarded to the run (once)
        and acknowledged (until the queue has the acknowledgement). False: no queue row."""
        from trainer import control

        row = self.queue.touch(self.job_id, steps_done=self.step, plans=False)
        if row is None:
            return False
        req = row.request
        if not (row.request_state == "pending" and req):
            return True
        rid, kind = str(req["id"]), str(req.get("kind"))
        if rid not in self.forwarded:
            control.request_stop(self.run_dir, reason="preempt" if kind == "preempt" else "resize", request_id=rid)
            self.forwarded[rid] = dict(req)
            target = Plan.model_validate(req["plan"]).short() if req.get("plan") else "the queue"
            self.log(f"frenzy: scheduler asks to {kind} ({req.get('reason') or kind}) -> {target}; "
                     f"stopping at the next step")
        self.queue.ack_request(self.job_id, rid)
        return True


    def _check_fence(self) -> None:
        from trainer import control

        if self.fence is None or self.fenced is not None:
            return
        why = self.fence()
        if why is None:
            return
        rid = control.request_stop(self.run_dir, reason="lease-lost")
        self.fenced = {"request_id": rid, "reason": why}
        self.log(f"frenzy: GPU lease lost ({why}); stopping at the next step with a checkpoint")


def lease_fence(ledger, lease: Callable[[], Any]) -> Callable[[], str | None]:
    """``RequestWatcher``'s fence for the lease ``lease()`` returns (a ``LeaseState``, or None
    while no lease is held on purpose): why it is lost, or None while it holds. Two signals:
    the lease thread's verdict, and one indexed read of the allocation by the database's clock."""
    def fence() -> str | None:
        state = lease()
        if state is None:
            return None
        if state.lost:
            return str(state["error"])
        try:
            valid = ledger.lease_valid(state.alloc_id)
        except Exception:           # the database away: the lease thread decides after a whole lease
            return None
        if valid or lease() is not state:   # released meanwhile on purpose
            return None
        return f"allocation {state.alloc_id} is no longer active by the ledger's clock"

    return fence


def answer_request(ledger, queue, job_id: str, req: dict[str, Any], done: int, *, log: Callable[[str], None],
                   wait_timeout_s: float, what: str, allocation_id: str | None = None) -> Assignment | None:
    """A run stopped after step ``done`` for the scheduler's request ``req`` and let its GPUs go:
    the allocation it relaunches on. A preempted job waits in the queue for its next one; a
    re-size takes its target (back to the queue when the target was taken meanwhile). None
    when the scheduler gave up on the run before it re-sized (it answered too late and the job
    was queued again): the target is released and the caller stops, the job resumes from the
    checkpoint. One implementation for a single-node run and a gang. ``allocation_id``: the
    allocation the run stopped on (``JobQueue._run_ended``)."""
    if req.get("kind") == "preempt":
        queue.requeue(job_id, steps_done=done, preempted=True, reason="preempted", allocation_id=allocation_id)
        log(f"frenzy: preempted after step {done}; waiting in the queue")
        return wait_for_allocation(queue, job_id, timeout_s=wait_timeout_s, log=log, what=what)
    target = Plan.model_validate(req["plan"])
    placement = {k: [int(d) for d in v] for k, v in req["placement"].items()}
    alloc = _take(ledger, job_id, target, placement, log, beat=lambda: queue.touch(job_id, plans=False))
    if alloc is None:
        queue.requeue(job_id, steps_done=done, preempted=False, reason="re-size target was taken",
                      allocation_id=allocation_id)
        return wait_for_allocation(queue, job_id, timeout_s=wait_timeout_s, log=log, what=what)
    new = Assignment.from_allocation(alloc, target)
    if not queue.resized(job_id, str(req["id"]), new.model_dump(mode="json"), done, allocation_id):
        ledger.release(alloc.id)
        log(f"frenzy: the scheduler cancelled this run before it re-sized (step {done}); "
            f"stopping here, the job resumes from the checkpoint")
        return None
    log(f"frenzy: re-sized ({req.get('kind')}) after step {done} to {target.short()} "
        f"on {placement}; resuming from the checkpoint")
    return new


def _take(ledger, job_id: str, plan: Plan, placement: dict[str, list[int]], log,
          beat: Callable[[], Any] | None = None) -> Any:
    """The re-size target, retried while GPUs another stopping job holds free; None if not.
    ``beat``: the job's queue heartbeat, kept while it retries (a gang's watcher has stopped by
    then, and the wait is as long as the queue's alive window)."""
    from ledger.core import LedgerConflict

    end = time.monotonic() + RESIZE_TAKE_S
    beat_at = time.monotonic()
    while True:
        try:
            return ledger.allocate(job_id, plan, placement)
        except LedgerConflict as err:
            now = time.monotonic()
            if now > end:
                log(f"frenzy: re-size target still taken after {RESIZE_TAKE_S:.0f} s ({err}); back to the queue")
                return None
            if beat is not None and now - beat_at >= WAIT_BEAT_S:
                beat_at = now
                try:
                    beat()
                except Exception as beat_err:     # a database hiccup: the next one beats again
                    log(f"frenzy: queue heartbeat failed: {beat_err}")
            time.sleep(WAIT_POLL_S)


def oom_fallbacks(job: TrainingJob, plan: Plan, *, inventory: dict[str, int] | None, site,
                  last_step: Callable[[], int], job_id: str | None = None) -> Iterator[Plan]:
    """The out-of-memory fallback plans of a run that starts on ``plan``, in the order it takes
    them: the trainer's ladder (``trainer.fallback.fallback_plans`` over ``inventory``), in the
    `FrenzySettings` block's order when ``site`` has one, each announced as it is taken
    (``events.announced_fallbacks``). One ladder for a one-node run and a gang."""
    from frenzy_flows import events

    ordered = None
    if site is not None:
        from trainer.fallback import fallback_plans

        ordered = site.order_fallbacks(plan, fallback_plans(job, plan, inventory=inventory))
    return events.announced_fallbacks(job, plan, inventory=inventory, plans=ordered, last_step=last_step,
                                      job_id=job_id)


def fallback_allocation(ledger, job_id: str, plan: Plan, log: Callable[[str], None],
                        pool: str | None = None, node: str | None = None) -> Assignment:
    """GPUs for an out-of-memory fallback plan (best fit, fewest nodes: several nodes make the
    relaunch a gang): on the run's own ``node`` of its ``pool`` first (where its process
    trains), then the rest of its pool, whose workers already train it, then wherever the
    ledger has them free now (another GPU type's pool: the relaunch goes to that pool's
    workers); ``RuntimeError`` when none are."""
    alloc = ledger.allocate_best_fit(job_id, plan, pool=pool, node=node) if pool and node else None
    if alloc is None and pool:
        alloc = ledger.allocate_best_fit(job_id, plan, pool=pool)
    if alloc is None:
        alloc = ledger.allocate_best_fit(job_id, plan)
    if alloc is None:
        raise RuntimeError(f"no free GPUs for fallback plan {plan.short()}")
    log(f"fallback allocation {alloc.id}: {plan.short()} on {alloc.placement}")
    return Assignment.from_allocation(alloc, plan)


def fenced_result(result, why: str) -> Any:
    """The result of a run stopped because its lease was lost: failed, with the reason."""
    step = result.stop.step if result.stop is not None else 0
    return result.model_copy(update={
        "status": "failed",
        "error": (f"GPU lease lost ({why}): stopped after step {step} with a checkpoint, since its GPUs "
                  f"may be another job's now; resubmitting the job resumes from that checkpoint")})


def record_measurement(ledger, job_id: str, alloc_id: str | None, result) -> str | None:
    """What the run measured next to what its final plan predicted (``frenzy calibrate`` refits
    from these); the reason when the ledger is unreachable (the training still counts)."""
    from ledger import LedgerUnavailable

    final = result.final_plan
    try:
        ledger.record_measurement(job_id, alloc_id, final.gpu_type, final, predicted=predicted_figures(final),
                                  measured=result.measured.model_dump())
    except LedgerUnavailable as err:
        return str(err)
    return None


def merge_segments(segments: list) -> Any:
    """One TrainResult for a run that relaunched: losses and attempts of every segment in
    order, the rest from the last one. Each segment's losses are its steps after the step it
    resumed from; an earlier segment's steps past that point were trained again (a relaunch
    that found an older checkpoint, or none: a run folder not on storage both machines see)
    and give way to the later segment's."""
    if len(segments) == 1:
        return segments[0]
    first = segments[0].attempts[0].resumed_from_step if segments[0].attempts else 0
    losses: list[float] = []
    evals: list = []
    for seg in segments:
        if seg.attempts:
            resumed = seg.attempts[0].resumed_from_step
            del losses[max(0, resumed - first):]
            evals = [e for e in evals if e.step <= resumed]
        losses += seg.losses
        evals += seg.eval_losses
    return segments[-1].model_copy(update={
        "losses": losses, "attempts": [a for s in segments for a in s.attempts], "eval_losses": evals})


def merge_results(segments: list[dict]) -> dict:
    """``merge_segments`` over the train flows' dicts of consecutive parts of one run (a gang's
    launches, a run handed on to another pool): the rest, "assignment" included, from the last."""
    from trainer.runner import TrainResult

    if len(segments) == 1:
        return segments[0]
    return {**segments[-1], **merge_segments([TrainResult.model_validate(s) for s in segments]).model_dump(
        mode="json", include={"losses", "attempts", "eval_losses"})}


def _check_same_ledger(ledger, alloc_id: str | None) -> None:
    """Before anything starts: the allocation the run was given is in the ledger it opened. A
    pool's worker gets no ledger URL from its dispatcher (it is a secret); without
    ``FRENZY_LEDGER_URL`` it opens its own default ledger, where the allocation is unknown."""
    if not alloc_id:
        return
    try:
        ledger.allocation(alloc_id)
    except FrenzyInputError:
        from sqlalchemy.engine import make_url

        shown = make_url(ledger.url).render_as_string(hide_password=True)
        raise FrenzyInputError("FRENZY_LEDGER_URL", f"allocation {alloc_id} is not in this run's ledger ({shown}): "
                                                    "a pool's worker must open the scheduler's ledger; set "
                                                    "FRENZY_LEDGER_URL on the worker (docs/fleet.md)") from None
    except Exception:                 # the database away: the lease thread decides, as for a running run
        pass


def run_allocated_training(job: TrainingJob, job_id: str, plan: Plan, assignment: Assignment, *,
                           ledger_url: str | None, log: Callable[[str], None],
                           inventory: dict[str, int] | None = None,
                           on_step: Callable[[int, int, float], None] | None = None,
                           fallbacks=None, wait_timeout_s: float = 3600.0,
                           on_placed: Callable[[Assignment], None] | None = None,
                           slots: Callable[[str, int], contextlib.AbstractContextManager] | None = None,
                           first_attempt: int = 1,
                           fallbacks_for: Callable[[Plan], Iterator[Plan]] | None = None):
    """Train ``job`` on ``assignment``; returns ``trainer.runner.TrainResult``. ``fallbacks``:
    the out-of-memory fallback plans to try (default: the trainer's own ladder).
    ``wait_timeout_s``: how long a preempted run waits in the queue for new GPUs.
    ``on_placed``: told each allocation the run moves to (a fallback's, a re-size's target),
    so the caller reports where the job ended, not where it started.
    ``slots(pool, gpus)``: a context held for as long as each allocation is (the train flow
    passes `dispatch.hold_gpu_slots`, Prefect's ``gpu:<pool>`` count), so that count follows
    the run through fallbacks, re-sizes and preemptions: a preempted run waiting in the queue
    holds none, a grown one holds its new GPUs. None: nothing counts them but the ledger.
    ``first_attempt``: the number of the first launch (a gang relaunched on one node goes on
    counting its launches, ``trainer.runner.run_training``). ``fallbacks_for(plan)``: the
    fallback ladder of a plan, asked again whenever a re-size or a new placement changes the
    plan the run trains on (a ladder made for the starting plan stepped down from its GPU count
    and memory, not the new plan's); it takes the place of ``fallbacks``.

    A re-size's target or a preempted run's next allocation that is not where this process
    trains (``Assignment.trains_where``: another pool, another node, several nodes) is not
    launched here: the run stops with its checkpoint, the result is "stopped" with
    ``handoff`` set to that allocation (kept held: the caller's ``allocation_lifetime`` must
    keep it too), and the caller's submitter launches it where it belongs (``frenzy_flows.flow``)."""
    from ledger import Ledger, LedgerUnavailable
    from ledger.queue import JobQueue
    from trainer import interrupt
    from trainer.resume import prepare_run_dir, shared_runs_root
    from trainer.loglines import readable_log
    from trainer.runner import LaunchElsewhere, run_training

    ledger = Ledger(ledger_url)
    _check_same_ledger(ledger, assignment.allocation_id)
    queue = JobQueue(ledger)
    current = {"alloc_id": assignment.allocation_id, "plan": plan, "devices": assignment.devices,
               "pool": assignment.pool, "first": True, "lease": None}
    home_node = next(iter(assignment.placement)) if len(assignment.placement) == 1 else None
    elsewhere: dict[str, Assignment] = {}      # "to": where the run goes on, not in this process
    leases = contextlib.ExitStack()

    def acquire(p: Plan) -> list[str]:
        if current["first"] and p == current["plan"]:
            current["first"] = False
        else:
            release()
            placed = fallback_allocation(ledger, job_id, p, log, pool=current["pool"], node=home_node)
            try:        # the queue row names the allocation the run holds (a cancellation frees it)
                queue.moved(job_id, placed.model_dump(mode="json"))
            except Exception as err:       # a database hiccup: the run goes on; the lease still fences it
                log(f"frenzy: could not record the fallback allocation on the queue row: {err}")
            if not assignment.trains_where(placed):
                # not this process's devices (another node or pool): the submitter launches it there
                elsewhere["to"] = placed
                raise LaunchElsewhere(f"the fallback {p.short()} got GPUs on {placed.placement} (pool {placed.pool})")
            current.update(alloc_id=placed.allocation_id, plan=p, devices=list(placed.devices), pool=placed.pool)
            if on_placed is not None:
                on_placed(placed)
        current["lease"] = leases.enter_context(ledger.lease(current["alloc_id"]))
        if slots is not None and current["pool"]:
            # as many as the pool's run is given (dispatch.job_variables' num_processes)
            leases.enter_context(slots(current["pool"], len(current["devices"] or []) or current["plan"].gpus))
        return list(current["devices"])

    def release() -> None:
        current["lease"] = None                 # released on purpose: nothing to fence
        leases.close()
        if current["alloc_id"]:
            ledger.release(current["alloc_id"])

    ledger_errors: list[str] = []       # the ledger unreachable at the end: the training still counts
    try:
        # on storage every node sees when the site has it: a preempted run, or a gang relaunched
        # on one node, may resume on another node of the pool; a resubmission continues its last checkpoint
        run_dir = prepare_run_dir(job, job_id, shared_runs_root())
        run_dir.mkdir(parents=True, exist_ok=True)
        with RequestWatcher(queue, job_id, run_dir, log, fence=lease_fence(ledger, lambda: current["lease"])) as watcher:
            def stepped(step: int, total: int, loss: float) -> None:
                watcher.step = step
                if on_step is not None:
                    on_step(step, total, loss)

            segments = []
            now_plan = plan
            training_log = readable_log(log)     # the run log: sentences, not FRENZY_<TAG> {json}
            # one deadline for the whole run: a segment after a re-size or a preemption (and the
            # wait in the queue between them) spends what is left of it, not a fresh one
            end = None if job.deadline_s is None else time.monotonic() + job.deadline_s
            ladder, ladder_plan = fallbacks, plan
            if fallbacks_for is not None:
                ladder = fallbacks_for(plan)
            while True:
                if fallbacks_for is not None and now_plan != ladder_plan:
                    ladder, ladder_plan = fallbacks_for(now_plan), now_plan
                result = run_training(job, now_plan, run_dir=run_dir, acquire=acquire, release=release,
                                      log=training_log,
                                      on_step=stepped, inventory=inventory,
                                      deadline_s=None if end is None else max(0.0, end - time.monotonic()),
                                      fallbacks=ladder, first_attempt=first_attempt)
                segments.append(result)
                first_attempt += len(result.attempts)      # a relaunch goes on counting launches
                if watcher.fenced is not None:
                    break
                if "to" in elsewhere:          # a fallback placed off this node
                    break
                req = (watcher.forwarded.get(result.stop.request_id)
                       if result.status == "stopped" and result.stop is not None else None)
                if req is None:
                    break
                done = int(result.stop.step)
                if interrupt.requested():       # a signal while stopping for the re-size: the checkpoint stands
                    log(f"frenzy: not relaunching after step {done} ({interrupt.requested()})")
                    break
                stopped_on = current["alloc_id"]
                release()                                       # run_training released it; idempotent
                new = answer_request(ledger, queue, job_id, req, done, log=log, wait_timeout_s=wait_timeout_s,
                                     what=job.name, allocation_id=stopped_on)
                if new is None:
                    break
                if not assignment.trains_where(new):
                    # its GPUs are another pool's, another node's or several nodes': launched here
                    # the ranks would train on this process's own devices under that name
                    elsewhere["to"] = new
                    log(f"frenzy: the run goes on from step {done} on {new.plan.short()} on {new.placement} "
                        f"(pool {new.pool}); handing it to its submitter to launch there")
                    break
                now_plan = new.plan
                current.update(alloc_id=new.allocation_id, plan=now_plan, devices=list(new.devices), pool=new.pool,
                               first=True)
                if on_placed is not None:
                    on_placed(new)
        result = merge_segments(segments)
        if "to" in elsewhere:
            result = result.model_copy(update={"handoff": elsewhere["to"].model_dump(mode="json")})
        if watcher.fenced is not None and result.status == "stopped":
            result = fenced_result(result, watcher.fenced["reason"])
            log(f"frenzy: {result.error}")
        unrecorded = record_measurement(ledger, job_id, current["alloc_id"], result)
        if unrecorded:
            ledger_errors.append(unrecorded)
    finally:
        try:
            release()
        except LedgerUnavailable as err:   # the lease, no longer renewed, frees the GPUs within its TTL
            ledger_errors.append(f"{err}; its lease frees the GPUs when it runs out")
    if ledger_errors:
        log("ledger: " + "; ".join(ledger_errors))
        result = result.model_copy(update={"ledger_error": "; ".join(ledger_errors)})
    return result
