"""Where a sharded checkpoint's collectives run: the row-chunk mesh and the mirrors.

A sharded save converts every tensor to its HF layout (collectives over the TP and
data-parallel meshes), then cuts it into one row chunk per rank holding it (a local cut,
as a DTensor over a 1-D mesh of those ranks) for ``torch.distributed.checkpoint``.  An
asynchronous save runs the conversion on a background thread, over mirrors of the
training meshes with process groups of their own, so its collectives never interleave
with the training step's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import TPError
from ..runtime.mesh import mirror_mesh
from ..runtime.shards import TPContext, world
from .pipelined import pp_layout, stage_mesh

__all__ = ["Meshes", "background_group", "chunk", "chunk_mesh", "full_tensor", "mesh_key", "root_mesh"]

_group: Any = None


def background_group() -> Any:
    """A process group of its own for background writes, so they never interleave with
    the training step's collectives (created once, by every rank, on the first async save)."""
    global _group
    if _group is None:
        _group = dist.new_group(backend="gloo")
    return _group


_world_meshes: dict[Any, DeviceMesh] = {}
# keyed by what a mirror must match (device, shape, dim names, ranks), never by id(mesh):
# after a mesh is garbage-collected a new one may reuse its id with another layout
_mirrors: dict[tuple, DeviceMesh] = {}


def mesh_key(mesh: DeviceMesh) -> tuple:
    return (mesh.device_type, tuple(mesh.shape), tuple(mesh.mesh_dim_names or ()),
            tuple(mesh.mesh.flatten().tolist()))


def chunk_mesh(model: nn.Module, device: str, group: Any = None) -> DeviceMesh | None:
    """The 1-D mesh (of ``device``'s type) a sharded checkpoint cuts tensors into row
    chunks over: the ranks holding them — the world (``group``: the world, or its
    background twin), or with pp this rank's stage; ``None`` on one process."""
    if pp_layout(model):  # the cut is local (Replicate -> Shard): no collective runs on it
        return stage_mesh(model, device)
    if world()[1] == 1:
        return None
    group = group or dist.group.WORLD
    if (group, device) not in _world_meshes:
        _world_meshes[group, device] = DeviceMesh.from_group(group, device)
    return _world_meshes[group, device]


def chunk(full: torch.Tensor, mesh: DeviceMesh | None) -> torch.Tensor:
    """This rank's row chunk of an HF tensor, as a DTensor over ``mesh`` (see
    :func:`chunk_mesh`), copied so training may go on changing the source."""
    if mesh is None or mesh.size() == 1 or full.dim() == 0:
        return full.detach().clone()
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dt = DTensor.from_local(full, mesh, [Replicate()], run_check=False)
    local = dt.redistribute(mesh, [Shard(0)]).to_local().clone()
    return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                              stride=full.stride())


def full_tensor(value: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return value.full_tensor() if isinstance(value, DTensor) else value


class Meshes:
    """The meshes a conversion runs its collectives on: the training job's own, or (for
    background saves) mirrors with fresh process groups of the same shape."""

    def __init__(self, model: nn.Module, mirror: bool) -> None:
        self.root = root_mesh(model)
        self.mirrored = mirror and self.root is not None
        self.world_group: Any = background_group() if mirror else None
        self.chunks = chunk_mesh(model, self.root.device_type if self.root is not None else "cpu",
                                  self.world_group)
        if self.mirrored:
            key = mesh_key(self.root)
            if key not in _mirrors:  # created once per mesh, by every rank, in step
                if not self.root.mesh_dim_names:
                    raise TPError("async sharded saves need a DeviceMesh with dim names")
                _mirrors[key] = mirror_mesh(self.root)
            self.root = _mirrors[key]

    def mesh(self, original: DeviceMesh) -> DeviceMesh:
        if not self.mirrored:
            return original
        dims = tuple(original.mesh_dim_names or ())
        return self.root[dims if len(dims) > 1 else dims[0]]

    def tp(self) -> Any:
        if self.root is None or "tp" not in (self.root.mesh_dim_names or ()):
            return TPContext(None)
        return TPContext(self.root["tp"])


def root_mesh(model: nn.Module) -> DeviceMesh | None:
    mesh: DeviceMesh | None = getattr(model, "tpcompile_mesh", None)
    if mesh is None:
        return None
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return root if root is not None else mesh
