"""Parameters read outside their module's forward.

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
"""

from __future__ import annotations

import torch.fx as fx

from .propagate import module_path

__all__ = ["read_outside"]


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

