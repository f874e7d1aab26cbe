"""Run a function on N local CPU processes joined by a gloo process group.

The project's one launcher: the CLI's ``demo`` and ``verify`` (both check a transformed
model against a single-process copy on a laptop, without torchrun), the test harness
and the benchmarks all spawn their ranks with :func:`spawn_local`.

Ranks start from a fork server where the platform has one: a process that imported
torch and transformers once and forks a fresh rank per request, so a launch pays for
neither the interpreter nor its imports again (a fresh interpreter per rank costs 5-15 s
on a busy 2-core host, mostly importing torch).  Each rank is still a new process: it
takes the launching process's environment, ``sys.path`` and working directory at launch
time, and shares nothing with earlier ranks.
"""

from __future__ import annotations

import datetime
import gc
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["LocalPool", "WorkerFailed", "free_port", "spawn_local"]

_COLLECTIVE_TIMEOUT_S = 300
_POLL_S = 0.2
# what the fork server imports once for every rank it forks (absent ones are skipped)
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "transformers", "transformers.modeling_utils",
            "transformers.modeling_layers", "transformers.masking_utils", "transformers.generation", "tpcompile"]


def _context(interpreter: bool = False) -> Any:
    """Fork-server processes where the platform has them (ranks fork from one interpreter
    that imported :data:`_PRELOAD` once), else (or with ``interpreter``) fresh interpreters
    ("spawn").  Never plain fork: the launching process may hold threads and locks a fork
    would copy mid-use."""
    import torch.multiprocessing as mp

    if interpreter or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts; later calls change nothing
    return ctx


class WorkerFailed(RuntimeError):
    """A spawned rank raised, died or ran out of time.

    ``rank`` is the (lowest) failing rank, or ``None`` if the launch as a whole timed out;
    ``kind`` is ``"assertion"`` (the rank failed an ``assert``), ``"error"`` (it raised
    anything else), ``"died"`` (it exited without reporting) or ``"timeout"``;
    ``traceback`` is the rank's traceback text ("" unless it raised).  The message names
    the rank and carries the traceback.
    """

    def __init__(self, message: str, *, rank: int | None = None, kind: str = "error",
                 traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.kind = kind
        self.traceback = traceback


def free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the OS chooses it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_local(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float | None = None,
                collective_timeout: float | None = None, torchrun_env: bool = False,
                interpreter: bool = False) -> list[Any]:
    """Run ``fn(rank, nprocs, *args)`` on ``nprocs`` spawned gloo ranks; return the
    per-rank results in rank order.

    ``fn`` must be a module-level function (it is pickled into fresh interpreters) and
    return picklable values (they travel pickled, so tensors arrive by value).  The first
    rank to raise or die makes this raise :class:`WorkerFailed`; the other ranks are then
    terminated rather than left blocked in a collective.

    Args:
        timeout: seconds the whole launch may take (``None``: no limit).
        collective_timeout: gloo's timeout of one collective; defaults to ``timeout``, or
            300 s without one.
        torchrun_env: set ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
            ``MASTER_PORT`` in each rank, as torchrun does (for code that reads them).
        interpreter: each rank a new interpreter ("spawn"), not a fork of the preloaded
            server: nothing inherited, as a job's own process (slower to start; for
            measuring a process's own memory).

    Example:
        >>> spawn_local(my_module.check, 2, "llama")     # doctest: +SKIP
        [True, True]
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    if collective_timeout is None:
        collective_timeout = timeout if timeout is not None else _COLLECTIVE_TIMEOUT_S
    payload = pickle.dumps((fn, args))  # a pickling error surfaces here, in the caller
    ctx = _context(interpreter)
    results = ctx.Queue()
    port = free_port()
    procs: list[BaseProcess] = []
    try:
        for rank in range(nprocs):
            proc = ctx.Process(target=_child, daemon=True,
                               args=(rank, nprocs, port, collective_timeout, torchrun_env, payload, results,
                                     dict(os.environ)))
            proc.start()
            procs.append(proc)
        values = _collect(procs, results, timeout)
        for proc in procs:
            proc.join(timeout=30)
        return values
    finally:
        _stop(procs)
        results.close()
        results.join_thread()


def _child(rank: int, nprocs: int, port: int, collective_timeout: float, torchrun_env: bool,
           payload: bytes, results: Any, environ: dict[str, str]) -> None:
    """One spawned rank: join the group, run ``fn``, report ``(rank, ok, pickled data)``."""
    os.environ.clear()  # the launcher's environment now, not the fork server's at its start
    os.environ.update(environ)
    torch.set_num_threads(1)  # nprocs processes share few cores; avoid oversubscription
    reported = False
    try:
        fn, args = pickle.loads(payload)
        if torchrun_env:
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs),
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=nprocs, timeout=datetime.timedelta(seconds=collective_timeout))
        results.put((rank, True, pickle.dumps(fn(rank, nprocs, *args))))
        reported = True
        dist.barrier()  # no rank tears gloo down while a peer still has traffic in flight
    except BaseException as exc:  # everything, even KeyboardInterrupt, must reach the parent
        if not reported:  # (a failed barrier after the report changes no result)
            kind = "assertion" if isinstance(exc, AssertionError) else "error"
            results.put((rank, False, pickle.dumps((kind, traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs: list[BaseProcess], results: Any, timeout: float | None) -> list[Any]:
    """One report per rank, in rank order; fail fast on the first error, crash or timeout."""
    deadline = None if timeout is None else time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < len(procs):
        try:
            rank, ok, data = results.get(timeout=_POLL_S)
        except queue_mod.Empty:
            crashed = {r: p.exitcode for r, p in enumerate(procs) if r not in values and p.exitcode}
            if crashed:
                raise WorkerFailed(f"ranks died without reporting (rank: exit code) {crashed}",
                                   rank=min(crashed), kind="died") from None
            if deadline is not None and time.monotonic() > deadline:
                pending = sorted(set(range(len(procs))) - set(values))
                raise WorkerFailed(f"ranks {pending} did not finish within {timeout:.0f} s",
                                   kind="timeout") from None
            continue
        if not ok:
            kind, text = pickle.loads(data)
            raise WorkerFailed(f"rank {rank} failed:\n{text}", rank=rank, kind=kind, traceback=text)
        values[rank] = pickle.loads(data)
    return [values[r] for r in range(len(procs))]


def _stop(procs: list[BaseProcess]) -> None:
    """Terminate and reap the processes this launch started that are still alive."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


class LocalPool:
    """``nprocs`` spawned gloo ranks kept alive between runs: :meth:`run` is
    :func:`spawn_local` without paying, each time, for fresh interpreters, their imports
    and a new process group (10-60 s a launch on a busy 2-core host).

    Between runs each rank gets back what a fresh process starts with: the environment it
    was spawned with, one intra-op thread, grad mode on, a garbage collection.  A run that
    raises, dies or times out stops the pool (its ranks may be inside a collective); so
    does :meth:`close`.  ``healthy`` is False once stopped, or when a rank holds more than
    half its file-descriptor limit or ``max_rss`` bytes, so a caller can start a new one.

    Example:
        >>> pool = LocalPool(2)                                  # doctest: +SKIP
        >>> pool.run(my_module.check, "llama"), pool.run(my_module.check, "gpt2")
        ([True, True], [True, True])
        >>> pool.close()
    """

    def __init__(self, nprocs: int, *, collective_timeout: float = 1800, max_rss: int = 6 << 30) -> None:
        import torch.multiprocessing as mp

        if nprocs < 1:
            raise ValueError(f"nprocs must be >= 1, got {nprocs}")
        ctx = mp.get_context("spawn")
        self.nprocs, self._max_rss = nprocs, max_rss
        self._tasks = [ctx.Queue() for _ in range(nprocs)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs: list[BaseProcess] = []
        for rank in range(nprocs):
            proc = ctx.Process(target=_pool_child, daemon=True,
                               args=(rank, nprocs, port, collective_timeout, self._tasks[rank], self._results))
            proc.start()
            self._procs.append(proc)
        self._alive, self._worn = True, False

    @property
    def healthy(self) -> bool:
        return self._alive and not self._worn and all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """``fn(rank, nprocs, *args)`` on every rank; the results in rank order (raises
        :class:`WorkerFailed` as :func:`spawn_local` does, stopping the pool)."""
        if not self.healthy:
            raise WorkerFailed("this LocalPool is stopped", kind="died")
        payload = pickle.dumps((fn, args))
        for q in self._tasks:
            q.put(payload)
        try:
            reports = _collect(self._procs, self._results, timeout)
        except BaseException:
            self.close()
            raise
        limit = _fd_limit()
        self._worn = any(r["fds"] > limit // 2 or r["rss"] > self._max_rss for r in reports)
        return [r["value"] for r in reports]

    def close(self) -> None:
        """Stop the ranks (idempotent)."""
        if not self._alive:
            return
        self._alive = False
        for q in self._tasks:
            q.put(None)
        deadline = time.monotonic() + 10
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        _stop(self._procs)
        for q in (*self._tasks, self._results):
            q.close()
            q.join_thread()


def _fd_limit() -> int:
    try:
        import resource

        return int(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    except (ImportError, ValueError, OSError):
        return 1024


def _rank_usage() -> tuple[int, int]:
    """(open file descriptors, resident bytes) of this process, 0 where unknown."""
    try:
        fds = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return fds, rss
    except (OSError, ValueError):
        return 0, 0


def _pool_child(rank: int, nprocs: int, port: int, collective_timeout: float, tasks: Any, results: Any) -> None:
    """One rank of a :class:`LocalPool`: join the group once, then run tasks until ``None``."""
    torch.set_num_threads(1)
    env = dict(os.environ)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=nprocs,
                            timeout=datetime.timedelta(seconds=collective_timeout))
    try:
        while (payload := tasks.get()) is not None:
            reported = False
            try:
                fn, args = pickle.loads(payload)
                value = fn(rank, nprocs, *args)
                fds, rss = _rank_usage()
                results.put((rank, True, pickle.dumps({"value": value, "fds": fds, "rss": rss})))
                reported = True
                dist.barrier()  # the next task starts on every rank after this one ended on all
            except BaseException as exc:  # everything must reach the parent, which then stops the pool
                if not reported:
                    kind = "assertion" if isinstance(exc, AssertionError) else "error"
                    results.put((rank, False, pickle.dumps((kind, traceback.format_exc()))))
            finally:  # what a fresh rank would start the next task with
                os.environ.clear()
                os.environ.update(env)
                torch.set_num_threads(1)
                torch.set_grad_enabled(True)
                gc.collect()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
