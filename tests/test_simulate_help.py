"""`frenzy simulate` and `frenzy workload` each have their own help, with examples printed as
written (one command per example, continuation lines kept) that run on a fresh clone."""
from __future__ import annotations

import contextlib
import io
import shlex
from pathlib import Path

import pytest

from frenzy_cli.main import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def _help(command: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    return out.getvalue()


def _examples(text: str) -> list[list[str]]:
    """The example commands of a help text, continuation lines joined."""
    body = text.split("examples:\n", 1)[1].split("\n\n", 1)[0]
    commands: list[str] = []
    for line in body.splitlines():
        if line.strip().startswith("frenzy "):
            commands.append(line.strip())
        elif commands:
            commands[-1] += " " + line.strip()
    return [shlex.split(c.replace("\\ ", " ")) for c in commands]


@pytest.mark.parametrize("command,other", [("simulate", "workload"), ("workload", "simulate")])
def test_each_command_has_its_own_help_with_its_own_examples(command, other):
    text = _help(command)
    examples = _examples(text)
    assert len(examples) >= 2
    assert all(argv[:2] == ["frenzy", command] for argv in examples)
    assert f"frenzy {other} --" not in text
    for argv in examples:                      # every example parses and names files that exist
        args = build_parser().parse_args(argv[1:])
        for attr in ("trace", "mix", "cluster"):
            if getattr(args, attr, None):
                assert (ROOT / getattr(args, attr)).is_file(), getattr(args, attr)


def test_the_workload_example_runs_as_printed(tmp_path, monkeypatch, capsys):
    argv = _examples(_help("workload"))[0]
    out = argv.index("--out") + 1
    argv[out] = str(tmp_path / argv[out])
    monkeypatch.chdir(ROOT)
    assert main(argv[1:]) == 0
    assert (tmp_path / "w01.csv").read_text().count("\n") == 301      # header + --max-jobs 300
