"""FP8 matmuls through torchao's float8 training, exact under tensor parallelism.

torchao's ``Float8Linear`` scales each operand of a projection by its amax (tensorwise:
one scale per tensor).  Under tensor parallelism a rank holds a shard, and the amax of
a shard is not the amax of the tensor: the quantised values, and so the model, would
differ from a single-process FP8 run.  Which operand is split is a fact of the plan:

=================  =====================  ==========================  ===================
module             input                  weight                      output gradient
=================  =====================  ==========================  ===================
column-parallel    whole (replicated)     split (output features)     split (features)
row-parallel       split (input features) split (input features)      whole (replicated)
=================  =====================  ==========================  ===================

Every split operand's amax is MAX-all-reduced over the TP group before it is cast, so
every rank quantises its shard with the whole tensor's scale and the FP8 model equals
torchao's single-process one.  The casts are done here (torchao's ``hp_tensor_to_float8_dynamic``
with ``reduce_amax``), in the forward for the input and the weight and in the backward for
the output gradient; torchao's own matmul then finds its operands already in FP8 and
reuses them for both backward matmuls, which is exact for tensorwise scaling (one scale
per tensor serves every axis).  Rowwise scaling needs other casts per backward matmul
and is supported without tensor parallelism only.

A module is converted in place (its class becomes :class:`TPFloat8Linear`, a
``Float8Linear``): tpcompile's hooks, its parameters and its state dict stay as they
are, so every checkpoint path keeps the high-precision HF tensors.  Under FSDP2
(``parallelize``) the weights arrive already in FP8, all-gathered with the whole weight's
scale (:mod:`tpcompile.runtime.fp8_gather`), and are not cast again.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import TPError
from ..plan.types import ParamPlan, Plan, Role
from .rows import shares_rows

__all__ = ["NO_REDUCTION", "Fp8Spec", "TPFloat8Linear", "convert_fp8", "convert_fp8_estimate", "fp8_config",
           "fp8_modules", "gathers_fp8"]

_MULTIPLE = 16  # torch._scaled_mm needs both matmul dims to be multiples of 16


def _torchao() -> Any:
    if importlib.util.find_spec("torchao") is None:
        raise TPError("fp8=... needs torchao's float8 training: pip install -e \".[fp8]\" (or pip install torchao)")
    import torchao.float8 as float8

    return float8


def fp8_config(fp8: Any) -> Any:
    """A ``torchao.float8.Float8LinearConfig`` from ``fp8``: ``True`` / ``"tensorwise"``,
    ``"rowwise"``, or a config."""
    float8 = _torchao()
    if isinstance(fp8, float8.Float8LinearConfig):
        return fp8
    if fp8 is True or fp8 == "tensorwise":
        # under parallelize FSDP2 then gathers these weights in FP8 (runtime/fp8_gather.py)
        return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    if fp8 == "rowwise":
        return float8.Float8LinearConfig.from_recipe_name("rowwise")
    raise TPError(f"fp8 must be True, 'tensorwise', 'rowwise' or a torchao.float8.Float8LinearConfig, got {fp8!r}")


@dataclass(frozen=True)
class Fp8Spec:
    """Which operands of one converted projection are split over the TP group."""

    input_split: bool
    weight_split: bool
    grad_split: bool


def fp8_modules(model: nn.Module, plan: Plan,
                fp8_filter: Callable[[nn.Module, str], bool] | None = None) -> dict[str, Fp8Spec]:
    """The projections to run in FP8, by module name, with their split operands.

    Default: what torchao's ``convert_to_float8_training`` converts, as torchtitan uses it:
    every ``nn.Linear`` whose global and local dims are multiples of 16, split or kept
    whole by the plan, but the LM head (its logits stay high precision: the plan's
    ``lm_head`` role, or the model's ``get_output_embeddings()``) and MoE routers (the
    plan's ``routers``, found from the dataflow: their scores choose the experts), nor
    KV projections whose rows several ranks hold or read several times (:func:`_copied`).  A
    linear the plan keeps whole has no split operand: every rank casts the whole tensor.
    ``fp8_filter(module, fqn)`` replaces the default choice among the linears (the
    multiple-of-16 rule still applies).
    """
    out: dict[str, Fp8Spec] = {}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    routers = set(plan.routers)
    for name, mod in model.named_modules():
        if type(mod) is not nn.Linear:
            continue
        pp = plan.params.get(f"{name}.weight")
        if pp is None:
            continue
        dims = [*pp.global_shape, *pp.local_shape, *pp.compute_shape()]
        if any(d % _MULTIPLE for d in dims):
            continue
        if fp8_filter is not None:
            if not fp8_filter(mod, name):
                continue
        elif pp.role is Role.LM_HEAD or mod is head or name in routers or _copied(pp):
            continue
        row = pp.role is Role.ROW and pp.shard_dim == 1
        column = pp.role is Role.COLUMN and pp.shard_dim == 0
        out[name] = Fp8Spec(input_split=row, weight_split=pp.shard_dim is not None, grad_split=column)
    return out


def _copied(pp: ParamPlan) -> bool:
    """A projection whose output rows several ranks hold, or one rank reads several times
    (a KV head copied beyond tp, or read once per query head): each copy gets only its own
    query heads' part of the output gradient, so the gradient's FP8 scale could not be
    the one-process model's (the sum over the copies is never one tensor).  Kept in high
    precision, like the LM head; a user's ``fp8_filter`` decides for itself."""
    return pp.layout == "kv_replicated" or pp.expand is not None


def gathers_fp8(plan: Plan, name: str) -> bool:
    """Whether FSDP2 can all-gather ``name``'s weight in FP8 (when the config's
    ``enable_fsdp_float8_all_gather`` is set; ``fp8=True`` sets it).  Not weights whose
    rows several TP ranks hold (replicated KV heads): their local tensor is summed over
    the copies in backward, which needs it in high precision; nor weights with padding
    rows (heads dealt unevenly), whose local tensor passes the same hook."""
    pp = plan.params.get(f"{name}.weight")
    return pp is None or not shares_rows(pp)


def convert_fp8(model: nn.Module, plan: Plan, mesh: Any, fp8: Any,
                fp8_filter: Callable[[nn.Module, str], bool] | None = None, *, fsdp: bool = False) -> list[str]:
    """Turn the chosen projections into :class:`TPFloat8Linear` in place; their names.

    ``fsdp``: FSDP2 will shard the model (``parallelize``); weights the config gathers in
    FP8 are wrapped for it (:mod:`tpcompile.runtime.fp8_gather`)."""
    config = fp8_config(fp8)
    specs = fp8_modules(model, plan, fp8_filter)
    tp = 1 if mesh is None else mesh.size()
    float8 = _torchao()
    if tp > 1 and config.cast_config_input.scaling_granularity is not float8.ScalingGranularity.TENSORWISE:
        raise TPError("fp8='rowwise' with tensor parallelism is not supported: per-row scales along a split "
                      "contraction dim need other casts for each backward matmul; use fp8=True (tensorwise), "
                      "whose scales tpcompile reduces over the TP group exactly")
    mods = dict(model.named_modules())
    for name, spec in specs.items():
        _make_float8(mods[name], config, spec, mesh if tp > 1 else None)
        if fsdp and config.enable_fsdp_float8_all_gather and gathers_fp8(plan, name):
            from .fp8_gather import wrap_for_fp8_gather

            wrap_for_fp8_gather(mods[name])
    return list(specs)


# ``fp8_mesh`` of a copy the cost model runs in one process at TP-local shapes: the casts
# of the TP path (what they save for backward), with nothing split, so nothing reduced
NO_REDUCTION = "no reduction"


def convert_fp8_estimate(copy: nn.Module, model: nn.Module, plan: Plan) -> list[str]:
    """For the cost model: ``copy`` (``model`` at this rank's local shapes, one process)
    with the projections ``fp8=True`` chooses converted as under ``plan``'s TP."""
    config = fp8_config(True)
    mods = dict(copy.named_modules())
    names = [n for n in fp8_modules(model, plan) if n in mods]
    for name in names:
        _make_float8(mods[name], config, Fp8Spec(False, False, False), NO_REDUCTION if plan.tp > 1 else None)
    return names


def _make_float8(mod: nn.Module, config: Any, spec: Fp8Spec, mesh: Any) -> None:
    from torchao.float8.float8_linear import Float8Linear

    template = Float8Linear.from_float(_shape_only(mod), config)  # builds the mm configs only
    mod.__class__ = TPFloat8Linear
    for key in ("scaling_type_input", "scaling_type_weight", "scaling_type_grad_output", "config",
                "linear_mm_config"):
        setattr(mod, key, getattr(template, key))
    mod.fp8_spec = spec
    mod.fp8_mesh = mesh


def _shape_only(mod: nn.Module) -> nn.Module:
    with torch.device("meta"):
        return nn.Linear(mod.in_features, mod.out_features, bias=False)


def _cast(t: torch.Tensor, mod: TPFloat8Linear, cast: Any, role: Any, split: bool, axis: int) -> torch.Tensor:
    """``t`` in FP8, scaled by the amax of the whole tensor (MAX-reduced when ``split``)."""
    from torchao.float8.float8_scaling_utils import (
        get_maybe_axiswise_dim,
        hp_tensor_to_float8_dynamic,
    )

    mesh = mod.fp8_mesh if split else None
    return hp_tensor_to_float8_dynamic(
        t, cast.target_dtype, mod.linear_mm_config, reduce_amax=mesh is not None, gemm_input_role=role,
        device_mesh=mesh, scaling_granularity=cast.scaling_granularity,
        axiswise_dim=get_maybe_axiswise_dim(axis, cast.scaling_granularity),
        round_scales_to_power_of_2=mod.config.round_scales_to_power_of_2)


class _GradToFloat8(torch.autograd.Function):
    """Identity forward; backward casts the output gradient to FP8 with the whole
    tensor's amax (reduced over the TP group when the features are split)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, mod: TPFloat8Linear) -> torch.Tensor:
        ctx.mod = mod
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        from torchao.float8.float8_training_tensor import GemmInputRole

        mod = ctx.mod
        return _cast(grad, mod, mod.config.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT,
                     mod.fp8_spec.grad_split, -1), None


try:
    from torchao.float8.float8_linear import Float8Linear as _Float8Linear
except ImportError:  # torchao missing: the class exists, converting raises first
    _Float8Linear = nn.Linear


class TPFloat8Linear(_Float8Linear):
    """torchao's ``Float8Linear`` whose amaxes are those of the whole (unsplit) tensors."""

    fp8_spec: Fp8Spec
    fp8_mesh: Any

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole

        c, spec = self.config, self.fp8_spec
        if self.fp8_mesh is None:
            return super().forward(input)  # nothing split: torchao's own casts
        x = _cast(input, self, c.cast_config_input, GemmInputRole.INPUT, spec.input_split, -1)
        if isinstance(self.weight, Float8TrainingTensor):  # FSDP2 gathered it in FP8, whole-weight scale
            w = self.weight.t()
        else:
            w = _cast(self.weight.t(), self, c.cast_config_weight, GemmInputRole.WEIGHT, spec.weight_split, 0)
        out = matmul_with_hp_or_float8_args.apply(x, w, self.linear_mm_config, c)
        out = _GradToFloat8.apply(out, self)
        if self.bias is not None:
            out = out + self.bias.to(out.dtype)
        return out
