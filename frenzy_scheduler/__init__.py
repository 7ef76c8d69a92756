"""The live scheduler: the pure round loop (``scheduler.loop``) over the ledger, with
leadership, reaping, the queue view and an event for every decision."""
from .service import SchedulerService, ensure_embedded_scheduler
from .source import LedgerSource

__all__ = ["LedgerSource", "SchedulerService", "ensure_embedded_scheduler"]
