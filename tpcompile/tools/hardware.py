"""Hardware profiles as data: FLOP/s per dtype, memory per device, links per level.

:func:`~tpcompile.tools.layout.plan_layout` prices a layout against one
:class:`HardwareProfile`: compute at the profile's *achievable* rate for the dtype,
each collective over the link its mesh dim runs on (``intra_node`` inside a node,
``inter_node`` across), memory against ``memory_bytes``.  A profile is plain data: a
built-in name, a JSON file (:func:`load_profile` / :func:`save_profile`) or what
:func:`~tpcompile.tools.calibration.calibrate` measures on this machine (``python -m tpcompile calibrate``).

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
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import TPError

__all__ = ["COLLECTIVES", "DTYPES", "PROFILES", "HardwareProfile", "Link", "device_profile", "get_profile",
           "load_profile", "profile_for_device", "save_profile"]

PROFILE_VERSION = 1
DTYPES = ("bf16", "fp16", "fp8", "fp32")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p", "broadcast")
_FAMILY = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
           "all_to_all_single": "all_to_all"}
_GB = 1e9
_T = 1e12


@dataclass(frozen=True, kw_only=True)
class Link:
    """One link level: achievable bus bandwidth per GPU (bytes/s, one direction, the
    nccl-tests convention) and latency per algorithm step (s)."""

    bandwidth: float
    latency: float
    peak_bandwidth: float | None = None  # the datasheet figure the bandwidth derates
    # per collective, [bus bandwidth, latency per step] where it differs from the link's
    # own (gloo's all-gather runs far below its all-reduce; calibrate measures each)
    ops: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for bw, lat in [(self.bandwidth, self.latency), *self.ops.values()]:
            if not bw > 0 or lat < 0:
                raise TPError(f"a link needs bandwidth > 0 and latency >= 0, got {bw}, {lat}")
        if unknown := set(self.ops) - set(COLLECTIVES):
            raise TPError(f"a link's ops are {', '.join(COLLECTIVES)}, got {', '.join(sorted(unknown))}")

    def for_op(self, op: str) -> tuple[float, float]:
        """``(bus bandwidth, latency per step)`` of collective ``op`` (torch's name or
        the family's: ``all_gather_into_tensor`` is an ``all_gather``)."""
        got = self.ops.get(_FAMILY.get(op, op))
        return (got[0], got[1]) if got else (self.bandwidth, self.latency)


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
    # the share of the communication the model lets hide behind compute (FSDP2's
    # prefetched all-gathers, its reduce-scatters during backward) that does hide: 1 on
    # GPUs (copy engines, their own streams); less where collectives run on the cores
    # that compute (gloo on a CPU host: calibrate measures it)
    comm_overlap: float = 1.0
    # FLOP/s of one device while its peers idle, where devices share compute (ranks on
    # one CPU host's cores): a pipeline's idle ranks lend their share to the busy ones.
    # Empty: devices share nothing (GPUs), the achievable rate holds either way
    solo_flops: dict[str, float] = field(default_factory=dict)
    # seconds a pipeline hand-off costs on top of its transfer: the pipeline runtime's own
    # work per received microbatch (torch's schedule Python, its p2p ops' set-up and
    # waits).  0 where unmeasured (the datasheet profiles); calibrate measures it by
    # running torch's schedule on stages that compute next to nothing
    pp_handoff: float = 0.0

    def __post_init__(self) -> None:
        for d in (*self.peak_flops, *self.achievable_flops, *self.solo_flops):
            if d not in DTYPES:
                raise TPError(f"hardware profile {self.name!r}: unknown dtype {d!r} (known: {', '.join(DTYPES)})")
        if self.memory_bytes <= 0 or self.gpus_per_node < 1:
            raise TPError(f"hardware profile {self.name!r}: memory_bytes and gpus_per_node must be positive")
        if self.pp_handoff < 0:
            raise TPError(f"hardware profile {self.name!r}: pp_handoff is seconds >= 0, got {self.pp_handoff}")
        if not 0.0 <= self.comm_overlap <= 1.0:
            raise TPError(f"hardware profile {self.name!r}: comm_overlap is a share in [0, 1], got "
                          f"{self.comm_overlap}")

    def achievable(self, dtype: str) -> float:
        """Achievable FLOP/s for ``dtype`` (``fp16`` falls back to ``bf16``); 0: none."""
        return float(self.achievable_flops.get(dtype, self.achievable_flops.get("bf16", 0.0)
                                               if dtype == "fp16" else 0.0))

    def solo(self, dtype: str) -> float:
        """FLOP/s of one device while its peers idle: ``solo_flops``, else the achievable
        rate (nothing shared)."""
        return float(self.solo_flops.get(dtype, 0.0)) or self.achievable(dtype)

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
        except (KeyError, TypeError, ValueError) as exc:
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
