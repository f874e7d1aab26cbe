"""Honest state dicts: ``model.state_dict()`` of a transformed model is the HF model's.

A transformed parameter is a ``DTensor`` ``Shard(dim)`` over the TP mesh whose *local*
tensor is this rank's rows of the HF tensor per the plan (``ParamPlan.index()[rank]``).
For a ``contiguous`` layout that is exactly what ``Shard(dim)`` means, so the parameter
is already an honest DTensor.  For the other layouts the global view (the rank-major
concatenation of the locals) is *not* the HF tensor: fused q|k|v / gate|up blocks come
back as ``q0 k0 v0 q1 k1 v1``, replicated KV heads appear several times, a vocabulary
that does not divide carries zero padding rows.  Every DTensor-aware tool (torch DCP,
``get_model_state_dict``, ``full_tensor()``) would read a permuted model.

The parameters keep that layout (the compute hooks run on it); the *state dict* is made
honest by hooks on every module owning such a parameter:

* ``state_dict()`` (a ``register_state_dict_post_hook``) replaces each such entry by a
  ``DTensor`` ``Shard(dim)`` of the HF tensor (even ``torch.chunk`` pieces per TP rank,
  ``Replicate()`` over data-parallel mesh dims), so DCP reshards it like any DTensor.
  A padded vocabulary whose real rows already are ``torch.chunk`` pieces is returned as
  a view (no copy, no collective); every other layout moves rows with one all-gather
  over the TP group per tensor: **all ranks must call** ``state_dict()`` **together**
  (as under DCP).  Contiguous and replicated parameters are returned as they are.
* ``load_state_dict()`` (a ``register_load_state_dict_pre_hook``) accepts, for every
  parameter, a full tensor or a DTensor of any layout and mesh whose full value is the
  HF tensor, and hands the module's own loader a DTensor of the parameter's layout
  holding this rank's rows (under FSDP2: this rank's piece of them).  Collective too.
  Every value is read as honest: ``dict(model.named_parameters())`` (tpcompile's local
  layout) is not a valid state dict; ``model.state_dict()`` is.

Tested (``tests/test_state_dict.py``): full values equal the untransformed model for
every family, plain DCP save/load across tp and dp layouts, and into a plain model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..errors import TPError
from ..plan.table import TensorMap
from ..plan.types import ParamPlan

__all__ = ["chunk_range", "honest_tensor", "install_state_dict_hooks", "to_param_layout"]


def chunk_range(size: int, parts: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of piece ``rank`` when ``size`` rows are cut like
    ``torch.chunk`` (``ceil(size / parts)`` rows each, the last pieces shorter or
    empty): the rows ``Shard(dim)`` gives that mesh coordinate."""
    step = -(-size // parts)
    start = min(rank * step, size)
    return start, min(size, start + step) - start


class _Layout:
    """What the hooks need of one parameter: its HF layout and how to make it honest."""

    def __init__(self, pp: ParamPlan, tp: int) -> None:
        self.map = TensorMap(key=pp.fqn, saved_as=pp.fqn, shape=list(pp.global_shape), dtype="",
                             shard_dim=pp.shard_dim, layout=pp.layout, runs=pp.runs)
        # honest as stored: Shard(dim) of even contiguous blocks, or Replicate()
        self.native = pp.shard_dim is None or pp.layout == "contiguous"
        # a padded vocabulary whose real rows are torch.chunk's pieces: a view suffices
        self.view = pp.layout == "padded" and all(self._is_chunk(r, tp) for r in range(tp))

    def _is_chunk(self, rank: int, tp: int) -> bool:
        start, length = chunk_range(self.map.shape[self.map.shard_dim], tp, rank)
        row = self.map.index[rank]
        return bool((row[:length] == torch.arange(start, start + length).numpy()).all()
                    and (row[length:] < 0).all())


def _tp_dim(t: DTensor) -> int:
    names = t.device_mesh.mesh_dim_names or ()
    if t.device_mesh.ndim == 1:
        return 0
    if "tp" not in names:
        raise TPError(f"a tensor-parallel parameter on mesh dims {names} has no 'tp' dim")
    return names.index("tp")


def _tp_local(t: DTensor) -> torch.Tensor:
    """This rank's TP shard (data-parallel pieces gathered under FSDP2)."""
    from .shards import tp_local

    return tp_local(t)


def honest_tensor(value: torch.Tensor, lay: _Layout, group: Any, tp_rank: int, tp: int) -> torch.Tensor:
    """``value`` (a parameter in tpcompile's layout) as a DTensor whose full value is
    the HF tensor: ``Shard(dim)`` over the TP mesh dim, ``Replicate()`` over the rest.
    Collective over the TP group (and the data-parallel dims under FSDP2) unless the
    layout allows a view."""
    if lay.native or not isinstance(value, DTensor):
        return value
    t = lay.map
    dim = t.shard_dim
    start, length = chunk_range(t.shape[dim], tp, tp_rank)
    local = _tp_local(value)
    if lay.view:
        out = local.narrow(dim, 0, length)
    else:
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=group)
        out = _pick_rows(parts, lay, start, length)
        del parts
    if not out.is_contiguous():
        out = out.contiguous()
    mesh = value.device_mesh
    placements = [Replicate()] * mesh.ndim
    placements[_tp_dim(value)] = Shard(dim)
    stride = torch.empty(t.shape, device="meta").stride()
    return DTensor.from_local(out, mesh, placements, run_check=False, shape=torch.Size(t.shape), stride=stride)


def _pick_rows(parts: list[torch.Tensor], lay: _Layout, start: int, length: int) -> torch.Tensor:
    """HF rows ``[start, start + length)`` from every rank's local tensor, each row taken
    from the first rank holding it, without assembling the full tensor."""
    t = lay.map
    dim = t.shard_dim
    first = torch.as_tensor(t._first_position[start:start + length])  # rank-major positions
    per_rank = parts[0].shape[dim]
    shape = list(parts[0].shape)
    shape[dim] = length
    out = parts[0].new_empty(shape)
    for q, part in enumerate(parts):
        rows = ((first >= q * per_rank) & (first < (q + 1) * per_rank)).nonzero().flatten()
        if rows.numel():
            out.index_copy_(dim, rows, part.index_select(dim, first[rows] - q * per_rank))
    return out


def to_param_layout(value: torch.Tensor, param: torch.Tensor, lay: _Layout, tp_rank: int,
                    key: str) -> torch.Tensor:
    """An incoming state-dict value (full tensor, or DTensor of the HF tensor at any
    layout/mesh) → a tensor of ``param``'s type and placement holding this rank's rows.
    Collective when ``value`` is a DTensor that has to be gathered."""
    from .shards import shard_like

    # every value is read as honest, the parameter object included: torch's
    # set_model_state_dict(broadcast_from_rank0=True) copies torch.chunk pieces of the HF
    # tensor into the parameters' storage and passes the parameters themselves
    if isinstance(value, DTensor):
        if (isinstance(param, DTensor) and lay.native and value.device_mesh == param.device_mesh
                and tuple(value.placements) == tuple(param.placements) and value.shape == param.shape):
            return value  # honest on both sides with one spec: the loader copies locals
        value = value.full_tensor()
    t = lay.map
    if list(value.shape) != t.shape:
        raise TPError(f"load_state_dict: {key} has shape {list(value.shape)}, the model's (HF) shape is "
                      f"{t.shape}; pass the untransformed model's tensor or a DTensor of it")
    local = t.to_local(value, tp_rank) if t.sharded else value
    if not isinstance(param, DTensor):
        return local
    from .shards import storage

    local = local.to(device=storage(param).device)
    return shard_like(param, local.contiguous())


def install_state_dict_hooks(model: nn.Module, params: dict[str, ParamPlan], mesh: Any) -> None:
    """Make ``model.state_dict()`` / ``load_state_dict()`` speak HF tensors.

    ``params``: the plan's parameters (tied aliases included via ``tied_to``); ``mesh``:
    the 1-D TP mesh.  Hooks go on each owning module, so a submodule's ``state_dict()``
    is honest too.  Example (every rank calls; DCP reshards the result)::

        sd = get_model_state_dict(model)          # DTensors of the HF tensors
        dcp.save(sd, checkpoint_id="ckpt")
    """
    tp = mesh.size()
    if tp == 1:
        return
    group, tp_rank = mesh.get_group(), mesh.get_local_rank()
    per_module: dict[str, dict[str, _Layout]] = {}
    for name, pp in params.items():
        lay = _Layout(pp, tp)
        for alias in [name, *pp.tied_to]:
            mname, _, pname = alias.rpartition(".")
            per_module.setdefault(mname, {})[pname] = lay
    for mname, lays in per_module.items():
        module = model.get_submodule(mname) if mname else model
        module.register_state_dict_post_hook(_save_hook(lays, group, tp_rank, tp))
        module.register_load_state_dict_pre_hook(_load_hook(lays, tp_rank))


def _save_hook(lays: dict[str, _Layout], group: Any, tp_rank: int, tp: int) -> Callable[..., None]:
    converted = {n: lay for n, lay in lays.items() if not lay.native}

    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        for name, lay in converted.items():
            key = prefix + name
            if key in state_dict:
                with torch.no_grad():
                    state_dict[key] = honest_tensor(state_dict[key], lay, group, tp_rank, tp)

    return hook


def _load_hook(lays: dict[str, _Layout], tp_rank: int) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any,
             strict: bool, missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        for name, lay in lays.items():
            key = prefix + name
            value = state_dict.get(key)
            param = module._parameters.get(name)
            if not isinstance(value, torch.Tensor) or param is None:
                continue
            with torch.no_grad():
                state_dict[key] = to_param_layout(value, param, lay, tp_rank, key)

    return hook
