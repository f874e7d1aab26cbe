"""Run a function on N local CPU processes joined by a gloo process group.

Shared by the CLI's ``demo`` and ``verify``: both check a transformed model against a
single-process copy on a laptop, without torchrun.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["WorkerFailed", "free_port", "spawn_local"]

_COLLECTIVE_TIMEOUT_S = 300


class WorkerFailed(RuntimeError):
    """A spawned rank raised or died; the message carries its traceback or exit code."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the OS chooses it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_local(fn: Callable[..., Any], nprocs: int, *args: Any) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` spawned gloo ranks; return the
    per-rank results in rank order.

    ``fn`` must be a module-level function (it is pickled into fresh interpreters) and
    return picklable values.  Raises :class:`WorkerFailed` if any rank raises or dies.

    Example:
        >>> spawn_local(my_module.check, 2, "llama")     # doctest: +SKIP
        [True, True]
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = free_port()
    try:
        mp.start_processes(_worker, args=(nprocs, port, fn, args, results), nprocs=nprocs,
                           join=True, start_method="spawn")
    except mp.ProcessRaisedException as exc:
        raise WorkerFailed(f"a worker failed:\n{exc}") from None
    except mp.ProcessExitedException as exc:
        raise WorkerFailed(f"a worker died: {exc}") from None
    values = dict(results.get() for _ in range(nprocs))
    return [values[r] for r in range(nprocs)]


def _worker(rank: int, nprocs: int, port: int, fn: Callable[..., Any], args: tuple,
            results: Any) -> None:
    """One spawned rank: join the group, run ``fn``, report ``(rank, value)``."""
    torch.set_num_threads(1)  # nprocs processes share few cores; avoid oversubscription
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=nprocs,
                            timeout=datetime.timedelta(seconds=_COLLECTIVE_TIMEOUT_S))
    try:
        results.put((rank, fn(rank, nprocs, *args)))
        dist.barrier()  # no rank tears gloo down while a peer still has traffic in flight
    finally:
        dist.destroy_process_group()
