"""Hub models a job names, fetched only when asked (`frenzy run --fetch`, the settings block's
``fetch_models`` with its ``hf_token``), through the real huggingface_hub client against a
local stand-in for the Hub (``tests/fake_hub.py``)."""
from __future__ import annotations

from pathlib import Path

import pytest

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from frenzy_flows.hub import fetch_hub_models, hub_models
from tests.fake_hub import FakeHub

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / ".models" / "tiny-llama"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """The tiny pretrained model served as the gated repo org/tiny (token "tok"), the Hub
    cache in a fresh folder, HF_ENDPOINT at the stand-in."""
    from huggingface_hub import constants

    from tests.test_trainer_finetune import _maker

    maker = _maker()
    if not maker.is_made(maker.DEFAULT_OUT):
        maker.make(maker.DEFAULT_OUT)
    files = {p.name: p.read_bytes() for p in TINY.iterdir() if p.is_file()}
    files["original/consolidated.00.pth"] = b"another copy of the weights, never fetched"
    served = FakeHub({"org/tiny": files}, token="tok")
    monkeypatch.setenv("HF_ENDPOINT", served.url)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    yield served
    served.close()


def _job(**kw) -> TrainingJob:
    return TrainingJob(**{"seq_len": 32, "global_batch": 4, "train_steps": 2, "precision": "fp32", **kw})


def test_only_hub_ids_are_fetched_and_weights_only_for_init_from(tmp_path):
    assert hub_models(_job(model="gpt2")) == {}                                   # a preset
    assert hub_models(_job(model=str(TINY))) == {}                                # a folder
    assert hub_models(_job(init_from="org/tiny")) == {"org/tiny": ("init_from", True)}
    assert hub_models(_job(model="org/cfg")) == {"org/cfg": ("model", False)}


def test_a_gated_model_is_fetched_with_the_token_once_and_only_its_safetensors(hub):
    job = _job(init_from="org/tiny")
    with pytest.raises(FrenzyInputError) as err:              # no token: one line naming the field
        fetch_hub_models(job, token=None)
    assert err.value.field == "init_from" and "gated" in str(err.value) and "\n" not in str(err.value)
    lines: list[str] = []
    assert fetch_hub_models(job, token="tok", log=lines.append) == ["org/tiny"]
    assert lines and "fetching org/tiny" in lines[0]
    got = [path for method, path, auth in hub.seen if method == "GET" and "/resolve/" in path]
    assert got and all(auth == "Bearer tok" for method, path, auth in hub.seen[-len(got) * 2:])
    assert any(p.endswith("model.safetensors") for p in got) and not any("original/" in p for p in got)
    # cached now: the model resolves offline, and a second fetch asks the Hub nothing
    from estimator.models import cached_hub_snapshot, resolve_model
    assert Path(cached_hub_snapshot("org/tiny")).joinpath("model.safetensors").is_file()
    assert resolve_model("org/tiny").params == resolve_model(str(TINY)).params
    before = len(hub.seen)
    assert fetch_hub_models(job, token="tok") == [] and len(hub.seen) == before


def test_frenzy_run_fetch_then_checks_and_plans_the_fetched_weights(hub, tmp_path, capsys, monkeypatch):
    from frenzy_cli.main import main

    job = tmp_path / "job.yaml"
    job.write_text("name: fetched\ninit_from: org/tiny\nseq_len: 32\nglobal_batch: 4\ntrain_steps: 2\n"
                   "precision: fp32\nfinetune: {method: lora, rank: 4, target_modules: [q_proj, v_proj]}\n")
    monkeypatch.setenv("FRENZY_HOME", str(tmp_path / "home"))
    assert main(["run", str(job), "--dry-run"]) == 2                  # nothing downloads unless asked
    assert "frenzy run --fetch" in capsys.readouterr().err
    monkeypatch.setenv("HF_TOKEN", "tok")        # huggingface_hub's own token source, as on a user's shell
    assert main(["run", str(job), "--dry-run", "--fetch"]) == 0
    out = capsys.readouterr()
    assert "org/tiny is in this machine's Hugging Face cache" in out.err and "would launch" in out.out


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_a_settings_block_with_fetch_models_fetches_with_its_token_in_the_submit_flow(hub, tmp_path):
    """The fleet's way: the block's fetch_models and hf_token; the submit flow's machine fetches
    before it checks the weights (the train flow on each node does the same)."""
    import uuid

    from blocks import FrenzySettings
    from frenzy_flows import submit_training

    name = f"fetch-{uuid.uuid4().hex[:6]}"
    FrenzySettings(fetch_models=True, hf_token="tok").save(name)
    (tmp_path / "cluster.yaml").write_text("pools:\n  - {name: cpu-fetch, gpu: CPU, nodes: 1, gpus_per_node: 1}\n")
    job = {"name": "fetched", "init_from": "org/tiny", "seq_len": 32, "global_batch": 4, "train_steps": 2,
           "precision": "fp32", "finetune": {"method": "lora", "rank": 4, "target_modules": ["q_proj", "v_proj"]}}
    d = submit_training(job=job, cluster=str(tmp_path / "cluster.yaml"), settings=name, dry_run=True)
    assert d["dry_run"] and d["model"] == "org/tiny"
    assert any(auth == "Bearer tok" and p.endswith("model.safetensors") for m, p, auth in hub.seen if m == "GET")
    FrenzySettings(fetch_models=False).save(name, overwrite=True)
    hub.seen.clear()
    submit_training(job=job, cluster=str(tmp_path / "cluster.yaml"), settings=name, dry_run=True)
    assert hub.seen == []                                      # cached now, and fetching is off anyway
    # off, a repo the cache lacks is refused, and the Hub is not asked
    hub.repos["org/other"] = hub.repos["org/tiny"]
    with pytest.raises(Exception, match="nothing downloads unless asked"):
        submit_training(job={**job, "init_from": "org/other"}, cluster=str(tmp_path / "cluster.yaml"),
                        settings=name, dry_run=True)
    assert hub.seen == []


def test_a_repo_is_fetched_for_what_the_job_reads_and_a_config_less_snapshot_is_named(hub, tmp_path):
    """A model named by Hub id without weights: its config only; a sharded repo: its index and
    every shard, not Mistral's consolidated copy; a cached entry without config.json is said so."""
    from estimator.models import cached_hub_snapshot

    cfg = (TINY / "config.json").read_bytes()
    index = b'{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    hub.repos["org/sharded"] = {"config.json": cfg, "model.safetensors.index.json": index,
                                "model-00001-of-00002.safetensors": b"1", "model-00002-of-00002.safetensors": b"2",
                                "consolidated.safetensors": b"a copy", "tokenizer.json": b"{}"}
    hub.repos["org/cfg"] = {"config.json": cfg, "model.safetensors": b"w"}
    assert fetch_hub_models(_job(model="org/cfg"), token="tok") == ["org/cfg"]
    assert sorted(p.name for p in Path(cached_hub_snapshot("org/cfg")).iterdir()) == ["config.json"]
    assert fetch_hub_models(_job(init_from="org/sharded"), token="tok") == ["org/sharded"]
    got = sorted(p.name for p in Path(cached_hub_snapshot("org/sharded")).iterdir())
    assert got == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                   "model.safetensors.index.json", "tokenizer.json"]
    hub.repos["org/nocfg"] = {"model.safetensors": b"w"}
    from huggingface_hub import snapshot_download
    snapshot_download("org/nocfg", token="tok", endpoint=hub.url)
    with pytest.raises(FrenzyInputError, match="holds no config.json at revision main"):
        cached_hub_snapshot("org/nocfg")


def test_a_training_node_keeps_its_job_and_gpus_while_it_fetches(tmp_path, monkeypatch):
    """The dispatcher beats a placed job's queue row only until its run starts, and the GPU
    lease is the training's from its first launch: a node's download of minutes in between had
    the job reaped and its GPUs given away. The row is beaten and the lease renewed meanwhile."""
    import time

    from estimator.plan import Plan
    from frenzy_flows import train_flow
    from frenzy_flows.results import Assignment
    from ledger import Ledger
    from ledger.queue import JobQueue
    from scheduler.cluster import parse_cluster

    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    led = Ledger(url)
    led.sync_cluster(parse_cluster("pools:\n  - {name: cpu, gpu: CPU, nodes: 1, gpus_per_node: 1}\n"))
    plan = Plan(gpu_type="CPU", gpus=1, dp=1, micro_batch=1, step_time_s=1.0)
    q = JobQueue(led)
    q.enqueue("j", "j", {"name": "j"}, [plan], steps=10)
    alloc = led.allocate_best_fit("j", plan)
    assignment = Assignment.from_allocation(alloc, plan)
    from ledger.tables import QueueJobRow
    from sqlmodel import Session

    def alive() -> float:
        with Session(led._read_engine) as s:
            return s.get(QueueJobRow, "j").alive_until
    alive0, lease0 = alive(), led.allocation(alloc.id).lease_expires_at
    monkeypatch.setattr(train_flow, "PREPARE_BEAT_S", 0.05)
    time.sleep(0.05)
    with train_flow._kept_alive(url, "j", assignment):
        time.sleep(0.4)
    assert alive() > alive0 and led.allocation(alloc.id).lease_expires_at > lease0
