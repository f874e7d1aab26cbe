"""Token rules: which ops keep each token's output a function of that token alone.

Sequence parallelism (:mod:`tpcompile.plan.sequence`) runs the code between
tensor-parallel regions on a slice of the tokens; the engine
(:func:`~tpcompile.analysis.tokens.propagate_tokens`) asks these rules, op by op, where
the tokens of each output are, from shapes:

* pointwise ops keep the tag if every other operand broadcasts along it (an operand
  that is not split by token would meet other ranks' tokens);
* ops that only change layout or dtype (``clone``, ``to``, dropout) keep it;
* reductions, softmax, top-k, norms keep it if they do not run along it;
* views keep it while the token dim stays whole (batch dims may merge in);
* a matmul keeps it on a row dim of the tagged operand against an untagged one.

Everything else that reads tagged values mixes tokens and is refused by the engine.

Writing a token rule (an op applied to each token on its own)::

    from tpcompile.rules import token_rule
    from tpcompile.rules.tokens import pointwise

    @token_rule(torch.ops.my_lib.fused_gelu)
    def fused_gelu_tokens(node, tags):
        return pointwise(node, tags)

and pass it with the other rules: ``transform(model, tp, rules=[fused_gelu_tokens])``.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx as fx

from tpcompile.analysis.tokens import Mixes, TokenRule, Tokens, token_rule

__all__ = ["TOKEN_RULES", "leading", "pointwise", "shape"]

aten = torch.ops.aten
Tags = Mapping[fx.Node, Tokens]


def shape(x: Any) -> tuple[int, ...] | None:
    """The shape of a graph value (``None``: not a tensor)."""
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _norm(dim: int, nd: int) -> int:
    return dim + nd if dim < 0 else dim


def leading(node: fx.Node, tags: Tags) -> tuple[fx.Node, Tokens, int]:
    """``(input, its tag, its rank)`` of an op whose tokens must come in through its
    first operand; tokens arriving through another operand mix them."""
    src = node.args[0] if node.args else None
    tag = tags.get(src) if isinstance(src, fx.Node) else None
    if tag is None:
        raise Mixes("tokens in a non-leading operand")
    return src, tag, len(shape(src) or ())


def pointwise(node: fx.Node, tags: Tags) -> Tokens:
    """Elementwise math with broadcasting: every tagged operand has its tokens at one
    output dim, and every untagged one broadcasts along it."""
    out = shape(node)
    if out is None:
        raise Mixes("no shape")
    where: set[tuple[int, bool]] = set()
    for x in node.all_input_nodes:
        shp = shape(x)
        if shp is None:
            continue
        tag = tags.get(x)
        if tag is not None:
            where.add((len(out) - len(shp) + tag.dim, tag.merged))
    if len(where) != 1:
        raise Mixes("operands carry tokens along different dims")
    dim, merged = where.pop()
    for x in node.all_input_nodes:  # untagged operands must broadcast along the tokens
        shp = shape(x)
        if shp is None or x in tags:
            continue
        at = dim - (len(out) - len(shp))
        if at >= 0 and shp[at] != 1:
            raise Mixes(f"a value of shape {list(shp)} that is not split by token meets tokens at dim {dim}")
    return Tokens(dim, merged)


# ---------------------------------------------------------------- the rules


@token_rule(operator.getitem)
def getitem_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """One output of a multi-output op: the same token dim."""
    return tags[node.args[0]]


@token_rule(torch.Tag.pointwise, aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor,
            aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def pointwise_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """Every op ATen tags pointwise, and the elementwise ops it does not."""
    return pointwise(node, tags)


@token_rule(aten.embedding.default)
def embedding_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """``embedding(table, ids)``: each position's row from its own id."""
    table, ids = node.args[:2]
    tag = tags.get(ids)
    if tag is None or table in tags:
        raise Mixes("tokens in the table of a lookup")
    return tag


@token_rule(aten.cat.default)
def cat_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """``cat(parts, dim)`` along another dim, every part carrying the same tokens
    (rotary's ``cat((freqs, freqs), -1)``)."""
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    found = [tags.get(p) for p in parts]
    if any(t is None for t in found) or len(set(found)) != 1:
        raise Mixes("joins values that do not carry the same tokens")
    if _norm(int(dim), len(shape(parts[0]) or ())) == found[0].dim:
        raise Mixes("concatenates along the token dim")
    return found[0]


@token_rule(aten.stack.default)
def stack_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """``stack(parts, dim)``: a new dim, every part carrying the same tokens (a rotation's
    ``stack((-x2, x1), -1)``)."""
    parts = node.args[0]
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    found = [tags.get(p) for p in parts]
    if any(t is None for t in found) or len(set(found)) != 1:
        raise Mixes("stacks values that do not carry the same tokens")
    at = _norm(int(dim), len(shape(parts[0]) or ()) + 1)
    return Tokens(found[0].dim + (at <= found[0].dim), found[0].merged)


@token_rule(aten.addmm.default)
def addmm_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """``(bias, x, weight)``: the rows of ``x`` are tokens."""
    bias, x, weight = node.args[:3]
    rows = tags.get(x)
    if rows is None or bias in tags or weight in tags or rows.dim != 0:
        raise Mixes("tokens outside the row operand of a matmul")
    return rows


@token_rule(aten.clone.default, aten._to_copy.default, aten.detach.default, aten.alias.default,
            aten.contiguous.default, aten.lift_fresh_copy.default, aten.zeros_like.default,
            aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
            aten.native_dropout.default, aten.dropout.default, aten.dropout_.default, aten.to.dtype,
            aten.to.dtype_layout,
            aten.to.device, aten.type_as.default)
def same_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """Layout or dtype only: the input's tag, unchanged."""
    return leading(node, tags)[1]


@token_rule(aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
            aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints)
def view_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """The token dim stays whole: its end is a boundary of the output's dims and the
    dims before it only fold into it (batch rows merging in)."""
    src, tag, _ = leading(node, tags)
    ins, out = shape(src), shape(node)
    if node.target is aten.expand.default and ins is not None and out is not None and len(out) >= len(ins):
        at = tag.dim + len(out) - len(ins)  # expand adds leading dims and widens size-1 ones
        if out[at] == ins[tag.dim]:
            return Tokens(at, tag.merged)
    if ins is None or out is None:
        raise Mixes("no shape")
    before = math.prod(ins[: tag.dim])
    end = before * ins[tag.dim]
    for j in range(len(out)):
        start_j = math.prod(out[:j])
        if math.prod(out[: j + 1]) == end and before % start_j == 0 and out[j] % ins[tag.dim] == 0:
            return Tokens(j, tag.merged or start_j != before)
    raise Mixes(f"a view {list(ins)} -> {list(out)} splits the token dim")


@token_rule(aten.t.default, aten.transpose.int, aten.permute.default)
def permute_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """Dims reordered: the token dim moves with them."""
    _, tag, nd = leading(node, tags)
    if node.target is aten.permute.default:
        order = [_norm(d, nd) for d in node.args[1]]
    else:
        a, b = (0, 1) if node.target is aten.t.default else (_norm(node.args[1], nd), _norm(node.args[2], nd))
        order = list(range(nd))
        order[a], order[b] = order[b], order[a]
    return Tokens(order.index(tag.dim), tag.merged)


@token_rule(aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
            aten.var.correction, aten.std.correction, aten.linalg_vector_norm.default,
            aten.any.dim, aten.all.dim, aten.argmax.default, aten.argmin.default,
            aten.max.dim, aten.min.dim, aten.logsumexp.default, aten.var_mean.correction)
def reduce_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """``(input, dims, keepdim, ...)``: token-local unless it reduces over the tokens."""
    _, tag, nd = leading(node, tags)
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is not None:
        dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims:
        dims, keep = list(range(nd)), False
    else:
        dims = [_norm(d, nd) for d in dims]
        keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    if tag.dim in dims:
        raise Mixes(f"reduces over the token dim {tag.dim}")
    return Tokens(tag.dim if keep else tag.dim - sum(d < tag.dim for d in dims), tag.merged)


_DIM_THIRD = {aten.topk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
              aten.repeat_interleave.self_int}


@token_rule(aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
            aten.log_softmax.int, aten.topk.default, aten.sort.default, aten.split.Tensor,
            aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default, aten.glu.default,
            aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.index_select.default,
            aten.squeeze.dim, aten.unsqueeze.default, aten.gather.default, aten.cumsum.default,
            aten.repeat_interleave.self_int)
def along_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """``(input, dim, ...)``: an op along one dim, which must not be the token dim
    (Cohere's rotary ``repeat_interleave(freqs, 2, dim=-1)`` runs along the features)."""
    target = node.target
    _, tag, nd = leading(node, tags)
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if target in _DIM_THIRD:  # (input, k / sizes / chunks / repeats, dim)
        default = {aten.topk.default: -1, aten.repeat_interleave.self_int: None}.get(target, 0)
        dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", default)
    if target is aten.repeat_interleave.self_int and dim is None:
        raise Mixes("repeat_interleave without a dim flattens the tokens into the features")
    if target in (aten.sort.default, aten._softmax.default, aten._log_softmax.default) and dim is None:
        dim = -1
    if target is aten.unsqueeze.default:  # a new dim, counted in the output's rank: never the tokens
        at = _norm(int(dim), nd + 1)
        return Tokens(tag.dim + (at <= tag.dim), tag.merged)
    dim = _norm(int(dim), nd)
    if dim == tag.dim:
        raise Mixes(f"runs along the token dim {dim}")
    if target in (aten.select.int, aten.squeeze.dim):
        return Tokens(tag.dim - (dim < tag.dim), tag.merged)
    return tag


_NORM_OPS = tuple(op for name in ("native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm")
                  if (op := getattr(getattr(aten, name, None), "default", None)) is not None)


@token_rule(*_NORM_OPS)
def norm_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """``(input, normalized_shape, ...)``: normalizes over the trailing dims."""
    _, tag, nd = leading(node, tags)
    if tag.dim >= nd - len(node.args[1]):
        raise Mixes("normalizes over the token dim")
    return tag


@token_rule(aten.mm.default, aten.bmm.default, aten.matmul.default, aten.linear.default)
def matmul_tokens(node: fx.Node, tags: Tags) -> Tokens:
    """Tokens on a row dim of the first operand, against an operand without tokens."""
    _, tag, nd = leading(node, tags)
    if node.args[1] in tags:
        raise Mixes("both operands carry tokens (attention-like)")
    if tag.dim == nd - 1:
        raise Mixes("contracts over the token dim")
    return tag


TOKEN_RULES: list[TokenRule] = [
    getitem_tokens, pointwise_tokens, embedding_tokens, cat_tokens, stack_tokens, addmm_tokens, same_tokens, view_tokens,
    permute_tokens,
    reduce_tokens, along_tokens, norm_tokens, matmul_tokens,
]
