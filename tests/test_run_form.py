"""The `frenzy-submit` run form: what Prefect's parameter schema gives the UI."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def schema():
    from prefect.utilities.callables import parameter_schema

    from frenzy_flows import submit_training

    return parameter_schema(submit_training).model_dump()


def test_every_flow_parameter_has_a_description(schema):
    props = schema["properties"]
    assert set(props) >= {"job", "cluster", "policy", "safety_margin_gib", "ledger_url", "wait_timeout_s",
                          "settings", "dry_run"}
    missing = [k for k, v in props.items() if not v.get("description")]
    assert missing == []


def test_the_cluster_can_be_a_gpu_cluster_block_or_a_path(schema):
    variants = schema["properties"]["cluster"]["anyOf"]
    refs = [v["$ref"].rsplit("/", 1)[-1] for v in variants if "$ref" in v]
    assert refs == ["GPUCluster"] and {"type": "string"} in variants
    assert schema["definitions"]["GPUCluster"]["block_type_slug"] == "gpu-cluster"
