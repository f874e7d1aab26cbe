"""Both sides of a branch on data: one plan that holds whichever side the data takes.

Some models ask their data a yes/no question and run other code after each answer (FSMT:
``if not padding_mask.any(): padding_mask = None``, so a batch without padding skips
the mask).  A trace on shapes alone cannot know the answer; the capture answers every
such question one way (:mod:`tpcompile.capture.branches`) and records where it was
asked.  The plan of one side proves nothing about the other, so a model that asked is
planned a second time with every question answered the other way.  The runtime runs the
model's own code, which takes the side the real data gives, so the two plans must be
the same plan: every parameter's split and every module's collectives and fix-ups.
Shape sites are the exception (a reshape's local sizes keyed by its source line, used
only when that line runs): each side's are proven by its own self-check, and the plan
keeps both sides'.  Plans that differ are a :class:`TPError` naming the branch lines
and the first parameters or modules that differ.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..analysis.shape_sites import is_site
from ..capture.branches import branch_side
from ..errors import TPError
from .modules import ModulePlan
from .types import Plan

__all__ = ["plan_both_sides"]


def plan_both_sides(plan_side: Callable[[], tuple[Plan, tuple[str, ...]]], model_name: str) -> Plan:
    """``plan_side()`` (the plan and the branch lines its capture asked) on the side in
    force; when it asked any, again on the other side, and the one plan both agree on."""
    plan, asked = plan_side()
    if not asked:
        return plan
    lines = ", ".join(asked[:4]) + (f" (and {len(asked) - 4} more)" if len(asked) > 4 else "")
    try:
        with branch_side(False):
            other, _ = plan_side()
    except TPError as err:
        raise TPError(f"{model_name} branches on its data at {lines}; with the other answer there "
                      f"it cannot be split: {err}") from err
    da, db = plan.to_dict(), other.to_dict()
    params = _differing_params(da["params"], db["params"])
    differ = _differences(plan, other, params, da["modules"], db["modules"])
    if differ:
        owners = sorted({plan.params[f].module if f in plan.params else other.params[f].module for f in params})
        keep = ", ".join(f"'re:{re.escape(m)}\\..*': 'replicated'" for m in owners[:4])
        raise TPError(f"{model_name} branches on its data at {lines}, and its two sides need different "
                      f"splits ({'; '.join(differ[:3])}). The runtime runs whichever side the batch takes, "
                      "so no one plan is exact on both"
                      + (f": keep the modules involved whole with overrides={{{keep}}}" if owners else ""))
    _join_sites(plan, other)
    plan.warnings.append(f"planned on both sides of the branches on data at {lines}: the same split")
    return plan


def _module_key(module: dict[str, Any] | None) -> dict[str, Any] | None:
    """A module's plan as data, its shape sites left out; ``None`` when it has nothing."""
    if module is None:
        return None
    fixups = {k: v for k, v in module.get("attr_fixups", {}).items() if not is_site(k)}
    return {**module, "attr_fixups": fixups} if module.get("ops") or fixups else None


def _differing_params(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The parameters two plans' ``params`` (as data) decide differently."""
    def decided(params: dict[str, Any]) -> dict[str, Any]:
        # why a parameter stays whole is said, not decided; where a whole one is swapped
        # in (its scope) changes nothing
        return {k: {**v, "whole_because": ""} | ({"scope": None} if v["shard_dim"] is None else {})
                for k, v in params.items()}

    pa, pb = decided(a), decided(b)
    return [fqn for fqn in sorted(set(pa) | set(pb)) if pa.get(fqn) != pb.get(fqn)]


def _differences(a: Plan, b: Plan, params: list[str], ma: dict[str, Any], mb: dict[str, Any]) -> list[str]:
    """What the two plans decide differently, one phrase per parameter (``params``: those
    :func:`_differing_params` found) or module (``ma`` / ``mb``: their modules as data)."""
    out = [f"parameter {fqn}: {_param_text(a, fqn)} against {_param_text(b, fqn)}" for fqn in params]
    for fqn in sorted(set(ma) | set(mb)):
        ka, kb = _module_key(ma.get(fqn)), _module_key(mb.get(fqn))
        if ka != kb:
            out.append(f"module {fqn}: {_module_text(ka)} against {_module_text(kb)}")
    return out


def _param_text(plan: Plan, fqn: str) -> str:
    p = plan.params.get(fqn)
    if p is None:
        return "not planned"
    return f"{p.role.value}" + (f" split on dim {p.shard_dim}" if p.shard_dim is not None else " whole")


def _module_text(key: dict[str, Any] | None) -> str:
    if key is None:
        return "nothing"
    ops = [op.get("kind", "?") for op in key.get("ops", [])]
    return ", ".join([*ops, *(f"{k}={v[1]}" for k, v in key["attr_fixups"].items())]) or "nothing"


def _join_sites(plan: Plan, other: Plan) -> None:
    """The other side's shape sites, for the lines only it runs."""
    for fqn, mp in other.modules.items():
        sites = {k: v for k, v in mp.attr_fixups.items() if is_site(k)}
        if not sites:
            continue
        mine = plan.modules.setdefault(fqn, ModulePlan(fqn=fqn))
        for k, v in sites.items():
            mine.attr_fixups.setdefault(k, v)
