"""``python -m ledger.migrations revision "message"``: autogenerate the next ledger schema
revision; ``python -m ledger.migrations heads``: print the head revision."""
from __future__ import annotations

import sys

from . import head, new_revision


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "revision":
        print(new_revision(argv[1]))
        return 0
    if argv == ["heads"]:
        print(head())
        return 0
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
