"""Parameters read where a slice of them would compute something else.

**Outside their module's forward.**
The runtime gives a module its local shards while the module runs (hooks around its
call) and keeps the split parameters as ``DTensor`` otherwise.  A model that reads a
parameter from outside, in a parent's own code (Gemma 4's multimodal model indexes its
text model's embedding table for the pad token's row:
``self.language_model.embed_tokens.weight[pad_id, :]``), would see the ``DTensor`` (a
crash mixing it with plain tensors) or, split, only this rank's rows.  Such a parameter
stays whole.

A read is inside when the reading op runs in the forward of a module holding the
parameter (under any of its tied names) or of that module's parent (PEFT's LoRA
embedding looks its ``lora_embedding_A`` up in its own forward: the ``ParameterDict``
holding it is never called, and that table has its own rule).

**Mixed whole.** An op may read a parameter's own entries into a value taken as the same
on every rank (:class:`~tpcompile.analysis.state.RawRead`): PEFT DeLoRA scales its
update by ``delora_B.norm(dim=0)``, whose ``delora_B`` follows the heads of the
projection it adapts.  Split along a dim such an op mixes, every rank would compute a
partial norm from its rows, a silent difference no shape reveals: that split is undone
(:func:`split_raw_reads`) and the region stays whole.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.fx as fx

from .propagate import Analysis, innermost_module, module_path
from .state import ParamRef, SubDim

__all__ = ["read_outside", "split_raw_reads"]


def _owners(names: list[str]) -> set[str]:
    out: set[str] = set()
    for name in names:
        owner = name.rpartition(".")[0]
        out.add(owner)
        parent = owner.rpartition(".")[0]
        if parent:  # the parent, unless that is the model itself (whose code reads anything)
            out.add(parent)
    return out


def read_outside(graph: fx.Graph, param_of_placeholder: dict[str, str],
                 names_of: dict[str, list[str]]) -> dict[str, str]:
    """``{parameter fqn: the module whose code reads it}`` for every parameter read
    outside the forward of the modules holding it (``names_of[fqn]``: all its names)."""
    out: dict[str, str] = {}
    for node in graph.nodes:
        fqn = param_of_placeholder.get(node.name) if node.op == "placeholder" else None
        if fqn is None:
            continue
        owners = _owners(names_of.get(fqn, [fqn]))
        for user in node.users:
            path = module_path(user)
            if not owners & set(path):
                out.setdefault(fqn, path[-1] if path else "")
    return out


def split_raw_reads(an: Analysis, layouts: dict[str, Any]) -> list[tuple[str, np.ndarray]]:
    """``(why, atoms)`` for every raw read of a parameter the plan splits along a dim the
    read mixes: ``atoms`` are that dim's, whose region must stay whole (``layouts``:
    fqn -> its :class:`~tpcompile.analysis.partition.BlockLayout`)."""
    out: list[tuple[str, np.ndarray]] = []
    for rr in an.raw_reads:
        lay = layouts.get(rr.fqn)
        if lay is None:
            continue
        real = lay.dim.dim if isinstance(lay.dim, SubDim) else lay.dim
        if real not in rr.dims:
            continue
        block = an.atoms.by_key.get((rr.fqn, lay.dim))
        if block is not None:
            atoms = np.arange(block.start, block.start + block.size, dtype=np.int64)
        else:  # no features of its own: sliced like the features it meets (a bias added in code)
            met = [ev.atoms.reshape(-1) for ev in an.aligned
                   if isinstance(ev.operand, ParamRef) and ev.operand.fqn == rr.fqn]
            if not met:
                continue
            atoms = np.concatenate(met)
        op = getattr(rr.node.target, "__name__", str(rr.node.target))
        why = (f"{op} in {innermost_module(rr.node) or '<root>'} reads {rr.fqn} whole along dim {real}, "
               "which would be split; kept the region replicated")
        out.append((why, atoms))
    return out
