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

from collections.abc import Callable, Container, Iterable, Sequence
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
    RawRead,
    ReducePoint,
    RowAddend,
    RowUse,
    StatUse,
    SubDim,
)
from .tokens import TokenRule

__all__ = ["Analysis", "Rule", "RuleSet", "place_atoms", "rule", "slice_indices"]

aten = torch.ops.aten
# ops that move elements between dims: uniformity survives only an all-uniform input
_MOVING = {
    aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.permute,
    aten.transpose, aten.t, aten.unsqueeze, aten.squeeze, aten.select, aten.movedim,
}
# elementwise ops (and same-dim views) that keep a value uniform along a dim
_ELEMENTWISE = {
    aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.where, aten.masked_fill, aten.eq,
    aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.logical_and, aten.logical_or,
    aten.logical_not, aten.bitwise_and, aten.bitwise_or, aten.bitwise_not, aten.minimum,
    aten.maximum, aten.clamp, aten.exp, aten.log, aten.pow, aten.to, aten._to_copy, aten.clone,
    aten.contiguous, aten.alias, aten.detach, aten.slice, aten.expand, aten.type_as,
    aten.add_, aten.mul_, aten.sub_, aten.div_, aten.masked_fill_, aten.copy, aten.lift_fresh_copy,
}

RuleFn = Callable[["Analysis", fx.Node], Any]


def _fits(atoms: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Whether feature atoms broadcast onto a value of ``shape`` (size 1 or equal per dim)."""
    if atoms.ndim > len(shape):
        return False
    return all(a in (1, s) for a, s in zip(atoms.shape, shape[len(shape) - atoms.ndim:], strict=True))


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
    """Op → rule lookup, one table per kind: feature rules (:class:`Rule`, this
    analysis) and token rules (:class:`~tpcompile.analysis.tokens.TokenRule`, sequence
    parallelism). Later registrations (user rules) override earlier ones of their kind."""

    by_op: dict[Any, Rule] = field(default_factory=dict)
    tokens: dict[Any, TokenRule] = field(default_factory=dict)

    def add(self, rules: Iterable[Rule | TokenRule]) -> RuleSet:
        for r in rules:
            table: dict[Any, Any] = self.tokens if isinstance(r, TokenRule) else self.by_op
            for op in r.ops:
                table[op] = r
        return self

    def find(self, target: Any) -> Rule | None:
        hit = self.by_op.get(target)
        if hit is None and hasattr(target, "overloadpacket"):
            hit = self.by_op.get(target.overloadpacket)
        return hit

    def find_tokens(self, target: Any) -> TokenRule | None:
        """The token rule for ``target``: its overload's, its packet's, else one for a
        ``torch.Tag`` it carries (``None``: the op mixes tokens)."""
        for key in (target, getattr(target, "overloadpacket", None), *getattr(target, "tags", ())):
            hit = self.tokens.get(key) if key is not None else None
            if hit is not None:
                return hit
        return None


def innermost_module(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    return list(stack.values())[-1][0]


def module_path(node: fx.Node) -> list[str]:
    stack = node.meta.get("nn_module_stack") or {}
    return [v[0] for v in stack.values()]


def params_feeding(nodes: Iterable[fx.Node], skip: Container[fx.Node], params: dict[str, str]) -> set[str]:
    """The parameters (``params``: placeholder name -> FQN) that reach ``nodes`` through
    values not in ``skip`` (``1 + weight.float()`` as much as ``weight``)."""
    out: set[str] = set()
    seen: set[fx.Node] = set()
    todo = [x for n in nodes for x in n.all_input_nodes if x not in skip]
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder" and x.name in params:
            out.add(params[x.name])
        todo.extend(y for y in x.all_input_nodes if y not in skip)
    return out


def slice_indices(bounds: Sequence[Any], size: int) -> list[int]:
    """Positions a ``slice(start, end, step)`` op's bound arguments select out of ``size``."""
    start = bounds[0] if len(bounds) > 0 and bounds[0] is not None else 0
    end = bounds[1] if len(bounds) > 1 and bounds[1] is not None else size
    step = bounds[2] if len(bounds) > 2 else 1
    return list(range(*slice(start, end, step).indices(size)))


def place_atoms_at(old: np.ndarray | None, src: np.ndarray | None, shape: Sequence[int],
                   index: list[np.ndarray], an: Analysis | None = None,
                   keep: tuple[int, ...] = ()) -> np.ndarray:
    """Atoms of a tensor ``old`` of ``shape`` after ``src`` is written at the positions
    ``index`` (one array of positions per dim; ``src`` aligned to all dims, size 1 where
    it broadcasts).  A ``src`` broadcast along a dim where ``old`` gives distinct features
    gets its own replica atoms per position (see :func:`place_atoms`), except along the
    dims ``keep``."""
    nd = len(shape)
    old = old if old is not None else np.full((1,) * nd, -1, dtype=np.int64)
    src = src if src is not None else np.full((1,) * nd, -1, dtype=np.int64)
    if an is not None and (src >= 0).any():
        for d in range(nd):
            if d not in keep and src.shape[d] == 1 and old.shape[d] > 1 and len(index[d]) > 1:
                src = np.concatenate(an.replicate(src, len(index[d])), axis=d)
    full = np.array(np.broadcast_to(old, tuple(shape)))
    full[np.ix_(*index)] = np.broadcast_to(src, [len(i) for i in index])
    return full


def place_atoms(old: np.ndarray | None, src: np.ndarray | None, nd: int, dim: int, size: int,
                idx: list[int], an: Analysis | None = None) -> np.ndarray:
    """Atoms of a tensor ``old`` (``None``: no features) after ``src`` is written at
    positions ``idx`` of ``dim`` (both already aligned to ``nd`` dims): the one-dim case
    of :func:`place_atoms_at` (a scatter's ``dim``), replicas minted off that dim only.

    Where ``src`` is broadcast along a dim whose positions ``old`` gives distinct
    features (one shared rotary key written into every head of a key buffer, as
    DeepSeek's MLA does), each position gets its own replica atoms (``an`` mints them):
    the copies may then live on different ranks, like repeated KV heads."""
    shapes = [a.shape if a is not None else (1,) * nd for a in (old, src)]
    shape = [max(a, b) for a, b in zip(*shapes, strict=True)]
    shape[dim] = size
    index = [np.arange(n) for n in shape]
    index[dim] = np.asarray(idx, dtype=np.int64)
    return place_atoms_at(old, src, shape, index, an, keep=(dim,))


_VIEW_OPS = {
    aten.slice, aten.select, aten.view, aten.reshape, aten.transpose, aten.permute, aten.t,
    aten.unsqueeze, aten.squeeze, aten.expand, aten.narrow, aten.diagonal, aten.unflatten,
    aten.alias, aten.as_strided,
}


def _writes_through_view(node: fx.Node) -> bool:
    """``node`` mutates its first argument in place, and that argument is a view."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.arguments or not node.args:
        return False
    info = schema.arguments[0].alias_info
    dst = node.args[0]
    return bool(info is not None and info.is_write and isinstance(dst, fx.Node)
                and getattr(dst.target, "overloadpacket", None) in _VIEW_OPS)


def _differentiable(meta: Any) -> bool:
    """Whether a value can carry a gradient: a floating tensor (or a tuple holding one);
    masks, indices and counts cannot."""
    if isinstance(meta, torch.Tensor):
        return meta.is_floating_point() or meta.is_complex()
    if isinstance(meta, tuple | list):
        return any(_differentiable(m) for m in meta)
    return False


def _holds_nothing(value: Any) -> bool:
    """A rule's result carries no features, partial sums or parameters."""
    if isinstance(value, list | tuple):
        return all(_holds_nothing(v) for v in value)
    return value is None


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
        whole_stats: set[fx.Node] | None = None,
    ) -> None:
        self.graph = graph
        self.rules = rules
        self.atoms = AtomTable()
        self.forced_replicated = forced_replicated or set()
        # statistics an earlier pass could not split: they tie their features again
        self.whole_stats = whole_stats or set()
        self.stat_uses: list[StatUse] = []
        self.value: dict[fx.Node, Any] = {}
        self.tainted: set[fx.Node] = set()
        # values that carry no gradient whatever their inputs (a fresh fill, ``zeros_like``)
        self.fresh: set[fx.Node] = set()
        self._edges_a: list[np.ndarray] = []
        self._edges_b: list[np.ndarray] = []
        self.columns: list[ColumnUse] = []
        self.rows: list[RowUse] = []
        self.embeddings: list[EmbeddingUse] = []
        self.aligned: list[Aligned] = []
        # buffers an op updates in place in training (BatchNorm's running statistics)
        self.updated_buffers: set[str] = set()
        self.poison: list[Poison] = []
        self.raw_reads: list[RawRead] = []
        self.reduce_points: list[ReducePoint] = []
        self.row_addends: list[RowAddend] = []
        self.outputs: list[np.ndarray] = []
        self.replicated_bases: list[np.ndarray] = []
        # per broadcast, its copies (copy x base position): each rank's local code makes
        # one count of copies of every base feature it holds (:func:`~.partition.partition`)
        self.replica_copies: list[np.ndarray] = []
        # values that are the same along some dims (a factory's fill, broadcast over): per
        # node, one flag per dim.  A sharded activation may meet such a value along a
        # uniform dim: once its size is rank-local, every rank's slice is the same.
        self.uniform: dict[fx.Node, tuple[bool, ...]] = {}
        self._params = param_of_placeholder
        self._buffers = buffer_of_placeholder

    # ---- running -----------------------------------------------------------------
    def run(self) -> Analysis:
        for node in self.graph.nodes:
            if node.op == "placeholder":
                self.value[node] = self._placeholder(node)
            elif node.op == "call_function":
                self.value[node] = self._call(node)
                if node not in self.fresh and _differentiable(self.meta(node)) and any(
                    isinstance(a, fx.Node) and a in self.tainted for a in node.all_input_nodes
                ):
                    self.tainted.add(node)
                elif self.value[node] is None and node not in self.uniform:
                    self._track_uniform(node)
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
            uses = self._use_count()
            value = r.fn(self, node)
            if _holds_nothing(value) and self._use_count() == uses and node not in self.fresh:
                self._read_raw(node)  # (a fresh fill reads its input's shape, not its entries)
            if isinstance(value, Feat) and not _fits(value.atoms, self.shape(node)):
                # a rule's bug (a user rule's too) must not place features at the wrong
                # positions: the region stays whole, or strict names the rule
                self.poison_node(node, f"rule {r.name} gave features shaped {tuple(value.atoms.shape)} to "
                                       f"a value shaped {self.shape(node)} (op {_op_name(node.target)} in "
                                       f"module {innermost_module(node) or '<root>'})",
                                 *(self.value.get(a) for a in node.all_input_nodes), unknown_op=True)
                return None
            if _writes_through_view(node):
                self.write_through(node, node.args[0], value)
            return value
        self._read_raw(node)
        vals = [self.value.get(a) for a in node.all_input_nodes]
        if any(isinstance(v, Feat | Partial) for v in vals):
            reason = (
                f"no rule for op {_op_name(node.target)} on sharded features "
                f"(in module {innermost_module(node) or '<root>'})"
            )
            self.poison_node(node, reason, *vals, unknown_op=True)
            self.reduce_partials(node)
        return None

    def _use_count(self) -> int:
        return len(self.columns) + len(self.rows) + len(self.embeddings) + len(self.aligned) + len(self.row_addends)

    def _read_raw(self, node: fx.Node) -> None:
        """``node`` computes a value taken as the same on every rank from parameters it
        got whole (no rule recorded a use of them that slices them): every dim they
        still carry is mixed (a weight times a mask, an FFT of a spectrum)."""
        if not isinstance(self.meta(node), torch.Tensor | list | tuple):
            return  # a size or a flag: no entries read
        for arg in dict.fromkeys(node.all_input_nodes):
            ref = self.value.get(arg)
            if isinstance(ref, ParamRef):
                self.read_raw(node, ref, list(range(len(ref.dims))))

    def read_raw(self, node: fx.Node, ref: ParamRef, dims: Sequence[int]) -> None:
        """``node`` mixes the entries of ``ref`` along its tensor dims ``dims``: the
        parameter dims behind them must not be split (:class:`RawRead`)."""
        real = {d.dim if isinstance(d, SubDim) else d for d in (ref.dims[i] for i in dims) if d is not None}
        if real:
            self.raw_reads.append(RawRead(node, ref.fqn, frozenset(real)))

    def _output(self, node: fx.Node) -> None:
        for arg in node.all_input_nodes:
            v = self.value.get(arg)
            if isinstance(v, Feat):
                self.outputs.append(v.atoms)
            elif isinstance(v, Partial):
                self.reduce_points.append(ReducePoint(node, v.rows))

    def _track_uniform(self, node: fx.Node) -> None:
        """A replicated value stays uniform along a dim if it comes from elementwise math
        whose tensor inputs are uniform along it or broadcast there (size 1); a view or
        permutation keeps only an everywhere-uniform value."""
        if not isinstance(self.meta(node), torch.Tensor):
            return
        inputs = [a for a in node.all_input_nodes if isinstance(self.meta(a), torch.Tensor)]
        if not inputs or not any(a in self.uniform for a in inputs):
            return
        nd = self.ndim(node)
        packet = getattr(node.target, "overloadpacket", node.target)
        if packet in _MOVING:
            if all(all(self.uniform.get(a, (False,))) for a in inputs):
                self.mark_uniform(node)
            return
        if packet not in _ELEMENTWISE:
            return
        flags = []
        for d in range(nd):
            ok = True
            for a in inputs:
                shape = (1,) * (nd - self.ndim(a)) + self.shape(a)
                u = self.uniform.get(a)
                if shape[d] > 1 and (u is None or not ((True,) * (nd - len(u)) + u)[d]):
                    ok = False
                    break
            flags.append(ok)
        if any(flags):
            self.uniform[node] = tuple(flags)

    def input_atoms(self, node: fx.Node) -> np.ndarray | None:
        """Atoms of ``node``'s first argument at its full rank, for an op that needs whole
        values: a partial sum is reduced first.  ``None``: nothing sharded comes in."""
        src = node.args[0]
        v = self.val(src)
        if isinstance(v, Partial):
            self.reduce_partials(node)
            return None
        return self.aligned_to(v.atoms, self.ndim(src)) if isinstance(v, Feat) else None

    def shares(self, node: fx.Node, operand: Any, atoms: np.ndarray) -> None:
        """``operand``, a replicated activation, is used by every rank alongside the
        sharded features ``atoms`` (broadcast into them, multiplied with them): each
        rank's backward sees only its features' share of its gradient."""
        if isinstance(operand, fx.Node) and operand in self.tainted and not isinstance(
                self.value.get(operand), Feat | ParamRef):
            nd = np.ndim(atoms)
            self.aligned.append(Aligned(node, operand, atoms, (1,) * nd, True))

    def mark_uniform(self, node: fx.Node) -> None:
        """``node`` is a freshly filled tensor: the same value everywhere."""
        self.uniform[node] = (True,) * self.ndim(node)

    def write_through(self, node: fx.Node, dst: Any, src_value: Any) -> None:
        """An in-place write of ``src_value`` into ``dst``, a chain of ``slice`` /
        ``select`` views of a base tensor (``attn[..., i, :i] = row``): later readers of
        the base see the written features at those positions."""
        chain: list[fx.Node] = []
        while isinstance(dst, fx.Node) and getattr(dst.target, "overloadpacket", None) in (aten.slice, aten.select):
            chain.append(dst)
            dst = dst.args[0]
        if not chain or not isinstance(dst, fx.Node):
            if isinstance(src_value, Feat | Partial):
                self.poison_node(node, "in-place write of sharded features through a view", src_value)
            return
        base = dst
        nd = self.ndim(base)
        cur = self.value.get(base)
        if isinstance(src_value, Partial):
            self.reduce_partials(node)  # the sum is needed before it is stored
            src_value = None
        if not isinstance(src_value, Feat) and isinstance(cur, Feat) and len(node.args) > 1:
            self.shares(node, node.args[1], self.aligned_to(cur.atoms, self.ndim(base)))
        if not isinstance(src_value, Feat) and not isinstance(cur, Feat):
            return  # nothing sharded before or after: the base stays replicated
        if isinstance(cur, Partial | ParamRef):
            self.poison_node(node, "in-place write into a sharded tensor through a view", src_value, cur)
            return
        # the base positions the view holds: one index list per base dim
        index = [np.arange(n) for n in self.shape(base)]
        view_dims = list(range(nd))
        sliced: list[int] = []  # written along a slice: no replicas there (as a scatter's dim)
        for view in reversed(chain):
            vnd = len(view_dims)
            dim = (view.args[1] if len(view.args) > 1 else 0) % vnd
            bd = view_dims[dim]
            if getattr(view.target, "overloadpacket", None) is aten.select:
                index[bd] = index[bd][[view.args[2] % len(index[bd])]]
                del view_dims[dim]
            else:
                index[bd] = index[bd][slice_indices(view.args[2:5], len(index[bd]))]
                sliced.append(bd)
        src = None
        if isinstance(src_value, Feat):
            aligned = self.aligned_to(src_value.atoms, len(view_dims))
            src = aligned.reshape([aligned.shape[view_dims.index(d)] if d in view_dims else 1 for d in range(nd)])
        old = self.aligned_to(cur.atoms, nd) if isinstance(cur, Feat) else None
        self.value[base] = self.feat(place_atoms_at(old, src, self.shape(base), index, self, keep=tuple(sliced)))
        self.uniform.pop(base, None)

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

    def tie(self, parts: Sequence[np.ndarray]) -> np.ndarray:
        """Tie the atoms of ``parts`` that meet position by position (elementwise math,
        broadcasting) and return the merged atoms: each position's first atom (``-1``:
        none there)."""
        out = parts[0]
        for other in parts[1:]:
            self.union(out, other)
            shape = np.broadcast_shapes(out.shape, other.shape)
            a, b = np.broadcast_to(out, shape), np.broadcast_to(other, shape)
            out = np.where(a >= 0, a, b)
        return out

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

    def replicate(self, atoms: np.ndarray, copies: int) -> list[np.ndarray]:
        """``copies`` broadcast copies of ``atoms`` (``repeat_kv``'s KV head per query
        head), each as fresh replica atoms of ``atoms``' shape, so different ranks may hold
        copies of one base feature; the broadcast is recorded for the partition."""
        self.replicated_bases.append(atoms.reshape(-1).copy())
        out = [self.atoms.replicas(atoms) for _ in range(copies)]
        self.replica_copies.append(np.stack([c.reshape(-1) for c in out]))
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

    def row_addend(self, node: fx.Node, partial: Partial, ref: ParamRef) -> bool:
        """Record that ``node`` adds the replicated parameter ``ref`` to ``partial``, if it
        runs inside the module of every row the sum comes from (the runtime then lets one
        rank add it: :mod:`.addends`).  ``False``: the sum must be reduced first."""
        path = module_path(node)
        if ref.is_buffer or any(self.rows[r].module not in path for r in partial.rows):
            return False
        self.row_addends.append(RowAddend(node, ref.fqn, partial.rows))
        return True

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
