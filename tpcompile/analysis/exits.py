"""Loop regions: a module an expert loop calls once per expert sums at its parent.

A row-parallel contraction's partial sum is all-reduced where its module returns, and a
column module's input gradient where it is entered: once per call.  DBRX hands each
expert's weights to one ``DbrxExpertGLU`` module inside ``for expert_idx in expert_hit``,
so a layer paid an all-reduce per expert hit, forward and backward, of top-k times the
bytes of the layer's output — while the loop only weights its partial sums and
``index_add_``-s them into the layer's output, all linear in them.

When the parent returns nothing but partial sums, it computes ``P = Σ_r P_r(x)`` with
``P_r`` this rank's share, so the parent itself can be the tensor-parallel region:
its inputs enter once (``EnterRegion``: the gradient of every input is the sum of the
ranks' own terms ``∂P_r/∂x``) and its output is reduced once (``ReduceOutput``).  The
plan moves both there for a row module called several times within one call of its
parent (the capture keys a repeated call ``module@1``, ``module@2`` ...), when:

* no op inside the parent needs the whole sum (no reduce point of its rows there: the
  partial-sum propagation proved every op between linear in them);
* every floating value the parent hands out is such a partial sum (a whole value
  returned beside it would be counted ``tp`` times);
* every parameter read inside the parent is split (a replicated one would see only its
  rank's share of the gradient), and no row there adds a bias or an addend.
"""

from __future__ import annotations

import torch.fx as fx

from .propagate import Analysis, module_path
from .state import Partial

__all__ = ["loop_parents"]


def loop_parents(an: Analysis, layouts: dict, param_of_placeholder: dict[str, str],
                 skip: set[str]) -> dict[str, str]:
    """``{row module: parent}`` for the row modules whose sums move to their parent's
    return (see module docstring); ``skip``: modules that must keep theirs (a bias
    added, an addend, a re-entering row)."""
    found: dict[str, str] = {}
    by_module: dict[str, list[int]] = {}
    for i, r in enumerate(an.rows):
        by_module.setdefault(r.module, []).append(i)
    for module, rows in by_module.items():
        uses = [an.rows[i] for i in rows]
        if module in skip or any(r.bias is not None or layouts.get(r.fqn) is None for r in uses):
            continue
        parent = _parent(uses[0].node, module)
        if parent is None or not any(_repeated(r.node, module) for r in uses):
            continue
        inside = [rp for rp in an.reduce_points if set(rows) & set(rp.rows)
                  and rp.node.op != "output" and parent in module_path(rp.node)]
        if inside:
            continue
        nodes = [n for n in an.graph.nodes if n.op == "call_function" and parent in module_path(n)]
        if _returns_partials(nodes, an, parent) and _params_split(nodes, layouts, param_of_placeholder):
            found[module] = parent
    return found


def _parent(node: fx.Node, module: str) -> str | None:
    path = module_path(node)
    i = path.index(module) if module in path else -1
    return path[i - 1] if i > 0 else None


def _repeated(node: fx.Node, module: str) -> bool:
    """Is this a second or later call of ``module`` (the capture keys it ``...@k``)?"""
    stack = node.meta.get("nn_module_stack") or {}
    return any(name == module and "@" in key for key, (name, _) in stack.items())


def _returns_partials(nodes: list[fx.Node], an: Analysis, parent: str) -> bool:
    """Is every floating value computed in ``parent`` (its ``nodes``) and read outside it
    a partial sum?"""
    found = False
    for node in nodes:
        if all(u.op != "output" and parent in module_path(u) for u in node.users):
            continue
        val = node.meta.get("val")
        if not getattr(val, "is_floating_point", lambda: False)():
            continue
        if not isinstance(an.value.get(node), Partial):
            return False
        found = True
    return found


def _params_split(nodes: list[fx.Node], layouts: dict, param_of_placeholder: dict[str, str]) -> bool:
    """Is every parameter the parent's code (its ``nodes``) reads one the plan splits?"""
    for node in nodes:
        for arg in node.all_input_nodes:
            fqn = param_of_placeholder.get(arg.name) if arg.op == "placeholder" else None
            if fqn is not None and fqn not in layouts:
                return False
    return True
