"""Propagation: run the rule set over the captured graph, attaching abstract values.

Each graph node's abstract value (see :mod:`tpcompile.analysis.state`) is computed from
its inputs' by the rule registered for its op.  Rules record *edges* between atoms (the
features that must live on one rank) and *events* (column / row / embedding uses,
replicated values meeting sharded ones, ops no rule knows).  The partition step turns
those into roles.

An op with no rule is harmless while its inputs carry no sharded features; if one does,
the features it touches are *poisoned*: the parallel region they belong to is kept
replicated (or, under ``strict``, the user is told which module and op to write a rule
for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from .atoms import AtomTable
from .state import (
    Aligned,
    ColumnUse,
    EmbeddingUse,
    Feat,
    ParamRef,
    Partial,
    Poison,
    ReducePoint,
    RowUse,
)

__all__ = ["Analysis", "Rule", "RuleSet", "rule"]

RuleFn = Callable[["Analysis", fx.Node], Any]


@dataclass(frozen=True)
class Rule:
    """A propagation rule: the ops it handles and the function computing their value."""

    ops: tuple[Any, ...]
    fn: RuleFn
    name: str


def rule(*ops: Any) -> Callable[[RuleFn], Rule]:
    """Declare a rule for ``ops`` (ATen overload packets, overloads or Python callables).

    Example:
        >>> @rule(torch.ops.aten.gelu)                          # doctest: +SKIP
        ... def gelu(an, node):
        ...     return an.pointwise(node)
    """

    def wrap(fn: RuleFn) -> Rule:
        return Rule(ops=tuple(ops), fn=fn, name=fn.__name__)

    return wrap


@dataclass
class RuleSet:
    """Op → rule lookup. Later registrations (user rules) override earlier ones."""

    by_op: dict[Any, Rule] = field(default_factory=dict)

    def add(self, rules: Iterable[Rule]) -> RuleSet:
        for r in rules:
            for op in r.ops:
                self.by_op[op] = r
        return self

    def find(self, target: Any) -> Rule | None:
        hit = self.by_op.get(target)
        if hit is None and hasattr(target, "overloadpacket"):
            hit = self.by_op.get(target.overloadpacket)
        return hit


def innermost_module(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def module_path(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [v[0] for v in stack.values()]


def _op_name(target: Any) -> str:
    return str(getattr(target, "__name__", target))


class Analysis:
    """State of one propagation pass over a captured graph."""

    def __init__(
        self,
        graph: fx.Graph,
        rules: RuleSet,
        *,
        param_of_placeholder: dict[str, str],
        buffer_of_placeholder: dict[str, str],
        forced_replicated: set | None = None,
    ) -> None:
        self.graph = graph
        self.rules = rules
        self.atoms = AtomTable()
        self.forced_replicated = forced_replicated or set()
        self.value: dict[fx.Node, Any] = {}
        self.tainted: set[fx.Node] = set()
        self._edges_a: list[np.ndarray] = []
        self._edges_b: list[np.ndarray] = []
        self.columns: list[ColumnUse] = []
        self.rows: list[RowUse] = []
        self.embeddings: list[EmbeddingUse] = []
        self.aligned: list[Aligned] = []
        self.poison: list[Poison] = []
        self.reduce_points: list[ReducePoint] = []
        self.outputs: list[np.ndarray] = []
        self.replicated_bases: list[np.ndarray] = []
        self._params = param_of_placeholder
        self._buffers = buffer_of_placeholder

    # ---- running -----------------------------------------------------------------
    def run(self) -> Analysis:
        for node in self.graph.nodes:
            if node.op == "placeholder":
                self.value[node] = self._placeholder(node)
            elif node.op == "call_function":
                self.value[node] = self._call(node)
                if any(isinstance(a, fx.Node) and a in self.tainted for a in node.all_input_nodes):
                    self.tainted.add(node)
            elif node.op == "output":
                self._output(node)
        return self

    def _placeholder(self, node: fx.Node) -> Any:
        ndim = self.ndim(node)
        if node.name in self._params:
            self.tainted.add(node)
            return ParamRef(self._params[node.name], tuple(range(ndim)))
        if node.name in self._buffers:
            return ParamRef(self._buffers[node.name], tuple(range(ndim)), is_buffer=True)
        return None

    def _call(self, node: fx.Node) -> Any:
        r = self.rules.find(node.target)
        if r is not None:
            return r.fn(self, node)
        vals = [self.value.get(a) for a in node.all_input_nodes]
        if any(isinstance(v, Feat | Partial) for v in vals):
            reason = (
                f"no rule for op {_op_name(node.target)} on sharded features "
                f"(in module {innermost_module(node) or '<root>'})"
            )
            self.poison_node(node, reason, *vals, unknown_op=True)
            self.reduce_partials(node)
        return None

    def _output(self, node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            v = self.value.get(arg)
            if isinstance(v, Feat):
                self.outputs.append(v.atoms)
            elif isinstance(v, Partial):
                self.reduce_points.append(ReducePoint(node, v.rows))

    # ---- helpers for rules ---------------------------------------------------------
    def val(self, arg: Any) -> Any:
        """Abstract value of an argument (``None`` for literals)."""
        return self.value.get(arg) if isinstance(arg, fx.Node) else None

    @staticmethod
    def meta(arg: Any) -> Any:
        return arg.meta.get("val") if isinstance(arg, fx.Node) else None

    def shape(self, arg: Any) -> tuple[int, ...]:
        v = self.meta(arg)
        return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else ()

    def ndim(self, arg: Any) -> int:
        return len(self.shape(arg))

    def union(self, a: np.ndarray, b: np.ndarray) -> None:
        """Tie atoms of ``a`` and ``b`` position by position (broadcasting; ``-1`` skipped)."""
        a, b = np.broadcast_arrays(np.asarray(a), np.asarray(b))
        a = a.reshape(-1)
        b = b.reshape(-1)
        keep = (a >= 0) & (b >= 0) & (a != b)
        if keep.any():
            self._edges_a.append(a[keep])
            self._edges_b.append(b[keep])

    def union_along(self, atoms: np.ndarray, dims: Sequence[int]) -> np.ndarray:
        """Tie all atoms along ``dims`` (a contraction or reduction); returns the result
        with those dims kept at size 1."""
        out = atoms
        for d in dims:
            if out.shape[d] > 1:
                first = np.take(out, [0], axis=d)
                self.union(out, first)
                out = first
        return out

    def edges(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._edges_a:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(self._edges_a), np.concatenate(self._edges_b)

    def aligned_to(self, atoms: np.ndarray, ndim: int) -> np.ndarray:
        """``atoms`` with leading size-1 dims added to reach ``ndim``."""
        return atoms.reshape((1,) * (ndim - atoms.ndim) + atoms.shape)

    def poison_node(self, node: fx.Node, reason: str, *vals: Any, unknown_op: bool = False) -> None:
        """Record that ``node`` cannot keep the features of ``vals`` sharded."""
        atoms = [v.atoms.reshape(-1) for v in vals if isinstance(v, Feat)]
        flat = np.concatenate(atoms) if atoms else np.zeros(0, np.int64)
        self.poison.append(Poison(node, reason, flat, unknown_op=unknown_op))

    def reduce_partials(self, node: fx.Node) -> None:
        """Record that ``node`` needs its partial-sum inputs all-reduced first."""
        rows: list[int] = []
        for a in node.all_input_nodes:
            v = self.value.get(a)
            if isinstance(v, Partial):
                rows.extend(v.rows)
        if rows:
            self.reduce_points.append(ReducePoint(node, tuple(rows)))

    def normalize(self, atoms: np.ndarray) -> np.ndarray:
        """Collapse dims along which every atom is the same (no distinct features)."""
        for d in range(atoms.ndim):
            if atoms.shape[d] > 1:
                first = np.take(atoms, [0], axis=d)
                if np.array_equal(np.broadcast_to(first, atoms.shape), atoms):
                    atoms = first
        return atoms

    def feat(self, atoms: np.ndarray) -> Feat | None:
        atoms = self.normalize(np.asarray(atoms, dtype=np.int64))
        if atoms.size == 0 or (atoms < 0).all():
            return None
        return Feat(atoms)
