"""The pattern library the analysis applies: one module per family of ops.

Rules are plain values of two kinds: :class:`~tpcompile.analysis.propagate.Rule` (where
an op sends the features tensor parallelism splits) and
:class:`~tpcompile.analysis.tokens.TokenRule` (whether an op keeps tokens apart, what
sequence parallelism needs: :mod:`tpcompile.rules.tokens`); nothing registers itself on
import.  :func:`default_rules` lists both in precedence order (later wins per kind), and
``tpcompile.transform(model, tp, rules=[...])`` appends a user's own, of either kind.

Writing a rule::

    from tpcompile.rules import rule, token_rule
    from tpcompile.rules.pointwise import pointwise

    @rule(torch.ops.my_lib.fused_gelu)
    def fused_gelu(an, node):
        return pointwise(an, node)      # behaves like any elementwise op

    @token_rule(torch.ops.my_lib.fused_gelu)
    def fused_gelu_tokens(node, tags):
        return tags[node.args[0]]       # and computes each token on its own

An op that reads token-carrying values and has no token rule mixes tokens: the stack
keeps whole sequences and the plan's warnings name the op.
"""

from __future__ import annotations

from tpcompile.analysis.propagate import Rule, RuleSet, rule
from tpcompile.analysis.tokens import Mixes, TokenRule, Tokens, token_rule

from .contract import CONTRACT_RULES
from .memory import MEMORY_RULES
from .pointwise import POINTWISE_RULES
from .reduce import REDUCE_RULES
from .shape import SHAPE_RULES
from .tokens import TOKEN_RULES

__all__ = ["Mixes", "Rule", "RuleSet", "TokenRule", "Tokens", "default_rules", "rule", "token_rule"]


def default_rules() -> list[Rule | TokenRule]:
    """Every built-in rule, both kinds, in registration order."""
    return [*SHAPE_RULES, *POINTWISE_RULES, *MEMORY_RULES, *REDUCE_RULES, *CONTRACT_RULES, *_custom_op_rules(),
            *TOKEN_RULES]


def _custom_op_rules() -> list[Rule]:
    """Rules for ops that third-party libraries register (only when they exist)."""
    import torch

    from .contract import grouped_mm

    ops = []
    hf = getattr(torch.ops, "transformers", None)
    if hf is not None and hasattr(hf, "grouped_mm_fallback"):
        ops.append(hf.grouped_mm_fallback)
    return [Rule(ops=tuple(ops), fn=grouped_mm.fn, name="grouped_mm_fallback")] if ops else []
