"""Ledger faults at the end of a run: a PostgreSQL outage shorter than the retries does not
lose the release; a longer one is reported as ``LedgerUnavailable`` (the lease frees the GPUs
later); a SQLite ledger file deleted or replaced mid-run makes the next write fail loudly
instead of starting an empty ledger where every GPU looks free."""
import os
import socket
import threading
import time

import pytest

from ledger import Ledger, LedgerGone, LedgerUnavailable, core

from .test_ledger_basic import CLUSTER, A, drop_schema, pg_schema_url


class Proxy:
    """A TCP proxy in front of PostgreSQL that can be cut (an outage) and restored."""

    def __init__(self, host: str, port: int):
        self.target = (host, port)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.sock.listen(64)
        self.up = True
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            if not self.up:
                c.close()
                continue
            u = socket.create_connection(self.target)
            self.conns += [c, u]
            for a, b in ((c, u), (u, c)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self):
        self.up = False
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.conns = []

    def restore(self):
        self.up = True


@pytest.fixture
def pg_behind_proxy(postgres_url, monkeypatch):
    from sqlalchemy.engine import make_url

    monkeypatch.setattr(core, "_END_RETRY_DELAYS_S", (0.2, 0.4, 0.8))     # 1.4 s in all
    url, schema = pg_schema_url(postgres_url)
    u = make_url(url)
    proxy = Proxy(u.host or "127.0.0.1", u.port or 5432)
    via = u.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    led = Ledger(via)
    led.sync_cluster(CLUSTER)
    yield led, proxy
    proxy.restore()
    led._write_engine.dispose()
    proxy.sock.close()
    drop_schema(postgres_url, schema)


@pytest.mark.postgres
def test_a_short_outage_at_the_end_does_not_lose_the_release(pg_behind_proxy):
    led, proxy = pg_behind_proxy
    a = led.allocate("j", A(2), {"a100-0": [0, 1]})
    proxy.cut()
    threading.Timer(0.5, proxy.restore).start()    # back within the retries
    assert led.release(a.id) is True
    assert led.allocation(a.id).status == "released"


@pytest.mark.postgres
def test_a_long_outage_is_reported_not_raised_as_a_raw_error(pg_behind_proxy):
    led, proxy = pg_behind_proxy
    a = led.allocate("j", A(2), {"a100-0": [0, 1]})
    proxy.cut()
    t0 = time.monotonic()
    with pytest.raises(LedgerUnavailable, match=f"release of allocation {a.id}: .*unreachable after 1.4 s"):
        led.release(a.id)
    with pytest.raises(LedgerUnavailable, match="measurement of job j"):
        led.record_measurement("j", a.id, "A100-80GB", A(2), predicted={}, measured={})
    assert time.monotonic() - t0 >= 2 * 1.4
    proxy.restore()
    assert led.allocation(a.id).status == "active"            # left to its lease, not lost


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_deleted_or_replaced_ledger_file_fails_the_next_write(tmp_path, how):
    path = tmp_path / "ledger.db"
    led = Ledger(f"sqlite:///{path}")
    led.sync_cluster(CLUSTER)
    a = led.allocate("j", A(4), {"a100-0": [0, 1, 2, 3]})
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(f"{path}{suffix}"):
            os.remove(f"{path}{suffix}")
    if how == "replaced":
        path.write_bytes(b"")
    with pytest.raises(LedgerGone, match=f"ledger file {path} was {how}"):
        led.release(a.id)
    with pytest.raises(LedgerGone):
        Ledger(f"sqlite:///{path}").cluster_state()            # a new handle in this process too
    assert how == "replaced" or not path.exists()              # nothing recreated it


def test_a_completed_training_stays_completed_when_the_ledger_is_down_at_the_end(tmp_path, frenzy_home, monkeypatch):
    """The end-of-run writes fail (as after the retries): the result keeps its status and losses,
    says ``ledger_error``, and the allocation is left to its lease."""
    import trainer.runner
    from estimator.job import TrainingJob
    from frenzy_flows.results import Assignment
    from frenzy_flows.training import run_allocated_training

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    led = Ledger(url)
    led.sync_cluster(CLUSTER)
    plan = A(1)
    alloc = led.allocate("j", plan, {"a100-0": [0]})

    def trained(job, plan, *, acquire, release, **_):      # the trainer, after its last step
        acquire(plan)
        return trainer.runner.TrainResult(status="completed", losses=[2.0, 1.5], attempts=[],
                                          measured=trainer.runner.Measured(step_time_s=0.1),
                                          checkpoint_dir=None, final_plan=plan)

    def down(self, *a, **k):
        raise LedgerUnavailable("release of allocation x: the ledger's database is unreachable")

    monkeypatch.setattr(trainer.runner, "run_training", trained)
    monkeypatch.setattr(Ledger, "record_measurement", down)
    monkeypatch.setattr(Ledger, "release", down)
    job = TrainingJob.model_validate({"name": "j", "model": "gpt2-tiny", "seq_len": 16, "global_batch": 2,
                                      "train_steps": 2})
    logs: list[str] = []
    result = run_allocated_training(job, "j", plan, Assignment.from_allocation(alloc, plan), ledger_url=url,
                                    log=logs.append)
    assert result.status == "completed" and result.losses == [2.0, 1.5]
    assert "unreachable" in result.ledger_error and "lease frees the GPUs" in result.ledger_error
    assert any(line.startswith("ledger: ") for line in logs)
    monkeypatch.undo()
    assert Ledger(url).allocation(alloc.id).status == "active"   # its lease, no longer renewed, frees it


def test_a_run_given_an_allocation_its_ledger_does_not_hold_is_refused_before_it_starts(tmp_path, frenzy_home,
                                                                                       monkeypatch):
    """A pool's worker without FRENZY_LEDGER_URL opens its own default ledger, where the
    scheduler's allocation is unknown: one line naming the setting, and nothing is trained."""
    import trainer.runner
    from estimator.errors import FrenzyInputError
    from estimator.job import TrainingJob
    from frenzy_flows.results import Assignment
    from frenzy_flows.training import run_allocated_training

    scheduler_ledger = Ledger(f"sqlite:///{tmp_path / 'scheduler.db'}")
    scheduler_ledger.sync_cluster(CLUSTER)
    plan = A(1)
    alloc = scheduler_ledger.allocate("j", plan, {"a100-0": [0]})
    started = []
    monkeypatch.setattr(trainer.runner, "run_training", lambda *a, **k: started.append(1))
    job = TrainingJob.model_validate({"name": "j", "model": "gpt2-tiny", "seq_len": 16, "global_batch": 2,
                                      "train_steps": 2})
    worker_ledger = f"sqlite:///{tmp_path / 'worker-default.db'}"
    with pytest.raises(FrenzyInputError, match=f"FRENZY_LEDGER_URL.*allocation {alloc.id} is not in this run's "
                                               "ledger.*set FRENZY_LEDGER_URL on the worker"):
        run_allocated_training(job, "j", plan, Assignment.from_allocation(alloc, plan), ledger_url=worker_ledger,
                               log=lambda _l: None)
    assert started == []
    assert scheduler_ledger.allocation(alloc.id).status == "active"      # not the worker's to touch
