"""What pipeline parallelism costs, stage by stage: parameters, FLOPs, activations, p2p.

``dump-plan --pp P`` asks this module for its ``pipeline`` section.  Nothing here is a
second description of the pipeline: the stages are :func:`~tpcompile.plan.stages.plan_pipeline`'s
(the objects ``parallelize(pp=...)`` applies), the value crossing a boundary is the one
:func:`~tpcompile.analysis.boundaries.probe_boundaries` reads off a fake-tensor forward
at the microbatch's shape, and the microbatches a stage holds come from the order torch's
schedule runs its actions in.  Per stage:

* **parameters**: the blocks' and, on the first / last stage, those of the modules before
  / after the blocks (a tied embedding counts on both stages holding it); bytes per rank
  at the plan's per-rank (TP) shapes, divided by FSDP2's padded dim-0 shard with
  ``dp_shard > 1``, as :func:`~tpcompile.tools.cost_params.memory` prices them.
* **forward FLOPs per token**: what the stages were balanced by
  (:func:`~tpcompile.plan.stages.stage_costs`: ``2 x`` matmul parameters, attention's
  ``4 x seq x hidden``, the head's ``2 x vocab x hidden``), for the whole TP group.
* **activations**: what one microbatch saves for backward on this stage
  (:func:`~tpcompile.tools.cost.estimate_activations` at the microbatch's shape, split by
  block: its ``parts``), plus the stage output torch keeps for backward (not on the last
  stage), the gathered logits and the loss buffer (last stage) — times the microbatches
  the stage holds at its peak (:func:`in_flight`).
* **point-to-point**: per boundary and microbatch, the hidden state forward and its
  gradient backward (each TP rank sends its full, replicated copy to its peer).

Example:
    >>> pipe = estimate_pipeline(meta_model, plan, pp=2, batch=8, seq=128)   # doctest: +SKIP
    >>> [s["blocks"] for s in pipe["stages"]], pipe["bubble"]
    (['model.layers.0-2', 'model.layers.3'], 0.2)
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..errors import TPError
from ..plan.schedule import schedule_order
from ..plan.stages import SCHEDULES, Stage, StagePlan, plan_pipeline, schedule_spec
from ..plan.types import ParamPlan, Plan
from .cost_params import _shard_numel
from .cost_render import human_bytes, table

__all__ = ["block_range", "estimate_pipeline", "in_flight", "in_flight_parts", "render_pipeline", "schedule_order"]

_PROBE_SEQ = 16  # tokens of the probe without --seq (p2p bytes are then given per token)


# ------------------------------------------------------------------ the schedule


def in_flight(order: dict[int, list[tuple[int, str]]], stage_bytes: dict[int, float] | None = None,
              grad_bytes: dict[int, float] | None = None) -> tuple[dict[int, int], dict[int, float]]:
    """The most microbatches each stage holds at once, and each rank's peak bytes (the
    time-maximum of the sum over its stages): ``stage_bytes`` per microbatch held, plus,
    with ``grad_bytes``, a stage's gradients from its first backward on.

    A microbatch is held from its forward until its backward frees it: ``B`` (full
    backward) or, when the backward is split, ``W`` (torch keeps the graph for the weight
    gradients after the input gradients ``I``).  A stage's weight gradients appear with its
    first ``B`` or ``W`` and stay to the step's end: GPipe holds every microbatch before
    any of them, 1F1B both at once in its steady state.

    Example:
        >>> in_flight(schedule_order("1f1b", 2, 1, 4)[0])[0]
        {0: 2, 1: 1}
    """
    return in_flight_parts(order, stage_bytes, grad_bytes)[:2]


def in_flight_parts(order: dict[int, list[tuple[int, str]]], stage_bytes: dict[int, float] | None = None,
                    grad_bytes: dict[int, float] | None = None) -> tuple[
        dict[int, int], dict[int, float], dict[int, tuple[float, float]]]:
    """:func:`in_flight`, and each rank's peak split into ``(activations, gradients)``."""
    peaks: dict[int, int] = {}
    rank_peak: dict[int, float] = {}
    parts: dict[int, tuple[float, float]] = {}
    for rank, actions in order.items():
        held: dict[int, int] = {}
        grads: set[int] = set()
        acts = grad = 0.0  # running sums: a long schedule is tens of thousands of actions
        best, split = 0.0, (0.0, 0.0)
        for stage, kind in actions:
            if kind == "F":
                held[stage] = held.get(stage, 0) + 1
                peaks[stage] = max(peaks.get(stage, 0), held[stage])
                if stage_bytes is not None:
                    acts += stage_bytes[stage]
            elif kind in ("B", "W"):
                held[stage] -= 1
                if stage_bytes is not None:
                    acts -= stage_bytes[stage]
                if stage not in grads:
                    grads.add(stage)
                    grad += grad_bytes[stage] if grad_bytes is not None else 0.0
            if stage_bytes is not None and acts + grad > best:
                best, split = acts + grad, (acts, grad)
        rank_peak[rank], parts[rank] = best, split
    return dict(sorted(peaks.items())), rank_peak, parts


# ------------------------------------------------------------------ per stage


def block_range(blocks: list[str]) -> str:
    """``[model.layers.0, ..., model.layers.3]`` → ``model.layers.0-3`` (a stage's blocks are
    consecutive)."""
    if len(blocks) == 1:
        return blocks[0]
    stack, _, first = blocks[0].rpartition(".")
    last = blocks[-1].rpartition(".")[2]
    return f"{stack}.{first}-{last}"


def _param_plans(plan: Plan) -> dict[str, ParamPlan]:
    """Every parameter name, tied aliases included, to its plan."""
    out = {}
    for fqn, p in plan.params.items():
        out[fqn] = p
        out.update(dict.fromkeys(p.tied_to, p))
    return out


def _stage_params(model: nn.Module, plan: Plan, sp: StagePlan, stage: Stage,
                  dp_shard: int) -> dict[int, tuple[str, int, int, bool]]:
    """The parameters stage ``stage`` holds: ``{id: (name, numel, bytes per rank, trainable)}``."""
    plans = _param_plans(plan)
    outside = set(sp.pre if stage.first else []) | set(sp.post if stage.last else [])
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner = name.rpartition(".")[0]
        mine = owner in outside or any(name.startswith(b + ".") for b in stage.blocks)
        if not mine or id(p) in out:
            continue
        pp = plans.get(name)
        shape = list(pp.local_shape) if pp is not None and plan.tp > 1 else list(p.shape)
        out[id(p)] = (name, p.numel(), _shard_numel(shape, dp_shard) * p.dtype.itemsize, p.requires_grad)
    return out


def _activation_bytes(acts: dict[str, Any] | None, stacks: Any, stage: Stage, hidden: int) -> int | None:
    """What one microbatch saves on ``stage`` (see the module docstring)."""
    if acts is None or acts.get("bytes") is None:
        return None
    parts = acts["parts"]
    total = sum(parts["blocks"][stacks.representative(b)] for b in stage.blocks)
    total += parts["pre"] if stage.first else 0
    total += parts["post"] + acts["logits"] + acts["loss"] if stage.last else hidden  # fwd_cache's output
    return total


def _memory(params: dict[int, tuple[str, int, int, bool]], activations: int | None) -> dict[str, int | None]:
    """A rank's memory as :func:`~tpcompile.tools.cost_params.memory` prices it, plus activations."""
    weights = sum(v[2] for v in params.values())
    grads = sum(v[2] for v in params.values() if v[3])
    adamw = 2 * grads + 4 * sum(1 for v in params.values() if v[3])
    total = weights + grads + adamw + (activations or 0)
    return {"parameters": weights, "gradients": grads, "adamw_states": adamw, "activations": activations,
            "total": total}


def _check(pp: int, batch: int | None, seq: int | None, microbatches: int) -> None:
    if pp < 2:
        raise TPError(f"a pipeline needs pp >= 2, got pp={pp}")
    if (batch is None) != (seq is None):
        raise TPError("give both batch and seq (tokens per step = batch × seq), or neither")
    if batch is not None and batch % microbatches:
        raise TPError(f"a batch of {batch} sequences does not split into {microbatches} microbatches (pp_microbatches "
                      f"defaults to 2 x pp): pick a batch divisible by {microbatches} or set pp_microbatches")


def estimate_pipeline(model: nn.Module, plan: Plan, *, pp: int, schedule: str | None = None,
                      microbatches: int | None = None, virtual: int = 2, batch: int | None = None,
                      seq: int | None = None, dp_shard: int = 1, fp8: bool = False, cp: int = 1) -> dict[str, Any]:
    """The ``pipeline`` section of ``dump-plan --pp``: the stages ``parallelize(pp=...)``
    would build for ``model`` (meta) under ``plan`` (its ``tp``), priced per stage and rank.

    Args:
        model: the model on the meta device (no weights are read).
        plan: its TP plan; parameter bytes are at the plan's per-rank shapes.
        pp, schedule, microbatches, virtual: as ``parallelize``'s ``pp``, ``pp_schedule``,
            ``pp_microbatches`` (``None``: ``2 x pp``) and ``pp_virtual``.
        batch, seq: sequences per step (split into ``microbatches``) and their length;
            without them p2p bytes are per token and activations are left out.
        dp_shard: FSDP2's shard degree (divides parameter bytes); fp8: FP8 projections.
        cp: context parallelism: each rank's stages run on its slice of the sequence
            (activations as :func:`~.cost.estimate_activations` prices them at ``cp``),
            and the hidden state crosses a boundary at that slice's length, split again
            over ``tp`` under sequence parallelism (a plan with a ``sequence`` section).

    Returns a JSON-able dict: ``stages`` (blocks, modules, params, bytes per rank, FLOPs,
    activations per microbatch and in flight), ``p2p``, ``bubble``, ``ranks`` (memory per
    pp rank at the activation peak), ``in_flight_rule`` and ``notes``.

    Example:
        >>> plan = plan_model(meta_model, tp=1)                                 # doctest: +SKIP
        >>> pipe = estimate_pipeline(meta_model, plan, pp=2, schedule="1f1b", batch=4, seq=16)
        >>> pipe["p2p"]["forward_bytes"] == 4 // 4 * 16 * meta_model.config.hidden_size * 4
        True
    """
    from ..capture import capture
    from .cost import estimate_activations

    if schedule is not None:
        schedule_spec(schedule)  # a bad name fails before any work
    m = microbatches or 2 * pp
    _check(pp, batch, seq, m)
    probe = (batch // m, seq) if batch is not None else (1, _PROBE_SEQ)
    inputs = {"input_ids": torch.zeros(*probe, dtype=torch.long)}
    sp, bounds = plan_pipeline(model, list(plan.blocks), pp=pp, schedule=schedule, virtual=virtual,
                               microbatches=m, seq=probe[1], inputs=inputs)
    bounds = replace(bounds, hidden_shape=_crossing_shape(bounds, plan, cp, probe[1]))
    hidden = math.prod(bounds.hidden_shape) * bounds.hidden_dtype.itemsize  # one microbatch, as sent
    notes = []
    acts = stacks = None
    if batch is not None:
        cap = capture(model)
        stacks = cap.stacks
        acts = estimate_activations(model, plan, batch=probe[0], seq=seq, fp8=fp8, cap=cap, cp=cp)
        if acts["bytes"] is None:
            notes.append(f"activation estimate unavailable: {acts['error']}")
    else:
        notes.append("activations and p2p totals need --batch and --seq")
    order, rule = schedule_order(sp.schedule, pp, sp.virtual, m)
    per_mb = {s.index: _activation_bytes(acts, stacks, s, hidden) for s in sp.stages}
    known = all(v is not None for v in per_mb.values())
    peaks, rank_peak = in_flight(order, per_mb if known else None)
    held = {s.index: _stage_params(model, plan, sp, s, dp_shard) for s in sp.stages}
    ranks = []
    for r in range(pp):
        mine = {k: v for s in sp.stages_of_rank(r) for k, v in held[s.index].items()}  # a tied tensor once
        ranks.append({"rank": r, "stages": [s.index for s in sp.stages_of_rank(r)],
                      "memory": _memory(mine, rank_peak[r] if known else None)})
    return {"pp": pp, "schedule": sp.schedule, "torch_schedule": SCHEDULES[sp.schedule].torch_class,
            "virtual": sp.virtual, "microbatches": m, "microbatch": None if batch is None else list(probe),
            "tp": plan.tp, "dp_shard": dp_shard, "stack": sp.stack, "bubble": sp.bubble(),
            "in_flight_rule": rule, "stages": [_stage_entry(sp, s, held[s.index], per_mb[s.index], peaks)
                                               for s in sp.stages],
            "p2p": _p2p(bounds, len(sp.stages) - 1, m, probe, batch is not None), "ranks": ranks, "notes": notes,
            "activations_method": None if acts is None else
            "cost.estimate_activations at the microbatch's shape, split by block (its 'parts'), + the stage "
            "output kept for backward (not last) / logits and loss buffer (last)"}


def _stage_entry(sp: StagePlan, s: Stage, params: dict[int, tuple[str, int, int, bool]], act: int | None,
                 peaks: dict[int, int]) -> dict[str, Any]:
    """One stage's row of the section."""
    n = peaks.get(s.index, 0)
    return {"index": s.index, "rank": s.rank, "blocks": block_range(s.blocks), "block_list": s.blocks,
            "embedding": s.first and bool(sp.pre), "head": s.last and bool(sp.post),
            "modules": (sp.pre if s.first else []) + (sp.post if s.last else []),
            "params": sum(v[1] for v in params.values()), "param_bytes_per_rank": sum(v[2] for v in params.values()),
            "flops_per_token": s.flops_per_token, "in_flight": n, "activation_bytes_per_microbatch": act,
            "activation_bytes_in_flight": None if act is None else act * n}


def _crossing_shape(bounds: Any, plan: Plan, cp: int, seq: int) -> tuple[int, ...]:
    """The hidden state's shape as a rank sends it: its token dim cut to CP's local
    length (the sequence padded to ``2·cp`` chunks, two per rank) and, under sequence
    parallelism, that length split over ``tp`` (padded to a multiple of it), as
    :mod:`~tpcompile.runtime.context` and :mod:`~tpcompile.runtime.sequence` cut it."""
    stacks = plan.sequence.stacks if plan.sequence else {}
    spec = next((st for st in stacks.values() if st.first.startswith(bounds.stack + ".")), None)
    dim = spec.stream.dim if spec is not None else 1
    shape = list(bounds.hidden_shape)
    if shape[dim] != seq:
        raise TPError(f"the hidden state crossing a stage boundary has shape {tuple(shape)}: no token dim of "
                      f"{seq} at dim {dim}")
    if cp > 1:
        shape[dim] = -(-seq // (2 * cp)) * 2
    if spec is not None and plan.tp > 1:
        shape[dim] = -(-shape[dim] // plan.tp)
    return tuple(shape)


def _p2p(bounds: Any, boundaries: int, microbatches: int, probe: tuple[int, int], sized: bool) -> dict[str, Any]:
    """What crosses each boundary: the hidden state of one microbatch, and its gradient back."""
    hidden = math.prod(bounds.hidden_shape) * bounds.hidden_dtype.itemsize
    return {"boundaries": boundaries, "hidden_shape": list(bounds.hidden_shape),
            "dtype": str(bounds.hidden_dtype).removeprefix("torch."),
            "forward_bytes": hidden if sized else None, "backward_bytes": hidden if sized else None,
            "bytes_per_token": hidden // (probe[0] * probe[1]),
            "per_step_bytes": 2 * hidden * microbatches * boundaries if sized else None}


# ------------------------------------------------------------------ the text


def render_pipeline(pipe: dict[str, Any]) -> list[str]:
    """``dump-plan --pp``'s lines: the stage table, p2p, the bubble and memory per pp rank."""
    mb = pipe["microbatch"]
    size = f" of {mb[0]}×{mb[1]} tokens" if mb else ""
    out = [f"pipeline pp={pipe['pp']}, schedule {pipe['schedule']} (torch {pipe['torch_schedule']}), "
           f"{pipe['virtual']} stage(s) per rank, "
           f"{pipe['microbatches']} microbatches{size}, tp={pipe['tp']}:"]
    header = ["stage", "rank", "blocks", "also holds", "params", "bytes/rank", "fwd GFLOP/token",
              "in flight", "activations/microbatch", "held at peak"]
    rows = []
    for s in pipe["stages"]:
        act, held = s["activation_bytes_per_microbatch"], s["activation_bytes_in_flight"]
        rows.append([str(s["index"]), str(s["rank"]), s["blocks"], ", ".join(s["modules"]) or "-",
                     f"{s['params'] / 1e6:,.1f} M", human_bytes(s["param_bytes_per_rank"]),
                     f"{s['flops_per_token'] / 1e9:.3f}", str(s["in_flight"]),
                     "-" if act is None else human_bytes(act), "-" if held is None else human_bytes(held)])
    out += [f"  {line}" for line in table(header, rows)]
    p = pipe["p2p"]
    shape = f"hidden [{', '.join(map(str, p['hidden_shape']))}] {p['dtype']}"
    if p["forward_bytes"] is None:
        out.append(f"p2p per boundary: {human_bytes(p['bytes_per_token'])}/token each way ({shape} per "
                   "token; --batch/--seq for totals)")
    else:
        cuts = f"{p['boundaries']} boundar{'y' if p['boundaries'] == 1 else 'ies'}"
        out.append(f"p2p per boundary per microbatch: fwd {human_bytes(p['forward_bytes'])} ({shape}) + bwd "
                   f"{human_bytes(p['backward_bytes'])} (its gradient); per step {cuts} × "
                   f"{pipe['microbatches']} microbatches × 2 ways: {human_bytes(p['per_step_bytes'])} per TP rank")
    out.append(f"bubble: {pipe['bubble']:.1%} of the step idle; microbatches in flight per stage: "
               f"{pipe['in_flight_rule']}")
    for r in pipe["ranks"]:
        mem = r["memory"]
        out.append(f"pp rank {r['rank']} (stages {', '.join(map(str, r['stages']))}): memory "
                   f"{human_bytes(mem['total'])} = params {human_bytes(mem['parameters'])} + grads "
                   f"{human_bytes(mem['gradients'])} + AdamW {human_bytes(mem['adamw_states'])} + activations "
                   f"{'n/a' if mem['activations'] is None else human_bytes(mem['activations'])} at their peak")
    out.append("note: the cost section above prices every block on one rank (no pp); each pp rank holds only "
               "its stages, priced here")
    out += [f"note: {n}" for n in pipe["notes"]]
    return out
