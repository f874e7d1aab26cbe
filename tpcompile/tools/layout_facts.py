"""What the layout search reads off a model once: per model, and per tensor-parallel degree.

:func:`~tpcompile.tools.layout.plan_layout` prices thousands of layouts; the facts they
are priced from are gathered here from the existing cost model, each at most once per
``tp`` (nothing here is per model family):

* **per model** (:func:`model_facts`): one capture; the blocks' forward FLOPs per token
  (:func:`~tpcompile.plan.stages.stage_costs`, what pipeline stages are balanced by);
  what crosses a stage boundary and which modules run before / after the blocks
  (:func:`~tpcompile.plan.stages.plan_pipeline` on a copy cut to one block of each
  structure, so a 126-layer model is probed at the cost of one); the experts.
* **per tp** (:func:`tp_facts`): the plan (:func:`~tpcompile.plan.build.plan_model`);
  parameter bytes per block at the plan's per-rank shapes, experts apart; the TP and FP8
  collectives as executed (:func:`~tpcompile.tools.cost.trace_collectives`,
  :func:`~tpcompile.tools.cost_params.fp8_issues`) in per-block, before- and after-block
  buckets; what one sequence saves for backward per block and outside them
  (:func:`~tpcompile.tools.cost.estimate_activations` at ``seq``); context
  parallelism's keys and values per block
  (:func:`~tpcompile.tools.cost_context.context_issues`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from torch import nn

from ..capture import Capture, capture
from ..errors import TPError
from ..plan.types import Plan, Role
from .cost_params import Issue, local_shape

__all__ = ["Bucketed", "ModelFacts", "TPFacts", "context_capture_or_reason", "fp8_activation_ratio", "model_facts",
           "sequence_parallel_refused", "tp_facts"]

_PROBE_TOKENS = 16  # plan_pipeline's example input: batch 1, seq 16


@dataclass
class Bucketed:
    """Collectives of one kind of place: ``(phase, op, group, calls, bytes per token,
    fixed bytes)`` per call site; for ``block``, calls are per block (averaged over the
    stack), for ``pre`` / ``post`` per step of the part before / after the blocks."""

    block: list[tuple[str, str, str, float, float, float]] = field(default_factory=list)
    pre: list[tuple[str, str, str, float, float, float]] = field(default_factory=list)
    post: list[tuple[str, str, str, float, float, float]] = field(default_factory=list)


@dataclass
class ModelFacts:
    """Per-model facts (see the module docstring); ``pp_refused``: why no pipeline."""

    model: nn.Module
    name: str
    cap: Capture
    seq: int
    blocks: list[str]
    pre: list[str]
    post: list[str]
    stack: str
    hidden_bytes_per_token: float  # the stream a block takes and a stage sends
    block_flops: list[float]  # forward, per token at ``seq``, whole TP group
    block_weight_flops: list[float]  # the part of ``block_flops`` that multiplies parameters
    block_params: list[int]
    pre_flops: float
    post_flops: float
    pre_params: int
    post_params: int
    pp_refused: str | None
    itemsize: int  # the parameters' dtype
    width: int  # config.hidden_size (the tokens experts receive)
    top_k: int  # experts per token
    stage_cache: dict[tuple[int, int], Any] = field(default_factory=dict)

    @property
    def model_flops_per_token(self) -> float:
        """Forward FLOPs per token of the whole model (the MFU numerator's ``F``)."""
        return sum(self.block_flops) + self.pre_flops + self.post_flops


@dataclass
class TPFacts:
    """Per-tp facts: bytes are per rank at the plan's shapes; activations per sequence."""

    tp: int
    plan: Plan
    dense_bytes: list[int]  # per block, experts excluded
    expert_bytes: list[int]
    fp8_weight_bytes: list[int]  # per block: weights FSDP2 would gather in FP8
    tensors: list[int]  # per block: trainable tensors (AdamW's step)
    pre_bytes: int
    post_bytes: int
    pre_tensors: int
    post_tensors: int
    root_bytes: int  # outside the blocks, each tensor once (FSDP2's root unit)
    root_tensors: int
    flops: list[float]  # per block, forward per token, this rank's share
    post_flops: float
    fp8_fraction: float  # of this rank's forward FLOPs that FP8 projections run
    comm: Bucketed
    fp8_comm: Bucketed
    enter_bytes: list[float]  # per block: inputs entering TP regions, bytes per token
    acts: dict[str, Any]  # {"block": [...], "pre", "post", "logits", "loss"} per sequence at seq
    kv_bytes: list[float] = field(default_factory=list)  # per block: K + V per token, TP-local (cp)
    kv_calls: float = 0.0  # gathers per block
    experts: int = 0  # experts per MoE layer (0: dense)
    moe_layers: int = 0
    warnings: list[str] = field(default_factory=list)


def _block_of(name: str, index: dict[str, int]) -> int | None:
    """The block a parameter / module name lies in (``index``: block name -> position)."""
    parts = name.split(".")
    for k in range(1, len(parts) + 1):
        hit = index.get(".".join(parts[:k]))
        if hit is not None:
            return hit
    return None


def _probe(model: nn.Module, cap: Capture, blocks: list[str]) -> tuple[Any, str | None]:
    """The pipeline boundaries, read on the model with each stack cut to one block of
    every structure (restored after); ``(bounds or None, why pp is refused or None)``."""
    from ..analysis.boundaries import stack_of
    from ..plan.stages import plan_pipeline

    try:
        stack = stack_of(blocks, type(model).__name__)
    except TPError as exc:
        return None, str(exc)
    mlist = model.get_submodule(stack)
    reps = cap.stacks.members.get(stack) or list(range(len(blocks)))
    keep = min(len(blocks), max(2, max(reps) + 1))
    saved = mlist._modules
    try:
        mlist._modules = dict(list(saved.items())[:keep])
        _, bounds = plan_pipeline(model, blocks[:keep], pp=2, schedule="1f1b", virtual=1, microbatches=2)
    except TPError as exc:
        return None, str(exc)
    except Exception as exc:  # noqa: BLE001 - the cut copy may not run: probe the whole model
        mlist._modules = saved
        try:
            _, bounds = plan_pipeline(model, blocks, pp=2, schedule="1f1b", virtual=1, microbatches=2)
        except TPError as err:
            return None, str(err)
        except Exception as err:  # noqa: BLE001 - any model code may refuse the fake forward
            return None, f"the pipeline probe failed: {type(err).__name__}: {err} (first: {exc})"
    finally:
        mlist._modules = saved
    return bounds, None


def model_facts(model: nn.Module, *, seq: int, name: str = "") -> ModelFacts:
    """Capture ``model`` (meta) once and read the per-model facts at sequence length ``seq``."""
    from ..plan.stages import stage_costs

    cap = capture(model)
    blocks = [f"{stack}.{i}" for stack, reps in cap.stacks.members.items() for i in range(len(reps))]
    if not blocks:
        raise TPError(f"{type(model).__name__}: no repeated blocks found; the layout search prices per block")
    bounds, refused = _probe(model, cap, blocks) if len(blocks) >= 2 else (None, "a single block")
    config = getattr(model, "config", None)
    itemsize = next(model.parameters()).dtype.itemsize
    if bounds is not None:
        pre, post, stack = bounds.pre, bounds.post, bounds.stack
        # the probe ran one sequence of _PROBE_TOKENS (plan_pipeline's example input)
        hidden = math.prod(bounds.hidden_shape) / _PROBE_TOKENS * bounds.hidden_dtype.itemsize
    else:  # no pipeline: every module outside the blocks is "before", the stream is hidden_size wide
        index = dict.fromkeys(blocks, 0)
        pre = sorted({n.rpartition(".")[0] for n, _ in model.named_parameters() if _block_of(n, index) is None})
        post, stack = [], blocks[0].rpartition(".")[0]
        hidden = float((getattr(config, "hidden_size", 0) or 0) * itemsize)
    costs = stage_costs(model, blocks, pre, post, seq)
    return ModelFacts(
        model=model, name=name or type(model).__name__, cap=cap, seq=seq, blocks=blocks, pre=pre, post=post,
        stack=stack, hidden_bytes_per_token=hidden, block_flops=costs["block_flops"],
        block_weight_flops=costs["block_weight_flops"], block_params=costs["block_params"], pre_flops=costs["pre_flops"], post_flops=costs["post_flops"],
        pre_params=costs["pre_params"], post_params=costs["post_params"], pp_refused=refused, itemsize=itemsize,
        width=int(getattr(config, "hidden_size", 0) or 0),
        top_k=int(getattr(config, "num_experts_per_tok", 0) or 1))


# ------------------------------------------------------------------ per tp


def _bucket(issues: list[Issue], mf: ModelFacts) -> Bucketed:
    index = {b: i for i, b in enumerate(mf.blocks)}
    pre = set(mf.pre)
    out = Bucketed()
    n = len(mf.blocks)
    for i in issues:
        entry = (i.phase, i.op, i.group, float(i.count), float(i.bytes_per_token), float(i.fixed_bytes))
        if _block_of(i.source, index) is not None:
            out.block.append((*entry[:3], i.count / n, *entry[4:]))
        elif i.source in pre or any(i.source.startswith(p + ".") for p in pre):
            out.pre.append(entry)
        else:  # the loss, the final norm, the head, FP8's per-step scale
            out.post.append(entry)
    return out


def _params(mf: ModelFacts, plan: Plan) -> dict[str, Any]:
    """Per-rank parameter bytes per block (experts apart) and outside the blocks."""
    from .cost_params import fp8_gathered
    from .cost_pipeline import _param_plans

    model, n = mf.model, len(mf.blocks)
    plans = _param_plans(plan)  # tied aliases too: a tied head is the embedding's shard

    def shape_of(name: str, p: nn.Parameter) -> list[int]:
        pp = plans.get(name)
        return list(pp.local_shape) if pp is not None and plan.tp > 1 else list(p.shape)

    index = {b: i for i, b in enumerate(mf.blocks)}
    experts = {(m, p) for m, xp in plan.experts.items() for p in xp.params}
    gathered = fp8_gathered(model, plan)
    out: dict[str, Any] = {k: [0] * n for k in ("dense", "expert", "fp8", "tensors", "local", "global")}
    root = root_tensors = 0
    pre, post = set(mf.pre), set(mf.post)
    side = {"pre": 0, "post": 0, "pre_tensors": 0, "post_tensors": 0}
    seen: dict[str, set[int]] = {"pre": set(), "post": set()}
    for name, p in model.named_parameters(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        size = math.prod(shape_of(name, p)) * p.dtype.itemsize
        b = _block_of(name, index)
        if b is None:
            for part, mods in (("pre", pre), ("post", post)):  # a tied tensor counts on both sides
                if owner in mods and id(p) not in seen[part]:
                    seen[part].add(id(p))
                    side[part] += size
                    side[f"{part}_tensors"] += int(p.requires_grad)
            continue
        if (owner, leaf) in experts:
            out["expert"][b] += size
        else:
            out["dense"][b] += size
        out["fp8"][b] += size if name in gathered else 0
        out["tensors"][b] += int(p.requires_grad)
        if p.dim() >= 2:
            out["local"][b] += math.prod(shape_of(name, p))
            out["global"][b] += p.numel()
    for name, p in model.named_parameters():  # each tensor once: FSDP2's root unit
        if _block_of(name, index) is None:
            root += math.prod(shape_of(name, p)) * p.dtype.itemsize
            root_tensors += int(p.requires_grad)
    return {**out, **side, "root": root, "root_tensors": root_tensors}


def _head_share(plan: Plan) -> float:
    """This rank's share of the LM head's FLOPs (its vocabulary shard)."""
    head = next((p for p in plan.params.values() if p.role is Role.LM_HEAD), None)
    if head is None or plan.tp == 1:
        return 1.0
    return math.prod(head.local_shape) / math.prod(head.global_shape)


def _fp8_fraction(mf: ModelFacts, plan: Plan, flops: float) -> float:
    from ..runtime.fp8 import fp8_modules

    total = 0.0
    for name in fp8_modules(mf.model, plan):
        w = mf.model.get_submodule(name).weight
        total += 2.0 * math.prod(local_shape(plan, f"{name}.weight", w))
    return min(1.0, total / flops) if flops else 0.0


def _acts(mf: ModelFacts, plan: Plan, seq: int, fp8: bool = False) -> dict[str, Any]:
    from .cost import estimate_activations

    a = estimate_activations(mf.model, plan, batch=1, seq=seq, cap=mf.cap, fp8=fp8)
    if a["bytes"] is None:
        raise TPError(f"activation estimate unavailable: {a['error']}")
    parts, rep = a["parts"], mf.cap.stacks.representative
    return {"block": [float(parts["blocks"][rep(b)]) for b in mf.blocks], "pre": float(parts["pre"]),
            "post": float(parts["post"]), "logits": float(a["logits"]), "loss": float(a["loss"])}


def tp_facts(mf: ModelFacts, tp: int, *, context: Capture | None) -> TPFacts:
    """Plan ``mf.model`` at ``tp`` and read its per-tp facts (see the module docstring);
    ``context``: the model's context-parallel capture, to price CP's keys and values."""
    from ..plan import plan_model
    from .cost import trace_collectives
    from .cost_params import fp8_gathered, fp8_issues

    plan = plan_model(mf.model, tp)
    params = _params(mf, plan)
    ratio = [loc / glob if glob else 1.0 for loc, glob in zip(params["local"], params["global"], strict=True)]
    flops = [f * r for f, r in zip(mf.block_flops, ratio, strict=True)]
    post_flops = mf.post_flops * _head_share(plan)
    issues, _ = trace_collectives(mf.model, plan, mf.cap)
    comm = _bucket(issues, mf)
    n = len(mf.blocks)
    index = {b: i for i, b in enumerate(mf.blocks)}
    # the inputs entering TP regions (their gradients all-reduced): what a column module
    # saves whole even under sequence parallelism, bytes per token per block
    enter = float(sum(i.count * i.bytes_per_token for i in issues if i.what.startswith("grad of input")
                      and _block_of(i.source, index) is not None)) / n
    fp8_comm = _bucket(fp8_issues(mf.model, plan, fp8_gathered(mf.model, plan)), mf)
    facts = TPFacts(
        tp=tp, plan=plan, dense_bytes=params["dense"], expert_bytes=params["expert"],
        fp8_weight_bytes=params["fp8"], tensors=params["tensors"], pre_bytes=params["pre"],
        post_bytes=params["post"], pre_tensors=params["pre_tensors"], post_tensors=params["post_tensors"],
        root_bytes=params["root"], root_tensors=params["root_tensors"], flops=flops,
        post_flops=post_flops, fp8_fraction=_fp8_fraction(mf, plan, sum(flops) + post_flops), comm=comm,
        fp8_comm=fp8_comm, enter_bytes=[enter] * n, acts=_acts(mf, plan, mf.seq), warnings=list(plan.warnings))
    if plan.experts:
        facts.experts = next(iter(plan.experts.values())).num_experts
        facts.moe_layers = len(plan.experts)
    if context is not None:
        from .cost_context import context_issues

        gathers = [i for i in context_issues(mf.model, plan, 2, cap=context)
                   if i.op == "all_gather" and i.phase == "forward"]
        kv = sum(Fraction(i.count) * i.bytes_per_token * 2 for i in gathers) / n  # local = per rank x cp
        facts.kv_bytes = [float(kv)] * n
        facts.kv_calls = sum(i.count for i in gathers) / n
    return facts


def fp8_activation_ratio(mf: ModelFacts, facts: TPFacts) -> float:
    """What FP8 projections do to the blocks' saved tensors: the ratio of one estimate
    with FP8 to one without, at ``facts.tp`` (the search applies it at every tp)."""
    with_fp8 = _acts(mf, facts.plan, mf.seq, fp8=True)
    base = sum(facts.acts["block"])
    return sum(with_fp8["block"]) / base if base else 1.0


def sequence_parallel_refused(mf: ModelFacts, facts: TPFacts) -> str | None:
    """Why ``sequence_parallel=True`` splits nothing for this model (None: it does),
    planned once at ``facts.tp``."""
    from ..plan.sequence import plan_sequence

    if facts.tp < 2:
        return "needs tp > 1"
    try:
        seq = plan_sequence(mf.model, facts.plan)
    except Exception as exc:  # noqa: BLE001 - an optimization: never a crash
        return f"{type(exc).__name__}: {exc}"
    if not seq.stacks:
        why = next(iter(seq.refused.values()), "no stack could be split")
        return f"sequence parallelism splits no stack ({why})"
    return None


def context_capture_or_reason(model: nn.Module) -> tuple[Capture | None, str | None]:
    """The context-parallel capture, or why context parallelism cannot run the model."""
    from ..plan.context import context_capture

    try:
        return context_capture(model)[0], None
    except Exception as exc:  # noqa: BLE001 - any model code may refuse the capture
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"

