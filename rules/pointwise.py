"""Pointwise rules: elementwise math ties the features it lines up.

``silu(gate) * up`` ties gate feature ``i`` to up feature ``i``; rotary's
``q * cos + rotate_half(q) * sin`` ties features within a head.  A value without features
(a norm weight, ``cos``, a mask) combined with sharded features is recorded as
:class:`Aligned`: after partitioning it is either sliced like the features (a per-head
parameter), replicated with its gradient all-reduced (a norm weight broadcast over the
local heads), or, for a computed activation that would need slicing, the region is kept
replicated.
"""

from __future__ import annotations

import numpy as np
import torch

from tpcompile.analysis.propagate import Analysis, rule
from tpcompile.analysis.state import Aligned, Feat, ParamRef, Partial

__all__ = ["POINTWISE_RULES", "pointwise"]

aten = torch.ops.aten

_ADDS = (aten.add, aten.sub, aten.add_, aten.sub_)


def _tensor_args(node: torch.fx.Node) -> list[torch.fx.Node]:
    out: list[torch.fx.Node] = []
    for a in list(node.args) + list(node.kwargs.values()):
        if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor):
            out.append(a)
    return out


def _partial_result(an: Analysis, node: torch.fx.Node, args: list[torch.fx.Node]) -> object:
    """A partial sum survives ops linear in it: f(a + b) = f(a) + f(b)."""
    vals = [an.val(a) for a in args]
    partials = [v for v in vals if isinstance(v, Partial)]
    others = [v for v in vals if not isinstance(v, Partial)]
    packet = getattr(node.target, "overloadpacket", node.target)
    if not any(isinstance(v, Feat) for v in others):
        first_is_partial = isinstance(an.val(node.args[0]), Partial)
        if packet is aten.neg or (packet is aten.mul and len(partials) == 1):
            return partials[0]
        if packet in (aten.div, aten.true_divide) and len(partials) == 1 and first_is_partial:
            return partials[0]
        # a constant added to a partial sum would be added once per rank
        constant = any(isinstance(a, int | float) and not isinstance(a, bool) and a != 0 for a in node.args[:2])
        if packet in _ADDS and not others and not constant:
            return Partial(tuple(r for p in partials for r in p.rows))
        if (packet in _ADDS and len(partials) == 1 and len(others) == 1 and not constant
                and isinstance(others[0], ParamRef) and an.row_addend(node, partials[0], others[0])):
            return partials[0]  # a bias added inside the row's module: one rank adds it
    an.reduce_partials(node)  # reduced first: from here on the sum is a replicated value
    return None


def _param_through(an: Analysis, node: torch.fx.Node, args: list[torch.fx.Node]) -> ParamRef | None:
    """Elementwise math on one parameter and scalars (Mamba's ``-exp(A_log)``, xIELU's
    ``beta + softplus(alpha_n)`` with a 0-d buffer) is still that parameter, entry for
    entry: it may be sliced like the parameter itself, and a use that broadcasts it over
    sharded features gives it a partial gradient like the parameter's own."""
    refs = [an.val(a) for a in args if isinstance(an.val(a), ParamRef) and not an.val(a).is_buffer]
    if len(refs) != 1:
        return None
    ref = refs[0]
    nd = an.ndim(node)
    dims = (None,) * (nd - len(ref.dims)) + ref.dims
    for a in args:
        shape = an.shape(a)
        if an.val(a) is ref or int(np.prod(shape)) <= 1:
            continue
        # a replicated value without gradient that the parameter's dims broadcast over
        # (Swin's shifted-window mask, ``[windows, 1, N, N]``, added to the per-head
        # position bias): slicing the parameter's dims slices the result alike
        aligned = (1,) * (nd - len(shape)) + tuple(shape)
        if isinstance(an.val(a), Feat | Partial) or a in an.tainted or any(
                s > 1 and d is not None for s, d in zip(aligned, dims, strict=True)):
            return None
    return ParamRef(ref.fqn, dims)


_BROADCASTS = (aten.expand.default, aten.expand_as.default, aten.broadcast_to.default)


def _distinct_shape(an: Analysis, a: torch.fx.Node) -> tuple[int, ...]:
    """The dims along which ``a`` holds distinct values: an activation without features
    broadcast by ``expand`` (XLM's ``mask.view(bs, 1, 1, -1).expand_as(scores)``) is the
    same along every dim the broadcast widened, so where it meets split features there
    it needs no slice, as the mask before the expand would not (the expanded size follows
    the local scores at run time; a hard-coded one is the self-check's to catch)."""
    shape = tuple(an.shape(a))
    while (isinstance(a, torch.fx.Node) and a.op == "call_function" and a.target in _BROADCASTS
           and an.val(a) is None and isinstance(a.args[0], torch.fx.Node)):
        a = a.args[0]
        src = tuple(an.shape(a))
        shape = (1,) * (len(shape) - len(src)) + src
    return shape


def pointwise(an: Analysis, node: torch.fx.Node) -> object:
    """Generic elementwise rule (with broadcasting)."""
    args = _tensor_args(node)
    if any(isinstance(an.val(a), Partial) for a in args):
        result = _partial_result(an, node, args)
        if result is not None:
            return result
    nd = an.ndim(node)
    feats = [an.aligned_to(an.val(a).atoms, nd) for a in args if isinstance(an.val(a), Feat)]
    if not feats:
        return _param_through(an, node, args)
    out = an.tie(feats)
    for a in args:
        v = an.val(a)
        if isinstance(v, Feat):
            continue
        shape = an.shape(a)
        if int(np.prod(shape)) <= 1 and not isinstance(v, ParamRef) and a not in an.tainted:
            continue  # a constant: the same on every rank, no gradient
        if isinstance(v, ParamRef) and v.is_buffer and int(np.prod(shape)) <= 1:
            continue  # a scalar buffer: nothing to slice, no gradient
        if not isinstance(v, ParamRef):
            shape = _distinct_shape(an, a)
        aligned = (1,) * (nd - len(shape)) + tuple(shape)
        operand = v if isinstance(v, ParamRef) else a
        an.aligned.append(Aligned(node, operand, out, aligned, a in an.tainted))
    return an.feat(out)


_POINTWISE_OPS = [
    aten.add, aten.sub, aten.mul, aten.div, aten.true_divide, aten.rsub, aten.pow,
    aten.neg, aten.abs, aten.exp, aten.log, aten.sqrt, aten.rsqrt, aten.reciprocal,
    aten.square, aten.tanh, aten.sigmoid, aten.silu, aten.gelu, aten.relu, aten.erf,
    aten.sin, aten.cos, aten.softplus, aten.clamp, aten.clamp_min, aten.clamp_max,
    aten.where, aten.masked_fill, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge,
    aten.logical_and, aten.logical_or, aten.logical_not, aten.bitwise_and,
    aten.bitwise_or, aten.bitwise_not, aten.minimum, aten.maximum, aten.sign,
    aten.floor, aten.ceil, aten.round, aten.trunc, aten.log1p, aten.expm1, aten.elu,
    aten.leaky_relu, aten.hardtanh, aten.mish, aten.hardswish, aten.hardsigmoid,
    aten.gelu_, aten.mul_, aten.add_, aten.div_, aten.sub_, aten.tanh_, aten.relu_,
    aten.isnan, aten.isinf, aten.nan_to_num, aten.lerp, aten.addcmul, aten.addcdiv,
    aten.fmod, aten.remainder, aten.__and__, aten.__or__, aten.atan, aten.log_sigmoid,
    aten.acos, aten.asin, aten.atan2, aten.sinh, aten.cosh, aten.asinh, aten.acosh, aten.atanh,
    aten.tan, aten.log2, aten.log10, aten.exp2, aten.xlogy, aten.hypot, aten.logaddexp,
    aten.softshrink, aten.hardshrink, aten.celu, aten.selu, aten.relu6, aten.threshold,
    # in-place forms (older code: XLM's ``scores.masked_fill_(mask, -inf)``); the write
    # through a view is followed by the engine for every rule
    aten.masked_fill_, aten.clamp_, aten.clamp_min_, aten.clamp_max_, aten.exp_, aten.neg_,
    aten.sigmoid_, aten.silu_, aten.pow_, aten.sqrt_, aten.rsqrt_, aten.abs_, aten.reciprocal_,
    aten.floor_, aten.erf_, aten.log_, aten.elu_, aten.leaky_relu_, aten.hardtanh_,
    aten.nan_to_num_, aten.lerp_, aten.addcmul_, aten.addcdiv_,
]


@rule(*_POINTWISE_OPS)
def elementwise(an: Analysis, node: torch.fx.Node) -> object:
    return pointwise(an, node)


@rule(aten.glu)
def glu(an: Analysis, node: torch.fx.Node) -> object:
    """``a * sigmoid(b)`` of the two halves of ``dim``: feature ``i`` meets ``i + half``."""
    atoms = an.input_atoms(node)
    if atoms is None:
        return None
    d = (node.args[1] if len(node.args) > 1 else -1) % atoms.ndim
    if atoms.shape[d] == 1:
        return Feat(atoms)
    half = atoms.shape[d] // 2
    a, b = np.take(atoms, range(half), axis=d), np.take(atoms, range(half, 2 * half), axis=d)
    an.union(a, b)
    return an.feat(np.where(a >= 0, a, b))


POINTWISE_RULES = [elementwise, glu]
