"""`frenzy pools sync/status`: GPU job templates, idempotent sync, all-or-nothing bad input."""
from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from estimator.errors import FrenzyInputError
from deployments import templates
from deployments.pools import CONTROL_POOL, TRAIN_ENTRYPOINT, parse_pool_description, pool_description, pool_specs

STANDIN = "tests/test_pools_dispatch.py:fake_train"


def _defaults():
    """The process and kubernetes default templates, as the server serves them (bundled view)."""
    import importlib.resources

    import prefect

    path = importlib.resources.files(prefect) / "server/api/collections_data/views/aggregate-worker-metadata.json"
    meta = json.loads(path.read_text())
    return (meta["prefect"]["process"]["default_base_job_configuration"],
            meta["prefect-kubernetes"]["kubernetes"]["default_base_job_configuration"])


# ---------------------------------------------------------------- pure

def test_pool_specs_validate_names_counts_and_duplicates():
    ok = pool_specs({"pools": [{"name": "a100", "gpu": "A100-80GB", "nodes": 2, "gpus_per_node": 8}]})
    assert ok[0].gpus == 16 and ok[0].gpu_type == "A100-80GB"
    dup = {"pools": [{"name": "a", "gpu": "CPU", "nodes": 1, "gpus_per_node": 1}] * 2}
    with pytest.raises(FrenzyInputError, match=r"pools\[1\].name: duplicate pool name 'a'"):
        pool_specs(dup)
    with pytest.raises(FrenzyInputError, match="not a valid pool name"):
        pool_specs({"pools": [{"name": "A/B", "gpu": "CPU", "nodes": 1, "gpus_per_node": 1}]})
    with pytest.raises(FrenzyInputError, match="reserved"):
        pool_specs({"pools": [{"name": CONTROL_POOL, "gpu": "CPU", "nodes": 1, "gpus_per_node": 1}]})
    with pytest.raises(FrenzyInputError, match="no pools"):
        pool_specs({"pools": []})


def test_pool_description_round_trips_the_gpu_facts():
    spec = pool_specs({"pools": [{"name": "h100", "gpu": "H100-80GB", "nodes": 1, "gpus_per_node": 8}]})[0]
    assert parse_pool_description(pool_description(spec)) == {"gpu_type": "H100-80GB", "gpus": 8, "nodes": 1,
                                                              "gpus_per_node": 8}
    assert parse_pool_description("someone else's pool") is None


def test_pool_description_is_a_sentence_a_person_reads():
    # the Work Pools page of the UI shows the description on the pool's card: no JSON there
    spec = pool_specs({"pools": [{"name": "lab", "gpu": "My Card, 24 GB", "nodes": 3, "gpus_per_node": 4}]})[0]
    desc = pool_description(spec)
    assert desc.startswith("Frenzy GPU pool: 12 x My Card, 24 GB on 3 nodes of 4. ")
    assert "prefect worker start --pool lab" in desc
    assert not any(c in desc for c in "{}[]\"") and "frenzy=" not in desc
    assert parse_pool_description(desc) == {"gpu_type": "My Card, 24 GB", "gpus": 12, "nodes": 3, "gpus_per_node": 4}
    # pools an older sync described as frenzy={json} are still Frenzy's (status, --prune)
    legacy = 'Frenzy GPU pool: 2 x CPU (1 node(s) x 2). frenzy={"gpu_type": "CPU", "gpus": 2, "nodes": 1, "gpus_per_node": 2}'
    assert parse_pool_description(legacy) == {"gpu_type": "CPU", "gpus": 2, "nodes": 1, "gpus_per_node": 2}
    assert parse_pool_description("Frenzy GPU pool: lots of GPUs") is None


def test_process_template_maps_gpu_variables_into_the_run_environment():
    from prefect.utilities.templating import apply_values

    process, _ = _defaults()
    t = templates.process_template(process, "A100-80GB", 8)
    props = t["variables"]["properties"]
    assert props["gpu_type"]["default"] == "A100-80GB" and props["num_processes"]["maximum"] == 8
    assert "env" in props                      # free-form env still offered
    env = apply_values(t["job_configuration"], {"gpu_ids": "2,3", "gpu_type": "A100-80GB", "num_processes": 2})["env"]
    assert env == {"CUDA_VISIBLE_DEVICES": "2,3", "FRENZY_GPU_TYPE": "A100-80GB", "FRENZY_NUM_PROCESSES": 2}
    # a manual run without gpu_ids keeps the worker's own CUDA_VISIBLE_DEVICES
    env = apply_values(t["job_configuration"], {"gpu_type": "A100-80GB", "num_processes": 1})["env"]
    assert "CUDA_VISIBLE_DEVICES" not in env
    assert process["job_configuration"]["env"] == "{{ env }}"   # the default was not mutated


def test_kubernetes_template_requests_gpus_and_selects_the_product():
    from prefect.utilities.templating import apply_values

    _, k8s = _defaults()
    t = templates.kubernetes_template(k8s, "H100-80GB", 8)
    assert t["variables"]["properties"]["gpu_product"]["default"] == "NVIDIA-H100-80GB-HBM3"
    cfg = apply_values(t["job_configuration"], {"num_processes": 4, "gpu_product": "NVIDIA-H100-80GB-HBM3",
                                                "gpu_type": "H100-80GB", "image": "img", "gpu_ids": "0,1,2,3"})
    pod = cfg["job_manifest"]["spec"]["template"]["spec"]
    res = pod["containers"][0]["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 4 and res["requests"]["nvidia.com/gpu"] == 4
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert cfg["env"]["FRENZY_GPU_IDS"] == "0,1,2,3" and "CUDA_VISIBLE_DEVICES" not in cfg["env"]


# ---------------------------------------------------------------- against the server

def _client():
    from prefect import get_client
    return get_client(sync_client=True)


def _cluster(*pools):
    return {"pools": [dict(name=n, gpu=g, nodes=nodes, gpus_per_node=per) for n, g, nodes, per in pools]}


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_process_worker_config_gets_devices_and_keeps_extra_env():
    """Prefect's own worker code turns the synced template + job variables into the run env."""
    from prefect.workers.process import ProcessJobConfiguration

    from deployments.pools import sync_pools

    pool = f"tp-{uuid.uuid4().hex[:6]}"
    sync_pools(_cluster((pool, "CPU", 1, 2)), entrypoint=STANDIN, control_pool=False, log=lambda *_: None)
    with _client() as client:
        template = client.read_work_pool(pool).base_job_template
    cfg = asyncio.run(ProcessJobConfiguration.from_template_and_values(
        template, {"gpu_ids": "1", "num_processes": 1, "env": {"EXTRA": "x"}}))
    assert cfg.env == {"CUDA_VISIBLE_DEVICES": "1", "FRENZY_GPU_TYPE": "CPU", "FRENZY_NUM_PROCESSES": "1",
                       "EXTRA": "x"}


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_sync_is_idempotent_and_resizes_limits_when_the_cluster_changes():
    from deployments.pools import sync_pools

    a, b = f"sa-{uuid.uuid4().hex[:6]}", f"sb-{uuid.uuid4().hex[:6]}"
    quiet = dict(entrypoint=STANDIN, log=lambda *_: None)
    r1 = sync_pools(_cluster((a, "A100-80GB", 2, 8), (b, "RTX3090-24GB", 1, 4)), **quiet)
    assert r1.pools[a] == "created" and r1.pools[b] == "created"
    assert r1.limits == {f"gpu:{a}": 16, f"gpu:{b}": 4}
    r2 = sync_pools(_cluster((a, "A100-80GB", 2, 8), (b, "RTX3090-24GB", 1, 4)), **quiet)
    assert r2.pools == {a: "unchanged", b: "unchanged"}
    assert r2.deployments == r1.deployments                  # same deployments, upserted
    r3 = sync_pools(_cluster((a, "A100-80GB", 3, 8), (b, "RTX3090-24GB", 1, 4)), **quiet)
    assert r3.pools[a] == "updated" and r3.pools[b] == "unchanged"
    with _client() as client:
        assert client.read_global_concurrency_limit_by_name(f"gpu:{a}").limit == 24
        wp = client.read_work_pool(a)
        assert wp.type == "process" and parse_pool_description(wp.description)["gpus"] == 24
        assert client.read_work_pool(CONTROL_POOL).type == "process"
        dep = client.read_deployment(r3.deployments[f"frenzy-train-{a}"])
        assert dep.work_pool_name == a and dep.entrypoint == STANDIN
        assert dep.job_variables == {"gpu_type": "A100-80GB"}
        assert set(dep.parameter_openapi_schema["properties"]) == {"job", "plan", "assignment", "job_id"}
        # a control pool an older sync described gets the card that says it needs a worker
        from prefect.client.schemas.actions import WorkPoolUpdate
        client.update_work_pool(CONTROL_POOL, WorkPoolUpdate(description="Frenzy control pool: runs frenzy-submit"))
    r4 = sync_pools(_cluster((a, "A100-80GB", 3, 8), (b, "RTX3090-24GB", 1, 4)), **quiet)
    assert r4.pools[CONTROL_POOL] == "updated"
    with _client() as client:
        assert "prefect worker start --pool frenzy" in client.read_work_pool(CONTROL_POOL).description


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_a_pool_that_lost_nodes_loses_their_work_queues_once_their_runs_ended():
    """A 3-node pool synced as 2 nodes (then 1) kept ``<pool>-2`` (then ``-1``): a worker
    started on it looked current. Those queues go, a site's own queue and the default stay,
    and a queue still holding a run waits for the next sync."""
    from prefect.states import Cancelled

    from deployments.pools import sync_pools

    a = f"sq-{uuid.uuid4().hex[:6]}"
    quiet = dict(entrypoint=STANDIN, log=lambda *_: None)
    r1 = sync_pools(_cluster((a, "A100-80GB", 3, 8)), **quiet)
    assert r1.queues[a] == [f"{a}-0", f"{a}-1", f"{a}-2"] and not r1.removed_queues
    with _client() as client:
        client.create_work_queue(name="nightly", work_pool_name=a)
        dep = client.read_deployment(r1.deployments[f"frenzy-train-{a}"])
        run = client.create_flow_run_from_deployment(dep.id, parameters={"job": {}, "plan": {}, "assignment": {}},
                                                     work_queue_name=f"{a}-1")
    lines: list[str] = []
    r2 = sync_pools(_cluster((a, "A100-80GB", 2, 8)), entrypoint=STANDIN, log=lines.append)
    assert r2.removed_queues == {a: [f"{a}-2"]}
    with _client() as client:
        names = {q.name for q in client.read_work_queues(work_pool_name=a)}
    assert names == {"default", "nightly", f"{a}-0", f"{a}-1"}
    lines.clear()
    r3 = sync_pools(_cluster((a, "A100-80GB", 1, 8)), entrypoint=STANDIN, log=lines.append)
    assert r3.queues[a] == [] and r3.removed_queues == {a: [f"{a}-0"]}       # -1 holds a scheduled run
    assert any(f"work queue {a}-1 kept" in line and run.name in line for line in lines)
    with _client() as client:
        client.set_flow_run_state(run.id, Cancelled(), force=True)
    assert sync_pools(_cluster((a, "A100-80GB", 1, 8)), **quiet).removed_queues == {a: [f"{a}-1"]}
    with _client() as client:
        assert {q.name for q in client.read_work_queues(work_pool_name=a)} == {"default", "nightly"}


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_sync_refuses_a_pool_of_another_type_and_changes_nothing():
    from prefect.client.schemas.actions import WorkPoolCreate

    from deployments.pools import sync_pools

    new, taken = f"n-{uuid.uuid4().hex[:6]}", f"k-{uuid.uuid4().hex[:6]}"
    with _client() as client:
        client.create_work_pool(WorkPoolCreate(name=taken, type="kubernetes"))
    with pytest.raises(FrenzyInputError, match=f"work pool '{taken}' already exists with type 'kubernetes'"):
        sync_pools(_cluster((new, "CPU", 1, 1), (taken, "CPU", 1, 1)), entrypoint=STANDIN, log=lambda *_: None)
    from prefect.exceptions import ObjectNotFound
    with _client() as client:
        with pytest.raises(ObjectNotFound):
            client.read_work_pool(new)


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_kubernetes_sync_writes_the_gpu_template():
    from deployments.pools import sync_pools

    pool = f"k8-{uuid.uuid4().hex[:6]}"
    sync_pools(_cluster((pool, "A100-80GB", 1, 8)), pool_type="kubernetes", entrypoint=STANDIN,
               control_pool=False, log=lambda *_: None)
    with _client() as client:
        wp = client.read_work_pool(pool)
    assert wp.type == "kubernetes"
    container = wp.base_job_template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "{{ num_processes }}"


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_cli_sync_rejects_duplicates_and_unknown_gpu_types_without_changes(tmp_path, capsys):
    from frenzy_cli.main import main

    p = f"cli-{uuid.uuid4().hex[:6]}"
    dup = tmp_path / "dup.yaml"
    dup.write_text(f"pools:\n  - {{name: {p}, gpu: CPU, nodes: 1, gpus_per_node: 2}}\n"
                   f"  - {{name: {p}, gpu: CPU, nodes: 1, gpus_per_node: 2}}\n")
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text(f"pools:\n  - {{name: {p}, gpu: B300-999GB, nodes: 1, gpus_per_node: 2}}\n")
    for f, words in ((dup, "duplicate"), (unknown, "B300-999GB")):
        assert main(["pools", "sync", "--cluster", str(f)]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    from prefect.exceptions import ObjectNotFound
    with _client() as client:
        with pytest.raises(ObjectNotFound):
            client.read_work_pool(p)


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_cli_sync_and_status_with_the_real_training_flow(tmp_path, capsys):
    """The real `frenzy-train` flow deploys per pool; status counts GPUs, a queued run, workers."""
    from prefect.deployments import run_deployment

    from frenzy_cli.main import main

    p = f"rc-{uuid.uuid4().hex[:6]}"
    f = tmp_path / "cluster.yaml"
    f.write_text(f"pools:\n  - {{name: {p}, gpu: CPU, nodes: 1, gpus_per_node: 2}}\n")
    assert main(["pools", "sync", "--cluster", str(f), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pools"][p] == "created" and report["limits"] == {f"gpu:{p}": 2}
    with _client() as client:
        dep = client.read_deployment(report["deployments"][f"frenzy-train-{p}"])
    assert dep.entrypoint == TRAIN_ENTRYPOINT
    assert {"job", "plan"} <= set(dep.parameter_openapi_schema["properties"])
    # a run the server can take but no worker picks up: queued, with 0 workers
    run_deployment(dep.id, parameters={"job": {"model": "gpt2-tiny", "seq_len": 16, "global_batch": 2,
                                               "train_steps": 1},
                                       "plan": {"gpu_type": "CPU", "gpus": 1}}, timeout=0)
    from prefect.concurrency.sync import concurrency
    with concurrency(f"gpu:{p}", occupy=1, strict=True):       # a running job holds one GPU
        assert main(["pools", "status", p, "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row == {"name": p, "pool_type": "process", "gpu_type": "CPU", "gpus": 2, "in_use": 1, "queued": 1,
                   "running": 0, "workers_online": 0, "state": "NOT_READY"}
    assert main(["pools", "status", p]) == 0
    out = capsys.readouterr().out
    assert p in out and "no workers online" in out
    assert main(["pools", "status", "no-such-pool-xyz"]) == 2
    capsys.readouterr()
    # the control pool (it runs frenzy-submit) is listed with the GPU pools: without its worker
    # every UI submission stays Scheduled
    assert main(["pools", "status", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert p in rows and rows["frenzy"]["gpu_type"] == "control"
    assert main(["pools", "status"]) == 0
    err = capsys.readouterr().err
    assert "no worker polls the control pool 'frenzy'" in err and "prefect worker start --pool frenzy" in err


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_one_clusters_sync_leaves_other_clusters_pools_until_prune(tmp_path, capsys, frenzy_home, monkeypatch):
    """Two clusters share one server and one ledger; only --prune removes the other's pools."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    from frenzy_cli.main import main
    from ledger import Ledger

    monkeypatch.delenv("FRENZY_LEDGER_URL", raising=False)
    a, b, foreign = (f"{x}-{uuid.uuid4().hex[:6]}" for x in ("pa", "pb", "foreign"))
    fa, fb = tmp_path / "a.yaml", tmp_path / "b.yaml"
    fa.write_text(f"pools:\n  - {{name: {a}, gpu: CPU, nodes: 1, gpus_per_node: 2}}\n")
    fb.write_text(f"pools:\n  - {{name: {b}, gpu: CPU, nodes: 1, gpus_per_node: 3}}\n")
    with _client() as client:
        client.create_work_pool(WorkPoolCreate(name=foreign, type="process"))   # not Frenzy's
    assert main(["pools", "sync", "--cluster", str(fa), "--json"]) == 0
    assert main(["pools", "sync", "--cluster", str(fb), "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert a not in report["pools"] and report["ledger_pruned"] == []
    with _client() as client:
        assert client.read_global_concurrency_limit_by_name(f"gpu:{a}").limit == 2   # a is still there
    assert {n.pool for n in Ledger().cluster_state().nodes} >= {a, b}
    # Prefect refuses (b is a process pool): the ledger is as it was, nothing pruned (it was
    # synced, and pruned, before Prefect's check)
    assert main(["pools", "sync", "--cluster", str(fb), "--type", "kubernetes", "--prune"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "already exists with type 'process'" in err
    assert {n.pool for n in Ledger().cluster_state().nodes} >= {a, b}
    # a settings block that is not there: one line, nothing written
    assert main(["pools", "sync", "--cluster", str(fb), "--settings", "no-such-settings"]) == 2
    assert "no FrenzySettings block named 'no-such-settings'" in capsys.readouterr().err

    assert main(["pools", "sync", "--cluster", str(fb), "--prune", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pools"][a] == "removed" and report["pools"][b] == "unchanged"
    assert a in report["ledger_pruned"]
    with _client() as client:
        for gone in (lambda: client.read_work_pool(a),
                     lambda: client.read_global_concurrency_limit_by_name(f"gpu:{a}")):
            with pytest.raises(ObjectNotFound):
                gone()
        assert client.read_work_pool(foreign).name == foreign
        assert client.read_work_pool(CONTROL_POOL).name == CONTROL_POOL
    assert {n.pool for n in Ledger().cluster_state().nodes} == {b}


def test_status_against_a_server_that_does_not_answer_is_one_line(tmp_path):
    """A wrong PREFECT_API_URL or a server that is down: one line naming the URL (it was an
    80-line httpx traceback)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "FRENZY_"))}
    env.update(PREFECT_API_URL="http://127.0.0.1:9/api", PREFECT_HOME=str(tmp_path / "prefect"),
               PYTHONPATH=str(root))
    proc = subprocess.run([sys.executable, "-m", "frenzy_cli.main", "pools", "status"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.strip().splitlines()
    assert "PREFECT_API_URL: no Prefect server answers at http://127.0.0.1:9/api" in line
