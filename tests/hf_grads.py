"""Gradients of a parallelized model in the unsplit model's layout, for comparisons.

``hf_grads(model)`` returns every gradient this rank's model holds as the full tensor of
the Hugging Face parameter (DTensors gathered, tensor-parallel layouts put back in HF
rows through the model's translation table).  It is a collective over the model's mesh:
every rank of it calls.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

__all__ = ["hf_grads"]


def hf_grads(model: torch.nn.Module, tp: int, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{name: gradient}`` in HF layout; ``tp`` is the model's tensor-parallel degree."""
    table = model.tpcompile_table
    out = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        tmap = table.tensors.get(name)
        if tmap is not None and tmap.sharded:  # the TP layout back to HF rows
            full = tmap.to_hf(list(full.chunk(tp, dim=tmap.shard_dim)))
        out[prefix + name] = full
    return out
