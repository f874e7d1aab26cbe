"""Atomic checkpoint directories: all or nothing, the previous checkpoint never touched.

Every save writes into a hidden sibling ``.<name>.partial-<id>`` and renames it into
place only once every file is written and fsynced.  A process killed mid-save leaves a
``.partial`` directory that no loader mistakes for a checkpoint, and whatever was at
``<name>`` before is still there.  Overwriting an existing checkpoint moves the old one
aside (``.<name>.old-<id>``), renames the new one in, then deletes the old one: at
every instant one complete copy exists under a recognizable name.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..errors import TPError

__all__ = ["PARTIAL_RE", "atomic_dir", "distributed_atomic_dir", "fsync_tree"]

PARTIAL_RE = re.compile(r"^\.(?P<name>.+)\.(partial|old)-[0-9a-f]{12}$")


def fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` so a rename publishes durable data."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_partial(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.partial-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    return tmp


def _commit(tmp: Path, final: Path, overwrite: bool) -> None:
    fsync_tree(tmp)
    old: Path | None = None
    if final.exists():
        if not overwrite:
            raise TPError(f"{final} exists; pass overwrite=True or choose another directory")
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:12]}"
        os.rename(final, old)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike, *, overwrite: bool = True) -> Iterator[Path]:
    """Yield a private directory that becomes ``final`` only if the block succeeds.

    Example:
        >>> with atomic_dir("ckpt/step-100") as tmp:                     # doctest: +SKIP
        ...     (tmp / "weights.safetensors").write_bytes(data)
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise TPError(f"{final} exists; pass overwrite=True or choose another directory")
    tmp = _new_partial(final)
    try:
        yield tmp
        _commit(tmp, final, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def distributed_atomic_dir(final: str | os.PathLike, *, overwrite: bool = True,
                           group: Any = None) -> Iterator[Path]:
    """:func:`atomic_dir` shared by every rank (a shared filesystem is assumed).

    The lowest rank of ``group`` (default: the world) creates the private directory and
    tells the others its name; the rename happens only if every rank finished its part,
    and every rank learns the outcome, so an error on any rank fails the save everywhere
    instead of leaving a half checkpoint.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        with atomic_dir(final, overwrite=overwrite) as tmp:
            yield tmp
        return
    final = Path(final)
    rank = dist.get_rank()
    leader = 0 if group is None else min(dist.get_process_group_ranks(group))
    box: list[object] = [str(_new_partial(final)) if rank == leader else None]
    dist.broadcast_object_list(box, src=leader, group=group)
    tmp = Path(str(box[0]))
    error: BaseException | None = None
    try:
        yield tmp
    except BaseException as err:  # noqa: BLE001 - re-raised after the ranks agree
        error = err
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, None if error is None else f"rank {rank}: {type(error).__name__}: {error}",
                           group=group)
    failures = [f for f in flags if f]
    outcome: list[object] = [None]
    if rank == leader:
        if failures:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome[0] = "; ".join(failures)
        else:
            try:
                _commit(tmp, final, overwrite)
            except BaseException as err:  # noqa: BLE001 - every rank must hear of it
                shutil.rmtree(tmp, ignore_errors=True)
                outcome[0] = f"rank {leader}: {type(err).__name__}: {err}"
    dist.broadcast_object_list(outcome, src=leader, group=group)
    if error is not None:
        raise error
    if outcome[0]:
        raise TPError(f"checkpoint save to {final} failed: {outcome[0]}")
