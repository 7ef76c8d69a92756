"""prefect.yaml: `prefect deploy --all` against a running server creates frenzy-submit (its form
is the job model), one frenzy-train-<pool> per pool and the nightly cron example; the server
rejects a job that fails the model before any run starts, naming the field."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.usefixtures("prefect_server")]


@pytest.fixture(scope="module")
def deployed():
    from prefect import get_client
    from prefect.settings import PREFECT_API_URL

    from deployments.pools import sync_pools
    from scheduler.cluster import load_cluster

    sync_pools(load_cluster(ROOT / "examples/cluster.yaml"), log=lambda *_: None)
    r = subprocess.run([str(Path(sys.executable).parent / "prefect"), "--no-prompt", "deploy", "--all"],
                       cwd=ROOT, env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    with get_client(sync_client=True) as client:
        return {d.name: d for d in client.read_deployments()}


def test_prefect_deploy_all_creates_submit_train_and_nightly(deployed):
    assert {"frenzy-submit", "frenzy-train-h100", "frenzy-train-a100", "frenzy-train-rtx3090",
            "nightly-finetune"} <= set(deployed)
    sub = deployed["frenzy-submit"]
    assert sub.work_pool_name == "frenzy" and sub.enforce_parameter_schema
    assert sub.pull_steps == [{"prefect.deployments.steps.set_working_directory": {"directory": str(ROOT)}}]
    # the UI form of frenzy-submit is the job model
    schema = sub.parameter_openapi_schema
    assert schema["required"] == ["job"]
    job_def = schema["definitions"]["TrainingJob"]
    assert {"model", "init_from", "finetune", "eval", "export", "seq_len", "global_batch", "train_steps",
            "train_tokens", "allowed_gpu_types", "deadline_s", "max_gpus", "data"} <= set(job_def["properties"])
    # `model` may be left out when init_from names the weights (their config is the model)
    assert set(job_def["required"]) == {"seq_len", "global_batch"}
    a100 = deployed["frenzy-train-a100"]
    assert a100.work_pool_name == "a100" and a100.job_variables == {"gpu_type": "A100-40GB"}
    [sched] = deployed["nightly-finetune"].schedules
    assert sched.schedule.cron == "0 2 * * *" and sched.active is False
    nightly = deployed["nightly-finetune"].parameters["job"]
    assert nightly["init_from"] == "openai-community/gpt2" and nightly["finetune"]["method"] == "lora"
    assert nightly["eval"]["fraction"] == 0.01


def test_the_server_rejects_a_job_that_fails_the_model_naming_the_field(deployed):
    from prefect import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    dep = deployed["frenzy-submit"]
    with get_client(sync_client=True) as client:
        before = len(client.read_flow_runs())
        for job, field in (({"model": "gpt2", "global_batch": 8, "train_steps": 1}, "seq_len"),
                           ({"model": "gpt2", "seq_len": -5, "global_batch": 8, "train_steps": 1}, "-5"),
                           ({"model": "gpt2", "seq_len": 8, "global_batch": 8, "gpus": 4}, "gpus")):
            with pytest.raises(PrefectHTTPStatusError) as err:
                client.create_flow_run_from_deployment(dep.id, parameters={"job": job})
            assert err.value.response.status_code == 409
            assert field in err.value.response.text
        assert len(client.read_flow_runs()) == before        # no run started
