"""The ledger password stays secret: not on a command line, not in the ranks' environment,
not in any Prefect flow-run parameter (SecretStr parameters are stored masked)."""
from __future__ import annotations

import pytest

from estimator.errors import FrenzyInputError

PASSWORD = "s3cret-ledger-pw"


def test_a_password_in_a_ledger_argument_is_refused_in_one_line(tmp_path, capsys, frenzy_home):
    from frenzy_cli.main import main
    from ledger.core import check_url_arg

    check_url_arg("--ledger", None)
    check_url_arg("--ledger", "postgresql://postgres@db/frenzy")          # no password: fine
    check_url_arg("--ledger", f"sqlite:///{tmp_path}/l.db")
    with pytest.raises(FrenzyInputError, match="--ledger: holds a password"):
        check_url_arg("--ledger", f"postgresql://u:{PASSWORD}@db/frenzy")
    job = tmp_path / "job.yaml"
    job.write_text("name: j\nmodel: gpt2-tiny\nseq_len: 16\nglobal_batch: 2\ntrain_steps: 1\n")
    for argv in (["run", str(job), "--ledger", f"postgresql://u:{PASSWORD}@db/frenzy"],
                 ["calibrate", "--ledger", f"postgresql+psycopg://u:{PASSWORD}@db/frenzy"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "holds a password" in err and PASSWORD not in err and len(err.strip().splitlines()) == 1
    assert not (frenzy_home / "ledger.db").exists()                        # nothing was opened


def test_the_ranks_never_see_the_ledger_url():
    from trainer.launcher import launch_env

    env = launch_env(["0"], cpu=True, base={"FRENZY_LEDGER_URL": f"postgresql://u:{PASSWORD}@db/x",
                                            "KEEP_ME": "1"})
    assert "FRENZY_LEDGER_URL" not in env and env["KEEP_ME"] == "1"
    assert PASSWORD not in repr(env)


@pytest.mark.prefect
@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.usefixtures("prefect_server")
def test_no_flow_run_parameter_holds_the_password(tmp_path, frenzy_home, postgres_url):
    """A settings block with a password URL (trust auth ignores the password): the submit flow,
    its tasks and the training subflow run, and no stored parameter contains the password."""
    import json

    from prefect import get_client
    from sqlalchemy.engine import make_url

    from blocks import FrenzySettings
    from deployments.pools import sync_pools
    from frenzy_flows import submit_training
    from scheduler.cluster import load_cluster

    from .test_ledger_basic import drop_schema, pg_schema_url

    url, schema = pg_schema_url(postgres_url)
    secret_url = make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)
    cluster = tmp_path / "cpu.yaml"
    cluster.write_text("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 2}\n")
    sync_pools(load_cluster(str(cluster)), log=lambda *_: None)
    try:
        FrenzySettings(ledger_url=secret_url).save("secret-ledger", overwrite=True)
        result = submit_training(job={"name": "secret", "model": "gpt2-tiny", "seq_len": 32, "global_batch": 2,
                                      "train_steps": 2, "precision": "fp32"},
                                 cluster=str(cluster), settings="secret-ledger")
        assert result.status == "completed"
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs()
            tasks = client.read_task_runs()
        names = {r.name for r in runs} | {t.name for t in tasks}
        stored = json.dumps([r.parameters for r in runs] + [t.task_inputs for t in tasks], default=str)
        assert len(runs) >= 2 and names                             # submit flow and training subflow
        assert PASSWORD not in stored
    finally:
        from ledger import core
        for (pid, u), (w, _) in list(core._ENGINES.items()):
            if schema in u:
                w.dispose()
        drop_schema(postgres_url, schema)
