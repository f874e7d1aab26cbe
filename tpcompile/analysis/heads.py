"""A head whose output the model returns *and* its own layers read further on.

A column-parallel layer whose split output reaches the model's outputs is a head: unless
the loss is computed vocab-parallel, the runtime gathers its output whole where the
module returns, so the user gets the same tensor a plain model returns.  Most heads end
the model (``lm_head``).  Some do not: a vision tower's pooling head returns
``pooler_output`` and also feeds the model's ``visual_projection`` (AIMv2), a text
encoder's last projection returns ``last_hidden_state`` and feeds ``text_projection``
(AltCLIP).  The dataflow sees the reader contract the head's split features, a row; at
run time it gets the gathered, whole tensor, and the row's half-width weight cannot
multiply it.

:func:`readers_of_gathered_heads` finds those rows; the analysis keeps their region
whole (head and reader), with the reason, instead of planning a split the runtime cannot
run (the self-check would refuse it at transform time).

Example:
    >>> readers_of_gathered_heads(analyzed, outputs)           # doctest: +SKIP
    {'visual_projection.weight': 'vision_model.head.output_proj'}
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch.fx as fx

from .propagate import module_path
from .state import Feat

__all__ = ["after_heads", "gathered_heads", "heads_off_the_last_dim", "readers_of_gathered_heads"]


def _labels(part: Any, atoms: np.ndarray) -> set[int]:
    atoms = atoms[atoms >= 0]
    return set(np.unique(part.label[atoms]).tolist()) if atoms.size else set()


def gathered_heads(a: Any, outputs: np.ndarray) -> list[Any]:
    """The split column uses whose output features reach ``outputs`` (the heads: the
    runtime gathers them; every other split column is a plain column)."""
    out_atoms = set(np.unique(outputs[outputs >= 0]).tolist()) if outputs.size else set()
    out_units = _labels(a.part, outputs) if outputs.size else set()
    columns = {c.node for c in a.an.columns}
    return [c for c in a.an.columns if out_atoms and (lay := a.layouts.get(c.fqn)) is not None
            and lay.dim == c.out_dim and (int(c.atoms[0]) in out_atoms or (
                int(a.part.label[c.atoms[0]]) in out_units and _reaches_output(a.an, c.node, columns)))]


def _reaches_output(an: Any, node: fx.Node, columns: set[fx.Node]) -> bool:
    """Do ``node``'s split features flow to the graph's output, op by op, without another
    contraction?  Two columns added into the logits (a LoRA ``lora_B`` beside its
    ``base_layer``) reach them tied, through the atoms of only one of them."""
    seen: set[fx.Node] = set()
    frontier = [node]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u.op == "output":
                return True
            if u not in seen and u not in columns and isinstance(an.value.get(u), Feat):
                seen.add(u)
                frontier.append(u)
    return False


def heads_off_the_last_dim(a: Any, heads: list[Any]) -> dict[str, str]:
    """Of ``heads`` (:func:`gathered_heads`), those (by parameter, with their module) whose
    output features are not on the last dim: a convolution's channels (``[batch,
    channels, *positions]``, a CNN's last 1x1 conv).  The runtime gathers a head's output
    along the last dim, so these are kept whole instead."""
    out: dict[str, str] = {}
    for c in heads:
        v = a.an.value.get(c.node)
        atoms = getattr(v, "atoms", None)
        if atoms is None:
            continue
        atoms = a.an.aligned_to(atoms, a.an.ndim(c.node))
        if any(s > 1 for s in atoms.shape[:-1]):
            out[c.fqn] = c.module
    return out


def readers_of_gathered_heads(a: Any, heads: list[Any]) -> dict[str, str]:
    """Rows (by parameter) of another module that read the split output of one of
    ``heads`` (:func:`gathered_heads`), each with the head's module."""
    an, part = a.an, a.part
    head_of: dict[int, str] = {}  # class label -> the head module producing it
    for c in heads:
        for label in _labels(part, c.atoms):
            head_of.setdefault(label, c.module)
    if not head_of:
        return {}
    readers: dict[str, str] = {}
    for r in an.rows:
        lay = a.layouts.get(r.fqn)
        if lay is None or lay.dim != r.in_dim:
            continue
        heads = {head_of[label] for label in _labels(part, r.atoms) if label in head_of}
        heads.discard(r.module)
        if heads:
            readers[r.fqn] = min(heads)
    return readers


def after_heads(a: Any, graph: fx.Graph) -> set[fx.Node]:
    """Nodes fed by a head's output outside the head: the gathered values and what is
    computed from them, whole at run time (however the dataflow splits them)."""
    heads = set(a.lm_head.values())

    def inside(node: fx.Node) -> bool:
        return any(h in module_path(node) for h in heads)

    frontier = [u for n in graph.nodes if n.op == "call_function" and inside(n) for u in n.users
                if not inside(u)]
    seen: set[fx.Node] = set()
    while frontier:
        node = frontier.pop()
        if node not in seen and node.op == "call_function":
            seen.add(node)
            frontier.extend(node.users)
    return seen
