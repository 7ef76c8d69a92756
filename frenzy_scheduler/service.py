"""A scheduler process: leadership on the ledger, then the round loop while it leads.

``frenzy scheduler`` runs one in the foreground; ``frenzy run`` (through the submit flow) starts
an embedded one in a thread, so a laptop needs nothing else. Every scheduler tries for the one
leadership lease (``ledger.queue.Leadership``): the holder renews it every third of its TTL and
runs rounds; the others stand by, try again every poll, and take over once the lease ran out
(the holder died) or was given up (a clean exit). A scheduler applies a round only while its
lease is valid by its own monotonic clock (``fence``), and each of its writes checks, in its own
transaction, that it still holds the lease at the epoch it acquired (``ledger.queue.LeaseFence``):
a holder that stalled past its TTL, even inside a round, cannot act on a round it computed before.
"""
from __future__ import annotations

import atexit
import logging
import os
import socket
import threading
import time
from typing import Any, Callable

from ledger import Ledger
from ledger.queue import Leadership, LeadershipLost
from scheduler.loop import RoundLoop
from scheduler.policies import get_policy
from scheduler.types import Policy

from .collector import collector_held
from .source import START_LEASE_S, LedgerSource, queue_table

log = logging.getLogger("frenzy.scheduler")

# Leadership lease. A standby takes over at most TTL + one poll after the leader died; 15 s
# keeps a laptop's submissions from waiting long after a crash, while the leader's renewal
# every 5 s survives a few seconds of database stall.
DEFAULT_TTL_S = 15.0
# Rounds run on every change the poll sees; 0.5 s keeps a job's start within a second of its
# submission at two small queries per poll.
DEFAULT_POLL_S = 0.5
# The tick for waiting jobs (aging, reservations coming due) and idle GPUs under growable runs.
# The simulator's default is 300 s for hour-long jobs; live jobs of minutes need a tick well
# under their length for waits to be revisited.
DEFAULT_TICK_S = 30.0
# Expired GPU leases and abandoned jobs are reaped at least this often (and their GPUs freed
# within one allocation lease TTL plus this).
DEFAULT_REAP_S = 5.0


def default_holder(kind: str = "scheduler") -> str:
    return f"{kind}:{socket.gethostname()}:{os.getpid()}:{threading.get_ident() % 100000}"


class SchedulerService:
    def __init__(self, ledger: Ledger | str | None = None, policy: str | Policy = "frenzy", *,
                 holder: str | None = None, ttl_s: float = DEFAULT_TTL_S, tick_s: float = DEFAULT_TICK_S,
                 poll_s: float = DEFAULT_POLL_S, reap_s: float = DEFAULT_REAP_S,
                 publish: Callable[[str, dict[str, Any]], None] | None = None,
                 on_queue: Callable[[list[dict[str, Any]]], None] | None = None,
                 lease_s: float = START_LEASE_S):
        self.ledger = ledger if isinstance(ledger, Ledger) else Ledger(ledger)
        self.policy_spec = policy
        if isinstance(policy, str):
            get_policy(policy)                 # an unknown name fails here, in one line
        self.leadership = Leadership(self.ledger, holder or default_holder(), ttl_s)
        self.ttl_s, self.tick_s, self.poll_s, self.reap_s = ttl_s, tick_s, poll_s, reap_s
        self.source = LedgerSource(self.ledger, fence=self._fence, publish=publish, lease_s=lease_s)
        self.on_queue = on_queue
        self.loop: RoundLoop | None = None
        self.leading = False
        self.stopped = threading.Event()
        self._valid_until = 0.0
        self._renew_at = 0.0
        self.takeovers = 0
        # database clock - this host's clock, measured at each leadership renewal: rounds run on
        # the database's clock, which stamps submissions, starts and leases (a host whose clock
        # is off shifted preemption grace, aging and predicted starts by its error)
        self._skew = 0.0

    def db_clock(self) -> float:
        """The database's time now, from this host's clock and the last measured skew."""
        return time.time() + self._skew

    def _measure_skew(self) -> None:
        try:
            t0 = time.time()
            db = self.source.queue.now()
            self._skew = db - (t0 + time.time()) / 2.0
        except Exception as err:           # the last skew stands until the next renewal
            log.warning("could not read the database clock: %s", err)

    # --- leadership -----------------------------------------------------------------------
    def _fence(self) -> bool:
        return self.leading and time.monotonic() < self._valid_until

    def _policy(self) -> Policy:
        spec = self.policy_spec
        return get_policy(spec) if isinstance(spec, str) else spec

    def _check_leadership(self) -> None:
        t = time.monotonic()
        if t < self._renew_at:
            return
        try:
            # a standby only reads while another holds a live lease: no write per poll
            cur = None if self.leading else self.leadership.current()
            held = cur is not None and cur["holder"] != self.leadership.holder and not cur["expired"]
            led = False if held else self.leadership.acquire()
        except Exception as err:          # the database is away: act as a standby until it is back
            log.warning("leadership check failed: %s", err)
            led = False
        if led:
            self._valid_until = t + self.ttl_s
            self._renew_at = t + self.ttl_s / 3.0
            # kept after a loss too: a write that slips past the monotonic fence fails there
            self.source.queue.fence = self.leadership.fence()
            self._measure_skew()
            if not self.leading:
                self.takeovers += 1
                log.info("leading as %s (epoch %s)", self.leadership.holder, self.leadership.epoch)
                # a fresh policy: policies keep per-job notes that a new leader must rebuild
                self.loop = RoundLoop(self._policy(), self.source, clock=self.db_clock, tick_s=self.tick_s,
                                      reap_s=self.reap_s, on_round=self._on_round)
        else:
            self._renew_at = t + self.poll_s
            if self.leading:
                log.warning("lost leadership to %s", (self.leadership.current() or {}).get("holder"))
            self.loop = None
        self.leading = led

    # --- running --------------------------------------------------------------------------
    def step(self) -> None:
        self._check_leadership()
        if self.leading and self.loop is not None:
            try:
                with collector_held():    # no collector pass inside a round (collector.py)
                    self.loop.step()
            except LeadershipLost as err:  # a standby took over while this round was written
                log.warning("leadership lost during a round, the rest of it not applied: %s", err)
                # a standby: the next poll asks the lease again, and leading again is a takeover
                # (a fresh loop and policy; this loop counted the dropped round as done)
                self.leading, self.loop = False, None
                self._valid_until = self._renew_at = 0.0
            except Exception:             # a policy bug or a database error: logged, next poll retries
                log.exception("scheduling round failed")

    def run(self, *, max_s: float | None = None) -> None:
        """Until ``stop()`` (or ``max_s`` seconds): lead or stand by, run rounds while leading."""
        end = None if max_s is None else time.monotonic() + max_s
        try:
            while not self.stopped.is_set() and (end is None or time.monotonic() < end):
                self.step()
                self.stopped.wait(self.poll_s)
        finally:
            if self.leading:
                try:
                    self.leadership.release()
                except Exception as err:
                    log.warning("could not give up leadership: %s", err)
                self.leading = False

    def stop(self) -> None:
        self.stopped.set()

    def _on_round(self, result, snap, now: float) -> None:
        if self.on_queue is None:
            return
        try:
            # the view needs no candidate plans (~80 KB a row)
            self.on_queue(queue_table(self.source.queue.jobs(plans=False), now))
        except Exception as err:          # the UI is a view: never stops scheduling
            log.warning("could not publish the queue: %s", err)


# --- the embedded scheduler -----------------------------------------------------------------
_EMBEDDED: dict[str, tuple[SchedulerService, threading.Thread]] = {}
_EMBEDDED_LOCK = threading.Lock()


def ensure_embedded_scheduler(ledger_url: str | None, policy: str = "frenzy", *,
                              publish=None, on_queue=None, **kw: Any) -> SchedulerService:
    """A scheduler thread in this process for the ledger at ``ledger_url`` (one per ledger; a
    later call with another policy reuses the first). It stands by while another scheduler (a
    site's ``frenzy scheduler``) leads, and gives its lease up at exit."""
    ledger = Ledger(ledger_url)
    with _EMBEDDED_LOCK:
        hit = _EMBEDDED.get(ledger.url)
        if hit is not None and hit[1].is_alive():
            return hit[0]
        svc = SchedulerService(ledger, policy, holder=default_holder("embedded"), publish=publish,
                               on_queue=on_queue, **kw)
        t = threading.Thread(target=svc.run, name="frenzy-embedded-scheduler", daemon=True)
        t.start()
        _EMBEDDED[ledger.url] = (svc, t)
        return svc


def stop_embedded_schedulers(timeout_s: float = 5.0) -> None:
    with _EMBEDDED_LOCK:
        items = list(_EMBEDDED.values())
        _EMBEDDED.clear()
    for svc, t in items:
        svc.stop()
    for svc, t in items:
        t.join(timeout_s)


atexit.register(stop_embedded_schedulers)
