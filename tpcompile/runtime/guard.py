"""The module tree a plan was made for, and a guard that refuses any other.

A module added to a transformed model after ``transform`` (a PEFT adapter, a resized
embedding, a new head) was never planned: it computes on this rank's shards without the
collectives it needs, so the model trains silently wrong — PEFT sizes LoRA from the
local shard, a row module's partial LoRA output is never summed, no LoRA gradient is
reduced.  :func:`watch_tree` records each module's name and class when the composer
finishes; every ``_modules`` dict of the model then flags any change, and the next
forward of the model compares the tree with the record and raises a
:class:`~tpcompile.errors.TPError` naming what was added or replaced.  Until something
changes the check costs one attribute read per forward.

Wrappers that only rename a subtree (FSDP1's ``FullyShardedDataParallel``, activation
checkpoint / offload wrappers, ``torch.compile``'s ``OptimizedModule``) are allowed:
their segment is dropped from the names before comparing.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import TPError

__all__ = ["unplanned_modules", "watch_tree"]

# names a wrapper inserts between a module and its parent: FSDP1, checkpoint_wrapper,
# offload_wrapper, torch.compile
_WRAPPER_SEGMENTS = {"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"}
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


def _normal(name: str) -> str:
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


def _tree(model: nn.Module) -> dict[str, type]:
    return {_normal(n): type(m) for n, m in model.named_modules() if type(m).__name__ not in _WRAPPER_CLASSES}


def unplanned_modules(model: nn.Module) -> list[str]:
    """Modules of ``model`` that are not in the tree recorded by :func:`watch_tree`:
    ``"name (Class)"`` for a new one, ``"name (now New, was Old)"`` for a replaced one."""
    known: dict[str, type] = model._tpcompile_tree
    out = []
    for name, cls in _tree(model).items():
        was = known.get(name)
        if was is None:
            out.append(f"{name or '<root>'} ({_class_name(cls)})")
        elif not issubclass(cls, was):  # FSDP2 subclasses a block's class: still planned
            out.append(f"{name} (now {_class_name(cls)}, was {_class_name(was)})")
    return out


def _class_name(cls: type) -> str:
    """``module.Class``: a PEFT ``Linear`` and torch's ``Linear`` must read differently."""
    return f"{cls.__module__}.{cls.__qualname__}"


def watch_tree(model: nn.Module) -> None:
    """Record ``model``'s module tree as planned and refuse, at its next forward, any
    module added or replaced after this call."""
    watch = _Watch()
    for mod in model.modules():
        if not isinstance(mod._modules, _WatchedModules):
            watched = _WatchedModules(mod._modules)
            watched.watch = watch
            mod._modules = watched
        else:
            mod._modules.watch = watch
    model._tpcompile_tree = _tree(model)
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
