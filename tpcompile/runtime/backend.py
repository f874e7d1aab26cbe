"""The one interface a backend implements to run a plan, and choosing one.

A backend owns the TP group and turns the plan's per-parameter and per-module entries
into tensors and hooks.  :class:`~tpcompile.runtime.torch_backend.TorchBackend` (DTensor
parameters, explicit collectives) runs everywhere; Transformer Engine
(:mod:`~tpcompile.runtime.te_backend`) is imported only when asked for.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import TPError
from ..plan.types import ModulePlan, ParamPlan

__all__ = ["BACKENDS", "Backend", "make_backend"]

BACKENDS = ("auto", "torch", "te")


@runtime_checkable
class Backend(Protocol):
    """What :func:`~tpcompile.runtime.apply.apply_plan` and the later steps call."""

    name: str
    mesh: DeviceMesh  # the 1-D TP mesh
    group: object  # its process group
    rank: int  # this process's rank in it
    tp: int

    def local_shard(self, full: torch.Tensor, plan: ParamPlan, rank: int | None = None) -> torch.Tensor:
        """This rank's shard of a full (HF-layout) tensor, per the plan's index map."""
        ...

    def make_param(self, local: torch.Tensor, plan: ParamPlan, requires_grad: bool) -> nn.Parameter:
        """The parameter the model holds for ``local`` (a DTensor of the global shape)."""
        ...

    def install(self, module: nn.Module, mplan: ModulePlan, swaps: list[str],
                vocab_range: tuple[int, int] | None, replicas: dict[str, ParamPlan] | None = None) -> None:
        """Wrap ``module``'s forward with the collectives ``mplan`` lists."""
        ...

    def reset(self) -> None:
        """Forget per-forward state (called around every top-level forward)."""
        ...


def make_backend(name: str, mesh: DeviceMesh) -> Backend:
    """The backend called ``name`` over the TP ``mesh``."""
    if name not in BACKENDS:
        raise TPError(f"backend must be one of {BACKENDS}, got {name!r}")
    if name == "te":
        from .te_backend import TEBackend

        return TEBackend(mesh)
    from .torch_backend import TorchBackend

    return TorchBackend(mesh)
