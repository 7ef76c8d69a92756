"""`frenzy calibrate`: fit overhead terms from ledger measurements (real SQLite ledger, real
H200 measurements from bench/) and have estimates use them."""
import json
import os

import pytest

from estimator import estimate
from estimator.overheads import calibration_path, fit_calibration
from frenzy_cli.main import main

MEASURED = os.path.join(os.path.dirname(__file__), "..", "bench", "estimator_measured_h200.json")


def _h200_rows():
    data = json.load(open(MEASURED))
    rows = []
    for r in data["results"]:
        if "error" in r:
            continue
        c = r["config"]
        rows.append(dict(gpu_type="H200-141GB",
                         plan={"gpus": 1, "dp": 1, "tp": 1, "pp": 1, "act_ckpt": c["act_ckpt"]},
                         measured={"memory_measured": True, "allocated_peak_gib": r["allocated_gib"],
                                   "reserved_peak_gib": r["reserved_gib"],
                                   "nvml_used_gib": r["device_used_gib"]}))
    return rows


def test_fit_from_measurements():
    fits = fit_calibration(_h200_rows())
    f = fits["H200-141GB"]
    assert f["runs"] >= 20
    # used - reserved was 0.75 GiB on every run: context = that minus the workspace term
    assert f["cuda_context_gib"] == pytest.approx(0.6, abs=0.05)
    assert 0.02 < f["fragmentation"] < 0.3
    assert f["fragmentation_recompute"] > f["fragmentation"]


def test_fit_skips_cpu_runs_and_fits_nccl():
    rows = [dict(gpu_type="CPU", plan={}, measured={"memory_measured": False})]
    rows += [dict(gpu_type="A100-80GB", plan={"dp": 2, "tp": 2, "act_ckpt": "none"},
                  measured={"allocated_peak_gib": 10.0, "reserved_peak_gib": 11.0,
                            "nvml_used_gib": 11.0 + 0.15 + 0.6 + 2 * 0.3})]
    fits = fit_calibration(rows)
    assert "CPU" not in fits
    assert fits["A100-80GB"]["nccl_per_comm_gib"] == pytest.approx(0.3)
    assert fits["A100-80GB"]["fragmentation"] == pytest.approx(0.1)


def test_a_run_that_shared_its_gpu_is_left_out_of_the_context_and_nccl_fits(frenzy_home, capsys):
    """NVML's used memory is the device's: one run on a GPU another process also used (70 GiB
    used for 9 reserved) was fitted as a 61 GiB CUDA context, and every plan of the type then
    carried it. Such runs are left out of the context and NCCL fits, and said so."""
    from ledger.core import Ledger

    def row(used, dp=1):
        return dict(gpu_type="A100-80GB", plan={"gpus": dp, "dp": dp, "act_ckpt": "none"},
                    measured={"allocated_peak_gib": 8.0, "reserved_peak_gib": 9.0, "nvml_used_gib": used})
    alone, shared = row(9.0 + 0.15 + 0.5), row(70.0)
    f = fit_calibration([alone, shared, row(9.0 + 0.15 + 0.5 + 0.3, dp=2), row(60.0, dp=2)])["A100-80GB"]
    assert f["cuda_context_gib"] == pytest.approx(0.5) and f["nccl_per_comm_gib"] == pytest.approx(0.3)
    assert f["outliers"] == 2 and f["runs"] == 4 and f["fragmentation"] == pytest.approx(0.125)
    assert "cuda_context_gib" not in fit_calibration([shared])["A100-80GB"]
    url = f"sqlite:///{frenzy_home}/ledger.db"
    frenzy_home.mkdir(parents=True, exist_ok=True)
    led = Ledger(url)
    for i, r in enumerate((alone, shared)):
        led.record_measurement(f"job-{i}", None, r["gpu_type"], r["plan"], predicted={}, measured=r["measured"])
    assert main(["calibrate", "--ledger", url]) == 0
    assert "1 run(s) left out of the context / NCCL fit" in capsys.readouterr().out
    saved = json.loads(calibration_path().read_text())["A100-80GB"]
    assert saved["cuda_context_gib"] == pytest.approx(0.5) and "outliers" not in saved


@pytest.mark.skipif(not os.path.exists(MEASURED), reason="no GPU measurements in bench/")
def test_calibrate_cli_writes_file_used_by_estimates(frenzy_home, capsys):
    from ledger.core import Ledger
    url = f"sqlite:///{frenzy_home}/ledger.db"
    frenzy_home.mkdir(parents=True, exist_ok=True)
    led = Ledger(url)
    for i, row in enumerate(_h200_rows()):
        # make the fitted terms differ clearly from the defaults
        m = dict(row["measured"], nvml_used_gib=row["measured"]["nvml_used_gib"] + 1.0)
        led.record_measurement(f"job-{i}", None, row["gpu_type"], row["plan"], predicted={}, measured=m)
    before = estimate(model="gpt2", seq_len=1024, micro_batch=8, gpu="H200-141GB")
    assert main(["calibrate", "--ledger", url, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["written"] == str(calibration_path())
    saved = json.loads(calibration_path().read_text())
    assert saved["H200-141GB"]["cuda_context_gib"] == pytest.approx(1.6, abs=0.05)
    after = estimate(model="gpt2", seq_len=1024, micro_batch=8, gpu="H200-141GB")
    assert after.overheads["cuda_context_gib"] == saved["H200-141GB"]["cuda_context_gib"]
    # runtime outside the allocator grew by the extra GiB; reserved follows the fitted fragmentation
    assert (after.device_used_gib - after.reserved_peak_gib) - \
        (before.device_used_gib - before.reserved_peak_gib) == pytest.approx(1.0, abs=0.06)
    assert after.reserved_peak_gib == pytest.approx(
        after.allocated_peak_gib * (1 + saved["H200-141GB"]["fragmentation"]))
    assert after.allocated_peak_gib == before.allocated_peak_gib


def test_calibrate_with_no_measurements(frenzy_home, capsys):
    from ledger import Ledger
    frenzy_home.mkdir(parents=True, exist_ok=True)
    Ledger(f"sqlite:///{frenzy_home}/empty.db")          # a ledger nothing has measured in
    assert main(["calibrate", "--ledger", f"sqlite:///{frenzy_home}/empty.db"]) == 0
    assert "nothing to fit" in capsys.readouterr().out
    assert not calibration_path().exists()


@pytest.mark.parametrize("command", [["calibrate", "--dry-run"], ["queue"]])
def test_a_ledger_that_is_not_there_or_not_a_database_is_one_line(frenzy_home, tmp_path, capsys, command):
    """A mistyped path is not made into an empty ledger (it read as "0 measurements", and a dry
    run wrote it); a file that is not a database, a folder, an unknown driver: one line each."""
    missing = tmp_path / "nowhere" / "ledger.db"
    assert main([*command, "--ledger", f"sqlite:///{missing}"]) == 2
    assert f"--ledger: no ledger at {missing}" in capsys.readouterr().err
    assert not missing.parent.exists()
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database at all, just bytes" * 8)
    for url, says in ((f"sqlite:///{junk}", "file is not a database"), (f"sqlite:///{tmp_path}", "is a folder"),
                      ("mysql://127.0.0.1:1/x", "cannot open the ledger at mysql://127.0.0.1:1/x")):
        assert main([*command, "--ledger", url]) == 2
        [line] = capsys.readouterr().err.strip().splitlines()
        assert says in line


def test_fit_splits_expandable_recomputation_and_lora_runs():
    """Runs that report expandable segments (the trainer's ``measured["allocator"]``) fit their
    own recomputation term, LoRA runs (by their job's spec) the adapters' term; runs without
    the field are the default allocator's, as before."""
    def row(job, ckpt, frag, allocator=None):
        meas = {"memory_measured": True, "allocated_peak_gib": 10.0, "reserved_peak_gib": 10.0 * (1 + frag)}
        if allocator:
            meas["allocator"] = allocator
        return dict(job_id=job, gpu_type="H100-80GB", plan={"gpus": 1, "act_ckpt": ckpt}, measured=meas)

    rows = [row("full", "none", 0.05, "expandable"), row("ckpt", "full", 0.14, "expandable"),
            row("old", "full", 0.30), row("lora", "none", 0.22, "expandable"), row("lora-d", "none", 0.08)]
    specs = {"lora": {"finetune": {"method": "lora"}}, "lora-d": {"finetune": "lora"}}
    f = fit_calibration(rows, specs)["H100-80GB"]
    assert f["fragmentation_recompute_expandable"] == pytest.approx(0.14)
    assert f["fragmentation_recompute"] == pytest.approx(0.30)
    assert f["fragmentation_adapters"] == pytest.approx(0.22)
    # LoRA under the default allocator pools with the full fine-tunes, as the estimate reads it
    assert f["fragmentation"] == pytest.approx(0.08)
    # without the specs a LoRA run cannot be told apart
    assert "fragmentation_adapters" not in fit_calibration(rows)["H100-80GB"]


def test_a_calibration_file_that_does_not_parse_warns_and_the_defaults_hold(frenzy_home):
    """A corrupt calibration file was ignored without a word: now a warning says the defaults
    are used, once per version of the file."""
    import warnings

    from estimator.home import forget_json_cache
    from estimator.overheads import DEFAULT, overheads_for

    frenzy_home.mkdir(parents=True, exist_ok=True)
    calibration_path().write_text("garbage{")
    forget_json_cache()
    with pytest.warns(UserWarning, match="does not parse .*the defaults are used"):
        assert overheads_for("A100-80GB") == DEFAULT
    with warnings.catch_warnings():
        warnings.simplefilter("error")           # the same file again: no second warning
        assert overheads_for("A100-80GB") == DEFAULT


@pytest.mark.parametrize("terms", [{"cuda_context_gib": float("nan")}, {"cuda_context_gib": -500},
                                   {"fragmentation": -0.9}, {"fragmentation_recompute": 3.0},
                                   {"zero3_live_units": 0}, {"workspace_gib": "big"}])
def test_a_calibration_term_out_of_its_range_is_named_and_the_defaults_hold(frenzy_home, terms):
    """A NaN or negative overhead in a hand-edited file made every plan fit (device used NaN or
    -497 GiB): the file is refused with the GPU type and term named, and the defaults are used."""
    from estimator.home import forget_json_cache
    from estimator.overheads import DEFAULT, overheads_for

    frenzy_home.mkdir(parents=True, exist_ok=True)
    calibration_path().write_text(json.dumps({"A100-80GB": terms}))    # NaN: JSON's NaN literal
    forget_json_cache()
    key = next(iter(terms))
    with pytest.warns(UserWarning, match=f"A100-80GB.{key} must be a number"):
        assert overheads_for("A100-80GB") == DEFAULT
    est = estimate(model="llama-3.1-70b", seq_len=8192, gpu="A100-80GB")
    assert est.fits is False and est.device_used_gib > 80


def test_estimate_json_carries_the_calibration_warning(frenzy_home, capsys):
    """The table said the calibration file was ignored; --json said nothing."""
    from estimator.home import forget_json_cache

    frenzy_home.mkdir(parents=True, exist_ok=True)
    calibration_path().write_text("{broken")
    forget_json_cache()
    assert main(["estimate", "--model", "llama-3.2-1b", "--seq-len", "2048", "--gpu", "A100-80GB", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert any("does not parse" in w for w in doc["warnings"])
    # a plan that fits nowhere: the warning, then the refusal (it may come of the ignored file)
    forget_json_cache()
    assert main(["plan", "--model", "llama-3.1-70b", "--seq-len", "8192", "--global-batch", "8",
                 "--gpu", "A100-80GB", "--max-gpus", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "warning:" in err[0] and "does not parse" in err[0] and "fits no GPU" in err[1]
