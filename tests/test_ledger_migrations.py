"""Ledger schema versions (Alembic): a new ledger is at the head, the head equals the models,
a ledger file made before versioning (``create_all``) is upgraded in place on open with its
rows kept, and a ledger written by a newer Frenzy is refused with one line naming its version.
On SQLite and (with FRENZY_TEST_POSTGRES_URL) PostgreSQL."""
import multiprocessing as mp
import sqlite3

import pytest
import sqlalchemy as sa

from estimator.plan import Plan
from ledger import Ledger, LedgerSchemaError
from ledger import migrations
from scheduler.cluster import parse_cluster

from .test_ledger_basic import drop_schema, pg_schema_url

CLUSTER = parse_cluster("pools:\n  - {name: a100, gpu: A100-80GB, nodes: 1, gpus_per_node: 4}\n")

# What `SQLModel.metadata.create_all` wrote into a SQLite ledger before schema versioning
# (dumped with `.schema` from a ledger made by that code): an unversioned file as users have it.
PRE_ALEMBIC_SQLITE = """
CREATE TABLE pools (
	name VARCHAR NOT NULL,
	gpu_type VARCHAR NOT NULL,
	nodes INTEGER NOT NULL,
	gpus_per_node INTEGER NOT NULL,
	inter_node_gbps FLOAT NOT NULL,
	gpu_memory_gib FLOAT NOT NULL,
	intra_link VARCHAR NOT NULL,
	active BOOLEAN NOT NULL,
	PRIMARY KEY (name)
);
CREATE TABLE jobs (
	job_id VARCHAR NOT NULL,
	name VARCHAR NOT NULL,
	spec JSON,
	status VARCHAR NOT NULL,
	steps INTEGER,
	submitted_at FLOAT NOT NULL,
	PRIMARY KEY (job_id)
);
CREATE TABLE measurements (
	id INTEGER NOT NULL,
	job_id VARCHAR NOT NULL,
	alloc_id VARCHAR,
	gpu_type VARCHAR NOT NULL,
	"plan" JSON,
	predicted JSON,
	measured JSON,
	predicted_device_used_gib FLOAT,
	measured_device_used_gib FLOAT,
	predicted_reserved_peak_gib FLOAT,
	measured_reserved_peak_gib FLOAT,
	predicted_step_time_s FLOAT,
	measured_step_time_s FLOAT,
	tokens_per_s FLOAT,
	created_at FLOAT NOT NULL,
	PRIMARY KEY (id)
);
CREATE INDEX ix_measurements_job_id ON measurements (job_id);
CREATE INDEX ix_measurements_gpu_type ON measurements (gpu_type);
CREATE TABLE nodes (
	node_id VARCHAR NOT NULL,
	pool VARCHAR NOT NULL,
	idx INTEGER NOT NULL,
	address VARCHAR,
	active BOOLEAN NOT NULL,
	PRIMARY KEY (node_id),
	FOREIGN KEY(pool) REFERENCES pools (name)
);
CREATE INDEX ix_nodes_pool ON nodes (pool);
CREATE TABLE plans (
	id INTEGER NOT NULL,
	job_id VARCHAR NOT NULL,
	rank INTEGER NOT NULL,
	gpu_type VARCHAR NOT NULL,
	gpus INTEGER NOT NULL,
	device_used_gib FLOAT NOT NULL,
	step_time_s FLOAT NOT NULL,
	"plan" JSON,
	PRIMARY KEY (id),
	FOREIGN KEY(job_id) REFERENCES jobs (job_id)
);
CREATE INDEX ix_plans_job_id ON plans (job_id);
CREATE TABLE allocations (
	id VARCHAR NOT NULL,
	job_id VARCHAR NOT NULL,
	pool VARCHAR NOT NULL,
	gpu_type VARCHAR NOT NULL,
	"plan" JSON,
	placement JSON,
	status VARCHAR NOT NULL,
	created_at FLOAT NOT NULL,
	lease_expires_at FLOAT NOT NULL,
	expected_end_at FLOAT,
	ended_at FLOAT,
	PRIMARY KEY (id),
	FOREIGN KEY(job_id) REFERENCES jobs (job_id)
);
CREATE INDEX ix_allocations_job_id ON allocations (job_id);
CREATE INDEX ix_allocations_status ON allocations (status);
CREATE TABLE gpus (
	id INTEGER NOT NULL,
	node_id VARCHAR NOT NULL,
	device_index INTEGER NOT NULL,
	pool VARCHAR NOT NULL,
	gpu_type VARCHAR NOT NULL,
	alloc_id VARCHAR,
	active BOOLEAN NOT NULL,
	PRIMARY KEY (id),
	CONSTRAINT uq_gpu_node_device UNIQUE (node_id, device_index),
	FOREIGN KEY(node_id) REFERENCES nodes (node_id)
);
CREATE INDEX ix_gpus_alloc_id ON gpus (alloc_id);
CREATE INDEX ix_gpus_type_free ON gpus (gpu_type, alloc_id);
"""


def _version(url: str) -> str | None:
    eng = sa.create_engine(url)
    try:
        return migrations.current(eng)
    finally:
        eng.dispose()


def _old_sqlite_file(path) -> str:
    con = sqlite3.connect(path)
    con.executescript(PRE_ALEMBIC_SQLITE)
    con.execute("INSERT INTO pools VALUES ('a100', 'A100-80GB', 1, 4, 100.0, 80.0, 'nvlink3', 1)")
    con.execute("INSERT INTO nodes VALUES ('a100-0', 'a100', 0, NULL, 1)")
    for d in range(4):
        con.execute("INSERT INTO gpus (node_id, device_index, pool, gpu_type, alloc_id, active) "
                    "VALUES ('a100-0', ?, 'a100', 'A100-80GB', ?, 1)", (d, "old-alloc" if d == 0 else None))
    con.execute("INSERT INTO jobs VALUES ('old-job', 'old-job', '{}', 'placed', 10, 1.0)")
    con.execute("INSERT INTO allocations VALUES ('old-alloc', 'old-job', 'a100', 'A100-80GB', ?, ?, "
                "'active', 1.0, 9e18, NULL, NULL)",
                ('{"gpu_type": "A100-80GB", "gpus": 1}', '{"a100-0": [0]}'))
    con.commit()
    con.close()
    return f"sqlite:///{path}"


def test_new_ledger_is_at_the_head_and_the_head_equals_the_models(tmp_path):
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext
    from sqlmodel import SQLModel

    url = f"sqlite:///{tmp_path / 'new.db'}"
    Ledger(url).sync_cluster(CLUSTER)
    assert _version(url) == migrations.head()
    eng = sa.create_engine(url)
    with eng.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}),
                                SQLModel.metadata)
    eng.dispose()
    # a model change without its revision shows here: run `python -m ledger.migrations revision`
    assert diff == [], diff


def test_baseline_is_exactly_the_pre_versioning_schema(tmp_path):
    from alembic import command

    old, new = tmp_path / "old.db", tmp_path / "new.db"
    sqlite3.connect(old).executescript(PRE_ALEMBIC_SQLITE)
    eng = sa.create_engine(f"sqlite:///{new}")
    with eng.begin() as conn:              # the baseline revision alone (later ones add columns)
        cfg = migrations.config()
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, migrations.BASELINE)
    eng.dispose()

    def shape(path):
        insp = sa.inspect(sa.create_engine(f"sqlite:///{path}"))
        return {t: (sorted((c["name"], str(c["type"]), c["nullable"]) for c in insp.get_columns(t)),
                    sorted((i["name"], tuple(i["column_names"])) for i in insp.get_indexes(t)),
                    sorted(tuple(u["column_names"]) for u in insp.get_unique_constraints(t)),
                    sorted((tuple(f["constrained_columns"]), f["referred_table"]) for f in insp.get_foreign_keys(t)))
                for t in insp.get_table_names() if t != "alembic_version"}

    before, after = shape(old), shape(new)
    assert set(before) == {"pools", "nodes", "gpus", "jobs", "plans", "allocations", "measurements"}
    assert {t: after[t] for t in before} == before


def test_pre_versioning_file_is_upgraded_in_place_keeping_its_rows(tmp_path):
    url = _old_sqlite_file(tmp_path / "old.db")
    assert _version(url) is None
    led = Ledger(url)
    assert _version(url) == migrations.head()
    assert [a.id for a in led.allocations()] == ["old-alloc"]
    assert led.cluster_state().nodes[0].free == [1, 2, 3]
    a = led.allocate_best_fit("new-job", Plan(gpu_type="A100-80GB", gpus=2, dp=2))
    assert a is not None and sorted(a.placement["a100-0"]) in ([1, 2], [2, 3])
    assert led.release("old-alloc") is True


def _refused(url: str) -> str:
    with pytest.raises(LedgerSchemaError) as err:
        Ledger(url)
    return str(err.value)


def test_newer_version_is_refused_with_one_line(tmp_path):
    url = f"sqlite:///{tmp_path / 'future.db'}"
    Ledger(url)
    con = sqlite3.connect(tmp_path / "future.db")
    con.execute("UPDATE alembic_version SET version_num = '0999_from_the_future'")
    con.commit()
    con.close()
    from ledger import core
    core._ENGINES.clear()                  # a fresh process would open it anew
    msg = _refused(url)
    assert "0999_from_the_future" in msg and migrations.head() in msg and "\n" not in msg
    assert msg.startswith("ledger: ")
    con = sqlite3.connect(tmp_path / "future.db")   # nothing was written
    assert con.execute("SELECT version_num FROM alembic_version").fetchall() == [("0999_from_the_future",)]


def _open(url, q):
    try:
        led = Ledger(url)
        led.sync_cluster(CLUSTER)
        q.put(("ok", migrations.head()))
    except Exception as e:  # report to the parent
        q.put(("err", f"{type(e).__name__}: {e}"))


def test_concurrent_first_opens_of_an_old_file_upgrade_once(tmp_path):
    url = _old_sqlite_file(tmp_path / "old.db")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_open, args=(url, q)) for _ in range(4)]
    for p in procs:
        p.start()
    results = [q.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert results == [("ok", migrations.head())] * 4, results
    assert _version(url) == migrations.head()


@pytest.mark.postgres
def test_postgres_old_schema_upgrades_and_newer_is_refused(postgres_url):
    from alembic import command

    url, schema = pg_schema_url(postgres_url)
    try:
        eng = sa.create_engine(url)
        with eng.begin() as conn:          # the baseline tables, unversioned, as create_all left them
            cfg = migrations.config()
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, migrations.BASELINE)
            conn.execute(sa.text("DROP TABLE alembic_version"))
            conn.execute(sa.text("INSERT INTO pools VALUES ('a100', 'A100-80GB', 1, 4, 100.0, 80.0, 'nvlink3', true)"))
        assert migrations.current(eng) is None
        led = Ledger(url)
        assert migrations.current(eng) == migrations.head()
        led.sync_cluster(CLUSTER)
        assert led.allocate_best_fit("j", Plan(gpu_type="A100-80GB", gpus=1)) is not None
        with eng.begin() as conn:
            conn.execute(sa.text("UPDATE alembic_version SET version_num = '0999_from_the_future'"))
        led._write_engine.dispose()
        from ledger import core
        core._ENGINES.clear()
        msg = _refused(url)
        assert "0999_from_the_future" in msg and "\n" not in msg
        eng.dispose()
    finally:
        drop_schema(postgres_url, schema)
