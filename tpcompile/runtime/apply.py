"""Applying a plan: shard each parameter, install the backend's hooks, fix sizes.

:func:`apply_plan` never holds more than one full tensor at a time; it reads nothing but
the :class:`~tpcompile.plan.Plan` and the model, so a saved or edited plan applies as is.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..analysis.fixups import apply_fixups, localize_embedding
from ..errors import TPError
from ..plan.modules import ModulePlan, VocabEmbedding
from ..plan.types import ParamPlan, Plan, Role, forward_holder
from . import comm
from .grad_norm import register_copies
from .rows import LocalRows, shared_rows, shares_rows
from .state_dict import install_state_dict_hooks

__all__ = ["apply_plan", "feature_methods", "has_gradient_hooks", "install_root_hooks", "install_scoped_swap"]


def _owner(fqn: str) -> tuple[str, str]:
    mod, _, name = fqn.rpartition(".")
    return mod, name


def apply_plan(model: nn.Module, plan: Plan, backend: Any, *, root_hooks: bool = True) -> nn.Module:
    """Shard parameters and install hooks per ``plan`` (in place).  ``root_hooks=False``:
    the root already has the backend's per-forward reset (a plan for added modules)."""
    # every name of a module: PEFT's prompt tuning holds the input embedding a second
    # time as ``word_embeddings``, and a tied name may be owned under that one
    mods = dict(model.named_modules(remove_duplicate=False))
    swaps: dict[str, list[str]] = defaultdict(list)
    scoped: dict[str, list[str]] = defaultdict(list)  # module -> descendants' param paths
    done: dict[int, nn.Parameter] = {}
    installed: set[tuple[int, str]] = set()  # (holder module, path): swapped once
    for name, pp in plan.params.items():
        mname, pname = _owner(name)
        old = mods[mname]._parameters[pname]
        new = done.get(id(old))
        if new is None:
            # replicated parameters become replicated DTensors too: optimizers' foreach
            # kernels and grad clipping refuse a mix of DTensors and plain tensors
            with torch.no_grad():
                local = _whole_local(old, name) if pp.shard_dim is None else backend.local_shard(old.detach(), pp)
            new = backend.make_param(local, pp, old.requires_grad)
            _carry_grad_hooks(old, new, pp)
            done[id(old)] = new
        names = [name, *pp.tied_to]
        # the names under the module whose whole forward sees the local tensor (code outside
        # the owner reads it, under any of its tied names: NeoMME's root reads
        # ``self.unembedding_projection.weight``, tied to an embedding's projection); every
        # other name is swapped by its owner
        under = set() if pp.scope is None else {n for n in names if not pp.scope or n.startswith(pp.scope + ".")}
        for alias in names:
            am, ap = _owner(alias)
            mods[am]._parameters[ap] = new
            # the module whose forward sees the local tensor: the scope, the owner, or the
            # owner's nearest caller where the owner has no forward (VBLoRA's vector bank,
            # one ParameterDict every adapted layer holds and indexes in its own forward)
            holder = pp.scope if alias in under else forward_holder(model, am)
            path = alias[len(holder) + 1:] if holder else alias
            if (id(mods[holder]), path) in installed:  # one module under two names: swapped once
                continue
            installed.add((id(mods[holder]), path))
            if holder == am:
                swaps[am].append(ap)
            else:
                scoped[holder].append(path)
        del old
    by_alias = {alias: pp for pp in plan.params.values() for alias in [pp.fqn, *pp.tied_to]}
    hooked = [m for m, mp in plan.modules.items() if mp.hooked]
    for mname in dict.fromkeys([*swaps, *hooked]):
        names = swaps.get(mname, [])
        mp = plan.modules.get(mname) or ModulePlan(fqn=mname)
        vocab_range = None
        if mp.op(VocabEmbedding) is not None:
            emb = next(by_alias[f"{mname}.{n}"] for n in names if f"{mname}.{n}" in by_alias)
            runs = emb.runs[backend.rank]
            vocab_range = (runs[0][0], runs[0][0] + emb.local_shape[emb.shard_dim])
            localize_embedding(mods[mname], vocab_range, emb.local_shape[emb.shard_dim])
        # rows several ranks hold (gradients summed) or padding rows (gradients zeroed)
        replicas = {n: by_alias[f"{mname}.{n}"] for n in names if f"{mname}.{n}" in by_alias
                    and shares_rows(by_alias[f"{mname}.{n}"])}
        backend.install(mods[mname], mp, sorted(set(names)), vocab_range, replicas)
    for mname, paths in scoped.items():
        prefix = f"{mname}." if mname else ""
        install_scoped_swap(mods[mname], {path: by_alias[prefix + path] for path in paths}, backend)
    for mname in dict.fromkeys([*swaps, *scoped]):
        if feature_methods(mods[mname]):
            prefix = f"{mname}." if mname else ""
            paths = [*swaps.get(mname, []), *scoped.get(mname, [])]
            _localizefeature_methods(mods[mname], {path: by_alias[prefix + path] for path in paths}, backend)
    for mname, mp in plan.modules.items():
        if mp.attr_fixups:
            apply_fixups(mods[mname], mp.attr_fixups)
    for name, pp in plan.params.items():
        if pp.layout == "kv_replicated":  # gradient norms count its copied rows once
            mname, pname = _owner(name)
            register_copies(mods[mname], pname, pp, backend.rank)
    if getattr(backend, "tp", 1) > 1:
        # state_dict()/load_state_dict() speak HF tensors, whatever the local layout
        install_state_dict_hooks(model, plan.params, backend.mesh)
    if root_hooks:
        install_root_hooks(model, backend)
    model.tpcompile_plan = plan
    return model


def _whole_local(p: torch.Tensor, name: str) -> torch.Tensor:
    """A whole parameter's tensor: a replicated DTensor (a copy of a planned parameter:
    PEFT's ``modules_to_save`` copies the transformed module) gives its local tensor."""
    if not isinstance(p, DTensor):
        return p.detach()
    if any(not pl.is_replicate() for pl in p.placements):
        raise TPError(f"{name} is a copy of a split parameter of the transformed model (a modules_to_save copy "
                      "of a split module): add the adapter before tpcompile.transform")
    return p.to_local().detach()


def has_gradient_hooks(p: torch.Tensor) -> bool:
    """Were hooks registered on the tensor ``p`` itself (``register_hook``, or
    ``register_post_accumulate_grad_hook``)?"""
    return bool(p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None))


def _carry_grad_hooks(old: nn.Parameter, new: nn.Parameter, pp: ParamPlan) -> None:
    """Gradient hooks registered on the parameter before ``transform`` (``p.register_hook``:
    PEFT OSF's projections, a mask freezing embedding rows) run on its replacement, as
    the plain tensors they were written for: a whole parameter's hook gets the local
    tensor of its replicated gradient, complete (summed where partial) by then.  A split
    parameter's would see its rows only: refused, naming it, never dropped."""
    if not has_gradient_hooks(old):
        return
    hooks = list((old._backward_hooks or {}).values())
    later = list((getattr(old, "_post_accumulate_grad_hooks", None) or {}).values())
    if not isinstance(new, DTensor):  # nothing split: the hooks run as they are
        for h in hooks:
            new.register_hook(h)
        for h in later:
            new.register_post_accumulate_grad_hook(h)
        return
    if later or pp.shard_dim is not None:
        what = "split over the TP ranks" if pp.shard_dim is not None else "a replicated DTensor"
        raise TPError(
            f"{pp.fqn} has {'post-accumulate-' if later else ''}gradient hooks (register_hook) and the plan "
            f"makes it {what}: the hooks would see a different gradient than they were written for. Register "
            f"them after transform on the parameter's local tensor, or keep it whole with "
            f"overrides={{{pp.fqn!r}: 'replicated'}}")
    for h in hooks:
        new.register_hook(functools.partial(_on_local_grad, h))


def _on_local_grad(hook: Any, grad: torch.Tensor) -> torch.Tensor | None:
    if not isinstance(grad, DTensor):
        return hook(grad)
    out = hook(grad.to_local())
    if out is None:
        return None
    return DTensor.from_local(out, grad.device_mesh, grad.placements, run_check=False)


def install_root_hooks(model: nn.Module, backend: Any) -> None:
    """The backend's per-forward state is reset around every call of the root ``model``."""
    if hasattr(backend, "reset"):  # an input shared by column modules never spans two passes
        model.register_forward_pre_hook(lambda *_: backend.reset())
        model.register_forward_hook(lambda *_: backend.reset())


class _LocalSwap:
    """Parameters at ``paths`` (under the module given to :meth:`enter`) as their local
    tensors until :meth:`exit`: with the gradients of rows several ranks hold summed,
    and of padding rows zeroed, as in an owner's own forward, and a scope's GradSum
    (plan/build.py) once, where an enclosing swap has not made it local already.
    ``only_tp``: leave alone what is not a DTensor of the TP mesh (a method called
    inside the forward finds it local already; outside, FSDP2's shard is FSDP2's to
    unshard)."""

    def __init__(self, paths: dict[str, ParamPlan], backend: Any, *, only_tp: bool = False) -> None:
        self.paths, self.backend, self.only_tp = paths, backend, only_tp
        self.mesh = getattr(backend, "mesh", None)
        self.rows = {path: LocalRows.of(pp, backend.rank) for path, pp in paths.items() if shares_rows(pp)}
        self.saved: list[tuple[nn.Module, str, Any]] = []

    def enter(self, mod: nn.Module) -> None:
        for path, pp in self.paths.items():
            owner, _, leaf = path.rpartition(".")
            sub = mod.get_submodule(owner) if owner else mod
            p = sub._parameters[leaf]
            tp = isinstance(p, DTensor) and (self.mesh is None or p.device_mesh == self.mesh)
            if self.only_tp and not tp:
                continue
            self.saved.append((sub, leaf, p))
            local = p.to_local() if isinstance(p, DTensor) else p
            if pp.role is Role.GRAD_ALLREDUCE and isinstance(p, DTensor):
                local = comm.all_reduce_grad(local, self.backend.group)
            sub._parameters[leaf] = shared_rows(local, pp, self.rows.get(path), self.backend.group)

    def exit(self) -> None:
        while self.saved:
            sub, leaf, p = self.saved.pop()
            sub._parameters[leaf] = p


def install_scoped_swap(module: nn.Module, paths: dict[str, ParamPlan], backend: Any) -> None:
    """For ``module``'s whole forward, its descendants' parameters at ``paths`` are their
    local tensors (the code reads them directly, outside the owner's forward; Mamba-2
    reads its depthwise conv's weight whose B/C channels, one group for all heads, every
    rank holds)."""
    swap = _LocalSwap(paths, backend)
    module.register_forward_pre_hook(lambda mod, args: swap.enter(mod))
    # always_call: restored even when the forward raised
    module.register_forward_hook(lambda mod, args, out: swap.exit(), always_call=True)


def feature_methods(module: nn.Module) -> list[str]:
    """The encoders a model offers beside its forward, which transformers' ``generate()``
    calls itself (``get_image_features``,
    ``get_video_features``, ``get_audio_features``)."""
    return [n for n in dir(type(module)) if n.startswith("get_") and n.endswith("_features")
            and callable(getattr(type(module), n, None))]


def _localizefeature_methods(module: nn.Module, paths: dict[str, ParamPlan], backend: Any) -> None:
    """``module``'s encoders (:func:`_feature_methods`) read its parameters at ``paths``
    as its forward does: transformers' ``generate()`` encodes the images before the first
    forward by calling the base model's ``get_image_features`` itself, where LLaVA-NeXT
    reads its own ``image_newline``, a DTensor outside the forward's swap."""
    for name in feature_methods(module):
        method = getattr(module, name)
        swap = _LocalSwap(paths, backend, only_tp=True)

        @functools.wraps(method)
        def local(*args: Any, _method: Any = method, _swap: _LocalSwap = swap, **kwargs: Any) -> Any:
            _swap.enter(module)
            try:
                return _method(*args, **kwargs)
            finally:
                _swap.exit()

        local.__module__ = __name__  # tpcompile's: a re-plan's twin of the model drops it (wraps copied HF's)
        setattr(module, name, local)
