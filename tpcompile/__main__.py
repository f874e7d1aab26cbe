"""``python -m tpcompile``: the command-line interface (see :mod:`tpcompile.tools.cli`)."""

from __future__ import annotations

import os
import sys

from .tools.cli import main

__all__: list[str] = []

# Commands that only read and print: once their output is flushed, the process ends
# without tearing down its objects (a 405B meta model's, its graphs': 1.3 s of exit).
_READ_ONLY = ("dump-plan",)

# The guard matters: the demo spawns workers, which re-import this module by path.
if __name__ == "__main__":
    code = main()
    if sys.argv[1:2] and sys.argv[1] in _READ_ONLY:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)
    sys.exit(code)
