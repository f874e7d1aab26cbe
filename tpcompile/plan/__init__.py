"""The plan stage: what tpcompile decided, as data that prints, prices and applies.

* :mod:`~tpcompile.plan.types` — :class:`Plan`, :class:`ParamPlan`, :class:`ModulePlan`
  and its typed collective entries, :class:`ExpertsPlan`;
* :mod:`~tpcompile.plan.build` — :func:`plan_model`: capture → analysis → self-check →
  plan;
* :mod:`~tpcompile.plan.table` — the HF ⇄ per-rank :class:`TranslationTable`;
* :mod:`~tpcompile.plan.sequence` / :mod:`~tpcompile.plan.experts` — the sequence- and
  expert-parallel plans;
* :mod:`~tpcompile.plan.check` — :func:`check_plan` before a saved plan is applied.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .build import build_plan, plan_model
from .check import check_plan
from .table import TensorMap, TranslationTable, build_table
from .types import PLAN_VERSION, ExpertsPlan, ModulePlan, ParamPlan, Plan, Role

__all__ = [
    "PLAN_VERSION", "ExpertsPlan", "ModulePlan", "ParamPlan", "Plan", "Role", "TensorMap", "TranslationTable",
    "build_plan", "build_table", "check_plan", "plan_model",
]

# names the single ``tpcompile/plan.py`` module exported before the plan stage became a
# package: still importable for one release, with a DeprecationWarning
_MOVED = {"key_matches": "tpcompile.analysis.roles", "index_to_runs": "tpcompile.plan.types",
          "runs_to_index": "tpcompile.plan.types", "select_rows": "tpcompile.plan.types"}


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        warnings.warn(f"tpcompile.plan.{name} is deprecated; import it from {_MOVED[name]}",
                      DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
