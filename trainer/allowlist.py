"""What a submitted job may read and run: data roots and entry-point modules.

A job names files (``data.path``, a local ``data.tokenizer`` folder, ``eval.data``) and
possibly a ``module:function`` the ranks import and call; without limits any submitter could
train on any file of the machine or run any function (``os:system``). Allowed:

* data: files and folders under a data root, after symlinks are resolved. Roots: the job
  file's folder (the CLI configures it), the working directory, ``FRENZY_HOME``, the roots in
  ``FRENZY_DATA_ROOTS`` (``os.pathsep``-separated) and the FrenzySettings block's ``data_roots``.
* entry points: the trainer's own package, the modules in ``FRENZY_ENTRY_POINT_MODULES``
  (comma-separated) and the block's ``entry_point_modules``; a name allows the module and its
  submodules. Checked before anything is imported.

``configure`` adds roots/modules for this process (the CLI: the job's folder; a flow: its
settings block). Pure (no torch, no prefect).
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from estimator.errors import FrenzyInputError
from estimator.home import frenzy_home

DATA_ROOTS_ENV = "FRENZY_DATA_ROOTS"
ENTRY_POINT_MODULES_ENV = "FRENZY_ENTRY_POINT_MODULES"
TRAINER_PACKAGE = "trainer"

_configured: dict[str, list[str]] = {"data_roots": [], "entry_point_modules": []}


def configure(*, data_roots: Iterable[str | os.PathLike] = (), entry_point_modules: Iterable[str] = ()) -> None:
    for r in data_roots:
        if str(r) not in _configured["data_roots"]:
            _configured["data_roots"].append(str(r))
    for m in entry_point_modules:
        if m and m not in _configured["entry_point_modules"]:
            _configured["entry_point_modules"].append(m)


def configure_from(site: Any) -> None:
    """The allow-lists of a FrenzySettings block (None: nothing)."""
    if site is not None:
        configure(data_roots=getattr(site, "data_roots", None) or (),
                  entry_point_modules=getattr(site, "entry_point_modules", None) or ())


def reset() -> None:
    for v in _configured.values():
        v.clear()


def data_roots() -> list[Path]:
    env = [r for r in os.environ.get(DATA_ROOTS_ENV, "").split(os.pathsep) if r]
    roots = [*_configured["data_roots"], Path.cwd(), frenzy_home(), *env]
    return list(dict.fromkeys(Path(r).expanduser().resolve() for r in roots))


def entry_point_modules() -> list[str]:
    env = [m.strip() for m in os.environ.get(ENTRY_POINT_MODULES_ENV, "").split(",") if m.strip()]
    return list(dict.fromkeys([TRAINER_PACKAGE, *_configured["entry_point_modules"], *env]))


def check_path(field: str, path: str) -> None:
    """``path`` (resolved, symlinks followed) lies under a data root, else FrenzyInputError."""
    target = Path(path).expanduser().resolve()
    roots = data_roots()
    if any(target == r or r in target.parents for r in roots):
        return
    raise FrenzyInputError(field, f"{path!r} is outside the allowed data roots ({', '.join(map(str, roots))}); "
                                  f"a site adds roots with the FrenzySettings block's data_roots or {DATA_ROOTS_ENV}")


def check_entry_point(entry: str) -> None:
    module = entry.partition(":")[0]
    allowed = entry_point_modules()
    if any(module == m or module.startswith(m + ".") for m in allowed):
        return
    raise FrenzyInputError("entry_point", f"module {module!r} is not an allowed entry-point module "
                                          f"({', '.join(allowed)}); a site allows more with the FrenzySettings "
                                          f"block's entry_point_modules or {ENTRY_POINT_MODULES_ENV}")


def _data_paths(prefix: str, data: Any) -> list[tuple[str, str]]:
    out = []
    if data is None:
        return out
    if getattr(data, "kind", "synthetic") != "synthetic" and getattr(data, "path", None):
        out.append((f"{prefix}.path", data.path))
    tok = getattr(data, "tokenizer", "byte")
    if tok and tok != "byte" and (os.sep in tok or Path(tok).expanduser().exists()):
        out.append((f"{prefix}.tokenizer", tok))
    return out


def check_job(job: Any) -> None:
    """Every file the job reads and its entry point, against the allow-lists."""
    paths = _data_paths("data", job.data)
    if job.eval is not None and job.eval.data is not None:
        paths += _data_paths("eval.data", job.eval.data)
    for field, path in paths:
        check_path(field, path)
    if job.entry_point:
        check_entry_point(job.entry_point)
