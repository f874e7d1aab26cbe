"""Rows several TP ranks hold, or none: replicated KV heads and padding heads.

A KV head copied to several ranks (tp > KV heads) must take the same optimizer step on
each: :class:`ReplicaGradSum` sums its copies' gradients.  A padding head (heads that no
tp divides, dealt unevenly) must stay zero and reach nothing: :class:`PaddingGradZero`
zeroes its rows' gradients, and :func:`zero_padding` its features where a linear makes
them and where one reads them (:func:`padding_masks`), so whatever the head computes in
between, even a non-finite value, meets zeros forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..plan.types import ParamPlan, Role, runs_to_index

__all__ = ["SHARED_ROW_LAYOUTS", "LocalRows", "shares_rows", "PaddingGradZero", "ReplicaGradSum", "padding_masks", "shared_rows",
           "zero_padding"]

# layouts whose local tensor passes through :func:`shared_rows`: rows several ranks hold
# (gradients summed), padding rows (gradients zeroed)
SHARED_ROW_LAYOUTS = ("kv_replicated", "padded")


def shares_rows(pp: ParamPlan) -> bool:
    """Does ``pp``'s local tensor pass through :func:`shared_rows` (rows several ranks
    hold, padding rows, or rows the forward reads several times)?"""
    return pp.layout in SHARED_ROW_LAYOUTS or pp.expand is not None


@dataclass(frozen=True)
class LocalRows:
    """One split parameter's local rows along its shard ``dim`` on this rank: the global
    row each holds (``index``, ``-1`` a padding row), found once when the hooks are
    installed, not per step."""

    index: torch.Tensor
    rows: int  # the global rows
    dim: int
    real: torch.Tensor | None  # positions of the real rows; ``None``: every row is real
    pads: torch.Tensor | None  # ``True`` at the padding rows; ``None``: there are none
    # the held position of each row the forward reads (``ParamPlan.expand``); ``None``: as held
    expand: torch.Tensor | None = None

    @classmethod
    def of(cls, pp: ParamPlan, rank: int) -> LocalRows:
        assert pp.shard_dim is not None
        index = torch.as_tensor(pp.index()[rank])
        pads = index < 0
        padded = bool(pads.any())
        expand = None if pp.expand is None else torch.as_tensor(runs_to_index(pp.expand)[rank])
        return cls(index, pp.global_shape[pp.shard_dim], pp.shard_dim,
                   torch.nonzero(~pads).flatten() if padded else None, pads if padded else None, expand)


class ReplicaGradSum(torch.autograd.Function):
    """Identity forward; backward sums the gradient of every copy of each global row.

    Each rank's local rows are scattered into the (small) global row space, summed over
    the TP group, and read back, so all copies of a replicated KV head get the full
    gradient — exactly the unsharded model's.  Padding rows (``-1``) get a zero gradient.
    """

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, rows: LocalRows, group: Any) -> torch.Tensor:
        ctx.local_rows, ctx.group = rows, group
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        lr: LocalRows = ctx.local_rows
        shape = list(grad.shape)
        shape[lr.dim] = lr.rows
        index = lr.index.to(grad.device)
        if lr.real is None:
            full = grad.new_zeros(shape).index_add_(lr.dim, index, grad)
            torch.distributed.all_reduce(full, group=ctx.group)
            return full.index_select(lr.dim, index), None, None
        real = lr.real.to(grad.device)
        full = grad.new_zeros(shape).index_add_(lr.dim, index[real], grad.index_select(lr.dim, real))
        torch.distributed.all_reduce(full, group=ctx.group)
        out = torch.zeros_like(grad).index_copy_(lr.dim, real, full.index_select(lr.dim, index[real]))
        return out, None, None


def padding_masks(module: nn.Module, pp: ParamPlan | None,
                  rows: LocalRows | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``True`` at each padding feature (a padding head's) of a linear's input (row-
    parallel) and of its output (column-parallel), or ``None``: ``nn.Linear``'s ``[out,
    in]`` and ``Conv1D``'s ``[in, out]`` weights (``pp``, its local ``rows``), whose
    activations' last dim is the sharded one."""
    if pp is None or rows is None or rows.pads is None:
        return None, None
    conv1d = type(module).__name__ == "Conv1D"
    if not isinstance(module, nn.Linear) and not conv1d:
        return None, None
    dim_in, dim_out = (0, 1) if conv1d else (1, 0)
    return (rows.pads if pp.role is Role.ROW and pp.shard_dim == dim_in else None,
            rows.pads if pp.role is Role.COLUMN and pp.shard_dim == dim_out else None)


def zero_padding(t: Any, pads: torch.Tensor | None) -> Any:
    """``t`` with its padding features set to zero (``masked_fill``: a NaN too), so
    nothing a padding head computes, forward or backward, reaches a real feature."""
    if pads is None or not isinstance(t, torch.Tensor) or t.shape[-1:] != pads.shape:
        return t
    return t.masked_fill(pads.to(t.device), 0)


class PaddingGradZero(torch.autograd.Function):
    """Identity forward; backward zeroes the gradient of the padding rows."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, rows: LocalRows) -> torch.Tensor:
        ctx.local_rows = rows
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        lr: LocalRows = ctx.local_rows
        assert lr.pads is not None
        shape = [1] * grad.dim()
        shape[lr.dim] = -1
        return grad.masked_fill(lr.pads.to(grad.device).view(shape), 0), None


def shared_rows(local: torch.Tensor, pp: ParamPlan, rows: LocalRows | None, group: Any) -> torch.Tensor:
    """``local`` as the module uses it: copies' gradients summed (``kv_replicated``) or
    padding rows' zeroed, and rows read several times repeated (``expand``: autograd sums
    their gradients into the held row), else as is.  ``rows``: ``LocalRows.of(pp, rank)``,
    found once."""
    if rows is None:
        return local
    if pp.layout == "kv_replicated":
        local = ReplicaGradSum.apply(local, rows, group)
    elif rows.pads is not None:  # this rank's share has padding rows
        local = PaddingGradZero.apply(local, rows)
    if rows.expand is not None:
        local = local.index_select(rows.dim, rows.expand.to(local.device))
    return local
