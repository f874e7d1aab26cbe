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

import numpy as np
import torch.fx as fx

from .gradients import splits
from .partition import Partition
from .propagate import Analysis, module_path
from .state import Feat, ParamRef, Partial

__all__ = ["Reentry", "find_params_only", "find_reentry"]


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
    return _walk(an, part, layouts, Reentry(rows={r.fqn for r in rows}), [r.node for r in rows],
                 {r.module for r in rows})


def find_params_only(an: Analysis, part: Partition, layouts: dict, node: fx.Node) -> Reentry | None:
    """The sums for ``node``, a whole value met by split features that is computed from
    parameters alone (no input of the model reaches it), or ``None``.

    DiffLlama weighs each head's second attention map by one scalar,
    ``exp(sum(lambda_q1 * lambda_k1)) - exp(sum(lambda_q2 * lambda_k2)) + lambda_init``.
    Split by heads, each rank's backward gives that scalar only its own heads' part of the
    gradient.  Every rank computes the scalar the same way from the same parameters, so
    their gradients are linear in its gradient: all-reducing the parameters' gradients
    (``GradSum``) sums the scalar's on the way — provided every use of those parameters
    ends in split code (one read whole elsewhere would be counted ``tp`` times)."""
    starts: list[fx.Node] = []
    for arg in (node, *_ancestors(node)):
        value = an.value.get(arg)
        if arg.op == "placeholder":
            if not isinstance(value, ParamRef):
                return None  # an input of the model: the value is computed from data
            if not value.is_buffer and value.fqn not in layouts:
                starts.append(arg)
        elif arg in an.tainted and isinstance(value, Feat | Partial):
            return None
    if not starts:
        return None
    found = _walk(an, part, layouts, Reentry(params={an.value[a].fqn for a in starts}), starts, set(),
                  whole_origin=True)
    return found if found is not None and node in found.nodes else None


def _atoms(atoms: np.ndarray) -> set[int]:
    return set(np.unique(atoms[atoms >= 0]).tolist())


def _returned_atoms(an: Analysis) -> set[int]:
    """The feature atoms of what the model returns (an LM head's logits)."""
    return set().union(*(_atoms(o) for o in an.outputs)) if an.outputs else set()


def _ancestors(node: fx.Node) -> set[fx.Node]:
    """The nodes ``node`` is computed from."""
    seen: set[fx.Node] = set()
    todo = [node]
    while todo:
        for arg in todo.pop().all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return seen


def _walk(an: Analysis, part: Partition, layouts: dict, found: Reentry, todo: list[fx.Node],
          homes: set[str], whole_origin: bool = False) -> Reentry | None:
    """Follow the whole values computed from ``todo`` to every use: each must be split
    code (or a split column, which then leaves its input's sum to ``found``).  From a
    ``whole_origin`` (not a row's sum), split code carrying features the model returns
    does not count (an LM head's logits are gathered where the head returns: what reads
    them after it sees them whole, and their gradient is whole on every rank already), nor
    does a partial sum the value joins (its gradient comes back whole from the reduce)."""
    columns = {c.node: c for c in an.columns}
    outputs = _returned_atoms(an) if whole_origin else set()
    found.nodes.update(todo)
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
                if outputs & _atoms(col.atoms):
                    return None  # an output head: it enters on its own and is gathered
                found.columns.add(col.fqn)  # its input gradient is summed at the exit now
                continue
            out = an.value.get(user)
            if isinstance(out, Feat):
                if not splits(part, an.aligned_to(out.atoms, an.ndim(user))):
                    return None  # an unsplit feature: its gradient is whole already
                if outputs & _atoms(out.atoms):
                    return None  # read after a gathered head: whole there
                continue  # split code: the partial gradient the exit sums
            if user not in an.tainted:
                continue  # no gradient flows back from it (a mask, a shape check)
            if whole_origin and isinstance(out, Partial):
                return None
            found.nodes.add(user)
            todo.append(user)
            # a parameter applied on the way (Jamba's norms of B and C) receives the same
            # partial gradient: it is all-reduced too
            for arg in user.all_input_nodes:
                ref = an.value.get(arg)
                if isinstance(ref, ParamRef) and not ref.is_buffer and ref.fqn not in layouts:
                    found.params.add(ref.fqn)
    return found
