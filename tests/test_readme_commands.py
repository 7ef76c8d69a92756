"""The README's commands work on a user's clone: every `frenzy` command parses, and every file
a command or link names is in the repository (no paths into a development setup beside it)."""
from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from frenzy_cli.main import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _shell_lines() -> list[str]:
    """Command lines of the README's shell blocks (fences without a language or ``bash``),
    comments cut, continuation lines joined."""
    lines: list[str] = []
    fence, pending = None, ""
    for raw in README.splitlines():
        if raw.startswith("```"):
            fence = None if fence is not None else (raw[3:].strip() or "sh")
            continue
        if fence not in ("sh", "bash"):
            continue
        line = re.sub(r"\s+#.*$", "", raw).strip()
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        if pending + line:
            lines.append(pending + line)
        pending = ""
    return lines


def _tracked() -> set[str] | None:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None                             # not a git checkout: existence is checked alone
    return set(out.splitlines())


def test_readme_names_only_files_of_the_repository():
    assert "../shared" not in README and "/work/" not in README
    named = set(re.findall(r"(?<![\w/.])((?:examples|data|docs|scripts|bench|deployments|frenzy_airflow)/[\w./-]+\w)",
                           README))
    assert "data/traces/elasticflow/cluster01.csv" in named and "docs/fleet.md" in named
    tracked = _tracked()
    for path in sorted(named):
        assert (ROOT / path).exists(), path
        if tracked is not None:
            assert path in tracked or any(t.startswith(path + "/") for t in tracked), f"{path} is not committed"


def test_every_readme_frenzy_command_parses():
    commands = [shlex.split(line) for line in _shell_lines() if line.startswith("frenzy ")]
    assert len(commands) >= 12
    for argv in commands:
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit as err:           # argparse's exit: a flag or value the CLI lacks
            pytest.fail(f"{' '.join(argv)}: exit {err.code}")


def test_readme_make_targets_and_pools_exist():
    makefile = (ROOT / "Makefile").read_text()
    for line in _shell_lines():
        if line.startswith("make "):
            assert re.search(rf"^{line.split()[1]}:", makefile, flags=re.M), line
    pools = set(re.findall(r"name:\s*([\w.-]+)", (ROOT / "examples/cluster.yaml").read_text()))
    for pool in re.findall(r"prefect worker start --pool ([\w.-]+)", README):
        assert pool == "frenzy" or pool in pools, f"README starts a worker for pool {pool!r}, not in examples/cluster.yaml"
