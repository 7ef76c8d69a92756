"""Multi-node runs in the ledger: the rendezvous node 0 publishes and the nodes' heartbeats.

A job placed on several nodes trains as a gang: one training flow run per node, every one of
them needed. ``gang_nodes`` holds one row per node of a gang launch (``GangNodeRow``):

* node 0 finds a free port on its own address and ``publish``es both; every other node
  ``wait_rendezvous``es for that row (bounded), so the address and port come from the machine
  whose store listens there, never from the orchestrator (a port free on the control machine
  means nothing on node 0);
* each node ``beat``s its row while it trains (with its last finished step) and ``finish``es
  it (done / failed / oom: failed because it ran out of memory, which the dispatcher answers
  with an out-of-memory fallback instead of a plain retry);
* the dispatcher reads ``nodes`` and calls a node ``lost`` when its heartbeat ran out by the
  database's clock (its worker vanished with the flow run) or its row says failed.

A retried gang gets a new gang id, so a late node of the old launch never meets the new one.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass

from sqlmodel import select

from .core import Ledger, db_now
from .tables import GangNodeRow

NODE_BEAT_S = 3.0
# A node's heartbeat keeps its row alive this long. Nodes beat every NODE_BEAT_S (a few small
# writes a minute); 30 s tolerates a few missed beats (a database hiccup, a stalled thread) yet
# stops a gang whose worker vanished within half a minute, well before the allocation's lease
# (300 s) would free its GPUs on its own. FRENZY_NODE_ALIVE_S (read where a node beats, at
# import) sets another: a site whose database stalls longer, or a test that loses a node on
# purpose; never under two beats, so one late beat does not lose a node.
NODE_ALIVE_ENV = "FRENZY_NODE_ALIVE_S"
NODE_ALIVE_DEFAULT_S = 30.0


def node_alive_s(raw: str | None) -> float:
    """The heartbeat's lifetime that ``raw`` (the environment's value, or None) asks for."""
    try:
        value = float(raw) if raw else NODE_ALIVE_DEFAULT_S
    except ValueError:
        value = NODE_ALIVE_DEFAULT_S
    return max(value, 2 * NODE_BEAT_S) if math.isfinite(value) else NODE_ALIVE_DEFAULT_S


NODE_ALIVE_S = node_alive_s(os.environ.get(NODE_ALIVE_ENV))
# How often a waiting node reads node 0's row: the wait lasts as long as node 0's flow run takes
# to start (seconds), so a quarter second adds little.
RENDEZVOUS_POLL_S = 0.25


# The states of a node that ended without completing: "oom" is a failure the dispatcher tells
# apart (its answer is a roomier plan, not the same plan again).
FAILED_STATES = ("failed", "oom")


class RendezvousTimeout(TimeoutError):
    """Node 0 did not publish its address within the wait."""


@dataclass(frozen=True)
class GangNode:
    gang_id: str
    node_rank: int
    job_id: str
    node_id: str
    address: str | None
    port: int | None
    state: str
    error: str
    alive_until: float
    step: int = 0

    @classmethod
    def of(cls, r: GangNodeRow) -> "GangNode":
        return cls(r.gang_id, r.node_rank, r.job_id, r.node_id, r.address, r.port, r.state, r.error,
                   r.alive_until, r.step)


class Gang:
    """The ``gang_nodes`` rows of one ledger."""

    def __init__(self, ledger: Ledger | str | None = None):
        self.ledger = ledger if isinstance(ledger, Ledger) else Ledger(ledger)

    def _upsert(self, gang_id: str, node_rank: int, **fields) -> None:
        with self.ledger._tx() as s:
            now = db_now(s)
            row = s.get(GangNodeRow, (gang_id, node_rank))
            if row is None:
                row = GangNodeRow(gang_id=gang_id, node_rank=node_rank, job_id=fields.pop("job_id", ""))
            for k, v in fields.items():
                setattr(row, k, v)
            row.alive_until = now + NODE_ALIVE_S
            row.updated_at = now
            s.add(row)

    def join(self, gang_id: str, node_rank: int, job_id: str, node_id: str = "") -> None:
        """The node's flow run started: its row exists and is alive."""
        self._upsert(gang_id, node_rank, job_id=job_id, node_id=node_id, state="starting")

    def publish(self, gang_id: str, address: str, port: int) -> None:
        """Node 0: the address and port its rendezvous store listens on."""
        self._upsert(gang_id, 0, address=address, port=int(port), state="running")

    def beat(self, gang_id: str, node_rank: int, state: str = "running", step: int | None = None) -> None:
        """The node is alive; ``step``: its last finished training step, when it knows one."""
        self._upsert(gang_id, node_rank, state=state, **({"step": int(step)} if step is not None else {}))

    def finish(self, gang_id: str, node_rank: int, state: str, error: str = "") -> None:
        self._upsert(gang_id, node_rank, state=state, error=error[:500])

    def nodes(self, gang_id: str) -> list[GangNode]:
        with self.ledger._read() as s:
            rows = s.exec(select(GangNodeRow).where(GangNodeRow.gang_id == gang_id)
                          .order_by(GangNodeRow.node_rank)).all()
            return [GangNode.of(r) for r in rows]

    def now(self) -> float:
        with self.ledger._read() as s:
            return db_now(s)

    def wait_rendezvous(self, gang_id: str, timeout_s: float, *, poll_s: float = RENDEZVOUS_POLL_S) -> tuple[str, int]:
        """Node 0's published ``(address, port)``; ``RendezvousTimeout`` after ``timeout_s``
        (and at once when node 0 already ended failed)."""
        end = time.monotonic() + max(0.0, timeout_s)
        while True:
            with self.ledger._read() as s:
                row = s.get(GangNodeRow, (gang_id, 0))
                if row is not None and row.address and row.port:
                    return row.address, int(row.port)
                if row is not None and row.state in FAILED_STATES:
                    raise RendezvousTimeout(f"node 0 of gang {gang_id} failed before it published its address: "
                                            f"{row.error or 'no reason given'}")
            if time.monotonic() >= end:
                raise RendezvousTimeout(f"node 0 of gang {gang_id} did not publish its address within "
                                        f"{timeout_s:.0f} s")
            time.sleep(poll_s)

    def lost(self, gang_id: str, ranks: int, nodes: list[GangNode] | None = None) -> dict[int, str]:
        """Nodes of the gang that are gone: rank -> why (its row failed, or its heartbeat ran
        out). A node without a row yet (its flow run not started) is not lost: the dispatcher
        bounds that wait itself. ``nodes``: the gang's rows when the caller has just read them."""
        now = self.now()
        out: dict[int, str] = {}
        for n in self.nodes(gang_id) if nodes is None else nodes:
            if n.node_rank >= ranks:
                continue
            if n.state in FAILED_STATES:
                how = "ran out of memory" if n.state == "oom" else "failed"
                out[n.node_rank] = f"node {n.node_rank} ({n.node_id or '?'}) {how}: {n.error or 'no reason given'}"
            elif n.state != "done" and n.alive_until < now:
                out[n.node_rank] = (f"node {n.node_rank} ({n.node_id or '?'}) stopped answering "
                                    f"{now - n.alive_until + NODE_ALIVE_S:.0f} s ago (its worker is gone)")
        return out


def node_address(ledger: Ledger, node_id: str) -> str | None:
    """The address the cluster file gives ``node_id`` (``addresses`` of its pool), or None."""
    from .tables import NodeRow

    with ledger._read() as s:
        row = s.get(NodeRow, node_id)
        return row.address if row is not None and row.address else None
