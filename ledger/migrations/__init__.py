"""Schema versions of the GPU ledger (Alembic).

The schema comes only from these revisions (never ``create_all``). Opening a ledger
(``ledger.Ledger(url)``, once per process and URL) calls ``ensure_schema``, which inside one
transaction holding the database's write lock (SQLite ``BEGIN IMMEDIATE``, PostgreSQL an
advisory lock), so concurrent first opens serialise:

- an empty database gets every revision up to the head;
- a file made before versioning (the ledger's tables, no ``alembic_version``) is stamped with
  the baseline revision ``0001_baseline`` and upgraded in place from there;
- a database at an older revision is upgraded in place;
- a database at a revision this code does not know (written by a newer Frenzy) is refused
  with one line naming that revision (``LedgerSchemaError``), before anything is written.

Adding a table or a column (e.g. in ``ledger/tables.py`` or another ledger module):

1. change the SQLModel classes (a new module with tables: also import it in ``env.py``);
2. generate the revision from the difference between the models and the current head::

       PYTHONPATH=. python -m ledger.migrations revision "add the job queue"

   It writes ``ledger/migrations/versions/<NNNN>_<slug>.py`` with ``down_revision`` set to the
   current head; read it, keep it to explicit ``op.*`` calls (never import the models: a
   revision must keep meaning what it meant when written), and commit it with the model change;
3. ``tests/test_ledger_migrations.py`` checks that the head equals the models (no pending
   difference) and that an old file upgrades.

Two branches that each add a revision on the same head give Alembic two heads; the ledger
then refuses to open until one revision is rebased onto the other (set its ``down_revision``).
"""
from __future__ import annotations

import re
import time
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Engine
from sqlalchemy.exc import OperationalError

from estimator.errors import FrenzyInputError

HERE = Path(__file__).resolve().parent
BASELINE = "0001_baseline"
# Any lock key unique to the ledger's schema step; only ever taken inside one transaction.
_PG_SCHEMA_LOCK = 7346022


class LedgerSchemaError(FrenzyInputError):
    """The ledger's schema version is not one this code can use (newer, or unresolvable)."""

    def __init__(self, rule: str):
        super().__init__("ledger", rule)


def config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.set_main_option("file_template", "%%(rev)s")      # versions/<rev id>.py
    return cfg


def script() -> ScriptDirectory:
    return ScriptDirectory.from_config(config())


def head() -> str:
    heads = script().get_heads()
    if len(heads) != 1:
        raise LedgerSchemaError(f"this Frenzy's ledger migrations have {len(heads)} heads "
                                f"({', '.join(sorted(heads))}); set one revision's down_revision to the other")
    return heads[0]


def current(engine: Engine) -> str | None:
    """The database's revision (None: unversioned or empty)."""
    with engine.connect() as conn:
        heads = MigrationContext.configure(conn).get_current_heads()
    return heads[0] if heads else None


def ensure_schema(engine: Engine, read_engine: Engine | None = None, *, attempts: int = 20) -> str:
    """Bring the database at ``engine`` to the head revision (see the module docstring);
    returns the head. ``engine`` must be the ledger's writing engine (SQLite: BEGIN IMMEDIATE);
    ``read_engine`` (default ``engine``) serves the lock-free check that it is already there."""
    want = head()
    for attempt in range(attempts):
        try:
            with (read_engine or engine).connect() as conn:   # cheap path: at the head, no lock
                if MigrationContext.configure(conn).get_current_heads() == (want,):
                    return want
            with engine.begin() as conn:
                if conn.dialect.name == "postgresql":
                    conn.execute(text(f"SELECT pg_advisory_xact_lock({_PG_SCHEMA_LOCK})"))
                _upgrade_locked(conn, want)
            return want
        except OperationalError:                     # SQLite: another process holds the lock
            if attempt == attempts - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    return want


def _upgrade_locked(conn, want: str) -> None:
    heads = MigrationContext.configure(conn).get_current_heads()
    if heads == (want,):
        return
    sd = script()
    known = {r.revision for r in sd.walk_revisions()}
    unknown = [h for h in heads if h not in known]
    if unknown:
        raise LedgerSchemaError(
            f"the ledger's schema is at version {unknown[0]}, newer than this Frenzy knows "
            f"(newest {want}); upgrade Frenzy, or point it at another ledger")
    cfg = config()
    cfg.attributes["connection"] = conn
    if not heads and inspect(conn).has_table("gpus"):
        command.stamp(cfg, BASELINE)                 # made by create_all before versioning
    command.upgrade(cfg, "head")


def new_revision(message: str) -> Path:
    """Autogenerate a revision from the models' difference to the current head (on a scratch
    SQLite database). Returns the new file."""
    import tempfile

    from sqlalchemy import create_engine

    slug = re.sub(r"[^a-z0-9]+", "_", message.lower()).strip("_")[:27] or "revision"   # 4 digits + "_" + 27: alembic_version holds VARCHAR(32)
    sd = script()
    numbers = [int(m.group(1)) for r in sd.walk_revisions() if (m := re.match(r"(\d+)_", r.revision))]
    rev_id = f"{max(numbers, default=0) + 1:04d}_{slug}"
    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'scratch.db'}"
        engine = create_engine(url)
        with engine.begin() as conn:
            cfg = config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")
        engine.dispose()
        cfg = config()
        cfg.set_main_option("sqlalchemy.url", url)
        command.revision(cfg, message=message, autogenerate=True, rev_id=rev_id)
    return HERE / "versions" / f"{rev_id}.py"
