"""Multi-node training: one `frenzy-train-<pool>` flow run per node, trained as a gang.

A job whose allocation spans several nodes of a pool is dispatched as one flow run per node of
the pool's training deployment, each sent to its node's work queue (``<pool>-<i>``, made by
``frenzy pools sync``; a worker started with ``--work-queue <pool>-<i>`` is that node's). Every
node runs the same training program through ``accelerate launch --num_machines N
--machine_rank r --main_process_ip <node 0> --main_process_port <port>``:

* node 0 finds a free port on its address and publishes both in the ledger's ``gang_nodes``
  (``ledger.gang``); the others wait for that record, bounded;
* the run folder (checkpoints, launch files) is on storage every node sees
  (``trainer.resume.shared_runs_root``, ``FRENZY_SHARED_RUNS``), each node's own files
  (``accelerate-node<r>.yaml``, ``attempt-<n>-node<r>.log``) told apart by name;
* each node beats its ledger row while it trains; the dispatcher watches every node's flow run
  and row. Gang semantics: when any node fails, or its heartbeat runs out (its worker
  vanished), the dispatcher cancels every other node's run (their launchers kill their ranks),
  releases the allocation, takes the GPUs again (through the scheduler's queue when the job has
  a row there) and relaunches the whole gang under a new gang id; it resumes from the newest
  checkpoint in the shared run folder. ``GANG_RETRIES`` relaunches at most.

Live re-sizing: while a gang trains, the dispatcher beats the job's queue row and writes the
scheduler's request into the shared run folder's control file (``RequestWatcher``, as a
one-node run's watcher does); every rank of every node stops after the same step with a
checkpoint, the gang's GPUs are released, and the job relaunches where the request says
(``answer_request``: a re-size's target, a preempted job's next allocation), as a gang again or
as one run on one node (sent to that node's work queue), resuming from the checkpoint with the
same global batch. An interrupted dispatcher (the submit flow cancelled by the scheduler when
the gang stopped answering, a signal) cancels every node's run before it ends.

A completed gang records node 0's measurement (per-GPU peak memory, step time) beside its
plan's prediction in the ledger, as a one-node run does.

A gang whose lease is lost (the ledger freed its GPUs: a database outage past the lease's
TTL, the reaper) is fenced as a one-node run is: every rank stops after the next step with a
checkpoint and the result is failed, naming the reason.

Out-of-memory fallback: a node whose training ran out of memory (``FRENZY_OOM``, the launcher's
``OOM_MARKERS``) finishes its row ``oom``. The dispatcher stops the whole gang as for any
failure, and once its runs have stopped it records the launch's ``oom`` attempt (the node's
own record in the shared run folder), releases the allocation and takes the next plan of the
job's out-of-memory ladder, the one a one-node run takes (``training.oom_fallbacks``: the
trainer's ``fallback_plans`` over the cluster's inventory, in the settings block's order, each
announced), with GPUs on the gang's own pool first, else wherever the ledger has them free
(``training.fallback_allocation``, best fit); it relaunches as a gang when they span nodes, else as one run on that node, resuming from
the newest checkpoint with the same global batch. The ladder's length bounds these relaunches
(``GANG_RETRIES`` counts the other failures). Launches are numbered across relaunches (the
nodes' ``attempt-<n>`` logs, ``FRENZY_ATTEMPT``), so a rehearsed failure
(``FRENZY_INJECT_OOM_AT_STEP``) fires on the first launch only.
"""
from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Mapping

from estimator.job import TrainingJob
from estimator.plan import Plan

from deployments.pools import node_index, node_queue_name

from frenzy_flows import dispatch
from frenzy_flows.cancel import cancel_flow_run
from frenzy_flows.results import Assignment

# Relaunches of a failed gang: a lost node (a worker restarted, a network blip) is worth two
# more tries from the checkpoint; a failure that repeats three times is the job's, not a node's.
GANG_RETRIES = 2
# How long node 1.. wait for node 0's rendezvous record: node 0's flow run must be picked up by
# its worker and start (a process worker polls every 10 s by default, the flow's imports take
# ~10 s on a busy machine), so two minutes.
RENDEZVOUS_WAIT_S = 120.0
# How long the GPUs of a failed gang may take to come back on the ledger for its relaunch (the
# killed nodes' processes must exit; the scheduler may place it elsewhere): as a re-size's.
RETAKE_S = 60.0
NODE_ADDRESS_ENV = "FRENZY_NODE_ADDRESS"


class GangError(dispatch.DispatchError):
    """The gang did not complete after its relaunches."""


class NodeOutOfMemory(RuntimeError):
    """A node's training ran out of memory (its flow run fails; the dispatcher falls back)."""


def gang_nodes(placement: Mapping[str, list[int]]) -> list[str]:
    """The nodes of a placement in node order: the first is node 0 (the rendezvous)."""
    return sorted(placement, key=node_index)


def is_multi_node(assignment: Assignment) -> bool:
    return len(assignment.placement) > 1


# ---------------------------------------------------------------- node side

def node_address(ledger, node_id: str) -> str:
    """This node's address for the rendezvous: ``FRENZY_NODE_ADDRESS`` (set on the worker),
    else the cluster file's ``addresses`` entry of the node, else what this host's name
    resolves to."""
    from ledger.gang import node_address as recorded

    return (os.environ.get(NODE_ADDRESS_ENV) or recorded(ledger, node_id)
            or socket.gethostbyname(socket.gethostname()))


def node_endpoint(gang, gang_id: str, node_rank: int, address: str,
                  timeout_s: float = RENDEZVOUS_WAIT_S) -> Callable[[], tuple[str, int]]:
    """``NodeRole.endpoint`` for one node: node 0 finds a free port on its own address and
    publishes both; another node waits for node 0's record (``RendezvousTimeout``)."""
    from trainer.ports import free_port

    def endpoint() -> tuple[str, int]:
        if node_rank == 0:
            port = free_port(address)
            gang.publish(gang_id, address, port)
            return address, port
        return gang.wait_rendezvous(gang_id, timeout_s)

    return endpoint


class _Beat:
    """Beats the node's ledger row every ``NODE_BEAT_S`` while the block runs, with the last
    finished step the training reported (``step``)."""

    def __init__(self, gang, gang_id: str, rank: int, log: Callable[[str], None]):
        from ledger.gang import NODE_BEAT_S

        self.gang, self.gang_id, self.rank, self.log, self.every = gang, gang_id, rank, log, NODE_BEAT_S
        self.step: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"frenzy-gang-beat-{rank}", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            try:
                self.gang.beat(self.gang_id, self.rank, step=self.step)
            except Exception as err:     # a database hiccup: the next beat may pass
                self.log(f"frenzy: node heartbeat failed: {err}")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)


def train_node(job: TrainingJob, plan: Plan, assignment: Assignment, job_id: str, node: Mapping[str, Any], *,
               ledger_url: str | None, log: Callable[[str], None],
               on_step: Callable[[int, int, float], None] | None = None) -> dict[str, Any]:
    """One node's share of a gang (the `frenzy-train` flow with a ``node`` parameter): train
    ``plan.gpus / nodes`` processes of the launch on this node's devices of the allocation.
    The allocation, its lease and its release are the dispatcher's. Raises when the node's
    training did not complete (its flow run fails, which fails the gang): ``NodeOutOfMemory``,
    with the row ``oom``, when it ran out of memory."""
    from ledger import Ledger
    from ledger.gang import Gang
    from trainer.loglines import readable_log
    from trainer.runner import NodeRole, run_training

    gang_id, rank, n = str(node["gang_id"]), int(node["rank"]), int(node["nodes"])
    node_id = str(node["node_id"])
    ledger = Ledger(ledger_url)
    gang = Gang(ledger)
    gang.join(gang_id, rank, job_id, node_id)
    devices = [str(d) for d in assignment.placement.get(node_id, [])]
    run_dir = Path(node["run_dir"])
    try:
        address = node_address(ledger, node_id)
        role = NodeRole(machine_rank=rank, num_machines=n,
                        endpoint=node_endpoint(gang, gang_id, rank, address,
                                               float(node.get("rendezvous_wait_s") or RENDEZVOUS_WAIT_S)))
        log(f"frenzy: node {rank} of {n} ({node_id}, {address}) of gang {gang_id}, devices {','.join(devices)}")
        with _Beat(gang, gang_id, rank, log) as beat:
            def stepped(step: int, total: int, loss: float) -> None:
                beat.step = step
                if on_step is not None:
                    on_step(step, total, loss)

            result = run_training(job, plan, run_dir=run_dir, acquire=lambda _p: devices, release=lambda: None,
                                  log=readable_log(log), on_step=stepped, deadline_s=job.deadline_s,
                                  max_transient_retries=0, fallbacks=iter(()), node=role,
                                  first_attempt=int(node.get("attempt") or 1))
    except BaseException as err:
        gang.finish(gang_id, rank, "failed", f"{type(err).__name__}: {err}")
        raise
    last = result.attempts[-1] if result.attempts else None
    if result.status == "failed" and last is not None and last.outcome == "oom":
        # told apart from other failures: the dispatcher answers it with a roomier plan
        gang.finish(gang_id, rank, "oom", last.error or result.error or "out of memory")
        raise NodeOutOfMemory(f"node {rank} ({node_id}) of gang {gang_id} ran out of memory on "
                              f"{plan.short()}: {last.error}")
    if result.status not in ("completed", "stopped"):
        gang.finish(gang_id, rank, "failed", result.error or result.status)
        raise RuntimeError(f"node {rank} ({node_id}) of gang {gang_id}: {result.error or result.status}")
    gang.finish(gang_id, rank, "done")
    return result.model_dump(mode="json")


# ---------------------------------------------------------------- dispatcher side

def _node_variables(plan: Plan, assignment: Assignment, node_id: str,
                    env: Mapping[str, str] | None) -> dict[str, Any]:
    """The pool template variables of one node's run: that node's devices only."""
    one = assignment.model_copy(update={"placement": {node_id: assignment.placement[node_id]},
                                        "devices": [str(d) for d in assignment.placement[node_id]]})
    return dispatch.job_variables(plan, one, env)


def _start_nodes(deployment_id, assignment: Assignment, plan: Plan, parameters: dict[str, Any], gang_id: str,
                 run_dir: Path, env: Mapping[str, str] | None, runs: list[tuple[str, Any]], attempt: int = 1) -> None:
    """One flow run per node, each appended to ``runs`` as soon as it exists, so a dispatcher
    interrupted half-way through still cancels the nodes already started. ``attempt``: the
    launch's number (the nodes' attempt number)."""
    from prefect.deployments import run_deployment

    nodes = gang_nodes(assignment.placement)
    for rank, node_id in enumerate(nodes):
        node = {"gang_id": gang_id, "rank": rank, "nodes": len(nodes), "node_id": node_id, "run_dir": str(run_dir),
                "attempt": attempt}
        fr = run_deployment(deployment_id, parameters={**parameters, "node": node},
                            job_variables=_node_variables(plan, assignment, node_id, env), timeout=0,
                            work_queue_name=node_queue_name(assignment.pool, node_index(node_id)),
                            tags=["frenzy", f"pool:{assignment.pool}", f"node:{node_id}", f"gang:{gang_id}"])
        runs.append((node_id, fr))
        dispatch._logger().info("gang %s: node %d (%s) dispatched to work queue %s as flow run %s", gang_id, rank,
                                node_id, node_queue_name(assignment.pool, node_index(node_id)), fr.name)


def watch_gang(states: Callable[[], list[Any]], lost: Callable[[], dict[int, str]], *, deadline: float,
               poll_s: float, beat: Callable[[], None] | None = None,
               sleep: Callable[[float], None] = time.sleep) -> tuple[bool, str]:
    """Wait for a gang's runs: ``(True, "")`` when every node's run completed, ``(False, why)``
    as soon as one ended otherwise, one node is ``lost`` (failed row, heartbeat run out), or
    the deadline passes. ``states()``: each node's flow-run state (None: not yet known)."""
    while True:
        sts = states()
        for rank, st in enumerate(sts):
            if st is not None and st.is_final() and not st.is_completed():
                return False, f"node {rank}'s flow run ended {st.name}: {(st.message or '').strip()[:300]}"
        if sts and all(st is not None and st.is_completed() for st in sts):
            return True, ""
        gone = lost()
        if gone:
            return False, "; ".join(gone[r] for r in sorted(gone))
        if time.monotonic() >= deadline:
            return False, "the gang did not finish within the job's deadline"
        if beat is not None:
            beat()
        sleep(poll_s)


def poll_nodes(gang, gang_id: str, nodes: int, watcher) -> dict[int, str]:
    """One read of the gang's rows: node 0's last step goes to ``watcher.step`` (the watcher
    reports it on the job's queue row, the scheduler's view of its progress); returns the
    nodes lost (``Gang.lost``)."""
    rows = gang.nodes(gang_id)
    watcher.step = next((n.step for n in rows if n.node_rank == 0), watcher.step)
    return gang.lost(gang_id, nodes, rows)


def _retake(ledger, queue, job_id: str, assignment: Assignment, why: str, log) -> Assignment:
    """The failed gang's GPUs go back; the job takes GPUs again for its relaunch: from the
    scheduler when it has a queue row (it may place it elsewhere), else the same placement."""
    from ledger.core import LedgerConflict

    from frenzy_flows.training import wait_for_allocation

    ledger.release(assignment.allocation_id)
    if queue.get(job_id) is not None:
        queue.requeue(job_id, steps_done=0, preempted=False, reason=f"gang failed: {why}"[:200],
                      allocation_id=assignment.allocation_id)
        return wait_for_allocation(queue, job_id, timeout_s=RETAKE_S * 10, log=log)
    end = time.monotonic() + RETAKE_S
    while True:
        try:
            alloc = ledger.allocate(job_id, assignment.plan, assignment.placement)
            return Assignment.from_allocation(alloc, assignment.plan)
        except LedgerConflict:
            if time.monotonic() > end:
                raise GangError(f"the GPUs of the failed gang were taken meanwhile ({why})")
            time.sleep(0.5)


def dispatch_gang(job: TrainingJob, plan: Plan, assignment: Assignment, *, job_id: str, timeout_s: float | None,
                  ledger_url: str | None = None, settings: str | None = None, env: Mapping[str, str] | None = None,
                  poll_s: float = 2.0, retries: int = GANG_RETRIES, wait_timeout_s: float = 3600.0,
                  inventory: dict[str, int] | None = None, first_attempt: int = 1) -> dict:
    """Train a multi-node assignment as a gang (module docstring); returns the train flow's
    dict of node 0 (losses and attempts of every launch, when the scheduler re-sized it or a
    node ran out of memory). ``GangError`` after ``retries`` failed relaunches, or when out of
    memory with no fallback plan left. ``inventory`` (GPU type -> count) widens the
    out-of-memory fallbacks to more GPUs and other types, as for a one-node run. Interrupted
    (the submit flow cancelled, a signal), it cancels every node's run before it re-raises: no
    node trains on alone."""
    from ledger import Ledger
    from ledger.gang import Gang
    from ledger.queue import JobQueue
    from trainer.resume import prepare_run_dir, shared_runs_root
    from trainer.runner import TrainResult

    from frenzy_flows.tasks import load_settings
    from frenzy_flows.training import (RequestWatcher, answer_request, fallback_allocation, fenced_result,
                                       lease_fence, merge_results, oom_fallbacks, record_measurement)

    log = dispatch._logger()
    ledger = Ledger(ledger_url)
    queue, gang = JobQueue(ledger), Gang(ledger)
    run_dir = prepare_run_dir(job, job_id, shared_runs_root())      # every node's folder
    parameters = {"job": job.model_dump(mode="json"), "job_id": job_id,
                  **({"settings": settings} if settings else {})}
    deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
    failures: list[str] = []
    segments: list[dict] = []          # results of launches stopped to re-size or preempt, or out of memory
    fallbacks = None                   # the out-of-memory ladder, made at the first OOM (as the runner does)
    watcher = None                     # each launch's; the fallbacks' events read the newest's step
    launch = first_attempt - 1         # launches go on counting the run's attempts (a handed-on run)
    while True:
        launch += 1
        if not is_multi_node(assignment):        # the scheduler placed the relaunch on one node
            log.info("gang relaunch placed on one node (%s): dispatching one run", assignment.placement)
            segments.append(dispatch.dispatch_to_pool(
                job, assignment.plan, assignment, job_id=job_id, settings=settings, env=env,
                poll_s=poll_s, timeout_s=None if timeout_s is None else max(1.0, deadline - time.monotonic()),
                first_attempt=launch, ledger_url=ledger_url))
            return merge_results(segments)
        plan = assignment.plan
        # the pool of this launch's placement: a re-size, a preemption's next allocation or a
        # fallback may have moved the gang to another pool's nodes
        deployment_id = dispatch.find_train_deployment(assignment.pool)
        gang_id = f"{job_id[:40]}-g{launch}-{uuid.uuid4().hex[:6]}"
        params = {**parameters, "plan": plan.model_dump(mode="json"),
                  "assignment": assignment.model_dump(mode="json")}
        runs: list[tuple[str, Any]] = []
        try:
            with dispatch.hold_gpu_slots(assignment.pool, plan.gpus, ledger_url=ledger_url), \
                    ledger.lease(assignment.allocation_id) as lease, \
                    RequestWatcher(queue, job_id, run_dir, log.info, fence=lease_fence(ledger, lambda: lease)) as watcher:
                # the watcher beats the job's queue row (with node 0's last step) and writes the
                # scheduler's re-size or stop request, or a stop when the lease is lost, into the
                # shared run folder's control file: rank 0 (on node 0) reads it and every rank
                # of every node stops after the same step
                _start_nodes(deployment_id, assignment, plan, params, gang_id, run_dir, env, runs, attempt=launch)

                ok, why = watch_gang(lambda: _states([fr.id for _, fr in runs]),
                                     lambda: poll_nodes(gang, gang_id, len(runs), watcher), deadline=deadline,
                                     poll_s=poll_s)
                if not ok:
                    for _, fr in runs:                # gang semantics: nobody trains on alone
                        cancel_flow_run(fr.id, f"frenzy: gang {gang_id} stopped: {why}")
        except BaseException as err:
            for _, fr in runs:
                cancel_flow_run(fr.id, f"frenzy: gang {gang_id} dispatcher stopped ({type(err).__name__})")
            raise
        if ok:
            result = _node_result(runs[0][1].id)
            stop = result.get("stop") or {}
            req = watcher.forwarded.get(stop.get("request_id", "")) if result.get("status") == "stopped" else None
            if watcher.fenced is not None and result.get("status") == "stopped":
                result = fenced_result(TrainResult.model_validate(result), watcher.fenced["reason"]).model_dump(
                    mode="json")
                log.warning("gang %s: %s", gang_id, result["error"])
            segments.append(result)
            result["assignment"] = assignment.model_dump(mode="json")     # where it ended
            if req is None:
                log.info("gang %s ended %s on %d nodes", gang_id, result.get("status"), len(runs))
                unrecorded = record_measurement(ledger, job_id, assignment.allocation_id,
                                                TrainResult.model_validate(result))
                if unrecorded:
                    result["ledger_error"] = unrecorded
                return merge_results(segments)
            ledger.release(assignment.allocation_id)
            new = answer_request(ledger, queue, job_id, req, int(stop.get("step", 0)), log=log.info,
                                 wait_timeout_s=wait_timeout_s, what=job.name, allocation_id=assignment.allocation_id)
            if new is None:
                return merge_results(segments)
            assignment = new
            continue
        # the runs stopped before the failure is told apart: a node's row says oom once its
        # runner has seen the failure, which may come after another node's lost rendezvous
        _wait_stopped([fr.id for _, fr in runs], deadline, lambda: gang.lost(gang_id, len(runs)))
        ooms = {n.node_rank: n.error for n in gang.nodes(gang_id) if n.state == "oom"}
        if ooms and time.monotonic() < deadline:
            segments.append(_oom_segment(run_dir, plan, launch, ooms))
            ledger.release(assignment.allocation_id)
            if fallbacks is None:        # the events say node 0's last step of the launch that ran out
                fallbacks = oom_fallbacks(job, plan, inventory=inventory, site=load_settings(settings),
                                          last_step=lambda: watcher.step, job_id=job_id)
            nxt = next(fallbacks, None)
            if nxt is None:
                raise GangError(f"training on pool {assignment.pool!r} across nodes ran out of memory on "
                                f"{plan.short()} and no fallback plan is left ({why})")
            log.warning("gang %s ran out of memory on %s (%s); allocation %s released, falling back to %s "
                        "(global batch %d kept), resuming from the newest checkpoint in %s", gang_id, plan.short(),
                        why, assignment.allocation_id, nxt.short(), nxt.global_batch, run_dir)
            assignment = fallback_allocation(ledger, job_id, nxt, log.info, pool=assignment.pool)
            continue
        failures.append(f"launch {launch}: {why}")
        log.warning("gang %s failed (%s); every node's run cancelled, allocation %s released", gang_id, why,
                    assignment.allocation_id)
        if len(failures) > retries or time.monotonic() >= deadline:
            break
        assignment = _retake(ledger, queue, job_id, assignment, why, log.info)
        log.warning("relaunching the gang on %s (relaunch %d of %d), resuming from the newest checkpoint in %s",
                    assignment.placement, len(failures), retries, run_dir)
    raise GangError(f"training on pool {assignment.pool!r} across nodes failed: " + "; ".join(failures))


def _oom_segment(run_dir: Path, plan: Plan, launch: int, ooms: dict[int, str]) -> dict:
    """What launch ``launch``, which ran out of memory on the nodes ``ooms`` (rank -> error),
    adds to the job's result (a train flow's dict, failed): its ``oom`` attempt, the first such
    node's own record of it in the shared run folder (the step it resumed from, its devices, its
    duration; else what the dispatcher knows), and node 0's losses up to the newest checkpoint,
    which the relaunch resumes after, so the job's losses run on without a gap or a repeat."""
    from trainer.checkpoints import latest_checkpoint
    from trainer.runner import Attempt, Measured, TrainResult, attempt_log, attempts_path, logged_losses

    oom = None
    for rank in sorted(ooms):
        try:
            recorded = json.loads(attempts_path(run_dir, rank).read_text())
        except (OSError, ValueError):      # not written (the node was killed first), or half-written
            continue
        mine = [a for a in recorded if a.get("number") == launch and a.get("outcome") == "oom"]
        if mine:
            oom = Attempt.model_validate(mine[-1])
            break
    if oom is None:
        rank = min(ooms)
        oom = Attempt(plan=plan, outcome="oom", error=ooms[rank] or "out of memory", number=launch)
    kept = latest_checkpoint(run_dir)
    losses = logged_losses(attempt_log(run_dir, launch))
    return TrainResult(status="failed", losses=[losses[s] for s in sorted(losses) if kept and s <= kept.step],
                       attempts=[oom], measured=Measured(), checkpoint_dir=str(kept.path) if kept else None,
                       final_plan=plan, error=oom.error).model_dump(mode="json")


def _node_result(flow_run_id) -> dict:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        result = client.read_flow_run(flow_run_id).state.result(raise_on_failure=True)
    return result if isinstance(result, dict) else {"result": result}



def _states(ids: list) -> list[Any]:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return [client.read_flow_run(i).state for i in ids]


# A cancelled node's worker stops its flow run (SIGTERM, Prefect's 30 s grace, SIGKILL) and the
# launcher kills its ranks: wait for that grace and a margin before its GPUs are taken again.
STOP_WAIT_S = 45.0


def _wait_stopped(ids: list, deadline: float, gone: Callable[[], dict[int, str]] = dict) -> None:
    """Until the stopped runs are final (their processes gone) or their node is ``gone`` (its
    heartbeat ran out: nothing is left there to stop), at most ``STOP_WAIT_S``; a run still
    CANCELLING then (its worker vanished with it) is marked CANCELLED."""
    end = min(deadline, time.monotonic() + STOP_WAIT_S)
    while time.monotonic() < end:
        lost = gone()
        if all(st is None or st.is_final() or r in lost for r, st in enumerate(_states(ids))):
            break
        time.sleep(0.5)
    for i in ids:
        cancel_flow_run(i, "frenzy: its worker did not stop it (gone)")
