"""Sizes read off a tensor at run time: reshapes the rewrite makes rank-local by their line.

Older attention code reads its width off its input and reshapes with it::

    bsz, tgt_len, embed_dim = hidden_states.size()      # the whole width: the input is replicated
    ...
    attn_output = attn_output.reshape(bsz, tgt_len, embed_dim)   # but attn_output holds this rank's heads

No attribute holds ``embed_dim`` (TrOCR, GroupViT, PVT-v2, Pegasus-X; BLIP and MGP-STR
divide it by their head count), so :mod:`.fixups` has nothing to set.  What is known is
the reshape itself: the capture records the source line of every ``view`` / ``reshape``
and the analysis the local size of each of its output dims.  A *shape site* is such a
line in one module, with the local size of every output dim that carries features (a
head count, a head dim, a width): while that module runs, a torch function mode rewrites
those entries of the shape a ``view`` / ``reshape`` called from that line asks for (a
``-1`` stays; a rewritten shape that cannot hold the tensor is left as written, so torch
raises its own error).

Sites are made only where the self-check's trace of the localized model fails (or a
shape disagrees with the plan), one line at a time, and kept only if the trace then gets
past it; every site is proven by the same trace as the attribute fix-ups.  They travel in
the module's fix-ups as ``"@file.py:line" -> [ndim, [[dim, local size], ...]]``.

Example:
    >>> import torch
    >>> from torch import nn
    >>> class Attn(nn.Module):
    ...     def forward(self, x):
    ...         b, t, e = x.size()
    ...         return x[..., : e // 2].reshape(b, t, e)
    >>> m = Attn()
    >>> line = f"{Attn.forward.__code__.co_filename.rsplit('/', 1)[-1]}:{Attn.forward.__code__.co_firstlineno + 2}"
    >>> install_sites(m, {line: [3, [[2, 2]]]})
    >>> m(torch.ones(1, 3, 4)).shape
    torch.Size([1, 3, 2])
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch import nn
from torch.overrides import TorchFunctionMode

from ..capture.branches import model_code

__all__ = ["SITE_PREFIX", "install_sites", "is_site", "model_code", "node_line", "sites_for", "strip_sites"]

aten = torch.ops.aten
SITE_PREFIX = "@"
_ATTR = "_tpcompile_shape_sites"  # on the module: {"file:line": {ndim: {dim: local}}}
_INNER = "_tpcompile_sites_inner_forward"
_RESHAPES = (aten.view, aten.reshape, aten._unsafe_view)


def is_site(key: str) -> bool:
    """Is this fix-up key a shape site (not an attribute)?"""
    return key.startswith(SITE_PREFIX)


def node_line(node: fx.Node) -> str | None:
    """``"file.py:line"`` of the model code that made ``node`` (its stack's last frame)."""
    trace = node.meta.get("stack_trace") or ""
    for text in reversed(trace.strip().splitlines()):
        text = text.strip()
        if text.startswith('File "'):
            path, _, rest = text[len('File "'):].partition('", line ')
            return f"{os.path.basename(path)}:{rest.split(',')[0]}"
    return None


def sites_for(a: Any, lines: tuple[str, ...]) -> dict[str, dict[str, list[Any]]]:
    """The shape sites of the first of ``lines`` (innermost first) that has reshapes of
    split features in the analysed graph, in every module (representative FQN) that runs
    it: ``{module: {"@line": [ndim, [[dim, local], ...]]}}``.  A module where two reshapes
    of that line would need different sizes gets none."""
    from .fixups import Local
    from .propagate import innermost_module
    from .state import Feat, ParamRef

    loc = Local(a)
    by_line: dict[str, dict[str, dict[int, dict[int, int] | None]]] = {}
    for node in a.an.graph.nodes:
        line = node_line(node)
        v = a.an.value.get(node)
        if (line not in lines or node.op != "call_function"
                or getattr(node.target, "overloadpacket", None) not in _RESHAPES
                or not isinstance(v, Feat | ParamRef)):
            continue
        ndim = a.an.ndim(node)
        if isinstance(v, ParamRef):
            # a split parameter viewed by a global count (Parakeet's per-head position
            # biases, ``bias_u.view(1, config.num_attention_heads, 1, head_dim)``)
            lay = a.layouts.get(v.fqn)
            split = [d for d, pd in enumerate(v.dims) if lay is not None and pd == lay.dim]
            local = {d: loc.size(node, d) for d in split} if len(v.dims) == ndim else {}
        else:
            local = {d: loc.size(node, d) for d in range(ndim) if loc.carries(node, d)}
        if not local:
            continue
        found = by_line.setdefault(line, {}).setdefault(innermost_module(node), {})
        found[ndim] = local if found.get(ndim, local) == local else None
    for line in lines:
        if line in by_line:
            return {mod: {SITE_PREFIX + line: [ndim, [[d, s] for d, s in sorted(local.items())]]}
                    for mod, found in by_line[line].items() if len(found) == 1
                    for ndim, local in found.items() if local is not None}
    return {}


def strip_sites(fixups: dict[str, Any]) -> dict[str, Any]:
    """``fixups`` without its shape sites (the attributes alone)."""
    return {k: v for k, v in fixups.items() if not is_site(k)}


def install_sites(module: nn.Module, sites: dict[str, list[Any]]) -> None:
    """Rewrite the reshapes of ``sites`` (``"@file:line" or "file:line" -> [ndim, [[dim,
    local], ...]]``) whenever ``module`` runs; a second call adds to the first.

    The mode is entered by ``module``'s forward itself (an instance ``forward`` wrapping
    the one it had), in a ``with`` block: hooks would leave it on torch's mode stack when
    the forward raises inside ``torch.export``, whose tracer does not call a forward
    hook's ``always_call``."""
    table = module.__dict__.get(_ATTR)
    if table is None:
        table = {}
        module.__dict__[_ATTR] = table
        if "forward" in module.__dict__:  # an instance forward already (another wrapper's)
            module.__dict__[_INNER] = module.__dict__["forward"]
        module.forward = types.MethodType(_forward_with_sites, module)
    for key, (ndim, dims) in sites.items():
        table.setdefault(key.removeprefix(SITE_PREFIX), {})[int(ndim)] = {int(d): int(s) for d, s in dims}


def _forward_with_sites(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    inner = self.__dict__.get(_INNER)
    with _LocalShapes(self.__dict__[_ATTR]):
        if inner is not None:
            return inner(*args, **kwargs)
        return type(self).forward(self, *args, **kwargs)


_DEPTH = 3  # model frames looked at: a reshape in a helper of a helper of ``forward``


def _site(table: dict[str, dict[int, dict[int, int]]]) -> dict[int, dict[int, int]] | None:
    """The site of the model code calling a reshape: its nearest frames outside torch and
    tpcompile, innermost first (the capture records a helper's call from ``forward``,
    ``self._shape(...)``, by the line in ``forward``)."""
    f = sys._getframe(2)
    for _ in range(_DEPTH):
        while f is not None and not model_code(f.f_code.co_filename):
            f = f.f_back
        if f is None:
            return None
        site = table.get(f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}")
        if site is not None:
            return site
        f = f.f_back
    return None


class _LocalShapes(TorchFunctionMode):
    """The local sizes of a module's shape sites, for the reshapes called from their lines."""

    def __init__(self, table: dict[str, dict[int, dict[int, int]]]) -> None:
        super().__init__()
        self.table = table

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in (torch.Tensor.reshape, torch.Tensor.view, torch.reshape) and len(args) >= 2:
            by_ndim = _site(self.table)
            if by_ndim:
                args = _rewritten(args, by_ndim)
        return func(*args, **kwargs)


def _rewritten(args: tuple, by_ndim: dict[int, dict[int, int]]) -> tuple:
    shape = args[1] if len(args) == 2 and isinstance(args[1], list | tuple | torch.Size) else args[1:]
    if not all(isinstance(s, int) for s in shape):  # view(dtype), or symbolic sizes
        return args
    local = by_ndim.get(len(shape))
    if not local:
        return args
    new = [local.get(d, s) if s != -1 else s for d, s in enumerate(shape)]
    numel, known = args[0].numel(), int(np.prod([s for s in new if s != -1]))
    # a shape that cannot hold the tensor is left as written: torch names it
    if (-1 in new and (known == 0 or numel % known)) or (-1 not in new and known != numel):
        return args
    return (args[0], new)
