"""Context parallelism's plan: which code may run on a slice of the sequence.

Under context parallelism every rank of a CP group holds a slice of each sequence's
positions (two mirrored chunks, so causal work is even) and runs the whole model on it;
only attention reads other ranks' positions (their keys and values are gathered,
:mod:`tpcompile.runtime.context`).  That is exact only if every other op computes each
position's output from that position alone.  The same token rules that decide what
sequence parallelism may run on a slice of the tokens (:mod:`tpcompile.rules.tokens`)
decide it here, over the whole captured model: starting from the token ids, every op's
tag is propagated; the attention core (one ``scaled_dot_product_attention``: the model is
captured with a plain sdpa core under transformers' attention interface, whatever the
layer passes it, softcapping, sinks or a window, since the runtime replaces that function
anyway) is the one op allowed to mix positions.  A stacked-experts module
(:func:`~tpcompile.plan.experts.find_experts`) is read as one per-token op: without a
capacity limit each token's output is a weighted sum of its own experts' outputs, the
property expert parallelism's dispatch stands on too (the routing inside sorts the
tokens by expert, which the token rules would rightly call mixing).  Anything else that
mixes positions (a convolution over time, a selective scan, a cumulative sum over the
sequence, a relative-position bias built from local lengths, a router's load-balancing
loss over the whole batch) makes :func:`check_context` raise a
:class:`~tpcompile.errors.TPError` naming the module and the op.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..analysis.propagate import RuleSet, innermost_module, module_path
from ..analysis.tokens import Mixes, Tokens, propagate_tokens
from ..capture import capture, example_inputs
from ..errors import TPError
from .experts import find_experts

__all__ = ["ATTENTION_OPS", "CAPTURE_KEY", "attention_configs", "check_context", "context_capture"]

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


CAPTURE_KEY = "tpcompile_cp_capture"  # the capture's attention under transformers' interface


def _capture_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention the position check captures: one sdpa over the layer's queries,
    keys and values.  Softcapping, sinks and windows change the weights, not which
    positions meet, and the runtime replaces this function anyway."""
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def _sdpa(model: nn.Module) -> Iterator[None]:
    """Capture with :func:`_capture_attention` (and sdpa's masks): the CP runtime
    replaces the attention function whatever the model uses, so the core is one op in the
    graph, also for layers transformers' sdpa refuses (softcapping)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(CAPTURE_KEY, _capture_attention)
    AttentionMaskInterface.register(CAPTURE_KEY, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    configs = attention_configs(model)
    saved = [(c, c.__dict__.get("_attn_implementation_internal", None)) for c in configs]
    try:
        for c in configs:
            c._attn_implementation_internal = CAPTURE_KEY
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
    _check_router_loss(model)
    cap, tags = context_capture(model)
    values = _value_nodes(cap.graph)
    experts = {fqn: _Experts() for fqn in find_experts(cap.graph, cap.param_of_placeholder)}
    attention = 0
    for node in cap.graph.nodes:
        if node in tags or node not in values:
            continue
        if _per_token_experts(node, tags, experts):
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


@dataclass
class _Experts:
    """What a stacked-experts module reads: the tag and length of its token dim."""

    tag: Tokens | None = None
    length: int = 0


def _per_token_experts(node: fx.Node, tags: dict[fx.Node, Tokens], experts: dict[str, _Experts]) -> bool:
    """Whether ``node`` belongs to a stacked-experts module (then it is tagged here, not
    by the token rules): inside, nothing is tagged; the module's outputs, the values
    used outside it, carry the token tag of the first token-carrying value it reads (its
    hidden states), when their token dim has that value's length."""
    path = module_path(node)
    inside = next((fqn for fqn in experts if fqn in path), None)
    if inside is None:
        return False
    seen = experts[inside]
    if seen.tag is None:
        source = next((a for a in node.all_input_nodes if a in tags and inside not in module_path(a)), None)
        if source is not None:
            seen.tag, seen.length = tags[source], _shape(source)[tags[source].dim]
    if seen.tag is not None and any(inside not in module_path(user) for user in node.users):
        shape = _shape(node)
        if len(shape) <= seen.tag.dim or shape[seen.tag.dim] != seen.length:
            raise TPError(f"context parallelism: the output of experts module {inside} is not per token "
                          f"(shape {list(shape)}); train without cp")
        tags[node] = seen.tag
    return True


def _shape(node: fx.Node) -> tuple[int, ...]:
    value = node.meta.get("val")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _check_router_loss(model: nn.Module) -> None:
    """A router's load-balancing loss is a product of means over every token of the batch:
    each rank's part of it is not a part of the whole, so it is refused."""
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if getattr(cfg, "output_router_logits", False) and getattr(cfg, "router_aux_loss_coef", 1.0):
            raise TPError(f"context parallelism: {type(model).__name__}'s config has output_router_logits=True, "
                          "whose load-balancing loss averages the router over the whole sequence (each rank "
                          "sees only its positions); set config.output_router_logits = False or train "
                          "without cp")


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
