"""The layout chosen for you: every layout a model admits on N GPUs, priced and ranked.

``plan_layout(model, gpus=64, hardware="h100-80gb", batch=64, seq=8192)`` enumerates
the degrees ``tp x pp x cp x dp_shard x dp_replicate = gpus`` (with ``ep`` carved from
``dp_shard``), sequence parallelism, activation checkpointing, FP8 and, for pipelines,
schedule and microbatches; drops what the model or ``parallelize`` does not admit
(saying why), prices the rest from the existing cost model (nothing per model family:
everything is read from the plan, the config and the fake-tensor estimates; see
:mod:`~tpcompile.tools.layout_facts`), drops what does not fit in memory and ranks the
rest by predicted step time.

**Memory per rank** (the peak rank of a pipeline): parameters, gradients and AdamW (two
states in the parameter dtype and a float32 step per tensor) at the plan's TP shapes
sharded over ``dp_shard x cp`` (FSDP2); FSDP2's unsharded buffers (the root unit kept
gathered, the unit computing and the one prefetched, one unit's gradients; under a
pipeline torch keeps a stage's parameters unsharded across microbatches, and its
unsharded gradients from its first backward on); the activations of the microbatches in
flight (what one sequence saves per block, from
:func:`~tpcompile.tools.cost.estimate_activations`; with activation checkpointing each
block's input plus one block recomputing) — under a pipeline torch's schedule order is
replayed, and activations and gradients are taken where their sum peaks. It must fit in the
profile's memory less ``headroom`` (allocator fragmentation, CUDA context, NCCL buffers).

**Step time** = compute + communication not hidden + pipeline bubble:

* compute: FLOPs of the step on the busiest rank (forward FLOPs per token of its blocks,
  :func:`~tpcompile.plan.stages.stage_costs` at this rank's TP share, times 3 for forward
  and backward (= 2x forward), plus one forward of the blocks with activation
  checkpointing) / the profile's achievable rate (FP8 projections at the FP8 rate);
* TP (and SP: its reduce-scatter + all-gather move what the all-reduce did), context
  parallelism's key / value gathers and expert parallelism's all-to-alls are **exposed**
  (they sit between the matmuls that need them; no async TP, no comm/compute overlap);
* FSDP2 / HSDP: all-gathers are prefetched and reduce-scatters run during backward, so
  they hide behind compute, except the root's first all-gather and last reduce-scatter
  (and all-reduce across replicas); what exceeds the step's compute is exposed, and of
  the rest only the profile's ``comm_overlap`` share hides (1 on GPUs; gloo on a CPU
  host computes and communicates on the same cores).  Under a pipeline every unit's
  reduction is exposed: torch's ``PipelineStage`` runs them after the last backward;
* pipeline: the bubble ``f / (1 - f)`` of the busiest rank's time, ``f`` its idle share
  when torch's action order for the schedule runs against each stage's time per
  microbatch (:func:`~tpcompile.plan.schedule.simulate_stages`), and the point-to-point
  hand-offs: what the same order lasts longer when each transfer costs its receiver the
  p2p link's time for the hidden state.  Where
  devices share compute (the profile's ``solo_flops``: ranks on one host's cores), a
  busy rank computes at the solo rate while its peers idle: the step is ``(solo compute
  + exposed comm) / (1 - f)``, never less than the busy time at the shared rate;
* collectives: each at its own ``(bandwidth, latency)`` where the link lists it
  (``Link.ops``), else the link's;
* links: the mesh is ``(pp, dp_replicate, dp_shard, cp, tp)``, innermost last, ranks in
  order, ``gpus_per_node`` per node: a dim whose ranks span more than a node uses the
  profile's ``inter_node`` link, else ``intra_node``; tp never leaves a node.

MFU = ``3 x model FLOPs per token x batch x seq / (step time x gpus x peak(dtype))``
(recomputation not counted, FP8 runs against the ``dtype`` peak).

Not modelled: kernel efficiency varying with shapes (small microbatches, narrow TP
shards), the optimizer step, data loading, stragglers, NCCL's SM contention with compute,
gradient accumulation (the batch runs in one step, split only into pipeline
microbatches), activation / CPU offload, fp32 master weights (parameters stay in the
model's dtype, as the cost section prices them).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from ..config import check_degree
from ..errors import TPError
from ..plan.layout import Layout  # plan-stage data: the front doors apply it, this module ranks it
from .hardware import HardwareProfile, device_profile, get_profile

__all__ = ["Layout", "LayoutReport", "Prediction", "choose_layout", "plan_layout", "price_layouts"]


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """A priced layout: memory per rank (bytes, the peak rank), step time (s) by part."""

    layout: Layout
    memory: dict[str, float]
    time: dict[str, float]
    mfu: float
    tokens_per_s: float
    fits: bool
    inter_node: tuple[str, ...] = ()  # the mesh dims whose groups cross nodes

    def to_dict(self) -> dict[str, Any]:
        return {"layout": asdict(self.layout), "label": self.layout.label(),
                "parallelize": self.layout.parallelize_kwargs(), "memory": self.memory,
                "time": self.time, "mfu": self.mfu, "tokens_per_s": self.tokens_per_s, "fits": self.fits,
                "inter_node": list(self.inter_node)}


@dataclass(kw_only=True)
class LayoutReport:
    """What :func:`plan_layout` found: the fastest layouts that fit, and why the rest lost."""

    model: str
    gpus: int
    gpus_per_node: int
    hardware: str
    batch: int
    seq: int
    dtype: str
    usable_memory: float
    ranked: list[Prediction]  # fit, fastest first (best schedule per layout), the top ones
    fitting: int  # distinct layouts that fit
    priced: int  # layouts priced (every schedule and microbatch count)
    unfit: list[Prediction] = field(default_factory=list)  # the fastest that do not fit
    unfit_count: int = 0
    refused: dict[str, int] = field(default_factory=dict)  # why not admitted -> degree combinations
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("model", "gpus", "gpus_per_node", "hardware", "batch", "seq", "dtype",
                                             "usable_memory", "fitting", "priced", "unfit_count", "refused",
                                             "notes", "seconds")}
        return {**out, "ranked": [p.to_dict() for p in self.ranked], "unfit": [p.to_dict() for p in self.unfit]}

    def render(self) -> str:
        from .layout_render import render_report

        return render_report(self)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _resolve_model(model: Any) -> tuple[nn.Module, str]:
    """A meta model from a module, a transformers config, a preset name or a config path."""
    from transformers import PreTrainedConfig

    from . import presets

    if isinstance(model, nn.Module):
        return model, type(model).__name__
    if isinstance(model, PreTrainedConfig):
        return presets.build_meta_model_from_config(model), type(model).__name__
    if isinstance(model, str):
        try:
            return presets.build_meta_model(presets.get_preset(model)), model
        except KeyError:
            try:
                config = presets.load_config_path(model)
            except (FileNotFoundError, ValueError) as exc:
                raise TPError(f"{model!r} is neither a preset ({', '.join(presets.list_presets())}) nor a "
                              f"config: {exc}") from None
            return presets.build_meta_model_from_config(config), model
    raise TPError(f"plan_layout takes a model, a transformers config or a preset name, got {type(model).__name__}")


def plan_layout(model: Any, *, gpus: int, hardware: str | HardwareProfile, batch: int | None = None,
                seq: int, gpus_per_node: int | None = None, dtype: str = "bf16", top: int = 10,
                headroom: float = 0.1, fp8: bool = False) -> LayoutReport:
    """Rank the layouts ``model`` admits on ``gpus`` devices by predicted step time.

    Args:
        model: a model (meta device is best: nothing is materialized), a transformers
            config, a preset name (``"llama-70b"``) or a config path.
        gpus: devices of the job; every layout's degrees multiply to it.
        hardware: a built-in profile name (``h100-80gb``, ``h200``, ``a100-80gb``,
            ``b200``, ``cpu``), a profile JSON file or a :class:`HardwareProfile`.
        batch: sequences per optimizer step over the whole job (the global batch;
            default: ``gpus``); each data-parallel rank gets ``batch / dp``.
        seq: tokens per sequence.
        gpus_per_node: default: the profile's.
        dtype: the compute dtype whose rate prices the matmuls and whose peak MFU is
            measured against (``bf16``, ``fp16``, ``fp32``).
        top: how many layouts to report.
        headroom: the share of device memory left unused (fragmentation, CUDA context,
            NCCL buffers).
        fp8: also search FP8 projections (torchao, ``parallelize(fp8=True)``) where the
            hardware has an FP8 rate; off by default, as FP8 changes the numerics.

    Returns a :class:`LayoutReport`; ``report.best.layout.parallelize_kwargs()`` builds
    the winner.

    Example:
        >>> report = plan_layout("llama-70b", gpus=64, hardware="h100-80gb", batch=64, seq=8192)  # doctest: +SKIP
        >>> report.best.layout.label(), round(report.best.mfu, 2)
        ('tp1 dp_shard64 ac', 0.37)
        >>> model = tpcompile.parallelize(model, **report.best.layout.parallelize_kwargs())
    """
    from .layout_search import search

    start = time.perf_counter()
    check_degree("top", top)
    job = _job(model, gpus=gpus, hardware=hardware, batch=batch, seq=seq, gpus_per_node=gpus_per_node, dtype=dtype,
               headroom=headroom)
    report = search(**job, top=top, fp8=fp8)
    report.seconds = time.perf_counter() - start
    return report


def price_layouts(model: Any, layouts: list[Layout], *, gpus: int, hardware: str | HardwareProfile,
                  batch: int | None = None, seq: int, gpus_per_node: int | None = None, dtype: str = "bf16",
                  headroom: float = 0.1) -> list[Prediction]:
    """The predictions of the given layouts, priced exactly as :func:`plan_layout` prices
    them (same arguments), in their order; a layout the search would not admit raises a
    TPError saying why.  For comparing your layout with the search's best, or the
    predictions with measured runs (``benchmarks/layout_rank.py``).

    Example:
        >>> preds = price_layouts("llama-8b", [Layout(tp=8), Layout(dp_shard=8)], gpus=8,  # doctest: +SKIP
        ...                       hardware="h100-80gb", seq=8192)
        >>> [round(p.time["total"], 2) for p in preds]
    """
    from .layout_search import price_given

    if not layouts:
        raise TPError("price_layouts needs at least one Layout")
    job = _job(model, gpus=gpus, hardware=hardware, batch=batch, seq=seq, gpus_per_node=gpus_per_node, dtype=dtype,
               headroom=headroom)
    return price_given(job.pop("model"), list(layouts), **job)


def _job(model: Any, *, gpus: int, hardware: str | HardwareProfile, batch: int | None, seq: int,
         gpus_per_node: int | None, dtype: str, headroom: float) -> dict[str, Any]:
    """The search's checked inputs: the meta model and its name, the profile, the job."""
    hw = get_profile(hardware)
    gpn = gpus_per_node or hw.gpus_per_node
    batch = gpus if batch is None else batch
    for key, value in (("gpus", gpus), ("seq", seq), ("gpus_per_node", gpn), ("batch", batch)):
        check_degree(key, value)
    if hw.achievable(dtype) <= 0:
        raise TPError(f"hardware {hw.name!r} has no {dtype} rate; dtypes it has: {', '.join(hw.achievable_flops)}")
    meta, name = _resolve_model(model)
    return {"model": meta, "name": name, "hw": hw, "gpus": gpus, "gpn": gpn, "batch": batch, "seq": seq,
            "dtype": dtype, "usable": hw.memory_bytes * (1 - headroom)}


def choose_layout(model: nn.Module, *, gpus: int, gpus_per_node: int | None, hardware: str | HardwareProfile | None,
                  batch: int | None, seq: int, device: str = "cpu") -> dict[str, Any]:
    """The layout ``tpcompile.parallelize(layout="auto")`` applies: :func:`plan_layout`'s
    best, as the fields of its ``model.tpcompile_layout`` record.

    ``hardware=None`` prices the job on ``device``'s profile (the CUDA device's built-in
    one, else ``cpu``); the model is searched as a meta copy, so its weights are never
    touched.  Raises a TPError naming the fastest layout that does not fit, and its
    memory per rank, when none fits.

    Example:
        >>> choose_layout(model, gpus=2, gpus_per_node=None, hardware="cpu", batch=None, seq=16)["label"]
        'tp1 dp_shard2'
    """
    from ..analysis.boundaries import meta_copy

    hw = get_profile(hardware if hardware is not None else device_profile(device))
    # a copy even of a meta model: what parallelize records about it (delayed init) stays as it was
    report = plan_layout(meta_copy(model), gpus=gpus, hardware=hw, batch=batch, seq=seq, gpus_per_node=gpus_per_node,
                         top=1)
    best = report.best
    if best is None:
        raise TPError(_none_fits(report))
    return {"parallelize": best.layout.record_keywords(), "label": best.layout.label(), "hardware": hw.name,
            "gpus": gpus, "gpus_per_node": report.gpus_per_node, "seq": seq, "batch": report.batch,
            "dtype": report.dtype,
            "predicted": {"step_seconds": best.time["total"], "memory_bytes": best.memory["total"],
                          "mfu": best.mfu, "tokens_per_s": best.tokens_per_s}}


def _none_fits(report: LayoutReport) -> str:
    from .cost_render import human_bytes

    job = (f"no layout of {report.model} fits {report.gpus} x {report.hardware} at batch {report.batch} x seq "
           f"{report.seq}")
    if not report.unfit:
        why = "; ".join(list(report.refused)[:3]) or "nothing is admitted"
        return f"{job}: none is admitted ({why})"
    lose = report.unfit[0]  # the fastest of those that do not fit
    return (f"{job}: the fastest, {lose.layout.label()}, needs {human_bytes(lose.memory['total'])} per rank of "
            f"{human_bytes(report.usable_memory)} usable; raise the GPU count, lower batch= or seq=, or pass "
            "hardware= a profile with more memory")
