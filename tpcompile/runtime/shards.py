"""Read and write one tensor's tensor-parallel shard, whatever wraps it.

A parameter of a transformed model is a ``DTensor`` sharded over the TP mesh; after
FSDP2 it is a ``DTensor`` over a (dp..., tp) mesh whose data-parallel dims shard it
further.  Checkpoint code only ever wants "this rank's TP shard" (``tp_local``) and
"set this rank's TP shard" (``assign_tp_local``): the data-parallel dims are gathered
or re-split here, one tensor at a time, so no rank ever holds more than one full
TP shard beyond its own parameters.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ..errors import TPError

__all__ = [
    "TPContext", "assign_tp_local", "lookup", "rank_local", "shard_like", "storage", "tp_context",
    "tp_local", "world",
]


class TPContext:
    """The TP group a model was transformed over (or a single-rank stand-in)."""

    def __init__(self, mesh: DeviceMesh | None) -> None:
        self.mesh = mesh
        self.group = mesh.get_group() if mesh is not None else None
        self.rank = mesh.get_local_rank() if mesh is not None else 0
        self.size = mesh.size() if mesh is not None else 1
        self.ranks: list[int] = (
            dist.get_process_group_ranks(self.group) if self.group is not None else [0]
        )


def world() -> tuple[int, int]:
    """``(rank, world size)`` of the default group; ``(0, 1)`` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def storage(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for ``t`` (its DTensor's local piece); no collective."""
    return t.to_local() if isinstance(t, DTensor) else t


def tp_context(model: nn.Module) -> TPContext:
    mesh = getattr(model, "tpcompile_mesh", None)
    if mesh is not None and mesh.mesh_dim_names and mesh.ndim > 1:
        mesh = mesh["tp"]
    return TPContext(mesh)


def lookup(model: nn.Module, key: str) -> tuple[nn.Module, str, torch.Tensor]:
    """``(owner module, attribute name, tensor)`` for a state-dict key."""
    mod_name, _, attr = key.rpartition(".")
    try:
        owner = model.get_submodule(mod_name) if mod_name else model
    except AttributeError:
        raise TPError(f"the model has no module {mod_name!r} (key {key!r})") from None
    tensor = owner._parameters.get(attr)
    if tensor is None:
        tensor = owner._buffers.get(attr)
    if tensor is None:
        raise TPError(f"the model has no parameter or buffer {key!r}")
    return owner, attr, tensor


def _tp_placements(t: DTensor) -> list[Any]:
    names = t.device_mesh.mesh_dim_names or ()
    if t.device_mesh.ndim == 1 and names in ((), ("tp",)):
        return list(t.placements)
    return [p if n == "tp" else Replicate() for n, p in zip(names, t.placements, strict=True)]


def tp_local(t: torch.Tensor) -> torch.Tensor:
    """This rank's TP shard of ``t``: data-parallel shards gathered, TP shard kept."""
    if not isinstance(t, DTensor):
        return t.detach()
    want = _tp_placements(t)
    if list(t.placements) != want:
        t = t.redistribute(t.device_mesh, want)
    return t.to_local().detach()


def rank_local(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """What this rank stores of a tensor laid out like ``like``, given its TP shard
    ``local``: the TP shard itself, or under FSDP this rank's piece of it."""
    if not isinstance(like, DTensor):
        return local.to(like.dtype)
    want = _tp_placements(like)
    src = DTensor.from_local(local.to(like.dtype), like.device_mesh, want, run_check=False,
                             shape=like.shape, stride=like.stride())
    if want != list(like.placements):
        src = src.redistribute(like.device_mesh, like.placements)
    return src.to_local()


def shard_like(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A tensor of ``like``'s type and placement (DTensor or plain) holding ``local``."""
    value = rank_local(like, local)
    if not isinstance(like, DTensor):
        return value
    return DTensor.from_local(value, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def assign_tp_local(model: nn.Module, key: str, local: torch.Tensor, aliases: list[str] = ()) -> None:
    """Make ``local`` (this rank's TP shard) the value of ``key`` and its tied aliases.

    A materialized tensor is written in place (optimizers and FSDP keep their
    references); a meta one is replaced by a new parameter/buffer that takes ownership of
    ``local``'s storage (callers pass a fresh tensor: no copy is made).
    """
    owner, attr, cur = lookup(model, key)
    with torch.no_grad():
        value = rank_local(cur, local)
        target = storage(cur)
        if list(target.shape) != list(value.shape):
            raise TPError(f"{key}: shard of shape {list(value.shape)} does not fit the model's "
                          f"{list(target.shape)}")
        if target.device.type != "meta":
            target.copy_(value)
            return
        if _fsdp_managed(model):
            raise TPError(f"{key} is still on the meta device inside FSDP; materialize the model "
                          "first (model.to_empty(device=...)) and load again")
        if isinstance(cur, DTensor):
            new = DTensor.from_local(value, cur.device_mesh, cur.placements, run_check=False,
                                     shape=cur.shape, stride=cur.stride())
        else:
            new = value
    if attr in owner._parameters:
        new = nn.Parameter(new, requires_grad=cur.requires_grad)
    for name in [key, *aliases]:  # tied aliases must stay the very same object
        mod, a, _ = lookup(model, name)
        (mod._parameters if a in mod._parameters else mod._buffers)[a] = new


def _fsdp_managed(model: nn.Module) -> bool:
    # fully_shard swaps each wrapped module's class for an "FSDP<Name>" subclass
    return any(type(m).__name__.startswith("FSDP") for m in model.modules())
