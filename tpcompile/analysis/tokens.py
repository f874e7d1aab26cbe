"""Which ops are token-local: the propagation sequence parallelism stands on.

Sequence parallelism runs the code *between* tensor-parallel regions (norms, residual
adds, dropout, a router's softmax) on this rank's slice of the tokens. That is exact only
if every such op computes each token's output from that token's inputs alone. This
module is the engine that answers it over the captured graph:

* a value that carries tokens has a :class:`Tokens` tag: the dim that holds them and
  whether batch rows were merged into it (``(B, S, H).view(-1, H)``: fine for row-wise
  math, but no longer a dim one can split into contiguous per-rank chunks);
* the tag of an op's output comes from the :class:`TokenRule` registered for the op in
  the :class:`~tpcompile.analysis.propagate.RuleSet` (the built-in ones, per family of
  ops, are :mod:`tpcompile.rules.tokens`; a user's ``rules=[...]`` may add or override
  them, as for the tensor-parallel rules);
* an op that reads tagged values and has no token rule mixes tokens (attention scores,
  a convolution over time, a cumulative sum, a position lookup, an unknown custom op):
  it is refused, with the op named, never silently accepted.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch.fx as fx

__all__ = ["Mixes", "TokenRule", "TokenRuleFn", "Tokens", "propagate_tokens", "token_rule"]


@dataclass(frozen=True)
class Tokens:
    """The token dim of a value; ``merged``: batch rows folded into it."""

    dim: int
    merged: bool = False


class Mixes(Exception):
    """An op reads token-carrying values in a way that mixes tokens."""


TokenRuleFn = Callable[[fx.Node, Mapping[fx.Node, Tokens]], Tokens]


@dataclass(frozen=True)
class TokenRule:
    """A token rule: the ops it handles and the function giving their output's tag.

    ``fn(node, tags)`` runs when one of ``node``'s inputs carries tokens (``tags``: the
    tag of every token-carrying value so far). It returns the output's :class:`Tokens`,
    or raises :class:`Mixes` saying why the op mixes tokens. ``ops`` are ATen overloads,
    overload packets, Python callables, or a ``torch.Tag`` (every op carrying it; an
    overload's or packet's own rule comes first)."""

    ops: tuple[Any, ...]
    fn: TokenRuleFn
    name: str


def token_rule(*ops: Any) -> Callable[[TokenRuleFn], TokenRule]:
    """Declare a token rule for ``ops``; pass it in ``rules=[...]`` like any rule.

    Example:
        >>> @token_rule(torch.ops.my_lib.fused_gelu)              # doctest: +SKIP
        ... def fused_gelu(node, tags):
        ...     return tags[node.args[0]]        # each token's output from that token
    """

    def wrap(fn: TokenRuleFn) -> TokenRule:
        return TokenRule(ops=tuple(ops), fn=fn, name=fn.__name__)

    return wrap


class _TokenRules(Protocol):
    def find_tokens(self, target: Any) -> TokenRule | None: ...


def propagate_tokens(node: fx.Node, tags: dict[fx.Node, Tokens], rules: _TokenRules) -> Tokens | None:
    """The token tag of ``node``'s value (``None``: it carries no tokens), by the token
    rule ``rules`` (a :class:`~tpcompile.analysis.propagate.RuleSet`) has for its op.

    Raises :class:`Mixes` when the op reads token-carrying inputs and mixes tokens, or
    when no rule says it does not."""
    if node.op != "call_function" or not any(x in tags for x in node.all_input_nodes):
        return None
    if not node.users and node.meta.get("val") is None:  # a check (tensor metadata asserts)
        return None
    r = rules.find_tokens(node.target)
    if r is None:
        raise Mixes("no token rule for this op")
    try:
        tag = r.fn(node, tags)
    except Mixes:
        raise
    except Exception as err:  # an op shape the rule does not know: refuse, never crash
        raise Mixes(f"no token rule for this call ({r.name}: {type(err).__name__})") from err
    if not isinstance(tag, Tokens):
        raise Mixes(f"token rule {r.name} gave {tag!r}, not a Tokens tag")
    return tag
