"""Random masks over split features: the dropouts a region draws, found in the graph.

A dropout inside a region draws its mask for the rank's local shape (attention
probabilities over this rank's heads, an MLP's share of its features), where one process
draws it for the whole shape from the same generator state.  The masks then differ
(heads at the same local position on two ranks share theirs) and so does every draw after
it: trained with dropout, a TP model was another random function than the model it came
from.  Each such op is a *mask site*: the dims of the mask, its split dim with the global
size and each rank's rows along it, and the local sizes of its other feature dims (token
dims are free).  At run time (:mod:`tpcompile.runtime.masks`) a module's training forward
draws each site's mask at its whole shape from the same generator and keeps this rank's
rows: bit for bit what one process draws, and the generator left where one process
leaves it.

Sites are the captured dropouts (``aten.dropout``: functional or ``nn.Dropout``, captured
with ``p`` 0 in eval mode all the same) and SDPA calls, whose dropout covers
``[..., heads, queries, keys]``.  A site is kept only where no other dropout under the
same module could take its shape (a replicated ``[B, S, hidden]`` dropout where the MLP's
local width equals the hidden size): the mask is matched by shape when it is drawn, and a
replicated mask narrowed to a rank's rows would set the ranks apart.

Example:
    >>> import torch
    >>> from tpcompile.plan.modules import WholeMasks
    >>> op = WholeMasks(sites=((4, 1, 8, ((0, 1, 2, 3), (4, 5, 6, 7)), ()),))
    >>> op.sites[0][2]
    8
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import torch
import torch.fx as fx

from .entries import with_padding
from .fixups import Local
from .gradients import along, rank_of, varies
from .propagate import innermost_module
from .roles import Analyzed
from .state import Feat

__all__ = ["mask_sites"]

aten = torch.ops.aten
_DROPOUTS = (aten.dropout, aten.native_dropout)
_ATTENTION = (aten.scaled_dot_product_attention,)

# (ndim, {dim: local size} of its feature dims): what a mask drawn at run time is matched by
Signature = tuple[int, dict[int, int]]


def _signature(loc: Local, node: fx.Node, ndim: int) -> Signature:
    return ndim, {d: loc.size(node, d) for d in range(ndim) if loc.carries(node, d)}


def _may_match(a: Signature, b: Signature) -> bool:
    """Could one drawn mask fit both signatures (the same ndim, no feature dim apart)?"""
    return a[0] == b[0] and all(b[1].get(d, s) == s for d, s in a[1].items())


def _whole_signature(loc: Local, node: fx.Node, ndim: int) -> Signature:
    """Every dim's size (local where it carries split features): a whole value's dropout
    compared on the dims a site fixes (its token dims vary, the site's do not)."""
    shape = loc.a.an.shape(node)
    return ndim, {d: loc.size(node, d) if loc.carries(node, d) else int(shape[d]) for d in range(ndim)}


def _site(a: Analyzed, loc: Local, node: fx.Node, packet: object) -> tuple[tuple, Signature] | None:
    """``(site, signature)`` of a dropout or SDPA node whose mask is split along one dim."""
    an = a.an
    src = node.args[0]
    if not isinstance(src, fx.Node) or not isinstance(an.value.get(src), Feat):
        return None
    nd = an.ndim(src)
    ranks = rank_of(a.part, an.aligned_to(an.value[src].atoms, nd))
    split = [d for d in range(nd) if varies(ranks, d)]
    if packet in _ATTENTION:  # the scores' mask: [..., heads, queries, keys], split by heads
        if split != [nd - 3]:
            return None
        signature: Signature = (nd, {nd - 3: loc.size(src, nd - 3)})
    else:
        if len(split) != 1:
            return None
        signature = _signature(loc, src, nd)
    d = split[0]
    line = along(ranks, d)
    if (line < 0).any():  # a row no single rank holds (a KV head several ranks hold)
        return None
    index = with_padding(tuple(tuple(int(i) for i in np.nonzero(line == r)[0]) for r in range(a.part.tp)))
    if index is None:
        return None
    fixed = tuple(sorted((k, v) for k, v in signature[1].items() if k != d))
    return (nd, d, int(line.size), index, fixed), signature


def mask_sites(a: Analyzed) -> dict[str, tuple[tuple, ...]]:
    """Per module (representative FQN): the sites ``(ndim, dim, size, index, fixed)`` of
    the masks it draws over split features, where no other dropout under it could be
    taken for one of them."""
    an, loc = a.an, Local(a)
    found: dict[str, list[tuple[tuple, Signature]]] = defaultdict(list)
    others: list[tuple[str, Signature]] = []  # dropouts of whole values, by module
    for node in an.graph.nodes:
        packet = getattr(node.target, "overloadpacket", None)
        if node.op != "call_function" or packet not in (*_DROPOUTS, *_ATTENTION):
            continue
        module = innermost_module(node)
        got = _site(a, loc, node, packet)
        if got is not None:
            found[module].append(got)
        elif packet in _DROPOUTS and isinstance(node.args[0], fx.Node):
            others.append((module, _whole_signature(loc, node.args[0], an.ndim(node.args[0]))))
    out: dict[str, tuple[tuple, ...]] = {}
    for module, sites in found.items():
        under = [sig for m, sig in others if m == module or m.startswith(module + ".") or not module]
        kept = [(site, sig) for site, sig in sites if not any(_may_match(sig, o) for o in under)]
        # two different sites one drawn mask could fit: neither is sure
        sure = {site for site, sig in kept
                if not any(other != site and _may_match(sig, o) for other, o in kept)}
        if sure:
            out[module] = tuple(sorted(sure))
    return out
