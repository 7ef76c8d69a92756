"""Job numbers are bounded and typed in the job model, so a bad value is one line naming the
field before Prefect starts or anything is written (`frenzy run` exits 2)."""
from __future__ import annotations

import pytest

from estimator.errors import FrenzyInputError
from frenzy_cli.main import main
from frenzy_cli.run import load_job

TINY = "name: tiny\nmodel: gpt2-tiny\nseq_len: 64\nglobal_batch: 8\nprecision: fp32\n"


@pytest.mark.parametrize("extra, field, rule", [
    ("train_steps: true\n", "train_steps", "not a boolean"),
    ("train_steps: 3\nseed: 1180591620717411303424\n", "seed", "less than or equal to 9223372036854775807"),
    ("train_steps: 3\nseed: -1\n", "seed", "greater than or equal to 0"),
    ("train_steps: 3\nlr: .inf\n", "lr", "finite number"),
    ("train_steps: 3\nlr: .nan\n", "lr", "finite number"),
    ("train_steps: 3\ndeadline_s: .inf\n", "deadline_s", "finite number"),
    ("train_steps: 3\nmax_gpus: false\n", "max_gpus", "not a boolean"),
    ("train_steps: 3\ncheckpoint_every: true\n", "checkpoint_every", "not a boolean"),
    ("train_steps: 3\noptim: {eps: .inf}\n", "optim.eps", "finite number"),
    ("train_tokens: 10000000000000000000\n", "train_tokens", "less than or equal to"),
    ("train_steps: 12\ntrain_tokens: 100\n", "train_steps", "not both"),     # one was silently ignored
    ("train_steps: 3\nfinetune: {method: full, rank: 8}\n", "finetune", "rank: adapter settings need method lora"),
    ("train_steps: 3\nfinetune: {target_modules: [q_proj]}\n", "finetune", "target_modules: adapter settings"),
])
def test_bad_numbers_name_their_field(tmp_path, extra, field, rule):
    f = tmp_path / "job.yaml"
    f.write_text(TINY + extra)
    with pytest.raises(FrenzyInputError) as e:
        load_job(str(f))
    assert e.value.field == field and rule in e.value.rule


def test_an_absurd_sequence_length_is_refused_as_such(tmp_path):
    f = tmp_path / "job.yaml"
    f.write_text(TINY.replace("seq_len: 64", "seq_len: 1000000000000") + "train_steps: 3\n")
    with pytest.raises(FrenzyInputError) as e:
        load_job(str(f))
    assert e.value.field == "seq_len" and "less than or equal to 16777216" in e.value.rule


def test_frenzy_run_exits_2_on_a_bad_number_before_anything_is_written(tmp_path, monkeypatch, capsys):
    home = tmp_path / "home"
    monkeypatch.setenv("FRENZY_HOME", str(home))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    job = tmp_path / "job.yaml"
    job.write_text(TINY + "train_steps: true\n")
    assert main(["run", str(job)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train_steps" in err[0]
    assert not home.exists() and not (tmp_path / "prefect").exists()


def test_a_stored_full_fine_tune_reads_back_and_lora_keeps_its_settings():
    from estimator.job import FinetuneSpec
    full = FinetuneSpec()
    assert FinetuneSpec.model_validate(full.model_dump()) == full      # defaults repeated are not "set"
    lora = FinetuneSpec(method="lora", rank=8, dropout=0.0, target_modules=["q_proj"])
    assert FinetuneSpec.model_validate(lora.model_dump()) == lora
