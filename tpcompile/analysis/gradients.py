"""The backward check: every gradient a rank computes from its own features is summed.

A rank holds a part of each split value.  Where a *whole* value that has a gradient (a
replicated parameter, or an activation computed from parameters) meets split features in
an op, each rank's backward gives that value only the part of its gradient that its own
features contribute: a partial gradient, which must be all-reduced over the TP group or
the model trains differently on every rank — while its forward is exact, so nothing
else would notice (Apertus' xIELU scalars once trained with gradients off by rel 2.4).

Which values get partial gradients is a fact of the dataflow, so it is checked on the
converged plan without weights, independently of the rules that placed the collectives:
for every op whose result is split, each floating operand that carries a gradient and is
not split itself must be summed by what the plan installs —

* a parameter sliced to this rank's features (its gradient is then local), or one whose
  gradient is all-reduced (``GradSum``);
* the input of a column-parallel contraction (``EnterRegion`` all-reduces input grads);
* a row's sum that only split code reads, whose gradient its module's exit sums
  (:mod:`.reentry`);
* an operand the op only places (``cat``, ``stack``, scatter's base): the positions it
  fills are whole on every rank, so its gradient is too.

Anything else is an error naming module, op and operand (strict), or its region is kept
replicated with a warning — never a model whose gradients differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.fx as fx

from .partition import Partition
from .propagate import Analysis, innermost_module, params_feeding
from .state import Feat, ParamRef

if TYPE_CHECKING:
    from .reentry import Reentry

__all__ = ["UnsummedGradient", "applied_inside_entry", "rank_of", "splits", "unsummed_gradients"]

aten = torch.ops.aten

# ops that put an operand's entries at positions of their own, never summed over features
_PLACING = {
    aten.cat, aten.stack, aten.slice_scatter, aten.select_scatter, aten.index_put,
    aten.index_put_, aten.scatter, aten.scatter_, aten.copy, aten.copy_, aten.masked_scatter,
}


@dataclass(frozen=True)
class UnsummedGradient:
    """An operand whose gradient would stay partial on each rank."""

    module: str
    op: str
    operand: str  # a parameter FQN or the activation's node name
    atoms: np.ndarray  # the split side's atoms (to replicate its region)
    via: str = "meets split features"

    def __str__(self) -> str:
        return (f"{self.operand} {self.via} in op {self.op} (in module "
                f"{self.module or '<root>'}) and each rank would hold only a partial gradient "
                "for it, which nothing sums")


def rank_of(part: Partition, atoms: np.ndarray) -> np.ndarray:
    """The rank holding each atom (``-1``: no feature, ``-2``: held by several ranks)."""
    r = part.rank_of_atom[np.clip(atoms, 0, None)]
    return np.where(atoms < 0, -1, r)


def along(values: np.ndarray, d: int) -> np.ndarray:
    """The entries along dim ``d`` (the first position of every other dim): which rank,
    or which feature, each row along ``d`` holds."""
    return np.moveaxis(values, d, 0).reshape(values.shape[d], -1)[:, 0]


def varies(ranks: np.ndarray, d: int) -> bool:
    """Do the features along dim ``d`` belong to different ranks?"""
    if ranks.shape[d] <= 1:
        return False
    ref = np.take(ranks, [0], axis=d)
    both = (ranks >= 0) & (ref >= 0)
    return bool((both & (ranks != ref)).any())


def splits(part: Partition, atoms: np.ndarray) -> bool:
    """Is a value with these atoms held in parts (split along a dim, or KV replicas)?"""
    ranks = rank_of(part, atoms)
    return bool((ranks == -2).any()) or any(varies(ranks, d) for d in range(ranks.ndim))


def _has_gradient(an: Analysis, arg: fx.Node, layouts: dict, summed: set[str], reentered: set) -> str | None:
    """The operand's name if its gradient must come out whole but would not, else None."""
    v = an.value.get(arg)
    meta = an.meta(arg)
    if not isinstance(meta, torch.Tensor) or not meta.is_floating_point():
        return None
    if isinstance(v, ParamRef):
        if v.is_buffer or v.fqn in layouts or v.fqn in summed:
            return None
        return v.fqn
    if isinstance(v, Feat) or arg not in an.tainted or arg in reentered:
        return None
    return arg.name


def unsummed_gradients(an: Analysis, part: Partition, layouts: dict, summed: set[str],
                       reentry: Reentry | None = None) -> list[UnsummedGradient]:
    """Every (op, operand) of the graph whose partial gradient the plan leaves unsummed.

    ``layouts``: the parameters sliced to local features; ``summed``: those whose
    gradient is all-reduced; ``reentry``: the row sums whose gradient is summed at their
    module's exit (and the columns that leave their input's to it)."""
    reentered = reentry.nodes if reentry is not None else set()
    unentered = reentry.columns if reentry is not None else set()
    columns = {c.node for c in an.columns if c.fqn not in unentered}
    found: list[UnsummedGradient] = []
    for node in an.graph.nodes:
        if node.op != "call_function" or node in columns:
            continue
        out = an.value.get(node)
        if not isinstance(out, Feat) or getattr(node.target, "overloadpacket", None) in _PLACING:
            continue
        if not splits(part, an.aligned_to(out.atoms, an.ndim(node))):
            continue
        for arg in dict.fromkeys(node.all_input_nodes):
            name = _has_gradient(an, arg, layouts, summed, reentered)
            if name is not None:
                op = getattr(node.target, "__name__", str(node.target))
                found.append(UnsummedGradient(innermost_module(node), op, name, out.atoms))
    # a re-entered value carries a partial gradient back to its row's exit: a parameter
    # applied to it on the way gets a partial gradient too
    rows = [r.atoms.reshape(-1) for r in an.rows if reentry is not None and r.fqn in reentry.rows]
    region = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)
    for node in reentered:
        for arg in node.all_input_nodes:
            v = an.value.get(arg)
            if isinstance(v, ParamRef) and not v.is_buffer and v.fqn not in layouts and v.fqn not in summed:
                op = getattr(node.target, "__name__", str(node.target))
                found.append(UnsummedGradient(innermost_module(node), op, v.fqn, region,
                                               via="is applied to a re-entered row sum"))
    return found


def applied_inside_entry(an: Analysis, entries: dict[fx.Node, str]) -> set[str]:
    """The whole parameters a module applies to a column contraction's input between the
    module's entry and the contraction (``entries``: contraction node -> the module whose
    inputs enter the TP region for it).

    The entry sums the gradient of the module's *inputs* only.  A parameter of the module
    applied on the way (AdaLoRA's ``lora_A`` and ``lora_E`` in the projection's own
    forward, before its split ``lora_B``) gets from each rank the part of its gradient
    that rank's features give: it must be all-reduced (``GradSum``).  The split weight
    itself is found too; the caller drops what the plan slices."""
    out: set[str] = set()
    for contraction, module in entries.items():
        prefix = module + "."
        found = params_feeding([contraction], _Outside(module), an._params)
        out |= {fqn for fqn in found if fqn.startswith(prefix)}
    return out


class _Outside:
    """The nodes computed outside ``module``: its inputs and what precedes them, which
    enter the region as they are (a container for :func:`params_feeding`'s ``skip``)."""

    def __init__(self, module: str) -> None:
        self.module, self.prefix = module, module + "."

    def __contains__(self, node: object) -> bool:
        if not isinstance(node, fx.Node) or node.op != "call_function":
            return False
        where = innermost_module(node)
        return where != self.module and not where.startswith(self.prefix)
