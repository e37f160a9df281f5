"""``python -m diffattn.train CONFIG [...]``: ``diffattn train``, also the torchrun entry point."""

from __future__ import annotations

from diffattn.train.cli import main
from diffattn.train.distributed import exit_process

if __name__ == "__main__":
    exit_process(main())  # not sys.exit: see exit_process
