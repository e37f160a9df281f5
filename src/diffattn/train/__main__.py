"""``python -m diffattn.train CONFIG [...]``: ``diffattn train``, also the torchrun entry point."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from diffattn.commands import train as command


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m diffattn.train", description=command.DESCRIPTION
    )
    command.add_arguments(parser)
    return command.run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
