"""Re-entry: a row-parallel sum that only split code reads gets its gradient summed where
it leaves its module.

Megatron's pair of collectives brackets a tensor-parallel region: ``f`` where a whole
activation enters (identity forward, all-reduce of the gradient backward) and ``g`` where
partial sums leave it (all-reduce forward, identity backward).  Tpcompile hooks them at
module boundaries: a column module's input (``EnterRegion``) and a row module's output
(``ReduceOutput``).  A state-space mixer reads a row's sum *back into* split code inside
one forward: Mamba's ``x_proj`` contracts the split channels into ``dt``, ``B`` and ``C``,
and every channel of the scan then reads ``B`` and ``C`` (and ``dt_proj`` lifts ``dt``
back to the channels).  Each rank's backward then gives that whole value only its own
channels' part of the gradient.

No module boundary sits where those values meet the channels, but one sits where the
value is made: the row module's exit.  If *every* use of the row's output (through any
ops that keep it whole) is split code, the whole gradient at the exit is the sum of the
ranks' partial ones, so the exit's all-reduce can be made two-way (``g`` then ``f``) and
the columns that read the value drop their own input all-reduce (it would count those
gradients twice).  A parameter applied to the value on its way (Jamba normalises ``B`` and
``C``) receives a partial gradient as well and has it all-reduced (``GradSum``).  A use that keeps the value whole and replicated — the residual stream,
the model output, an unsplit feature — receives the whole gradient on every rank and
would be counted ``tp`` times: then there is no re-entry and the region stays replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from .gradients import splits
from .partition import Partition
from .propagate import Analysis, module_path
from .state import Feat, ParamRef, Partial

__all__ = ["Reentry", "find_reentry"]


@dataclass
class Reentry:
    """Rows whose exit sums gradients too, the columns that no longer do, and the whole
    values (row outputs and what is computed from them) whose gradients this sums."""

    rows: set[str] = field(default_factory=set)
    columns: set[str] = field(default_factory=set)
    nodes: set[fx.Node] = field(default_factory=set)
    params: set[str] = field(default_factory=set)  # used on the way: partial gradients too

    def update(self, other: Reentry) -> None:
        self.rows |= other.rows
        self.columns |= other.columns
        self.nodes |= other.nodes
        self.params |= other.params


def find_reentry(an: Analysis, part: Partition, layouts: dict, node: fx.Node) -> Reentry | None:
    """The re-entry that sums the partial gradient of ``node`` (a row's sum, met by split
    features), or ``None`` if some use of that sum keeps it whole."""
    value = an.value.get(node)
    if not isinstance(value, Partial):
        return None
    rows = [an.rows[i] for i in value.rows]
    if not rows or any(layouts.get(r.fqn) is None or layouts[r.fqn].dim != r.in_dim for r in rows):
        return None  # not actually split: a whole value, nothing to re-enter
    columns = {c.node: c for c in an.columns}
    found = Reentry(rows={r.fqn for r in rows})
    todo = [r.node for r in rows]
    found.nodes.update(todo)
    homes = {r.module for r in rows}
    while todo:
        for user in todo.pop().users:
            if user in found.nodes:
                continue
            if user.op == "output":
                return None  # leaves the model whole
            if homes & set(module_path(user)):
                return None  # read inside the row's own module, before its exit
            col = columns.get(user)
            if col is not None and col.fqn in layouts:
                found.columns.add(col.fqn)  # its input gradient is summed at the exit now
                continue
            out = an.value.get(user)
            if isinstance(out, Feat):
                if not splits(part, an.aligned_to(out.atoms, an.ndim(user))):
                    return None  # an unsplit feature: its gradient is whole already
                continue  # split code: the partial gradient the exit sums
            if user not in an.tainted:
                continue  # no gradient flows back from it (a mask, a shape check)
            found.nodes.add(user)
            todo.append(user)
            # a parameter applied on the way (Jamba's norms of B and C) receives the same
            # partial gradient: it is all-reduced too
            for arg in user.all_input_nodes:
                ref = an.value.get(arg)
                if isinstance(ref, ParamRef) and not ref.is_buffer and ref.fqn not in layouts:
                    found.params.add(ref.fqn)
    return found
