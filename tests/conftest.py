"""Pytest configuration: make the repo root and this directory importable.

The repo root makes ``import tpcompile`` work without installing the package; the
tests directory makes ``from dist import run_distributed`` work, and lets spawned
worker processes re-import test modules by name to unpickle their functions.
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__: list[str] = []

_TESTS_DIR = Path(__file__).resolve().parent
for _path in (_TESTS_DIR.parent, _TESTS_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
