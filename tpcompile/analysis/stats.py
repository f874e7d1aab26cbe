"""Statistics over split features: per-rank partial sums, all-reduced, instead of a whole
region.

OLMo-2 normalises ``q_proj``'s output over *all* heads: ``mean(q**2, -1)`` reads every
feature column-parallel attention splits.  Tying those features into one unit (what any
other reduction over features does, :mod:`tpcompile.rules.reduce`) keeps the attention
whole.  But a linear statistic is a sum over features, and a sum over split features is
the sum of each rank's local sum::

    mean(x, -1) = (1 / N) · Σ_r sum(x_r, -1)        (N: the global feature count)
    var(x, -1)  = (1 / (N - c)) · Σ_r sum((x_r - mean(x, -1))**2, -1)

so each rank reduces its own features and the partial sums are all-reduced over the TP
group (:func:`~tpcompile.runtime.comm.sum_over_tp`).  The result is whole on every
rank; the split code that reads it (``x_r * rsqrt(var + eps)``) gives it, on each rank,
only its own features' part of its gradient, so the backward of that all-reduce is an
all-reduce too (``g`` then ``f``, as a re-entering row's exit, :mod:`.reentry`).

That is exact only where the analysis proves it, per statistic (else it ties its
features as before and the region stays whole):

* the reduction leaves no feature behind and its features are split along exactly one
  dim, each rank holding the same number of distinct features (no KV-head replicas, no
  positions without a feature, a floating input);
* every use of the result, through values without features, ends in split features:
  never the model output, an unsplit feature, a partial sum or a linear's input (their
  gradients are whole on every rank and would be summed ``tp`` times); a replicated
  parameter applied on the way gets its gradient all-reduced, and no other whole
  activation may meet it;
* the runtime can find it: it rewrites ``sum`` / ``mean`` / ``var`` / ``std`` over that
  dim in the forward of the statistic's innermost module, so every such op run in that
  module's forward (its children's included) must be a split statistic of that module,
  over the same dim and sizes, the same ops in every call.  The plan records the ops per
  call and the runtime checks it rewrote exactly those.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from .gradients import along, rank_of, splits, varies
from .partition import Partition
from .propagate import Analysis, innermost_module, module_path
from .reentry import Reentry
from .state import Feat, ParamRef, Partial, StatUse

__all__ = ["STAT_OPS", "SplitStat", "find_split_stats", "stat_nodes"]

aten = torch.ops.aten

# the linear statistics: op packet -> the name the plan and the runtime use for it
STAT_OPS: dict[Any, str] = {aten.sum: "sum", aten.mean: "mean", aten.var: "var", aten.std: "std"}


@dataclass(frozen=True)
class SplitStat:
    """The split statistics computed in one module's forward.

    ``dim`` is counted from the end of the reduced tensor (negative); ``size`` is the
    global feature count along it, ``local`` each rank's; ``ops`` the statistics one call
    computes, in execution order."""

    module: str
    dim: int
    size: int
    local: int
    ops: tuple[str, ...]


def find_split_stats(an: Analysis, part: Partition, layouts: dict
                     ) -> tuple[dict[str, SplitStat], Reentry, set[fx.Node]]:
    """The statistics that split exactly, by module; the whole values whose gradients
    their all-reduces sum (and parameters applied on the way); and the statistics that
    cannot split (to tie their features on the next pass)."""
    whole: set[fx.Node] = set()
    exact: dict[fx.Node, tuple[tuple[int, int, int], Reentry]] = {}
    for use in an.stat_uses:
        ranks = rank_of(part, use.atoms)
        if not any(varies(ranks, d) for d in use.dims) and not (ranks == -2).any():
            continue  # its features are not split: each rank reduces all of them
        found = _exact(an, part, layouts, use, ranks)
        if found is None:
            whole.add(use.node)
        else:
            exact[use.node] = found
    by_module: dict[str, list[fx.Node]] = defaultdict(list)
    for node in exact:
        by_module[innermost_module(node)].append(node)
    stats: dict[str, SplitStat] = {}
    summed = Reentry()
    for module, nodes in by_module.items():
        stat = _module_stat(an, module, {n: exact[n][0] for n in exact})
        if stat is None:
            whole.update(nodes)
            continue
        stats[module] = stat
        for n in nodes:
            summed.update(exact[n][1])
    return stats, summed, whole


def _exact(an: Analysis, part: Partition, layouts: dict, use: StatUse, ranks: np.ndarray
           ) -> tuple[tuple[int, int, int], Reentry] | None:
    """``((dim, size, local), summed uses)`` if ``use`` is exact from partial sums."""
    split = [d for d in use.dims if varies(ranks, d)]
    meta = an.meta(use.node.args[0])
    if len(split) != 1 or (ranks < 0).any() or not isinstance(meta, torch.Tensor) or not meta.is_floating_point():
        return None  # replicas / unfeatured positions would be counted more than once
    d = split[0]
    line = along(ranks, d)
    counts = np.bincount(line, minlength=part.tp)
    size = int(meta.shape[d])
    if line.size != size or counts.size != part.tp or len(set(counts.tolist())) != 1:
        return None
    uses = _summed_uses(an, part, layouts, use.node)
    if uses is None:
        return None
    return (d - meta.ndim, size, size // part.tp), uses


def _summed_uses(an: Analysis, part: Partition, layouts: dict, start: fx.Node) -> Reentry | None:
    """The whole values computed from ``start`` on the way to split features, or ``None``
    if some use keeps its gradient whole on every rank."""
    columns = {c.node for c in an.columns}
    found = Reentry(nodes={start})
    todo = [start]
    while todo:
        for user in todo.pop().users:
            if user in found.nodes:
                continue
            if user.op == "output" or user in columns:
                return None
            out = an.value.get(user)
            if isinstance(out, Partial):
                return None
            if isinstance(out, Feat):
                if not splits(part, an.aligned_to(out.atoms, an.ndim(user))):
                    return None  # an unsplit feature: its gradient is whole already
                continue  # split code: the partial gradient the backward all-reduce sums
            if user not in an.tainted:
                continue  # no gradient flows back from it
            for arg in user.all_input_nodes:
                if arg in found.nodes or arg not in an.tainted:
                    continue
                ref = an.value.get(arg)
                if isinstance(ref, ParamRef) and not ref.is_buffer and ref.fqn not in layouts:
                    found.params.add(ref.fqn)  # gets a partial gradient: all-reduced
                    continue
                return None  # another whole activation would get a partial gradient
            found.nodes.add(user)
            todo.append(user)
    return found


def _module_stat(an: Analysis, module: str, exact: dict[fx.Node, tuple[int, int, int]]) -> SplitStat | None:
    """The runtime rewrites every statistic op in ``module``'s forward: each must be one
    of its own exact split statistics, over one dim and size, the same ops per call."""
    if not module:
        return None  # the root's forward: no module to scope the rewrite to
    sizes: set[tuple[int, int, int]] = set()
    calls: dict[str, list[str]] = defaultdict(list)
    for node in stat_nodes(an.graph, module, within=True):
        if node not in exact or innermost_module(node) != module:
            return None
        sizes.add(exact[node])
        calls[_call_key(node, module)].append(STAT_OPS[node.target.overloadpacket])
    per_call = {tuple(ops) for ops in calls.values()}
    if len(sizes) != 1 or len(per_call) != 1:
        return None
    dim, size, local = sizes.pop()
    return SplitStat(module, dim, size, local, per_call.pop())


def stat_nodes(graph: fx.Graph, module: str, *, within: bool = False) -> list[fx.Node]:
    """The statistic ops ``module``'s forward runs (``within``: its children's too), in
    graph order: what its split-statistic rewrite sees (the cost model sizes them)."""
    out = []
    for node in graph.nodes:
        if node.op != "call_function" or getattr(node.target, "overloadpacket", None) not in STAT_OPS:
            continue
        if (module in module_path(node)) if within else innermost_module(node) == module:
            out.append(node)
    return out


def _call_key(node: fx.Node, module: str) -> str:
    """The ``nn_module_stack`` key of the call of ``module`` that ``node`` runs in."""
    for key, (path, _) in (node.meta.get("nn_module_stack") or {}).items():
        if path == module:
            return key
    return module
