"""Fresh tensors and in-place writes.

A factory (``zeros``, ``new_empty``, ``full_like`` ...) makes a tensor that carries no
features and holds one value everywhere: it may meet sharded features along any dim
once its size is rank-local (Mamba's scan state, T5's zero position bias, DeepSeek's
key buffer).  Model code then often fills part of such a buffer in place —
``key[..., :d].copy_(k_nope)`` — so a write through a ``slice`` of a base hands the
written features to every later reader of the base (see
:meth:`~tpcompile.analysis.propagate.Analysis.write_through`).
"""

from __future__ import annotations

import numpy as np
import torch

from tpcompile.analysis.propagate import Analysis, place_atoms, rule, slice_indices
from tpcompile.analysis.state import Feat, Partial

__all__ = ["MEMORY_RULES"]

aten = torch.ops.aten


_LIKE = (aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like, aten.fill, aten.zero)


@rule(
    aten.zeros, aten.ones, aten.empty, aten.full, aten.new_zeros, aten.new_ones, aten.new_empty,
    aten.new_full, aten.zeros_like, aten.ones_like, aten.full_like, aten.empty_like, aten.fill,
    aten.fill_, aten.scalar_tensor, aten.empty_strided, aten.new_empty_strided, aten.zero_,
    aten.zero,
)
def factory(an: Analysis, node: torch.fx.Node) -> object:
    """A fresh tensor: no features, one value everywhere (its sizes may be global), and
    no gradient even when made ``like`` a value that has one."""
    an.fresh.add(node)
    if getattr(node.target, "overloadpacket", None) in _LIKE:
        v = an.val(node.args[0])
        if isinstance(v, Feat):  # shaped like its input, local where the input is
            return an.feat(v.atoms)
    if isinstance(an.meta(node), torch.Tensor):
        an.mark_uniform(node)
    return None


@rule(aten.copy_, aten.copy)
def copy(an: Analysis, node: torch.fx.Node) -> object:
    """``dst.copy_(src)``: the result holds ``src`` broadcast to ``dst``'s shape."""
    src = node.args[1]
    v = an.val(src)
    if isinstance(v, Partial):
        an.reduce_partials(node)
        return None
    if isinstance(v, Feat):
        return an.feat(an.aligned_to(v.atoms, an.ndim(node)))
    if src in an.uniform:
        an.mark_uniform(node)
    return None


@rule(aten.slice_scatter, aten.select_scatter)
def scatter(an: Analysis, node: torch.fx.Node) -> object:
    """``base`` with ``src`` written at a slice (the functional form of ``base[s] = src``)."""
    base, src = node.args[:2]
    bv, sv = an.val(base), an.val(src)
    if isinstance(bv, Partial) or isinstance(sv, Partial):
        an.reduce_partials(node)
        return None
    if not isinstance(bv, Feat) and not isinstance(sv, Feat):
        return None
    nd = an.ndim(node)
    dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
    size = an.shape(node)[dim]
    src_atoms = None
    if getattr(node.target, "overloadpacket", None) is aten.select_scatter:
        idx = [node.args[3] % size]
        if isinstance(sv, Feat):
            src_atoms = np.expand_dims(an.aligned_to(sv.atoms, nd - 1), dim)
    else:
        idx = slice_indices(node.args[3:6], size)
        if isinstance(sv, Feat):
            src_atoms = an.aligned_to(sv.atoms, nd)
    old = an.aligned_to(bv.atoms, nd) if isinstance(bv, Feat) else None
    if src_atoms is None and old is not None:
        an.shares(node, src, old)
    return an.feat(place_atoms(old, src_atoms, nd, dim, size, idx, an))


_ZERO_FILLS = (aten.zeros, aten.zeros_like, aten.new_zeros, aten.zero, aten.zero_)
_VALUE_FILLS = (aten.full, aten.full_like, aten.new_full, aten.fill, aten.fill_)


def _zeros(node: object) -> bool:
    """Is ``node`` a fresh tensor of zeros (``torch.zeros_like(h)``, ``h.new_zeros(...)``)?"""
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return False
    packet = getattr(node.target, "overloadpacket", None)
    if packet in _ZERO_FILLS:
        return True
    if packet in _VALUE_FILLS:  # full(size, 0) / fill(t, 0): the value follows the size or tensor
        value = node.args[-1] if len(node.args) >= 2 else node.kwargs.get("fill_value", node.kwargs.get("value"))
        return isinstance(value, int | float) and value == 0
    return False


@rule(aten.index_add, aten.index_add_)
def index_add(an: Analysis, node: torch.fx.Node) -> object:
    """``base`` with ``source``'s rows added at ``index`` along ``dim`` (an expert loop's
    ``out.index_add_(0, token_idx, expert_out)``).  Linear in both: partial sums added
    into zeros or into partial sums stay partial sums; features along the other dims
    are carried as by elementwise addition."""
    base, source = node.args[0], node.args[3]
    bv, sv = an.val(base), an.val(source)
    if isinstance(bv, Partial) or isinstance(sv, Partial):
        parts = [v for v in (bv, sv) if isinstance(v, Partial)]
        others_zero = all(isinstance(v, Partial) or _zeros(n) for n, v in ((base, bv), (source, sv)))
        if others_zero and not any(isinstance(v, Feat) for v in (bv, sv)):
            return Partial(tuple(r for p in parts for r in p.rows))
        an.reduce_partials(node)
        return None
    if not isinstance(bv, Feat) and not isinstance(sv, Feat):
        return None
    nd = an.ndim(node)
    dim = node.args[1] % nd
    aligned = [an.aligned_to(v.atoms, nd) for v in (bv, sv) if isinstance(v, Feat)]
    if any(atoms.shape[dim] > 1 for atoms in aligned):
        an.poison_node(node, "index_add along sharded features", bv, sv)
        return None
    out = an.tie(aligned)
    if any(not isinstance(v, Feat) and not _zeros(n) for n, v in ((base, bv), (source, sv))):
        an.poison_node(node, "index_add of split features and a whole tensor", bv, sv)
        return None
    return an.feat(out)


MEMORY_RULES = [factory, copy, scatter, index_add]
