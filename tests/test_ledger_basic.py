"""The GPU ledger against real SQLite (and PostgreSQL when FRENZY_TEST_POSTGRES_URL is set)."""
import time
import uuid

import pytest

from estimator.errors import FrenzyInputError
from estimator.plan import Plan
from ledger import Ledger, LedgerConflict, LeaseLost
from scheduler.cluster import parse_cluster

CLUSTER = parse_cluster("""
pools:
  - {name: a100, gpu: A100-80GB, nodes: 2, gpus_per_node: 4}
  - {name: rtx, gpu: RTX3090-24GB, nodes: 1, gpus_per_node: 2}
""")


def pg_schema_url(base: str) -> tuple[str, str]:
    """A private schema per test, so tests never see each other's rows."""
    import sqlalchemy as sa
    schema = "frenzy_t_" + uuid.uuid4().hex[:10]
    url = base.replace("postgresql://", "postgresql+psycopg://", 1) if base.startswith("postgresql://") else base
    eng = sa.create_engine(url)
    with eng.begin() as c:
        c.execute(sa.text(f"CREATE SCHEMA {schema}"))
    eng.dispose()
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options=-csearch_path%3D{schema}", schema


def drop_schema(base: str, schema: str) -> None:
    import sqlalchemy as sa
    url = base.replace("postgresql://", "postgresql+psycopg://", 1) if base.startswith("postgresql://") else base
    eng = sa.create_engine(url)
    with eng.begin() as c:
        c.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
    eng.dispose()


@pytest.fixture(params=["sqlite", "postgres"])
def ledger(request, tmp_path):
    if request.param == "sqlite":
        led = Ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
        led.sync_cluster(CLUSTER)
        yield led
        return
    base = request.getfixturevalue("postgres_url")
    url, schema = pg_schema_url(base)
    led = Ledger(url)
    led.sync_cluster(CLUSTER)
    yield led
    led._write_engine.dispose()
    drop_schema(base, schema)


def A(n, **kw):
    return Plan(gpu_type="A100-80GB", gpus=n, dp=n, step_time_s=2.0, **kw)


def test_default_url_under_frenzy_home(frenzy_home, monkeypatch):
    monkeypatch.delenv("FRENZY_LEDGER_URL", raising=False)
    led = Ledger()
    assert led.url.endswith("/ledger.db") and str(frenzy_home) in led.url
    led.sync_cluster(CLUSTER)
    assert (frenzy_home / "ledger.db").exists()


def test_sync_is_idempotent_and_state_matches(ledger):
    ledger.sync_cluster(CLUSTER)
    st = ledger.cluster_state()
    assert [(n.node_id, n.gpus, n.free) for n in st.nodes] == [
        ("a100-0", 4, [0, 1, 2, 3]), ("a100-1", 4, [0, 1, 2, 3]), ("rtx-0", 2, [0, 1])]
    assert st.gpu_memory_gib["A100-80GB"] == 80.0 and st.running == []


def test_allocate_release_and_state(ledger):
    ledger.submit_job("j1", "j1", {"train_steps": 100})
    a = ledger.allocate("j1", A(2), {"a100-1": [2, 3]})
    assert a.pool == "a100" and a.gpu_type == "A100-80GB" and a.devices == ["2", "3"]
    assert a.expected_end_at == pytest.approx(a.created_at + 200.0)
    st = ledger.cluster_state()
    assert {n.node_id: n.free for n in st.nodes}["a100-1"] == [0, 1]
    [r] = st.running
    assert r.job_id == "j1" and r.placement == {"a100-1": [2, 3]} and r.plan == A(2)
    assert ledger.release(a.id) is True
    assert ledger.release(a.id) is False                       # idempotent
    assert ledger.cluster_state().running == []


def test_conflicts_and_bad_requests_change_nothing(ledger):
    a = ledger.allocate("j1", A(2), {"a100-0": [0, 1]})
    before = (ledger.holders(), [x.id for x in ledger.allocations()])
    with pytest.raises(LedgerConflict):
        ledger.allocate("j2", A(3), {"a100-0": [1, 2, 3]})      # GPU 1 is taken
    with pytest.raises(FrenzyInputError, match="unknown GPU a100-9:0"):
        ledger.allocate("j2", A(1), {"a100-9": [0]})
    with pytest.raises(FrenzyInputError, match="unknown GPU a100-0:7"):
        ledger.allocate("j2", A(2), {"a100-0": [2, 7]})
    with pytest.raises(FrenzyInputError, match="is a RTX3090-24GB"):
        ledger.allocate("j2", A(1), {"rtx-0": [0]})
    with pytest.raises(FrenzyInputError, match="needs 4"):
        ledger.allocate("j2", A(4), {"a100-1": [0, 1]})
    with pytest.raises(FrenzyInputError, match="unknown allocation"):
        ledger.release("no-such-allocation")
    assert (ledger.holders(), [x.id for x in ledger.allocations()]) == before
    assert ledger.cluster_state().nodes[0].free == [2, 3] and a.id in before[1]


def test_best_fit_uses_the_policies_placement(ledger):
    ledger.allocate("j0", A(3), {"a100-0": [0, 1, 2]})
    b = ledger.allocate_best_fit("j1", A(1))
    assert b.placement == {"a100-0": [3]}                      # exact fit, not the empty node
    c = ledger.allocate_best_fit("j2", A(4))
    assert c.placement == {"a100-1": [0, 1, 2, 3]}
    assert ledger.allocate_best_fit("j3", A(1)) is None        # all A100s held
    rtx = ledger.allocate_best_fit("j4", Plan(gpu_type="RTX3090-24GB", gpus=2, dp=2))
    assert rtx.devices == ["0", "1"]


def test_best_fit_on_one_pool_leaves_another_pools_gpus_of_the_type(ledger):
    from scheduler.cluster import parse_cluster
    ledger.sync_cluster(parse_cluster("""
pools:
  - {name: a100, gpu: A100-80GB, nodes: 2, gpus_per_node: 4}
  - {name: a100b, gpu: A100-80GB, nodes: 1, gpus_per_node: 4}
  - {name: rtx, gpu: RTX3090-24GB, nodes: 1, gpus_per_node: 2}
"""))
    ledger.allocate("j0", A(4), {"a100-0": [0, 1, 2, 3]})
    ledger.allocate("j1", A(3), {"a100-1": [0, 1, 2]})
    anywhere = ledger.allocate_best_fit("j2", A(1))
    assert anywhere.placement == {"a100-1": [3]}                 # the exact fit
    ledger.release(anywhere.id)
    own = ledger.allocate_best_fit("j2", A(1), pool="a100b")
    assert own.pool == "a100b" and own.placement == {"a100b-0": [0]}
    assert ledger.allocate_best_fit("j3", A(4), pool="a100") is None   # a100 has 1 free GPU left


def test_expired_lease_frees_gpus_and_heartbeat_keeps_them(ledger):
    crashed = ledger.allocate("crashed", A(4), {"a100-0": [0, 1, 2, 3]}, lease_s=0.2)
    alive = ledger.allocate("alive", A(4), {"a100-1": [0, 1, 2, 3]}, lease_s=0.6)
    with ledger.lease(alive.id, every_s=0.1, lease_s=0.6) as beat:
        time.sleep(1.0)
        assert ledger.expire_leases() == [crashed.id]
    assert beat["beats"] >= 3
    st = ledger.cluster_state()
    assert {n.node_id: n.free for n in st.nodes}["a100-0"] == [0, 1, 2, 3]
    assert [r.job_id for r in st.running] == ["alive"]
    with pytest.raises(LeaseLost):
        ledger.heartbeat(crashed.id)
    assert ledger.release(crashed.id) is False                 # already expired: no-op
    assert ledger.allocation(crashed.id).status == "expired"
    # the freed GPUs can be allocated again
    assert ledger.allocate_best_fit("next", A(4)).placement == {"a100-0": [0, 1, 2, 3]}


def test_cluster_change_deactivates_but_keeps_holders(ledger):
    a = ledger.allocate("j", Plan(gpu_type="RTX3090-24GB", gpus=1), {"rtx-0": [1]})
    smaller = parse_cluster("pools:\n  - {name: a100, gpu: A100-80GB, nodes: 1, gpus_per_node: 4}\n")
    assert ledger.sync_cluster(smaller, prune=True) == ["rtx"]
    st = ledger.cluster_state()
    assert [n.node_id for n in st.nodes] == ["a100-0"]
    with pytest.raises(FrenzyInputError):
        ledger.allocate("k", A(1), {"a100-1": [0]})
    assert ledger.release(a.id) is True
    ledger.sync_cluster(CLUSTER)
    assert len(ledger.cluster_state().nodes) == 3


def test_jobs_plans_measurements(ledger):
    ledger.submit_job("j", "my-job", {"train_tokens": 1000, "global_batch": 2, "seq_len": 50})
    plans = [A(2, device_used_gib=30), A(4, device_used_gib=20)]
    ledger.record_plans("j", plans)
    ledger.record_plans("j", plans)                             # replaces, not appends
    assert ledger.plans("j") == plans
    a = ledger.allocate("j", plans[0], {"a100-0": [0, 1]})
    assert a.expected_end_at == pytest.approx(a.created_at + 10 * 2.0)   # 1000 / (2 * 50) steps
    ledger.record_measurement("j", a.id, "A100-80GB", plans[0],
                              predicted={"device_used_gib": 30.0, "step_time_s": 2.0},
                              measured={"nvml_used_gib": 31.5, "step_time_s": 2.4, "tokens_per_s": 41.7})
    ledger.record_measurement("j", a.id, "RTX3090-24GB", plans[0], predicted={}, measured={})
    [m] = ledger.measurements(gpu_type="A100-80GB")
    assert (m.predicted_device_used_gib, m.measured_device_used_gib, m.measured_step_time_s) == (30.0, 31.5, 2.4)
    assert m.plan["gpus"] == 2 and len(ledger.measurements()) == 2


def test_corrupt_cluster_changes_nothing(ledger, tmp_path):
    from scheduler.cluster import Cluster, Pool, load_cluster

    before = ledger.cluster_state()
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  - {name: a100, gpu: A100-80GB, nodes: 2, gpus_per_node: 4}\n  - {name: x, gpu: Nope-1GB}\n")
    with pytest.raises(FrenzyInputError):
        ledger.sync_cluster(load_cluster(bad))
    # a Cluster built around the loader (unknown GPU type) fails inside the transaction: rolled back
    sneaky = Cluster(pools=[Pool(name="a100", gpu="A100-80GB", nodes=1, gpus_per_node=4),
                            Pool(name="zz", gpu="Nope-1GB", nodes=1, gpus_per_node=1)])
    with pytest.raises(FrenzyInputError):
        ledger.sync_cluster(sneaky)
    after = ledger.cluster_state()
    assert [(n.node_id, n.free) for n in after.nodes] == [(n.node_id, n.free) for n in before.nodes]


def test_a_shared_ledger_keeps_every_clusters_pools(ledger):
    """Syncing one cluster changes only its own pools; others go only by prune or remove_pools."""
    other = parse_cluster("pools:\n  - {name: h100, gpu: H100-80GB, nodes: 1, gpus_per_node: 8}\n")
    assert ledger.sync_cluster(other) == []
    assert [n.node_id for n in ledger.cluster_state().nodes] == ["a100-0", "a100-1", "h100-0", "rtx-0"]
    shrunk = parse_cluster("pools:\n  - {name: a100, gpu: A100-80GB, nodes: 1, gpus_per_node: 4}\n")
    ledger.sync_cluster(shrunk)                     # a100 loses a node; rtx and h100 untouched
    assert [n.node_id for n in ledger.cluster_state().nodes] == ["a100-0", "h100-0", "rtx-0"]
    h = ledger.allocate_best_fit("h", Plan(gpu_type="H100-80GB", gpus=8, dp=8))
    assert h is not None and h.placement == {"h100-0": list(range(8))}
    with pytest.raises(FrenzyInputError, match="no pool nope"):
        ledger.remove_pools(["h100", "nope"])
    assert ledger.remove_pools(["h100"]) == ["h100"]
    assert [n.node_id for n in ledger.cluster_state().nodes] == ["a100-0", "rtx-0"]
    assert ledger.holders()[("h100-0", 0)] == h.id   # a running job keeps its GPUs until released
    assert ledger.release(h.id) is True
    assert ledger.allocate_best_fit("h2", Plan(gpu_type="H100-80GB", gpus=1)) is None
    assert ledger.sync_cluster(CLUSTER, prune=True) == []          # h100 already inactive
    ledger.sync_cluster(other)                                     # a sync brings it back
    assert ledger.allocate_best_fit("h3", Plan(gpu_type="H100-80GB", gpus=1)) is not None
