"""``verify --pp P``: check pipeline parallelism on a shrunk copy, gradient by gradient.

``pp x tp`` gloo processes each build the same seeded model, keep an unsplit copy and
``parallelize(pp=P, tp=tp)`` the other (1F1B, one microbatch per sample of the batch).
One ``tpcompile.pipeline_step`` runs the schedule; the unsplit copy runs
``model(**batch).loss.backward()``.  Compared: the loss (every rank gets the batch's
loss) and every parameter gradient this rank's stages hold (FSDP2's shards gathered back
to this rank's TP shard, then mapped to the HF rows it holds, as ``verify --tp`` does),
per module, and every module's forward output: recorded call by call while the schedule
runs each microbatch, the microbatches' outputs put back together along the batch (or
the flattened tokens) before they are compared with the unsplit model's, so the report
names the first module that departs.  ``generate`` is skipped: a pipelined model refuses
it (save and reload without pp to generate).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers import PreTrainedConfig

from .verify import (
    _check,
    _forward_check,
    _inject_fault,
    _inputs,
    _Recorder,
    _sharded_rows,
    build_small_model,
)
from .verify_context import _grad

__all__ = ["pp_worker"]


def pp_worker(rank: int, world: int, config: PreTrainedConfig, task: str | None, opts: dict[str, Any]) -> dict:
    """One rank of ``verify --pp``: build, copy, parallelize, one pipeline step, compare."""
    from transformers.utils import logging as hf_logging

    from ..api import parallelize
    from ..runtime.pipeline_step import pipeline_step

    hf_logging.set_verbosity_error()
    tp, pp = opts["tp"], opts["pp"]
    torch.manual_seed(0)  # same seed on every rank: identical full weights
    model = build_small_model(config, tp=tp, layers=max(opts["layers"], pp), task=task, attn=opts["attn"],
                              dtype=opts.get("dtype", "float32"))
    ref = copy.deepcopy(model)
    batch = _inputs(ref, torch.Generator().manual_seed(1))
    result: dict[str, Any] = {"model_class": type(model).__name__, "config": model.config.to_diff_dict(),
                              "warnings": [], "forward": {},
                              "generate": {"status": "skipped: a pipelined model refuses generate()"}}
    size = next(v.shape[0] for v in batch.values() if isinstance(v, torch.Tensor))
    # a failure is raised, not returned: a rank that fails inside parallelize leaves the
    # others waiting in its collectives, and only a raise makes the launcher stop them
    model = parallelize(model, tp=tp, pp=pp, pp_schedule="1f1b", pp_microbatches=max(size, pp) if
                        size % pp == 0 else pp)
    fault = opts.get("fault")
    if fault and fault in dict(model.named_modules()):  # on the stage that holds it, one TP rank
        _inject_fault(model, fault, model.tpcompile_mesh["tp"].get_local_rank(), tp)
    elif fault and fault not in dict(ref.named_modules()):
        _inject_fault(ref, fault, rank, world)  # raises, naming the module that does not exist
    run = model.tpcompile_pipeline
    result["warnings"].append("stages: " + "; ".join(
        f"{s.index} on pp rank {s.rank}: {s.blocks[0]}..{s.blocks[-1].rpartition('.')[2]}" for s in run.plan.stages))
    names = [n for n, m in ref.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    here = set(dict(model.named_modules()))
    recorders = [_Recorder(model, [n for n in names if n in here]), _Recorder(ref, names)]
    try:
        loss = pipeline_step(model, batch)
        want = ref(**batch).loss
        want.backward()
    finally:
        for r in recorders:
            r.remove()
    plan = model.tpcompile_plan
    tp_rank = model.tpcompile_mesh["tp"].get_local_rank()
    m = run.plan.microbatches
    result["forward"] = {n: _forward_check(_merged(recorders[0].outputs[n], len(recorders[1].outputs[n]), m),
                                           recorders[1].outputs[n], _sharded_rows(n, plan, tp_rank))
                         for n in recorders[1].order if n in here}
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    grads: dict[str, Any] = {}
    for pname, p in model.named_parameters():
        owner = pname.rpartition(".")[0]
        c = _grad(p, ref_params[pname], plan.params.get(pname), tp_rank)
        grads[owner] = c if owner not in grads else grads[owner].worst(c)
    result["grads"] = grads
    result["outputs"] = {"loss": _check(loss, want.detach())}
    return result


def _merged(calls: list[torch.Tensor], per_batch: int, microbatches: int) -> list[torch.Tensor]:
    """A module's outputs over ``microbatches`` runs (each makes ``per_batch`` calls, in
    order) as the ``per_batch`` outputs of one run on the whole batch: joined along dim 0
    (the batch, or the tokens flattened batch-major)."""
    if per_batch == 0 or len(calls) != per_batch * microbatches:
        return calls  # not comparable call by call: the length check reports it
    return [torch.cat([calls[k * per_batch + j] for k in range(microbatches)]) for j in range(per_batch)]
