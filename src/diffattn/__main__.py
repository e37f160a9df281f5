"""``python -m diffattn`` is the ``diffattn`` command."""

import sys

from diffattn.cli import main

sys.exit(main())
