"""``python -m tpcompile``: the command-line interface (see :mod:`tpcompile.tools.cli`)."""

from __future__ import annotations

import sys

from .tools.cli import main

__all__: list[str] = []

# The guard matters: the demo spawns workers, which re-import this module by path.
if __name__ == "__main__":
    sys.exit(main())
