"""Background saves: a write runs on a daemon thread; its :class:`SaveHandle` waits for it.

Shared by the training checkpoints (``checkpoint.save(..., async_=True)``) and the SMP
front's ``async_save``.  The caller stages what the write needs first (copies of the
tensors, its own process group), so the thread touches nothing training still uses.

Each front's writes run one after another on one long-lived thread, not on a new thread
per save: glibc keeps the memory a thread freed in that thread's malloc arena, and with
a thread per save the resident set of a long run grew by about one save's conversion
buffers at every save (``benchmarks/soak.py``: +1.5 MiB a save per rank on a tiny
Llama; flat with one thread, or with ``MALLOC_ARENA_MAX=1``).  Both fronts finish the
previous save before starting the next, so running them in order changes nothing else.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

__all__ = ["BackgroundSaves", "SaveHandle"]


class SaveHandle:
    """A save in flight (or done).  ``wait()`` returns the path or raises its error."""

    def __init__(self, path: Path, future: Future | None = None) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        if self._future is not None:
            self._future.result(timeout)
        return self.path


class BackgroundSaves:
    """The background saves one front has started and not yet finished, oldest first."""

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._pending: list[SaveHandle] = []
        self._jobs: queue.SimpleQueue[tuple[Callable[[], None], Future, Path]] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def start(self, path: Path, write: Callable[[], None]) -> SaveHandle:
        """Queue ``write()`` for this front's writer thread; the handle's ``wait()``
        re-raises its error."""
        future: Future = Future()
        self._jobs.put((write, future, path))
        if self._worker is None or not self._worker.is_alive():  # the first save (or a forked child's)
            self._worker = threading.Thread(target=self._run, name=self._thread_name, daemon=True)
            self._worker.start()
        handle = SaveHandle(path, future)
        self._pending.append(handle)
        return handle

    def _run(self) -> None:
        """The writer thread: daemon, so a process may exit while it waits for work."""
        while True:
            write, future, path = self._jobs.get()
            try:
                write()
                future.set_result(path)
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(err)
            del write, future  # the job's staged tensors go now, not when the next save comes

    def finish(self, blocking: bool = True) -> list[Path]:
        """Wait for every save in flight (``blocking``), or collect only those done; their
        paths, oldest first.  A failed save re-raises its error here (once: it is dropped)."""
        done = [h for h in self._pending if blocking or h.done()]
        for handle in done:
            self._pending.remove(handle)
        return [h.wait() for h in done]
