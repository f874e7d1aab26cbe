"""Shared helpers of the benchmark sections: statistics, result rows, host info.

A section returns a plain dict (JSON-serialisable) built with :func:`section_result`;
each timed quantity is a row built with :func:`row`, so ``run.py`` can render every
section with the same table code.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import platform
import queue as queue_mod
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = ["free_port", "host_info", "quiet_stderr", "row", "section_result", "spawn_ranks",
           "summarize"]


def summarize(samples: Sequence[float]) -> dict[str, float | int]:
    """Median, min, max and inter-quartile range of ``samples`` (needs at least one)."""
    if not samples:
        raise ValueError("summarize() needs at least one sample")
    xs = sorted(float(x) for x in samples)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1],
            "q1": q1, "q3": q3, "n": len(xs)}


def row(name: str, samples: Sequence[float] | None, *, unit: str = "s",
        baseline: float | None = None, note: str = "", error: str | None = None,
        **extra: Any) -> dict[str, Any]:
    """One result row: ``name``, its statistics, ``ratio`` = median / ``baseline``.

    A competitor that could not run gets ``samples=None`` and an ``error`` message, so
    the table still says why it is missing instead of silently dropping it.
    """
    out: dict[str, Any] = {"name": name, "unit": unit, "note": note}
    if samples:
        out.update(summarize(samples))
        out["samples"] = [round(float(x), 6) for x in samples]
        out["ratio"] = out["median"] / baseline if baseline else None
    else:
        out.update(median=None, min=None, max=None, q1=None, q3=None, n=0, samples=[],
                   ratio=None)
    if error:
        out["error"] = error
    out.update(extra)
    return out


def section_result(title: str, rows: list[dict[str, Any]], *, ratio_of: str,
                   notes: Sequence[str] = (), config: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The dict a section's ``run(quick)`` returns.

    ``ratio_of`` explains what the ratio column divides by (e.g. "tpcompile default");
    ``notes`` are free-text findings printed under the table.
    """
    return {"title": title, "ratio_of": ratio_of, "rows": rows, "notes": list(notes),
            "config": dict(config or {})}


def host_info() -> dict[str, Any]:
    """Where the numbers were taken: cores, library versions, date."""
    import torch
    import transformers

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = os.cpu_count()
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")),
                       cpu)
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": affinity,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
    }


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2 (e.g. kineto's C++ line per profiler start/stop)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _rank_main(rank: int, world: int, port: int, timeout_s: float, fn: Callable[..., Any],
               args: tuple, results: Any) -> None:
    """Entry point of one spawned rank: gloo group, one thread, ``fn(rank, *args)``."""
    import torch
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # `world` processes on few cores: one intra-op thread each
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        # Results travel as pickled bytes: torch's queue reducers would share memory
        # that dies with this process.
        results.put((rank, True, pickle.dumps(fn(rank, *args))))
        dist.barrier()  # no rank tears gloo down while its peer still talks
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_ranks(fn: Callable[..., Any], world: int, args: tuple = (), *,
                timeout_s: float = 600.0) -> dict[int, Any]:
    """Run ``fn(rank, *args)`` on ``world`` fresh gloo processes; ``{rank: return value}``.

    ``fn`` must be a module-level function (it is pickled).  A rank that raises, dies
    or outlives ``timeout_s`` makes this raise ``RuntimeError`` with the cause (the
    child's traceback), and the other ranks are terminated instead of left hanging.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, world, port, timeout_s / 2, fn, args, results))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            try:
                rank, ok, payload = results.get(timeout=1.0)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {procs.index(dead[0])} died with exit code "
                                       f"{dead[0].exitcode} before reporting") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{fn.__name__} timed out after {timeout_s:.0f} s "
                                       f"(results from ranks {sorted(got)})") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            got[rank] = pickle.loads(payload)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return got
