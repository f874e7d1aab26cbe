"""Canonical forms of a captured graph: one name per op, one path per module.

The analysis and the runtime look ops up by name and modules by their path in the
model; export can write either in more than one way.
"""

from __future__ import annotations

import re

import torch
from torch import nn

__all__ = ["canonical_aliases", "canonical_module_paths"]


# ATen's alias ops that torch.export may keep (Gemma 3n's ``torch.multiply``): the same
# op under another name, rewritten to the name the rules and the runtime know
_ALIASES = {"multiply": "mul", "divide": "div", "subtract": "sub", "greater": "gt", "greater_equal": "ge",
            "less": "lt", "less_equal": "le", "not_equal": "ne", "negative": "neg", "absolute": "abs",
            "arctan": "atan", "clip": "clamp", "multiply_": "mul_", "divide_": "div_", "subtract_": "sub_"}


def canonical_aliases(graph: torch.fx.Graph) -> None:
    """Rewrite every alias op of ``graph`` (``aten.multiply.Tensor``) to its canonical
    overload (``aten.mul.Tensor``): the same computation, one name for the analysis."""
    aten = torch.ops.aten
    for node in graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        name = getattr(packet, "__name__", "").split(".")[-1]
        if node.op != "call_function" or name not in _ALIASES:
            continue
        canonical = getattr(getattr(aten, _ALIASES[name]), node.target._overloadname, None)
        if canonical is not None:
            node.target = canonical


# how export's non-strict tracer writes a module it reached through a slice of a
# container: ``layers.slice(None, 2, None).0``
_SLICED = re.compile(r"\.slice\(([^()]*)\)\.(\d+)")


def canonical_module_paths(graph: torch.fx.Graph, model: nn.Module) -> None:
    """Rewrite every module path of ``graph``'s ``nn_module_stack`` to the module's own
    name in ``model``, the one ``named_modules()`` gives it.

    Export names a module by the way the forward reached it once the model holds some
    module under two names: PEFT's prompt tuning calls the input embedding as
    ``word_embeddings``, and VeRA shares its projection buffers with every layer it
    adapts, so ``self.layers[: config.num_hidden_layers]`` reads as
    ``layers.slice(None, 2, None).0``.  Under those names the modules would match no
    parameter's owner."""
    names = {id(m): name for name, m in model.named_modules()}
    seen: dict[str, str] = {}
    for node in graph.nodes:
        stack = node.meta.get("nn_module_stack")
        for key, (path, cls) in list((stack or {}).items()):
            if path not in seen:
                seen[path] = _own_name(path, model, names)
            stack[key] = (seen[path], cls)


def _own_name(path: str, model: nn.Module, names: dict[int, str]) -> str:
    while (m := _SLICED.search(path)) is not None:
        try:
            container = model.get_submodule(path[: m.start()])
            bounds = [None if b.strip() == "None" else int(b) for b in m.group(1).split(",")]
            index = range(len(container))[slice(*bounds)][int(m.group(2))]
        except (AttributeError, ValueError, TypeError, IndexError):
            return path  # not a container slice this model can resolve: left as written
        path = f"{path[: m.start()]}.{index}{path[m.end():]}"
    try:
        return names.get(id(model.get_submodule(path)), path)
    except AttributeError:
        return path
