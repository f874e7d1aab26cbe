"""The pattern library the analysis applies: one module per family of ops.

Rules are plain :class:`~tpcompile.analysis.propagate.Rule` values; nothing registers
itself on import.  :func:`default_rules` lists them in precedence order (later wins), and
``tpcompile.transform(model, tp, rules=[...])`` appends a user's own.

Writing a rule::

    from tpcompile.rules import rule
    from tpcompile.rules.pointwise import pointwise

    @rule(torch.ops.my_lib.fused_gelu)
    def fused_gelu(an, node):
        return pointwise(an, node)      # behaves like any elementwise op
"""

from __future__ import annotations

from tpcompile.analysis.propagate import Rule, RuleSet, rule

from .contract import CONTRACT_RULES
from .memory import MEMORY_RULES
from .pointwise import POINTWISE_RULES
from .reduce import REDUCE_RULES
from .shape import SHAPE_RULES

__all__ = ["Rule", "RuleSet", "default_rules", "rule"]


def default_rules() -> list[Rule]:
    """Every built-in rule, in registration order."""
    return [*SHAPE_RULES, *POINTWISE_RULES, *MEMORY_RULES, *REDUCE_RULES, *CONTRACT_RULES, *_custom_op_rules()]


def _custom_op_rules() -> list[Rule]:
    """Rules for ops that third-party libraries register (only when they exist)."""
    import torch

    from .contract import grouped_mm

    ops = []
    hf = getattr(torch.ops, "transformers", None)
    if hf is not None and hasattr(hf, "grouped_mm_fallback"):
        ops.append(hf.grouped_mm_fallback)
    return [Rule(ops=tuple(ops), fn=grouped_mm.fn, name="grouped_mm_fallback")] if ops else []
