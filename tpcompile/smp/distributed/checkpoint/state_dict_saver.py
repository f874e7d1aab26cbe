"""``torch.sagemaker.distributed.checkpoint.state_dict_saver``: (async) DCP saves.

``async_save`` copies the state dict on the calling thread (training may change the
tensors right after it returns) and writes it with ``torch.distributed.checkpoint`` on a
background thread, over a private twin of ``process_group`` (a fresh group with the same
ranks: the write never interleaves with collectives the training step runs on the
original). Like every tpcompile save it is atomic: the files go to a hidden
``.<name>.partial-<id>`` directory renamed into place once every rank of the group is done.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ....checkpoint.atomic import distributed_atomic_dir
from ....checkpoint.background import BackgroundSaves, SaveHandle
from ....errors import TPError
from ...utils.process_group_utils import get_global_ranks
from .state_dict_utils import LocalStateDict

__all__ = ["LAYOUT_FILE", "async_save", "maybe_finalize_async_calls", "save"]

LAYOUT_FILE = "tpcompile-smp.json"  # the layouts of SM_LOCAL state dicts, checked on load

_saves = BackgroundSaves("tpcompile-smp-checkpoint")
_twins: dict[tuple[int, ...], Any] = {}


def _path(checkpoint_id: Any, storage: Any) -> Path:
    if checkpoint_id is None and storage is None:
        raise TPError("pass checkpoint_id=<directory> (or a storage writer/reader with a path)")
    if checkpoint_id is not None:
        return Path(checkpoint_id)
    if not hasattr(storage, "path"):
        raise TPError(f"{type(storage).__name__} has no filesystem path; only file system storage is supported")
    return Path(storage.path)


def group_ranks(process_group: Any, coordinator_rank: int) -> list[int]:
    """The group's global ranks; DCP coordinates on its lowest one, so that must be SMP's
    ``coordinator_rank`` (a global rank)."""
    ranks = get_global_ranks(process_group)
    if dist.get_rank() not in ranks:
        raise TPError(f"this rank ({dist.get_rank()}) is not in the process group {ranks}")
    if coordinator_rank != min(ranks):
        raise TPError(f"coordinator_rank={coordinator_rank}: torch.distributed.checkpoint coordinates on a "
                      f"group's lowest rank; pass coordinator_rank=min(get_global_ranks(group)) = {min(ranks)}")
    return ranks


def _twin(ranks: list[int]) -> Any:
    """A background group with the same ranks as ``ranks`` (collective: every rank calls it,
    and every rank creates every twin any rank needs, in one order)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, tuple(ranks))
    for key in sorted(set(everyone)):
        if key not in _twins:
            _twins[key] = dist.new_group(list(key), backend="gloo")
    return _twins[tuple(ranks)]


def _layouts(state_dict: dict[str, Any]) -> dict[str, Any]:
    return {k: v.layout for k, v in state_dict.items() if isinstance(v, LocalStateDict)}


def _stage(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A private CPU copy of every tensor (sharded and DTensors included)."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    copy = _create_cpu_state_dict(state_dict)
    return _copy_state_dict(state_dict, copy)


def _write(staged: dict[str, Any], layouts: dict[str, Any], path: Path, group: Any, size: int) -> None:
    import torch.distributed.checkpoint as dcp

    with distributed_atomic_dir(path, group=group) as tmp:
        dcp.save(staged, checkpoint_id=tmp, process_group=group, no_dist=size == 1)
        if dist.get_rank() == min(get_global_ranks(group)) and layouts:
            (tmp / LAYOUT_FILE).write_text(json.dumps(layouts) + "\n")


def save(state_dict: dict[str, Any], checkpoint_id: Any = None, storage_writer: Any = None,
         planner: Any = None, process_group: Any = None, coordinator_rank: int = 0) -> Path:
    """Save ``state_dict`` now (every rank of ``process_group`` calls this)."""
    if planner is not None:
        raise TPError("a custom planner is not supported; the default DCP planner is used")
    path = _path(checkpoint_id, storage_writer)
    ranks = group_ranks(process_group, coordinator_rank)
    maybe_finalize_async_calls(blocking=True)
    _write(state_dict, _layouts(state_dict), path, process_group, len(ranks))
    return path


def async_save(state_dict: dict[str, Any], checkpoint_id: Any = None, storage_writer: Any = None,
               planner: Any = None, process_group: Any = None, coordinator_rank: int = 0,
               queue: Any = None, sharded_strategy: Any = None, wait_error_handling: bool = True,
               force_check_all_plans: bool = True, s3_region: str | None = None,
               s3client_config: Any = None) -> SaveHandle:
    """Start saving ``state_dict`` to ``checkpoint_id``; returns once it is copied.

    Every rank of the world calls it at the same time (the background group is created
    collectively); each passes its own ``process_group`` (e.g. its SMP replication group)
    and that group's lowest global rank as ``coordinator_rank``. A previous save still in
    flight is finished first. ``maybe_finalize_async_calls(blocking=True)`` waits for it.

    Example:
        >>> async_save(state_dict, checkpoint_id=path, process_group=group,  # doctest: +SKIP
        ...            coordinator_rank=min(get_global_ranks(group)))
    """
    if planner is not None or queue is not None or sharded_strategy is not None or s3_region is not None \
            or s3client_config is not None:
        raise TPError("async_save supports state_dict, checkpoint_id / storage_writer, process_group and "
                      "coordinator_rank; planners, queues, sharded strategies and S3 are not supported")
    path = _path(checkpoint_id, storage_writer)
    ranks = group_ranks(process_group, coordinator_rank)
    maybe_finalize_async_calls(blocking=True)
    layouts = _layouts(state_dict)
    staged = _stage(state_dict)
    group = _twin(ranks)
    return _saves.start(path, lambda: _write(staged, layouts, path, group, len(ranks)))


def maybe_finalize_async_calls(blocking: bool = True, process_group: Any = None) -> list[Path]:
    """Finish the saves in flight: wait for all (``blocking``) or collect those done.
    Returns the finished checkpoint paths; a failed save re-raises its error here."""
    return _saves.finish(blocking)
