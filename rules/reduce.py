"""Reduction and normalization rules: reducing over features ties them together.

``softmax`` over a head's keys, ``mean(x**2)`` of an RMSNorm over ``head_dim`` (Qwen3's
``q_norm``), a LayerNorm over the hidden size: every feature reduced over must sit on one
rank.  A norm over the full hidden size therefore fuses a whole region into one unit and
keeps it replicated.

Except for a *linear statistic over every feature* of its input (``sum``, ``mean``,
``var``, ``std`` leaving no feature behind: OLMo-2's ``q_norm`` over all heads): it is a
sum of per-rank partial sums, so it ties nothing and is recorded as a
:class:`~tpcompile.analysis.state.StatUse`; :mod:`tpcompile.analysis.stats` then proves
it exact (its result only scales split features) or sends it back here to tie them.
"""

from __future__ import annotations

import numpy as np
import torch

from tpcompile.analysis.propagate import Analysis, rule
from tpcompile.analysis.state import Aligned, Feat, ParamRef, Partial, StatUse
from tpcompile.analysis.stats import STAT_OPS

from .pointwise import pointwise

__all__ = ["REDUCE_RULES"]

aten = torch.ops.aten

_LINEAR_REDUCTIONS = {aten.sum, aten.mean}


def _dims(arg: object, nd: int) -> list[int]:
    if arg is None:
        return list(range(nd))
    if isinstance(arg, int):
        return [arg % nd]
    dims = list(arg)
    return [d % nd for d in dims] if dims else list(range(nd))


@rule(
    aten.sum, aten.mean, aten.amax, aten.amin, aten.max, aten.min, aten.argmax,
    aten.argmin, aten.var, aten.std, aten.logsumexp, aten.norm, aten.linalg_vector_norm, aten.linalg_norm,
    aten.prod, aten.any, aten.all, aten.var_mean, aten.topk, aten.sort, aten.cumsum,
)
def reduction(an: Analysis, node: torch.fx.Node) -> object:
    if len(node.args) > 1 and isinstance(node.args[1], torch.fx.Node):
        return pointwise(an, node)  # max(a, b) / min(a, b) of two tensors: elementwise
    src = node.args[0]
    v = an.val(src)
    nd = an.ndim(src)
    packet = getattr(node.target, "overloadpacket", node.target)
    if isinstance(v, Partial):
        if packet in _LINEAR_REDUCTIONS:
            return v
        an.reduce_partials(node)
        return None
    if isinstance(v, ParamRef):
        return _reduce_param(an, node, v, packet)
    if not isinstance(v, Feat):
        return None
    atoms = an.aligned_to(v.atoms, nd)
    if packet in (aten.topk, aten.sort, aten.cumsum):
        if packet is aten.topk:
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1)
        else:
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
        an.union_along(atoms, [dim % nd])
        out = an.feat(np.take(atoms, [0], axis=dim % nd)) if atoms.shape[dim % nd] > 1 else Feat(atoms)
        return [out, out] if packet is not aten.cumsum else out
    dims = _reduced_dims(node, packet, nd)
    if packet in STAT_OPS and node not in an.whole_stats and _over_every_feature(atoms, dims):
        an.stat_uses.append(StatUse(node, atoms, tuple(dims)))
        return None  # a whole value once the partial sums are all-reduced
    reduced = an.union_along(atoms, dims)
    keepdim = bool(node.kwargs.get("keepdim", False))
    for a in node.args[2:]:
        if isinstance(a, bool):
            keepdim = a
    out_nd = an.ndim(node)
    if out_nd < nd and not keepdim:
        reduced = reduced.reshape([s for d, s in enumerate(reduced.shape) if d not in dims])
    if packet in (aten.max, aten.min, aten.var_mean) and isinstance(node.meta.get("val"), list | tuple):
        f = an.feat(reduced)
        return [f, f]
    return an.feat(reduced)


def _reduced_dims(node: torch.fx.Node, packet: object, nd: int) -> list[int]:
    dims_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if packet in (aten.norm, aten.linalg_vector_norm, aten.linalg_norm):
        dims_arg = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    return _dims(dims_arg, nd)


def _reduce_param(an: Analysis, node: torch.fx.Node, ref: ParamRef, packet: object) -> object:
    """A reduction of a parameter itself (PEFT DeLoRA's ``delora_B.norm(dim=0)``): the
    parameter dims it reduces must stay whole (a rank's slice would give a partial
    norm); the dims it keeps are the parameter's, entry for entry, and may be sliced
    like it (:func:`.pointwise._param_through`)."""
    nd = an.ndim(node.args[0])
    if packet in (aten.topk, aten.sort, aten.cumsum) or not isinstance(an.meta(node), torch.Tensor):
        an.read_raw(node, ref, range(nd))  # values moved along the dim, or several results
        return None
    dims = _reduced_dims(node, packet, nd)
    an.read_raw(node, ref, dims)
    kept = [d for d in range(nd) if d not in dims]
    if an.ndim(node) == nd:  # keepdim
        return ParamRef(ref.fqn, tuple(None if d in dims else ref.dims[d] for d in range(nd)), ref.is_buffer)
    if an.ndim(node) != len(kept):
        an.read_raw(node, ref, range(nd))
        return None
    return ParamRef(ref.fqn, tuple(ref.dims[d] for d in kept), ref.is_buffer)


def _over_every_feature(atoms: np.ndarray, dims: list[int]) -> bool:
    """The reduction leaves no feature behind: features vary along reduced dims only (a
    per-head statistic keeps its heads' features and ties each head as before)."""
    return any(atoms.shape[d] > 1 for d in dims) and all(
        atoms.shape[d] == 1 for d in range(atoms.ndim) if d not in dims)


@rule(aten.softmax, aten._softmax, aten.log_softmax, aten._log_softmax, aten.special_softmax)
def softmax(an: Analysis, node: torch.fx.Node) -> object:
    atoms = an.input_atoms(node)
    if atoms is None:
        return None
    an.union_along(atoms, [node.args[1] % atoms.ndim])
    return Feat(atoms)


@rule(aten.tril, aten.triu)
def triangle(an: Analysis, node: torch.fx.Node) -> object:
    """A triangular mask over the last two dims (a chunked linear attention's causal
    mask): an entry's fate depends on its position in both, so features there are tied;
    features on the other dims (heads) pass through."""
    atoms = an.input_atoms(node)
    if atoms is None:
        return None
    nd = atoms.ndim
    an.union_along(atoms, [nd - 2, nd - 1])
    return Feat(atoms)


@rule(aten.layer_norm, aten.native_layer_norm, aten.rms_norm, aten._fused_rms_norm)
def layer_norm(an: Analysis, node: torch.fx.Node) -> object:
    packet = getattr(node.target, "overloadpacket", node.target)
    multi = packet in (aten.native_layer_norm, aten._fused_rms_norm)
    atoms = an.input_atoms(node)
    if atoms is None:
        return [None, None, None] if multi else None
    nd = atoms.ndim
    k = len(node.args[1])
    an.union_along(atoms, list(range(nd - k, nd)))
    for p in node.args[2:4]:
        pv = an.val(p)
        if isinstance(p, torch.fx.Node) and isinstance(pv, ParamRef | type(None)):
            shape = (1,) * (nd - k) + an.shape(p)
            operand = pv if isinstance(pv, ParamRef) else p
            an.aligned.append(Aligned(node, operand, atoms, shape, p in an.tainted))
    out = Feat(atoms)
    return [out, None, None] if multi else out


@rule(aten.group_norm, aten.native_group_norm)
def group_norm(an: Analysis, node: torch.fx.Node) -> object:
    """Normalize each group of channels (dim 1) over itself and the positions: the
    channels of one group are one unit; the per-channel weight and bias follow them
    (wav2vec2's feature encoder: one group per channel, a channel-wise op)."""
    native = getattr(node.target, "overloadpacket", None) is aten.native_group_norm
    multi = [None, None, None] if native else None
    atoms = an.input_atoms(node)
    if atoms is None:
        return multi
    nd = atoms.ndim
    channels = an.shape(node.args[0])[1]
    groups = node.args[6] if native else node.args[1]
    weight, bias = (node.args[1], node.args[2]) if native else (
        node.args[2] if len(node.args) > 2 else None, node.args[3] if len(node.args) > 3 else None)
    if atoms.shape[1] != channels or any(s > 1 for i, s in enumerate(atoms.shape) if i != 1):
        an.poison_node(node, "group norm over features that vary off the channel dim", Feat(atoms))
        return multi
    line = atoms.reshape(-1)
    for g in line.reshape(int(groups), -1):
        an.union_along(g.reshape(1, -1), [1])
    for p in (weight, bias):
        pv = an.val(p) if isinstance(p, torch.fx.Node) else None
        if isinstance(pv, ParamRef):
            ref = ParamRef(pv.fqn, (None, pv.dims[0]) + (None,) * (nd - 2), pv.is_buffer)
            an.aligned.append(Aligned(node, ref, atoms, (1, channels) + (1,) * (nd - 2), True))
    out = Feat(atoms)
    return [out, None, None] if native else out


@rule(aten.batch_norm, aten.native_batch_norm, aten._native_batch_norm_legit_no_training)
def batch_norm(an: Analysis, node: torch.fx.Node) -> object:
    """Normalize each channel (dim 1) over the batch and the positions: channels stay
    apart, and the weight, the bias and the running statistics follow them (a conformer's
    convolution module, a CNN's blocks).  The running statistics a training forward
    updates are this rank's rows; the runtime writes them back whole
    (:class:`~tpcompile.plan.modules.SliceBuffers`).  Its statistics mix the tokens, so
    sequence and context parallelism keep it whole (no token rule)."""
    multi = None if getattr(node.target, "overloadpacket", node.target) is aten.batch_norm else [None, None, None]
    atoms = an.input_atoms(node)
    if atoms is None:
        return multi
    nd = atoms.ndim
    channels = an.shape(node.args[0])[1]
    if atoms.shape[1] != channels or any(s > 1 for i, s in enumerate(atoms.shape) if i != 1):
        an.poison_node(node, "batch norm over features that vary off the channel dim", Feat(atoms))
        return multi
    for k, p in enumerate(node.args[1:5]):  # weight, bias, running mean, running variance
        pv = an.val(p) if isinstance(p, torch.fx.Node) else None
        if isinstance(pv, ParamRef):
            ref = ParamRef(pv.fqn, (None, pv.dims[0]) + (None,) * (nd - 2), pv.is_buffer)
            an.aligned.append(Aligned(node, ref, atoms, (1, channels) + (1,) * (nd - 2), True))
            if k >= 2 and pv.is_buffer:  # a training forward updates them in place
                an.updated_buffers.add(pv.fqn)
    out = Feat(atoms)
    return out if multi is None else [out, None, None]


_POOLS = tuple(getattr(aten, n) for n in (
    "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d",
    "_adaptive_avg_pool3d", "avg_pool1d", "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d",
    "adaptive_max_pool3d") if hasattr(aten, n))
_POOLS_WITH_INDICES = {getattr(aten, n) for n in ("max_pool2d_with_indices", "max_pool3d_with_indices",
                                                  "adaptive_max_pool1d", "adaptive_max_pool2d",
                                                  "adaptive_max_pool3d") if hasattr(aten, n)}


def _positions_tied(an: Analysis, v: Feat, nd: int) -> np.ndarray:
    """``v``'s atoms at rank ``nd`` (``[batch, channels, *positions]``) with the features
    along the positions (dims 2 on) tied: an op over each channel's positions."""
    return an.union_along(an.aligned_to(v.atoms, nd), list(range(2, nd)))


@rule(*_POOLS)
def pool(an: Analysis, node: torch.fx.Node) -> object:
    """Pooling over the positions (dims 2 on) of ``[batch, channels, *positions]``: each
    channel pools its own positions, so features on the channels pass and features along
    the positions are tied (they would cross ranks); the result keeps the channels'
    features, the same at every pooled position."""
    src = node.args[0]
    v = an.val(src)
    with_indices = getattr(node.target, "overloadpacket", node.target) in _POOLS_WITH_INDICES
    if isinstance(v, Partial):
        an.reduce_partials(node)
        return [None, None] if with_indices else None
    if not isinstance(v, Feat):
        return [None, None] if with_indices else None
    out = an.feat(_positions_tied(an, v, an.ndim(src)))
    return [out, out] if with_indices else out


_RESAMPLES = tuple(getattr(aten, n) for n in (
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")
    if hasattr(aten, n))


@rule(*_RESAMPLES)
def resample(an: Analysis, node: torch.fx.Node) -> object:
    """Resizing the positions (dims 2 on) of ``[batch, channels, *positions]`` (a
    detector's feature pyramid): each channel is resized on its own, a weighted sum of
    its own positions, so a partial sum passes and features on the channels keep their
    place; features along the positions are tied, as pooling ties them."""
    src = node.args[0]
    v = an.val(src)
    if isinstance(v, Partial):
        return v
    if not isinstance(v, Feat):
        return None
    return an.feat(_positions_tied(an, v, an.ndim(src)))


@rule(*(getattr(aten, n) for n in ("grid_sampler_2d", "grid_sampler", "grid_sampler_3d") if hasattr(aten, n)))
def grid_sample(an: Analysis, node: torch.fx.Node) -> object:
    """``grid_sample(input [N, C, *in], grid [N, *out, k])``: sample ``n`` of the output,
    channel ``c``, reads channel ``c`` of input sample ``n`` at the grid's points (a
    deformable attention's values, heads folded into ``N`` and sampled at offsets each
    head computes).  Features on ``N`` tie input and grid sample for sample; on ``C``
    they pass; along the positions, or across the grid's coordinates, they are tied."""
    src, grid = node.args[:2]
    v, g = an.val(src), an.val(grid)
    if isinstance(g, Partial):
        an.reduce_partials(node)
        g = None
    if isinstance(v, Partial):
        if g is None:
            return v  # linear in the input for a fixed grid
        an.reduce_partials(node)
        v = None
    nd = an.ndim(node)
    parts = []
    if isinstance(v, Feat):
        parts.append(_positions_tied(an, v, nd))
    if isinstance(g, Feat):
        atoms = an.union_along(an.aligned_to(g.atoms, nd), list(range(1, nd)))  # one unit per sample
        parts.append(atoms)
    if not parts:
        return None
    out = an.tie(parts)
    for arg, val in ((src, v), (grid, g)):
        if not isinstance(val, Feat) and isinstance(arg, torch.fx.Node):
            shape = an.shape(arg)  # only dim 0 lines up with the output's
            an.aligned.append(Aligned(node, arg, out, (shape[0],) + (1,) * (nd - 1), arg in an.tainted))
    return an.feat(out)


@rule(aten.im2col)
def im2col(an: Analysis, node: torch.fx.Node) -> object:
    """``nn.Unfold``'s sliding blocks: ``[B, C, H, W]`` to ``[B, C * kh * kw, L]``, each
    channel's ``kh * kw`` taps together in the channel order (ConvBERT's span-based
    convolution).  Channels' features repeat over their taps; positions are tied."""
    src = node.args[0]
    v = an.val(src)
    if isinstance(v, Partial):
        return v  # copies of the summed values: linear
    if not isinstance(v, Feat):
        return None
    atoms = _positions_tied(an, v, an.ndim(src))
    taps = int(np.prod(node.args[1]))
    channels = atoms.reshape(atoms.shape[:2])
    return an.feat(np.repeat(channels, taps, axis=1)[..., None])


REDUCE_RULES = [reduction, softmax, triangle, layer_norm, group_norm, batch_norm, pool, resample, grid_sample,
                im2col]
