"""FSDP2 all-gathers FP8 weights (1 byte per element) scaled by the whole weight's amax.

With ``fp8=True`` under ``parallelize`` the weight of every FP8 projection is held, inside
its DTensor, as a :class:`Float8GatherWeight`: FSDP2 asks it for what to all-gather
(``fsdp_pre_all_gather``) and gets the shard already cast to FP8, then rebuilds torchao's
``Float8TrainingTensor`` from the gathered bytes and the scale (``fsdp_post_all_gather``).
:class:`~tpcompile.runtime.fp8.TPFloat8Linear` finds its weight already in FP8 and
casts nothing.

The cast must equal single-process torchao's, whose scale is that of the whole logical
weight; a rank holds one FSDP2 shard of one TP shard of it.  So before FSDP2's first
all-gather of every forward of the model, one MAX all-reduce over every rank (a vector:
one amax per FP8 weight; replicas hold equal values, so the max over all ranks is the
logical weight's) gives every weight its scale — torchao's
``precompute_float8_dynamic_scale_for_fsdp``, run by a forward pre-hook of the root
instead of a line after ``optimizer.step()``.  The backward's re-gathers reuse it (the
weights do not change between forward and backward).  A weight changed in place after
that (its parameter's version counter moved: a block run alone after an optimizer
step) gets its scale recomputed in its own all-gather, with the same reduction.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["Float8GatherWeight", "install_gather_scales", "wrap_for_fp8_gather"]

_aten = torch.ops.aten
# the ops FSDP2 runs on a parameter's local tensor to shard, pad, copy and view it:
# their results stay gatherable in FP8 (every other op sees the plain tensor)
_KEEP = {_aten.empty_like.default, _aten.new_zeros.default, _aten.slice.Tensor, _aten.copy_.default,
         _aten.view.default, _aten.as_strided.default, _aten._to_copy.default, _aten._pin_memory.default,
         _aten.split.Tensor, _aten.clone.default, _aten.detach.default, _aten.alias.default,
         _aten.narrow.default, _aten.chunk.default}


class Float8GatherWeight(torch.Tensor):
    """A high-precision weight that FSDP2 all-gathers in FP8 (one byte per element).

    Everything but FSDP2's all-gather sees the high-precision tensor it wraps: the
    optimizer, gradient clipping, state dicts and checkpoints.
    """

    _tensor: torch.Tensor

    @staticmethod
    def __new__(cls, tensor: torch.Tensor) -> Float8GatherWeight:
        return torch.Tensor._make_wrapper_subclass(
            cls, tensor.size(), strides=tensor.stride(), storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype, layout=tensor.layout, device=tensor.device, requires_grad=tensor.requires_grad)

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        args, kwargs = pytree.tree_map_only(Float8GatherWeight, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _KEEP:
            return out
        return pytree.tree_map_only(torch.Tensor, Float8GatherWeight, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, ctx: Any, size: Any, stride: Any) -> Float8GatherWeight:
        return Float8GatherWeight(inner["_tensor"])

    def __repr__(self) -> str:
        return f"Float8GatherWeight({self._tensor!r})"

    # ---- FSDP2's all-gather extension ------------------------------------------------
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This shard in FP8 with the whole weight's scale, as bytes (gloo has no FP8)."""
        from torchao.float8.float8_training_tensor import (
            GemmInputRole,
            hp_tensor_and_scale_to_float8,
        )

        scale = _scale_of(module, self)
        fp8 = hp_tensor_and_scale_to_float8(self._tensor, scale, module.config.cast_config_weight.target_dtype,
                                            module.linear_mm_config, GemmInputRole.WEIGHT)
        data = fp8._data.view(torch.uint8)
        rows = -(-outer_size[0] // mesh.size())  # FSDP2 gathers equal, zero-padded dim-0 shards
        if data.size(0) < rows:
            data = torch.cat([data, data.new_zeros(rows - data.size(0), *data.shape[1:])])
        return (data,), (scale, fp8._data.dtype, module.linear_mm_config)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any, param_dtype: torch.dtype,
                             *, out: torch.Tensor | None = None) -> Any:
        """The gathered bytes as torchao's FP8 weight (or a new scale for the one FSDP2 keeps)."""
        from torch.distributed.tensor import DTensor
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        scale, dtype, mm_config = metadata
        if out is not None:  # FSDP2 reuses its unsharded tensor: the bytes are in place already
            (out._local_tensor if isinstance(out, DTensor) else out)._scale = scale
            return None
        data = outputs[0].view(dtype)
        return Float8TrainingTensor(data, scale, param_dtype, mm_config, gemm_input_role=GemmInputRole.WEIGHT), (data,)


def _amax_to_scale(amax: torch.Tensor, module: nn.Module) -> torch.Tensor:
    from torchao.float8.float8_utils import amax_to_scale

    return amax_to_scale(amax, module.config.cast_config_weight.target_dtype,
                         module.config.round_scales_to_power_of_2)


def _version(module: nn.Module, shard: Float8GatherWeight) -> int | None:
    """The version counter of the parameter whose shard is ``shard`` (an optimizer's
    in-place step moves it; the wrapped tensor's own counter does not), if it is found."""
    p = module._parameters.get("weight")
    return p._version if p is not None and getattr(p, "_local_tensor", p) is shard else None


def _scale_of(module: nn.Module, shard: Float8GatherWeight) -> torch.Tensor:
    """The scale computed at this forward's start, or a fresh one if the weight changed
    since (the same MAX reduction over every rank, for this weight alone)."""
    cached = getattr(module, "fp8_gather_scale", None)
    version = _version(module, shard)
    if cached is not None and version is not None and cached[1] == version:
        return cached[0]
    amax = torch._foreach_norm([shard._tensor], ord=math.inf)[0].float()  # max |w|; an empty shard: 0
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=getattr(module, "fp8_gather_group", None))
    scale = _amax_to_scale(amax, module)
    module.fp8_gather_scale = (scale, version)
    return scale


def wrap_for_fp8_gather(mod: nn.Module) -> None:
    """Hold ``mod.weight``'s local tensor as a :class:`Float8GatherWeight` (before FSDP2)."""
    from torch.distributed.tensor import DTensor

    p = mod.weight
    if isinstance(p, DTensor):
        local = Float8GatherWeight(p._local_tensor)
        new = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                 stride=p.stride())
    else:
        new = Float8GatherWeight(p.data)
    mod._parameters["weight"] = nn.Parameter(new, requires_grad=p.requires_grad)


def _gathered(model: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """Every FP8-gathered weight's module and its sharded parameter, in module order."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        for fp in group.fsdp_params if group is not None else ():
            if isinstance(fp._sharded_local_tensor, Float8GatherWeight):
                out.append((fp._module_info.module, fp.sharded_param))
    return out


def install_gather_scales(model: nn.Module, group: Any = None) -> None:
    """Before FSDP2's first all-gather of each forward of ``model`` (the root): every
    FP8-gathered weight's scale from one MAX all-reduce of their amaxes over ``group``,
    the ranks holding parts of this model's weights (``None``: every rank; a pipeline
    stage's ranks under pp, whose other stages hold other weights)."""

    @torch.no_grad()
    def precompute(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        pairs = _gathered(mod)
        if not pairs:
            return
        norms = torch._foreach_norm([p._local_tensor._tensor for _, p in pairs], ord=math.inf)
        amax = torch.stack([n.float() for n in norms])  # exact: a max of bf16 values is one
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        for i, (m, p) in enumerate(pairs):
            m.fp8_gather_scale = (_amax_to_scale(amax[i], m), p._version)

    for m, _ in _gathered(model):  # a block's own fresh scale (_scale_of) reduces over the same ranks
        m.fp8_gather_group = group

    # prepended after fully_shard: runs before FSDP2's own pre-forward (its all-gathers)
    model.register_forward_pre_hook(precompute, prepend=True, with_kwargs=True)
