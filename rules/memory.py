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
from tpcompile.analysis.state import Aligned, Feat, Partial

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


@rule(aten.masked_scatter, aten.masked_scatter_)
def masked_scatter(an: Analysis, node: torch.fx.Node) -> object:
    """``dst.masked_scatter(mask, src)``: the positions ``mask`` picks take ``src``'s rows
    in order (a vision-language model's image features filling the text's placeholder
    tokens).  With one row width on both sides, feature ``i`` of a filled row is feature
    ``i`` of a ``src`` row, so the last dims tie and the rows stay whole; the mask must
    be the same along the split features (an expanded ``[B, S, 1]`` mask, checked where
    it meets them).  Features elsewhere, or rows refilled at another width (the fill
    runs over the flattened ``src``), would land at other features: refused."""
    dst, mask, src = node.args[:3]
    vals = [an.val(dst), an.val(src)]
    if any(isinstance(v, Partial) for v in vals):
        an.reduce_partials(node)  # a sum is needed whole before its rows are copied
        vals = [None if isinstance(v, Partial) else v for v in vals]
    if not any(isinstance(v, Feat) for v in vals):
        return None
    nd = an.ndim(dst)
    if an.shape(src)[-1:] != an.shape(dst)[-1:]:
        an.poison_node(node, "masked_scatter refills rows of another width", *vals)
        return None
    last = []
    for arg, v in ((dst, vals[0]), (src, vals[1])):
        if not isinstance(v, Feat):
            continue
        atoms = an.aligned_to(v.atoms, an.ndim(arg))
        if any(s > 1 for s in atoms.shape[:-1]):
            an.poison_node(node, "masked_scatter of features off the last dim", *vals)
            return None
        last.append(atoms.reshape((1,) * (nd - 1) + atoms.shape[-1:]))
    out = an.tie(last)
    for arg, v in ((dst, vals[0]), (src, vals[1]), (mask, None)):
        if isinstance(v, Feat) or not isinstance(arg, torch.fx.Node):
            continue
        shape = an.shape(arg)
        # src's rows are matched to dst's by the last dim alone
        aligned = (1,) * (nd - 1) + shape[-1:] if arg is src else (1,) * (nd - len(shape)) + shape
        an.aligned.append(Aligned(node, arg, out, aligned, arg in an.tainted))
    return an.feat(out)


MEMORY_RULES = [factory, copy, scatter, index_add, masked_scatter]
