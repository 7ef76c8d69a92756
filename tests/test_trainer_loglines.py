"""The run log a person reads: sentences instead of FRENZY_<TAG> {json} lines, no library
warnings, thinned step lines; the attempt's file keeps every line as printed."""
from __future__ import annotations

import io
import json

from trainer.loglines import STEP_LINES, RunLog
from trainer.runner import _Listener


def _step(step, total=12, loss=5.4321, dt=0.0521):
    return "FRENZY_STEP " + json.dumps({"step": step, "total": total, "loss": loss, "step_time_s": dt,
                                        "tokens": 512, "lr": 0.003})


def test_program_lines_become_sentences_and_warnings_stay_out():
    log = RunLog()
    assert log(_step(1)) == "step 1/12: loss 5.4321, 52.1 ms/step"
    assert log('FRENZY_EVAL {"step": 6, "loss": 4.9, "sequences": 4, "eval_time_s": 0.1}') == \
        "eval at step 6: loss 4.9000"
    assert log('FRENZY_CHECKPOINT {"step": 6, "dir": "/runs/x/checkpoints/step-6", "save_s": 0.2}') == \
        "checkpoint at step 6: /runs/x/checkpoints/step-6"
    assert log('FRENZY_MODEL {"params": 1234567, "trainable_params": 1234567, "finetune": "full"}') == \
        "model: 1,234,567 parameters (full)"
    assert log('FRENZY_RESULT {"status": "completed"}') is None
    # Python's warning format and the source line it prints beneath: out of the run log
    assert log("/venv/lib/python3.11/site-packages/torch/x.py:83: FutureWarning: `foo` is deprecated") is None
    assert log("  warnings.warn(") is None
    assert log("/venv/site-packages/accelerate/y.py:9: UserWarning: gloo on CPU") is None
    assert log("    return fn(*args)") is None
    # the libraries' notices of a tiny CPU run (seen in `frenzy run examples/tiny-job.yaml`)
    for noise in ("[transformers] `loss_type=None` was set in the config but it is unrecognized.",
                  "[RANK 0] Removed shared tensor {'lm_head.weight'} while saving.",
                  "[2026-12-01 21:38:43,579] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
                  "", "Writing model shards: 100%|##########| 1/1 [00:00<00:00, 516.73it/s]",
                  'FRENZY_EXPORT {"step": 12, "dir": "/runs/x/export", "request_id": null}'):
        assert log(noise) is None, noise
    assert log("[2026-12-01 21:38:43,579] [ERROR] [engine.py:1:x] broken") is not None
    assert log("frenzy: export step 12 -> /runs/x/export (0.1 s)") == "frenzy: export step 12 -> /runs/x/export (0.1 s)"
    assert log("an ordinary line") == "an ordinary line"
    assert log("  an indented line after an ordinary one") == "  an indented line after an ordinary one"
    assert log("FRENZY_STEP not json") == "FRENZY_STEP not json"       # as printed when it is not ours


def test_long_runs_log_about_twenty_step_lines_first_and_last_included():
    log = RunLog()
    shown = [s for i in range(1, 1001) if (s := log(_step(i, total=1000))) is not None]
    assert STEP_LINES <= len(shown) <= STEP_LINES + 2
    assert shown[0].startswith("step 1/1000:") and shown[-1].startswith("step 1000/1000:")


def test_the_flows_log_sentences_and_the_attempt_file_keeps_every_line():
    import inspect

    from frenzy_flows import training
    from trainer.loglines import readable_log

    logged, steps, file = [], [], io.StringIO()
    listener = _Listener(readable_log(logged.append), lambda s, t, loss: steps.append(s), {}, file)
    lines = [_step(1), "/x/torch/y.py:1: UserWarning: noise", "  warnings.warn(", _step(2)]
    for line in lines:
        listener(line)
    assert steps == [1, 2] and listener.losses == {1: 5.4321, 2: 5.4321}
    assert file.getvalue().splitlines() == lines
    assert logged == ["step 1/12: loss 5.4321, 52.1 ms/step", "step 2/12: loss 5.4321, 52.1 ms/step"]
    # the flows' training (submit in-process and the pool runs) hands the runner that log
    assert "log=training_log" in inspect.getsource(training.run_allocated_training)
