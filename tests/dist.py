"""Run a function on ``N`` real CPU processes joined by a gloo process group.

``run_distributed(fn, world_size, *args)`` spawns ``world_size`` fresh interpreters
(start method "spawn", so nothing is inherited by fork), initializes
``torch.distributed`` with the gloo backend over TCP on 127.0.0.1 in each, calls
``fn(rank, world_size, *args)`` and returns the per-rank return values in rank
order.  An exception on any rank is re-raised in the parent with the child's
traceback text: ``AssertionError`` if the child failed an assertion (so pytest
reports it as a test failure), ``RuntimeError`` otherwise.

``fn`` and ``args`` are pickled, so ``fn`` must be a module-level function of an
importable module (e.g. a test module, whose directory is on ``sys.path``).

``run_cases(world_size, cases)`` runs many named cases in that one launch (a launch
costs ~10-20 s of interpreter start-up and imports, usually more than the case itself);
each test then reads its own case from the result and fails with the case's name.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["CaseResults", "free_port", "global_step", "kill_at_marker", "run_cases", "run_distributed"]

_TESTS_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _TESTS_DIR.parent
_POLL_SECONDS = 0.2


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _export_import_path() -> None:
    """Make the repo root and tests dir importable in children.

    Spawned children already receive the parent's ``sys.path``, but ``PYTHONPATH``
    also covers interpreters that re-derive it (and anything they spawn in turn).
    """
    wanted = [str(_REPO_ROOT), str(_TESTS_DIR)]
    current = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    missing = [p for p in wanted if p not in current]
    if missing:
        os.environ["PYTHONPATH"] = os.pathsep.join(missing + current)
    for path in reversed(wanted):
        if path not in sys.path:
            sys.path.insert(0, path)


def _child(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    payload: bytes,
    results: Any,
) -> None:
    """Entry point of each spawned process; reports ``(rank, ok, data)`` on ``results``.

    Results are pickled to bytes with plain ``pickle`` so tensors travel by value:
    torch's queue reducers would share memory that dies with this process.
    """
    torch.set_num_threads(1)  # N processes on few cores: avoid oversubscription
    try:
        fn, args = pickle.loads(payload)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args)
        results.put((rank, True, pickle.dumps(value)))
    except BaseException as exc:  # everything, even KeyboardInterrupt, must reach the parent
        kind = "assertion" if isinstance(exc, AssertionError) else "error"
        results.put((rank, False, pickle.dumps((kind, traceback.format_exc()))))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _stop(procs: list[BaseProcess]) -> None:
    """Terminate and reap the processes this helper started that are still alive."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)


def _raise_child_failure(rank: int, kind: str, text: str) -> None:
    message = f"rank {rank} failed:\n{text}"
    if kind == "assertion":
        raise AssertionError(message)
    raise RuntimeError(message)


def _poll(results: Any) -> tuple[int, bool, bytes] | None:
    """Next report from a child, or ``None`` if none arrived within the poll interval."""
    try:
        return results.get(timeout=_POLL_SECONDS)
    except queue_mod.Empty:
        return None


def _check_progress(
    procs: list[BaseProcess], reported: set[int], deadline: float, timeout: float
) -> None:
    """Raise if a rank died without reporting, or if the run is past its deadline."""
    crashed = {r: p.exitcode for r, p in enumerate(procs) if r not in reported and p.exitcode}
    if crashed:
        raise RuntimeError(f"ranks died without reporting (rank: exit code) {crashed}")
    if time.monotonic() > deadline:
        pending = sorted(set(range(len(procs))) - reported)
        raise TimeoutError(f"ranks {pending} did not finish within {timeout:.0f} s")


def _collect(procs: list[BaseProcess], results: Any, world_size: int, timeout: float) -> list[Any]:
    """Wait for one report per rank; fail fast on the first error, crash or timeout."""
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    while len(values) < world_size:
        report = _poll(results)
        if report is None:
            _check_progress(procs, set(values), deadline, timeout)
            continue
        rank, ok, data = report
        if not ok:
            _raise_child_failure(rank, *pickle.loads(data))
        values[rank] = pickle.loads(data)
    return [values[r] for r in range(world_size)]


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    Returns the list of per-rank return values (each must be picklable).  Raises the
    first child failure in the parent; remaining children are terminated rather than
    left blocked in a collective.  ``timeout`` (seconds) bounds both the whole run and
    each gloo collective.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _export_import_path()
    payload = pickle.dumps((fn, args))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs: list[BaseProcess] = []
    try:
        for rank in range(world_size):
            proc = ctx.Process(
                target=_child,
                args=(rank, world_size, port, timeout, payload, results),
                daemon=True,
            )
            proc.start()
            procs.append(proc)
        values = _collect(procs, results, world_size, timeout)
        for proc in procs:
            proc.join(timeout=30)
        return values
    finally:
        _stop(procs)
        results.close()
        results.join_thread()


def _run_case(rank: int, world_size: int, case: tuple) -> tuple[bool, Any]:
    """``(True, value)`` of one case on this rank, or ``(False, (kind, traceback))``."""
    fn, *args = case
    try:
        return True, fn(rank, world_size, *args)
    except Exception as exc:  # recorded per case: the other cases still run and report
        kind = "assertion" if isinstance(exc, AssertionError) else "error"
        return False, (kind, traceback.format_exc())


def _cases_child(rank: int, world_size: int, cases: dict[str, tuple]) -> dict[str, tuple[bool, Any]]:
    """Every case in order on this rank; a barrier after each keeps the ranks in step.

    A case that failed on one rank only may leave the others inside one of its
    collectives: the barrier then fails (or times out), and the cases after it are
    reported as not run rather than run out of step.
    """
    out: dict[str, tuple[bool, Any]] = {}
    names = list(cases)
    for i, name in enumerate(names):
        out[name] = _run_case(rank, world_size, cases[name])
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - any failure here means the ranks diverged
            why = f"not run: the ranks were out of step after case {name!r}\n{traceback.format_exc()}"
            out.update({rest: (False, ("error", why)) for rest in names[i + 1:]})
            break
    return out


class CaseResults:
    """Per-rank results of :func:`run_cases`, read one case at a time.

    ``results[name]`` is the list of that case's per-rank return values; if the case
    raised on any rank, reading it raises instead (``AssertionError`` for a failed
    assertion), naming the case and the rank and carrying the child's traceback.
    """

    def __init__(self, per_rank: list[dict[str, tuple[bool, Any]]]) -> None:
        self._per_rank = per_rank

    def __contains__(self, name: str) -> bool:
        return name in self._per_rank[0]

    def __getitem__(self, name: str) -> list[Any]:
        values = []
        for rank, cases in enumerate(self._per_rank):
            if name not in cases:
                raise KeyError(f"no case {name!r}; cases: {sorted(cases)}")
            ok, value = cases[name]
            if not ok:
                kind, text = value
                error = AssertionError if kind == "assertion" else RuntimeError
                raise error(f"case {name!r} failed on rank {rank}:\n{text}")
            values.append(value)
        return values


def run_cases(
    world_size: int, cases: dict[str, tuple], *, timeout: float = 300
) -> CaseResults:
    """Run named cases ``{name: (fn, *args)}`` in ONE launch of ``world_size`` processes.

    Every rank calls ``fn(rank, world_size, *args)`` for each case, in order. A case
    that raises is recorded and the next case still runs, so one broken case fails
    only the tests that read it.  ``timeout`` bounds the whole launch.

    Example::

        @pytest.fixture(scope="module")
        def world2() -> CaseResults:
            return run_cases(2, {"generate": (_generate,), "llama": (_equivalence, "llama")})

        def test_generate(world2: CaseResults) -> None:
            for want, got in world2["generate"]:  # raises with the case name if it failed
                assert got == want
    """
    return CaseResults(run_distributed(_cases_child, world_size, cases, timeout=timeout))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (for subprocess jobs)."""
    return _free_port()


def kill_at_marker(args: list[str], marker: str = "MID-SAVE") -> None:
    """Run ``python args...`` and SIGKILL it the moment it prints ``marker``.

    The child's stderr is shown if it exits before printing the marker.
    """
    import signal
    import subprocess

    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = ""
        while marker not in line:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, proc.stderr.read()[-3000:]
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)


def global_step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """One optimizer step on this rank's data-parallel slice of the global batch ``ids``;
    returns the global loss (token means, so the mean over dp ranks is the global mean).

    A model without ``tpcompile_parallel`` (not parallelized) trains on the whole batch.
    """
    from tpcompile import data_parallel_rank

    distributed = dist.is_initialized() and hasattr(model, "tpcompile_parallel")
    rank, size = data_parallel_rank(model) if distributed else (0, 1)
    local = ids.chunk(size)[rank]
    loss = model(local, labels=local).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    if not distributed:
        return loss.item()
    mean = loss.detach().clone()
    dist.all_reduce(mean)  # TP ranks agree; the mean over dp ranks is the global loss
    return mean.item() / dist.get_world_size()
