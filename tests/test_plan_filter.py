"""`--plan "tp=2,zero=3"`: the knobs a candidate plan must have (parse, match, refuse)."""
from __future__ import annotations

import pytest

from estimator.errors import FrenzyInputError
from estimator.plan import Plan
from estimator.plan_filter import filter_plans, matches, parse_plan_filter


def P(**kw) -> Plan:
    base = dict(gpu_type="A100-80GB", gpus=1, dp=1)
    base.update(kw)
    return Plan(**base)


PLANS = {
    "A100-80GB": [P(gpus=2, dp=2), P(gpus=2, tp=2), P(gpus=4, dp=2, pp=2, zero=1),
                  P(gpus=2, dp=2, zero=2, offload="optimizer"), P(gpus=16, dp=8, tp=2, zero=3)],
    "RTX3090-24GB": [P(gpu_type="RTX3090-24GB", gpus=2, dp=1, cp=2)],
}


def test_parse_knobs_of_every_kind():
    assert parse_plan_filter("tp=2") == {"tp": 2}
    assert parse_plan_filter(" offload=optimizer+params , zero=3 ,") == {"offload": "optimizer+params", "zero": 3}
    assert parse_plan_filter("NODES=2,gpu=cpu,act_ckpt=full") == {"nodes": 2, "gpu": "cpu", "act_ckpt": "full"}


@pytest.mark.parametrize("text, named", [
    ("tq=2", "unknown knob 'tq'"), ("tp", "not knob=value"), ("tp=two", "tp must be an integer"),
    ("zero=4", "zero must be 0..3"), ("tp=0", "tp must be >= 1"), ("offload=disk", "offload must be one of"),
    ("tp=2,tp=4", "given twice"), ("", "empty filter"), (" , ", "empty filter"),
])
def test_bad_filters_are_one_line_naming_the_knob(text, named):
    with pytest.raises(FrenzyInputError) as e:
        parse_plan_filter(text)
    assert e.value.field == "plan" and named in str(e.value) and "\n" not in str(e.value)


def test_filter_keeps_matching_plans_per_type():
    got = filter_plans(PLANS, parse_plan_filter("tp=2"), {"A100-80GB": 8})
    assert got["A100-80GB"] == [PLANS["A100-80GB"][1], PLANS["A100-80GB"][4]] and got["RTX3090-24GB"] == []
    got = filter_plans(PLANS, parse_plan_filter("tp=2,zero=3"), 8)
    assert [p.gpus for p in got["A100-80GB"]] == [16]
    got = filter_plans(PLANS, parse_plan_filter("offload=optimizer"), 8)
    assert [p.offload for ps in got.values() for p in ps] == ["optimizer"]
    assert [p.cp for p in filter_plans(PLANS, {"cp": 2}, 8)["RTX3090-24GB"]] == [2]
    assert filter_plans(PLANS, None, 8) is PLANS


def test_nodes_count_gpus_per_node_of_the_type():
    big = PLANS["A100-80GB"][4]
    assert matches(big, {"nodes": 2}, 8) and not matches(big, {"nodes": 2}, 16)
    assert matches(big, {"nodes": 1}, 16) and matches(P(gpus=2, dp=2), {"nodes": 1}, 8)
    assert [p.gpus for p in filter_plans(PLANS, {"nodes": 2}, {"A100-80GB": 8})["A100-80GB"]] == [16]
    assert matches(PLANS["RTX3090-24GB"][0], {"gpu": "rtx3090-24gb"}, 8)


def test_plans_carry_the_nodes_the_filter_and_the_gang_count():
    """``Plan.nodes`` in the JSON: the planner's count is what ``--plan nodes=N`` matches, and a
    run's result reports the nodes of its placement (one gang flow run per node)."""
    from estimator.plans import plans_for_job
    from frenzy_flows.gang import gang_nodes
    from frenzy_flows.results import with_placed_nodes

    job = {"model": {"name": "tiny-llama", "arch": "llama", "layers": 2, "hidden": 64, "heads": 4,
                     "kv_heads": 2, "vocab": 256}, "seq_len": 32, "global_batch": 4, "train_steps": 1}
    plans = plans_for_job(job, {"CPU": 2}, gpus_per_node=1)["CPU"]
    assert {(p.gpus, p.nodes) for p in plans} == {(1, 1), (2, 2)}
    assert all(matches(p, {"nodes": p.nodes}, 1) for p in plans)
    two = plans_for_job(job, {"CPU": 2}, gpus_per_node=1, plan_filter={"nodes": 2})["CPU"]
    assert two and all(p.nodes == 2 and '"nodes":2' in p.model_dump_json() for p in two)
    placement = {"cpu2-1": [0], "cpu2-0": [0]}
    assert with_placed_nodes(two[0], placement).nodes == len(gang_nodes(placement)) == 2
    # spread over more nodes than the planner counted: the result says where it ran
    assert with_placed_nodes(P(gpus=2, dp=2), placement).nodes == 2
    assert with_placed_nodes(P(gpus=4, dp=4), placement).nodes == 1      # another count: kept
    assert Plan.model_validate({k: v for k, v in P(gpus=2, dp=2).model_dump().items() if k != "nodes"}).nodes == 1


def test_no_match_names_the_filter():
    with pytest.raises(FrenzyInputError) as e:
        filter_plans(PLANS, parse_plan_filter("pp=4"), 8)
    assert "no feasible plan matches 'pp=4'" in str(e.value) and "6 feasible plans" in str(e.value)


def test_cli_refuses_an_unknown_knob_and_a_filter_nothing_matches(tmp_path):
    from tests.test_cli_run import ROOT, frenzy

    proc = frenzy("run", str(ROOT / "examples/tiny-job.yaml"), "--plan", "tpp=2", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "unknown knob 'tpp'" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    proc = frenzy("run", str(ROOT / "examples/tiny-job.yaml"), "--plan", "gpus=64", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "no feasible plan matches 'gpus=64'" in proc.stderr, proc.stderr
    assert not (tmp_path / ".frenzy" / "prefect").exists()          # refused before Prefect started


def test_tp_or_cp_that_does_not_divide_the_heads_is_one_line_naming_them():
    from estimator.models import resolve_model

    spec = resolve_model("gpt2-tiny")                      # 4 heads
    for text, knob in (("tp=3", "tp=3"), ("cp=8", "cp=8"), ("tp=2,cp=3", "cp=3")):
        with pytest.raises(FrenzyInputError) as e:
            filter_plans(PLANS, parse_plan_filter(text), 8, spec=spec)
        msg = str(e.value)
        assert e.value.field == "plan" and f"{knob} must divide the model's 4 attention heads" in msg, msg
        assert "\n" not in msg
    gqa = resolve_model({"name": "gqa", "arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2,
                         "vocab": 256})
    with pytest.raises(FrenzyInputError, match="tp=4 must divide the model's 4 attention heads and 2 KV heads"):
        filter_plans(PLANS, {"tp": 4}, 8, spec=gqa)
    assert filter_plans(PLANS, {"tp": 2}, 8, spec=gqa)["A100-80GB"]     # 2 divides both


def test_cli_refuses_tp_the_heads_do_not_split_into(tmp_path):
    from tests.test_cli_run import ROOT, frenzy

    proc = frenzy("run", str(ROOT / "examples/tiny-job.yaml"), "--plan", "tp=3", cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "tp=3 must divide the model's 4 attention heads" in proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr


def test_the_planner_picks_matching_plans_among_all_that_fit():
    """Plans of the asked kind are chosen before the best few per GPU count are kept: a slower
    tp=2 plan is not crowded out by faster tp=1 ones and then filtered to nothing."""
    from estimator.plans import plans_for_job

    job = {"model": "llama-3.2-1b", "seq_len": 1024, "global_batch": 16, "train_steps": 1}
    free = plans_for_job(job, {"A100-80GB": 8}, gpus_per_node=8)["A100-80GB"]
    assert not [p for p in free if p.tp == 2 and p.not_launchable is None]   # crowded out unfiltered
    got = plans_for_job(job, {"A100-80GB": 8}, gpus_per_node=8, plan_filter={"tp": 2})["A100-80GB"]
    assert got and all(p.tp == 2 for p in got) and any(p.not_launchable is None for p in got)
    with pytest.raises(FrenzyInputError, match="no feasible plan matches 'gpus=64'"):
        plans_for_job(job, {"A100-80GB": 8}, gpus_per_node=8, plan_filter={"gpus": 64})
    with pytest.raises(FrenzyInputError, match="tp=3 must divide the model's 32 attention heads"):
        plans_for_job(job, {"A100-80GB": 8}, gpus_per_node=8, plan_filter={"tp": 3})
    # the --plan text, as `frenzy run --plan` and the submit flow take it, is the same filter
    assert plans_for_job(job, {"A100-80GB": 8}, gpus_per_node=8, plan_filter="tp=2")["A100-80GB"] == got
    assert plans_for_job(job, {"A100-80GB": 8}, gpus_per_node=8, plan_filter="")["A100-80GB"] == free
    with pytest.raises(FrenzyInputError, match="unknown knob 'tq'"):
        plans_for_job(job, {"A100-80GB": 8}, gpus_per_node=8, plan_filter="tq=2")
    # a dict is checked as the text is (a bad value raised a bare ValueError deep inside)
    with pytest.raises(FrenzyInputError, match="tp must be an integer"):
        plans_for_job(job, {"A100-80GB": 8}, gpus_per_node=8, plan_filter={"tp": "x"})


TINY_LLAMA = {"model": {"name": "tiny-llama", "arch": "llama", "layers": 2, "hidden": 64, "heads": 4,
                        "kv_heads": 2, "vocab": 256}, "seq_len": 32, "global_batch": 4, "train_steps": 4,
              "precision": "fp32"}


@pytest.mark.parametrize("text,field,value", [("tp=2", "tp", 2), ("pp=2", "pp", 2), ("cp=2", "cp", 2),
                                              ("offload=optimizer", "offload", "optimizer")])
def test_cpu_ranks_get_the_plan_kind_a_filter_asks_for(text, field, value):
    """The CPU pseudo GPU type proposes data-parallel plans only, unless ``--plan`` asks for
    another kind: then launchable plans of that kind (what `frenzy run --plan tp=2` on a laptop
    launches)."""
    from estimator.plans import plans_for_job

    free = plans_for_job(TINY_LLAMA, {"CPU": 2}, gpus_per_node=2)["CPU"]
    assert free and all(p.tp == p.pp == p.cp == 1 and p.offload == "none" for p in free)
    got = plans_for_job(TINY_LLAMA, {"CPU": 2}, gpus_per_node=2, plan_filter=parse_plan_filter(text))["CPU"]
    launchable = [p for p in got if p.not_launchable is None]
    assert launchable and all(getattr(p, field) == value for p in got), got
    assert launchable[0].gpus == launchable[0].dp * launchable[0].tp * launchable[0].pp * launchable[0].cp


def test_long_sequences_get_sequence_parallel_plans_on_gpus():
    """A filter asking for cp keeps only cp (Ulysses) plans, beside data parallel, and their
    predicted memory is the estimator's (unasked, cp is enumerated on GPU types too and chosen
    where memory binds: ``test_estimator_plans``)."""
    from estimator import estimate
    from estimator.plans import plans_for_job

    job = {"model": "llama-3.1-8b", "seq_len": 8192, "global_batch": 32, "train_steps": 1}
    plans = plans_for_job(job, {"H100-80GB": 8}, gpus_per_node=8, plan_filter={"cp": 2})["H100-80GB"]
    ok = [p for p in plans if p.not_launchable is None]
    assert ok and all(p.cp == 2 and p.tp == 1 and p.pp == 1 for p in ok)
    p = ok[0]
    e = estimate(model="llama-3.1-8b", seq_len=8192, micro_batch=p.micro_batch, grad_accum=p.grad_accum,
                 dp=p.dp, cp=p.cp, zero=p.zero, offload=p.offload, act_ckpt=p.act_ckpt, gpu="H100-80GB")
    assert p.device_used_gib == pytest.approx(e.device_used_gib, abs=1e-3)
    with pytest.raises(FrenzyInputError, match="cp=3 must divide"):
        plans_for_job(job, {"H100-80GB": 8}, gpus_per_node=8, plan_filter={"cp": 3})


@pytest.mark.slow
def test_cli_runs_a_tensor_parallel_plan_on_cpu_ranks(tmp_path):
    """`frenzy run JOB --plan tp=2,zero=0 --json` on the laptop's CPU ranks: the planner proposes
    the kind asked for, every candidate plan in the result matches the filter, and the run
    completes on it (the other kinds: tests/test_parallel_plans.py)."""
    import json
    import yaml
    from tests.test_cli_run import ROOT, frenzy

    job = dict(TINY_LLAMA, name="tiny-llama-tp", data={"kind": "synthetic"}, lr=0.003, checkpoint_every=100)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    proc = frenzy("run", str(tmp_path / "job.yaml"), "--plan", "tp=2,zero=0", "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["status"] == "completed", doc.get("error")
    assert doc["plan"]["tp"] == 2 and doc["plan"]["zero"] == 0 and doc["plan"]["gpus"] == 2
    assert doc["plan"]["gpu_type"] == "CPU"
    assert doc["plans"] and all(p["tp"] == 2 and p["zero"] == 0 for ps in doc["plans"].values() for p in ps)
    assert len(doc["losses"]) == 4
