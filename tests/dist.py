"""Run a function on ``N`` real CPU processes joined by a gloo process group.

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes (forked
from the launcher's fork server, which imported torch and transformers once: a launch
costs well under a second; each rank is a new process all the same), initializes
``torch.distributed`` with the gloo backend over TCP on 127.0.0.1 in each, calls
``fn(rank, world_size, *args)`` and returns the per-rank return values in rank
order.  An exception on any rank is re-raised in the parent with the child's
traceback text: ``AssertionError`` if the child failed an assertion (so pytest
reports it as a test failure), ``RuntimeError`` otherwise.

``fn`` and ``args`` are pickled, so ``fn`` must be a module-level function of an
importable module (e.g. a test module, whose directory is on ``sys.path``).  The
processes are launched by the project's one launcher, ``tpcompile.tools.launch``; this
module adds the tests' import path, their exception types and the case batching below.

``run_cases(world_size, cases)`` runs many named cases in that one launch (each case
then skips the model-module imports and plans the others already made); each test reads
its own case from the result and fails with the case's name.

With ``TPCOMPILE_TEST_POOL=1`` the ranks of one world size are started once per test
session and reused by every run (:class:`tpcompile.tools.launch.LocalPool`: a fresh
environment, one thread and grad mode on between runs; a run that fails stops them and
the next one starts new ranks), so the suite pays the start-up a few times instead of
once per module.  Not the default yet: the process groups and device meshes each run
creates stay alive in the reused ranks (hundreds of gloo threads by mid-suite, slowing
every later run); they must be destroyed between runs first.
"""

from __future__ import annotations

import atexit
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from tpcompile.tools.launch import LocalPool, WorkerFailed, free_port, spawn_local

__all__ = ["CaseResults", "Collectives", "free_port", "global_step", "kill_at_marker", "plan_ahead", "refusal", "run_cases",
           "run_distributed"]

_TESTS_DIR = Path(__file__).resolve().parent
_REPO_ROOT = _TESTS_DIR.parent


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


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300, fresh: bool = False,
    interpreter: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    Returns the list of per-rank return values (each must be picklable).  Raises the
    first child failure in the parent; remaining children are terminated rather than
    left blocked in a collective.  ``timeout`` (seconds) bounds both the whole run and
    each gloo collective; a run that times out is run once more in fresh processes (with
    a warning), since gloo's transport can deadlock on its own.  ``fresh``: new processes
    for this run (for code whose contract is once per process, like
    ``tpcompile.smp.init``), not the session's ranks; ``interpreter``: each rank a new
    interpreter, nothing inherited from the fork server (for measuring a process's memory).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    _export_import_path()
    try:
        try:
            if fresh or interpreter or not os.environ.get("TPCOMPILE_TEST_POOL"):
                return spawn_local(fn, world_size, *args, timeout=timeout, interpreter=interpreter)
            return _pool(world_size).run(fn, *args, timeout=timeout)
        except WorkerFailed as exc:
            if exc.kind != "timeout":
                raise
            # gloo's TCP transport deadlocks now and then on a loaded host (seen: both
            # ranks in one all-gather, one waiting for its send to complete, the other
            # spinning in the receive buffer's destructor); a deterministic hang hangs
            # again and still fails, a transport race passes, and is reported
            warnings.warn(f"a {world_size}-rank launch timed out after {timeout:.0f} s and was run again in fresh "
                          f"processes: {str(exc).splitlines()[0][:200]}", stacklevel=2)
            return spawn_local(fn, world_size, *args, timeout=timeout, interpreter=interpreter)
    except WorkerFailed as exc:  # a failed assert stays a test failure, a timeout a timeout
        if exc.kind == "assertion":
            raise AssertionError(str(exc)) from None
        if exc.kind == "timeout":
            raise TimeoutError(str(exc)) from None
        raise


def plan_ahead(rank: int, world: int, jobs: list[tuple[Callable[..., Any], tuple, dict[str, Any]]]) -> int:
    """Plan this rank's share of ``jobs`` (every ``world``-th ``(build, args, planning)``:
    ``plan_model(build(*args), **planning)``) into the session's plan cache; how many.

    Every rank of a launch plans the same models; through the cache the first rank to
    ask plans while the others wait on its lock, so the launch plans on one core at a
    time.  Planned ahead, split over the ranks, the plans are made side by side and each
    case's own ``transform`` reads its plan.  A refusal is stored too (the case raises
    it); a job whose planning warns is not stored and is planned again by its case."""
    import tpcompile

    planned = 0
    for build, args, planning in jobs[rank::world]:
        try:
            tpcompile.plan_model(build(*args), **planning)
            planned += 1
        except Exception:  # noqa: BLE001 - the case that transforms this model reports it
            continue
    return planned


_POOLS: dict[int, LocalPool] = {}


def _pool(world_size: int) -> LocalPool:
    """The session's ranks for ``world_size`` (``TPCOMPILE_TEST_POOL=1``), started on first
    use and again after a run that failed: a launch costs more than most cases."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.healthy:
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = LocalPool(world_size)
    return pool


@atexit.register
def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()


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


def refusal(attempt: Callable[[], Any]) -> str | None:
    """The message of the ``TPError`` ``attempt()`` raises (``None``: it ran), for cases
    that report what tpcompile refused; any other exception fails the case."""
    from tpcompile import TPError

    try:
        attempt()
    except TPError as exc:
        return str(exc)
    return None


class Collectives(TorchDispatchMode):
    """Counts the collectives that reach the dispatcher (``c10d`` and functional ops),
    however called, by op name.  A tensor subclass (DTensor, torchao's float8 tensors)
    runs its own dispatch under the mode, so the collectives it issues are counted too.

    Not ``CommDebugMode``: its module tracker wraps every module output for backward
    hooks, which changes the tensors the model's loss receives, and breaks on a module
    called outside the model's tree (transformers 5.25's rotary ``Func`` module)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    @property
    def count(self) -> int:
        return sum(self.ops.values())

    def all_reduces(self) -> int:
        return sum(n for op, n in self.ops.items() if "all_reduce" in op or "allreduce" in op)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor

        if any(t.__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ and not issubclass(t, FakeTensor)
               for t in types):
            return NotImplemented  # the subclass dispatches first; its inner ops come back here
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func.__name__:
            self.ops[func.__name__] = self.ops.get(func.__name__, 0) + 1
        return func(*args, **(kwargs or {}))
