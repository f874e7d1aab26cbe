"""Pipeline stages: the blocks of one stack dealt into contiguous stages, balanced by cost.

A stage is a run of consecutive blocks; the first stage also runs what comes before the
first block (embeddings), the last what comes after the last (final norm, head, loss)
— :mod:`tpcompile.analysis.boundaries` finds both from the dataflow.  The split is the
contiguous partition that minimises the most expensive stage, each block priced by its
forward FLOPs per token (2 x its matmul parameters, plus attention's ``4 x seq x width``)
and the pre / post parts by theirs (an embedding lookup costs no FLOPs, a head
``2 x vocab x hidden``), so a 128k-vocabulary head makes the last stage take fewer blocks.

Stages go to ranks as the schedule wants: one per rank (``gpipe``, ``1f1b``), ``V`` per
rank looped (stage ``s`` on rank ``s % pp``: ``interleaved_1f1b``, ``zero_bubble``) or
V-shaped (rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``: ``zbv``, ``dualpipev``).

Example:
    >>> sp = plan_stages(costs, pp=2, schedule="interleaved_1f1b", virtual=2, microbatches=4)  # doctest: +SKIP
    >>> [s.blocks for s in sp.stages]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import TPError

__all__ = ["SCHEDULES", "ScheduleSpec", "Stage", "StagePlan", "default_schedule",
           "plan_pipeline", "plan_stages", "schedule_spec", "stage_costs"]


@dataclass(frozen=True)
class ScheduleSpec:
    """One of torch.distributed.pipelining's schedules, as tpcompile offers it."""

    name: str
    torch_class: str
    style: str  # "single": one stage per rank; "loop" / "v": several
    fixed_virtual: int | None = None  # stages per rank the schedule requires
    split_backward: bool = False  # input gradients and weight gradients as separate actions


SCHEDULES = {s.name: s for s in (
    ScheduleSpec("gpipe", "ScheduleGPipe", "single", 1),
    ScheduleSpec("1f1b", "Schedule1F1B", "single", 1),
    ScheduleSpec("interleaved_1f1b", "ScheduleInterleaved1F1B", "loop"),
    # the zero-bubble family splits backward into input gradients (sent on at once) and
    # weight gradients (run later, in what would be the bubble)
    ScheduleSpec("zero_bubble", "ScheduleInterleavedZeroBubble", "loop", split_backward=True),
    ScheduleSpec("zbv", "ScheduleZBVZeroBubble", "v", 2, split_backward=True),
    ScheduleSpec("dualpipev", "ScheduleDualPipeV", "v", 2, split_backward=True),
)}


def schedule_spec(name: str) -> ScheduleSpec:
    if name not in SCHEDULES:
        raise TPError(f"pp_schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name]


def default_schedule(n_blocks: int, pp: int, virtual: int, microbatches: int) -> str:
    """What users at scale pick: interleaved 1F1B where the model has a block for every
    stage and the microbatches fill each round (a multiple of pp), else 1F1B."""
    if n_blocks >= pp * virtual and microbatches % pp == 0 and virtual > 1:
        return "interleaved_1f1b"
    return "1f1b"


@dataclass
class Stage:
    index: int
    rank: int  # the pp rank that runs it
    blocks: list[str]
    first: bool
    last: bool
    flops_per_token: float  # forward
    param_count: int
    weight_flops_per_token: float  # the part of the forward that multiplies parameters


@dataclass
class StagePlan:
    """The stages of a pipelined model: printable (``dump-plan --pp``) and applied as is."""

    pp: int
    virtual: int
    schedule: str
    microbatches: int
    stack: str
    pre: list[str]
    post: list[str]
    stages: list[Stage] = field(default_factory=list)

    def stage_of_block(self) -> dict[str, int]:
        return {b: s.index for s in self.stages for b in s.blocks}

    def stages_of_rank(self, rank: int) -> list[Stage]:
        return [s for s in self.stages if s.rank == rank]

    def bubble(self) -> float:
        """The step's idle share, mean over the pp ranks: torch's action order for this
        schedule run against the stages' forward FLOPs (backward twice that; a split
        backward's weight pass the parameters' share of it), so the fill and drain and a
        heavier stage (a large-vocabulary head) both count (:mod:`tpcompile.plan.schedule`;
        equal stages give ``(pp - 1) / (v M + pp - 1)``)."""
        from .schedule import stage_idle_share

        return stage_idle_share(self.schedule, self.pp, self.virtual, self.microbatches,
                                {s.index: s.flops_per_token for s in self.stages}, self.weight_shares())

    def weight_shares(self) -> dict[int, float]:
        """Each stage's weight pass as a share of its backward
        (:func:`~tpcompile.plan.schedule.weight_share`)."""
        from .schedule import weight_share

        return {s.index: weight_share(s.weight_flops_per_token, s.flops_per_token) for s in self.stages}

    def to_dict(self) -> dict[str, Any]:
        return {"pp": self.pp, "virtual": self.virtual, "schedule": self.schedule,
                "microbatches": self.microbatches, "stack": self.stack, "pre": self.pre, "post": self.post,
                "bubble": round(self.bubble(), 4),
                "stages": [{"index": s.index, "rank": s.rank, "blocks": s.blocks, "first": s.first,
                            "last": s.last, "flops_per_token": s.flops_per_token,
                            "weight_flops_per_token": s.weight_flops_per_token, "params": s.param_count}
                           for s in self.stages]}


def _stage_ranks(spec: ScheduleSpec, pp: int, n_stages: int) -> list[int]:
    if spec.style == "v":
        return [s if s < pp else 2 * pp - 1 - s for s in range(n_stages)]
    return [s % pp for s in range(n_stages)]


def _partition(costs: list[float], parts: int, head: float, tail: float) -> list[int]:
    """Block counts of the contiguous split of ``costs`` into ``parts`` non-empty runs that
    minimises the largest run (``head`` added to the first, ``tail`` to the last)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the smallest possible maximum splitting the first i blocks into k runs
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0.0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                run = prefix[i] - prefix[j] + (head if j == 0 else 0.0) + (tail if i == n else 0.0)
                value = max(best[k - 1][j], run)
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        j = cut[k][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def plan_stages(blocks: list[str], block_flops: list[float], block_params: list[int], *, pp: int,
                schedule: str | None, virtual: int, microbatches: int, stack: str, pre: list[str],
                post: list[str], pre_flops: float = 0.0, post_flops: float = 0.0, pre_params: int = 0,
                post_params: int = 0, block_weight_flops: list[float] | None = None) -> StagePlan:
    """Deal ``blocks`` (costs per block) into the stages of ``schedule``; a bad degree or a
    model with fewer blocks than stages is a ``TPError``.  ``block_weight_flops``: the part
    of each block's FLOPs that multiplies parameters (default: all of it); the pre / post
    parts are all parameter products (embedding, head)."""
    weights = block_flops if block_weight_flops is None else block_weight_flops
    name = schedule or default_schedule(len(blocks), pp, virtual, microbatches)
    spec = schedule_spec(name)
    v = spec.fixed_virtual or virtual
    if spec.style != "single" and v < 2:
        raise TPError(f"pp_schedule={name!r} runs several stages per rank: pp_virtual must be >= 2, got {v}")
    n_stages = pp * v
    if len(blocks) < n_stages:
        raise TPError(f"pp={pp} with {v} stage(s) per rank needs {n_stages} stages, but the model has only "
                      f"{len(blocks)} blocks in {stack}: lower pp or pp_virtual, or pick gpipe / 1f1b")
    if microbatches < pp and name != "gpipe":
        raise TPError(f"pp_schedule={name!r} needs at least pp={pp} microbatches, got pp_microbatches="
                      f"{microbatches}")
    if spec.style == "loop" and microbatches % pp:
        raise TPError(f"pp_schedule={name!r} needs pp_microbatches divisible by pp={pp}, got {microbatches}")
    sizes = _partition(block_flops, n_stages, pre_flops, post_flops)
    ranks = _stage_ranks(spec, pp, n_stages)
    stages, start = [], 0
    for s, size in enumerate(sizes):
        run = slice(start, start + size)
        first, last = s == 0, s == n_stages - 1
        ends = (pre_flops if first else 0.0) + (post_flops if last else 0.0)  # embedding, head: all weights
        stages.append(Stage(index=s, rank=ranks[s], blocks=blocks[run], first=first, last=last,
                            flops_per_token=sum(block_flops[run]) + ends,
                            weight_flops_per_token=sum(weights[run]) + ends,
                            param_count=sum(block_params[run]) + (pre_params if first else 0)
                            + (post_params if last else 0)))
        start += size
    return StagePlan(pp=pp, virtual=v, schedule=name, microbatches=microbatches, stack=stack, pre=pre, post=post,
                     stages=stages)


def _matmul_flops(module: Any, config: Any) -> float:
    """Forward FLOPs per token of ``module``'s own parameters: ``2 x`` each matrix (an
    embedding table is looked up, not multiplied; stacked experts count their top-k share)."""
    import torch.nn as nn

    if isinstance(module, nn.Embedding):
        return 0.0
    total = 0.0
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    top_k = getattr(config, "num_experts_per_tok", None)
    for p in module.parameters(recurse=False):
        if p.dim() == 3 and experts and top_k and p.shape[0] == experts:
            total += 2.0 * p.numel() * top_k / experts
        elif p.dim() >= 2:
            total += 2.0 * p.numel()
    return total


def stage_costs(model: Any, blocks: list[str], pre: list[str], post: list[str], seq: int) -> dict[str, Any]:
    """Per-token forward FLOPs and parameter counts of every block and of the pre / post
    parts, for :func:`plan_stages` (attention adds ``4 x seq x hidden`` per block to the
    parameters' products, ``block_weight_flops``)."""
    config = getattr(model, "config", None)
    width = getattr(config, "hidden_size", 0) or 0
    flops, weights, params = [], [], []
    for name in blocks:
        block = model.get_submodule(name)
        weights.append(sum(_matmul_flops(m, config) for m in block.modules()))
        flops.append(weights[-1] + 4.0 * seq * width)
        params.append(sum(p.numel() for p in block.parameters()))

    def part(names: list[str]) -> tuple[float, int]:
        mods = [model.get_submodule(n) for n in names]
        seen: set[int] = set()
        count = 0
        for m in mods:
            for p in m.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    count += p.numel()
        return sum(_matmul_flops(m, config) for m in mods), count

    (pre_flops, pre_params), (post_flops, post_params) = part(pre), part(post)
    return {"block_flops": flops, "block_weight_flops": weights, "block_params": params, "pre_flops": pre_flops,
            "post_flops": post_flops,
            "pre_params": pre_params, "post_params": post_params}


def plan_pipeline(model: Any, blocks: list[str], *, pp: int, schedule: str | None, virtual: int,
                  microbatches: int | None, seq: int = 16, inputs: dict[str, Any] | None = None) -> tuple[
                      StagePlan, Any]:
    """The stages of ``model`` (meta or real) and the boundaries they cut at: the blocks
    and what crosses them read off one meta forward (:mod:`tpcompile.analysis.boundaries`),
    balanced by :func:`stage_costs`.  Refuses what a pipeline cannot carry, naming it."""
    from ..analysis.boundaries import probe_boundaries
    from ..capture.inputs import example_inputs

    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):
        raise TPError(f"pp > 1: {type(model).__name__} is an encoder-decoder: its decoder blocks read the encoder's "
                      "output, whose gradient would have to cross stages. Train it without pp (tp / FSDP2 / cp)")
    m = microbatches or 2 * pp
    probe_in = inputs if inputs is not None else example_inputs(model, batch=1, seq=seq)
    bounds = probe_boundaries(model, probe_in, blocks)
    costs = stage_costs(model, blocks, bounds.pre, bounds.post, seq)
    stages = plan_stages(blocks, costs["block_flops"], costs["block_params"], pp=pp, schedule=schedule,
                         virtual=virtual, microbatches=m, stack=bounds.stack, pre=bounds.pre, post=bounds.post,
                         pre_flops=costs["pre_flops"], post_flops=costs["post_flops"],
                         pre_params=costs["pre_params"], post_params=costs["post_params"],
                         block_weight_flops=costs["block_weight_flops"])
    return stages, bounds
