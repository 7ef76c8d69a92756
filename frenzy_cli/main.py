"""`frenzy` command line. Each subcommand lives in its own module exposing
``register(subparsers)``; heavy imports (prefect, torch) happen inside the handlers so that
`frenzy estimate` answers in milliseconds."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from estimator.errors import FrenzyInputError

# module name -> owns these subcommands (order = order in --help)
SUBCOMMAND_MODULES = [
    "frenzy_cli.run",        # run
    "frenzy_cli.estimate",   # estimate, plan, models
    "frenzy_cli.calibrate",  # calibrate
    "frenzy_cli.simulate",   # simulate, workload
    "frenzy_cli.pools",      # pools sync|status
    "frenzy_cli.scheduler",  # scheduler (the live round loop)
    "frenzy_cli.queue",      # queue
]


class OneLineParser(argparse.ArgumentParser):
    """A bad flag is one line, as every other bad input (argparse printed the whole usage block
    first, up to 19 lines for `frenzy estimate`); ``--help`` still shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="frenzy",
        description="Submit LLM training without choosing GPUs: estimate memory, select GPU "
                    "types, assign across a heterogeneous cluster, train.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name == name:      # subcommand not built yet
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "handler", None):
        parser.print_help()
        return 2
    try:
        return int(args.handler(args) or 0)
    except FrenzyInputError as err:
        print(f"frenzy {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`frenzy plan --json | head`): say nothing more, as Unix tools do;
        # stdout is pointed at devnull so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
