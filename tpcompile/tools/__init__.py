"""Tools around the library: the CLI, ``verify``, the cost model, the layout search and
hardware profiles, the config shrinker, presets, the demo and the local launcher.
No library module imports them; importing this package (the front door ``import
tpcompile`` does) installs the layout search that ``tpcompile.parallelize(layout="auto")``
runs (:mod:`tpcompile.plan.layout`).

Example:
    >>> from tpcompile.tools import estimate_cost, shrink_config, verify   # doctest: +SKIP
    >>> report = verify("llama", tp=2)
"""

from __future__ import annotations

import importlib
from typing import Any

from ..plan.layout import register_layout_search

__all__ = ["WorkerFailed", "calibrate", "estimate_cost", "free_port", "plan_layout", "shrink_config", "spawn_local",
           "verify"]

# imported on first use: ``python -m tpcompile --help`` should not pay for the cost model
_HOME = {"estimate_cost": "cost", "shrink_config": "shrink", "verify": "verify", "spawn_local": "launch",
         "free_port": "launch", "WorkerFailed": "launch", "plan_layout": "layout", "calibrate": "calibration"}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _choose_layout(model: Any, **job: Any) -> dict[str, Any]:
    from .layout import choose_layout

    return choose_layout(model, **job)


# The one upward link, inverted: the layout search prices layouts with the cost model,
# which runs runtime code, so it lives here, above the front doors, and the front doors
# reach it through the registration point of the plan stage (see tpcompile.plan.layout).
# Installed when the tools are imported (``import tpcompile`` does); the search itself is
# imported on first use.
register_layout_search(_choose_layout)
