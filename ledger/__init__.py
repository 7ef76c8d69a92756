"""The GPU ledger (SQLModel): pools, nodes, GPUs, jobs, plans, allocations with leases, and
measurements. SQLite by default (WAL, ``BEGIN IMMEDIATE``), PostgreSQL by URL (row locks).
The schema is versioned with Alembic (``ledger.migrations``)."""
from .core import (DEFAULT_LEASE_S, Allocation, Ledger, LedgerConflict, LedgerGone, LedgerUnavailable, LeaseLost,
                   LeaseState, Measurement, default_url)
from .migrations import LedgerSchemaError

__all__ = ["Ledger", "Allocation", "Measurement", "LedgerConflict", "LeaseLost", "DEFAULT_LEASE_S", "default_url",
           "LedgerSchemaError", "LeaseState",
           "LedgerGone", "LedgerUnavailable"]
