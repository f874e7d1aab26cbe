"""Every rank writes its own rows of HF-layout safetensors files: no gather at all.

The translation table says which HF rows each TP rank holds (and, for KV heads copied
onto several ranks, which rank is the first to hold each row).  Rank 0 writes each
file's header and sizes the file; then every writing rank ``pwrite``s the bytes of the
rows it owns at their offsets in the HF row-major layout: one write per run for a
dim-0 shard, one per (outer index, run) for a shard along a later dim.  Of the ranks
holding identical data (data-parallel replicas), only the first writes.  Needs a
filesystem every rank sees (like ``torch.distributed.checkpoint``).
"""

from __future__ import annotations

import math
import mmap
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..errors import TPError
from ..plan.table import TensorMap
from ..runtime.shards import TPContext, tp_local, world
from .safetensors_io import file_layout

__all__ = ["Item", "entry_of", "is_writer", "write_files"]

# (key in the file, HF layout or None for a whole tensor, the live tensor)
Item = tuple[str, TensorMap | None, torch.Tensor]


def is_writer(model: nn.Module) -> bool:
    """First of its data-parallel replicas: coordinate 0 on every mesh dim but "tp" and
    "pp" (each pipeline stage writes its own tensors)."""
    mesh = getattr(model, "tpcompile_mesh", None)
    if mesh is None:
        return world()[0] == 0
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    coords = root.get_coordinate() or []
    names = root.mesh_dim_names or ("tp",) * len(coords)
    return all(c == 0 for n, c in zip(names, coords, strict=True) if n not in ("tp", "pp"))


def entry_of(item: Item, dtype: torch.dtype | None = None) -> tuple[str, torch.dtype, list[int]]:
    """The file-header entry ``(key, dtype, HF shape)`` of ``item``, written as ``dtype``."""
    key, t, tensor = item
    shape = t.shape if t is not None else list(tensor.shape)
    want = tensor.dtype if dtype is None or not tensor.is_floating_point() else dtype
    return key, want, shape


def _pwrite(fd: int, data: torch.Tensor, offset: int) -> None:
    view = memoryview(data.contiguous().reshape(-1).view(torch.uint8).numpy())
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_rows(fd: int, base: int, t: TensorMap, local: torch.Tensor, rank: int) -> None:
    """This rank's owned HF rows of ``t`` (``local`` = its TP shard) at their offsets.

    A dim-0 run is one contiguous ``pwrite``.  A shard along a later dim is a strided
    piece of every outer row (a row-parallel weight: a slice of each matrix row); it is
    copied in one strided assignment through a shared memory map of the tensor's bytes,
    instead of thousands of small writes into pages the other ranks write too.
    """
    d = t.shard_dim
    item = local.element_size()
    inner = math.prod(t.shape[d + 1:]) * item  # bytes of one index along ``d``
    owned = t.owned_rows(rank)
    if d == 0:
        for pos, a, b in owned:
            _pwrite(fd, local[pos:pos + b - a], base + a * inner)
        return
    outer = math.prod(t.shape[:d])
    length = outer * t.shape[d] * inner
    skew = base % mmap.ALLOCATIONGRANULARITY
    with mmap.mmap(fd, length + skew, offset=base - skew) as mm:
        dst = np.frombuffer(mm, dtype=np.uint8, count=length, offset=skew).reshape(outer, -1)
        src = local.contiguous().reshape(-1).view(torch.uint8).numpy().reshape(outer, -1)
        for pos, a, b in owned:
            dst[:, a * inner:b * inner] = src[:, pos * inner:(pos + b - a) * inner]
        del dst  # the map cannot close while a view of it is alive


def write_files(tmp: Path, files: list[tuple[str, list[Item]]], ctx: TPContext, writer: bool,
                dtype: torch.dtype | None = None,
                headers: dict[str, list[tuple[str, torch.dtype, list[int]]]] | None = None) -> int:
    """Write ``files`` (name, items) into ``tmp`` from every rank; returns bytes of data.

    Collective: every rank passes the same files and items in the same order.  With
    ``headers`` (every file's entries, the same on every rank), a rank's items may be a
    part of them: a pipeline stage writes its own tensors into files the stages share.
    """
    rank, _ = world()
    layouts = {}
    total = 0
    for name, items in files:
        entries = headers[name] if headers is not None else [entry_of(i, dtype) for i in items]
        prefix, ranges = file_layout(entries)
        layouts[name] = ranges
        size = max((b for _, b in ranges.values()), default=len(prefix))
        total += size - len(prefix)
        if rank == 0:  # header first, file sized so every rank can write anywhere in it
            with open(tmp / name, "wb") as f:
                f.write(prefix)
                f.truncate(size)
    if dist.is_initialized():
        dist.barrier()
    error: str | None = None
    for name, items in files:
        fd = os.open(tmp / name, os.O_RDWR)  # read access: memory maps need it
        try:
            for item in items:
                key, t, tensor = item
                local = tp_local(tensor)  # collective under FSDP: every rank takes part
                if not writer or error is not None:
                    continue
                _, want, _ = entry_of(item, dtype)
                local = local.to(device="cpu", dtype=want)
                begin, _ = layouts[name][key]
                try:
                    if t is not None and t.sharded and ctx.size > 1:
                        _write_rows(fd, begin, t, local, ctx.rank)
                    elif ctx.rank == 0:
                        _pwrite(fd, local, begin)
                except OSError as err:  # keep taking part in collectives; raised below
                    error = f"{tmp / name}: {key}: {err}"
            os.fsync(fd)
        finally:
            os.close(fd)
    if error is not None:
        raise TPError(error)
    return total
