"""Contraction rules: where column, row and vocab parallelism come from.

Megatron's rule, stated over the dataflow:

* a parameter contracted with a *replicated* activation is **column-parallel**: each of
  its output features becomes an atom, ``Y = X·[W_1 … W_p]``;
* a parameter contracted over *sharded* features is **row-parallel**: its input features
  join the atoms they meet, and its output is a partial sum (one all-reduce);
* an ``embedding`` table is **vocab-parallel** (rows split, masked lookup, all-reduce);
* activation × activation contractions (``q @ kᵀ``, ``attn @ v``, SDPA) tie batch-aligned
  features (a query head to its key/value head) and everything contracted over (a head's
  ``head_dim``) into one unit.

The weight may reach the op transposed or cast (Falcon's ``x @ W.T``, GPT-2's ``Conv1D``
``addmm`` with a ``[in, out]`` weight, a ``[E, in, out]`` grouped matmul of fused MoE
experts): :class:`ParamRef` tracks which parameter dim is contracted.
"""

from __future__ import annotations

import string

import numpy as np
import torch

from tpcompile.analysis.propagate import Analysis, innermost_module, rule
from tpcompile.analysis.state import (
    Aligned,
    ColumnUse,
    EmbeddingUse,
    Feat,
    ParamRef,
    Partial,
    RowAddend,
    RowUse,
)

__all__ = ["CONTRACT_RULES", "linear_like"]

aten = torch.ops.aten


def linear_like(
    an: Analysis,
    node: torch.fx.Node,
    x: torch.fx.Node,
    w: ParamRef,
    w_in: int,
    w_out: int,
    bias: object = None,
    *,
    feature_dim: int = -1,
) -> object:
    """``x`` contracted with parameter ``w`` over tensor dim ``w_in`` of ``w``'s view; the
    features sit on ``feature_dim`` of ``x`` and of the result (channels: dim 1)."""
    p_in, p_out = w.dims[w_in], w.dims[w_out]
    xv = an.val(x)
    module = innermost_module(node)
    bias_ref = an.val(bias) if isinstance(bias, torch.fx.Node) else None
    bias_fqn = bias_ref.fqn if isinstance(bias_ref, ParamRef) else None
    if p_in is None or p_out is None:
        an.poison_node(node, f"weight {w.fqn} is used through a view tpcompile cannot map", xv)
        return None
    if isinstance(xv, Partial):
        an.reduce_partials(node)
        xv = None
    nd = an.ndim(node)
    fd = feature_dim % nd
    out_features = an.shape(node)[fd]
    if xv is None:
        if w.fqn in an.forced_replicated or (w.fqn, p_out) in an.forced_replicated:
            return None
        atoms = an.atoms.param_atoms(w.fqn, p_out, out_features)
        if bias_fqn is not None:
            an.union(an.atoms.param_atoms(bias_fqn, bias_ref.dims[0], out_features), atoms)
        an.columns.append(ColumnUse(node, w.fqn, p_out, p_in, bias_fqn, module, atoms))
        return Feat(atoms.reshape([-1 if d == fd else 1 for d in range(nd)]))
    if not isinstance(xv, Feat):
        return None
    xa = an.aligned_to(xv.atoms, an.ndim(x))
    xfd = feature_dim % an.ndim(x)
    if any(s > 1 for d, s in enumerate(xa.shape) if d != xfd) or xa.shape[xfd] == 1:
        an.poison_node(node, f"{w.fqn} contracts features that vary along other dims", xv)
        return None
    k = an.shape(x)[xfd]
    in_atoms = an.atoms.param_atoms(w.fqn, p_in, k)
    an.union(in_atoms, xa.reshape(-1))
    # a convolution adds its bias on the channels inside the op, before any reduce can:
    # one rank adds it and the exit's all-reduce sums it once (an addend)
    inside = bias_fqn is not None and xfd != an.ndim(x) - 1
    an.rows.append(RowUse(node, w.fqn, p_in, None if inside else bias_fqn, module, in_atoms))
    if inside:
        an.row_addends.append(RowAddend(node, bias_fqn, (len(an.rows) - 1,)))
    return Partial((len(an.rows) - 1,))


@rule(aten.linear)
def linear(an: Analysis, node: torch.fx.Node) -> object:
    w = an.val(node.args[1])
    if not isinstance(w, ParamRef):
        return activation_matmul(an, node, node.args[0], node.args[1], transpose_y=True)
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    return linear_like(an, node, node.args[0], w, 1, 0, bias)


@rule(aten.addmm)
def addmm(an: Analysis, node: torch.fx.Node) -> object:
    bias, x, w = node.args[:3]
    wv = an.val(w)
    if isinstance(wv, ParamRef):
        return linear_like(an, node, x, wv, 0, 1, bias)
    return activation_matmul(an, node, x, w)


@rule(aten.mm, aten.matmul, aten.bmm)
def matmul(an: Analysis, node: torch.fx.Node) -> object:
    x, y = node.args[:2]
    xv, yv = an.val(x), an.val(y)
    if isinstance(yv, ParamRef) and an.ndim(y) >= 2:
        return linear_like(an, node, x, yv, an.ndim(y) - 2, an.ndim(y) - 1)
    if isinstance(xv, ParamRef) and an.ndim(x) == 2 and an.ndim(y) >= 2:
        # W @ y (Mamba's dt_proj.weight @ time_step): rows of W are the output features,
        # on dim -2 of the result, and y's dim -2 is contracted
        return linear_like(an, node, y, xv, 1, 0, feature_dim=-2)
    return activation_matmul(an, node, x, y)


@rule(aten._grouped_mm)
def grouped_mm(an: Analysis, node: torch.fx.Node) -> object:
    """``[T, in] x [E, in, out]`` with per-expert token offsets (fused MoE experts)."""
    x, w = node.args[:2]
    wv = an.val(w)
    if isinstance(wv, ParamRef) and an.ndim(w) == 3:
        return linear_like(an, node, x, wv, 1, 2)
    if isinstance(an.val(x), Feat | Partial) or isinstance(wv, Feat):
        an.poison_node(node, "grouped matmul of two activations", an.val(x), wv)
    return None


def activation_matmul(
    an: Analysis, node: torch.fx.Node, x: torch.fx.Node, y: torch.fx.Node, *, transpose_y: bool = False
) -> object:
    """``x [..., m, k] @ y [..., k, n]``: batch dims aligned, ``k`` contracted."""
    xv, yv = an.val(x), an.val(y)
    if isinstance(xv, Partial) or isinstance(yv, Partial):
        an.reduce_partials(node)  # summed first: from here on a replicated value
        xv, yv = (None if isinstance(v, Partial) else v for v in (xv, yv))
    if not isinstance(xv, Feat) and not isinstance(yv, Feat):
        return None
    nd = an.ndim(node)
    if an.ndim(x) < 2 or an.ndim(y) < 2:
        an.poison_node(node, "vector matmul on sharded features", xv, yv)
        return None
    xa = an.aligned_to(xv.atoms, an.ndim(x)) if isinstance(xv, Feat) else None
    ya = an.aligned_to(yv.atoms, an.ndim(y)) if isinstance(yv, Feat) else None
    if ya is not None and transpose_y:
        ya = np.swapaxes(ya, -1, -2)
    contracted = (xa is None and ya is not None and ya.shape[-2] > 1) or (
        ya is None and xa is not None and xa.shape[-1] > 1)
    if contracted and not _fill(an, x if xa is None else y):
        an.poison_node(node, "sharded features contracted with a replicated activation", xv, yv)
        return None
    if xa is None or ya is None:  # the replicated side meets every rank's own features
        an.shares(node, x if xa is None else y, an.aligned_to(xa if ya is None else ya, nd))
    x_m = x_k = y_k = y_n = None
    # the features along the contracted dim ``k`` are summed on one rank: tied into one
    # unit (with those of every row); a ``k`` without features ties nothing (a scan's
    # per-channel state times a shared vector keeps its channels apart)
    if xa is not None:
        xa = an.aligned_to(xa, nd)
        if xa.shape[-1] > 1:
            x_k = an.union_along(xa, [nd - 2])
            an.union_along(x_k, [nd - 1])
        x_m = an.union_along(xa, [nd - 1])
    if ya is not None:
        ya = an.aligned_to(ya, nd)
        if ya.shape[-2] > 1:
            y_k = an.union_along(ya, [nd - 1])
            an.union_along(y_k, [nd - 2])
        y_n = an.union_along(ya, [nd - 2])
    if x_k is not None and y_k is not None:
        an.union(np.swapaxes(x_k, -1, -2), y_k)
    parts = [p for p in (x_m, y_n) if p is not None]
    out = an.tie(parts)  # x's rows and y's columns (at most two parts)
    return an.feat(out)


def _fill(an: Analysis, node: torch.fx.Node) -> bool:
    """A fresh fill (a scan's zero initial state): one value everywhere, so any rank's
    slice of it is the same and it may meet the features it is contracted with."""
    flags = an.uniform.get(node)
    return flags is not None and all(flags) and node not in an.tainted


@rule(aten.baddbmm)
def baddbmm(an: Analysis, node: torch.fx.Node) -> object:
    out = activation_matmul(an, node, node.args[1], node.args[2])
    base = node.args[0]
    if isinstance(out, Feat) and isinstance(base, torch.fx.Node) and not isinstance(an.val(base), Feat):
        shape = (1,) * (an.ndim(node) - an.ndim(base)) + an.shape(base)
        operand = an.val(base) if isinstance(an.val(base), ParamRef) else base
        an.aligned.append(Aligned(node, operand, out.atoms, shape, base in an.tainted))
    return out


def _gqa_expand(an: Analysis, atoms: np.ndarray, heads: int) -> np.ndarray:
    """Expand ``[.., kv_heads, ..]`` atoms to ``heads`` with one replica per query head."""
    kv = atoms.shape[1]
    if kv == heads or kv == 1:
        return atoms
    rep = heads // kv
    copies = np.stack(an.replicate(atoms, rep), axis=2)
    return copies.reshape((atoms.shape[0], heads) + atoms.shape[2:])


@rule(aten.scaled_dot_product_attention, aten._scaled_dot_product_flash_attention_for_cpu,
      aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention)
def sdpa(an: Analysis, node: torch.fx.Node) -> object:
    """Attention per head: ``softmax(q kᵀ) v`` ties each query head to its key/value head."""
    q, k, v = node.args[:3]
    vals = [an.val(t) for t in (q, k, v)]
    if any(isinstance(t, Partial) for t in vals):
        an.reduce_partials(node)
        return None
    if not any(isinstance(t, Feat) for t in vals):
        return None
    heads = an.shape(q)[1]
    full = []
    for _t, tv in zip((q, k, v), vals, strict=False):
        if not isinstance(tv, Feat):
            full.append(None)
            continue
        a = an.aligned_to(tv.atoms, 4)
        full.append(_gqa_expand(an, a, heads) if a.shape[1] > 1 else a)
    qa, ka, va = full
    if qa is None or ka is None:
        an.poison_node(node, "attention with replicated queries or keys but sharded values", *vals)
        return None
    q_head = an.union_along(an.union_along(qa, [3]), [2])
    k_head = an.union_along(an.union_along(ka, [3]), [2])
    an.union(q_head, k_head)
    out = None
    if va is not None:
        an.union(q_head, va)
        out = an.union_along(va, [2])
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    if isinstance(mask, torch.fx.Node) and an.ndim(mask) == 4 and an.shape(mask)[1] > 1:
        mv = an.val(mask)
        if isinstance(mv, Feat):  # a per-head bias computed from sharded features (T5, ALiBi)
            m_head = an.union_along(an.union_along(an.aligned_to(mv.atoms, 4), [3]), [2])
            an.union(m_head, q_head)
        elif isinstance(mv, Partial):
            an.reduce_partials(node)
        else:
            operand = mv if isinstance(mv, ParamRef) else mask
            an.aligned.append(Aligned(node, operand, q_head, an.shape(mask), mask in an.tainted))
    if out is None:
        an.poison_node(node, "attention with sharded queries but replicated values", *vals)
        return None
    result = an.feat(out)
    if node.target is aten.scaled_dot_product_attention.default:
        return result
    return [result] + [None] * 8


@rule(aten.embedding)
def embedding(an: Analysis, node: torch.fx.Node) -> object:
    """A lookup is ``one_hot(ids) · W``, a contraction over W's rows: either the rows are
    split (vocab-parallel, a masked lookup and an all-reduce) or, like a column-parallel
    linear, W's columns are (T5's relative-position bias table has one column per head).
    Token ids from the caller take the vocabulary path; for ids computed in the graph
    (positions, relative-position buckets) columns are tried first, and a hidden-size
    table fuses into one unit at the first norm and falls back to rows on the next pass."""
    w, ids = node.args[:2]
    wv = an.val(w)
    if not isinstance(wv, ParamRef) or isinstance(an.val(ids), Feat | Partial):
        return None
    rows, cols = wv.dims[0], wv.dims[1] if len(wv.dims) > 1 else None
    forced = an.forced_replicated
    if rows is None or wv.fqn in forced:
        return None
    module = innermost_module(node)
    computed_ids = isinstance(ids, torch.fx.Node) and ids.op != "placeholder"
    if computed_ids and cols is not None and (wv.fqn, cols) not in forced:
        atoms = an.atoms.param_atoms(wv.fqn, cols, an.shape(w)[1])
        an.columns.append(ColumnUse(node, wv.fqn, cols, rows, None, module, atoms))
        return Feat(atoms.reshape((1,) * (an.ndim(node) - 1) + (-1,)))
    if (wv.fqn, rows) in forced:
        return None
    atoms = an.atoms.param_atoms(wv.fqn, rows, an.shape(w)[0])
    an.embeddings.append(EmbeddingUse(node, wv.fqn, module, atoms))
    return None


@rule(aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution, aten._convolution)
def conv(an: Analysis, node: torch.fx.Node) -> object:
    """Convolutions over channels (dim 1), the weight ``[C_out, C_in / groups, *kernel]``.

    ``groups == 1`` contracts every input channel: output channels split like a column
    linear (replicated input), or input channels like a row linear (partial sums).  A
    depthwise conv (``groups == C_in == C_out``, a state-space mixer's) is channel-wise:
    each output channel follows its input channel, and so do the weight's and bias's
    rows; ``groups`` becomes rank-local (a fix-up).  ``aten.convolution`` with
    ``transposed=True`` is :func:`conv_transpose`'s.
    """
    packet = getattr(node.target, "overloadpacket", node.target)
    generic = packet in (aten.convolution, aten._convolution)
    groups = node.args[8] if generic else (node.args[6] if len(node.args) > 6 else 1)
    return _convolution(an, node, groups, transposed=generic and bool(node.args[6]))


@rule(aten.conv_transpose1d, aten.conv_transpose2d, aten.conv_transpose3d)
def conv_transpose(an: Analysis, node: torch.fx.Node) -> object:
    """Transposed convolutions (an upsampling decoder's, a vocoder's): the weight is
    ``[C_in, C_out / groups, *kernel]``, so with ``groups == 1`` dim 0 is contracted and
    dim 1 gives the output channels, the other way round from :func:`conv`; grouped
    ones on split channels are refused."""
    return _convolution(an, node, node.args[6] if len(node.args) > 6 else node.kwargs.get("groups", 1),
                        transposed=True)


def _convolution(an: Analysis, node: torch.fx.Node, groups: int, *, transposed: bool) -> object:
    x, w = node.args[:2]
    bias = node.args[2] if len(node.args) > 2 else None
    kind = "transposed convolution" if transposed else "convolution"
    xv, wv = an.val(x), an.val(w)
    if isinstance(xv, Partial):
        an.reduce_partials(node)
        xv = None
    if not isinstance(wv, ParamRef):
        if isinstance(xv, Feat) or isinstance(wv, Feat):
            an.poison_node(node, f"{kind} with a computed kernel", xv, wv)
        return None
    nd = an.ndim(node)
    c_out, c_in = an.shape(w)[0], an.shape(x)[1]
    if groups == 1:
        if xv is not None and not _channels_only(an, x, xv):
            an.poison_node(node, f"{kind} over features that vary along other dims", xv)
            return None
        # linear_like reads the weight as [in, out]: a transposed one already is
        weight = wv if transposed else ParamRef(wv.fqn, (wv.dims[1], wv.dims[0]))
        return linear_like(an, node, x, weight, 0, 1, bias, feature_dim=1)
    if not isinstance(xv, Feat):
        return None
    if transposed or not (groups == c_in == c_out) or not _channels_only(an, x, xv):
        an.poison_node(node, f"grouped {kind} (groups={groups}) on sharded channels", xv)
        return None
    atoms = an.aligned_to(xv.atoms, nd)
    an.aligned.append(Aligned(node, ParamRef(wv.fqn, (None, wv.dims[0]) + (None,) * (nd - 2)), atoms,
                              (1, c_out) + (1,) * (nd - 2), True))
    bv = an.val(bias) if isinstance(bias, torch.fx.Node) else None
    if isinstance(bv, ParamRef):
        an.aligned.append(Aligned(node, ParamRef(bv.fqn, (None, bv.dims[0]) + (None,) * (nd - 2)), atoms,
                                  (1, c_out) + (1,) * (nd - 2), True))
    return an.feat(atoms)  # channel c of the output is channel c of the input


def _channels_only(an: Analysis, x: torch.fx.Node, v: Feat) -> bool:
    a = an.aligned_to(v.atoms, an.ndim(x))
    return a.shape[1] > 1 and all(s == 1 for i, s in enumerate(a.shape) if i != 1)


@rule(aten.index)
def index(an: Analysis, node: torch.fx.Node) -> object:
    """Advanced indexing on dims that carry no features (MoE token routing)."""
    src, indices = node.args[:2]
    v = an.val(src)
    if isinstance(v, Partial):
        return v
    used = [i for i, t in enumerate(indices) if t is not None]
    if isinstance(v, ParamRef) and used == list(range(len(used))):
        # rows of a parameter picked per token (GPT-OSS's expert biases by routed expert):
        # the remaining dims are still the parameter's, and may be sliced like it
        lead = an.ndim(node) - (len(v.dims) - len(used))
        return ParamRef(v.fqn, (None,) * lead + v.dims[len(used):], v.is_buffer)
    if not isinstance(v, Feat):
        return None
    a = an.aligned_to(v.atoms, an.ndim(src))
    # a boolean mask selects over as many dims as it has (VITS' ``x[mask]`` over batch and
    # time), an integer index over one
    spans = [an.ndim(indices[i]) if _is_mask(an, indices[i]) else 1 for i in used]
    covered = sum(spans)
    if used != list(range(len(used))) or any(a.shape[d] > 1 for d in range(covered)):
        an.poison_node(node, "indexing across sharded features", v)
        return None
    rest = a[(0,) * covered] if used else a
    return an.feat(an.aligned_to(np.asarray(rest), an.ndim(node)))


def _is_mask(an: Analysis, index: torch.fx.Node) -> bool:
    meta = an.meta(index)
    return isinstance(meta, torch.Tensor) and meta.dtype == torch.bool


@rule(aten.gather)
def gather(an: Analysis, node: torch.fx.Node) -> object:
    """``src.gather(dim, index)``: each output element reads the element of ``src`` along
    ``dim`` that ``index`` names (a router's scores at its top-k experts).  Which one the
    data chooses, so ``src``'s features along ``dim`` are tied; along the other dims they
    stay where ``index`` spans the whole dim; ``index``'s own features meet the output's."""
    src, dim, index = node.args[:3]
    v = an.val(src)
    if isinstance(v, Partial):
        an.reduce_partials(node)
        return None
    nd = an.ndim(node)
    d = dim % nd
    parts = []
    if isinstance(v, Feat):
        atoms = an.union_along(an.aligned_to(v.atoms, an.ndim(src)), [d])
        whole = [k for k in range(nd) if k != d and atoms.shape[k] > 1 and an.shape(index)[k] != an.shape(src)[k]]
        if whole:
            an.poison_node(node, "gather over part of a dim with sharded features", v)
            return None
        parts.append(atoms)
    iv = an.val(index)
    if isinstance(iv, Feat):
        parts.append(an.aligned_to(iv.atoms, an.ndim(index)))
    return an.feat(an.tie(parts)) if parts else None


def _without_ellipsis(equation: str, ndims: list[int]) -> str | None:
    """``equation`` with each ``...`` spelled out in fresh labels, right-aligned across
    the operands as einsum broadcasts them (LongT5's ``"...hqk,...khd->...qhd"``);
    ``None`` where it has none or cannot be spelled out (no output given, too few
    letters left)."""
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    ins = lhs.split(",")
    if "..." not in eq or not arrow or len(ins) != len(ndims):
        return None
    fresh = [c for c in string.ascii_letters if c not in eq]
    counts = [n - len(s.replace("...", "")) if "..." in s else 0 for s, n in zip(ins, ndims, strict=True)]
    width = max(counts)
    if width > len(fresh) or min(counts) < 0:
        return None
    ell = "".join(fresh[:width])
    ins = [s.replace("...", ell[width - c:]) for s, c in zip(ins, counts, strict=True)]
    return ",".join(ins) + "->" + rhs.replace("...", ell)


@rule(aten.einsum)
def einsum(an: Analysis, node: torch.fx.Node) -> object:
    """An einsum of activations read from its equation, with matmul's algebra: operands'
    features meet where they share a label (tied, as elementwise math ties them), and a
    contracted label ties every feature along it into one unit, so each sum runs on one
    rank (as ``q·kᵀ`` ties a head's ``head_dim``). Mamba-2's SSD ``"bclhn,bcshn->bclsh"``
    keeps its heads ``h`` split. A parameter operand (a weight written as an einsum) is
    not read yet and refuses the region."""
    equation, operands = node.args[0], list(node.args[1])
    vals = [an.val(o) for o in operands]
    if any(isinstance(v, Partial) for v in vals):
        an.reduce_partials(node)
        return None
    if not any(isinstance(v, Feat) for v in vals):
        return None
    equation = _without_ellipsis(equation, [an.ndim(o) for o in operands]) or equation
    lhs, arrow, out_labels = equation.replace(" ", "").partition("->")
    ins = lhs.split(",")
    if (not arrow or "." in equation or len(ins) != len(operands)
            or any(len(set(s)) != len(s) for s in ins) or any(isinstance(v, ParamRef) for v in vals)):
        an.poison_node(node, f"einsum {equation!r}: only explicit activation equations are read", *vals)
        return None
    contracted = [lab for lab in dict.fromkeys("".join(ins)) if lab not in out_labels]
    order = [*out_labels, *contracted]  # every label once: output first, then the summed ones
    parts = []
    for labels, v in zip(ins, vals, strict=True):
        if not isinstance(v, Feat):
            continue
        atoms = an.aligned_to(v.atoms, len(labels))
        atoms = np.transpose(atoms, [labels.index(lab) for lab in order if lab in labels])
        parts.append(atoms.reshape([atoms.shape[[x for x in order if x in labels].index(lab)]
                                    if lab in labels else 1 for lab in order]))
    full = an.tie(parts)  # features meeting at one position are tied
    for labels, v in zip(ins, vals, strict=True):
        summed = [order.index(lab) for lab in labels if lab in contracted]
        # a replicated operand summed against features that vary along the summed label
        if not isinstance(v, Feat) and any(full.shape[d] > 1 for d in summed):
            an.poison_node(node, "sharded features contracted with a replicated activation", *vals)
            return None
    out = an.union_along(full, [order.index(lab) for lab in contracted])
    out = out.reshape(out.shape[: len(out_labels)])
    for o, v in zip(operands, vals, strict=True):
        if not isinstance(v, Feat):
            an.shares(node, o, an.aligned_to(out, len(out_labels)))
    return an.feat(out)


CONTRACT_RULES = [linear, addmm, matmul, grouped_mm, baddbmm, einsum, sdpa, embedding, conv, conv_transpose, index,
                  gather]
