"""Rows several TP ranks hold, or none: replicated KV heads and padding heads.

A KV head copied to several ranks (tp > KV heads) must take the same optimizer step on
each: :class:`ReplicaGradSum` sums its copies' gradients.  A padding head (heads that no
tp divides, dealt unevenly) must stay zero and reach nothing: :class:`PaddingGradZero`
zeroes its rows' gradients, and :func:`zero_padding` its features where a linear makes
them and where one reads them (:func:`padding_masks`), so whatever the head computes in
between, even a non-finite value, meets zeros forward and backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..plan.types import ParamPlan, Role

__all__ = ["PaddingGradZero", "ReplicaGradSum", "padding_masks", "zero_padding"]


class ReplicaGradSum(torch.autograd.Function):
    """Identity forward; backward sums the gradient of every copy of each global row.

    Each rank's local rows are scattered into the (small) global row space, summed over
    the TP group, and read back, so all copies of a replicated KV head get the full
    gradient — exactly the unsharded model's.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, index: torch.Tensor, rows: int, dim: int, group: Any) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows, ctx.dim, ctx.group = rows, dim, group
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (index,) = ctx.saved_tensors
        index = index.to(grad.device)
        real = torch.nonzero(index >= 0).flatten()  # padding rows (-1) get a zero gradient
        shape = list(grad.shape)
        shape[ctx.dim] = ctx.rows
        full = grad.new_zeros(shape).index_add_(ctx.dim, index[real], grad.index_select(ctx.dim, real))
        torch.distributed.all_reduce(full, group=ctx.group)
        out = torch.zeros_like(grad).index_copy_(ctx.dim, real, full.index_select(ctx.dim, index[real]))
        return out, None, None, None, None


def padding_masks(module: nn.Module, params: dict[str, ParamPlan],
                   rank: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``True`` at each padding feature (a padding head's) of a linear's input (row-
    parallel) and of its output (column-parallel), or ``None``: ``nn.Linear``'s ``[out,
    in]`` and ``Conv1D``'s ``[in, out]`` weights, whose activations' last dim is the
    sharded one."""
    pp = params.get("weight")
    if pp is None or pp.shard_dim is None or pp.runs is None:
        return None, None
    pads = torch.as_tensor(pp.index()[rank] < 0)
    if not pads.any():
        return None, None
    conv1d = type(module).__name__ == "Conv1D"
    if not isinstance(module, nn.Linear) and not conv1d:
        return None, None
    dim_in, dim_out = (0, 1) if conv1d else (1, 0)
    return (pads if pp.role is Role.ROW and pp.shard_dim == dim_in else None,
            pads if pp.role is Role.COLUMN and pp.shard_dim == dim_out else None)


def zero_padding(t: Any, pads: torch.Tensor | None) -> Any:
    """``t`` with its padding features set to zero (``masked_fill``: a NaN too), so
    nothing a padding head computes, forward or backward, reaches a real feature."""
    if pads is None or not isinstance(t, torch.Tensor) or t.shape[-1:] != pads.shape:
        return t
    return t.masked_fill(pads.to(t.device), 0)


class PaddingGradZero(torch.autograd.Function):
    """Identity forward; backward zeroes the gradient of the padding rows (``index < 0``)."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, index: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.dim = dim
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        (index,) = ctx.saved_tensors
        shape = [1] * grad.dim()
        shape[ctx.dim] = -1
        return grad.masked_fill((index < 0).to(grad.device).view(shape), 0), None, None
