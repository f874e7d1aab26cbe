"""Getting real weights into a transformed model without any rank holding the model.

* :func:`from_pretrained` — the front door: config → model on the meta device →
  ``transform`` → each rank reads its own rows → buffers no checkpoint stores (rotary
  tables) computed by the model's own init;
* :class:`CheckpointLoader` — ``parallelize(load_from=...)``: the model is built on the
  meta device, sharded, ``to_empty`` allocates only this rank's shards, and
  :func:`~tpcompile.checkpoint.hf.load_hf_weights` fills them: each rank reads
  (``pread``) only the rows of its TP shard and keeps its FSDP piece of them, one tensor
  at a time.  Buffers no checkpoint stores are recomputed by the model's own init.
* :func:`scatter_from_rank0` — SageMaker's ``load_state_dict_from_rank0`` mode: rank 0
  built the model with real weights, the other ranks on meta; rank 0 sends every rank
  its shards, tensor by tensor.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TPError
from ..plan.table import TranslationTable
from ..runtime.materialize import TensorRecord, records
from ..runtime.shards import assign_tp_local, lookup, tp_context, world

__all__ = ["CheckpointLoader", "check_checkpoint_dir", "materialize_buffers", "scatter_from_rank0"]


def materialize_buffers(model: nn.Module, device: str | torch.device = "cpu") -> list[str]:
    """Give buffers left on the meta device real values, computed by the model's own init.

    No checkpoint stores non-persistent buffers (rotary tables, position ids), so a
    model built on the meta device must recompute them.  Hugging Face models do that in
    ``_init_weights``: it runs only on the modules that own such buffers, with every
    parameter marked initialized so loaded weights are never touched.
    """
    owners: dict[str, nn.Module] = {}
    for name, buf in list(model.named_buffers()):
        if buf is not None and buf.device.type == "meta":
            mod_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(mod_name) if mod_name else model
            owner._buffers[attr] = torch.empty_like(buf, device=device)
            owners[mod_name] = owner
    if not owners:
        return []
    init = getattr(model, "_init_weights", None)
    if init is None:
        raise TPError(f"buffers {sorted(owners)} are on the meta device and {type(model).__name__} has "
                      "no _init_weights to compute them; build the model with real buffers")
    for p in model.parameters():
        p._is_hf_initialized = True  # transformers' init helpers skip flagged tensors
    with torch.no_grad():
        for owner in owners.values():
            init(owner)
    return sorted(owners)


def scatter_from_rank0(model: nn.Module, table: TranslationTable,
                       full: dict[str, torch.Tensor] | None) -> None:
    """Fill every rank's shards from rank 0's full tensors (``full`` on rank 0 only).

    Collective over the default group; one tensor in flight at a time.  Buffers are
    broadcast too, so ranks that built the model entirely on meta get them.
    """
    rank, size = world()
    ctx = tp_context(model)
    tp_rank_of = [0] * size
    dist.all_gather_object(tp_rank_of, ctx.rank)
    if rank == 0 and full is None:
        raise TPError("load_state_dict_from_rank0: rank 0 must hold the real weights")
    for key in table.saved_keys():
        t = table.tensors[key]
        _, _, cur = lookup(model, key)
        shape = t.local_shape()
        buf = torch.empty(shape, dtype=cur.dtype, device="cpu")
        if t.sharded:
            parts = None
            if rank == 0:
                src = full.pop(key)
                per_tp = [t.to_local(src.detach().cpu(), r) for r in range(table.tp)]
                parts = [per_tp[tp_rank_of[r]].to(cur.dtype) for r in range(size)]
                del src
            dist.scatter(buf, parts, src=0)
        else:
            if rank == 0:
                buf.copy_(full.pop(key))
            dist.broadcast(buf, src=0)
        assign_tp_local(model, key, buf, table.aliases(key))
    for name, b in list(model.named_buffers()):
        if name in table.tensors:
            continue  # persistent: done above
        tmp = b.detach().cpu().clone() if rank == 0 else torch.empty(b.shape, dtype=b.dtype)
        dist.broadcast(tmp, src=0)
        owner, attr, _ = lookup(model, name)
        owner._buffers[attr] = tmp


def _checkpoint_dir_error(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be read as an HF checkpoint on this rank (``None``: it can)."""
    from . import hf

    meta = Path(path) / hf.META_NAME
    if meta.exists():
        try:
            fmt = json.loads(meta.read_text()).get("format")
        except ValueError:
            fmt = None
        if fmt in ("tpcompile-sharded", "tpcompile-local"):  # training.SHARDED/LOCAL_FORMAT
            return (f"{path} is a tpcompile training checkpoint ({fmt}), not an HF directory: "
                    "parallelize the model first (seed= initializes a meta model, shards only), "
                    "then tpcompile.checkpoint.load(path, model, optimizer); or export it with "
                    "`python -m tpcompile translate` and pass that directory as load_from")
    try:
        hf.checkpoint_files(path)  # every file's header and size: truncated files fail here
    except (TPError, OSError) as err:
        return str(err)
    return None


def check_checkpoint_dir(path: str | os.PathLike) -> None:
    """Raise on every rank if any rank cannot read ``path`` (a rank raising alone would
    leave the others waiting in the next collective)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, _checkpoint_dir_error(path))
    bad = [r for r, e in enumerate(errors) if e is not None]
    if bad:
        raise TPError(f"load_from: cannot read the checkpoint on ranks {bad}: {errors[bad[0]]}")


class CheckpointLoader:
    """Fills a sharded model from an HF checkpoint directory after ``fully_shard``.

    Parameters and the buffers the checkpoint stores are read shard-on-read; the other
    buffers keep their real values (``to_empty`` wipes them, so they are recorded here
    first) or, if built on meta, are recomputed by the model's own init.
    """

    def __init__(self, path: str | os.PathLike, buffers: list[TensorRecord]) -> None:
        self.path, self.buffers = path, buffers

    @classmethod
    def prepare(cls, model: nn.Module, path: str | os.PathLike) -> CheckpointLoader:
        kept = records(model, lambda t, is_param: not is_param)  # keep real buffers only
        return cls(path, [r for r in kept if not r.is_param])

    def run(self, model: nn.Module, device: str) -> dict[str, Any]:
        """Load; returns this rank's ``{"bytes_read", "tensors"}``."""
        from .hf import checkpoint_files, load_hf_weights

        wiped = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
        if wiped:
            model.to_empty(device=device)  # allocates this rank's FSDP shards only
        stats = load_hf_weights(model, self.path)
        if not wiped:
            return stats  # a materialized model: loaded in place, its buffers untouched
        stored = set(checkpoint_files(self.path))
        for rec in self.buffers:
            if rec.fqn in stored:
                continue  # read from the checkpoint, as transformers does
            # real before to_empty: that value; built on meta: back to meta, so that
            # materialize_buffers recomputes it (to_empty left uninitialized memory)
            value = rec.value.to(device) if rec.value is not None else \
                torch.empty(rec.shape, dtype=rec.dtype, device="meta")
            for name in [rec.fqn, *rec.aliases]:
                owner, attr, _ = lookup(model, name)
                owner._buffers[attr] = value
        materialize_buffers(model, device)
        return stats
