"""The training step of a pipelined model, and the global gradient norm.

``model(input_ids, labels)`` cannot drive a pipeline schedule, so one call does:
:func:`pipeline_step` splits the batch into microbatches, runs forward and backward
under the model's schedule and returns the batch's loss on every rank.  On a model
without pipeline parallelism it is ``model(**batch).loss.backward()``, so a training
loop need not branch.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TPError
from ..plan.stages import SCHEDULES
from .loss import check_labels
from .markers import differing_ranks, guarded_inputs
from .pipeline import PipelineRun, shape_key, sum_tied_gradients
from .torch_backend import check_ids

__all__ = ["clip_grad_norm_", "pipeline_step"]

_IGNORE = -100  # transformers' ignore_index


def _split(batch: dict[str, Any], m: int) -> list[dict[str, Any]]:
    """``m`` microbatches of ``batch``: every tensor with the batch's leading size is
    chunked along dim 0, everything else is shared."""
    sizes = {v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    if "input_ids" in batch:
        sizes = {batch["input_ids"].shape[0]}
    if len(sizes) != 1:
        raise TPError(f"pipeline_step: the batch's tensors disagree on the batch size ({sorted(sizes)}); pass "
                      "the keyword arguments of the model's forward, each with the batch as dim 0")
    (size,) = sizes
    if size % m:
        raise TPError(f"pipeline_step: a batch of {size} does not split into pp_microbatches={m}; use a batch "
                      f"size divisible by {m}")
    out: list[dict[str, Any]] = [{} for _ in range(m)]
    for key, value in batch.items():
        parts = value.chunk(m) if isinstance(value, torch.Tensor) and value.dim() > 0 and \
            value.shape[0] == size else [value] * m
        for mb, part in zip(out, parts, strict=True):
            mb[key] = part
    for mb in out:
        mb.setdefault("use_cache", False)
    return out


def _loss_kind(model: nn.Module, labels: torch.Tensor) -> str:
    """``causal`` (labels shifted by one), ``masked`` (token labels) or ``other``."""
    kind = str(getattr(model, "loss_type", "") or "")
    if "CausalLM" in kind or (not kind and labels.dim() == 2):
        return "causal"
    return "masked" if "MaskedLM" in kind else "other"


def _weights(model: nn.Module, mbs: list[dict[str, Any]]) -> list[float]:
    """Each microbatch's share of the batch's loss: its mean loss times its share of the
    tokens the loss averages over (causal LM: labels shifted by one; masked LM: the
    labels; otherwise the samples)."""
    if any("labels" not in mb for mb in mbs):
        raise TPError("pipeline_step: the batch has no labels; the last stage computes the model's own loss "
                      "from them (pass labels=..., as for model(**batch).loss)")
    counts = []
    for mb in mbs:
        labels = mb["labels"]
        kind = _loss_kind(model, labels)
        if kind == "causal":
            counts.append(int((labels[..., 1:] != _IGNORE).sum()))
        elif kind == "masked":
            counts.append(int((labels != _IGNORE).sum()))
        else:
            counts.append(int(labels.shape[0]))
    total = sum(counts)
    if total == 0:
        raise TPError("pipeline_step: every label in the batch is ignore_index (-100): the loss is undefined")
    return [c / total for c in counts]


def _check_batch(run: PipelineRun, model: nn.Module, batch: dict[str, Any]) -> None:
    """Refuse on every stage what one stage alone would refuse, and batches that differ
    across the pipeline.

    A token id outside the vocabulary raises in the first stage's embedding, a label
    outside it in the last stage's loss; raised there alone, the other stages would wait
    in the schedule's receives until the process group times out.  So every rank checks
    the whole batch's ids and labels before the schedule runs (no collective).  And the
    first stage reads the ids while the last reads the labels: a loader that hands a
    pipeline's ranks different batches (a sampler sharding over every rank) would train
    on one batch's ids with another's labels, silently.  The first steps compare a
    checksum of the inputs over the pp group, as the TP input guard does."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and vocab > 0:
        ids = batch.get("input_ids")
        if isinstance(ids, torch.Tensor):
            check_ids(ids, vocab, "pipeline_step: input_ids")
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and not labels.is_floating_point():
            kind = _loss_kind(model, labels)
            if kind == "causal":  # the first label is never a target, as in transformers
                check_labels(labels[..., 1:], vocab, _IGNORE, "pipeline_step", shift=1)
            elif kind == "masked":
                check_labels(labels, vocab, _IGNORE, "pipeline_step")
    if run.batch_checks <= 0:
        return
    run.batch_checks -= 1
    tensors = guarded_inputs(batch.values())
    if not tensors:
        return
    differ = differing_ranks(tensors, run.pp_mesh.get_group())
    if differ:
        raise TPError(f"pipeline_step: the ranks of a pipeline received different batches (pp ranks {differ} "
                      "differ from the first stage's); every rank of a pipeline must pass the same batch (the "
                      "first stage reads its ids, the last its labels). Give each data-parallel rank the slice "
                      "tpcompile.data_parallel_rank(model) names, the same on every pp rank")


def _loss_of_output(output: torch.Tensor, target: Any) -> torch.Tensor:
    return output  # the last stage's output is the weighted loss already


def _schedule(run: PipelineRun, mb: dict[str, Any], m: int, device: torch.device) -> Any:
    """The schedule (and its ``PipelineStage``s) for microbatches shaped like ``mb``."""
    key = (m, shape_key(mb))
    if key in run.schedules:
        return run.schedules[key]
    from torch.distributed import pipelining

    shapes = run.shapes(mb)
    asked, probed = ({e.key for e in b.carried} for b in (shapes, run.bounds))
    if asked != probed:  # the stages forward what parallelize's probe found recorded
        raise TPError(f"pipeline_step: with this batch's options the model records {sorted(asked) or 'nothing'} "
                      f"for the code after its blocks, but parallelize probed it recording {sorted(probed) or 'nothing'}"
                      " (an output_* option such as output_router_logits passed per call); set it on model.config "
                      "before parallelize instead")
    # the stage metadata says which values carry a gradient: the hidden state, the carried
    # entries (router logits) and the loss
    hidden = torch.empty(shapes.hidden_shape, dtype=run.hidden_dtype or shapes.hidden_dtype, device="meta",
                         requires_grad=True)
    index = torch.empty((1,), dtype=torch.long, device="meta")
    loss = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
    group = run.pp_mesh.get_group()
    plan = run.plan

    def crossing(stage: int) -> tuple[torch.Tensor, ...]:
        """What enters stage ``stage``: the hidden state and the entries recorded before it."""
        carried = shapes.carried_before(plan.stages[stage].blocks[0])
        return (hidden, *(torch.empty(e.shape, dtype=e.dtype, device="meta", requires_grad=True) for e in carried))

    def output(sm: Any) -> Any:
        if sm.last:
            return loss
        out = crossing(sm.index + 1)
        return out if len(out) > 1 else hidden

    stages = [pipelining.PipelineStage(sm, sm.index, len(plan.stages), device,
                                       input_args=(index,) if sm.first else crossing(sm.index),
                                       output_args=output(sm), group=group)
              for sm in run.stages]
    spec = SCHEDULES[run.plan.schedule]
    cls = getattr(pipelining, spec.torch_class)
    schedule = cls(stages[0] if spec.style == "single" else stages, n_microbatches=m, loss_fn=_loss_of_output,
                   scale_grads=False)
    run.schedules[key] = schedule
    return schedule


def pipeline_step(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Forward and backward of one batch; the batch's loss (detached) on every rank.

    ``batch`` is the keyword arguments of the model's forward, labels included.  With
    ``pp > 1`` it is split into ``pp_microbatches`` run under the model's schedule; the
    gradients equal those of ``model(**batch).loss.backward()`` on the unsplit model
    (accumulated over the microbatches, reduced by FSDP2 once).  Every rank of a pipeline
    passes the same batch (compared over the pipeline in the first steps); a token id or
    label outside the vocabulary is refused on every rank before the schedule runs.
    Without pp it is exactly that backward.

    Example:
        >>> model = tpcompile.parallelize(model, pp=2, tp=2)              # doctest: +SKIP
        >>> loss = tpcompile.pipeline_step(model, {"input_ids": ids, "labels": ids})
        >>> opt.step(); opt.zero_grad()
    """
    if not isinstance(batch, dict):
        raise TPError(f"pipeline_step takes the model's keyword arguments as a dict, got {type(batch).__name__}")
    run: PipelineRun | None = getattr(model, "tpcompile_pipeline", None)
    if run is None:
        out = model(**batch)
        if getattr(out, "loss", None) is None:
            raise TPError("pipeline_step: the model returned no loss; put labels in the batch")
        out.loss.backward()
        return out.loss.detach()
    m = run.plan.microbatches
    _check_batch(run, model, batch)
    mbs = _split(batch, m)
    run.microbatches, run.weights = mbs, _weights(model, mbs)
    device = next((v.device for v in batch.values() if isinstance(v, torch.Tensor)), torch.device("cpu"))
    schedule = _schedule(run, mbs[0], m, device)
    index = torch.arange(m, device=device)
    losses: list[torch.Tensor] = []
    first = any(sm.first for sm in run.stages)
    try:
        schedule.step(*((index,) if first else ()), target=index, losses=losses, return_outputs=False, mb=index)
    finally:
        run.microbatches, run.weights = [], []
    sum_tied_gradients(run)
    total = torch.stack([x.detach().float() for x in losses]).sum() if losses else torch.zeros((), device=device)
    last_rank = run.plan.stages[-1].rank
    dist.broadcast(total, src=int(run.pp_mesh.mesh[last_rank]), group=run.pp_mesh.get_group())
    return total


def _norm_of(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The norm of ``grads`` over every rank that holds a part of them (DTensors by their
    meshes; plain tensors: this rank's)."""
    from torch.distributed.tensor import DTensor

    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh if isinstance(g, DTensor) else None, []).append(g)
    parts = []
    for mesh, group in by_mesh.items():
        norm = torch.nn.utils.get_total_norm(group, norm_type)
        parts.append(norm.full_tensor() if mesh is not None and isinstance(norm, DTensor) else norm)
    if not parts:
        return torch.zeros(())
    stacked = torch.stack([p.float() for p in parts])
    return stacked.max() if math.isinf(norm_type) else stacked.pow(norm_type).sum().pow(1.0 / norm_type)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model, pipeline stages included:
    the norm of every gradient of the unsplit model (each tied parameter counted once),
    the same on every rank; the gradients scaled in place.  Returns the total norm.

    Example:
        >>> tpcompile.pipeline_step(model, batch)                       # doctest: +SKIP
        >>> norm = tpcompile.clip_grad_norm_(model, 1.0)
    """
    run: PipelineRun | None = getattr(model, "tpcompile_pipeline", None)
    params = list({id(p): p for p in model.parameters() if p.grad is not None}.values())
    if run is None:
        norm = _norm_of([p.grad for p in params], norm_type)
    else:
        skip = {n for tie in run.ties if tie.group is not None and run.pp_rank != tie.pp_ranks[0]
                for n in tie.names}
        counted = [p.grad for n, p in model.named_parameters() if p.grad is not None and n not in skip]
        local = _norm_of(counted, norm_type)
        group = run.pp_mesh.get_group()
        if math.isinf(norm_type):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
            norm = local
        else:
            power = local.pow(norm_type)
            dist.all_reduce(power, group=group)
            norm = power.pow(1.0 / norm_type)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
