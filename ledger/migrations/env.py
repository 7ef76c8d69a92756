"""Alembic environment of the GPU ledger. The ledger runs it in-process with its own open
connection (``config.attributes["connection"]``, already inside a transaction that holds the
database's write lock); the ``python -m ledger.migrations`` helper runs it on a scratch SQLite
file to autogenerate a revision."""
from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine
from sqlmodel import SQLModel

import ledger.tables  # noqa: F401  (registers every ledger table on SQLModel.metadata)

try:                       # other ledger modules that define tables register them too
    import ledger.queue  # noqa: F401
except ImportError:
    pass


def _run(connection) -> None:
    context.configure(connection=connection, target_metadata=SQLModel.metadata,
                      render_as_batch=True,   # SQLite has no ALTER COLUMN: batch mode copies the table
                      compare_type=True)
    with context.begin_transaction():
        context.run_migrations()


conn = context.config.attributes.get("connection")
if conn is not None:
    _run(conn)
else:
    engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
    with engine.begin() as c:
        _run(c)
    engine.dispose()
