"""Shared helpers of the benchmark sections: statistics, result rows, host info, ranks.

A section returns a plain dict (JSON-serialisable) built with :func:`section_result`;
each timed quantity is a row built with :func:`row`, so ``run.py`` can render every
section with the same table code.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
import statistics
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["SavedBytes", "host_info", "quiet_stderr", "row", "section_result", "spawn_ranks", "summarize"]


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the distinct storages saved for backward that are not parameters: this
    rank's shard of a DTensor, the tensors a wrapper subclass (FP8) holds.

    Example:
        >>> saved = SavedBytes(model)                                  # doctest: +SKIP
        >>> with saved:
        ...     loss = model(input_ids=ids, labels=ids).loss
        >>> saved.total
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {s.data_ptr() for p in model.parameters() for s in _storages(_local(p))}
        self.storages: dict[int, int] = {}
        super().__init__(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        for s in _storages(_local(t)):
            if s.data_ptr() not in self.params:
                self.storages[s.data_ptr()] = s.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind ``t``: its own, or those of the tensors a wrapper subclass holds
    (FP8 tensors, weights FSDP2 gathers in FP8)."""
    if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):
        for name in t.__tensor_flatten__()[0]:
            yield from _storages(getattr(t, name))
        return
    yield t.untyped_storage()


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)  # a DTensor's local shard holds this rank's memory


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


def _without_world(rank: int, world: int, fn: Callable[..., Any], *args: Any) -> Any:
    return fn(rank, *args)


def spawn_ranks(fn: Callable[..., Any], world: int, args: tuple = (), *,
                timeout_s: float = 600.0, collective_timeout_s: float | None = None) -> dict[int, Any]:
    """Run ``fn(rank, *args)`` on ``world`` fresh gloo processes; ``{rank: return value}``.

    ``fn`` must be a module-level function (it is pickled).  A rank that raises, dies
    or outlives ``timeout_s`` makes this raise (``tpcompile.tools.launch.WorkerFailed``,
    a ``RuntimeError``, with the child's traceback), and the other ranks are terminated
    instead of left hanging.  One collective may take ``collective_timeout_s`` (default
    half of ``timeout_s``).  Each rank sees torchrun's environment variables.
    """
    from tpcompile.tools.launch import spawn_local

    values = spawn_local(_without_world, world, fn, *args, timeout=timeout_s, torchrun_env=True,
                         collective_timeout=timeout_s / 2 if collective_timeout_s is None
                         else collective_timeout_s)
    return dict(enumerate(values))
