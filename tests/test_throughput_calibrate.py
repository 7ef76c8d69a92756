"""`frenzy calibrate` refits the throughput model's per-GPU factors from the ledger's measured
step times (real H200 runs from bench/), writes them, and step times then use them; a held-out
file of other runs is predicted better after calibrating than before."""
import json
import math
import os
import statistics

import pytest

from estimator.catalog import get_gpu
from estimator.models import resolve_model
from estimator.plan import Plan
from estimator.throughput import DEFAULT_FACTORS, calibrated_factors, calibration_file, step_time
from frenzy_cli.main import main

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")
REGIME = {"amp": "bf16", "master": "bf16", "fp32": "fp32"}


def _runs(name):
    data = json.load(open(os.path.join(BENCH, name)))
    for r in data["results"]:
        if not r.get("step_s"):
            continue
        c = r["config"]
        plan = Plan(gpu_type="H200-141GB", gpus=1, micro_batch=c["micro_batch"], grad_accum=c.get("grad_accum", 1),
                    act_ckpt=c["act_ckpt"], attention=c["attention"], precision=REGIME[c["regime"]],
                    optimizer=c["optimizer"])
        yield c, plan, r["step_s"]


def _abs_log_median(runs, factors):
    g = get_gpu("H200-141GB")
    return statistics.median(abs(math.log(step_time(resolve_model(c["model"]), p, g, seq_len=c["seq_len"],
                                                    factors=factors) / s)) for c, p, s in runs)


def test_calibrate_cli_fits_throughput_factors_that_step_times_use(frenzy_home, capsys):
    from ledger.core import Ledger
    frenzy_home.mkdir(parents=True, exist_ok=True)
    url = f"sqlite:///{frenzy_home}/ledger.db"
    led = Ledger(url)
    for i, (c, plan, step_s) in enumerate(_runs("estimator_measured_h200.json")):
        led.submit_job(f"job-{i}", c["model"], {"model": c["model"], "seq_len": c["seq_len"]})
        led.record_measurement(f"job-{i}", None, "H200-141GB", plan, predicted={},
                               measured={"step_time_s": step_s, "memory_measured": False})
    # a run whose job cannot be resolved is skipped, not a crash
    led.record_measurement("job-unknown", None, "H200-141GB", Plan(gpu_type="H200-141GB", gpus=1),
                           predicted={}, measured={"step_time_s": 0.1})
    assert calibrated_factors() is DEFAULT_FACTORS
    assert main(["calibrate", "--ledger", url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["throughput"]
    assert out["usable"] >= 20 and out["skipped"] == 1
    fit = out["fits"]["H200-141GB"]
    assert abs(math.log(fit["median_ratio_after"])) < abs(math.log(fit["median_ratio_before"]))
    assert out["written"] == calibration_file()
    saved = json.loads(open(calibration_file()).read())["H200-141GB"]
    assert saved == {"util": fit["util"], "mem_eff": fit["mem_eff"]}
    cal = calibrated_factors()
    assert cal.util == {"H200-141GB": fit["util"]}
    # step_time without explicit factors now uses the fitted ones
    c, plan, _ = next(_runs("estimator_measured_h200.json"))
    g = get_gpu("H200-141GB")
    spec = resolve_model(c["model"])
    assert step_time(spec, plan, g, seq_len=c["seq_len"]) == \
        pytest.approx(step_time(spec, plan, g, seq_len=c["seq_len"], factors=cal))
    assert step_time(spec, plan, g, seq_len=c["seq_len"]) != \
        pytest.approx(step_time(spec, plan, g, seq_len=c["seq_len"], factors=DEFAULT_FACTORS))
    # held-out runs (a second file, other configurations) are predicted better after calibrating
    held = list(_runs("estimator_measured_h200_heldout.json"))
    assert _abs_log_median(held, cal) < _abs_log_median(held, DEFAULT_FACTORS)


def test_calibration_file_with_bad_values_falls_back_to_defaults(frenzy_home, monkeypatch):
    import estimator.throughput as tm
    monkeypatch.setattr(tm, "CAL_RECHECK_S", 0.0)      # look at the file on every call
    frenzy_home.mkdir(parents=True, exist_ok=True)
    with open(calibration_file(), "w") as fh:
        json.dump({"A100-80GB": {"util": 7.0, "mem_eff": 0.5}, "H100-80GB": "nonsense"}, fh)
    f = calibrated_factors()
    assert f.util == {} and f.mem_eff == {"A100-80GB": 0.5}
    with open(calibration_file(), "w") as fh:
        fh.write("{not json")
    assert calibrated_factors() is DEFAULT_FACTORS


def test_a_lora_runs_measurement_carries_its_adapters():
    """``frenzy calibrate`` charges a LoRA run's step its adapters' terms, as the planner did:
    fitting a LoRA run against a full fine-tune's prediction would bias the GPU's factors."""
    from types import SimpleNamespace as NS

    from frenzy_cli.calibrate import throughput_measurements

    plan = Plan(gpu_type="H200-141GB", gpus=1, micro_batch=4, grad_accum=2)
    row = lambda job: NS(job_id=job, measured_step_time_s=0.3, measured={}, gpu_type="H200-141GB",  # noqa: E731
                         plan=plan.model_dump())
    job = {"name": "j", "model": "llama-3.2-1b", "seq_len": 2048, "global_batch": 8, "train_steps": 10}
    specs = {"full": job, "lora": {**job, "finetune": {"method": "lora", "rank": 8}},
             "short": {**job, "finetune": "full"}}
    ms, skipped = throughput_measurements([row("full"), row("lora"), row("short")], specs)
    assert skipped == 0 and [m.adapters is None for m in ms] == [True, False, True]
    assert ms[1].adapters.rank == 8
    g = get_gpu("H200-141GB")
    assert step_time(ms[1].spec, plan, g, seq_len=2048, adapters=ms[1].adapters) < \
        step_time(ms[0].spec, plan, g, seq_len=2048)
