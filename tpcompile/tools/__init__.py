"""Tools around the library: the CLI, ``verify``, the cost model, the layout search and
hardware profiles, the config shrinker, presets, the demo and the local launcher.
Nothing in the library imports them.

Example:
    >>> from tpcompile.tools import estimate_cost, shrink_config, verify   # doctest: +SKIP
    >>> report = verify("llama", tp=2)
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["WorkerFailed", "calibrate", "estimate_cost", "free_port", "plan_layout", "shrink_config", "spawn_local",
           "verify"]

# imported on first use: ``python -m tpcompile --help`` should not pay for the cost model
_HOME = {"estimate_cost": "cost", "shrink_config": "shrink", "verify": "verify", "spawn_local": "launch",
         "free_port": "launch", "WorkerFailed": "launch", "plan_layout": "layout", "calibrate": "hardware"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
