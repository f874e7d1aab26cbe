"""Find the stacked-experts modules of a mixture-of-experts model from the dataflow.

A module holds experts when it owns parameters stacked along a leading *expert* dim
``E`` (``gate_up_proj (E, 2I, H)``, ``down_proj (E, H, I)``, GPT-OSS's biases
``(E, 2I)``) and its forward picks those rows with values computed from a router's
``topk`` over ``E`` scores: ``w[expert_ids]`` in eager code, a grouped matmul whose group
offsets count the top-k ids in transformers' ``grouped_mm`` path.  Names are never
looked at: in the traced graph,

1. the *routed* values are everything computed from a ``topk`` node's outputs;
2. a parameter (through views, transposes and casts) of at least 3 dims is *expert
   stacked* when an op of its own module reads it together with a routed value;
3. the module's other parameters with the same leading size ``E`` (biases) come along,
   and ``E`` must equal the last dim of a ``topk`` input (the router's scores).

Only the traced (representative) blocks are seen; callers expand the FQNs to every
block of the stack.

Example:
    >>> cap = capture(model)                                  # doctest: +SKIP
    >>> find_experts(cap.graph, cap.param_of_placeholder)
    {'model.layers.0.mlp.experts': ExpertsFound(num_experts=4, params=['down_proj', 'gate_up_proj'])}
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..analysis.fixups import verify_fixups
from ..analysis.propagate import innermost_module
from ..errors import TPError
from .types import ExpertsPlan

__all__ = ["ExpertsFound", "expert_plans", "find_experts", "find_routers"]

aten = torch.ops.aten
# ops that only reinterpret a parameter: the result still "is" the parameter
# contractions: a router's scores come from one, and the walk back from topk stops there
_CONTRACTIONS = {aten.linear.default, aten.matmul.default, aten.mm.default, aten.addmm.default,
                 aten.bmm.default, aten.einsum.default}
_VIEWS = {aten.transpose.int, aten.permute.default, aten.t.default, aten.view.default,
          aten.reshape.default, aten._to_copy.default, aten.to.dtype, aten.alias.default,
          aten.expand.default, aten.contiguous.default, aten.clone.default}


@dataclass
class ExpertsFound:
    """One experts module: ``E`` and the names (local to the module) of its stacked params."""

    num_experts: int
    params: list[str] = field(default_factory=list)


def _flat_nodes(args: object) -> Iterator[fx.Node]:
    if isinstance(args, fx.Node):
        yield args
    elif isinstance(args, list | tuple):
        for a in args:
            yield from _flat_nodes(a)
    elif isinstance(args, dict):
        for a in args.values():
            yield from _flat_nodes(a)


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    return tuple(int(s) for s in val.shape) if isinstance(val, torch.Tensor) else None


def _routed(graph: fx.Graph) -> tuple[set[fx.Node], set[int]]:
    """Every node computed from a ``topk`` output, and the sizes topk chose among."""
    routed: set[fx.Node] = set()
    sizes: set[int] = set()
    for node in graph.nodes:  # topological order: inputs are decided first
        if node.op != "call_function":
            continue
        if node.target is aten.topk.default:
            shape = _shape(node.args[0])
            if shape:
                sizes.add(shape[-1])
            routed.add(node)
        elif any(a in routed for a in _flat_nodes((node.args, node.kwargs))):
            routed.add(node)
    return routed, sizes


def _param_views(node: fx.Node) -> Iterator[fx.Node]:
    """``node`` (a parameter placeholder) and the view-like ops reading it, transitively."""
    stack = [node]
    while stack:
        cur = stack.pop()
        yield cur
        stack.extend(u for u in cur.users if u.op == "call_function" and u.target in _VIEWS)


def _picked_by_router(placeholder: fx.Node, owner: str, routed: set[fx.Node]) -> bool:
    for view in _param_views(placeholder):
        for user in view.users:
            if user.op != "call_function" or user.target in _VIEWS:
                continue
            inside = innermost_module(user) == owner or innermost_module(user).startswith(owner + ".")
            if inside and any(a in routed for a in _flat_nodes((user.args, user.kwargs)) if a is not view):
                return True
    return False


def find_experts(graph: fx.Graph, param_of_placeholder: dict[str, str]) -> dict[str, ExpertsFound]:
    """``{module fqn: ExpertsFound}`` for every experts module of the traced graph."""
    routed, sizes = _routed(graph)
    if not routed:
        return {}
    shapes: dict[str, tuple[int, ...]] = {}
    stacked: dict[str, set[int]] = {}
    for node in graph.nodes:
        fqn = param_of_placeholder.get(node.name) if node.op == "placeholder" else None
        shape = _shape(node) if fqn else None
        if fqn is None or shape is None:
            continue
        shapes[fqn] = shape
        owner = fqn.rpartition(".")[0]
        if len(shape) >= 3 and shape[0] in sizes and _picked_by_router(node, owner, routed):
            stacked.setdefault(owner, set()).add(shape[0])
    found: dict[str, ExpertsFound] = {}
    for owner, leading in stacked.items():
        if len(leading) != 1:
            continue  # stacks of different sizes in one module: not one set of experts
        (e,) = leading
        names = sorted(f.rpartition(".")[2] for f, s in shapes.items()
                       if f.rpartition(".")[0] == owner and len(s) >= 2 and s[0] == e)
        found[owner] = ExpertsFound(num_experts=e, params=names)
    return found


def find_routers(graph: fx.Graph, param_of_placeholder: dict[str, str]) -> list[str]:
    """The modules whose parameter a contraction reads to make the scores a ``topk``
    chooses experts from (walking back from each ``topk`` input, stopping at the first
    contraction on every path): an MoE router, however it is written or named."""
    owners: set[str] = set()
    for topk in graph.nodes:
        if topk.op != "call_function" or topk.target is not aten.topk.default:
            continue
        stack, seen = [topk.args[0]], set()
        while stack:
            node = stack.pop()
            if not isinstance(node, fx.Node) or node in seen or node.op != "call_function":
                continue
            seen.add(node)
            if node.target in _CONTRACTIONS:
                for a in _flat_nodes((node.args, node.kwargs)):
                    src = a
                    while src.op == "call_function" and src.target in _VIEWS:
                        src = src.args[0]
                    fqn = param_of_placeholder.get(src.name) if src.op == "placeholder" else None
                    if fqn is not None:
                        owners.add(fqn.rpartition(".")[0])
                continue
            stack.extend(_flat_nodes((node.args, node.kwargs)))
    return sorted(owners)


def _size_attrs(model: nn.Module, found: dict[str, ExpertsFound], ep: int,
                signature: Callable[[], Any]) -> dict[str, dict[str, list[int]]]:
    """Integer attributes equal to ``E`` that the forward turns into a shape (``histc``
    bins, ``one_hot`` classes): the fix-up machinery keeps those whose local value
    changes a shape of the forward, so a width that merely equals ``E`` is left alone."""
    candidates: dict[str, dict[str, list[int]]] = {}
    for fqn, info in found.items():
        module = model.get_submodule(fqn)
        attrs = {k: [v, v // ep] for k, v in vars(module).items() if type(v) is int and v == info.num_experts}
        if attrs:
            candidates[fqn] = attrs
    return verify_fixups(model, candidates, signature) if candidates else {}


def expert_plans(model: nn.Module, graph: fx.Graph, param_of_placeholder: dict[str, str],
                 expand: Callable[[str], list[str]], ep: int,
                 signature: Callable[[], Any]) -> dict[str, ExpertsPlan]:
    """Every experts module of ``model`` (all blocks) as plan entries for ``ep`` ranks.

    ``E % ep != 0`` raises a :class:`TPError` naming the module; the size attributes are
    verified (one shapes-only forward each, ``signature``) only when ``ep > 1``."""
    found = find_experts(graph, param_of_placeholder)
    for fqn, info in found.items():
        if info.num_experts % ep:
            ok = [d for d in range(1, info.num_experts + 1) if info.num_experts % d == 0]
            raise TPError(f"{fqn} ({type(model.get_submodule(fqn)).__name__}) has {info.num_experts} experts, "
                          f"not divisible by ep={ep}; use an ep that divides it: {ok}")
    attrs = _size_attrs(model, found, ep, signature) if ep > 1 else {}
    return {name: ExpertsPlan(fqn=name, num_experts=info.num_experts, params=list(info.params),
                              size_attrs=dict(attrs.get(fqn, {})))
            for fqn, info in found.items() for name in expand(fqn)}
