"""``torch.sagemaker.distributed.checkpoint.state_dict_utils``.

``sm_state_dict_type(model, type)`` chooses what ``model.state_dict()`` returns inside the
block:

* ``SMStateDictType.SM_LOCAL_STATE_DICT`` — this rank's own storage, no collectives: each
  FSDP1 unit's local flat-parameter shard (``<unit>.flat_param``) plus persistent buffers;
  for a model without FSDP1 (plain or FSDP2) every parameter's local tensor. The tensors
  are the live storage, so ``state_dict_loader.load`` writes straight into the model. It
  reloads only at the layout that wrote it (checked, both layouts named).
* ``StateDictType.SHARDED_STATE_DICT`` / ``LOCAL_STATE_DICT`` — FSDP1's own, per TP rank
  (as under SMP, FSDP1 sees one ordinary model per TP rank); sharded ones reload at
  another data-parallel degree.
* ``StateDictType.FULL_STATE_DICT`` with ``FullStateDictConfig(translate_on_save=True)``
  (the default config) — the Hugging Face state dict of the whole model on rank 0 (TP
  shards joined through tpcompile's translation table); ``translate_on_save=False`` gives
  FSDP1's full state dict of this TP rank's shard.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullStateDictConfig as _TorchFullStateDictConfig
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import StateDictType

from ....errors import TPError

__all__ = ["FullStateDictConfig", "LocalStateDict", "SMStateDictType", "init_optim_state", "sm_state_dict_type"]


class SMStateDictType(enum.Enum):
    SM_LOCAL_STATE_DICT = "sm_local_state_dict"


@dataclass
class FullStateDictConfig(_TorchFullStateDictConfig):
    """torch's ``FullStateDictConfig`` plus SMP's ``translate_on_save`` (default ``True``:
    the full state dict is the Hugging Face one)."""

    translate_on_save: bool = True


class LocalStateDict(dict):
    """``model.state_dict()`` under ``SM_LOCAL_STATE_DICT``; ``layout`` is checked on load."""

    layout: dict[str, Any]


def _clean(name: str) -> str:
    return name.replace("_fsdp_wrapped_module.", "").replace("_checkpoint_wrapped_module.", "")


def _layout(model: nn.Module) -> dict[str, Any]:
    from ...core import state

    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = state.mesh
    shape = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True)) if mesh is not None else {}
    return {"world": world, "mesh": shape}


def local_state_dict(model: nn.Module) -> LocalStateDict:
    """This rank's tensors of ``model`` (aliases of the live storage), no collectives."""
    from ....runtime.shards import storage

    out = LocalStateDict()
    units = [m for m in FSDP.fsdp_modules(model) if m._handle is not None]
    if units:
        names = {id(m): _clean(n) for n, m in model.named_modules()}
        for unit in units:
            flat = unit._handle.flat_param
            if flat.data.numel() != flat._sharded_size.numel():
                raise TPError("SM_LOCAL_STATE_DICT is taken outside forward/backward (FSDP holds "
                              "gathered parameters right now)")
            prefix = names[id(unit)]
            out[f"{prefix}.flat_param" if prefix else "flat_param"] = flat.data
    else:
        for name, p in model.named_parameters():
            out[_clean(name)] = storage(p).detach()
    for mname, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                key = _clean(f"{mname}.{bname}" if mname else bname)
                out[key] = storage(b)
    out.layout = {**_layout(model), "tensors": {k: list(v.shape) for k, v in out.items()}}
    return out


def _hf_state_dict(model: nn.Module, config: FullStateDictConfig) -> dict[str, torch.Tensor]:
    from ....checkpoint.hf import hf_state_dict

    inner = model.module if isinstance(model, FSDP) else model
    if not hasattr(inner, "tpcompile_table"):
        raise TPError("translate_on_save needs a model transformed by tsm.transform (or tpcompile.transform)")
    if isinstance(model, FSDP):
        with FSDP.summon_full_params(model, writeback=False):
            return hf_state_dict(inner, rank0_only=config.rank0_only, cpu_offload=True)
    return hf_state_dict(inner, rank0_only=config.rank0_only, cpu_offload=True)


@contextlib.contextmanager
def _state_dict_is(model: nn.Module, fn: Any) -> Iterator[None]:
    model.state_dict = fn  # an instance attribute shadows the method for this block only
    try:
        yield
    finally:
        del model.state_dict


@contextlib.contextmanager
def sm_state_dict_type(module: nn.Module, state_dict_type: SMStateDictType | StateDictType,
                       state_dict_config: Any = None, optim_state_dict_config: Any = None) -> Iterator[None]:
    """Choose what ``module.state_dict()`` returns inside the block (see the module doc).

    Example:
        >>> with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):  # doctest: +SKIP
        ...     state_dict = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    """
    if state_dict_type is SMStateDictType.SM_LOCAL_STATE_DICT:
        with _state_dict_is(module, lambda *a, **k: local_state_dict(module)):
            yield
        return
    if not isinstance(state_dict_type, StateDictType):
        raise TPError(f"unknown state dict type {state_dict_type!r}; use SMStateDictType.SM_LOCAL_STATE_DICT "
                      "or torch.distributed.fsdp.StateDictType.{FULL,SHARDED,LOCAL}_STATE_DICT")
    translate = state_dict_type is StateDictType.FULL_STATE_DICT and \
        getattr(state_dict_config, "translate_on_save", True)
    if translate:
        config = state_dict_config if state_dict_config is not None else FullStateDictConfig(rank0_only=True)
        with _state_dict_is(module, lambda *a, **k: _hf_state_dict(module, config)):
            yield
        return
    if not isinstance(module, FSDP):
        raise TPError(f"{state_dict_type.name} is FSDP1's state dict type: wrap the model in "
                      "FullyShardedDataParallel first (or use SM_LOCAL_STATE_DICT / translate_on_save)")
    if isinstance(state_dict_config, FullStateDictConfig):  # torch's FSDP1 knows no translate_on_save
        state_dict_config = _TorchFullStateDictConfig(offload_to_cpu=state_dict_config.offload_to_cpu,
                                                      rank0_only=state_dict_config.rank0_only)
    with FSDP.state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config):
        yield


def init_optim_state(optimizer: torch.optim.Optimizer, skip_empty_param: bool = False) -> None:
    """Create the optimizer's per-parameter state (to load a checkpoint into it) without
    changing any parameter: one step at learning rate 0 on zero gradients.

    Example:
        >>> init_optim_state(optimizer, skip_empty_param=True)        # doctest: +SKIP
        >>> state_dict["optimizer"] = optimizer.state_dict()
    """
    made: list[torch.Tensor] = []
    lrs = []
    for group in optimizer.param_groups:
        lrs.append(group["lr"])
        group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
        for p in group["params"]:
            if p in optimizer.state and optimizer.state[p]:
                continue
            if skip_empty_param and p.numel() == 0:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
                made.append(p)
    try:
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        for p in made:
            p.grad = None
