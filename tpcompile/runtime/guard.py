"""The module tree a plan was made for, and a guard that refuses any other.

A module added to a transformed model after ``transform`` (a PEFT adapter, a resized
embedding, a new head) was never planned: it computes on this rank's shards without the
collectives it needs, so the model trains silently wrong — PEFT sizes LoRA from the
local shard, a row module's partial LoRA output is never summed, no LoRA gradient is
reduced.  :func:`watch_tree` marks every module of the planned model when the composer
finishes (the mark is the module's own, so it follows the module wherever it moves and
into copies); every ``_modules`` dict of the model then flags any change, and the next
forward looks for modules without the mark and raises a
:class:`~tpcompile.errors.TPError` naming them.  Until something changes the check costs
one attribute read per forward.  Moving planned modules is fine: PEFT's
``merge_and_unload`` puts each planned base layer back where its wrapper was.

Wrappers that only rename a subtree (FSDP1's ``FullyShardedDataParallel``, activation
checkpoint / offload wrappers, ``torch.compile``'s ``OptimizedModule``) are allowed.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import TPError

__all__ = ["unplanned_modules", "watch_tree"]

# wrappers that only rename a subtree: FSDP1, checkpoint_wrapper, offload_wrapper,
# torch.compile
_WRAPPER_CLASSES = {"FullyShardedDataParallel", "CheckpointWrapper", "OffloadWrapper", "OptimizedModule"}
_SHOWN = 6


class _Watch:
    """Shared by every ``_modules`` dict of one model: set when any of them changes."""

    __slots__ = ("changed",)

    def __init__(self) -> None:
        self.changed = False


class _WatchedModules(dict):
    """A module's ``_modules`` that flags its model's watch on every change."""

    __slots__ = ("watch",)

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self.watch.changed = True

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self.watch.changed = True

    def pop(self, *args: Any) -> Any:
        self.watch.changed = True
        return super().pop(*args)

    def popitem(self) -> Any:
        self.watch.changed = True
        return super().popitem()

    def setdefault(self, key: str, default: Any = None) -> Any:
        self.watch.changed = True
        return super().setdefault(key, default)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self.watch.changed = True
        super().update(*args, **kwargs)

    def clear(self) -> None:
        self.watch.changed = True
        super().clear()


_MARK = "_tpcompile_planned"


def unplanned_modules(model: nn.Module) -> list[str]:
    """``"name (module.Class)"`` of every module of ``model`` that was not part of it when
    :func:`watch_tree` ran (wrappers that only rename a subtree aside)."""
    return [f"{name or '<root>'} ({_class_name(type(m))})" for name, m in model.named_modules()
            if not m.__dict__.get(_MARK) and type(m).__name__ not in _WRAPPER_CLASSES]


def _class_name(cls: type) -> str:
    """``module.Class``: a PEFT ``Linear`` and torch's ``Linear`` must read differently."""
    return f"{cls.__module__}.{cls.__qualname__}"


def watch_tree(model: nn.Module) -> None:
    """Record ``model``'s module tree as planned and refuse, at its next forward, any
    module added or replaced after this call."""
    watch = _Watch()
    for mod in model.modules():
        mod.__dict__[_MARK] = True
        if not isinstance(mod._modules, _WatchedModules):
            watched = _WatchedModules(mod._modules)
            watched.watch = watch
            mod._modules = watched
        else:
            mod._modules.watch = watch
    model._tpcompile_watch = watch
    if not hasattr(model, "_tpcompile_tree_guard"):
        model._tpcompile_tree_guard = model.register_forward_pre_hook(_check, prepend=True)


def _check(model: nn.Module, args: tuple) -> None:
    watch = model._tpcompile_watch
    if not watch.changed:
        return
    found = unplanned_modules(model)
    if not found:
        watch.changed = False  # a module set back to itself: nothing new
        return
    shown = ", ".join(found[:_SHOWN]) + (f" and {len(found) - _SHOWN} more" if len(found) > _SHOWN else "")
    raise TPError(
        f"{len(found)} modules were added to or replaced in this model after tpcompile planned it, so they "
        f"would run on this rank's shards without the collectives they need (a silently wrong model): "
        f"{shown}. Add adapters and new modules before tpcompile.transform / parallelize (PEFT: "
        "get_peft_model(model, config) first, then transform the PeftModel), or build the model again")
