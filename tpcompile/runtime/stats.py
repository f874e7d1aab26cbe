"""Split statistics at run time: ``sum`` / ``mean`` / ``var`` / ``std`` over split features.

The module's own ``forward`` runs unchanged (OLMo-2's ``Olmo2RMSNorm`` computes
``hidden_states.pow(2).mean(-1, keepdim=True)`` on its local features).  While it runs,
a ``TorchFunctionMode`` (above autograd, so the rewrite is differentiated like any
other code) turns each statistic over the planned dim into its local reduction plus
:func:`~tpcompile.runtime.comm.sum_over_tp`, dividing by the *global* count::

    mean(x_r, -1)  ->  sum_over_tp(sum(x_r, -1)) / size
    var(x_r, -1)   ->  m = mean as above;  sum_over_tp(sum((x_r - m)**2, -1)) / (size - c)

A call over another dim, or over a dim whose size is not this rank's ``local``, runs
as written.  The analysis proved every statistic op of this module's forward is a
split statistic (:mod:`tpcompile.analysis.stats`); to hold the runtime to the plan, each
call checks that it rewrote exactly the plan's ``ops`` — torch code that computes one
without going through these functions (an ``einsum`` reducing a dim) is refused, never
silently reduced over the local features only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup
from torch.overrides import TorchFunctionMode

from ..errors import TPError
from ..plan.modules import SplitStats
from . import comm

__all__ = ["SplitStatMode"]

_FUNCS: dict[Any, str] = {
    torch.sum: "sum", torch.Tensor.sum: "sum", torch.mean: "mean", torch.Tensor.mean: "mean",
    torch.var: "var", torch.Tensor.var: "var", torch.std: "std", torch.Tensor.std: "std",
}


class SplitStatMode(TorchFunctionMode):
    """Rewrites the split statistics of one module call (see module docstring)."""

    def __init__(self, op: SplitStats, group: ProcessGroup | None, fqn: str = "") -> None:
        super().__init__()
        self.op, self.group, self.fqn = op, group, fqn
        self.seen: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _FUNCS.get(func)
        if name is not None:
            out = self._rewrite(name, args, kwargs)
            if out is not None:
                self.seen.append(name)
                return out
        return func(*args, **kwargs)

    def check(self) -> None:
        """The forward computed exactly the statistics the plan split."""
        if tuple(self.seen) != self.op.ops:
            raise TPError(
                f"{self.fqn or 'a module'}: the plan splits the statistics {list(self.op.ops)} over its "
                f"{self.op.local} of {self.op.size} features, but its forward rewrote {self.seen}: the code "
                "no longer matches the captured graph. Keep the module replicated with "
                "overrides={'<param fqn>': 'replicated'}")

    def _rewrite(self, name: str, args: Sequence[Any], kwargs: dict) -> torch.Tensor | None:
        x = args[0] if args else kwargs.get("input")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return None
        dims, keepdim, extra = _reduction_args(name, args[1:], kwargs, x.dim())
        split = x.dim() + self.op.dim
        if dims is None or split < 0 or split not in dims or x.shape[split] != self.op.local:
            return None
        count = math.prod(x.shape[d] for d in dims) // self.op.local * self.op.size  # global
        if name in ("sum", "mean"):
            total = comm.sum_over_tp(torch.sum(x, dims, keepdim=keepdim, dtype=extra), self.group)
            return total if name == "sum" else total / count
        mean = comm.sum_over_tp(torch.sum(x, dims, keepdim=True), self.group) / count
        squares = comm.sum_over_tp(torch.sum((x - mean).square(), dims, keepdim=keepdim), self.group)
        var = squares / max(count - extra, 0)
        return var if name == "var" else var.sqrt()


def _reduction_args(name: str, rest: Sequence[Any], kwargs: dict, ndim: int
                    ) -> tuple[list[int] | None, bool, Any]:
    """``(dims, keepdim, dtype)`` of a ``sum`` / ``mean`` call, ``(dims, keepdim,
    correction)`` of a ``var`` / ``std`` one; ``dims`` is ``None`` for a form this does not
    read (named dims), which then runs as written (and the per-call check refuses it)."""
    rest = list(rest)
    if rest and isinstance(rest[0], torch.dtype):  # sum(input, dtype)
        kwargs = {**kwargs, "dtype": rest.pop(0)}
    stat = name in ("var", "std")
    if stat and rest and isinstance(rest[0], bool):  # var(input, unbiased): every dim
        kwargs = {**kwargs, "unbiased": rest.pop(0), "dim": None}
    dim = kwargs.get("dim", rest.pop(0) if rest else None)
    if stat:
        correction: Any = kwargs.get("correction")
        if rest and isinstance(rest[0], bool) and "unbiased" not in kwargs:
            kwargs = {**kwargs, "unbiased": rest.pop(0)}  # var(input, dim, unbiased, keepdim)
        if correction is None:
            correction = 1 if kwargs.get("unbiased", True) else 0
        extra: Any = correction
    else:
        extra = kwargs.get("dtype")
    keepdim = bool(kwargs.get("keepdim", rest.pop(0) if rest else False))
    if dim is None or (isinstance(dim, Sequence) and not isinstance(dim, str) and len(dim) == 0):
        return list(range(ndim)), keepdim, extra
    if isinstance(dim, int):
        return [dim % ndim], keepdim, extra
    if isinstance(dim, Sequence) and all(isinstance(d, int) for d in dim):
        return sorted({d % ndim for d in dim}), keepdim, extra
    return None, keepdim, extra
