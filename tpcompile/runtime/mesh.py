"""Every device mesh tpcompile uses, built in one place.

:class:`ParallelDims` names the degrees of one layout and builds its mesh
``(dp_replicate, dp_shard, tp)`` over the default process group, TP innermost so a TP
group is ranks ``r*tp .. r*tp + tp-1`` (on GPUs: one node's NVLink island).  The other
meshes are views of it: ``mesh["tp"]`` for tensor parallelism, ``mesh["dp_shard"]`` (or
``["dp_replicate", "dp_shard"]``: HSDP) for FSDP2, and for expert parallelism the 4-D
``(dp_replicate, efsdp, ep, tp)`` unflattening of ``dp_shard`` (:meth:`expert_mesh`).
Background checkpoint saves run their collectives on a :func:`mirror_mesh`: the same
layout over fresh process groups.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..errors import TPError

__all__ = [
    "EXPERT_MESH_DIMS", "MESH_DIMS", "ParallelDims", "data_parallel_rank", "device_type", "mirror_mesh", "stage_group",
    "tp_mesh",
]

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")
EXPERT_MESH_DIMS = ("dp_replicate", "efsdp", "ep", "tp")


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The degrees of one layout; ``dp_replicate x dp_shard x tp`` is the world size.

    Example:
        >>> dims = ParallelDims(dp_shard=2, tp=2)                  # doctest: +SKIP
        >>> mesh = dims.build("cpu"); mesh["tp"].size()
        2
    """

    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    cp: int = 1  # context parallelism: the mesh's dp_shard dim is dp_shard x cp, cp innermost
    pp: int = 1  # pipeline parallelism: the outermost dim, one stage group per pp rank

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.dp_replicate, self.dp_shard * self.cp, self.tp)

    def build(self, device: str) -> DeviceMesh:
        """The ``(dp_replicate, dp_shard, tp)`` mesh over the default process group (with
        pp > 1: this pipeline stage's slice of :meth:`build_pipeline`'s mesh)."""
        return self.build_pipeline(device)[0]

    def build_pipeline(self, device: str) -> tuple[DeviceMesh, DeviceMesh | None]:
        """``(stage mesh, whole mesh)``: the whole mesh is ``(pp, dp_replicate, dp_shard,
        tp)`` with pp outermost (a stage's ranks are consecutive, so TP stays inside a
        node and the pipeline crosses nodes); without pp it is ``None`` and the stage mesh
        the 3-D mesh itself."""
        if self.pp == 1:
            return init_device_mesh(device, self.shape, mesh_dim_names=MESH_DIMS), None
        whole = init_device_mesh(device, (self.pp, *self.shape), mesh_dim_names=("pp", *MESH_DIMS))
        return whole[MESH_DIMS], whole

    def expert_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 4-D ``(dp_replicate, efsdp, ep, tp)`` view of ``mesh``: its ``dp_shard``
        dim split into ``efsdp x ep`` (the EP group: consecutive dp_shard ranks)."""
        shard = mesh["dp_shard"].size()
        if shard % self.ep:
            raise TPError(f"ep={self.ep} must divide dp_shard={shard}")
        return mesh._unflatten("dp_shard", (shard // self.ep, self.ep), ("efsdp", "ep"))

    def context_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 4-D ``(dp_replicate, dp, cp, tp)`` view of ``mesh``: its ``dp_shard`` dim
        (FSDP2 shards over it whole) split into data-parallel shards and CP groups
        (consecutive ranks of one TP rank share a sequence)."""
        return mesh._unflatten("dp_shard", (self.dp_shard, self.cp), ("dp", "cp"))

    @staticmethod
    def data_mesh(mesh: DeviceMesh, hsdp: bool) -> DeviceMesh:
        """FSDP2's mesh: a 2-D (replicate, shard) mesh is HSDP."""
        return mesh["dp_replicate", "dp_shard"] if hsdp else mesh["dp_shard"]


def stage_group(whole: DeviceMesh | None) -> Any:
    """The process group of this rank's pipeline stage: every rank with its pp coordinate
    (``None`` without pp: the world).  Collective: every rank creates every stage's group,
    in the same order."""
    if whole is None:
        return None
    rank, mine = dist.get_rank(), None
    for row in whole.mesh.reshape(whole.mesh.shape[0], -1).tolist():
        group = dist.new_group(row)
        if rank in row:
            mine = group
    return mine


def mirror_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """A mesh of ``mesh``'s shape and dim names over fresh process groups, for
    collectives that run beside training's (a background checkpoint save)."""
    names = tuple(mesh.mesh_dim_names or ())
    # a backend override forces fresh groups: without it a dim spanning the whole world
    # would reuse the default group, which training is using right now
    backend = dist.get_backend()
    return init_device_mesh(mesh.device_type, tuple(mesh.shape), mesh_dim_names=names,
                            backend_override={n: backend for n in names})


def device_type(model: nn.Module) -> str:
    """The device type to build meshes on: CUDA for a CUDA model, the process group's
    backend for a meta model, else ``TPCOMPILE_DEVICE`` (default ``cpu``)."""
    dev = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device.type
    if dev == "meta":  # nothing to read off the model: follow the process group's backend
        return "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return "cuda" if dev == "cuda" else os.environ.get("TPCOMPILE_DEVICE", "cpu")


def tp_mesh(model: nn.Module, tp: int, mesh: DeviceMesh | None) -> DeviceMesh:
    """``transform``'s 1-D TP mesh: ``mesh`` checked, or the ``tp`` dim of the
    ``(1, world/tp, tp)`` layout over the default process group."""
    if mesh is not None:
        if mesh.ndim != 1:
            raise TPError(f"mesh must be a 1-D tensor-parallel DeviceMesh, got {mesh.ndim}-D; pass mesh['tp']")
        if mesh.size() != tp:
            raise TPError(f"mesh has {mesh.size()} ranks but tp={tp}; pass tp={mesh.size()}")
        return mesh
    if not dist.is_available() or not dist.is_initialized():
        raise TPError(
            "tpcompile.transform needs an initialized process group: launch with torchrun and "
            "call torch.distributed.init_process_group() first, or pass mesh=<1-D DeviceMesh>"
        )
    world = dist.get_world_size()
    if world % tp != 0:
        ok = [t for t in range(1, world + 1) if world % t == 0]
        raise TPError(f"world size {world} is not divisible by tp={tp}; tp values that work: {ok}")
    try:
        device = next(model.parameters()).device.type
    except StopIteration:
        device = "cpu"
    device = "cuda" if device == "cuda" else os.environ.get("TPCOMPILE_DEVICE", "cpu")
    return ParallelDims(dp_shard=world // tp, tp=tp).build(device)["tp"]


def data_parallel_rank(mesh: DeviceMesh | nn.Module) -> tuple[int, int]:
    """``(dp rank, dp size)`` of this process on a ``parallelize`` mesh (or model):
    which slice of the global batch this rank should load.

    Example:
        >>> rank, size = tpcompile.data_parallel_rank(model)     # doctest: +SKIP
        >>> local_batch = global_batch.chunk(size)[rank]
    """
    cp = 1
    if isinstance(mesh, nn.Module):
        if not hasattr(mesh, "tpcompile_mesh"):
            raise TPError("this model was not parallelized: call tpcompile.parallelize(model, ...) first")
        context = getattr(mesh, "tpcompile_context", None)
        cp = 1 if context is None else context.size  # a CP group shares its batch
        mesh = mesh.tpcompile_mesh
    rep, shard, _ = mesh.get_coordinate()
    shards = mesh.size(1) // cp
    return rep * shards + shard // cp, mesh.size(0) * shards
