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


def test_optional_fields_offer_no_none_choice_and_the_model_offers_the_presets(schema):
    import json

    from estimator.models import PRESETS

    # 'Property is type "None"' in the UI: no null choice in the form's fields (the GPUCluster
    # block's own schema is the block editor's, the run form shows a block picker)
    job_models = {"TrainingJob", "DataSpec", "EvalSpec", "ExportSpec", "FinetuneSpec", "OptimSpec",
                  "ScheduleSpec", "TrackingSpec"}
    assert job_models <= set(schema["definitions"])
    for part in [schema["properties"]] + [schema["definitions"][m] for m in job_models]:
        assert '{"type": "null"}' not in json.dumps(part)
    model = schema["definitions"]["TrainingJob"]["properties"]["model"]
    first = model["anyOf"][0]
    assert first["title"] == "preset" and first["enum"] == sorted(PRESETS) and "gpt2-tiny" in first["enum"]
    assert {"type": "string"} in model["anyOf"] and "default" not in model
    # nested models too (LoRA target modules), and validation is unchanged: None still means "unset"
    assert schema["definitions"]["FinetuneSpec"]["properties"]["target_modules"]["type"] == "array"
    from frenzy_flows import submit_training
    params = submit_training.validate_parameters({"job": {"model": "gpt2-tiny", "seq_len": 8, "global_batch": 1,
                                                          "train_steps": 1, "eval": None}, "policy": None})
    assert params["policy"] is None and params["job"].eval is None


def test_prefect_deploy_reads_the_same_form(schema):
    from prefect.utilities.callables import parameter_schema_from_entrypoint

    static = parameter_schema_from_entrypoint("frenzy_flows/flow.py:submit_training").model_dump()
    assert static == schema
