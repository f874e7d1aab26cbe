"""Dropout masks over split features drawn as one process draws them.

A module with mask sites (:class:`~tpcompile.plan.modules.WholeMasks`, found by
:mod:`tpcompile.analysis.masks`) runs its training forward under :class:`WholeMaskMode`.
The mode sees each random mask being drawn below autograd: ``bernoulli_`` on a CPU
dropout's noise tensor (``F.dropout``, ``nn.Dropout`` and SDPA's math path all draw
there), ``native_dropout`` where a device fuses it.  A draw whose shape is a site's local
shape is made at the site's whole shape instead, from the same generator and with the
same strides, and narrowed to this rank's rows along the split dim.  The mask is then
the rows of the one a single process draws, and the generator advances as it would there,
so every later draw (a replicated residual dropout) matches too: a TP model trained
with dropout computes what the plain model computes under the same seed.  Each rank
draws ``size / local`` times the numbers it keeps, about as much as the dropout's own
elementwise work, and no collective.

Fused attention kernels that draw inside the kernel (CUDA's flash and memory-efficient
SDPA with ``dropout_p > 0``) expose no mask to narrow; there each rank's heads draw their
own, as without this mode.

Example:
    >>> import torch
    >>> from tpcompile.plan.modules import WholeMasks
    >>> op = WholeMasks(sites=((2, 1, 4, ((0, 1), (2, 3)), ()),))
    >>> _ = torch.manual_seed(0)
    >>> whole = torch.nn.functional.dropout(torch.ones(3, 4), 0.5)
    >>> _ = torch.manual_seed(0)
    >>> with WholeMaskMode(op, rank=1):
    ...     local = torch.nn.functional.dropout(torch.ones(3, 2), 0.5)
    >>> bool((local == whole[:, 2:]).all())
    True
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from ..plan.modules import WholeMasks
from .random_state import has_dropout, is_dropout_field

__all__ = ["WholeMaskMode", "may_drop"]

aten = torch.ops.aten


class WholeMaskMode(TorchDispatchMode):
    """Draws the masks of ``op``'s sites whole and keeps ``rank``'s rows."""

    def __init__(self, op: WholeMasks, rank: int) -> None:
        super().__init__()
        # per site: (ndim, dim, size, this rank's rows, local rows, {dim: local size})
        self.sites = [(nd, d, size, torch.tensor(index[rank]), len(index[rank]), dict(fixed))
                      for nd, d, size, index, fixed in op.sites]

    def _site(self, t: torch.Tensor) -> tuple | None:
        for site in self.sites:
            nd, d, _, _, local, fixed = site
            if t.dim() == nd and t.shape[d] == local and all(t.shape[k] == n for k, n in fixed.items()):
                return site
        return None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is aten.bernoulli_.float and isinstance(args[0], torch.Tensor):
            site = self._site(args[0])
            if site is not None:
                t = args[0]
                p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
                with _disable_current_modes():  # an outer mode (another module's) must not narrow it again
                    whole = _whole_like(t, site).bernoulli_(p, generator=kwargs.get("generator"))
                    return t.copy_(_narrow(whole, site))
        if func is aten.native_dropout.default and len(args) > 2 and args[2]:
            x, p = args[0], args[1]
            site = self._site(x)
            if site is not None and 0 < p < 1:
                with _disable_current_modes():
                    _, whole_mask = torch.native_dropout(_whole_like(x, site).fill_(1), p, True)
                    mask = _narrow(whole_mask, site)
                    return x * mask * (1.0 / (1.0 - p)), mask
        return func(*args, **kwargs)


def may_drop(module: torch.nn.Module) -> bool:
    """Could ``module``'s forward draw a mask: a dropout module under it, or a probability
    its code reads (``self.attention_dropout``, T5's ``self.dropout``, a config's
    ``attention_dropout``), above zero.  Asked at each training call, so the mode (a
    Python dispatch per op) stays off where every dropout is zero, as in most decoders."""
    return has_dropout(module) or any(is_dropout_field(k, v) for k, v in vars(module).items())


def _whole_like(t: torch.Tensor, site: tuple) -> torch.Tensor:
    """An empty tensor of ``t``'s dtype and device at the site's whole shape, its dims laid
    out in ``t``'s order: ``empty_like`` of the whole input (what one process fills) keeps
    the input's strides, and a generator fills memory in order."""
    _, d, size, *_ = site
    shape = list(t.shape)
    shape[d] = size
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))  # outermost first
    flat = torch.empty([shape[i] for i in order], dtype=t.dtype, device=t.device)
    return flat.permute([order.index(i) for i in range(t.dim())])


def _narrow(whole: torch.Tensor, site: tuple) -> torch.Tensor:
    _, d, _, rows, *_ = site
    return whole.index_select(d, rows.to(whole.device))
