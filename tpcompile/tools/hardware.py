"""Hardware profiles as data: FLOP/s per dtype, memory per device, links per level.

:func:`~tpcompile.tools.layout.plan_layout` prices a layout against one
:class:`HardwareProfile`: compute at the profile's *achievable* rate for the dtype,
each collective over the link its mesh dim runs on (``intra_node`` inside a node,
``inter_node`` across), memory against ``memory_bytes``.  A profile is plain data: a
built-in name, a JSON file (:func:`load_profile` / :func:`save_profile`) or what
:func:`calibrate` measures on this machine (``python -m tpcompile calibrate``).

Built-in profiles, from the vendors' datasheets (dense peaks, i.e. the "with sparsity"
figures halved):

* ``h100-80gb``: NVIDIA H100 SXM5 datasheet: BF16 989 TFLOP/s, FP8 1,979, FP32 67;
  80 GB HBM3; NVLink 4 900 GB/s per GPU (450 each way); DGX H100: one ConnectX-7
  400 Gb/s InfiniBand NIC per GPU (50 GB/s).
* ``h200``: NVIDIA H200 SXM datasheet: the H100's tensor cores, 141 GB HBM3e, NVLink 900
  GB/s; 400 Gb/s per GPU (DGX H200).
* ``a100-80gb``: NVIDIA A100 SXM4 80GB datasheet: BF16 312 TFLOP/s, FP32 19.5, no FP8;
  80 GB HBM2e; NVLink 3 600 GB/s per GPU (300 each way); DGX A100: 200 Gb/s HDR per GPU.
* ``b200``: NVIDIA DGX / HGX B200 datasheets: per GPU BF16 2.25 PFLOP/s, FP8 4.5, FP32
  ~75 TFLOP/s; 180 GB HBM3e; NVLink 5 1.8 TB/s per GPU (900 GB/s each way); 400 Gb/s
  ConnectX-7 per GPU (DGX B200).
* ``cpu``: a nominal small host (gloo over loopback), a placeholder: run ``calibrate``.

Achievable fractions assumed (they are data: edit the JSON):

* compute: 0.5 of the dense BF16 / FP32 peak (isolated large GEMMs reach 0.7-0.8 on
  Hopper; a whole training step's FLOP-counted work, with attention, norms and
  elementwise kernels between the GEMMs that the FLOP count leaves out, runs near 0.5:
  Llama 3 405B's published BF16 MFU is 38-43% with communication included); FP8 0.35 of
  the FP8 peak, about 1.4x the BF16 rate (torchao / torchtitan report 1.2-1.5x end to end);
* links: 0.8 of NVLink's one-way bandwidth (nccl-tests all-reduce bus bandwidth on
  8 GPUs: ~360 GB/s on H100, ~230 GB/s on A100), 0.9 of the InfiniBand line rate;
* latency per algorithm step: 3 us inside a node, 10 us across nodes.

Example:
    >>> hw = get_profile("h100-80gb")
    >>> hw.achievable("bf16") / 1e12, hw.link(inter_node=True).bandwidth / 1e9
    (494.5, 45.0)
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import TPError

__all__ = ["PROFILES", "HardwareProfile", "Link", "calibrate", "device_profile", "get_profile", "load_profile",
           "profile_for_device", "save_profile"]

PROFILE_VERSION = 1
DTYPES = ("bf16", "fp16", "fp8", "fp32")
_GB = 1e9
_T = 1e12


@dataclass(frozen=True, kw_only=True)
class Link:
    """One link level: achievable bus bandwidth per GPU (bytes/s, one direction, the
    nccl-tests convention) and latency per algorithm step (s)."""

    bandwidth: float
    latency: float
    peak_bandwidth: float | None = None  # the datasheet figure the bandwidth derates

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or self.latency < 0:
            raise TPError(f"a link needs bandwidth > 0 and latency >= 0, got {self.bandwidth}, {self.latency}")


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """What one accelerator (and its links) can do.

    ``peak_flops`` / ``achievable_flops`` map a dtype (``bf16``, ``fp16``, ``fp8``,
    ``fp32``) to FLOP/s (0 or missing: the device has no such rate); ``memory_bytes`` is
    per device; ``intra_node`` / ``inter_node`` the two link levels; ``measurements``
    what :func:`calibrate` measured (empty for datasheet profiles).
    """

    name: str
    peak_flops: dict[str, float]
    achievable_flops: dict[str, float]
    memory_bytes: float
    intra_node: Link
    inter_node: Link
    gpus_per_node: int = 8
    source: str = ""
    measurements: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for d in (*self.peak_flops, *self.achievable_flops):
            if d not in DTYPES:
                raise TPError(f"hardware profile {self.name!r}: unknown dtype {d!r} (known: {', '.join(DTYPES)})")
        if self.memory_bytes <= 0 or self.gpus_per_node < 1:
            raise TPError(f"hardware profile {self.name!r}: memory_bytes and gpus_per_node must be positive")

    def achievable(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype`` (``fp16`` falls back to ``bf16``); 0: none."""
        return float(self.achievable_flops.get(dtype, self.achievable_flops.get("bf16", 0.0)
                                               if dtype == "fp16" else 0.0))

    def peak(self, dtype: str) -> float:
        return float(self.peak_flops.get(dtype, self.peak_flops.get("bf16", 0.0) if dtype == "fp16" else 0.0))

    def link(self, *, inter_node: bool) -> Link:
        return self.inter_node if inter_node else self.intra_node

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        if d.get("version", PROFILE_VERSION) != PROFILE_VERSION:
            raise TPError(f"hardware profile version {d.get('version')} is not supported (expected {PROFILE_VERSION})")
        rest = {k: v for k, v in d.items() if k != "version"}
        try:
            return cls(**{**rest, "intra_node": Link(**rest["intra_node"]), "inter_node": Link(**rest["inter_node"])})
        except (KeyError, TypeError) as exc:
            raise TPError(f"not a hardware profile: {exc}") from None


def _gpu(name: str, *, bf16: float, fp8: float, fp32: float, memory_gb: float, nvlink_one_way: float,
         nic: float, source: str) -> HardwareProfile:
    """A datasheet profile with this module's achievable fractions (see the docstring)."""
    peak = {"bf16": bf16, "fp16": bf16, "fp32": fp32, **({"fp8": fp8} if fp8 else {})}
    achievable = {"bf16": 0.5 * bf16, "fp16": 0.5 * bf16, "fp32": 0.5 * fp32, **({"fp8": 0.35 * fp8} if fp8 else {})}
    return HardwareProfile(
        name=name, peak_flops=peak, achievable_flops=achievable, memory_bytes=memory_gb * _GB,
        intra_node=Link(bandwidth=0.8 * nvlink_one_way, latency=3e-6, peak_bandwidth=nvlink_one_way),
        inter_node=Link(bandwidth=0.9 * nic, latency=1e-5, peak_bandwidth=nic), gpus_per_node=8,
        source=source + "; achievable: compute 0.5 of dense peak (FP8 0.35), NVLink 0.8, InfiniBand 0.9")


PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    _gpu("h100-80gb", bf16=989 * _T, fp8=1979 * _T, fp32=67 * _T, memory_gb=80, nvlink_one_way=450 * _GB,
         nic=50 * _GB, source="NVIDIA H100 SXM5 datasheet; DGX H100 (8x ConnectX-7 400 Gb/s)"),
    _gpu("h200", bf16=989 * _T, fp8=1979 * _T, fp32=67 * _T, memory_gb=141, nvlink_one_way=450 * _GB,
         nic=50 * _GB, source="NVIDIA H200 SXM datasheet; DGX H200 (8x ConnectX-7 400 Gb/s)"),
    _gpu("a100-80gb", bf16=312 * _T, fp8=0.0, fp32=19.5 * _T, memory_gb=80, nvlink_one_way=300 * _GB,
         nic=25 * _GB, source="NVIDIA A100 SXM4 80GB datasheet; DGX A100 (8x ConnectX-6 200 Gb/s)"),
    _gpu("b200", bf16=2250 * _T, fp8=4500 * _T, fp32=75 * _T, memory_gb=180, nvlink_one_way=900 * _GB,
         nic=50 * _GB, source="NVIDIA DGX/HGX B200 datasheets (per GPU); 8x ConnectX-7 400 Gb/s"),
    HardwareProfile(name="cpu", peak_flops={"bf16": 2e10, "fp16": 2e10, "fp32": 1e11},
                    achievable_flops={"bf16": 1e10, "fp16": 1e10, "fp32": 5e10}, memory_bytes=16 * _GB,
                    intra_node=Link(bandwidth=1 * _GB, latency=5e-5), inter_node=Link(bandwidth=1 * _GB,
                                                                                     latency=5e-5),
                    gpus_per_node=64, source="nominal small host, gloo over loopback: a placeholder, run "
                                             "`python -m tpcompile calibrate` for this machine's numbers"),
)}


def get_profile(name_or_path: str | os.PathLike[str] | HardwareProfile) -> HardwareProfile:
    """A built-in profile by name, a profile JSON file, or the profile itself.

    Example:
        >>> get_profile("a100-80gb").achievable("fp8")
        0.0
    """
    if isinstance(name_or_path, HardwareProfile):
        return name_or_path
    key = str(name_or_path)
    if key.lower() in PROFILES:
        return PROFILES[key.lower()]
    if Path(key).is_file():
        return load_profile(key)
    raise TPError(f"unknown hardware {key!r}: built-in profiles are {', '.join(PROFILES)}, or give a profile "
                  "JSON file (python -m tpcompile calibrate --out FILE.json writes one)")


# ``torch.cuda.get_device_name()`` -> the built-in profile of that part.  The profiles hold
# the SXM boards' figures: PCIe and NVL boards (other clocks, links and memory) would be
# priced wrong, so they are not matched; GH200 is not an H200 (hence the word boundaries)
_DEVICE_NAMES = ((r"\bH200\b", "h200"), (r"\bH100\b", "h100-80gb"), (r"\bB200\b", "b200"),
                 (r"\bA100\b.*\b80\s*GB\b", "a100-80gb"))


def profile_for_device(name: str) -> str:
    """The built-in profile of a CUDA device name; a TPError naming ``hardware=`` otherwise.

    Example:
        >>> profile_for_device("NVIDIA H100 80GB HBM3"), profile_for_device("NVIDIA A100-SXM4-80GB")
        ('h100-80gb', 'a100-80gb')
    """
    upper = name.upper()
    found = None if re.search(r"PCIE|\bNVL\b", upper) else next(
        (profile for pattern, profile in _DEVICE_NAMES if re.search(pattern, upper)), None)
    if found is None:
        raise TPError(f"no built-in hardware profile for {name!r} (built-in: {', '.join(PROFILES)}): pass "
                      "hardware= a profile's name or a profile JSON file (python -m tpcompile calibrate --out "
                      "FILE.json measures this machine into one)")
    return found


def device_profile(device: str) -> str:
    """The profile a job on ``device`` (``"cuda"`` / ``"cpu"``) is priced with by default:
    the CUDA device's (:func:`profile_for_device`), else ``cpu``."""
    return profile_for_device(torch.cuda.get_device_name()) if device == "cuda" else "cpu"


def load_profile(path: str | os.PathLike[str]) -> HardwareProfile:
    """Read a profile written by :func:`save_profile` (or by hand)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise TPError(f"cannot read hardware profile {path}: {exc}") from None
    if not isinstance(data, dict):
        raise TPError(f"{path}: a hardware profile is a JSON object")
    return HardwareProfile.from_dict(data)


def save_profile(profile: HardwareProfile, path: str | os.PathLike[str]) -> None:
    Path(path).write_text(json.dumps(profile.to_dict(), indent=2) + "\n", encoding="utf-8")


# ------------------------------------------------------------------ calibration

_TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _time_calls(fn: Any, seconds: float) -> float:
    """Median seconds per call of ``fn`` (a loaded host's outliers are long): one
    warm-up call, then calls for ``seconds`` (at least 3)."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < seconds:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def measure_matmul(dtype: str, *, n: int = 512, seconds: float = 0.3) -> float:
    """FLOP/s of an ``n x n`` by ``n x n`` ``torch.mm`` in ``dtype`` on this process's
    CPU threads (``fp8``: ``torch._scaled_mm`` of float8_e4m3fn operands); 0 when the
    dtype does not run here.  A dtype without fast kernels here (CPU fp16 / fp8 can run
    at MFLOP/s) is timed at ``n / 2`` when one call at ``n`` would take over 0.5 s."""
    try:
        probe = _matmul_call(dtype, n // 2)
        once = _time_calls(probe, 0.0)
        size, call = (n, _matmul_call(dtype, n)) if once * 8 <= 0.5 else (n // 2, probe)
        return 2.0 * size ** 3 / _time_calls(call, seconds)
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


def _comm_worker(rank: int, world: int, sizes: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Seconds per call of each collective at each size (bytes, float32), on one rank of
    a gloo group (spawned by :func:`calibrate`; module-level so it pickles)."""
    import torch.distributed as dist

    out: dict[str, dict[int, float]] = {}
    for op in ("all_reduce", "all_gather", "p2p", "all_to_all"):
        out[op] = {}
        for size in sizes:
            numel = max(world, size // 4 // world * world)
            x = torch.ones(numel)
            gathered = torch.empty(numel * world)
            recv = torch.empty(numel)

            def call(op: str = op, x: torch.Tensor = x, gathered: torch.Tensor = gathered,
                     recv: torch.Tensor = recv) -> None:
                if op == "all_reduce":
                    dist.all_reduce(x)
                elif op == "all_gather":  # all_gather_into_tensor's torch >= 2.13 name
                    getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(gathered, x)
                elif op == "all_to_all":
                    dist.all_to_all_single(recv, x)
                elif rank == 0:  # ping-pong between ranks 0 and 1; halved below
                    dist.send(x, 1)
                    dist.recv(recv, 1)
                elif rank == 1:
                    dist.recv(recv, 0)
                    dist.send(x, 0)

            try:
                call()  # warm-up (and: does the backend have it? older gloo has no all_to_all)
                call()
                per = []
                for _ in range(repeats):  # the median: a loaded host's outliers are long
                    dist.barrier()
                    start = time.perf_counter()
                    call()
                    per.append(time.perf_counter() - start)
                per.sort()
                median = per[len(per) // 2]
            except (RuntimeError, NotImplementedError, ValueError):
                out.pop(op)
                dist.barrier()
                break
            out[op][numel * 4] = median / 2 if op == "p2p" else median
    return out


def _steps(op: str, p: int) -> int:
    """Latency-bound steps of a collective over ``p`` ranks (tree / recursive doubling,
    as :mod:`~tpcompile.tools.layout` prices them)."""
    log = max(1, math.ceil(math.log2(p))) if p > 1 else 0
    return 1 if op == "p2p" else 2 * log if op == "all_reduce" else log


def _bus_factor(op: str, p: int) -> float:
    """nccl-tests' bus-bandwidth factor: bytes on the wire per rank over the buffer size."""
    return {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "all_to_all": (p - 1) / p}.get(op, 1.0)


def fit_link(times: dict[int, float], op: str, p: int) -> tuple[float, float]:
    """``(bus bandwidth, latency per step)`` from seconds per call at two or more sizes:
    the smallest gives the latency, the slope to the largest the bandwidth."""
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
              repeats: int = 5, seconds_per_dtype: float = 0.3, timeout: float = 120.0) -> HardwareProfile:
    """Measure this machine into a profile: ``torch.mm`` FLOP/s per dtype in this
    process, then all-reduce / all-gather / p2p (and all-to-all where the backend has
    it) over ``procs`` local gloo processes.

    The measured rates are both peak and achievable (nothing is derated); memory per
    device is the host's (or cgroup's) memory divided by ``procs``; both link levels
    are the local group's (one host: nothing crosses a node). ``measurements`` keeps
    every timing. Takes about 10-30 s at the defaults.

    Example:
        >>> hw = calibrate(procs=2)                                  # doctest: +SKIP
        >>> hw.intra_node.bandwidth > 0, sorted(hw.measurements["collectives"])
        (True, ['all_gather', 'all_reduce', 'p2p'])
    """
    from .launch import spawn_local

    if procs < 2:
        raise TPError(f"calibrate needs at least 2 processes to measure links, got procs={procs}")
    rates = {d: measure_matmul(d, seconds=seconds_per_dtype) for d in DTYPES}
    rates = {d: r for d, r in rates.items() if r > 0}
    timings = spawn_local(_comm_worker, procs, list(sizes), repeats, timeout=timeout)[0]
    links = {op: fit_link(t, op, procs) for op, t in timings.items()}
    bandwidth, latency = links["all_reduce"]
    link = Link(bandwidth=bandwidth, latency=latency)
    return HardwareProfile(
        name=name, peak_flops=rates, achievable_flops=dict(rates), memory_bytes=_host_memory() / procs,
        intra_node=link, inter_node=link, gpus_per_node=max(procs, os.cpu_count() or procs),
        source=f"measured by tpcompile calibrate on this host: torch.mm 512^3 per dtype ({torch.get_num_threads()} "
               f"threads), gloo collectives over {procs} local processes (links from the all-reduce)",
        measurements={"matmul_flops": rates, "procs": procs,
                      "collectives": {op: {"seconds": {str(k): v for k, v in t.items()},
                                           "bus_bandwidth": links[op][0], "latency": links[op][1]}
                                      for op, t in timings.items()}})
