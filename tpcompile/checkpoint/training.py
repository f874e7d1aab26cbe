"""Training checkpoints — model + optimizer — in three kinds, all atomic.

* ``sharded``: ``torch.distributed.checkpoint`` files holding every tensor in its **HF
  layout** (the translation table undoes fused / interleaved / replicated / padded TP
  layouts first), cut into one row-chunk per rank of the world.  Because nothing of the
  saving layout survives in the files, a checkpoint reloads bit-exactly at any ``tp``,
  ``dp`` or world size, into a plain single-process model too.
* ``local``: every rank writes exactly the tensors it holds, with no data collectives;
  fastest, and reloadable only at the same layout (checked, with both layouts named).
* ``full``: an HF directory (``from_pretrained`` loads it) plus the optimizer state in
  HF layout, every rank writing the rows it owns, read back shard-on-read.

``save(..., async_=True)`` stages on the calling thread (everything that needs the
training process group or the live tensors) and writes on a background thread over its
own process group; the returned handle's ``wait()`` re-raises any error, and the next
save waits for the previous one.  With ``step=`` the checkpoint goes to
``<root>/step-<step>`` and ``<root>/latest`` is updated only once it is complete.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import TPError
from ..plan.table import TensorMap, TranslationTable
from ..runtime.shards import (
    assign_tp_local,
    lookup,
    shard_like,
    storage,
    tp_context,
    tp_local,
    world,
)
from . import hf
from .atomic import distributed_atomic_dir
from .background import BackgroundSaves, SaveHandle
from .chunks import Meshes, background_group, chunk, chunk_mesh, full_tensor
from .pipelined import (
    StageKeys,
    gather_stages,
    pp_layout,
    stage_keys,
    stored_names,
    whole_table,
)
from .safetensors_io import SliceReader, StreamWriter, read_header

__all__ = ["KINDS", "SaveHandle", "latest", "load", "save", "saved_layout"]

KINDS = ("sharded", "local", "full")
LATEST = "latest"
SHARDED_FORMAT = "tpcompile-sharded"
LOCAL_FORMAT = "tpcompile-local"
OPTIM_FILE = "optimizer.safetensors"


_saves = BackgroundSaves("tpcompile-checkpoint")  # at most one in flight: save() waits first
# ---- what a model + optimizer hold, in HF layout --------------------------------------


def _optim_entries(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                   table: TranslationTable) -> tuple[dict[str, Any], list[tuple[str, str, TensorMap | None]]]:
    """The optimizer's state dict by parameter FQN (state created if still empty) and its
    tensors as ``(fqn, state name, layout or None for per-parameter scalars)``."""
    if optimizer is None:
        return {}, []
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    osd = get_optimizer_state_dict(model, optimizer)
    entries = []
    for fqn, state in osd["state"].items():
        pshape = lookup(model, fqn)[2].shape
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                shaped = value.dim() > 0 and value.shape == pshape
                entries.append((fqn, name, table.tensors[fqn] if shaped else None))
    return osd, entries


def _param_groups(osd: dict[str, Any]) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in osd.get("param_groups", [])]


def _set_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any], entries: list,
                   groups: list[dict[str, Any]], value_of: Callable[[str, str, TensorMap | None], torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    for fqn, name, t in entries:
        cur = osd["state"][fqn][name]
        osd["state"][fqn][name] = shard_like(cur, value_of(fqn, name, t)) if t is not None \
            else value_of(fqn, name, None).to(cur.dtype)
    if len(groups) != len(osd["param_groups"]):
        raise TPError(f"the checkpoint has {len(groups)} optimizer param groups, the optimizer "
                      f"{len(osd['param_groups'])}")
    for g, saved in zip(osd["param_groups"], groups, strict=True):
        g.update(saved)
    set_optimizer_state_dict(model, optimizer, osd)


def _stored_optim(model: nn.Module, stored: dict[str, str], entries: list) -> list[list]:
    """The optimizer entries of the whole model, ``[fqn, state name, shaped]`` under the
    names a checkpoint stores them (every pipeline stage's: collective over the pp group)."""
    out: dict[tuple[str, str], list] = {}
    for stage in gather_stages(model, [[stored.get(f, f), n, t is not None] for f, n, t in entries]):
        for f, n, shaped in stage:
            out.setdefault((f, n), [f, n, shaped])
    return list(out.values())


def _meta(kind: str, model: nn.Module, keys: StageKeys, osd: dict[str, Any],
          entries: list, extra: dict[str, Any] | None) -> dict[str, Any]:
    meta = {"format": kind, "table": keys.table.to_dict(), "param_groups": _param_groups(osd),
            "optim": _stored_optim(model, keys.stored, entries), "layout": _layout(model),
            # the parallelize layout it trained at, as information (load reshards to any)
            "tpcompile_layout": getattr(model, "tpcompile_layout", None), "extra": extra or {}}
    if pp_layout(model):  # which stage's files hold each tensor (translating a local checkpoint)
        meta["writers"] = {name: list(w) for name, w in keys.writer.items()}
    if kind != "tpcompile-full" and world()[0] == 0:
        meta["configs"] = _configs(model)
    return meta


def _write_meta(tmp: Path, meta: dict[str, Any]) -> None:
    # config files let `translate` produce a complete HF directory later
    for name, text in meta.pop("configs", {}).items():
        (tmp / name).write_text(text)
    (tmp / hf.META_NAME).write_text(json.dumps(meta) + "\n")


def _configs(model: nn.Module) -> dict[str, str]:
    """The model's HF config files as text, captured while staging."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        hf.write_configs(model, Path(d))
        return {p.name: p.read_text() for p in Path(d).iterdir()}


def _layout(model: nn.Module) -> dict[str, Any]:
    mesh: DeviceMesh | None = getattr(model, "tpcompile_mesh", None)
    _, size = world()
    if mesh is None:
        return {"world": size, "mesh": {}}
    names = mesh.mesh_dim_names or ("tp",)
    if mesh.ndim == 1:
        return {"world": size, "mesh": {"dp": size // mesh.size(), names[0]: mesh.size()}}
    layout = {"world": size, "mesh": {**pp_layout(model), **dict(zip(names, mesh.shape, strict=True))}}
    ep = getattr(getattr(model, "tpcompile_parallel", None), "ep", 1)
    if ep > 1:  # expert parallelism splits dp_shard: another owner of each expert row
        layout["mesh"]["ep"] = ep
    return layout


# ---- sharded (DCP, HF layout) ---------------------------------------------------------


@dataclass
class _Piece:
    """One tensor as this rank holds it, copied: enough to rebuild its DTensor later."""

    name: str  # "model/<key>" or "optim/<fqn>/<state>"
    layout: TensorMap | None  # HF layout; None for per-parameter scalars (AdamW's step)
    local: torch.Tensor
    placements: tuple | None = None
    mesh: DeviceMesh | None = None
    shape: torch.Size | None = None
    stride: tuple[int, ...] | None = None


def _snapshot(name: str, layout: TensorMap | None, value: torch.Tensor) -> _Piece:
    from torch.distributed.tensor import DTensor

    if not isinstance(value, DTensor):
        return _Piece(name, layout, value.detach().clone())
    return _Piece(name, layout, value.to_local().detach().clone(), tuple(value.placements),
                  value.device_mesh, value.shape, value.stride())


@dataclass
class _Staged:
    pieces: list[_Piece]
    meshes: Meshes


def _stage_sharded(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                   extra: dict | None) -> tuple[list[_Piece], dict[str, Any]]:
    """Copy what this rank writes (no tensor collectives; with pp the stages exchange
    their metadata): cheap, so async saves block briefly."""
    table = hf.table_of(model, plain_ok=True)
    keys = stage_keys(model, table)  # with pp: each tensor under its unsplit name, by one stage
    pieces = [_snapshot(f"model/{keys.stored[k]}", table.tensors[k], lookup(model, k)[2]) for k in keys.writes]
    osd, entries = _optim_entries(model, optimizer, table)
    written = keys.written()
    pieces += [_snapshot(f"optim/{keys.stored[f]}/{n}", t, osd["state"][f][n]) for f, n, t in entries
               if keys.stored[f] in written]
    return pieces, _meta(SHARDED_FORMAT, model, keys, osd, entries, extra)


def _to_hf_chunks(pieces: list[_Piece], meshes: Meshes) -> dict[str, Any]:
    """Each piece → its HF tensor → this rank's row chunk (collectives on ``meshes``)."""
    from torch.distributed.tensor import DTensor

    ctx = meshes.tp()
    state: dict[str, Any] = {}
    for p in pieces:
        value = p.local
        if p.placements is not None:
            value = DTensor.from_local(p.local, meshes.mesh(p.mesh), p.placements, run_check=False,
                                       shape=p.shape, stride=p.stride)
        full = hf.hf_tensor(p.layout, value, ctx) if p.layout is not None else tp_local(value)
        state[p.name] = chunk(full, meshes.chunks)
        p.local = torch.empty(0)  # free the snapshot as soon as it is converted
    return state


def _write_sharded(state: dict[str, Any], meta: dict[str, Any], tmp: Path, group: Any) -> None:
    import torch.distributed.checkpoint as dcp

    rank, size = world()
    if isinstance(state, _Staged):
        state = _to_hf_chunks(state.pieces, state.meshes)
    dcp.save(state, checkpoint_id=tmp, process_group=group, no_dist=size == 1)
    if rank == 0:
        _write_meta(tmp, meta)


def _load_sharded(path: Path, meta: dict[str, Any], model: nn.Module,
                  optimizer: torch.optim.Optimizer | None) -> None:
    import torch.distributed.checkpoint as dcp

    table = hf.table_of(model, plain_ok=True)
    ctx = tp_context(model)
    _check_same_model(path, TranslationTable.from_dict(meta["table"]), whole_table(model) or table)
    stored = stored_names(model, table)  # a pipeline stage reads its tensors under their unsplit names
    osd, entries = _optim_entries(model, optimizer, table)
    _check_same_optimizer(path, meta, _stored_optim(model, stored, entries))
    mesh = chunk_mesh(model, "cpu")
    readers: dict[str, list[str]] = {}  # stored name -> the local keys it loads into (a tie's copies)
    for key in table.saved_keys():
        readers.setdefault(stored[key], []).append(key)
    state: dict[str, Any] = {}
    for name, (key, *_) in readers.items():
        t = table.tensors[key]
        state[f"model/{name}"] = chunk(torch.empty(t.shape, dtype=getattr(torch, t.dtype)), mesh)
    for fqn, name, t in entries:
        cur = osd["state"][fqn][name]
        state[f"optim/{stored[fqn]}/{name}"] = chunk(torch.empty(t.shape, dtype=cur.dtype), mesh) \
            if t is not None else torch.empty((), dtype=cur.dtype)
    _, size = world()
    dcp.load(state, checkpoint_id=path, no_dist=size == 1)
    for name, keys in readers.items():
        full = full_tensor(state.pop(f"model/{name}"))
        for key in keys:
            assign_tp_local(model, key, table.tensors[key].to_local(full, ctx.rank), table.aliases(key))
    if optimizer is not None:
        def value_of(fqn: str, name: str, t: TensorMap | None) -> torch.Tensor:
            full = full_tensor(state[f"optim/{stored[fqn]}/{name}"])
            return t.to_local(full, ctx.rank) if t is not None else full
        _set_optimizer(model, optimizer, osd, entries, meta["param_groups"], value_of)


def _check_same_model(path: Path, saved: TranslationTable, table: TranslationTable) -> None:
    want = {k: table.tensors[k].shape for k in table.saved_keys()}
    have = {k: saved.tensors[k].shape for k in saved.saved_keys()}
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    wrong = [f"{k}: {have[k]} vs {want[k]}" for k in want if k in have and have[k] != want[k]]
    if missing or unexpected or wrong:
        raise TPError(f"{path} holds a different model ({saved.model_class}): missing {missing[:3]}, "
                      f"unexpected {unexpected[:3]}, shape mismatches {wrong[:3]}")


def _check_same_optimizer(path: Path, meta: dict[str, Any], entries: list) -> None:
    """``entries``: the whole model's, as :func:`_stored_optim` names them."""
    saved = {(f, n) for f, n, _ in meta.get("optim", [])}
    if entries and not saved:
        raise TPError(f"{path} holds no optimizer state; pass optimizer=None to load the model only")
    if entries and saved != {(f, n) for f, n, _ in entries}:
        raise TPError(f"{path}: the optimizer state does not match this optimizer (another optimizer "
                      "class or parameter set?); pass optimizer=None to load the model only")


# ---- local (per rank, same layout) ----------------------------------------------------


def _local_name(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def _stage_local(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 extra: dict | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    def mine(v: torch.Tensor) -> torch.Tensor:
        return storage(v).detach().clone()

    table = hf.table_of(model, plain_ok=True)
    keys = stage_keys(model, table)  # a rank file holds what the rank holds, under its own names
    tensors = {f"model/{k}": mine(lookup(model, k)[2]) for k in table.saved_keys()}
    osd, entries = _optim_entries(model, optimizer, table)
    for fqn, name, _ in entries:
        tensors[f"optim/{fqn}/{name}"] = mine(osd["state"][fqn][name])
    return tensors, _meta(LOCAL_FORMAT, model, keys, osd, entries, extra)


def _write_local(tensors: dict[str, torch.Tensor], meta: dict[str, Any], tmp: Path, group: Any) -> None:
    rank, _ = world()
    with StreamWriter(tmp / _local_name(rank), [(k, v.dtype, list(v.shape)) for k, v in tensors.items()]) as w:
        for k, v in tensors.items():
            w.write(k, v)
    if rank == 0:
        _write_meta(tmp, meta)


def _load_local(path: Path, meta: dict[str, Any], model: nn.Module,
                optimizer: torch.optim.Optimizer | None) -> None:
    layout = _layout(model)
    table = hf.table_of(model, plain_ok=True)
    if meta["layout"] != layout or meta["table"]["tp"] != table.tp:
        raise TPError(f"{path} is a local checkpoint of layout {meta['layout']}, this job runs "
                      f"{layout}; local checkpoints reload only at the layout that wrote them: "
                      "save with kind='sharded' to change layouts")
    rank, _ = world()
    f = path / _local_name(rank)
    if not f.exists():
        raise TPError(f"{path}: this rank's shard {f.name} is missing (an interrupted save?)")
    osd, entries = _optim_entries(model, optimizer, table)
    _check_same_optimizer(path, meta, _stored_optim(model, stored_names(model, table), entries))
    with SliceReader(f) as r:
        for key in table.saved_keys():
            _, _, cur = lookup(model, key)
            with torch.no_grad():
                storage(cur).copy_(r.read(f"model/{key}"))
        if optimizer is not None:
            from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

            for fqn, name, _ in entries:
                storage(osd["state"][fqn][name]).copy_(r.read(f"optim/{fqn}/{name}"))
            for g, saved in zip(osd["param_groups"], meta["param_groups"], strict=True):
                g.update(saved)
            set_optimizer_state_dict(model, optimizer, osd)


# ---- full (HF directory + optimizer in HF layout) -------------------------------------


def _save_full(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
               extra: dict | None, overwrite: bool) -> None:
    table = hf.table_of(model)
    keys = stage_keys(model, table)
    osd, entries = _optim_entries(model, optimizer, table)
    written = keys.written()  # with pp: each stage writes its own state, a tie's once
    items = [(f"{keys.stored[fqn]}/{name}", t, osd["state"][fqn][name]) for fqn, name, t in entries
             if keys.stored[fqn] in written]
    hf.save_pretrained(model, path, overwrite=overwrite, extra_files=[(OPTIM_FILE, items)],
                       extra_meta=_meta("tpcompile-full", model, keys, osd, entries, extra))


def _load_full(path: Path, meta: dict[str, Any], model: nn.Module,
               optimizer: torch.optim.Optimizer | None) -> None:
    hf.load_hf_weights(model, path)
    if optimizer is None:
        return
    table = hf.table_of(model)
    stored = stored_names(model, table)
    osd, entries = _optim_entries(model, optimizer, table)
    _check_same_optimizer(path, meta, _stored_optim(model, stored, entries))
    rank = tp_context(model).rank
    read_header(path / OPTIM_FILE)
    with SliceReader(path / OPTIM_FILE) as r:
        def value_of(fqn: str, name: str, t: TensorMap | None) -> torch.Tensor:
            key = f"{stored[fqn]}/{name}"
            return hf.read_local(r, t, rank, key) if t is not None else r.read(key)
        _set_optimizer(model, optimizer, osd, entries, meta["param_groups"], value_of)


# ---- front doors ----------------------------------------------------------------------


def latest(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under ``root`` (``None`` if there is none)."""
    pointer = Path(root) / LATEST
    if not pointer.exists():
        return None
    return Path(root) / pointer.read_text().strip()


def _publish_latest(root: Path, name: str) -> None:
    tmp = root / f".{LATEST}.{os.getpid()}.{threading.get_ident()}"
    tmp.write_text(name + "\n")
    os.replace(tmp, root / LATEST)  # atomic: readers see the old or the new name


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         kind: str = "sharded", async_: bool = False, step: int | None = None,
         extra: dict[str, Any] | None = None, overwrite: bool = True) -> SaveHandle:
    """Save ``model`` (and ``optimizer``) as a ``kind`` checkpoint; every rank calls this.

    Args:
        path: the checkpoint directory, or with ``step`` the root holding
            ``step-<step>/`` directories and the ``latest`` pointer.
        kind: ``"sharded"`` (reshards on load), ``"local"`` (same layout only) or
            ``"full"`` (HF directory + optimizer).
        async_: return at once after staging; the write continues in the background.
        extra: JSON-able data stored with the checkpoint (``load`` returns it).

    Example:
        >>> h = tpcompile.checkpoint.save("ckpt", model, opt, step=100, async_=True)  # doctest: +SKIP
        >>> ...  # train on
        >>> h.wait()
    """
    if kind not in KINDS:
        raise TPError(f"checkpoint kind must be one of {KINDS}, got {kind!r}")
    model = hf.transformed_part(model)[0]  # a PEFT model around a transformed one: its base
    _saves.finish()  # one save at a time; a failed one surfaces here
    root = Path(path)
    final = root / f"step-{step:08d}" if step is not None else root
    if kind == "full":
        if async_:
            raise TPError("async saves are for kind='sharded' or 'local'; a full save writes from the live parameters")
        _save_full(final, model, optimizer, extra, overwrite)
        if step is not None and world()[0] == 0:
            _publish_latest(root, final.name)
        return SaveHandle(final)
    stage, write = (_stage_sharded, _write_sharded) if kind == "sharded" else (_stage_local, _write_local)
    data, meta = stage(model, optimizer, extra)
    if kind == "sharded":  # layout conversion runs where the write runs, on its own groups if async
        data = _Staged(data, Meshes(model, mirror=async_ and world()[1] > 1))

    def job(group: Any) -> None:
        with distributed_atomic_dir(final, overwrite=overwrite, group=group) as tmp:
            write(data, meta, tmp, group)
        if step is not None and world()[0] == 0:
            _publish_latest(root, final.name)

    if not async_:
        job(None)
        return SaveHandle(final)
    group = background_group() if world()[1] > 1 else None
    return _saves.start(final, lambda: job(group))


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` (a directory, or a root with ``latest``).

    Sharded and full checkpoints load at any layout; a local one only at its own.
    Returns the ``extra`` data saved with it.
    """
    model = hf.transformed_part(model)[0]  # a PEFT model around a transformed one: its base
    path, meta = _read_meta(path)
    loaders = {SHARDED_FORMAT: _load_sharded, LOCAL_FORMAT: _load_local, "tpcompile-full": _load_full}
    if meta.get("format") not in loaders:
        raise TPError(f"{path}: unknown checkpoint format {meta.get('format')!r}")
    loaders[meta["format"]](path, meta, model, optimizer)
    return meta.get("extra", {})


def saved_layout(path: str | os.PathLike) -> dict[str, Any] | None:
    """The layout the model of a :func:`save` checkpoint ran at: its
    ``model.tpcompile_layout`` when saved (the parallelize keywords, label, source and,
    chosen by ``layout="auto"``, the search's inputs and prediction); ``None`` for a
    checkpoint of an earlier version.  Information only: :func:`load` reshards sharded and
    full checkpoints to whatever layout the loading model runs at.

    Example:
        >>> tpcompile.checkpoint.saved_layout("ckpt")["label"]            # doctest: +SKIP
        'tp2 dp_shard4 ac'
        >>> model = tpcompile.parallelize(model, layout=saved_layout("ckpt")["parallelize"])
    """
    return _read_meta(path)[1].get("tpcompile_layout")


def _read_meta(path: str | os.PathLike) -> tuple[Path, dict[str, Any]]:
    """The checkpoint directory (a root's ``latest``) and its metadata, checked complete."""
    path = Path(path)
    if (path / LATEST).exists() and not (path / hf.META_NAME).exists():
        path = latest(path)
    hf.reject_partial(path)
    meta_file = path / hf.META_NAME
    if not meta_file.exists():
        raise TPError(f"{path} is not a complete tpcompile checkpoint (no {hf.META_NAME}); "
                      "an interrupted save leaves only a hidden .partial directory")
    return path, json.loads(meta_file.read_text())
