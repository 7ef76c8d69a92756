"""change markers: what a scheduling round mirrors is read incrementally

Revision ID: 0005_change_markers
Revises: 0004_gang_nodes

Every table a scheduling round reads (pools, nodes, gpus, allocations, queue_jobs) gets a
``chg`` column that the database's own triggers set, so no writer (this code, an older Frenzy,
a hand-written statement) can change a row without its marker moving:

* PostgreSQL: ``chg`` is the writing transaction's id (``pg_current_xact_id``). A reader that
  remembers the ``xmin`` of its snapshot (every transaction with a smaller id had finished)
  later reads ``chg >= xmin`` and sees every row changed since, whatever the commit order.
* SQLite: writers are serialised (``BEGIN IMMEDIATE``): ``chg`` is a counter in
  ``ledger_changes`` bumped per written row; a reader remembers the counter it saw.

A DELETE on these tables moves ``ledger_changes.deletes``: a mirror that sees it move reads
everything again (the ledger itself never deletes these rows; resets and tests do).

Updates that only renew liveness do not move the marker (a round never reads these columns):
``queue_jobs.alive_until`` and ``updated_at`` (the submitter's heartbeat, every second), and
``allocations.lease_expires_at`` (the run's lease renewal). The triggers list the columns that
do move it (``UPDATE OF``): a later revision that adds a column to one of these tables must
recreate that table's update trigger with the new column (``tests/test_ledger_mirror.py``
checks every column). SQLite batch operations that copy a table drop its triggers: recreate
them in the same revision.
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op


revision = '0005_change_markers'
down_revision = '0004_gang_nodes'
branch_labels = None
depends_on = None

# the columns whose update moves the marker, per table, as of this revision
MARKED = {
    "pools": ["name", "gpu_type", "nodes", "gpus_per_node", "inter_node_gbps", "gpu_memory_gib", "intra_link",
              "active"],
    "nodes": ["node_id", "pool", "idx", "address", "active"],
    "gpus": ["id", "node_id", "device_index", "pool", "gpu_type", "alloc_id", "active"],
    "allocations": ["id", "job_id", "pool", "gpu_type", "plan", "placement", "status", "created_at",
                    "expected_end_at", "ended_at"],
    "queue_jobs": ["job_id", "name", "job", "plans", "state", "submitted_at", "steps_total", "steps_done", "model",
                   "checkpoint_gb", "attained_gpu_s", "restarts", "preemptions", "resizes", "allocation_id",
                   "allocation", "started_at", "predicted_start_s", "wait_gpu_type", "wait_gpus", "wait_reason",
                   "request", "request_state", "flow_run_id", "error", "ended_at"],
}


def _cols(names: list[str]) -> str:
    return ", ".join(f'"{c}"' for c in names)


# SQLite: a written row takes the next counter value
_SQLITE_MARK = ("UPDATE ledger_changes SET counter = counter + 1 WHERE id = 1; "
                "UPDATE {t} SET chg = (SELECT counter FROM ledger_changes WHERE id = 1) WHERE rowid = NEW.rowid;")


def update_trigger(table: str, cols: list[str], postgres: bool) -> str:
    """The statement creating ``table``'s marker-moving update trigger over ``cols`` (a later
    revision adding a column drops the trigger and runs this with the longer list)."""
    if postgres:
        return (f"CREATE TRIGGER frenzy_chg_upd BEFORE UPDATE OF {_cols(cols)} ON {table} "
                "FOR EACH ROW EXECUTE FUNCTION frenzy_mark_change()")
    return (f"CREATE TRIGGER frenzy_chg_upd_{table} AFTER UPDATE OF {_cols(cols)} ON {table} "
            f"BEGIN {_SQLITE_MARK.format(t=table)} END")


def upgrade() -> None:
    op.create_table('ledger_changes',
                    sa.Column('id', sa.Integer(), nullable=False),
                    sa.Column('counter', sa.BigInteger(), nullable=False),
                    sa.Column('deletes', sa.BigInteger(), nullable=False),
                    sa.PrimaryKeyConstraint('id'))
    op.execute("INSERT INTO ledger_changes (id, counter, deletes) VALUES (1, 0, 0)")
    for table in MARKED:
        # plain ALTER TABLE ADD COLUMN (SQLite can, with a constant default): no table copy
        op.add_column(table, sa.Column('chg', sa.BigInteger(), server_default=sa.text('0'), nullable=False))
        op.create_index(f'ix_{table}_chg', table, ['chg'], unique=False)
    if op.get_bind().dialect.name == "postgresql":
        op.execute("""CREATE OR REPLACE FUNCTION frenzy_mark_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN NEW.chg := pg_current_xact_id()::text::bigint; RETURN NEW; END $$""")
        op.execute("""CREATE OR REPLACE FUNCTION frenzy_count_delete() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN UPDATE ledger_changes SET deletes = deletes + 1 WHERE id = 1; RETURN NULL; END $$""")
        for table, cols in MARKED.items():
            op.execute(f"CREATE TRIGGER frenzy_chg_ins BEFORE INSERT ON {table} "
                       "FOR EACH ROW EXECUTE FUNCTION frenzy_mark_change()")
            op.execute(update_trigger(table, cols, postgres=True))
            op.execute(f"CREATE TRIGGER frenzy_chg_del AFTER DELETE OR TRUNCATE ON {table} "
                       "FOR EACH STATEMENT EXECUTE FUNCTION frenzy_count_delete()")
    else:
        for table, cols in MARKED.items():
            op.execute(f"CREATE TRIGGER frenzy_chg_ins_{table} AFTER INSERT ON {table} "
                       f"BEGIN {_SQLITE_MARK.format(t=table)} END")
            op.execute(update_trigger(table, cols, postgres=False))
            op.execute(f"CREATE TRIGGER frenzy_chg_del_{table} AFTER DELETE ON {table} "
                       "BEGIN UPDATE ledger_changes SET deletes = deletes + 1 WHERE id = 1; END")


def downgrade() -> None:
    pg = op.get_bind().dialect.name == "postgresql"
    for table in MARKED:
        for kind in ("ins", "upd", "del"):
            op.execute(f"DROP TRIGGER IF EXISTS frenzy_chg_{kind} ON {table}" if pg
                       else f"DROP TRIGGER IF EXISTS frenzy_chg_{kind}_{table}")
        op.drop_index(f'ix_{table}_chg', table_name=table)
        with op.batch_alter_table(table, schema=None) as batch_op:
            batch_op.drop_column('chg')
    if pg:
        op.execute("DROP FUNCTION IF EXISTS frenzy_mark_change()")
        op.execute("DROP FUNCTION IF EXISTS frenzy_count_delete()")
    op.drop_table('ledger_changes')
