"""Replicated values sliced where they enter a split module.

A value computed outside a module from no parameter and no gradient-carrying input
(MPT's ALiBi bias: ``slopes * arange`` over all heads, built once by the model and
passed to every attention as ``position_bias``) meets the module's split features
inside it: ``scores + position_bias[:, -q:, -k:]``, the scores holding this rank's heads
and the bias all of them.  Kept as it was, the whole region had to stay replicated (the
bias would need slicing).  It needs no more than that slice, taken where it enters the
module: every rank narrows the argument to the rows of its own features
(``index_select`` along the head dim) before the module's forward runs, so the code
inside sees a bias of the local head count.  The value carries no gradient, so the slice
adds no collective, forward or backward.

The analysis proves the slice is exact before planning it (:func:`entry_slice`):

* the value reaches the meeting op through views that keep its dims (``slice`` along
  other dims, casts, ``alias``), all inside the module, and nothing else inside the
  module reads it (each step has one user), so narrowing it at the entry changes only
  that meeting;
* the features along the sliced dim are distinct (one head per row, at the capture's
  batch of one);
* every rank gets the same number of rows;
* where the rows repeat per batch entry (BLOOM's ALiBi: ``batch * heads`` rows, the
  heads' block ``repeat``-ed per sequence), each rank keeps its heads' rows of every
  entry (``b * H + h``): the capture sees one batch entry, and a second fake forward on
  a larger batch shows the rows grow by exactly the batch factor.

Which forward argument carries the value is not in the graph (torch.export inlines the
call): the planner finds it from one fake forward of the model, the unique tensor
argument of the module's call with the value's shape and dtype
(:func:`tpcompile.capture.fake.call_inputs`), and checks with a second one on a larger
batch and sequence that the sliced dim's size stays put, or (rows per batch entry) grows
by the batch factor; where none or several match, the region stays whole as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from ..errors import TPError
from .propagate import Analysis, innermost_module, module_path

__all__ = ["EntryPaths", "EntrySlice", "entry_slice", "narrow_args", "with_padding"]

aten = torch.ops.aten
# views and casts that keep every dim of their input (a slice along another dim is
# checked separately): the sliced dim reads the same rows before and after them
_KEEP_DIMS = {aten.alias.default, aten.clone.default, aten._to_copy.default, aten.to.dtype,
              aten.to.dtype_layout, aten.detach.default, aten.contiguous.default}

# (module fqn, the value entering it, the dim to slice, whether its rows repeat per batch
# entry) -> the argument path of its call carrying it, or None when no single argument
# matches or that dim's size changes with the batch or sequence otherwise than expected
EntryPaths = Callable[[str, fx.Node, int, bool], "list | None"]


@dataclass(frozen=True)
class EntrySlice:
    """One argument of a module's call narrowed to this rank's rows along ``dim``."""

    module: str  # the (representative) module whose call receives the value
    path: tuple  # the forward argument carrying it: ("kwargs", "position_bias")
    dim: int  # the argument's dim to slice (non-negative)
    size: int  # its global size along ``dim``
    index: tuple[tuple[int, ...], ...]  # per TP rank, the rows it keeps
    # rows repeat per batch entry with this period (``b * size + i``), 0: a fixed size
    period: int = 0

    def as_tuple(self) -> tuple:
        """``(path, dim, size, index, period)``: the plan's form (``SliceInputs.slices``)."""
        return (self.path, self.dim, self.size, self.index, self.period)


def narrow_args(args: tuple, kwargs: dict, slices: Iterable[tuple], rank: int,
                where: str = "") -> tuple[tuple, dict]:
    """``(args, kwargs)`` of one module call with each ``(path, dim, size, index,
    period)`` of ``slices`` narrowed to ``rank``'s rows (with a ``period``, the rows of
    every batch entry: ``b * size + i``); an argument missing or of another size than
    planned is a :class:`TPError`."""
    new_args, new_kwargs = list(args), dict(kwargs)
    for path, dim, size, index, period in slices:
        box: Any = new_args if path[0] == "args" else new_kwargs
        key = path[1]
        held = key in box if isinstance(box, dict) else key < len(box)
        value = box[key] if held else None
        n = value.shape[dim] if isinstance(value, torch.Tensor) and value.dim() > dim else -1
        if n != size and not (period and n > 0 and n % period == 0):
            got = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            rows = f"{size} (per batch entry)" if period else str(size)
            raise TPError(f"{where or 'a module'}: the plan slices its argument {'.'.join(map(str, path))} "
                          f"to this rank's rows of {rows} along dim {dim}, but the call passes {got}. "
                          "The model is called differently than when it was captured; keep the module "
                          "replicated with overrides={'<param fqn>': 'replicated'}")
        keep = [b * size + i for b in range(n // size) for i in index[rank]]  # one block unless periodic
        box[key] = value.index_select(dim, torch.tensor(keep, device=value.device))
    return tuple(new_args), new_kwargs


def with_padding(index: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...] | None:
    """Each rank's rows, the same number on every rank, or ``None``.  Heads dealt
    unevenly (:func:`~tpcompile.analysis.partition.partition`'s padding units) leave the
    last ranks one head short, its padding head placed after their last one: there the
    slice repeats the rank's last row (any finite row: a padding head's output meets only
    zero weights and its gradient is zeroed).  Only where every rank holds one run of
    consecutive rows and the short ranks are the last ones."""
    sizes = [len(i) for i in index]
    if len(set(sizes)) == 1:
        return index
    if 0 in sizes or sizes != sorted(sizes, reverse=True):
        return None
    if any(list(i) != list(range(i[0], i[0] + len(i))) for i in index):
        return None
    width = sizes[0]
    return tuple(tuple(i) + (i[-1],) * (width - len(i)) for i in index)


def entry_slice(an: Analysis, operand: fx.Node, operand_dim: int, ranks_line: np.ndarray,
                atoms_line: np.ndarray, consumer: fx.Node, tp: int,
                paths: EntryPaths | None) -> EntrySlice | None:
    """The slice at a module's entry that makes ``operand`` (a replicated activation
    carrying no gradient, met by split features along its ``operand_dim``) rank-local, or
    ``None`` when none is exact.  ``ranks_line`` / ``atoms_line``: the rank and the
    feature of each row along that dim."""
    if paths is None or operand in an.tainted:
        return None
    module = innermost_module(consumer)
    if not module:
        return None
    source = _entering(an, operand, operand_dim, module)
    if source is None:
        return None
    if len(set(atoms_line.tolist())) != atoms_line.size or (ranks_line < 0).any():
        return None  # a feature repeated along the dim, or a row no single rank holds
    index = tuple(tuple(int(i) for i in np.nonzero(ranks_line == r)[0]) for r in range(tp))
    index = with_padding(index)
    if index is None:
        return None
    size = int(ranks_line.size)
    period = size if _batch_major(an, source, operand_dim) else 0
    path = paths(module, source, operand_dim, bool(period))
    if path is None or len(path) != 2:  # an argument itself, not a tensor nested in one
        return None
    return EntrySlice(module=module, path=tuple(path), dim=operand_dim, size=size, index=index, period=period)


def _batch_major(an: Analysis, node: fx.Node, dim: int) -> bool:
    """Is ``node``'s ``dim`` (dim 0) one batch entry's rows, to be repeated per entry?
    BLOOM's ALiBi is ``slopes * positions`` over the heads, then ``repeat(batch, 1, 1)``
    (or ``reshape([B, H, S] -> [B * H, 1, S])`` when the batch is padded): at the
    capture's batch of one a ``repeat`` by 1 or a reshape folding a leading size-1 dim,
    at batch ``B`` the rows ``b * H + h``.  (The planner checks that a larger batch
    indeed multiplies the rows.)"""
    while node.op == "call_function" and node.target in _KEEP_DIMS:
        node = node.args[0]
    if node.op != "call_function" or dim != 0:
        return False
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return False
    if node.target == aten.repeat.default:
        reps = node.args[1]
        return len(reps) == an.ndim(node) and reps[0] == 1
    if node.target in (aten.reshape.default, aten.view.default, aten._unsafe_view.default):
        shape, out = an.shape(src), an.shape(node)
        return len(shape) >= 2 and shape[0] == 1 and shape[1] == out[0]
    return False


def _entering(an: Analysis, node: fx.Node, dim: int, module: str) -> fx.Node | None:
    """The value produced outside ``module`` that ``node`` is, seen through views that
    keep ``dim``; ``None`` if anything else lies between, or something else in the module
    reads it."""
    while module in module_path(node):
        if node.op != "call_function" or len(node.users) != 1 or not node.args:
            return None
        target = node.target
        if target == aten.slice.Tensor:
            if (node.args[1] if len(node.args) > 1 else 0) % an.ndim(node) == dim:
                return None
        elif target not in _KEEP_DIMS:
            return None
        src = node.args[0]
        if not isinstance(src, fx.Node) or an.ndim(src) != an.ndim(node):
            return None
        node = src
    inside = [u for u in node.users if module in module_path(u)]
    if node.op != "call_function" or len(inside) != 1:
        return None
    return node
