"""Pytest configuration: make the repo root and this directory importable.

The repo root makes ``import tpcompile`` work without installing the package; the
tests directory makes ``from dist import run_distributed`` work, and lets spawned
worker processes re-import test modules by name to unpickle their functions.

Plans go through a plan cache fresh for the session (``TPCOMPILE_PLAN_CACHE``, inherited
by every spawned rank): each model and set of planning arguments is traced once, by the
first rank that plans it, and read back by the other ranks and by later tests.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

__all__: list[str] = []

_TESTS_DIR = Path(__file__).resolve().parent
for _path in (_TESTS_DIR.parent, _TESTS_DIR):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

if "TPCOMPILE_PLAN_CACHE" not in os.environ:
    _PLANS = tempfile.mkdtemp(prefix="tpcompile-plans-")
    os.environ["TPCOMPILE_PLAN_CACHE"] = _PLANS
    atexit.register(shutil.rmtree, _PLANS, ignore_errors=True)
