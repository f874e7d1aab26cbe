"""Where torch's meta kernels refuse what its CPU / CUDA kernels run, for the cost model's
fake-tensor forwards.

``aten._grouped_mm``'s meta kernel (torch 2.13) accepts bfloat16 operands only, while
the CPU kernel multiplies float32 too, so a float32 MoE model that trains here (Mixtral
through transformers' ``grouped_mm`` experts) could not be estimated on fake tensors.
Its output shape does not depend on the dtype: :class:`FakeKernelFixes` computes it on
bfloat16 copies and returns the caller's dtype.  Autograd saves the original operands
above this mode, so the saved bytes counted are the float32 ones.

Example:
    >>> with FakeTensorMode(), FakeKernelFixes():                       # doctest: +SKIP
    ...     out = model(ids)
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["FakeKernelFixes"]

_BF16_ONLY = {torch.ops.aten._grouped_mm.default}


def _to(t: Any, dtype: torch.dtype) -> Any:
    return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t


class FakeKernelFixes(TorchDispatchMode):
    """Runs the ops whose meta kernels are narrower than their real ones (see the module
    docstring); enter it inside a ``FakeTensorMode``."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        dtype = args[0].dtype if args and isinstance(args[0], torch.Tensor) else None
        if func in _BF16_ONLY and dtype != torch.bfloat16:
            out = func(*(_to(a, torch.bfloat16) for a in args),
                       **{k: _to(v, torch.bfloat16) for k, v in kwargs.items()})
            return out.to(dtype)
        return func(*args, **kwargs)
