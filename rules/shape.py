"""Shape rules: views, permutations, slicing, splitting and joining.

A view that splits a feature dim into (heads, head_dim) moves the atoms with it; a
merge back does the reverse.  Merging a *broadcast copy* dim (stride 0, as ``repeat_kv``'s
``expand`` makes) into a feature dim mints replica atoms: each query head gets its own copy
of the KV head it shares, which is what lets tp exceed the number of KV heads.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import numpy as np
import torch

from tpcompile.analysis.propagate import Analysis, rule, slice_indices
from tpcompile.analysis.state import Aligned, Feat, ParamRef, Partial, SubDim

__all__ = ["SHAPE_RULES"]

aten = torch.ops.aten


def _atoms(an: Analysis, arg: object) -> np.ndarray | None:
    v = an.val(arg)
    if isinstance(v, Feat):
        return an.aligned_to(v.atoms, an.ndim(arg))
    return None


def _relayout(
    v: object,
    atoms: Callable[[np.ndarray], np.ndarray],
    dims: Callable[[tuple[int | None, ...]], tuple[int | None, ...]],
) -> object:
    """Apply one dim re-arrangement to whichever abstract value ``v`` is."""
    if isinstance(v, Feat):
        return Feat(atoms(v.atoms))
    if isinstance(v, ParamRef):
        return ParamRef(v.fqn, dims(v.dims), v.is_buffer)
    return v if isinstance(v, Partial) else None


@rule(
    aten.clone, aten.contiguous, aten.alias, aten.detach, aten.to, aten._to_copy,
    aten.dropout, aten.lift_fresh_copy, aten.type_as, aten._assert_tensor_metadata,
    aten.feature_dropout, aten.alpha_dropout, aten.copy,
    aten.dropout_, aten.feature_dropout_, aten.alpha_dropout_,  # in place (MobileNet's classifier)
)
def identity(an: Analysis, node: torch.fx.Node) -> object:
    """Value-preserving ops: the abstract value passes through unchanged."""
    if node.target is aten._assert_tensor_metadata.default:
        return None
    return an.val(node.args[0])


@rule(aten.sym_size, aten.sym_numel)
def size_read(an: Analysis, node: torch.fx.Node) -> object:
    """A size read as a value (the count of positions a boolean mask selected, which only
    the data sizes): the same on every rank where the dim carries no features; a size
    over split features would differ, and refuses the region."""
    v = an.val(node.args[0])
    if isinstance(v, Feat):
        atoms = an.aligned_to(v.atoms, an.ndim(node.args[0]))
        dims = [node.args[1] % atoms.ndim] if len(node.args) > 1 else range(atoms.ndim)
        if any(atoms.shape[d] > 1 for d in dims):
            an.poison_node(node, "a size of sharded features read as a value", v)
    return None


@rule(aten.native_dropout)
def native_dropout(an: Analysis, node: torch.fx.Node) -> object:
    return [an.val(node.args[0]), None]


@rule(aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten, aten.view_as, aten.reshape_as)
def view(an: Analysis, node: torch.fx.Node) -> object:
    src = node.args[0]
    v = an.val(src)
    out_shape = an.shape(node)
    if isinstance(v, Partial):
        return v
    if isinstance(v, ParamRef):
        return _param_view(v, an.shape(src), out_shape)
    if not isinstance(v, Feat):
        return None
    in_val = an.meta(src)
    in_shape = an.shape(src)
    atoms = an.aligned_to(v.atoms, len(in_shape))
    strides = in_val.stride()
    for d, (stride, size) in enumerate(zip(strides, in_shape, strict=False)):
        if atoms.shape[d] == 1 and size > 1 and stride == 0 and atoms.size > 1:
            # broadcast copies of features merged into a feature dim: each copy becomes
            # a replica atom so different ranks may hold the same base feature
            atoms = np.concatenate(an.replicate(atoms, size), axis=d)
    full = np.broadcast_to(atoms, in_shape).reshape(out_shape)
    return an.feat(full)


def _param_view(v: ParamRef, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> ParamRef | None:
    """A parameter viewed with size-1 dims added or dropped (a per-head vector reshaped
    to ``(1, H, 1, 1)``) is still that parameter; so is one whose dim the view splits
    into factors (stacked experts kept 2-D, ``[E * F, H]`` viewed ``(E, F, H)``): each
    factor becomes a :class:`SubDim` of it.  Any other view loses track of it."""
    real_in = [(d, s) for d, s in zip(v.dims, in_shape, strict=True) if s != 1]
    real_out = [s for s in out_shape if s != 1]
    dims = _split_dims(real_in, real_out)
    if dims is None:
        return None
    real = iter(dims)
    return ParamRef(v.fqn, tuple(next(real) if s != 1 else None for s in out_shape), v.is_buffer)


def _split_dims(real_in: list[tuple], real_out: list[int]) -> list | None:
    """The parameter dim of each non-1 output size: the same dims where the sizes match,
    and one input dim split into the factors of consecutive output sizes."""
    if [s for _, s in real_in] == real_out:
        return [d for d, _ in real_in]
    for i, (d, size) in enumerate(real_in):
        if d is not None and not isinstance(d, int):
            continue
        for k in range(2, len(real_out) - i + 1):
            factors = tuple(real_out[i:i + k])
            if math.prod(factors) != size:
                continue
            rest_in = [s for _, s in real_in[i + 1:]]
            if [s for _, s in real_in[:i]] == real_out[:i] and rest_in == real_out[i + k:]:
                # a dim that is no parameter dim (rows a table lookup gathered: Swin's
                # relative position bias ``table[index].view(W, W, heads)``) splits into
                # factors that are none either
                split = [None] * k if d is None else [SubDim(d, factors, j) for j in range(k)]
                return [e for e, _ in real_in[:i]] + split + [e for e, _ in real_in[i + 1:]]
    return None


@rule(aten.expand, aten.expand_as, aten.broadcast_to)
def expand(an: Analysis, node: torch.fx.Node) -> object:
    nd = an.ndim(node)
    return _relayout(
        an.val(node.args[0]),
        lambda a: an.aligned_to(a, nd),
        lambda dims: (None,) * (nd - len(dims)) + dims,
    )


@rule(aten.repeat_interleave)
def repeat_interleave(an: Analysis, node: torch.fx.Node) -> object:
    """Each position repeated ``r`` times in place (Mamba-2's ``B.repeat_interleave(heads //
    groups)``): every copy is a replica atom, so copies may live on different ranks."""
    src = node.args[0]
    v = an.val(src)
    if isinstance(v, Partial) or not isinstance(v, Feat):
        return v if isinstance(v, Partial) else None
    repeats = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if not isinstance(repeats, int) or dim is None:
        an.poison_node(node, "repeat_interleave of sharded features by a tensor of counts", v)
        return None
    atoms = an.aligned_to(v.atoms, an.ndim(src))
    dim %= atoms.ndim
    if atoms.shape[dim] == 1 and (an.shape(src)[dim] != 1 or atoms.size == 1):
        return Feat(atoms)  # positions without features repeated: nothing to copy
    copies = np.stack(an.replicate(atoms, repeats), axis=dim + 1)
    shape = list(atoms.shape)
    shape[dim] *= repeats
    return an.feat(copies.reshape(shape))


@rule(aten.repeat)
def repeat(an: Analysis, node: torch.fx.Node) -> object:
    """Tiling (``x.repeat(1, heads, 1, 1)``): each tile of a feature dim is a replica."""
    src, repeats = node.args[0], list(node.args[1])
    v = an.val(src)
    if isinstance(v, Partial) or not isinstance(v, Feat):
        return v if isinstance(v, Partial) else None
    nd = len(repeats)
    atoms = an.aligned_to(v.atoms, nd)
    for d, r in enumerate(repeats):
        if r > 1 and atoms.shape[d] > 1:
            atoms = np.concatenate(an.replicate(atoms, r), axis=d)
    return an.feat(atoms)


@rule(aten.pad, aten.constant_pad_nd)
def pad(an: Analysis, node: torch.fx.Node) -> object:
    """Padding adds positions that carry no feature (Mamba-2's chunked scan pads the
    sequence); only a constant pad is that — reflecting a feature dim is refused."""
    src, widths = node.args[0], list(node.args[1])
    v = an.val(src)
    if getattr(node.target, "overloadpacket", None) is aten.constant_pad_nd:  # (x, pad, value)
        constant, value = True, node.args[2] if len(node.args) > 2 else 0
    else:  # aten.pad: (x, pad, mode, value)
        mode = node.args[2] if len(node.args) > 2 else node.kwargs.get("mode", "constant")
        value = node.args[3] if len(node.args) > 3 else node.kwargs.get("value")
        constant = mode == "constant"
    if isinstance(v, Partial):
        if constant and not value:
            return v  # zero padding is linear: still a partial sum
        an.reduce_partials(node)
        return None
    if not isinstance(v, Feat):
        return None
    atoms = an.aligned_to(v.atoms, an.ndim(src))
    for i in range(len(widths) // 2):
        d = atoms.ndim - 1 - i
        left, right = widths[2 * i], widths[2 * i + 1]
        if (left or right) and atoms.shape[d] > 1:
            if not constant or left < 0 or right < 0:
                an.poison_node(node, "non-constant padding of a sharded feature dim", v)
                return None
            shape = list(atoms.shape)
            pieces = []
            for width in (left, right):
                shape[d] = width
                pieces.append(np.full(shape, -1, dtype=np.int64))
            atoms = np.concatenate([pieces[0], atoms, pieces[1]], axis=d)
    return an.feat(atoms)


@rule(aten.permute, aten.transpose, aten.t, aten.swapaxes, aten.movedim, aten.numpy_T)
def permute(an: Analysis, node: torch.fx.Node) -> object:
    src = node.args[0]
    nd = an.ndim(src)
    order = list(range(nd))
    target = node.target
    packet = getattr(target, "overloadpacket", target)
    if packet is aten.permute:
        order = [d % nd for d in node.args[1]]
    elif packet in (aten.transpose, aten.swapaxes):
        a, b = (d % nd for d in node.args[1:3])
        order[a], order[b] = order[b], order[a]
    elif packet is aten.movedim:
        src_d, dst_d = node.args[1] % nd, node.args[2] % nd
        order.insert(dst_d, order.pop(src_d))
    else:  # t / numpy_T reverse
        order = order[::-1]
    return _relayout(
        an.val(src),
        lambda a: np.transpose(an.aligned_to(a, nd), order),
        lambda dims: tuple(dims[d] for d in order),
    )


@rule(aten.unsqueeze)
def unsqueeze(an: Analysis, node: torch.fx.Node) -> object:
    src = node.args[0]
    nd = an.ndim(src)
    d = node.args[1] % (nd + 1)
    return _relayout(
        an.val(src),
        lambda a: np.expand_dims(an.aligned_to(a, nd), d),
        lambda dims: (*dims[:d], None, *dims[d:]),
    )


@rule(aten.squeeze)
def squeeze(an: Analysis, node: torch.fx.Node) -> object:
    src = node.args[0]
    in_shape = an.shape(src)
    out_nd = an.ndim(node)
    if len(node.args) > 1:
        dims = node.args[1] if isinstance(node.args[1], list | tuple) else [node.args[1]]
        drop = {d % len(in_shape) for d in dims if in_shape[d % len(in_shape)] == 1}
    else:
        drop = {d for d, s in enumerate(in_shape) if s == 1}
    keep = [d for d in range(len(in_shape)) if d not in drop]
    assert len(keep) == out_nd

    def drop_atoms(a: np.ndarray) -> np.ndarray:
        full = an.aligned_to(a, len(in_shape))
        return full.reshape([full.shape[d] for d in keep])

    return _relayout(an.val(src), drop_atoms, lambda dims: tuple(dims[d] for d in keep))


@rule(aten.view_as_complex)
def view_as_complex(an: Analysis, node: torch.fx.Node) -> object:
    """``[..., n, 2]`` real pairs read as ``n`` complex numbers (Llama 4's rotary): the two
    parts of a number are one feature from here on, so the pair is tied."""
    atoms = an.input_atoms(node)
    if atoms is None:
        return None
    return an.feat(an.union_along(atoms, [atoms.ndim - 1]).reshape(atoms.shape[:-1]))


@rule(aten.view_as_real)
def view_as_real(an: Analysis, node: torch.fx.Node) -> object:
    """``n`` complex numbers as ``[..., n, 2]`` real pairs: both parts carry the number's
    feature (a size-1 dim broadcasts it)."""
    atoms = an.input_atoms(node)
    return None if atoms is None else an.feat(atoms[..., None])


@rule(aten.slice)
def slice_(an: Analysis, node: torch.fx.Node) -> object:
    src = node.args[0]
    v = an.val(src)
    if isinstance(v, Partial):
        return v
    atoms = _atoms(an, src)
    if atoms is None:
        return None
    nd = atoms.ndim
    dim = (node.args[1] if len(node.args) > 1 else 0) % nd
    if atoms.shape[dim] == 1:
        return Feat(atoms)
    return an.feat(np.take(atoms, slice_indices(node.args[2:5], an.shape(src)[dim]), axis=dim))


def _over_positions(an: Analysis, node: torch.fx.Node, dims: list[int], what: str) -> object:
    """The input of an op that moves positions along ``dims`` (Partial sums pass: the op
    is linear), its feature atoms when no feature lies along those dims, else ``None``
    with the op refused as ``what``."""
    v = an.val(node.args[0])
    if isinstance(v, Partial):
        return v
    atoms = _atoms(an, node.args[0])
    if atoms is None:
        return None
    if any(atoms.shape[d % max(atoms.ndim, 1)] > 1 for d in dims):
        an.poison_node(node, what, v)
        return None
    return atoms


@rule(aten.unfold)
def unfold(an: Analysis, node: torch.fx.Node) -> object:
    """Sliding windows along ``dim`` (a short causal convolution written as
    ``x.unfold(seq, k, 1)``): each window is a new last dim of positions, so features
    along every other dim keep their place; windows across the features would mix them."""
    atoms = _over_positions(an, node, [node.args[1]], "unfold windows across split features")
    return an.feat(np.expand_dims(atoms, -1)) if isinstance(atoms, np.ndarray) else atoms


@rule(aten.flip)
def flip(an: Analysis, node: torch.fx.Node) -> object:
    """Reversed positions (a causal convolution's taps read backwards): features along
    the other dims keep their place; reversing the features would deal them anew."""
    atoms = _over_positions(an, node, list(node.args[1]), "flip reverses split features")
    return Feat(atoms) if isinstance(atoms, np.ndarray) else atoms


@rule(aten.roll)
def roll(an: Analysis, node: torch.fx.Node) -> object:
    """Positions shifted cyclically (Swin's shifted windows): as ``flip``, features along
    the other dims keep their place; no dims given rolls the flattened tensor."""
    dims = node.args[2] if len(node.args) > 2 else node.kwargs.get("dims", ())
    dims = list(dims) if isinstance(dims, list | tuple) else [dims]
    atoms = _over_positions(an, node, dims or list(range(max(an.ndim(node), 1))), "roll shifts split features")
    return Feat(atoms) if isinstance(atoms, np.ndarray) else atoms


@rule(aten.select)
def select(an: Analysis, node: torch.fx.Node) -> object:
    src = node.args[0]
    v = an.val(src)
    if isinstance(v, Partial):
        return v
    if isinstance(v, ParamRef):  # one expert of stacked weights (``gate_up_proj[e]``, e an int)
        d = node.args[1] % len(v.dims)
        return ParamRef(v.fqn, v.dims[:d] + v.dims[d + 1:], v.is_buffer)
    atoms = _atoms(an, src)
    if atoms is None:
        return None
    dim = node.args[1] % atoms.ndim
    index = node.args[2] if atoms.shape[dim] > 1 else 0
    return an.feat(np.take(atoms, index, axis=dim))


@rule(aten.split, aten.split_with_sizes, aten.chunk, aten.tensor_split, aten.unbind, aten.unsafe_split)
def split(an: Analysis, node: torch.fx.Node) -> object:
    src = node.args[0]
    v = an.val(src)
    outs = node.meta.get("val")
    n_out = len(outs) if isinstance(outs, list | tuple) else 1
    if isinstance(v, Partial):
        return [v] * n_out
    atoms = _atoms(an, src)
    if atoms is None:
        return [None] * n_out
    packet = getattr(node.target, "overloadpacket", node.target)
    if packet is aten.unbind:
        dim = (node.args[1] if len(node.args) > 1 else 0) % atoms.ndim
    else:
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % atoms.ndim
    result: list[object] = []
    offset = 0
    for out in outs:
        if packet is aten.unbind:
            piece = np.take(atoms, [offset], axis=dim) if atoms.shape[dim] > 1 else atoms
            result.append(an.feat(np.squeeze(piece, axis=dim)))
            offset += 1
            continue
        length = int(out.shape[dim])
        piece = np.take(atoms, range(offset, offset + length), axis=dim) if atoms.shape[dim] > 1 else atoms
        result.append(an.feat(piece))
        offset += length
    return result


@rule(operator.getitem)
def getitem(an: Analysis, node: torch.fx.Node) -> object:
    v = an.val(node.args[0])
    if isinstance(v, list | tuple):
        return v[node.args[1]]
    return None


@rule(aten.cat, aten.concat, aten.concatenate, aten.stack)
def cat(an: Analysis, node: torch.fx.Node) -> object:
    nd = an.ndim(node)
    packet = getattr(node.target, "overloadpacket", node.target)
    # torch.cat skips a 1-D empty piece beside pieces of any rank (XLM's cache of no
    # earlier tokens): it holds nothing, so it takes no part
    tensors = [t for t in node.args[0] if packet is aten.stack or nd == 1 or an.shape(t) != (0,)]
    dim = (node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % nd
    vals = [an.val(t) for t in tensors]
    if any(isinstance(v, Partial) for v in vals):
        if all(isinstance(v, Partial) for v in vals):
            rows = tuple(r for v in vals for r in v.rows)
            return Partial(rows)
        an.reduce_partials(node)
        return None
    if not any(isinstance(v, Feat) for v in vals):
        return None
    pieces: list[np.ndarray] = []
    unplaced: list[torch.fx.Node] = []
    params: list[tuple[ParamRef, tuple[int, ...]]] = []
    for t, v in zip(tensors, vals, strict=False):
        shape = list(an.shape(t))
        if packet is aten.stack:
            shape.insert(dim, 1)
        if isinstance(v, Feat):
            a = v.atoms
            if packet is aten.stack:
                a = np.expand_dims(an.aligned_to(a, nd - 1), dim)
            a = an.aligned_to(a, nd)
        else:
            a = np.full([1] * nd, -1, dtype=np.int64)
            if isinstance(v, ParamRef) and packet is not aten.stack:
                params.append((v, tuple(shape)))  # attention sinks: a per-head column
            elif isinstance(t, torch.fx.Node) and not isinstance(v, Partial) and 0 not in shape:
                unplaced.append(t)  # (an empty piece, like a zero-width rotary tail, is nothing)
        pieces.append(a)
    feats = [p for p in pieces if (p >= 0).any()]
    for t in unplaced:  # a replicated piece beside sharded ones: read by every rank
        an.shares(node, t, feats[0])
    for ref, shape in params:  # sliced like the features it lines up with off the cat dim
        line = feats[0] if feats[0].shape[dim] == 1 else np.take(feats[0], [0], axis=dim)
        an.aligned.append(Aligned(node, ref, line, shape, True))
    # broadcast every piece to a common shape off the cat dim, full size on it
    common = [max(p.shape[d] for p in pieces) for d in range(nd)]
    full: list[np.ndarray] = []
    for t, p in zip(tensors, pieces, strict=False):
        target = list(common)
        target[dim] = 1 if packet is aten.stack else an.shape(t)[dim]
        full.append(np.broadcast_to(p, target))
    return an.feat(np.concatenate(full, axis=dim))


SHAPE_RULES = [identity, size_read, native_dropout, view, expand, repeat_interleave, repeat, pad, permute, unsqueeze, squeeze,
               slice_, select, unfold, flip, roll, split, getitem, cat, view_as_complex, view_as_real]
