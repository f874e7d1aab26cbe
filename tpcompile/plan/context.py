"""Context parallelism's plan: which code may run on a slice of the sequence.

Under context parallelism every rank of a CP group holds a slice of each sequence's
positions (two mirrored chunks, so causal work is even) and runs the whole model on it;
only attention reads other ranks' positions (their keys and values are gathered,
:mod:`tpcompile.runtime.context`).  That is exact only if every other op computes each
position's output from that position alone.  The same token rules that decide what
sequence parallelism may run on a slice of the tokens (:mod:`tpcompile.rules.tokens`)
decide it here, over the whole captured model: starting from the token ids, every op's
tag is propagated; the attention core (one ``scaled_dot_product_attention``, which
transformers' attention interface routes every implementation through, eager and sdpa
alike, once tpcompile replaces it) is the one op allowed to mix positions.  Anything else
that mixes them (a convolution over time, a selective scan, a cumulative sum over the
sequence, a relative-position bias built from local lengths) makes :func:`check_context`
raise a :class:`~tpcompile.errors.TPError` naming the module and the op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..analysis.propagate import RuleSet, innermost_module
from ..analysis.tokens import Mixes, Tokens, propagate_tokens
from ..capture import capture, example_inputs
from ..errors import TPError

__all__ = ["ATTENTION_OPS", "attention_configs", "check_context", "context_capture"]

aten = torch.ops.aten
# the attention core: positions meet here, through the gathered keys and values
ATTENTION_OPS = (aten.scaled_dot_product_attention.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
                 aten._scaled_dot_product_efficient_attention.default,
                 aten._scaled_dot_product_flash_attention.default)


def attention_configs(model: nn.Module) -> list[Any]:
    """Every config of ``model`` (and its sub-models) that picks an attention implementation."""
    configs = {id(c): c for m in model.modules()
               if hasattr(c := getattr(m, "config", None), "_attn_implementation")}
    return list(configs.values())


@contextlib.contextmanager
def _sdpa(model: nn.Module) -> Iterator[None]:
    """Capture with transformers' sdpa attention: the CP runtime replaces the attention
    function whatever the model uses, so the core is one op in the graph."""
    configs = attention_configs(model)
    saved = [(c, c.__dict__.get("_attn_implementation_internal", None)) for c in configs]
    try:
        for c in configs:
            c._attn_implementation_internal = "sdpa"
        yield
    finally:
        for c, value in saved:
            c._attn_implementation_internal = value


def context_capture(model: nn.Module) -> tuple[Any, dict[fx.Node, Tokens]]:
    """The model captured as context parallelism sees it (sdpa attention, the position
    ids an input), and the token tags of its inputs (the ids and positions)."""
    # the positions are inputs too: the runtime hands every rank its slice of the global
    # position ids, so rotary tables and position embeddings are split like the tokens
    kwargs = example_inputs(model)
    ids_name = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and not v.is_floating_point()
                     and v.dim() == 2), None)
    if ids_name is None:
        raise TPError(f"context parallelism: found no token ids among {type(model).__name__}'s inputs")
    ids = kwargs[ids_name]
    kwargs["position_ids"] = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    with _sdpa(model):
        cap = capture(model, example_kwargs=kwargs)
    tags = {n: Tokens(1) for n in cap.graph.nodes if n.op == "placeholder"
            and any(n.target in (k, f"kwargs_{k}") for k in (ids_name, "position_ids"))}
    return cap, tags


def check_context(model: nn.Module, rules: RuleSet) -> int:
    """Raise unless every op of ``model`` outside attention is position-local; returns the
    number of attention ops found (at least one: otherwise CP has nothing to split)."""
    cap, tags = context_capture(model)
    values = _value_nodes(cap.graph)
    attention = 0
    for node in cap.graph.nodes:
        if node in tags or node not in values:
            continue
        if node.target in ATTENTION_OPS and node.args and node.args[0] in tags:
            tags[node] = tags[node.args[0]]  # each local query's output, from every key
            attention += 1
            continue
        try:
            tag = propagate_tokens(node, tags, rules)
        except Mixes as why:
            op = getattr(node.target, "__name__", str(node.target))
            raise TPError(
                f"context parallelism cannot split {type(model).__name__}'s sequence: "
                f"{innermost_module(node) or '<root>'} mixes positions outside attention (op {op}: {why}). "
                "Add a token rule for it (rules=[...]) if the op is position-local, or train without cp") from None
        if tag is not None:
            tags[node] = tag
    if not attention:
        raise TPError(f"context parallelism: {type(model).__name__} has no attention over the sequence to split")
    return attention


def _value_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes the outputs depend on other than through an attention op's mask: the mask
    the model builds is replaced by the runtime's own, built from global positions."""
    out: set[fx.Node] = set()
    todo = [n for n in graph.nodes if n.op == "output"]
    while todo:
        node = todo.pop()
        if node in out:
            continue
        out.add(node)
        if node.target in ATTENTION_OPS:
            todo.extend(a for a in node.args[:3] if isinstance(a, fx.Node))  # query, key, value
        else:
            todo.extend(node.all_input_nodes)
    return out
