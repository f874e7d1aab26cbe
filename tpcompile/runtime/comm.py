"""Differentiable tensor-parallel collectives.

Each collective is a ``torch.autograd.Function`` built on plain ``torch.distributed``
calls (no DTensor), so it works with any backend that implements the primitives:
gloo on CPU, nccl on GPU.  With a tensor-parallel group ``G`` of size ``n`` and
group-local rank ``r``, the forward/backward pairs are the conjugate operators of
Megatron-LM style tensor parallelism:

==================  ==============================  ==================================
function            forward                         backward
==================  ==============================  ==================================
``copy_to_tp``      ``y = x``                       ``dx = sum_r dy_r``  (all-reduce)
``reduce_from_tp``  ``y = sum_r x_r`` (all-reduce)  ``dx = dy``
``gather_from_tp``  ``y = cat(x_0..x_{n-1}, dim)``  ``dx = chunk(dy, n, dim)[r]``
``scatter_to_tp``   ``y = chunk(x, n, dim)[r]``     ``dx = cat(dy_0..dy_{n-1}, dim)``
``enter_tp``        ``y = cat(x_0..x_{n-1}, dim)``  ``dx = chunk(sum_r dy_r, n)[r]``
``leave_tp``        ``y = chunk(sum_r x_r, n)[r]``  ``dx = cat(dy_0..dy_{n-1}, dim)``
``sum_over_tp``     ``y = sum_r x_r`` (all-reduce)  ``dx = sum_r dy_r`` (all-reduce)
==================  ==============================  ==================================

``enter_tp`` / ``leave_tp`` are the sequence-parallel forms of "f" and "g" (Megatron's
all-gather / reduce-scatter pair): a token-split activation enters a column-parallel
region whole, and a row-parallel partial sum leaves it already split by tokens.

``copy_to_tp`` is Megatron's "f" (entry of a column-parallel region) and
``reduce_from_tp`` its "g" (exit of a row-parallel region).  ``sum_over_tp`` is "g" then
"f": a partial statistic over split features (each rank's local ``sum(x_r**2)``) is
summed, and the whole result is read by split code only, so each rank's gradient of it
is partial and summed too.  ``all_reduce_grad`` is
an alias of ``copy_to_tp`` for replicated parameters applied to sharded activations:
each rank sees only part of the parameter's gradient, and the true gradient is the
sum over the group.

When the group has a single member every function returns its input unchanged and
issues no collective, so a model compiled for tp=1 pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup

__all__ = [
    "all_reduce_grad",
    "copy_to_tp",
    "enter_tp",
    "gather_from_tp",
    "group_rank",
    "group_size",
    "on_first_rank",
    "leave_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "sum_over_tp",
]


# --------------------------------------------------------------------------- helpers


def group_size(group: ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (``None`` means the default group)."""
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    """This process's rank *within* ``group`` (not its global rank)."""
    return dist.get_rank(group)


def _normalize_dim(dim: int, ndim: int) -> int:
    """Map a possibly negative ``dim`` into ``[0, ndim)`` or raise ``ValueError``."""
    if ndim == 0:
        raise ValueError("cannot split or concatenate a 0-dim tensor along a dimension")
    if not -ndim <= dim < ndim:
        raise ValueError(f"dim {dim} is out of range for a tensor with {ndim} dimensions")
    return dim % ndim


def _all_reduce_sum(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Return ``sum_r x_r`` in a fresh contiguous buffer.

    The input is never written: autograd may still need it, and gradients handed to
    ``backward`` can be aliased or expanded (stride-0) views, so reducing in place
    would corrupt other consumers.
    """
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
    return out


def _all_gather_cat(x: Tensor, group: ProcessGroup | None, dim: int) -> Tensor:
    """Return ``cat([x_0, ..., x_{n-1}], dim)`` with chunks ordered by group rank.

    All ranks must pass tensors of identical shape and dtype.
    """
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(group_size(group))]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _check_divisible(x: Tensor, world: int, dim: int) -> int:
    """Return the chunk length ``x.size(dim) / world`` or raise ``ValueError``."""
    size = x.shape[dim]
    if size % world != 0:
        raise ValueError(
            f"cannot split dimension {dim} of size {size} into {world} equal chunks "
            f"(tensor shape {tuple(x.shape)}, tensor-parallel size {world})"
        )
    return size // world


def _local_chunk(x: Tensor, group: ProcessGroup | None, dim: int) -> Tensor:
    """Return this rank's chunk ``x[..., r*k:(r+1)*k, ...]`` with ``k = size(dim) / n``.

    The result is a contiguous copy, not a view, so later in-place ops on it can never
    reach the (replicated) full tensor.
    """
    chunk = _check_divisible(x, group_size(group), dim)
    piece = x.narrow(dim, group_rank(group) * chunk, chunk)
    return piece.clone(memory_format=torch.contiguous_format)


def _reduce_scatter(x: Tensor, group: ProcessGroup | None, dim: int) -> Tensor:
    """``chunk(sum_r x_r, n, dim)[r]``: one reduce-scatter (half an all-reduce's traffic)."""
    n = group_size(group)
    _check_divisible(x, n, dim)
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
    dist.reduce_scatter_tensor(out, moved, group=group)
    return out.movedim(0, dim).contiguous()  # model code may .view() it


# --------------------------------------------------------------------------- autograd


class _CopyToTP(torch.autograd.Function):
    """Forward ``y = x``; backward ``dx = sum_r dy_r``."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        # A view keeps the identity free of copies (autograd would make one anyway if
        # ``x`` were returned as-is).  Like any view made inside a custom Function,
        # it must not be modified in place, nor may ``x`` after this call.
        return x.view_as(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce_sum(grad, ctx.group), None


class _OnFirstRank(torch.autograd.Function):
    """Forward ``y = x`` on the group's first rank, zeros elsewhere; backward ``dx = dy``."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        return x.view_as(x) if group_rank(group) == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Forward ``y = sum_r x_r``; backward ``dx = dy``."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _SumOverTP(torch.autograd.Function):
    """Forward ``y = sum_r x_r``; backward ``dx = sum_r dy_r``."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        ctx.group = group
        return _all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce_sum(grad, ctx.group), None


def _dim_pair(forward: Callable[[Tensor, ProcessGroup | None, int], Tensor],
              backward: Callable[[Tensor, ProcessGroup | None, int], Tensor],
              name: str, doc: str) -> type[torch.autograd.Function]:
    """An autograd Function along one dim whose backward is ``forward``'s conjugate."""

    def fwd(ctx: FunctionCtx, x: Tensor, group: ProcessGroup | None, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return forward(x, group, dim)

    def bwd(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        return backward(grad, ctx.group, ctx.dim), None, None

    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(fwd), "backward": staticmethod(bwd), "__doc__": doc})


_GatherFromTP = _dim_pair(_all_gather_cat, _local_chunk, "_GatherFromTP",
                          "Forward ``y = cat_r(x_r, dim)``; backward ``dx = chunk(dy, n, dim)[r]``.")
_ScatterToTP = _dim_pair(_local_chunk, _all_gather_cat, "_ScatterToTP",
                         "Forward ``y = chunk(x, n, dim)[r]``; backward ``dx = cat_r(dy_r, dim)``.")
_EnterTP = _dim_pair(_all_gather_cat, _reduce_scatter, "_EnterTP",
                     "Forward all-gather along ``dim``; backward reduce-scatter of the partial gradients.")
_LeaveTP = _dim_pair(_reduce_scatter, _all_gather_cat, "_LeaveTP",
                     "Forward reduce-scatter along ``dim``; backward all-gather.")


# --------------------------------------------------------------------------- public API


def copy_to_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Identity forward, all-reduce(sum) backward (Megatron's "f").

    Use where a replicated activation enters a tensor-parallel region: every rank
    consumes the same ``x`` but contributes a different partial ``dL/dx``, and the
    true gradient is ``dL/dx = sum_r dL_r/dx``.

    The result is a zero-copy view of ``x``; autograd forbids in-place changes to it
    (or to ``x`` while it is alive), so clone first if a consumer mutates it.
    """
    if group_size(group) == 1:
        return x
    return _CopyToTP.apply(x, group)


def reduce_from_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-reduce(sum) forward, identity backward (Megatron's "g").

    Use where partial sums leave a row-parallel region: ``y = sum_r x_r`` and, since
    ``dy/dx_r = I``, each rank receives the replicated upstream gradient unchanged.
    The input is not modified.
    """
    if group_size(group) == 1:
        return x
    return _ReduceFromTP.apply(x, group)


def gather_from_tp(x: Tensor, group: ProcessGroup | None, dim: int = -1) -> Tensor:
    """All-gather forward: ``y = cat([x_0, ..., x_{n-1}], dim)`` in group-rank order.

    Backward keeps this rank's slice of the (replicated) upstream gradient,
    ``dx_r = dy[..., r*k:(r+1)*k, ...]`` with ``k = x.size(dim)``.  Every rank must
    pass the same shape.
    """
    if group_size(group) == 1:
        return x
    return _GatherFromTP.apply(x, group, _normalize_dim(dim, x.dim()))


def scatter_to_tp(x: Tensor, group: ProcessGroup | None, dim: int = -1) -> Tensor:
    """Split forward: return this rank's contiguous chunk ``chunk(x, n, dim)[r]``.

    Backward all-gathers the per-rank gradients, ``dx = cat([dy_0, ..., dy_{n-1}], dim)``.
    Raises ``ValueError`` when ``x.size(dim)`` is not divisible by the group size.
    """
    if group_size(group) == 1:
        return x
    dim = _normalize_dim(dim, x.dim())
    # Validate eagerly so the error surfaces at the call site, not inside autograd.
    _check_divisible(x, group_size(group), dim)
    return _ScatterToTP.apply(x, group, dim)


def enter_tp(x: Tensor, group: ProcessGroup | None, dim: int) -> Tensor:
    """All-gather forward; reduce-scatter backward: a token-split ``x`` enters a
    column-parallel region whole, and the region's partial input gradients are summed
    and split back by tokens in one collective (no separate ``copy_to_tp``)."""
    if group_size(group) == 1:
        return x
    return _EnterTP.apply(x, group, _normalize_dim(dim, x.dim()))


def leave_tp(x: Tensor, group: ProcessGroup | None, dim: int) -> Tensor:
    """Reduce-scatter forward; all-gather backward: a row-parallel partial sum leaves
    its region summed and already split by tokens (instead of ``reduce_from_tp``)."""
    if group_size(group) == 1:
        return x
    dim = _normalize_dim(dim, x.dim())
    _check_divisible(x, group_size(group), dim)
    return _LeaveTP.apply(x, group, dim)


def on_first_rank(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """``x`` on the group's first rank and zeros on the others; the gradient passes
    through unchanged on every rank.

    Use for a replicated value added to a partial sum before the all-reduce that sums it
    (a bias a fused experts module adds inside its forward): the sum then holds it once.
    The gradient of that sum is whole on every rank, so each rank's copy of ``x`` gets
    all of it, as a replicated parameter must.
    """
    if group_size(group) == 1:
        return x
    return _OnFirstRank.apply(x, group)


def sum_over_tp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """All-reduce(sum) forward *and* backward: ``y = sum_r x_r``, ``dx = sum_r dy_r``.

    Use for a partial statistic over split features (a norm's sum of squares over all
    heads): every rank gets the whole statistic, and, since only split code reads it,
    each rank's ``dL/dy`` covers only its own features — the true gradient of every
    rank's partial sum is ``sum_r dL_r/dy``.  Using ``reduce_from_tp`` here would train
    each rank's features with only its own share of that gradient.
    """
    if group_size(group) == 1:
        return x
    return _SumOverTP.apply(x, group)


all_reduce_grad = copy_to_tp
"""Alias of :func:`copy_to_tp` for replicated parameters used on sharded activations:
identity forward, gradient summed over the tensor-parallel group in backward."""
