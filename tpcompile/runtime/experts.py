"""Expert parallelism: each rank of an EP group holds ``E / ep`` whole experts.

EP ranks are carved from the data-parallel shard ranks that share a tp rank
(``dp_shard = efsdp x ep``, torchtitan's rule), so the 3-D ``parallelize`` mesh
``(dp_replicate, dp_shard, tp)`` unflattens into ``(dp_replicate, efsdp, ep, tp)``.
Attention and dense layers keep their TP / FSDP2 layout; only the experts modules the
plan found (``plan.experts``, from the dataflow) change:

* **Parameters** stay honest DTensors with the Hugging Face shape: ``Shard(0)`` over
  ``ep`` (rank ``r`` holds experts ``[r*E/ep, (r+1)*E/ep)``) and, inside each expert, the
  TP layout over ``tp``.  FSDP2 wraps each experts module on its own (nested, before the
  block) over ``efsdp`` only, so the dp ranks EP uses never shard experts twice.
* **Forward** (the module's own ``forward`` is wrapped, so every family's expert code
  runs unchanged)::

      (token, slot) rows sorted by expert -> owner rank r = expert // (E/ep)
      counts: all_to_all_single;  rows: all_to_all (autograd)
      y = original_forward(rows, top_k_index=local expert id (N, 1), top_k_weights=1)
      y back: all_to_all (autograd);  out[t] = sum over slots of y[t, slot] * w[t, slot]

  The module's expert count attribute (found by the fix-up machinery) reads ``E/ep``
  during the call.  TP's hooks (``copy_to_tp`` in, all-reduce out) stay around the whole
  dispatch: the combine is linear, so the partial sums over ``tp`` combine too.
* **Gradients**: an expert's gradient on its rank already sums the contributions of
  every token of the EP group (the all-to-all's backward brings them back).  Dense
  parameters get FSDP2's mean over all ``dp`` ranks, so the experts' FSDP2 unit sums
  over its replicas (``efsdp x dp_replicate``) and divides by the *total* dp degree
  (``set_gradient_divide_factor``), not by its own group size.
* No capacity limit: every token reaches its experts (no dropping, no padding).

Example:
    >>> model = tpcompile.parallelize(model, tp=2, ep=2)       # doctest: +SKIP (world 4)
    >>> model.tpcompile_plan.experts["model.layers.0.mlp.experts"].num_experts
    8
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import TPError
from ..plan.types import ExpertsPlan

__all__ = ["shard_experts"]

def shard_experts(model: nn.Module, experts: dict[str, ExpertsPlan], mesh4: DeviceMesh) -> list[nn.Module]:
    """Keep this rank's experts of every experts module and wrap its forward with the
    dispatch; returns the modules (each becomes its own FSDP2 unit)."""
    ep_mesh = mesh4["ep", "tp"]
    group, rank, ep = mesh4["ep"].get_group(), mesh4["ep"].get_local_rank(), mesh4["ep"].size()
    modules = []
    for fqn, xp in experts.items():
        module = model.get_submodule(fqn)
        for name in xp.params:
            p = module._parameters[name]
            module._parameters[name] = nn.Parameter(_ep_shard(p, ep_mesh, rank, ep), requires_grad=p.requires_grad)
        module.forward = _Dispatch(module.forward, xp, group, ep)
        modules.append(module)
    return modules


def _ep_shard(p: torch.Tensor, ep_mesh: DeviceMesh, rank: int, ep: int) -> DTensor:
    """``p`` (whole experts, plain or a TP DTensor) as a DTensor over ``(ep, tp)`` holding
    this rank's experts: ``Shard(0)`` over ep, the TP placement inside each expert."""
    if isinstance(p, DTensor):
        local, tp_placement = p.to_local().detach(), p.placements[-1]
    else:
        local, tp_placement = p.detach(), Replicate()
    n = local.shape[0] // ep
    piece = local[rank * n:(rank + 1) * n].clone()  # a copy: the other experts are freed
    return DTensor.from_local(piece, ep_mesh, [Shard(0), tp_placement], run_check=False,
                              shape=p.shape, stride=p.stride())


class _Dispatch:
    """The experts module's ``forward`` under EP: route, run the original, combine."""

    def __init__(self, forward: Callable[..., torch.Tensor], xp: ExpertsPlan, group: Any, ep: int) -> None:
        self.forward, self.xp, self.group, self.ep = forward, xp, group, ep
        self.local = xp.num_experts // ep
        # the first three parameters: hidden states (T, H), top-k ids (T, k), weights (T, k)
        self.names = list(inspect.signature(forward).parameters)[:3]
        self.module = getattr(forward, "__self__", None)

    def _inputs(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        values = dict(zip(self.names, args, strict=False))
        values.update({k: v for k, v in kwargs.items() if k in self.names})
        if len(values) != 3 or len(args) + len(kwargs) != 3:
            raise TPError(f"{self.xp.fqn}: expert parallelism calls experts as (hidden_states, top_k_index, "
                          f"top_k_weights); got {len(args)} positional and {sorted(kwargs)} keyword arguments")
        return values[self.names[0]], values[self.names[1]], values[self.names[2]]

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden, index, weights = self._inputs(args, kwargs)
        shape = hidden.shape
        hidden = hidden.reshape(-1, shape[-1])  # (T, H)
        k = index.shape[-1]
        flat = index.reshape(-1)  # (T*k,) position t*k + slot
        order = torch.argsort(flat, stable=True)  # grouped by expert, hence by owner rank
        expert = flat[order]
        owner = torch.div(expert, self.local, rounding_mode="floor")
        send = torch.bincount(owner, minlength=self.ep)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        send_split, recv_split = send.tolist(), recv.tolist()
        rows = _exchange(hidden[torch.div(order, k, rounding_mode="floor")], recv_split, send_split, self.group)
        ids = flat.new_empty(sum(recv_split))
        dist.all_to_all_single(ids, (expert - owner * self.local).contiguous(), recv_split, send_split,
                               group=self.group)
        ones = weights.new_ones(ids.shape[0], 1)
        y = self._local_forward(rows, ids.unsqueeze(1), ones)  # (N, H)
        back = _exchange(y, send_split, recv_split, self.group)  # (T*k, H), sorted order
        w = weights.reshape(-1)[order].unsqueeze(-1)
        per_slot = torch.zeros(flat.shape[0], y.shape[-1], dtype=y.dtype, device=y.device)
        per_slot = per_slot.index_copy(0, order, (back * w).to(y.dtype))
        # the (token, slot) order of the unsharded model's combine
        return per_slot.view(-1, k, y.shape[-1]).sum(1).to(hidden.dtype).reshape(shape)

    def _local_forward(self, rows: torch.Tensor, ids: torch.Tensor, ones: torch.Tensor) -> torch.Tensor:
        """The original forward over this rank's experts: local parameters, local count."""
        mod = self.module
        saved_params: dict[str, Any] = {}
        saved_attrs = {a: getattr(mod, a) for a in self.xp.size_attrs}
        try:
            for name in self.xp.params:
                p = mod._parameters[name]
                if isinstance(p, DTensor):  # tp > 1: TP's hook has swapped it already
                    saved_params[name] = p
                    mod._parameters[name] = p.to_local()
            for attr, (_, local) in self.xp.size_attrs.items():
                setattr(mod, attr, local)
            return self.forward(rows, ids, ones)
        finally:
            mod._parameters.update(saved_params)
            for attr, value in saved_attrs.items():
                setattr(mod, attr, value)


def _exchange(t: torch.Tensor, out_split: list[int], in_split: list[int], group: Any) -> torch.Tensor:
    """Rows of ``t`` to their ranks (``in_split[r]`` rows go to rank ``r``, ``out_split[r]``
    rows come from it); differentiable: the backward sends the gradients the opposite way."""
    return _AllToAll.apply(t, out_split, in_split, group)


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of rows with uneven splits; backward = the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, out_split: list[int], in_split: list[int], group: Any) -> torch.Tensor:
        ctx.splits, ctx.group = (out_split, in_split), group
        out = t.new_empty(sum(out_split), *t.shape[1:])
        dist.all_to_all_single(out, t.contiguous(), out_split, in_split, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        out_split, in_split = ctx.splits
        back = grad.new_empty(sum(in_split), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), in_split, out_split, group=ctx.group)
        return back, None, None, None
