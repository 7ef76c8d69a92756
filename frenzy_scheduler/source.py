"""The ledger as the round loop's source of truth (``scheduler.loop.RoundSource``).

Snapshot: pending queue jobs become ``JobRequest``s (plans, steps left, attained service,
restarts, preemptions); the ledger's active allocations become ``RunningJob``s carrying their
job's request. A job whose run has an open re-size or stop request is in neither list (its
GPUs stay held until the run lets them go), and the target GPUs of an open re-size are not
offered as free: the run takes them when it relaunches.

Apply: a stop becomes a request on the job's queue row (the run's heartbeat acts on it); a
start of a pending job becomes a ledger allocation and the row turns ``running``. A start whose
GPUs are still held (a run stopping in this very round) is skipped: the next round places the
job again.
"""
from __future__ import annotations

import logging
import math
from dataclasses import replace
from operator import attrgetter
from typing import Any, Callable

from ledger import Ledger
from ledger.mirror import LedgerMirror
from ledger.queue import JobQueue, QueueJob
from scheduler.loop import Snapshot
from scheduler.round import RoundResult
from scheduler.types import JobRequest, RunningJob

from frenzy_flows.cancel import cancel_flow_run

log = logging.getLogger("frenzy.scheduler")

# A placed job's GPUs stay held this long without a heartbeat from its run; its submitter
# starts the heartbeat within a second (its poll), the ledger's default lease is 300 s.
START_LEASE_S = 300.0

Publish = Callable[[str, dict[str, Any]], None]          # (event kind, payload)
_SUBMITTED = attrgetter("submit_s", "job_id")            # the queue's order


def assignment_json(alloc, plan) -> dict[str, Any]:
    """A ledger ``Allocation`` as the flows' ``Assignment`` JSON."""
    return {"allocation_id": str(alloc.id), "plan": plan.model_dump(mode="json"), "pool": alloc.pool,
            "gpu_type": alloc.gpu_type, "placement": {k: list(v) for k, v in alloc.placement.items()},
            "devices": list(alloc.devices)}


class LedgerSource:
    def __init__(self, ledger: Ledger | str | None = None, *, fence: Callable[[], bool] | None = None,
                 publish: Publish | None = None, lease_s: float = START_LEASE_S,
                 cancel: Callable[[str, str], bool] | None = cancel_flow_run):
        self.ledger = ledger if isinstance(ledger, Ledger) else Ledger(ledger)
        self.queue = JobQueue(self.ledger)
        self.fence = fence
        self.publish = publish
        self.lease_s = lease_s
        self.cancel = cancel               # (flow run id, message) -> cancelled; None: never
        # the ledger rows a round reads, kept here and refreshed with what changed (ledger.mirror)
        self.mirror = LedgerMirror(self.ledger)
        self.rows: dict[str, QueueJob] = {}        # the last snapshot's active queue rows
        self._requests: dict[str, tuple[QueueJob, JobRequest]] = {}   # job_id -> (its row, its request)
        self._running_plans: dict[str, Any] = {}
        # job_id -> (allocation id, steps done when this source first saw that run): a run's
        # predicted end is its start plus the steps it had left then, as in the simulator (the
        # heartbeat's steps_done moves on; started_at + what is left *now* would drift earlier
        # than the run's real end as it progresses)
        self._run_base: dict[str, tuple[str, int]] = {}
        # job_id -> (the mirror's run, its queue row, its base, the run as the policy sees it):
        # kept while the three are the same objects (the policy must not change its inputs)
        self._runs: dict[str, tuple[RunningJob, QueueJob, tuple[str, int] | None, RunningJob]] = {}
        self.counts = {"started": 0, "resized": 0, "preempted": 0, "skipped": 0, "reaped": 0,
                       "cancelled": 0}

    # --- read -----------------------------------------------------------------------------
    def request_of(self, j: QueueJob) -> JobRequest:
        """The policy's view of queue row ``j`` (the same object while the row is unchanged: a
        policy must not mutate its inputs)."""
        hit = self._requests.get(j.job_id)
        if hit is not None and hit[0] is j:
            return hit[1]
        plans, spec = self.mirror.static.get(j.job_id, ([], {}))
        req = JobRequest(job_id=j.job_id, submit_s=j.submitted_at, plans=plans,
                         steps_left=max(1, j.steps_total - j.steps_done),
                         requested_gpu_type=(spec.get("allowed_gpu_types") or [None])[0],
                         requested_gpus=spec.get("max_gpus"), attained_gpu_s=j.attained_gpu_s,
                         restarts=j.restarts, model=j.model, checkpoint_gb=j.checkpoint_gb,
                         preemptions=j.preemptions)
        self._requests[j.job_id] = (j, req)
        return req

    def snapshot(self) -> Snapshot:
        mirror = self.mirror
        with mirror.lock:
            mirror.refresh()
            state = mirror.cluster_state(shared=True)     # the mirror's objects: replaced here, never changed
            rows = self.rows = dict(mirror.jobs)
            version = mirror.version
        if len(self._requests) > 2 * len(rows) + 256:        # ended jobs' requests
            self._requests = {k: v for k, v in self._requests.items() if k in rows}
        reserved: dict[str, set[int]] = {}
        for j in rows.values():
            if j.open_request and j.request.get("kind") != "preempt":
                for node, devs in (j.request.get("placement") or {}).items():
                    reserved.setdefault(node, set()).update(int(d) for d in devs)
        if reserved:
            state.nodes = [replace(n, free=[i for i in n.free if i not in reserved[n.node_id]])
                           if n.node_id in reserved else n for n in state.nodes]
        running = []
        for rj in state.running:
            j = rows.get(rj.job_id)
            if j is None:
                running.append(rj)             # not submitted through the queue: left as it is
                continue
            if j.state != "running" or j.open_request or j.allocation_id is None:
                continue
            base = None
            if j.started_at is not None and rj.plan.step_time_s > 0:
                base = self._run_base.get(j.job_id)
                if base is None or base[0] != j.allocation_id:
                    base = self._run_base[j.job_id] = (j.allocation_id, j.steps_done)
            kept = self._runs.get(j.job_id)
            if kept is None or kept[0] is not rj or kept[1] is not j or kept[2] is not base:
                seen = RunningJob(job_id=rj.job_id, plan=rj.plan, placement=rj.placement, start_s=rj.start_s,
                                  expected_end_s=rj.expected_end_s, request=self.request_of(j), resizes=j.resizes,
                                  reason=j.start_reason)
                if base is not None:
                    seen.start_s = j.started_at
                    seen.expected_end_s = j.started_at + max(1, j.steps_total - base[1]) * rj.plan.step_time_s
                kept = self._runs[j.job_id] = (rj, j, base, seen)
            running.append(kept[3])
        state.running = running
        live = {rj.job_id for rj in running}
        for jid in [k for k in self._run_base if k not in live]:
            del self._run_base[jid]
        for jid in [k for k in self._runs if k not in live]:
            del self._runs[jid]
        self._running_plans = {rj.job_id: rj.plan for rj in running}
        # oldest submission first, as the queue lists them
        pending = sorted((self.request_of(j) for j in rows.values() if j.state == "pending"), key=_SUBMITTED)
        return Snapshot(pending=pending, state=state, version=version)

    # --- write ----------------------------------------------------------------------------
    def reap(self) -> None:
        gone = self.queue.reap()
        if gone["leases"] or gone["jobs"]:
            self.counts["reaped"] += len(gone["jobs"])
            log.info("reaped %d expired leases, gave up jobs %s", len(gone["leases"]), gone["jobs"] or "none")
        for j in gone["overdue"]:
            self._cancel_overdue(j)

    def _cancel_overdue(self, j: QueueJob) -> None:
        """The run of ``j`` did not answer its request in time: cancel its flow run through
        Prefect, free its GPUs and queue the job again (it resumes from its last checkpoint)."""
        if self.fence is not None and not self.fence():
            return
        kind, rid = j.request.get("kind"), str(j.request.get("id"))
        waited = "acknowledge" if j.request_state == "pending" else "stop after acknowledging"
        why = f"its run did not {waited} the {kind} request {rid} in time"
        # the ledger first, atomically: a run that answered meanwhile keeps running (cancelling
        # its flow run before this check killed a run that had answered at the deadline)
        if not self.queue.cancel_run(j.job_id, rid, f"requeued: {why}; resumes from its last checkpoint"):
            return                         # the run answered meanwhile
        cancelled = False
        if j.flow_run_id and self.cancel is not None:
            try:
                cancelled = self.cancel(j.flow_run_id, f"frenzy scheduler: {why}")
            except Exception as err:      # Prefect away: the ledger's release still fences the run
                log.warning("could not cancel flow run %s of job %s: %s", j.flow_run_id, j.job_id, err)
        self.counts["cancelled"] += 1
        log.warning("job %s: %s; flow run %s %s, GPUs freed, job queued again", j.job_id, why,
                    j.flow_run_id or "(none recorded)", "cancelled through Prefect" if cancelled else "not cancelled")
        self._emit("cancelled", j.job_id, request_id=rid, kind=kind, flow_run_id=j.flow_run_id,
                   reason=why)

    def apply(self, result: RoundResult, now: float) -> None:
        if self.fence is not None and not self.fence():
            log.warning("leadership lost before applying the round: nothing applied")
            return
        for d in result.stops:
            rz = result.resizes.get(d.job_id)
            if rz is not None:
                rid = self.queue.request(d.job_id, rz.kind, plan=rz.start.plan, placement=rz.start.placement,
                                         reason=rz.start.reason or d.reason or rz.kind)
                if rid:
                    self.counts["resized"] += 1
                    self._emit("resized", d.job_id, kind=rz.kind, request_id=rid,
                               from_plan=rz.old_plan.model_dump(mode="json"),
                               to_plan=rz.start.plan.model_dump(mode="json"),
                               placement=rz.start.placement, reason=rz.start.reason or d.reason)
            else:
                rid = self.queue.request(d.job_id, "preempt", reason=d.reason or "preempt")
                if rid:
                    self.counts["preempted"] += 1
                    kind = "recalled" if "recall" in (d.reason or "") else "preempted"
                    rp = self._running_plans.get(d.job_id)
                    plan = rp.model_dump(mode="json") if rp is not None else None
                    self._emit(kind, d.job_id, request_id=rid, from_plan=plan, reason=d.reason)
        starts = [d for d in result.starts if d.job_id not in result.resizes]
        by_id = {d.job_id: d for d in starts}
        started = {d.job_id for d in result.starts}
        waits = {jid: {"predicted_start_s": w.predicted_start_s, "gpu_type": w.gpu_type, "gpus": w.gpus,
                       "reason": w.reason} for jid, w in result.waits.items() if jid not in started}
        # the starts and the wait answers in one transaction (one commit a round)
        for job_id, alloc, why in self.queue.start_all([(d.job_id, d.plan, d.placement) for d in starts],
                                                       lease_s=self.lease_s, assignment=assignment_json,
                                                       waits=waits, known=self.rows,
                                                       reasons={d.job_id: d.reason for d in starts if d.reason}):
            d = by_id[job_id]
            if alloc is None:
                self.counts["skipped"] += 1
                log.info("start of %s on %s skipped: %s", job_id, d.placement, why)
                continue
            self.counts["started"] += 1
            self._emit("started", job_id, plan=d.plan.model_dump(mode="json"),
                       placement={k: list(v) for k, v in alloc.placement.items()}, pool=alloc.pool, reason=d.reason)

    def _emit(self, event: str, job_id: str, **payload: Any) -> None:
        row = self.rows.get(job_id)
        name = row.name if row is not None else job_id
        plans = " -> ".join(_short(payload[k]) for k in ("from_plan", "to_plan", "plan") if payload.get(k))
        log.info("%s %s: %s %s %s", event, job_id, plans, payload.get("placement") or "", payload.get("reason") or "")
        if self.publish is None:
            return
        try:
            self.publish(event, {"job_id": job_id, "job_name": name, **payload})
        except Exception as err:      # the UI is a view: a Prefect outage never stops scheduling
            log.warning("could not publish %s of %s: %s", event, job_id, err)


def _short(plan: dict[str, Any]) -> str:
    try:
        from estimator.plan import Plan
        return Plan.model_validate(plan).short()
    except Exception:                    # a malformed plan still gets logged
        return str(plan)


def queue_table(rows: list[QueueJob], now: float) -> list[dict[str, Any]]:
    """The queue view (``frenzy queue``, the scheduler's artifact): one row per active job."""
    out = []
    for j in rows:
        plan = (j.allocation or {}).get("plan") or {}
        p = j.predicted_start_s
        out.append({
            "job": j.job_id, "name": j.name, "state": j.state,
            "waited_s": round(max(0.0, now - j.submitted_at), 1) if j.state == "pending" else None,
            "predicted_start_in_s": (round(p - now, 1) if p is not None and math.isfinite(p) else None),
            "gpu_type": plan.get("gpu_type") if j.state == "running" else j.wait_gpu_type,
            "gpus": plan.get("gpus") if j.state == "running" else j.wait_gpus,
            "steps": f"{j.steps_done}/{j.steps_total}",
            "why": (f"{j.request.get('kind')} requested" if j.open_request
                    else j.wait_reason if j.state == "pending"
                    else j.wait_reason or "running" if j.state == "running"
                    # an ended job (``frenzy queue --all``): why it failed or stopped
                    else j.error or ("trained to its last step" if j.state == "done" else j.state)),
            "preemptions": j.preemptions, "resizes": j.resizes,
        })
    return out
