"""``python -m tpcompile translate``: any checkpoint tpcompile writes → an HF directory.

A source kind is registered with :func:`register_source`: a function that opens the
checkpoint directory and returns a :class:`Source` (its tensors' HF keys, shapes and
dtypes, and a way to read one full HF tensor at a time).  Translation streams: one
tensor is in memory at a time, written through the safetensors stream writer into an
atomically published directory.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import TPError
from .atomic import atomic_dir
from .hf import (
    FULL_FORMAT,
    INDEX_NAME,
    META_NAME,
    SINGLE_NAME,
    checkpoint_files,
    file_names,
    nbytes,
    parse_size,
    pipelined,
    split_by_size,
)
from .safetensors_io import SliceReader, StreamWriter

__all__ = ["Source", "detect_kind", "register_source", "translate_checkpoint"]

_CONFIG_FILES = ("config.json", "generation_config.json")
_BATCH = 256 * 1024 * 1024  # bytes read from a sharded checkpoint per call


@dataclass
class Source:
    """An open checkpoint: HF ``(key, dtype, shape)`` entries and a reader per key."""

    root: Path
    entries: list[tuple[str, torch.dtype, list[int]]]
    read: Callable[[str], torch.Tensor]
    close: Callable[[], None] = lambda: None


_SOURCES: dict[str, Callable[[Path], Source]] = {}


def register_source(kind: str) -> Callable[[Callable[[Path], Source]], Callable[[Path], Source]]:
    """Register the opener of a checkpoint kind (the ``format`` of its metadata file)."""
    def deco(fn: Callable[[Path], Source]) -> Callable[[Path], Source]:
        _SOURCES[kind] = fn
        return fn
    return deco


def detect_kind(root: Path) -> str:
    meta = root / META_NAME
    if not root.is_dir():
        raise TPError(f"{root} is not a directory")
    if not meta.exists():
        if (root / SINGLE_NAME).exists() or (root / INDEX_NAME).exists():
            return "hf"
        raise TPError(f"{root} is not a tpcompile checkpoint (no {META_NAME}); is the save complete?")
    try:
        return json.loads(meta.read_text())["format"]
    except (ValueError, KeyError) as err:
        raise TPError(f"{meta} is unreadable ({err}); the checkpoint may be incomplete") from None


@register_source(FULL_FORMAT)
@register_source("hf")
def _open_full(root: Path) -> Source:
    where = checkpoint_files(root)
    readers = {f: SliceReader(f) for f in dict.fromkeys(where.values())}
    entries = []
    for key, f in where.items():
        dtype, shape = readers[f].info(key)
        entries.append((key, dtype, shape))

    def close() -> None:
        for r in readers.values():
            r.close()

    return Source(root=root, entries=entries, read=lambda k: readers[where[k]].read(k), close=close)


def _hf_entries(meta: dict[str, Any]) -> tuple[Any, list[tuple[str, torch.dtype, list[int]]]]:
    from ..plan.table import TranslationTable

    table = TranslationTable.from_dict(meta["table"])
    return table, [(k, getattr(torch, table.tensors[k].dtype), table.tensors[k].shape)
                   for k in table.saved_keys()]


@register_source("tpcompile-sharded")
def _open_sharded(root: Path) -> Source:
    """Read each HF tensor whole from the DCP files, one key per call (no process group)."""
    import torch.distributed.checkpoint as dcp

    _, entries = _hf_entries(json.loads((root / META_NAME).read_text()))
    order = {k: i for i, (k, _, _) in enumerate(entries)}
    ready: dict[str, torch.Tensor] = {}

    def read(key: str) -> torch.Tensor:
        if key not in ready:  # one DCP read per batch of up to _BATCH bytes, in file order
            box, size = {}, 0
            for k, d, s in entries[order[key]:]:
                if box and size + nbytes(d, s) > _BATCH:
                    break
                box[f"model/{k}"] = torch.empty(s, dtype=d)
                size += nbytes(d, s)
            dcp.load(box, checkpoint_id=root, no_dist=True)
            ready.update({k.removeprefix("model/"): v for k, v in box.items()})
        return ready.pop(key)

    return Source(root=root, entries=entries, read=read)


@register_source("tpcompile-local")
def _open_local(root: Path) -> Source:
    """Reassemble HF tensors from every rank's file: FSDP pieces concatenated along dim 0
    into each TP shard, TP shards mapped back to HF rows by the translation table."""
    meta = json.loads((root / META_NAME).read_text())
    table, entries = _hf_entries(meta)
    mesh = meta["layout"]["mesh"] or {"tp": 1}
    world = meta["layout"]["world"]
    tp = mesh.get("tp", 1)
    shard = mesh.get("dp_shard", 1)
    stage_size = world // mesh.get("pp", 1)
    # a pipelined model's tensor sits in the files of the stage that wrote it, under its name there
    writers = meta.get("writers", {})
    names = [root / f"rank-{r:05d}.safetensors" for r in range(world)]
    missing = [n.name for n in names if not n.exists()]
    if missing:
        raise TPError(f"{root}: rank files {missing[:4]} are missing (an interrupted save?)")
    readers = [SliceReader(n) for n in names]
    # mesh (pp, dp_replicate, dp_shard, tp), row-major: replica 0 holds every TP shard's pieces
    def rank_of(p: int, s: int, t: int) -> int:
        return p * stage_size + s * tp + t

    def read(key: str) -> torch.Tensor:
        t = table.tensors[key]
        p, name = writers.get(key, (0, key))
        tp_shards = [torch.cat([readers[rank_of(p, s, r)].read(f"model/{name}") for s in range(shard)])
                     if shard > 1 else readers[rank_of(p, 0, r)].read(f"model/{name}") for r in range(tp)]
        return t.to_hf(tp_shards) if t.sharded else tp_shards[0]

    def close() -> None:
        for r in readers:
            r.close()

    return Source(root=root, entries=entries, read=read, close=close)


def _progress(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety, never a dependency
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="translate")


def translate_checkpoint(src: str | os.PathLike, out: str | os.PathLike, *,
                         dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB",
                         progress: bool = True, overwrite: bool = False) -> dict[str, Any]:
    """Convert a tpcompile checkpoint at ``src`` into an HF directory at ``out``.

    Example:
        >>> translate_checkpoint("ckpt/step-1000", "hf-out", dtype=torch.bfloat16)  # doctest: +SKIP
        {'files': 1, 'tensors': 291, 'bytes': 16060522496, ...}
    """
    src, out = Path(src), Path(out)
    kind = detect_kind(src)
    if kind not in _SOURCES:
        raise TPError(f"{src}: checkpoint kind {kind!r} cannot be translated; known: {sorted(_SOURCES)}")
    start = time.perf_counter()
    source = _SOURCES[kind](src)
    try:
        entries = [(k, dtype if dtype is not None and d.is_floating_point else d, s)
                   for k, d, s in source.entries]
        files = split_by_size(entries, [nbytes(d, s) for _, d, s in entries], parse_size(max_shard_size))
        bar = _progress(sum(nbytes(d, s) for _, d, s in entries), progress)
        written = 0
        with atomic_dir(out, overwrite=overwrite) as tmp:
            _copy_config(source.root, tmp, dtype)
            names = file_names(len(files))
            weight_map: dict[str, str] = {}

            def write_all(tensors: Iterator[torch.Tensor]) -> None:
                nonlocal written
                for group, name in zip(files, names, strict=True):
                    with StreamWriter(tmp / name, group) as w:
                        for key, d, s in group:
                            w.write(key, next(tensors))
                            weight_map[key] = name
                            if bar is not None:
                                bar.update(nbytes(d, s))
                        written += w.bytes_written

            # reading the next tensors overlaps with writing the previous ones
            pipelined(write_all, (source.read(k).to(d) for k, d, _ in entries))
            if len(files) > 1:
                index = {"metadata": {"total_size": written}, "weight_map": weight_map}
                (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        if bar is not None:
            bar.close()
    finally:
        source.close()
    return {"kind": kind, "out": str(out), "files": len(files), "tensors": len(entries),
            "bytes": written, "seconds": round(time.perf_counter() - start, 3)}


def _copy_config(root: Path, tmp: Path, dtype: torch.dtype | None) -> None:
    for name in _CONFIG_FILES:
        if (root / name).exists():
            shutil.copyfile(root / name, tmp / name)
    cfg = tmp / "config.json"
    if dtype is not None and cfg.exists():
        data = json.loads(cfg.read_text())
        data["dtype"] = str(dtype).removeprefix("torch.")
        cfg.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
