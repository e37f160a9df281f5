"""``python -m diffattn.train CONFIG [...]``: ``diffattn train``, also the torchrun entry point."""

from __future__ import annotations

import sys

from diffattn.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
