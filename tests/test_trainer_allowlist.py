"""Allow-lists: a job reads data only under the data roots and runs entry points only from the
allowed modules; refused in one line naming the field, before any file is read or module
imported."""
from __future__ import annotations

import os

import pytest

from estimator.errors import FrenzyInputError
from estimator.job import TrainingJob
from trainer import allowlist


@pytest.fixture
def narrow(tmp_path, monkeypatch):
    """Only the defaults (cwd = a fresh folder, FRENZY_HOME) and what a test configures."""
    monkeypatch.delenv(allowlist.DATA_ROOTS_ENV, raising=False)
    monkeypatch.delenv(allowlist.ENTRY_POINT_MODULES_ENV, raising=False)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("FRENZY_HOME", str(tmp_path / "home"))
    allowlist.reset()
    yield work
    allowlist.reset()


def job(**kw) -> TrainingJob:
    return TrainingJob(name="allow", model="gpt2-tiny", seq_len=16, global_batch=2, train_steps=1, **kw)


def test_system_files_are_refused_naming_the_field(narrow):
    with pytest.raises(FrenzyInputError) as e:
        allowlist.check_job(job(data={"kind": "text", "path": "/etc/passwd"}))
    assert e.value.field == "data.path" and "/etc/passwd" in str(e.value) and "data roots" in str(e.value)


def test_a_symlink_out_of_a_root_is_refused(narrow):
    link = narrow / "innocent.txt"
    os.symlink("/etc/passwd", link)
    with pytest.raises(FrenzyInputError) as e:
        allowlist.check_job(job(data={"kind": "text", "path": str(link)}))
    assert e.value.field == "data.path"


def test_defaults_and_configured_roots_are_allowed(narrow, tmp_path, monkeypatch):
    (narrow / "d.txt").write_text("x")
    allowlist.check_job(job(data={"kind": "text", "path": "d.txt"}))          # the working directory
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "e.txt").write_text("x")
    with pytest.raises(FrenzyInputError):
        allowlist.check_job(job(data={"kind": "text", "path": str(shared / "e.txt")}))
    monkeypatch.setenv(allowlist.DATA_ROOTS_ENV, str(shared))                 # a site's root
    allowlist.check_job(job(data={"kind": "text", "path": str(shared / "e.txt")}))
    monkeypatch.delenv(allowlist.DATA_ROOTS_ENV)

    class Site:                                                                # a settings block
        data_roots = [str(shared)]
        entry_point_modules = ["mymodels"]

    allowlist.configure_from(Site())
    allowlist.check_job(job(data={"kind": "text", "path": str(shared / "e.txt")}, entry_point="mymodels.sub:build"))


def test_eval_data_and_tokenizer_folders_are_checked(narrow, tmp_path):
    outside = tmp_path / "tok"
    outside.mkdir()
    (narrow / "d.txt").write_text("x")
    with pytest.raises(FrenzyInputError) as e:
        allowlist.check_job(job(data={"kind": "text", "path": "d.txt", "tokenizer": str(outside)}))
    assert e.value.field == "data.tokenizer"
    with pytest.raises(FrenzyInputError) as e:
        allowlist.check_job(job(data={"kind": "text", "path": "d.txt"},
                                eval={"data": {"kind": "text", "path": "/etc/hostname"}}))
    assert e.value.field == "eval.data.path"


def test_entry_points_default_to_the_trainer_package(narrow, monkeypatch):
    with pytest.raises(FrenzyInputError) as e:
        allowlist.check_job(job(entry_point="os:system"))
    assert e.value.field == "entry_point" and "'os'" in str(e.value)
    allowlist.check_job(job(entry_point="trainer.modeling:build"))             # the trainer's own
    with pytest.raises(FrenzyInputError):
        allowlist.check_job(job(entry_point="trainerx:build"))                # a prefix is not a package
    monkeypatch.setenv(allowlist.ENTRY_POINT_MODULES_ENV, "mymodels, other")
    allowlist.check_job(job(entry_point="other:build"))


def test_preflight_refuses_before_importing(narrow, monkeypatch):
    import sys

    from estimator.plan import Plan
    from trainer.runner import preflight

    (narrow / "sneaky.py").write_text("import sys; sys.modules['__sneaky_ran__'] = True\ndef f(c): pass\n")
    monkeypatch.syspath_prepend(str(narrow))
    j = job(entry_point="sneaky:f")
    with pytest.raises(FrenzyInputError) as e:
        preflight(j, Plan(gpu_type="CPU", gpus=1, dp=1, micro_batch=2, grad_accum=1))
    assert e.value.field == "entry_point" and "__sneaky_ran__" not in sys.modules
