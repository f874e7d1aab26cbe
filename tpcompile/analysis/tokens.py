"""Which ops are token-local: the rules sequence parallelism stands on.

Sequence parallelism runs the code *between* tensor-parallel regions (norms, residual
adds, dropout, a router's softmax) on this rank's slice of the tokens. That is exact only
if every such op computes each token's output from that token's inputs alone. This
module answers it per ATen op of the captured graph, from shapes, the way the other rules
answer "where do features go":

* a value that carries tokens has a :class:`Tokens` tag: the dim that holds them and
  whether batch rows were merged into it (``(B, S, H).view(-1, H)``: fine for row-wise
  math, but no longer a dim one can split into contiguous per-rank chunks);
* pointwise ops keep the tag if every other operand broadcasts along it;
* reductions, softmax, top-k, norms keep it if they do not run along it;
* views keep it while the token dim stays whole (batch dims may merge in);
* a matmul keeps it on a row dim of the tagged operand against an untagged one;
* everything else that reads tagged values mixes tokens (attention scores, a
  convolution over time, a cumulative sum, a position lookup) and is refused, with the
  op named.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = ["Mixes", "Tokens", "propagate_tokens"]

aten = torch.ops.aten


@dataclass(frozen=True)
class Tokens:
    """The token dim of a value; ``merged``: batch rows folded into it."""

    dim: int
    merged: bool = False


class Mixes(Exception):
    """An op reads token-carrying values in a way that mixes tokens."""


def _val(x: Any) -> Any:
    return x.meta.get("val") if isinstance(x, fx.Node) else None


def _shape(x: Any) -> tuple[int, ...] | None:
    v = _val(x)
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _norm(dim: int, nd: int) -> int:
    return dim + nd if dim < 0 else dim


_SAME = {  # one input carries the tag through unchanged (layout or dtype only)
    aten.clone.default, aten._to_copy.default, aten.detach.default, aten.alias.default,
    aten.contiguous.default, aten.lift_fresh_copy.default, aten.zeros_like.default,
    aten.ones_like.default, aten.empty_like.default, aten.full_like.default,
    aten.native_dropout.default, aten.dropout.default, aten.to.dtype, aten.type_as.default,
}
_REDUCE = {  # (input, dims, keepdim, ...)
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.var.correction, aten.std.correction, aten.linalg_vector_norm.default,
    aten.any.dim, aten.all.dim, aten.argmax.default, aten.argmin.default,
    aten.max.dim, aten.min.dim, aten.logsumexp.default, aten.var_mean.correction,
}
_ALONG = {  # (input, dim, ...): ops along one dim, which must not be the token dim
    aten._softmax.default, aten._log_softmax.default, aten.softmax.int,
    aten.log_softmax.int, aten.topk.default, aten.sort.default, aten.split.Tensor,
    aten.split_with_sizes.default, aten.unbind.int, aten.chunk.default, aten.glu.default,
    aten.select.int, aten.slice.Tensor, aten.narrow.default, aten.index_select.default,
    aten.squeeze.dim, aten.unsqueeze.default, aten.gather.default, aten.cumsum.default,
}

_DIM_THIRD = {aten.topk.default, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default}
# (input, normalized_shape, ...): normalize over the trailing dims
_NORMS = {op for name in ("native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm")
          if (op := getattr(getattr(aten, name, None), "default", None)) is not None}


def _pointwise(node: fx.Node, tags: dict[fx.Node, Tokens]) -> Tokens:
    out = _shape(node)
    if out is None:
        raise Mixes("no shape")
    where: set[tuple[int, bool]] = set()
    for x in node.all_input_nodes:
        shp = _shape(x)
        if shp is None:
            continue
        tag = tags.get(x)
        if tag is not None:
            where.add((len(out) - len(shp) + tag.dim, tag.merged))
    if len(where) != 1:
        raise Mixes("operands carry tokens along different dims")
    dim, merged = where.pop()
    for x in node.all_input_nodes:  # untagged operands must broadcast along the tokens
        shp = _shape(x)
        if shp is None or x in tags:
            continue
        at = dim - (len(out) - len(shp))
        if at >= 0 and shp[at] != 1:
            raise Mixes(f"a value of shape {list(shp)} that is not split by token meets tokens at dim {dim}")
    return Tokens(dim, merged)


def _view(node: fx.Node, tag: Tokens, src: fx.Node) -> Tokens:
    """The token dim stays whole: its end is a boundary of the output's dims and the
    dims before it only fold into it (batch rows merging in)."""
    ins, out = _shape(src), _shape(node)
    if ins is None or out is None:
        raise Mixes("no shape")
    before = math.prod(ins[: tag.dim])
    end = before * ins[tag.dim]
    for j in range(len(out)):
        start_j = math.prod(out[:j])
        if math.prod(out[: j + 1]) == end and before % start_j == 0 and out[j] % ins[tag.dim] == 0:
            return Tokens(j, tag.merged or start_j != before)
    raise Mixes(f"a view {list(ins)} -> {list(out)} splits the token dim")


def _reduce_dims(node: fx.Node, nd: int) -> tuple[list[int], bool]:
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if dims is None:
        return list(range(nd)), False
    dims = [dims] if isinstance(dims, int) else list(dims)
    if not dims:
        return list(range(nd)), False
    keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
    return [_norm(d, nd) for d in dims], keep


def _rule(node: fx.Node, tags: dict[fx.Node, Tokens]) -> Tokens:
    target = node.target
    src = node.args[0] if node.args else None
    tag = tags.get(src) if isinstance(src, fx.Node) else None
    nd = len(_shape(src) or ()) if isinstance(src, fx.Node) else 0
    if target is operator.getitem:  # one output of a multi-output op: same token dim
        return tags[src]
    if isinstance(target, torch._ops.OpOverload) and torch.Tag.pointwise in target.tags:
        return _pointwise(node, tags)
    if target in (aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.div.Tensor,
                  aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        return _pointwise(node, tags)
    if target is aten.addmm.default:  # (bias, x, weight): rows of x are tokens
        bias, x, weight = node.args[:3]
        rows = tags.get(x)
        if rows is None or bias in tags or weight in tags or rows.dim != 0:
            raise Mixes("tokens outside the row operand of a matmul")
        return rows
    if tag is None:  # tokens arrive through a later operand: only pointwise ops allow it
        raise Mixes("tokens in a non-leading operand")
    if target in _SAME:
        return tag
    if target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                  aten.expand.default, aten.squeeze.dims, aten.squeeze.default, aten.flatten.using_ints):
        return _view(node, tag, src)
    if target in (aten.t.default, aten.transpose.int, aten.permute.default):
        if target is aten.permute.default:
            order = [_norm(d, nd) for d in node.args[1]]
        else:
            a, b = (0, 1) if target is aten.t.default else (_norm(node.args[1], nd), _norm(node.args[2], nd))
            order = list(range(nd))
            order[a], order[b] = order[b], order[a]
        return Tokens(order.index(tag.dim), tag.merged)
    if target in _REDUCE:
        dims, keep = _reduce_dims(node, nd)
        if tag.dim in dims:
            raise Mixes(f"reduces over the token dim {tag.dim}")
        return Tokens(tag.dim if keep else tag.dim - sum(d < tag.dim for d in dims), tag.merged)
    if target in _ALONG:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        if target in _DIM_THIRD:  # (input, k / sizes / chunks, dim)
            dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", -1 if target is aten.topk.default else 0)
        if target in (aten.sort.default, aten._softmax.default, aten._log_softmax.default) and dim is None:
            dim = -1
        dim = _norm(int(dim), nd)
        if dim == tag.dim:
            raise Mixes(f"runs along the token dim {dim}")
        if target in (aten.select.int, aten.squeeze.dim):
            return Tokens(tag.dim - (dim < tag.dim), tag.merged)
        if target is aten.unsqueeze.default:
            out_nd = nd + 1
            at = _norm(int(node.args[1]), out_nd)
            return Tokens(tag.dim + (at <= tag.dim), tag.merged)
        return tag
    if target in _NORMS:
        if tag.dim >= nd - len(node.args[1]):
            raise Mixes("normalizes over the token dim")
        return tag
    if target in (aten.mm.default, aten.bmm.default, aten.matmul.default, aten.linear.default):
        return _matmul(node, tags, tag, nd)
    raise Mixes("no token rule for this op")


def _matmul(node: fx.Node, tags: dict[fx.Node, Tokens], tag: Tokens, nd: int) -> Tokens:
    other = node.args[1]
    if other in tags:
        raise Mixes("both operands carry tokens (attention-like)")
    if node.target is aten.linear.default:
        if tag.dim == nd - 1:
            raise Mixes("contracts over the token dim")
        return tag
    if tag.dim == nd - 1:
        raise Mixes("contracts over the token dim")
    return tag


def propagate_tokens(node: fx.Node, tags: dict[fx.Node, Tokens]) -> Tokens | None:
    """The token tag of ``node``'s value (``None``: it carries no tokens).

    Raises :class:`Mixes` when the op reads token-carrying inputs and mixes tokens."""
    if node.op != "call_function" or not any(x in tags for x in node.all_input_nodes):
        return None
    if not node.users and node.meta.get("val") is None:  # a check (tensor metadata asserts)
        return None
    try:
        return _rule(node, tags)
    except Mixes:
        raise
    except Exception as err:  # an op shape the rules do not know: refuse, never crash
        raise Mixes(f"no token rule for this call ({type(err).__name__})") from err
