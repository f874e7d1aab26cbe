"""Background saves: a write runs on a daemon thread; its :class:`SaveHandle` waits for it.

Shared by the training checkpoints (``checkpoint.save(..., async_=True)``) and the SMP
front's ``async_save``.  The caller stages what the write needs first (copies of the
tensors, its own process group), so the thread touches nothing training still uses.
"""

from __future__ import annotations

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

    def start(self, path: Path, write: Callable[[], None]) -> SaveHandle:
        """Run ``write()`` on a new daemon thread; the handle's ``wait()`` re-raises its error."""
        future: Future = Future()

        def run() -> None:
            try:
                write()
                future.set_result(path)
            except BaseException as err:  # noqa: BLE001 - handed to whoever waits
                future.set_exception(err)

        threading.Thread(target=run, name=self._thread_name, daemon=True).start()
        handle = SaveHandle(path, future)
        self._pending.append(handle)
        return handle

    def finish(self, blocking: bool = True) -> list[Path]:
        """Wait for every save in flight (``blocking``), or collect only those done; their
        paths, oldest first.  A failed save re-raises its error here (once: it is dropped)."""
        done = [h for h in self._pending if blocking or h.done()]
        for handle in done:
            self._pending.remove(handle)
        return [h.wait() for h in done]
