"""Gradient norms that count every weight once, where TP ranks hold copies of its rows.

A KV head copied to several ranks (tp > KV heads, query heads straddling KV groups, a
single KV head beside heads dealt unevenly) is held by each of them, and after
:class:`~tpcompile.runtime.rows.ReplicaGradSum` every copy holds the head's full
gradient.  The parameter is a ``Shard`` DTensor over the TP group, so the norm torch
computes for it (``clip_grad_norm_``, accelerate's and the HF Trainer's clipping, all
through ``torch.nn.utils.get_total_norm``) sums each copy: Falcon's single KV head at
tp=4 counted four times, a 0.12 (12%) larger norm on the tiny model — a different
clipping factor, so a different training run.

The fix is where every clipping path meets: ``get_total_norm`` is wrapped (once, when a
plan with copied rows is applied) so that a gradient of such a parameter enters the
norm with each row scaled by ``count ** (-1 / p)`` (``count``: the copies of that row
over the TP group) — ``sum |g|^p / count`` over the copies is the row's ``|g|^p`` once.
Every other tensor, and the infinity norm (a max ignores copies), goes through torch's
own code unchanged.  The gradients themselves are never touched.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import TPError
from ..plan.types import ParamPlan

__all__ = ["register_copies", "total_norm"]


@dataclass(frozen=True)
class _Copies:
    module: weakref.ref
    name: str
    dim: int  # the TP shard dim
    scale: torch.Tensor  # per TP-local row: 1 / copies of it over the TP group (before ** 1/p)


_ENTRIES: list[_Copies] = []
_ORIGINAL: Any = None


def register_copies(module: nn.Module, name: str, pp: ParamPlan, rank: int) -> None:
    """Count ``module.name``'s rows once in gradient norms (``pp``: its plan, rows some
    TP ranks both hold; ``rank``: this TP rank).  Looked up by module and name at each
    norm, so the parameter FSDP2 puts in its place is found too."""
    index = pp.index()
    assert index is not None and pp.shard_dim is not None
    real = index[index >= 0]
    counts = np.bincount(real, minlength=int(real.max()) + 1)
    mine = index[rank]
    inverse = np.where(mine >= 0, 1.0 / counts[np.clip(mine, 0, None)], 1.0)
    _ENTRIES[:] = [e for e in _ENTRIES if e.module() is not None and not (e.module() is module and e.name == name)]
    _ENTRIES.append(_Copies(weakref.ref(module), name, pp.shard_dim, torch.as_tensor(inverse, dtype=torch.float64)))
    _install()


def _install() -> None:
    global _ORIGINAL
    if _ORIGINAL is not None:
        return
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    _ORIGINAL = clip_grad._get_total_norm
    # clip_grad_norm_ reads the module global; accelerate and the Trainer import the name
    # from torch.nn.utils at each call
    clip_grad._get_total_norm = utils.get_total_norm = total_norm


def total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
               foreach: bool | None = None) -> torch.Tensor:
    """``torch.nn.utils.get_total_norm`` with each copied row of a registered parameter's
    gradient counted once (:func:`register_copies`)."""
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    p = float(norm_type)
    if _ENTRIES and 0 < p < math.inf:
        copied = _copied_grads()
        tensors = [_weighted(t, copied[id(t)], p) if id(t) in copied else t for t in tensors]
    return _ORIGINAL(tensors, norm_type, error_if_nonfinite, foreach)


def _copied_grads() -> dict[int, _Copies]:
    out: dict[int, _Copies] = {}
    for e in _ENTRIES:
        module = e.module()
        param = None if module is None else module._parameters.get(e.name)
        if param is not None and param.grad is not None:
            out[id(param.grad)] = e
    return out


def _weighted(grad: torch.Tensor, e: _Copies, p: float) -> torch.Tensor:
    """``grad`` with its rows scaled by ``(1 / copies) ** (1 / p)``: this rank's piece of
    it (FSDP2's chunk of the TP-local rows along dim 0 where both split dim 0)."""
    from torch.distributed.tensor import DTensor

    local = grad.to_local() if isinstance(grad, DTensor) else grad
    scale = e.scale
    if isinstance(grad, DTensor) and e.dim == 0:
        names = grad.device_mesh.mesh_dim_names or ()
        for i, placement in enumerate(grad.placements):  # data-parallel chunks of dim 0, outer first
            # Shard(0) or FSDP2's _StridedShard(0) over a TP-split dim 0 (not a Shard subclass)
            if getattr(placement, "dim", None) == 0 and (i >= len(names) or names[i] != "tp"):
                # torch.chunk's split, as FSDP2's; fewer rows than ranks leave the last empty
                chunks = scale.chunk(grad.device_mesh.size(i)) if scale.numel() else ()
                at = grad.device_mesh.get_local_rank(i)
                scale = chunks[at] if at < len(chunks) else scale[:0]
    if local.dim() <= e.dim or local.shape[e.dim] != scale.numel():
        raise TPError(f"{e.name}: its gradient holds {list(local.shape)} here, not the {scale.numel()} rows "
                      "tpcompile's plan gives this rank; the gradient norm cannot count its copied rows once")
    shape = [1] * local.dim()
    shape[e.dim] = -1
    scaled = local * scale.pow(1.0 / p).to(local.device, local.dtype).view(shape)
    if not isinstance(grad, DTensor):
        return scaled
    return DTensor.from_local(scaled, grad.device_mesh, grad.placements, run_check=False,
                              shape=grad.shape, stride=grad.stride())
