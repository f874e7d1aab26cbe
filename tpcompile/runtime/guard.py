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

With an ``adopt`` callback (the composer's re-planning, :mod:`tpcompile.runtime.adapters`)
new modules are planned instead of refused.  That happens at the first walk over the
model's tree from its root after the change (``parameters()``, ``state_dict()``,
``named_modules()``: PEFT's own marking of the trainable adapters is one), so an
optimizer built right after ``get_peft_model`` already holds the planned parameters;
the next forward is the backstop.  Walks of a subtree (PEFT moving one new wrapper to
its base's device) do not trigger it, so one re-plan covers every adapter injected.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from ..errors import TPError, listed

__all__ = ["held", "planned_names", "settle", "unplanned_modules", "watch_tree"]

# wrappers that only rename a subtree: FSDP1, checkpoint_wrapper, offload_wrapper,
# torch.compile
_WRAPPER_CLASSES = {"FullyShardedDataParallel", "CheckpointWrapper", "OffloadWrapper", "OptimizedModule"}
_SHOWN = 6


class _Watch:
    """Shared by every ``_modules`` dict of one model: set when any of them changes."""

    __slots__ = ("adopt", "busy", "changed", "model")

    def __init__(self, model: nn.Module, adopt: Callable[[list[str]], None] | None) -> None:
        self.changed = False
        self.busy = False
        self.model = model
        self.adopt = adopt

    def settle(self) -> None:
        """Plan what changed (``adopt``) or, without an adopter, leave it to the forward."""
        if not self.changed or self.busy or self.adopt is None or _HELD[0]:
            return
        self.busy = True  # the walks below (and the adopter's) must not settle again
        try:
            try:  # also with nothing new: planned modules may have moved (renamed)
                self.adopt(unplanned_modules(self.model))
            except Exception:
                self.adopt = None  # said once; from now on the forward refuses them
                raise
            self.changed = False
        finally:
            self.busy = False


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


_HELD = [0]  # > 0: a multi-step change is under way (held), walks do not settle it


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Changes made inside are one change: walks of the tree in between (PEFT looks at
    the model's parameters before each adapter it injects) do not plan them one by one;
    :func:`settle` after the block does, once."""
    _HELD[0] += 1
    try:
        yield
    finally:
        _HELD[0] -= 1


def settle(model: nn.Module) -> None:
    """Plan the changes made to a watched ``model`` now (a no-op for other models)."""
    watch = model.__dict__.get("_tpcompile_watch")
    if watch is not None:
        watch.settle()


class _RootModules(_WatchedModules):
    """The root's ``_modules``: a walk over the tree from the root starts here, and first
    plans whatever changed since the last one."""

    __slots__ = ()

    def items(self) -> Any:
        self.watch.settle()
        return super().items()

    def values(self) -> Any:
        self.watch.settle()
        return super().values()


_MARK = "_tpcompile_planned"


def planned_names(model: nn.Module) -> dict[int, str]:
    """``id(module) -> name`` with the segments of renaming wrappers left out (an FSDP1 or
    checkpoint-wrapped block keeps the name it was planned under)."""
    names: dict[int, str] = {}
    todo = [("", model)]
    while todo:
        name, mod = todo.pop()
        if id(mod) in names:
            continue
        names[id(mod)] = name
        wrapper = type(mod).__name__ in _WRAPPER_CLASSES
        for key, child in dict.items(mod._modules):
            if child is not None:
                todo.append((name if wrapper else f"{name}.{key}" if name else key, child))
    return names


def unplanned_modules(model: nn.Module) -> list[str]:
    """``"name (module.Class)"`` of every module of ``model`` that was not part of it when
    :func:`watch_tree` ran (wrappers that only rename a subtree aside)."""
    return [u for name, m in model.named_modules() if (u := _unplanned(name, m))]


def _unplanned(name: str, mod: nn.Module) -> str | None:
    """``"name (module.Class)"`` if ``mod`` was not planned (nor a renaming wrapper)."""
    if mod.__dict__.get(_MARK) or type(mod).__name__ in _WRAPPER_CLASSES:
        return None
    return f"{name or '<root>'} ({_class_name(type(mod))})"


def _class_name(cls: type) -> str:
    """``module.Class``: a PEFT ``Linear`` and torch's ``Linear`` must read differently."""
    return f"{cls.__module__}.{cls.__qualname__}"


def watch_tree(model: nn.Module, adopt: Callable[[list[str]], None] | None = None) -> None:
    """Record ``model``'s module tree as planned; any module added or replaced after this
    call is handed to ``adopt`` (it plans them or raises), or without one refused at the
    next forward."""
    watch = _Watch(model, adopt)
    for mod in model.modules():
        mod.__dict__[_MARK] = True
        kind = _RootModules if mod is model else _WatchedModules
        if type(mod._modules) is not kind:
            watched = kind(mod._modules)
            watched.watch = watch
            mod._modules = watched
        else:
            mod._modules.watch = watch
    model._tpcompile_watch = watch
    if not hasattr(model, "_tpcompile_tree_guard"):
        model._tpcompile_tree_guard = model.register_forward_pre_hook(_check, prepend=True)
        model._tpcompile_tree_guard_after = model.register_forward_hook(_check_after)


def _check(model: nn.Module, args: tuple) -> None:
    watch = model._tpcompile_watch
    if not watch.changed:
        return
    watch.settle()
    if not watch.changed:
        return
    found = unplanned_modules(model)
    if not found:
        watch.changed = False  # a module set back to itself: nothing new
        return
    shown = listed(found, _SHOWN)
    raise TPError(
        f"{len(found)} modules were added to or replaced in this model after tpcompile planned it, so they "
        f"would run on this rank's shards without the collectives they need (a silently wrong model): "
        f"{shown}. Add adapters and new modules before tpcompile.transform / parallelize (PEFT: "
        "get_peft_model(model, config) first, then transform the PeftModel), or build the model again")


def _check_after(model: nn.Module, args: tuple, output: Any) -> None:
    """A model that replaces its own modules during a forward (BigBird switches to full
    attention for short inputs, building new attention modules) has just run them
    unplanned: its output is refused, not returned.  Adapters added between forwards
    were planned (or refused) before this forward began, so a change seen here is one
    this forward made.  The tree is walked without settling: planning the new modules
    now would not mend the output they already computed."""
    watch = model._tpcompile_watch
    if not watch.changed:
        return
    found, todo = [], [("", model)]
    while todo:
        name, mod = todo.pop()
        if u := _unplanned(name, mod):
            found.append(u)
        todo += [(f"{name}.{k}" if name else k, c) for k, c in dict.items(mod._modules) if c is not None]
    if found:
        raise TPError(
            f"{listed(sorted(found), _SHOWN)} replaced or added during this forward by the model's own code, "
            "after tpcompile planned it: they ran on this rank's shards without the collectives and local sizes "
            "they need, so the output is refused. Put the model in the state its forward leaves it before "
            "transform / parallelize (BigBird: config.attention_type='original_full' for inputs this short)")
