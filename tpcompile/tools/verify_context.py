"""``verify --cp C``: check context parallelism on a shrunk copy, per module.

``tp x cp`` gloo processes each build the same seeded model, keep an unsplit copy,
``parallelize(tp=tp, cp=cp)`` the other and hand both the same batch.  Compared per
module: its forward output on this rank's positions (two mirrored chunks of the padded
sequence, :meth:`~tpcompile.runtime.context.ContextParallel.index`; positions past the
caller's length are CP's padding and skipped) and, under TP, on the features this rank
holds; every parameter gradient (FSDP2's shards over ``dp_shard x cp`` gathered back to
this rank's TP shard, then mapped to the HF rows it holds, as ``verify --tp`` does); the
loss and the model outputs put back in order (:func:`~tpcompile.runtime.gather_sequence`).
``generate`` is skipped: a CP model refuses a KV cache.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import PreTrainedConfig

from .verify import (
    Check,
    _check,
    _forward_check,
    _inject_fault,
    _inputs,
    _loss,
    _output_tensors,
    _run_recorded,
    _sharded_rows,
    build_small_model,
)

__all__ = ["cp_worker"]

_INF = Check(abs=float("inf"), rel=float("inf"))


def _positions(g: torch.Tensor, w: torch.Tensor, mine: torch.Tensor, length: int) -> tuple | None:
    """``(g, w)`` restricted to this rank's real positions: the dim where ``g`` holds the
    rank's ``len(mine)`` positions and ``w`` the caller's ``length`` (or a dim merging
    batch rows with positions, ``[b·s, ...]``).  ``None`` when there is no such dim."""
    real = mine < length
    for d in range(min(g.dim(), w.dim())):
        if g.shape[d] == mine.numel() and w.shape[d] == length:
            return g.index_select(d, real.nonzero().flatten()), w.index_select(d, mine[real])
    if g.dim() and w.dim() and g.shape[0] % mine.numel() == 0 and w.shape[0] % length == 0 \
            and g.shape[0] // mine.numel() == w.shape[0] // length > 0:
        b = w.shape[0] // length  # batch rows merged into the positions (MoE experts' inputs)
        gg, ww = g.reshape(b, mine.numel(), *g.shape[1:]), w.reshape(b, length, *w.shape[1:])
        return gg[:, real], ww[:, mine[real]]
    return None


def _forward(got: list[torch.Tensor], want: list[torch.Tensor], rows: dict, mine: torch.Tensor,
             length: int) -> Check | None:
    """One module's outputs call by call, on this rank's positions (then TP features)."""
    if len(got) != len(want) and want:
        return _INF
    result: Check | None = None
    for g, w in zip(got, want, strict=False):
        pair = _positions(g, w, mine, length) if g.shape != w.shape else (g, w)
        if pair is None:
            continue
        c = _forward_check([pair[0]], [pair[1]], rows)
        if c is not None:
            result = c if result is None else result.worst(c)
    return result


def _tp_local_grad(grad: torch.Tensor) -> torch.Tensor:
    """This rank's TP shard of a gradient: FSDP2's data-parallel shards gathered back."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(grad, DTensor):
        return grad
    names = grad.device_mesh.mesh_dim_names or ()
    keep = [p if name == "tp" else Replicate() for name, p in zip(names, grad.placements, strict=True)]
    return grad.redistribute(grad.device_mesh, keep).to_local()


def _grad(p: torch.Tensor, ref: torch.Tensor, plan: Any, tp_rank: int) -> Check:
    got, want = p.grad, ref.grad
    if got is None or want is None:
        return Check() if got is None and want is None else _INF
    got = _tp_local_grad(got)
    index = plan.index() if plan is not None and plan.shard_dim is not None else None
    if index is None or tuple(got.shape) == tuple(want.shape):
        return _check(got, want)
    rows = torch.as_tensor(index[tp_rank])
    keep, dim = rows >= 0, plan.shard_dim
    if got.shape[dim] != rows.numel():
        return _INF
    return _check(got.index_select(dim, keep.nonzero().flatten()), want.index_select(dim, rows[keep]))


def cp_worker(rank: int, world: int, config: PreTrainedConfig, task: str | None, opts: dict[str, Any]) -> dict:
    """One rank of ``verify --cp``: build, copy, parallelize, forward + backward, compare."""
    from transformers.utils import logging as hf_logging

    from ..api import parallelize
    from ..runtime import gather_sequence

    hf_logging.set_verbosity_error()
    tp, cp = opts["tp"], opts["cp"]
    torch.manual_seed(0)  # same seed on every rank: identical full weights
    model = build_small_model(config, tp=tp, layers=opts["layers"], task=task, attn=opts["attn"],
                              dtype=opts.get("dtype", "float32"))
    ref = copy.deepcopy(model)
    batch = _inputs(ref, torch.Generator().manual_seed(1))
    names = [n for n, m in ref.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    result: dict[str, Any] = {"model_class": type(model).__name__, "config": model.config.to_diff_dict(),
                              "warnings": [], "generate": {"status": "skipped: a CP model refuses a KV cache"}}
    try:
        model = parallelize(model, tp=tp, cp=cp, sequence_parallel=opts.get("sequence_parallel", False))
    except Exception as exc:  # reported, not raised: the user wants to know why
        result["error"] = f"parallelize failed: {type(exc).__name__}: {exc}"
        return result
    if opts.get("fault"):
        _inject_fault(model, opts["fault"], rank, world)
    ran = _run_recorded(model, ref, batch, names, ("the context-parallel model", "the unsplit model"))
    if isinstance(ran, str):
        result["error"] = ran
        return result
    (got_out, want_out), recorders = ran
    context, plan = model.tpcompile_context, model.tpcompile_plan
    tp_rank = model.tpcompile_mesh["tp"].get_local_rank()
    mine = context.index(context.padded, context.rank, torch.device("cpu"))
    result["warnings"].append(f"attention cores: {dict(context.paths)}")
    order = list(dict.fromkeys([*recorders[1].order, *names]))
    result["forward"] = {n: _forward(recorders[0].outputs[n], recorders[1].outputs[n],
                                     _sharded_rows(n, plan, tp_rank), mine, context.length) for n in order}
    ref_params = dict(ref.named_parameters())
    grads = {n: Check() for n in order}
    for pname, p in model.named_parameters():
        owner = pname.rpartition(".")[0]
        grads[owner] = grads.get(owner, Check()).worst(_grad(p, ref_params[pname], plan.params.get(pname),
                                                             tp_rank))
    result["grads"] = grads
    got, want = _output_tensors(got_out), _output_tensors(want_out)
    result["outputs"] = {}
    for k, v in want.items():
        if k not in got:
            result["outputs"][k] = _INF
            continue
        g = got[k]
        if k != "loss" and g.dim() > 1 and g.shape[1] == mine.numel() and v.shape[1] == context.length:
            g = gather_sequence(model, g)  # per-position outputs (logits), whole and in order
        result["outputs"][k] = _check(g, v)
    result["outputs"]["loss"] = _check(_loss(got_out), _loss(want_out))
    return result
