"""GPUCluster and FrenzySettings blocks: validation, secrets kept secret, save/load on the
server, auto-registration through the prefect.collections entry point."""
from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from pydantic import ValidationError

from blocks import FrenzySettings, GPUCluster
from blocks.settings import DEFAULT_FALLBACK_ORDER, fallback_step
from estimator.plan import Plan

ROOT = Path(__file__).resolve().parent.parent
SECRET = "pw-" + uuid.uuid4().hex


def test_gpu_cluster_from_file_matches_the_cluster_loader():
    from scheduler.cluster import load_cluster

    block = GPUCluster.from_file(ROOT / "examples/cluster.yaml")
    assert block.to_cluster() == load_cluster(ROOT / "examples/cluster.yaml")
    assert block.to_cluster().inventory() == load_cluster(ROOT / "examples/cluster.yaml").inventory()


def test_gpu_cluster_rejects_what_a_cluster_file_would_reject():
    pool = {"name": "a", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 8}
    with pytest.raises(ValidationError, match="duplicate"):
        GPUCluster(pools=[pool, pool])
    with pytest.raises(ValidationError, match="B300-999GB"):
        GPUCluster(pools=[{**pool, "gpu": "B300-999GB"}])
    custom = GPUCluster(pools=[{**pool, "gpu": "MyCard-40GB"}],
                        gpu_types={"MyCard-40GB": {"name": "MyCard-40GB", "memory_gib": 40, "bf16_tflops": 100,
                                                   "fp16_tflops": 100, "fp32_tflops": 12, "mem_bw_gbs": 1000}})
    assert custom.to_cluster().gpu("MyCard-40GB").memory_gib == 40


def test_secrets_never_show_in_repr_str_or_json():
    s = FrenzySettings(ledger_url=f"postgresql+psycopg://u:{SECRET}@db/frenzy", hf_token=SECRET)
    c = GPUCluster.from_file(ROOT / "examples/cluster.yaml", node_credentials=SECRET)
    for text in (repr(s), str(s), s.model_dump_json(), repr(c), str(c), c.model_dump_json(),
                 json.dumps(s.model_dump(mode="json"))):
        assert SECRET not in text
    assert SECRET in s.ledger_url_value() and s.hf_token_value() == SECRET


def test_block_editors_offer_no_none_choice_and_save_no_nulls():
    # 'Property is type "None"' and a "None" type tab in the block editor come from anyOf [X, null]
    for block in (GPUCluster, FrenzySettings):
        schema = block.model_json_schema()
        assert '{"type": "null"}' not in json.dumps(schema), block.__name__
    schema = GPUCluster.model_json_schema()
    pool = schema["definitions"]["Pool"]["properties"]
    assert pool["addresses"]["type"] == "array" and pool["inter_node_gbps"]["type"] == "number"
    assert all(p.get("description") for p in pool.values())
    assert schema["definitions"]["GPU"]["properties"]["fp8_tflops"]["type"] == "number"
    assert schema["secret_fields"] == ["node_credentials"]
    assert schema["properties"]["node_credentials"]["format"] == "password"
    # validation is unchanged: unset still means None, and the saved data leaves it out
    block = GPUCluster.from_file(ROOT / "examples/cluster.yaml")
    assert block.pools[0].addresses is None and GPUCluster(pools=[{**block.pools[0].model_dump(), "devices": None}])
    data = block.model_dump(mode="json")
    assert "null" not in json.dumps({"pools": data["pools"], "gpu_types": data["gpu_types"]})
    assert GPUCluster.model_validate(data).to_cluster() == block.to_cluster()
    assert FrenzySettings(safety_margin_gib=None).safety_margin_gib is None
    # a new settings block in the UI starts with every fallback selected (an empty selection
    # would forbid them all), and instances do not share the list
    order = FrenzySettings.model_json_schema()["properties"]["fallback_order"]
    assert order["default"] == list(DEFAULT_FALLBACK_ORDER)
    one, two = FrenzySettings(), FrenzySettings()
    one.fallback_order.remove("zero")
    assert two.fallback_order == list(DEFAULT_FALLBACK_ORDER)


def test_order_fallbacks_follows_the_setting_and_drops_forbidden_kinds():
    base = Plan(gpu_type="A100-40GB", gpus=2, dp=2)
    ck = base.model_copy(update={"act_ckpt": "full"})
    z = ck.model_copy(update={"zero": 2})
    off = z.model_copy(update={"offload": "optimizer"})
    more = base.model_copy(update={"gpus": 4, "dp": 4})
    other = Plan(gpu_type="A100-80GB", gpus=2, dp=2)
    assert [fallback_step(base, p) for p in (ck, z, off, more, other)] == list(DEFAULT_FALLBACK_ORDER)
    cands = [other, more, off, z, ck]
    assert FrenzySettings().order_fallbacks(base, cands) == [ck, z, off, more, other]
    s = FrenzySettings(fallback_order=["next_gpu_type", "act_ckpt"])
    assert s.order_fallbacks(base, cands) == [other, ck]
    with pytest.raises(ValidationError):
        FrenzySettings(fallback_order=["buy_more_gpus"])


def test_the_entry_point_loads_the_blocks_module_and_registers_both_types():
    """What Prefect's server and workers do at start (prefect.plugins.load_prefect_collections)."""
    code = ("from prefect.plugins import load_prefect_collections\n"
            "from prefect.blocks.core import Block\n"
            "from prefect.utilities.dispatch import get_registry_for_type\n"
            "loaded = load_prefect_collections()\n"
            "print(type(loaded['frenzy']).__name__, loaded['frenzy'].__name__)\n"
            "print(sorted(k for k in get_registry_for_type(Block) if k in ('gpu-cluster', 'frenzy-settings')))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["module blocks", "['frenzy-settings', 'gpu-cluster']"], (
        "the frenzy package must be installed (pip install -e .) for its prefect.collections entry point")


# ---------------------------------------------------------------- on the server

@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_blocks_round_trip_and_the_api_and_logs_hide_secrets():
    from prefect import flow, get_client, get_run_logger
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.runtime import flow_run

    name = f"lab-{uuid.uuid4().hex[:6]}"
    FrenzySettings(ledger_url=f"postgresql+psycopg://u:{SECRET}@db/frenzy", safety_margin_gib=3.5,
                   fallback_order=["zero", "act_ckpt"]).save(name)
    GPUCluster.from_file(ROOT / "examples/cluster.yaml", node_credentials=SECRET).save(name)

    s = FrenzySettings.load(name)
    assert s.ledger_url_value().endswith(f"{SECRET}@db/frenzy") and s.safety_margin_gib == 3.5
    assert s.fallback_order == ["zero", "act_ckpt"]
    c = GPUCluster.load(name)
    assert c.to_cluster().inventory() == {"H100-80GB": 8, "A100-40GB": 16, "RTX3090-24GB": 32}
    assert c.node_credentials.get_secret_value() == SECRET

    with get_client(sync_client=True) as client:
        doc = client.read_block_document_by_name(name, "frenzy-settings", include_secrets=False)
        assert SECRET not in json.dumps(doc.data, default=str)

    @flow
    def uses_settings():
        st = FrenzySettings.load(name)
        get_run_logger().info("settings: %s cluster: %s", st, GPUCluster.load(name))
        print(st)
        return str(flow_run.id)

    run_id = uses_settings()
    import time
    time.sleep(2)      # logs are shipped in the background
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run_id])))
    text = "\n".join(entry.message for entry in logs)
    assert "settings: FrenzySettings(" in text and SECRET not in text


@pytest.mark.prefect
@pytest.mark.usefixtures("prefect_server")
def test_pools_sync_from_a_gpu_cluster_block(capsys):
    from frenzy_cli.main import main

    pool = f"blk-{uuid.uuid4().hex[:6]}"
    name = f"inv-{uuid.uuid4().hex[:6]}"
    GPUCluster(pools=[{"name": pool, "gpu": "CPU", "nodes": 1, "gpus_per_node": 2}]).save(name)
    assert main(["pools", "sync", "--cluster", f"block:{name}", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["limits"] == {f"gpu:{pool}": 2}
    assert main(["pools", "sync", "--cluster", "block:missing-inventory"]) == 2
    assert "no GPUCluster block named 'missing-inventory'" in capsys.readouterr().err


def test_settings_refuse_an_unknown_policy_and_an_infinite_margin():
    """A mistyped policy was stored and failed only at a submission; an infinite margin fitted
    nothing anywhere."""
    from pydantic import ValidationError

    from blocks import FrenzySettings
    with pytest.raises(ValidationError, match="unknown policy 'fenzy'"):
        FrenzySettings(policy="fenzy")
    with pytest.raises(ValidationError, match="finite number"):
        FrenzySettings(safety_margin_gib=float("inf"))
    assert FrenzySettings(policy="sia").policy == "sia"


def test_blocks_refuse_a_mistyped_setting_and_keep_what_they_save():
    """Prefect's Block keeps unknown keys: ``FrenzySettings(polcy="sia")`` made a block with the
    default policy and no word. A saved document's data (``model_dump``: the fields and
    Prefect's ``block_type_slug``) still builds the block."""
    from pydantic import ValidationError

    from blocks import FrenzySettings
    with pytest.raises(ValidationError, match="polcy: is not a setting of FrenzySettings"):
        FrenzySettings(polcy="sia")
    with pytest.raises(ValidationError, match="pool: is not a setting of GPUCluster"):
        GPUCluster(pool=[{"name": "x", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 8}])
    s = FrenzySettings(policy="sia", safety_margin_gib=2.0)
    assert FrenzySettings(**s.model_dump()).policy == "sia"
    c = GPUCluster(pools=[{"name": "x", "gpu": "A100-80GB", "nodes": 1, "gpus_per_node": 8}])
    assert GPUCluster(**c.model_dump()).to_cluster().inventory() == {"A100-80GB": 8}
    # a saved document holding a key that is no field (the API, a field a later version drops)
    # still loads, through Prefect's own loading: the key is left out with a warning (Prefect's
    # fallback for a document that fails validation cannot load it)
    from types import SimpleNamespace
    from uuid import uuid4
    doc = SimpleNamespace(block_schema=object(), data={**s.model_dump(exclude={"block_type_slug"}), "polcy": "gavel"},
                          id=uuid4(), block_schema_id=uuid4(), block_type_id=uuid4(), name="site",
                          is_anonymous=False, block_document_references={})
    with pytest.warns(UserWarning, match="polcy is not one of its settings"):
        assert FrenzySettings._from_block_document(doc).policy == "sia"
    with pytest.raises(ValidationError, match="polcy: is not a setting"):   # and a user's typo is refused again
        FrenzySettings(**doc.data)
    with pytest.raises(ValidationError, match="_private: is not a setting"):
        FrenzySettings(_private=1)


def test_a_custom_gpu_type_typed_as_in_a_cluster_file_is_accepted_by_the_block():
    """The block asked for name and fp16_tflops that a cluster file fills in (a 13-line error)."""
    b = GPUCluster(pools=[{"name": "x", "gpu": "X1", "nodes": 1, "gpus_per_node": 8}],
                   gpu_types={"X1": {"memory_gib": 40, "bf16_tflops": 100}})
    assert b.to_cluster().gpu_types["X1"].memory_gib == 40 and b.gpu_types["X1"].fp16_tflops == 100
