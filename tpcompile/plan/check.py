"""Checking a plan against the model it is applied to.

A plan is data: saved with :meth:`~tpcompile.plan.Plan.to_json`, edited, loaded with
:meth:`~tpcompile.plan.Plan.from_json` and applied with ``transform(model, tp,
plan=...)``.  Before anything moves, :func:`check_plan` proves it describes *this*
model at *this* degree: same class, same parameters with the same (HF) shapes, local
shapes that follow from the index runs, modules that exist.
"""

from __future__ import annotations

from torch import nn

from ..errors import TPError
from .types import Plan

__all__ = ["check_plan"]


def check_plan(plan: Plan, model: nn.Module, tp: int) -> None:
    """Raise a :class:`TPError` naming the first way ``plan`` does not fit ``model`` at ``tp``."""
    if not isinstance(plan, Plan):
        raise TPError(f"plan must be a tpcompile Plan (Plan.from_json(text)), got {type(plan).__name__}")
    if plan.tp != tp:
        raise TPError(f"the plan was made for tp={plan.tp}, not tp={tp}: re-plan with plan_model(model, tp={tp})")
    name = type(model).__name__
    if plan.model_class and plan.model_class != name:
        raise TPError(f"the plan was made for a {plan.model_class}, not this {name}")
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(plan.params))
    extra = sorted(set(plan.params) - set(params))
    if missing or extra:
        what = (f"{len(missing)} parameters have no entry (e.g. {missing[:3]})" if missing
                else f"{len(extra)} entries name no parameter of the model (e.g. {extra[:3]})")
        raise TPError(f"the plan does not describe this {name}: {what}")
    modules = dict(model.named_modules())
    for fqn, pp in plan.params.items():
        shape = list(params[fqn].shape)
        if list(pp.global_shape) != shape:
            raise TPError(f"plan entry {fqn}: global shape {pp.global_shape}, but the model's parameter is {shape}")
        if pp.shard_dim is None:
            if list(pp.local_shape) != shape:
                raise TPError(f"plan entry {fqn} is not split but its local shape {pp.local_shape} is not {shape}")
            continue
        if not 0 <= pp.shard_dim < len(shape) or pp.runs is None or len(pp.runs) != tp:
            raise TPError(f"plan entry {fqn}: shard_dim {pp.shard_dim} with {len(pp.runs or [])} rank runs "
                          f"does not fit a {len(shape)}-D parameter at tp={tp}")
        rows = pp.index()
        local = list(shape)
        local[pp.shard_dim] = rows.shape[1]
        if list(pp.local_shape) != local or rows.max() >= shape[pp.shard_dim]:
            raise TPError(f"plan entry {fqn}: its runs give local shape {local} over {shape[pp.shard_dim]} rows, "
                          f"but local_shape is {pp.local_shape}")
        for alias in pp.tied_to:
            if alias.rpartition(".")[0] not in modules:
                raise TPError(f"plan entry {fqn} is tied to {alias}, which is not in the model")
    unknown = sorted(set(plan.modules) - set(modules))
    if unknown:
        raise TPError(f"the plan hooks modules the model does not have: {unknown[:3]}")
    for fqn in [*plan.blocks, *plan.experts]:
        if fqn not in modules:
            raise TPError(f"the plan names block or experts module {fqn!r}, which is not in the model")
