"""queue start reason

Revision ID: 0007_queue_start_reason
Revises: 0006_gang_node_step
Create Date: 2026-12-06 15:30:00.000000

``queue_jobs.start_reason``: why the scheduler started a job's current run ("stopgap", ...), which
the policy reads back as ``RunningJob.reason``. A round reads it, so its update moves the row's
change marker (0005): the table's update trigger is recreated with the new column.
"""
from __future__ import annotations

import importlib

import sqlalchemy as sa
import sqlmodel
from alembic import op


revision = '0007_queue_start_reason'
down_revision = '0006_gang_node_step'
branch_labels = None
depends_on = None

_MARKS = importlib.import_module("ledger.migrations.versions.0005_change_markers")
BEFORE = _MARKS.MARKED["queue_jobs"]
AFTER = [*BEFORE, "start_reason"]


def _update_trigger(cols: list[str]) -> None:
    """Replace queue_jobs' marker-moving update trigger by one over ``cols`` (0005's statement)."""
    postgres = op.get_bind().dialect.name == "postgresql"
    op.execute("DROP TRIGGER IF EXISTS frenzy_chg_upd ON queue_jobs" if postgres
               else "DROP TRIGGER IF EXISTS frenzy_chg_upd_queue_jobs")
    op.execute(_MARKS.update_trigger("queue_jobs", cols, postgres))


def upgrade() -> None:
    # a plain ALTER TABLE ADD COLUMN (SQLite can, with a constant default): no table copy, so
    # 0005's other triggers stay
    op.add_column('queue_jobs', sa.Column('start_reason', sqlmodel.sql.sqltypes.AutoString(), nullable=False,
                                          server_default=''))
    _update_trigger(AFTER)


def downgrade() -> None:
    _update_trigger(BEFORE)        # SQLite refuses to drop a column a trigger names
    # ALTER TABLE DROP COLUMN (SQLite >= 3.35): no table copy either
    op.drop_column('queue_jobs', 'start_reason')
