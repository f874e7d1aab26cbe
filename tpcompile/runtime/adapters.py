"""Modules added to a transformed model (PEFT adapters): planned like the rest of it.

``get_peft_model(tpcompile.transform(model, tp), config)`` wraps planned modules in
adapter modules the plan never saw.  They are planned from the dataflow of the adapted
model, exactly as if the adapters had been there at ``transform`` time:

1. :func:`global_twin` builds a meta-device twin of the model as the user sees it:
   every module, old and new, with the global (HF) shapes, no tpcompile hooks, and the
   attributes tpcompile made rank-local set back to their global values;
2. the composer plans the twin with the options ``transform`` was given;
3. :func:`adopt_plan` checks that the parameters and modules planned before keep their
   layout (adding an adapter never re-splits the model under it), then shards the new
   parameters and installs their collectives with the same code ``transform`` uses.

So a LoRA ``B`` after a column-parallel projection is split like the projection's output
and reads its input through the TP region, a LoRA ``A`` before a row-parallel one is split
like its input and its partial sum is reduced, and anything else the rules can place
(IA3 vectors, DoRA magnitudes, ``modules_to_save`` copies) follows; what they cannot is
a :class:`~tpcompile.errors.TPError` naming the module.

For the twin to hold global shapes the adapters must be *created* at global size: PEFT
sizes an adapter from the local shard of a DTensor weight (transformers' TP runs each
module on its shard), but a tpcompile module keeps the global semantics of the
untransformed model.  :func:`size_adapters_globally` makes PEFT read the global features
of tpcompile-planned modules, so the adapters get the same shapes, and the same random
initialisation, as on a single process.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import itertools
import sys
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..analysis.fixups import global_config
from ..analysis.shape_sites import strip_sites
from ..errors import TPError, listed
from ..plan.modules import VocabEmbedding
from ..plan.types import Plan
from .apply import apply_plan, install_scoped_swap
from .guard import held, settle

__all__ = ["adopt_plan", "global_twin", "is_peft_model", "refuse_cache_prefixes", "size_adapters_globally",
           "when_imported"]

_PLANNED = "_tpcompile_planned"


# ------------------------------------------------------------------ PEFT's adapter sizes


def _global_features(original: Any) -> Any:
    def in_out_features(module: nn.Module) -> Any:
        if module.__dict__.get(_PLANNED) and isinstance(getattr(module, "weight", None), DTensor):
            if isinstance(module, nn.Linear):
                return module.in_features, module.out_features  # global: never localized
            if isinstance(module, nn.Embedding):
                return tuple(module.weight.shape)  # num_embeddings is the local row count
        return original(module)

    in_out_features._tpcompile_original = original
    return in_out_features


def size_adapters_globally() -> None:
    """Make PEFT size adapters of tpcompile-planned modules from their global features;
    other modules are sized by PEFT's own rule.  Done when PEFT is imported (now, if it
    already is); idempotent."""
    when_imported("peft.tuners.tuners_utils", _patch_sizing)
    when_imported("peft.tuners.tuners_utils", _patch_injection)
    when_imported("peft.peft_model", _patch_prompt_encoder)
    when_imported("peft.tuners.adalora.model", _patch_rank_allocation)


def _patch_injection(utils: Any) -> None:
    """One PEFT injection is one change: PEFT reads ``next(model.parameters())`` before
    each adapter it adds, and each such walk would re-plan the model."""
    tuner = getattr(utils, "BaseTuner", None)
    inject = getattr(tuner, "inject_adapter", None)
    if inject is None or hasattr(inject, "_tpcompile_original"):
        return

    def inject_adapter(self: Any, model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        watched = "_tpcompile_watch" in model.__dict__
        try:
            with held():
                # held by reference: an object PEFT replaces and frees must not lend its id
                before = {id(t): t for t in itertools.chain(model.parameters(), model.buffers(), model.modules())} \
                    if watched else {}
                out = inject(self, model, *args, **kwargs)
                for module in model.modules() if watched else ():
                    if id(module) not in before:
                        _drop_copied_hooks(module)
                # no error does not mean no such computation: a factorization of the
                # sharded weight (PEFT OSF's SVD) runs on the DTensor, leaving DTensors
                # (a ``modules_to_save`` copy is a copy, not a computation: the re-plan judges it)
                made = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
                        if watched and id(t) not in before and isinstance(t, DTensor) and ".modules_to_save." not in n]
        except RuntimeError as err:
            if not watched or "mixed torch.Tensor and DTensor" not in str(err):
                raise
            raise _computed_from_shards(self, str(err)) from err
        if made:
            raise _computed_from_shards(self, f"it made {', '.join(made[:3])} from them")
        settle(model)
        return out

    inject_adapter._tpcompile_original = inject
    tuner.inject_adapter = inject_adapter


def _drop_copied_hooks(module: nn.Module) -> None:
    """A module PEFT made by copying a transformed one (``modules_to_save``) carries the
    original's tpcompile hooks, bound to the original's state: they would swap the copy's
    parameters and never restore them.  The copy is planned afresh, hooks and all."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key, fn in list(hooks.items()):
            if _ours("", fn):
                del hooks[key]
                for extra in (module._forward_pre_hooks_with_kwargs, module._forward_hooks_with_kwargs,
                              module._forward_hooks_always_called):
                    extra.pop(key, None)


def _computed_from_shards(tuner: Any, what: str) -> TPError:
    return TPError(
        f"PEFT computes with the sharded weights of the transformed model while it creates this "
        f"adapter ({type(tuner).__name__}: {what}), as DoRA's magnitude vector, trainable tokens' rows "
        "of the embedding and OSF's factorization of each weight do. Add this adapter "
        "before tpcompile.transform (get_peft_model(model, config) first, then transform the PeftModel; "
        "strict=False keeps the modules it adapts replicated)")


def _patch_sizing(utils: Any) -> None:
    original = getattr(utils, "_get_in_out_features", None)
    if original is None or hasattr(original, "_tpcompile_original"):
        return
    patched = _global_features(original)
    # PEFT's tuner modules import the function by name: every binding made so far is
    # replaced, and the ones made later import the patched function
    for name, mod in list(sys.modules.items()):
        if (name == "peft" or name.startswith("peft.")) and getattr(mod, "_get_in_out_features", None) is original:
            mod._get_in_out_features = patched


# PEFT methods that give every attention layer learned keys and values through
# ``past_key_values``: a cache built outside the model, holding every head
_CACHE_PREFIXES = ("PREFIX_TUNING", "CARTRIDGE")


def _cache_prefix(config: Any, adapter: str) -> str | None:
    """``"prefix tuning (adapter 'default')"`` where ``config`` is one of those methods."""
    method = str(getattr(getattr(config, "peft_type", None), "value", ""))
    return f"{method.lower().replace('_', ' ')} (adapter {adapter!r})" if method in _CACHE_PREFIXES else None


def _cache_prefix_error(method: str, fix: str) -> TPError:
    return TPError(
        f"PEFT's {method} feeds every attention layer learned keys and values for all its heads as a cache "
        "(past_key_values) built outside the model: tpcompile neither captures a cache passed in nor splits "
        f"its heads, so the attention would run on mismatched heads. {fix}; LoRA-family adapters, IA3, VeRA "
        "and prompt tuning split exactly")


def refuse_cache_prefixes(model: nn.Module) -> None:
    """A PEFT model whose adapters are key/value prefixes (prefix tuning, cartridges) is
    a :class:`TPError` before anything is traced."""
    if not is_peft_model(model):
        return
    for name, config in model.peft_config.items():
        if (method := _cache_prefix(config, name)) is not None:
            raise _cache_prefix_error(method, "Train it on the plain model (data parallelism only, e.g. FSDP2's "
                                      "fully_shard)")


def _patch_prompt_encoder(peft_model: Any) -> None:
    """Adding prefix adapters to a model whose heads are split is refused right away, not
    at its first forward (where the prefix and the local keys would not concatenate)."""
    cls = getattr(peft_model, "PeftModel", None)
    setup = getattr(cls, "_setup_prompt_encoder", None)
    if setup is None or hasattr(setup, "_tpcompile_original"):
        return

    def _setup_prompt_encoder(self: Any, adapter_name: str) -> Any:
        method = _cache_prefix(self.peft_config[adapter_name], adapter_name)
        plan = getattr(self.base_model, "tpcompile_plan", None)
        if method is not None and plan is not None and plan.tp > 1:
            raise _cache_prefix_error(method, f"This model's attention heads are split over tp={plan.tp} ranks")
        return setup(self, adapter_name)

    _setup_prompt_encoder._tpcompile_original = setup
    cls._setup_prompt_encoder = _setup_prompt_encoder


@contextlib.contextmanager
def whole_trainables(model: nn.Module) -> Iterator[None]:
    """Inside the block, every trainable DTensor parameter of ``model`` is its whole tensor
    (and gradient); what the block changes in place is written back to this rank's part
    after it.  For a tool's code that computes on parameters outside any forward: AdaLoRA's
    rank allocation scores each adapter's triplets and masks ``lora_E`` with Python lists.
    A collective: every rank of the model's TP group enters it."""
    swapped: list[tuple[nn.Module, str, DTensor, nn.Parameter, int]] = []
    whole_of: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if not isinstance(p, DTensor) or not p.requires_grad:
                continue
            whole = whole_of.get(id(p))
            if whole is None:  # a parameter several modules hold is gathered once
                whole = whole_of[id(p)] = nn.Parameter(p.full_tensor().detach().clone())
                if p.grad is not None:
                    whole.grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            swapped.append((mod, name, p, whole, whole._version))
            mod._parameters[name] = whole
    try:
        yield
    finally:
        for mod, name, p, whole, version in swapped:
            mod._parameters[name] = p
            if whole._version != version:
                with torch.no_grad():
                    p.to_local().copy_(_local_part(whole.detach(), p))


def _local_part(whole: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's part of ``whole`` as ``like`` holds it (rank order, equal parts)."""
    placement = like.placements[0]
    if not placement.is_shard():
        return whole
    return whole.chunk(like.device_mesh.size(), dim=placement.dim)[like.device_mesh.get_local_rank()]


def _patch_rank_allocation(adalora: Any) -> None:
    """AdaLoRA's ``update_and_allocate`` (called in the training loop) runs on the whole
    adapters of a transformed model: its scores and masks equal one process's."""
    cls = getattr(adalora, "AdaLoraModel", None)
    update = getattr(cls, "update_and_allocate", None)
    if update is None or hasattr(update, "_tpcompile_original"):
        return

    def update_and_allocate(self: Any, global_step: int) -> Any:
        if not any(isinstance(p, DTensor) for p in self.model.parameters()):
            return update(self, global_step)
        with whole_trainables(self.model):
            return update(self, global_step)

    update_and_allocate._tpcompile_original = update
    cls.update_and_allocate = update_and_allocate


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT wrapper (``PeftModel``): adapters' config by name, the model it wraps behind."""
    return isinstance(getattr(model, "peft_config", None), dict) and hasattr(model, "get_base_model")


_PENDING: dict[str, list[Callable[[Any], None]]] = {}


def when_imported(name: str, fn: Callable[[Any], None]) -> None:
    """Call ``fn(module)`` once module ``name`` is imported: now if it is, else right after
    its import (a third-party package a user may import only after ``transform``, left
    unimported for users who never do)."""
    mod = sys.modules.get(name)
    if mod is not None:
        fn(mod)
        return
    if fn not in _PENDING.setdefault(name, []):
        _PENDING[name].append(fn)
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the :func:`when_imported` callbacks of a module right after it executes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _PENDING:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader, callbacks = spec.loader, _PENDING.pop(name)
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            for fn in callbacks:
                fn(module)

        loader.exec_module = exec_module
        return spec


# ------------------------------------------------------------------------ the twin


def global_twin(model: nn.Module, plan: Plan) -> nn.Module:
    """A meta-device copy of ``model`` as the untransformed model would be: global shapes,
    no hooks, rank-local attributes set back to their global values.  ``plan`` is the plan
    applied so far, under the model's current module names."""
    clones: dict[int, nn.Module] = {}
    tensors: dict[int, torch.Tensor] = {}
    # the HF shape of each planned parameter: a DTensor's shape is ``tp`` times its local
    # rows, not the HF rows where ranks hold copies (a KV head on every rank) or padding
    shapes = {id(p): plan.params[n].global_shape for n, p in model.named_parameters(remove_duplicate=False)
              if n in plan.params}

    def meta(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        if id(t) not in tensors:
            m = torch.empty(shapes.get(id(t), t.shape), dtype=t.dtype, device="meta")
            tensors[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m
        return tensors[id(t)]

    def clone(mod: nn.Module) -> nn.Module:
        if id(mod) in clones:
            return clones[id(mod)]
        twin = object.__new__(_plain_class(type(mod)))
        clones[id(mod)] = twin
        # every hook is dropped below, so a flag saying hooks are installed goes too
        # (transformers' ``_output_capturing_hooks_installed``: the twin's vision tower
        # returned no hidden states, its images failed, and the re-plan kept it whole)
        state = {k: v for k, v in mod.__dict__.items() if not _ours(k, v) and not k.endswith("_hooks_installed")}
        for k, v in state.items():
            if "hooks" in k and isinstance(v, dict):
                state[k] = OrderedDict()  # tpcompile's collectives, state-dict hooks, guards
            elif isinstance(v, nn.Module):  # a module held as a plain attribute: its twin
                state[k] = clone(v)
        state["_parameters"] = {k: meta(p) for k, p in mod._parameters.items()}
        state["_buffers"] = {k: meta(b) for k, b in mod._buffers.items()}
        state["_modules"] = {k: None if c is None else clone(c) for k, c in dict.items(mod._modules)}
        if "config" in state:
            state["config"] = global_config(state["config"])
        object.__setattr__(twin, "__dict__", state)
        return twin

    twin = clone(model)
    mods = dict(twin.named_modules())
    for name, mp in plan.modules.items():
        mod = mods.get(name)
        if mod is None:
            continue
        for attr, (glob, _) in strip_sites(mp.attr_fixups).items():
            if not attr.startswith("config."):
                setattr(mod, attr, glob)
        if mp.op(VocabEmbedding) is not None and hasattr(mod, "num_embeddings"):
            mod.num_embeddings = mod.weight.shape[0]
    return twin


def _plain_class(cls: type) -> type:
    """The model's own class behind FSDP2's ``FSDP<Class>`` (``fully_shard`` swaps it in)."""
    from torch.distributed.fsdp import FSDPModule

    if not issubclass(cls, FSDPModule):
        return cls
    return next(c for c in cls.__mro__[1:] if issubclass(c, nn.Module) and not issubclass(c, FSDPModule))


def _ours(key: str, value: Any) -> bool:
    """An instance attribute tpcompile (its marks, bound methods, loss functions) or
    FSDP2 (its per-module state) set."""
    if key.startswith(("tpcompile", "_tpcompile", "__composable_api_state_key")):  # ours, FSDP2's state
        return True
    fn = getattr(value, "__func__", value)
    return callable(fn) and getattr(fn, "__module__", "").startswith("tpcompile.")


# ------------------------------------------------------------------ applying the new plan


def _layout(pp: Any) -> tuple:
    return pp.shard_dim, pp.layout, pp.runs, tuple(pp.global_shape), pp.scope


def adopt_plan(model: nn.Module, old: Plan, new: Plan, backend: Any) -> None:
    """Apply the part of ``new`` (the adapted model's plan) that ``old`` (the applied one,
    under today's names) does not cover; raise if a planned part would change."""
    tied = {name for p in new.params.values() for name in p.tied_to}
    rescoped: dict[str, dict[str, Any]] = {}
    for fqn, pp in old.params.items():
        now = new.params.get(fqn)
        if now is None and pp.shard_dim is None and fqn not in tied:
            continue  # whole, and no longer read (the original beside a modules_to_save copy)
        if now is not None and pp.shard_dim is None and now.shard_dim is None and now.scope \
                and now.scope != pp.scope and _layout(now)[:4] == _layout(pp)[:4]:
            # whole, now read by a wrapper's own code too (PEFT's modules_to_save wrapper
            # reads its original's weight): local in that wrapper's forward as well
            rescoped.setdefault(now.scope, {})[fqn[len(now.scope) + 1:]] = now
            continue
        if now is None or _layout(now) != _layout(pp):
            how = "keeps it replicated" if now is None or now.shard_dim is None else f"splits dim {now.shard_dim}"
            raise TPError(
                f"adding {_new_owner(new, old)} to the transformed model changes how {fqn} is split (now "
                f"{'replicated' if pp.shard_dim is None else f'split along dim {pp.shard_dim}'}, the adapted "
                f"model {how}); tpcompile does not re-split a model it applied. Add the adapters before "
                "tpcompile.transform (get_peft_model(model, config) first, then transform the PeftModel)")
    for name, mp in old.modules.items():
        now = new.modules.get(name)
        if now is None or now.ops != mp.ops:
            raise TPError(
                f"adding {_new_owner(new, old)} to the transformed model changes the collectives of {name} "
                f"({mp.ops} -> {None if now is None else now.ops}); add the adapters before tpcompile.transform "
                "(get_peft_model(model, config) first, then transform the PeftModel)")
    added = replace(new, params={k: v for k, v in new.params.items() if k not in old.params},
                    modules={k: v for k, v in new.modules.items() if k not in old.modules})
    with torch.no_grad():
        apply_plan(model, added, backend, root_hooks=False)
    for scope, paths in rescoped.items():
        install_scoped_swap(model.get_submodule(scope), paths, backend)
    model.tpcompile_plan = new


def _new_owner(new: Plan, old: Plan) -> str:
    return listed(sorted({pp.module for k, pp in new.params.items() if k not in old.params}), 3) or "new modules"
