"""Replicated parameters added to a partial sum inside the module that computed it.

A row-parallel ``nn.Linear`` adds its bias after the all-reduce (``ReduceOutput``'s
``row_biases``).  A fused experts module writes the row's bias as code, *inside* its
forward, before the partial sums leave it::

    out = grouped_mm(h, down_proj, offsets)        # partial: this rank's features only
    out.add_(down_proj_bias[expert_ids])           # replicated: added on every rank
    return (out * routing_weights).sum(...)        # all-reduced at the module's exit

Added on every rank, the all-reduce would add the bias ``tp`` times; reduced before the
add, the sum would have to leave a module that is still running, so the analysis used to
keep the whole experts module replicated (GPT-OSS: 3.95x the ideal bytes per rank at
tp=4).  But ``Σ_r p_r + b = (p_0 + b) + Σ_{r>0} p_r``: one rank adds the bias and the exit
all-reduce sums it once.  Its gradient is the gradient of the sum, whole on every rank
(the all-reduce's backward hands every rank the same), so every rank passes it straight
to the parameter: rank 0's copy and the others' zeros share one gradient
(:func:`~tpcompile.runtime.comm.on_first_rank`), and no all-reduce is needed.

That is exact only where the runtime can give the module its parameter's first-rank
version for the whole forward, so the analysis proves, per parameter:

* it is owned by the module whose forward computes the partial sum (the one the
  runtime wraps), every row of the sum runs in that module, and the parameter is not a
  buffer;
* every use of it in the captured graph, through entry-wise picks of it (``bias[ids]``,
  a cast), is such an addend: a parameter also read elsewhere would be zero there on
  every rank but the first.

A parameter that fails keeps the old answer: the partial sum is reduced inside the
module, so that region stays whole (with the reason recorded for ``dump-plan``).
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.fx as fx

from .partition import Partition
from .propagate import Analysis
from .state import ParamRef

__all__ = ["addend_params"]


def _only_addends(an: Analysis, fqn: str, addends: set[fx.Node]) -> bool:
    """Every use of parameter ``fqn`` reaches the graph only as an addend of a partial sum."""
    starts = [n for n in an.graph.nodes if n.op == "placeholder" and an._params.get(n.name) == fqn]
    stack, seen = list(starts), set(starts)
    while stack:
        node = stack.pop()
        for user in node.users:
            if user in addends or user in seen:
                continue
            if not isinstance(user.meta.get("val"), torch.Tensor):
                continue  # a metadata assert: no value flows on
            v = an.value.get(user)
            if not (isinstance(v, ParamRef) and v.fqn == fqn):
                return False
            seen.add(user)
            stack.append(user)
    return bool(starts)


def addend_params(an: Analysis, part: Partition) -> tuple[dict[str, tuple[str, ...]], dict[int, str]]:
    """The parameters one rank adds, by module (names local to it); and the rows whose
    addend cannot be placed (each must be reduced inside its module), with the reason."""
    by_fqn: dict[str, list] = defaultdict(list)
    for ra in an.row_addends:
        if any((an.rows[r].fqn, an.rows[r].in_dim) in part.layouts for r in ra.rows):
            by_fqn[ra.fqn].append(ra)
    placed: dict[str, set[str]] = defaultdict(set)
    failed: dict[int, str] = {}
    for fqn, uses in by_fqn.items():
        owner, _, name = fqn.rpartition(".")
        modules = {an.rows[r].module for ra in uses for r in ra.rows}
        if modules != {owner}:
            reason = (f"{fqn} is added to a partial sum of {', '.join(sorted(modules))} but owned by "
                      f"{owner or '<root>'}")
        elif not _only_addends(an, fqn, {ra.node for ra in uses}):
            reason = f"{fqn} is added to a partial sum inside {owner} and also read otherwise"
        else:
            placed[owner].add(name)
            continue
        for ra in uses:
            failed.update({r: reason for r in ra.rows})
    return {m: tuple(sorted(names)) for m, names in placed.items()}, failed
