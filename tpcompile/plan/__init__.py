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

from .build import build_plan, plan_model
from .check import check_plan
from .table import TensorMap, TranslationTable, build_table
from .types import PLAN_VERSION, ExpertsPlan, ModulePlan, ParamPlan, Plan, Role

__all__ = [
    "PLAN_VERSION", "ExpertsPlan", "ModulePlan", "ParamPlan", "Plan", "Role", "TensorMap", "TranslationTable",
    "build_plan", "build_table", "check_plan", "plan_model",
]
