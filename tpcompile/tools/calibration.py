"""``python -m tpcompile calibrate``: measure this machine into a hardware profile.

``procs`` local gloo processes stand for the ranks of a job here.  Each measures, at
once with the others (so the numbers are what a rank of a job sees):

* ``torch.mm`` FLOP/s per dtype with every rank multiplying: the *achievable* rate.
  Ranks on one host share its cores, so this is each rank's share; then rank 0 alone
  while the others wait: the *solo* rate a rank gets while its peers idle (a pipeline's
  bubble lends the idle ranks' cores to the busy ones), kept where it is above the
  shared one;
* each collective (all-reduce, all-gather, reduce-scatter, all-to-all, p2p) at three
  sizes: latency from the smallest, bus bandwidth from the slope to the largest, one
  pair per collective in the links' ``ops`` (the all-reduce's is the link's own);
* a **pipeline hand-off** (``pp_handoff``): a GPipe step of two stages that compute next
  to nothing, through torch's pipelining runtime, over the span torch's action order
  makes at one unit per hand-off, less the p2p transfer of its 256 bytes: what the
  runtime adds to every hand-off (its schedule's Python, its p2p ops' set-up and waits);
* the **overlap**: an asynchronous all-gather running while the rank multiplies,
  against each alone: ``(t_mm + t_comm - t_both) / min(t_mm, t_comm)``, the share of
  communication that hides behind compute (gloo runs collectives on the cores that
  compute; a GPU's copy engines would give 1).

Example:
    >>> hw = calibrate(procs=2)                                  # doctest: +SKIP
    >>> hw.intra_node.bandwidth > 0, sorted(hw.measurements["collectives"])
    (True, ['all_gather', 'all_reduce', 'all_to_all', 'p2p', 'reduce_scatter'])
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import TPError
from .hardware import DTYPES, HardwareProfile, Link

__all__ = ["calibrate", "fit_link", "measure_matmul"]

_HANDOFF_WIDTH = 64  # features of the hand-off's microbatch: a transfer of 256 bytes
_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time_calls(fn: Any, seconds: float, *, throughput: bool = False) -> float:
    """Seconds per call of ``fn``: one warm-up call, then calls for ``seconds`` (at least
    3).  The median call (a loaded host's outliers are long), or with ``throughput`` the
    window's wall time over its calls: a process sharing cores with others is preempted
    between calls as well as inside them, and only the window sees both."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    if throughput:
        return (time.perf_counter() - start) / len(times)
    return sorted(times)[len(times) // 2]


def measure_matmul(dtype: str, *, n: int = 512, seconds: float = 0.3, throughput: bool = False) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` ``torch.mm`` in ``dtype`` on this process's
    CPU threads (``fp8``: ``torch._scaled_mm`` of float8_e4m3fn operands); 0 when the
    dtype does not run here.  A dtype without fast kernels here (CPU fp16 / fp8 can run
    at MFLOP/s) is timed at ``n / 2`` when one call at ``n`` would take over 0.5 s.
    ``throughput``: the rate over the whole window (see :func:`_time_calls`), not the
    median call's."""
    try:
        probe = _matmul_call(dtype, n // 2)
        once = _time_calls(probe, 0.0)
        size, call = (n, _matmul_call(dtype, n)) if once * 8 <= 0.5 else (n // 2, probe)
        return 2.0 * size ** 3 / _time_calls(call, seconds, throughput=throughput)
    except (RuntimeError, NotImplementedError, AttributeError, TypeError):
        return 0.0


def _matmul_call(dtype: str, n: int) -> Any:
    if dtype == "fp8":
        a = torch.randn(n, n).to(torch.float8_e4m3fn)
        b = torch.randn(n, n).to(torch.float8_e4m3fn).t()  # _scaled_mm wants a column-major b
        one = torch.tensor(1.0)
        return lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)
    a = torch.randn(n, n, dtype=_TORCH_DTYPES[dtype])
    b = torch.randn(n, n, dtype=_TORCH_DTYPES[dtype])
    return lambda: torch.mm(a, b)


def _rank_worker(rank: int, world: int, sizes: list[int], repeats: int, threads: int,
                 seconds_per_dtype: float) -> dict[str, Any]:
    """One rank of :func:`calibrate` (module-level so it pickles)."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    shared: dict[str, float] = {}
    solo: dict[str, float] = {}
    for d in DTYPES:
        dist.barrier()  # every rank starts each dtype together: the rates are under contention
        shared[d] = measure_matmul(d, seconds=seconds_per_dtype, throughput=True)
    for d in DTYPES:
        dist.barrier()
        if rank == 0 and shared[d] > 0:  # the others wait in the barrier below
            solo[d] = measure_matmul(d, seconds=seconds_per_dtype, throughput=True)
        dist.barrier()
    return {"matmul": shared, "solo": solo, "collectives": _collective_times(rank, world, sizes, repeats),
            "overlap": _overlap(world, max(sizes)), "handoff": _handoff(rank, repeats)}


class _Tiny(torch.nn.Module):
    """A stage that computes next to nothing (the last one returns its loss)."""

    def __init__(self, last: bool) -> None:
        super().__init__()
        self.lin, self.last = torch.nn.Linear(_HANDOFF_WIDTH, _HANDOFF_WIDTH), last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.sum() if self.last else y


def _handoff(rank: int, repeats: int, microbatches: int = 8) -> dict[str, float]:
    """A pipeline hand-off as torch's runtime makes it, between ranks 0 and 1: the median
    wall of a GPipe step of two stages that compute next to nothing, and the span torch's
    action order makes at one unit per hand-off (the same simulation the price runs), so
    ``wall / span`` is one hand-off.  The other ranks wait."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    from ..plan.schedule import simulate_stages

    group = dist.new_group([0, 1])
    walls = []
    if rank < 2:
        meta = {"device": "meta"}
        hidden = torch.empty(1, _HANDOFF_WIDTH, **meta, requires_grad=True)
        stage = pipelining.PipelineStage(
            _Tiny(last=rank == 1), rank, 2, torch.device("cpu"),
            input_args=(torch.empty(1, _HANDOFF_WIDTH, **meta),) if rank == 0 else (hidden,),
            output_args=hidden if rank == 0 else torch.empty((), **meta, requires_grad=True), group=group)
        schedule = pipelining.ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=lambda out, _: out,
                                            scale_grads=False)
        x = torch.zeros(microbatches, _HANDOFF_WIDTH)
        for step in range(repeats + 2):  # two warm-up steps
            dist.barrier(group)
            start = time.perf_counter()
            if rank == 0:
                schedule.step(x, return_outputs=False)
            else:
                schedule.step(target=x, losses=[], return_outputs=False)
            if step >= 2:
                walls.append(time.perf_counter() - start)
    dist.barrier()
    runs = simulate_stages("gpipe", 2, 1, microbatches, {0: 0.0, 1: 0.0}, hop=1.0)
    span = max(r.finish for r in runs.values())
    wall = sorted(walls)[len(walls) // 2] if walls else 0.0
    return {"wall": wall, "span": span, "hop": wall / span}


def _collective(op: str, rank: int, x: torch.Tensor, gathered: torch.Tensor, recv: torch.Tensor,
                shard: torch.Tensor) -> None:
    import torch.distributed as dist

    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "all_gather":  # all_gather_into_tensor's torch >= 2.13 name
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(gathered, x)
    elif op == "reduce_scatter":  # each rank passes the whole buffer and keeps 1 / world of it
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(shard, x)
    elif op == "all_to_all":
        dist.all_to_all_single(recv, x)
    elif rank == 0:  # ping-pong between ranks 0 and 1; halved by the caller
        dist.send(x, 1)
        dist.recv(recv, 1)
    elif rank == 1:
        dist.recv(recv, 0)
        dist.send(x, 0)


def _numel(nbytes: int, world: int) -> int:
    """Float32 elements of a buffer of about ``nbytes`` that splits evenly over ``world``."""
    return max(world, nbytes // 4 // world * world)


def _collective_times(rank: int, world: int, sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Seconds per call of each collective at each size (bytes, float32) on one rank."""
    import torch.distributed as dist

    out: dict[str, dict[int, float]] = {}
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all"):
        out[op] = {}
        for size in sizes:
            numel = _numel(size, world)
            bufs = (torch.ones(numel), torch.empty(numel * world), torch.empty(numel), torch.empty(numel // world))
            try:
                _collective(op, rank, *bufs)  # warm-up (and: does the backend have it?)
                _collective(op, rank, *bufs)
                per = []
                for _ in range(repeats):  # the median: a loaded host's outliers are long
                    dist.barrier()
                    start = time.perf_counter()
                    _collective(op, rank, *bufs)
                    per.append(time.perf_counter() - start)
                per.sort()
                median = per[len(per) // 2]
            except (RuntimeError, NotImplementedError, ValueError):
                out.pop(op)
                dist.barrier()
                break
            out[op][numel * 4] = median / 2 if op == "p2p" else median
    return out


def _overlap(world: int, nbytes: int, rounds: int = 3) -> dict[str, float]:
    """Matmuls alone, all-gathers alone, both at once (the gathers asynchronous), on
    every rank together; the share of the shorter that the overlap hid (median round)."""
    import torch.distributed as dist

    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    numel = _numel(nbytes, world)
    x, out = torch.ones(numel), torch.empty(numel * world)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    gathers = 4

    def comm() -> list[Any]:
        return [gather(out, x, async_op=True) for _ in range(gathers)]

    def timed(fn: Any) -> float:
        dist.barrier()
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    # as many matmuls as the gathers take: the overlap of two equal spans
    t_comm = timed(lambda: [w.wait() for w in comm()])
    one_mm = timed(lambda: [torch.mm(a, b) for _ in range(8)]) / 8
    mms = max(1, round(t_comm / max(one_mm, 1e-9)))
    shares = []
    for _ in range(rounds):
        t_comm = timed(lambda: [w.wait() for w in comm()])
        t_mm = timed(lambda: [torch.mm(a, b) for _ in range(mms)])

        def both() -> None:
            works = comm()
            for _ in range(mms):
                torch.mm(a, b)
            for w in works:
                w.wait()

        t_both = timed(both)
        shares.append(min(1.0, max(0.0, (t_mm + t_comm - t_both) / min(t_mm, t_comm))))
    return {"share": sorted(shares)[len(shares) // 2], "bytes": float(numel * 4), "gathers": float(gathers),
            "matmuls": float(mms)}


def _steps(op: str, p: int) -> int:
    """Latency-bound steps of a collective over ``p`` ranks (tree / recursive doubling,
    as :mod:`~tpcompile.tools.layout_price` prices them)."""
    log = max(1, math.ceil(math.log2(p))) if p > 1 else 0
    return 1 if op == "p2p" else 2 * log if op == "all_reduce" else log


def _bus_factor(op: str, p: int) -> float:
    """Bytes on the wire per rank over the buffer each passes, in the convention
    :func:`~tpcompile.tools.layout_price.collective_time` prices with: an all-gather's
    buffer is the rank's shard (``p - 1`` of them arrive), the others' the whole."""
    return {"all_reduce": 2 * (p - 1) / p, "all_gather": float(p - 1), "reduce_scatter": (p - 1) / p,
            "all_to_all": (p - 1) / p}.get(op, 1.0)


def fit_link(times: dict[int, float], op: str, p: int) -> tuple[float, float]:
    """``(bus bandwidth, latency per step)`` from seconds per call at two or more sizes
    (bytes each rank passes): the smallest gives the latency, the slope to the largest
    the bandwidth."""
    small, large = min(times), max(times)
    latency = times[small] / max(1, _steps(op, p))
    # a noisy small-size time can exceed a larger one: never let the slope go below the
    # large size's own rate
    slope = max(times[large] - times[small], 0.5 * times[large]) / max(large - small, 1)
    return _bus_factor(op, p) / slope, latency


def _host_memory() -> float:
    """Bytes of memory this host (or its cgroup) allows."""
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, float(limit))
    except OSError:
        pass
    return total


def calibrate(*, procs: int = 2, name: str = "calibrated", sizes: tuple[int, ...] = (4096, 1 << 20, 8 << 20),
              repeats: int = 5, seconds_per_dtype: float = 0.3, timeout: float = 120.0,
              threads: int | None = None) -> HardwareProfile:
    """Measure this machine into a profile over ``procs`` local gloo processes, the
    ranks of a job here (see the module docstring for what each number is).

    Each rank runs ``threads`` intra-op threads (default: the cores over ``procs``, at
    least one).  The measured rates are both peak and achievable (nothing is derated);
    memory per device is the host's (or cgroup's) memory over ``procs``; both link levels
    are the local group's (one host: nothing crosses a node).  ``measurements`` keeps
    every timing.  About 15-30 s at the defaults.

    Example:
        >>> hw = calibrate(procs=4, threads=1)                       # doctest: +SKIP
        >>> hw.comm_overlap, hw.solo("fp32") / hw.achievable("fp32")
        (0.3, 2.0)
    """
    from .launch import spawn_local
    from .layout_price import collective_time

    if procs < 2:
        raise TPError(f"calibrate needs at least 2 processes to measure links, got procs={procs}")
    if threads is None:
        threads = max(1, (os.cpu_count() or procs) // procs)
    per_rank = spawn_local(_rank_worker, procs, list(sizes), repeats, threads, seconds_per_dtype, timeout=timeout)
    rates = {d: min(r["matmul"][d] for r in per_rank) for d in DTYPES}
    rates = {d: r for d, r in rates.items() if r > 0}
    solo = {d: r for d, r in per_rank[0]["solo"].items() if d in rates and r > rates[d]}
    timings = per_rank[0]["collectives"]
    links = {op: fit_link(t, op, procs) for op, t in timings.items()}
    bandwidth, latency = links["all_reduce"]
    link = Link(bandwidth=bandwidth, latency=latency,
                ops={op: [bw, lat] for op, (bw, lat) in links.items() if op != "all_reduce"})
    overlap = sorted(r["overlap"]["share"] for r in per_rank)[len(per_rank) // 2]
    handoff = per_rank[0]["handoff"]  # the step starts and ends on rank 0 (the last backward's receive)
    transfer = collective_time("p2p", 2, _HANDOFF_WIDTH * 4, link)
    return HardwareProfile(
        name=name, peak_flops=rates, achievable_flops=dict(rates), memory_bytes=_host_memory() / procs,
        intra_node=link, inter_node=link, gpus_per_node=max(procs, os.cpu_count() or procs),
        comm_overlap=round(overlap, 3), solo_flops=solo, pp_handoff=max(0.0, handoff["hop"] - transfer),
        source=f"measured by tpcompile calibrate on this host over {procs} local processes ({threads} threads "
               "each): torch.mm 512^3 per dtype on every process at once (the slowest process's rate) and on one "
               "alone, gloo collectives, an all-gather overlapped with matmuls, a GPipe step of two stages that "
               "compute next to nothing",
        measurements={"matmul_flops": rates, "solo_flops": per_rank[0]["solo"], "procs": procs, "threads": threads,
                      "matmul_flops_per_rank": [r["matmul"] for r in per_rank],
                      "overlap_per_rank": [r["overlap"] for r in per_rank], "pp_handoff": handoff,
                      "collectives": {op: {"seconds": {str(k): v for k, v in t.items()},
                                           "bus_bandwidth": links[op][0], "latency": links[op][1]}
                                      for op, t in timings.items()}})
