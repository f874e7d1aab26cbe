"""Hugging Face format in and out of a transformed model, one tensor at a time.

* :func:`hf_state_dict` — the untransformed model's ``state_dict()`` (same keys, shapes,
  dtypes, values), gathered tensor by tensor onto rank 0 (not of a pipelined model);
* :func:`save_pretrained` — an HF directory (safetensors shards + index + config +
  generation config) that ``transformers.AutoModel*.from_pretrained`` loads without
  tpcompile; nothing is gathered: rank 0 writes each header (known from the translation
  table before any data exists) and every TP rank writes the HF rows it owns (with
  pipeline parallelism, every stage its own tensors: :mod:`.pipelined`);
* :func:`load_hf_weights` — each rank reads only its own rows of each tensor from an
  HF directory (``pread``, no memory map), so a checkpoint loads at any ``tp`` without
  any rank holding the model;
* :func:`from_pretrained` — config → model with parameters on the meta device →
  ``transform`` → :func:`load_hf_weights`.
"""

from __future__ import annotations

import json
import os
import queue
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TPError
from ..plan.table import TensorMap, TranslationTable
from ..runtime.guard import settle
from ..runtime.shards import (
    TPContext,
    assign_tp_local,
    lookup,
    storage,
    tp_context,
    tp_local,
    world,
)
from .atomic import PARTIAL_RE, distributed_atomic_dir
from .parallel_write import Item, entry_of, is_writer, write_files
from .pipelined import (
    Entry,
    StageKeys,
    gather_entries,
    merged_plan,
    pipeline_of,
    stage_keys,
    stored_names,
    whole_table,
)
from .safetensors_io import SliceReader

__all__ = ["FULL_FORMAT", "file_names", "hf_state_dict", "iter_hf_tensors", "load_hf_weights", "nbytes",
           "parse_size", "save_pretrained", "split_by_size", "transformed_part"]

FULL_FORMAT = "tpcompile-full"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
META_NAME = "tpcompile.json"


def transformed_part(model: nn.Module) -> tuple[nn.Module, str]:
    """The module tpcompile transformed inside ``model`` — ``model`` itself, or the base a
    PEFT model wraps (adapters added after transform) — and its prefix in ``model``'s
    state dict."""
    if "tpcompile_table" in model.__dict__ or not hasattr(type(model), "get_base_model"):
        return model, ""  # (PEFT forwards attribute lookups to its base: read the dict)
    base = model.get_base_model()
    if "tpcompile_table" not in base.__dict__:
        return model, ""
    name = next(n for n, m in model.named_modules() if m is base)
    return base, f"{name}."


def table_of(model: nn.Module, *, plain_ok: bool = False) -> TranslationTable:
    """The model's translation table; ``plain_ok``: an untransformed model gets a tp=1
    table (so training checkpoints load into a plain single-process model too)."""
    settle(model)  # modules moved since the last walk (a PEFT merge): the table follows them
    table = getattr(model, "tpcompile_table", None)
    if table is None and plain_ok:
        from ..plan.table import build_table

        return build_table(model, None)
    if table is None:
        raise TPError("this model was not transformed by tpcompile (no model.tpcompile_table); "
                      "call tpcompile.transform(model, tp) first")
    return table


def hf_tensor(t: TensorMap, tensor: torch.Tensor, ctx: TPContext, dst: int | None = None) -> torch.Tensor | None:
    """The HF tensor behind ``tensor`` (a parameter, or optimizer state shaped like one),
    assembled from every TP rank's shard on TP-group rank ``dst`` (``None``: on all of
    them); ``None`` on the ranks that do not receive it.  Collective over the TP group
    (and, under FSDP, the data-parallel dims)."""
    local = tp_local(tensor)
    if not t.sharded or ctx.size == 1:
        return local if dst is None or ctx.rank == dst else None
    local = local.contiguous()
    if dst is None:
        parts = [torch.empty_like(local) for _ in range(ctx.size)]
        dist.all_gather(parts, local, group=ctx.group)
        return t.to_hf(parts)
    parts = [torch.empty_like(local) for _ in range(ctx.size)] if ctx.rank == dst else None
    dist.gather(local, parts, group=ctx.group, group_dst=dst)
    return t.to_hf(parts) if parts is not None else None


def iter_hf_tensors(model: nn.Module, keys: list[str] | None = None, *, rank0_only: bool = True,
                    cpu_offload: bool = True, copy: bool = False) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Yield ``(key, hf_tensor)`` one key at a time; ``None`` on ranks that do not keep it.

    Every rank must iterate to the end (each step is a collective).
    """
    if pipeline_of(model) is not None:  # rank 0 would get its own stages' tensors only
        raise TPError("hf_state_dict / iter_hf_tensors gather onto rank 0, which holds only its pipeline "
                      "stages' tensors: save a pipelined model with model.save_pretrained(dir) (every stage "
                      "writes its own) and read that directory, or load a checkpoint at pp=1")
    table = table_of(model)
    ctx = tp_context(model)
    keys = table.saved_keys() if keys is None else keys
    # with data parallelism, only the TP group holding global rank 0 needs to gather
    wanted = not rank0_only or 0 in ctx.ranks or ctx.size == 1
    keep = not rank0_only or world()[0] == 0
    for key in keys:
        t = table.tensors[key]
        tensor = lookup(model, key)[2]
        if wanted:
            hf = hf_tensor(t, tensor, ctx, 0 if rank0_only else None)
        else:  # still take part in the data-parallel gathers
            tp_local(tensor)
            hf = None
        if not keep or hf is None:
            yield key, None
            continue
        hf = hf.cpu() if cpu_offload else hf
        if copy and hf.data_ptr() == storage(tensor).data_ptr():
            hf = hf.clone()  # never hand out the live parameter
        yield key, hf


def hf_state_dict(model: nn.Module, *, rank0_only: bool = True, cpu_offload: bool = True) -> dict[str, torch.Tensor]:
    """The full state dict of the untransformed model: same keys, shapes, dtypes, values.

    Gathered one tensor at a time; with ``rank0_only`` other ranks return ``{}``.
    Tied weights appear under each of their names, sharing one tensor, as in
    ``model.state_dict()``.

    Example:
        >>> sd = tpcompile.hf_state_dict(model)                          # doctest: +SKIP
        >>> reference.load_state_dict(sd)   # on rank 0
    """
    table = table_of(model)
    out: dict[str, torch.Tensor] = {}
    for key, hf in iter_hf_tensors(model, rank0_only=rank0_only, cpu_offload=cpu_offload, copy=True):
        if hf is not None:
            out[key] = hf
    if not out:
        return out
    return {k: out[t.saved_as] for k, t in table.tensors.items()}


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``"5GB"`` → 5·10⁹ bytes (``GiB`` is binary), as ``transformers`` reads it."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", size.upper())
    if not m:
        raise TPError(f"max_shard_size {size!r} is not a size like '5GB' or '500MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def split_by_size(items: list[Any], sizes: list[int], limit: int) -> list[list[Any]]:
    """Greedy, order-keeping split into files of at most ``limit`` bytes (a tensor
    larger than the limit gets a file of its own), as ``transformers`` shards."""
    files: list[list[Any]] = [[]]
    used = 0
    for item, n in zip(items, sizes, strict=True):
        if files[-1] and used + n > limit:
            files.append([])
            used = 0
        files[-1].append(item)
        used += n
    return files


def file_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    n = torch.empty(0, dtype=dtype).element_size()
    for s in shape:
        n *= s
    return n


# An extra file written with the weights: (file name, [(key, HF layout or None, tensor)]).
ExtraFile = tuple[str, list[Item]]


def save_pretrained(model: nn.Module, out_dir: str | os.PathLike, *, translate_on_save: bool = True,
                    max_shard_size: int | str = "5GB", dtype: torch.dtype | None = None,
                    overwrite: bool = True, extra_files: list[ExtraFile] = (),
                    extra_meta: dict[str, Any] | None = None) -> Path:
    """Write an HF checkpoint directory from a transformed model (all ranks call this).

    ``translate_on_save=True`` (default) writes exactly what ``model.save_pretrained``
    of the untransformed model would: ``from_pretrained`` loads it without tpcompile.
    ``False`` writes tpcompile's full format: the same tensors plus ``tpcompile.json``
    (plan and translation table), restorable at any ``tp``.  No tensor is gathered:
    every TP rank writes the HF rows it holds straight into the files (a filesystem all
    ranks see is needed); a pipelined model's stages each write their own tensors into
    the files of the unsplit model.  The directory appears atomically: an interrupted
    save leaves any previous checkpoint untouched.

    Example:
        >>> tpcompile.save_pretrained(model, "out/final")                # doctest: +SKIP
        >>> AutoModelForCausalLM.from_pretrained("out/final")  # plain transformers
    """
    table = table_of(model)
    keys = stage_keys(model, table)  # with pp: each stage writes its own tensors, once
    headers, files = _weight_files(model, table, keys, dtype, parse_size(max_shard_size))
    extra = []
    for name, items in extra_files:
        header = gather_entries(model, [entry_of(i) for i in items])
        if header:  # a file no stage has entries for is not written
            headers[name] = header
            extra.append((name, items))
    plan = merged_plan(model) if not translate_on_save or extra_meta else None
    ctx = tp_context(model)
    writer = is_writer(model)
    out_dir = Path(out_dir)
    with distributed_atomic_dir(out_dir, overwrite=overwrite) as tmp:
        total = write_files(tmp, files, ctx, writer, dtype, headers)
        write_files(tmp, extra, ctx, writer, headers=headers)
        if world()[0] == 0:
            write_configs(model, tmp, dtype)
            if len(files) > 1:
                weight_map = {k: name for name, _ in files for k, _, _ in headers[name]}
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
            if not translate_on_save or extra_meta:
                meta = {"format": FULL_FORMAT, "plan": plan, "table": keys.table.to_dict(), **(extra_meta or {})}
                (tmp / META_NAME).write_text(json.dumps(meta) + "\n")
    return out_dir


def _weight_files(model: nn.Module, table: TranslationTable, keys: StageKeys, dtype: torch.dtype | None,
                  limit: int) -> tuple[dict[str, list[Entry]], list[tuple[str, list[Item]]]]:
    """``(headers, files)``: every weight file's header entries and the items this rank
    writes into each.  The headers are every stage's entries in the unsplit model's order
    (gathered over the pp group), so the files are the ones the unsplit model writes."""
    mine = {keys.stored[k]: (keys.stored[k], table.tensors[k], lookup(model, k)[2]) for k in keys.writes}
    entries = gather_entries(model, [entry_of(i, dtype) for i in mine.values()], keys.table.saved_keys())
    groups = split_by_size(entries, [nbytes(d, s) for _, d, s in entries], limit)
    headers = dict(zip(file_names(len(groups)), groups, strict=True))
    return headers, [(name, [mine[k] for k, _, _ in group if k in mine]) for name, group in headers.items()]


def pipelined(consume: Callable[[Iterator[Any]], None], produce: Iterator[Any], depth: int = 2) -> None:
    """Run ``consume`` (file writes) on a thread while this thread drives ``produce``
    (gathers: collectives stay on the calling thread).  At most ``depth`` items wait in
    between, so memory stays bounded; ``produce`` is always exhausted, even after the
    writer failed, so every rank's collectives stay matched.  Re-raises the writer's error.
    """
    q: queue.Queue = queue.Queue(maxsize=depth)
    done = object()
    failure: list[BaseException] = []

    def worker() -> None:
        try:
            consume(iter(q.get, done))
        except BaseException as err:  # noqa: BLE001 - re-raised on the calling thread
            failure.append(err)
            while q.get() is not done:  # unblock the producer
                pass

    thread = threading.Thread(target=worker, name="tpcompile-writer", daemon=True)
    thread.start()
    for item in produce:
        if not failure:
            q.put(item)
    q.put(done)
    thread.join()
    if failure:
        raise failure[0]


def write_configs(model: nn.Module, out: Path, dtype: torch.dtype | None = None) -> None:
    """``config.json`` (and ``generation_config.json``) of an HF model, if it has them."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "save_pretrained"):
        config.save_pretrained(out)
        if dtype is not None:
            cfg = json.loads((out / "config.json").read_text())
            cfg["dtype"] = str(dtype).removeprefix("torch.")
            (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(model, "can_generate", lambda: False)():
        gen.save_pretrained(out)


# ---- loading ------------------------------------------------------------------------


def reject_partial(path: Path) -> None:
    """A ``.<name>.partial-<id>`` directory is a save that never completed: refuse it."""
    if PARTIAL_RE.match(path.name):
        raise TPError(f"{path} is not a complete tpcompile checkpoint: it is the partial directory of an "
                      "interrupted save (safe to delete); load the last published checkpoint instead")


def checkpoint_files(path: str | os.PathLike) -> dict[str, Path]:
    """``{tensor key: file}`` of an HF safetensors directory, every file checked."""
    path = Path(path)
    reject_partial(path)
    if not path.is_dir():
        raise TPError(f"{path} is not a checkpoint directory")
    index = path / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as err:
            raise TPError(f"{index} is not a valid safetensors index ({err})") from None
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE_NAME).exists():
        files = [SINGLE_NAME]
    else:
        found = sorted(p.name for p in path.glob("*.safetensors"))
        hint = f" (found {found} but no {INDEX_NAME})" if found else ""
        raise TPError(f"{path} holds no {SINGLE_NAME} or {INDEX_NAME}{hint}; an incomplete save?")
    out: dict[str, Path] = {}
    for name in files:
        f = path / name
        if not f.exists():
            raise TPError(f"{path}: shard file {name} listed in {INDEX_NAME} is missing")
        with SliceReader(f) as r:  # header + size check: truncated files fail here
            for k in r.keys():
                out[k] = f
    return out


def load_hf_weights(model: nn.Module, path: str | os.PathLike, *, strict: bool = True) -> dict[str, Any]:
    """Load an HF safetensors directory into a transformed model, each rank reading only
    its own rows of each tensor.  Parameters on the meta device are materialized.

    Returns ``{"bytes_read", "tensors"}`` for this rank.

    Example:
        >>> with torch.device("meta"):                                   # doctest: +SKIP
        ...     model = AutoModelForCausalLM.from_config(config)
        >>> tpcompile.transform(model, tp=8)
        >>> tpcompile.load_hf_weights(model, "Llama-3-70B/")
    """
    table = table_of(model)
    ctx = tp_context(model)
    where = checkpoint_files(path)
    stored = stored_names(model, table)  # a pipeline stage: its tensors under the unsplit model's names
    known = whole_table(model) or table
    missing = [k for k in table.saved_keys() if stored[k] not in where and table.tensors[k].kind == "param"]
    unexpected = sorted(set(where) - set(known.tensors))
    if strict and (missing or unexpected):
        raise TPError(
            f"{path} does not match {table.model_class}: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} (another architecture, or a legacy layout "
            "this transformers version renames on load: load it once with transformers and re-save)"
        )
    readers: dict[Path, SliceReader] = {}
    loaded = 0
    try:
        for key in table.saved_keys():
            name = stored[key]
            if name not in where:
                continue  # a buffer the checkpoint does not store keeps its own value
            f = where[name]
            r = readers.get(f) or readers.setdefault(f, SliceReader(f))
            local = read_local(r, table.tensors[key], ctx.rank, name)
            assign_tp_local(model, key, local, table.aliases(key))
            loaded += 1
    finally:
        for r in readers.values():
            r.close()
    still_meta = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if still_meta:
        raise TPError(f"{path} left parameters uninitialized on the meta device: {still_meta[:5]}")
    return {"bytes_read": sum(r.bytes_read for r in readers.values()), "tensors": loaded}


def read_local(r: SliceReader, t: TensorMap, rank: int, name: str | None = None) -> torch.Tensor:
    """This TP rank's shard of tensor ``name`` (default ``t.key``) laid out as ``t``."""
    name = name or t.key
    dtype, shape = r.info(name)
    if shape != t.shape:
        raise TPError(f"{r.path}: {name} has shape {shape}, the model expects {t.shape} "
                      "(a checkpoint of another architecture or config?)")
    if not t.sharded:
        return r.read(name)
    runs = t.read_runs(rank)
    local_shape = t.local_shape()
    if sum(b - a for _, a, b in runs) == local_shape[t.shard_dim]:
        # no padding: one read straight into the shard (runs are in local order)
        return r.read(name, t.shard_dim, [(a, b) for _, a, b in runs])
    local = torch.zeros(local_shape, dtype=dtype)  # padding rows stay zero
    for pos, a, b in runs:
        local.narrow(t.shard_dim, pos, b - a).copy_(r.read(name, t.shard_dim, [(a, b)]))
    return local
