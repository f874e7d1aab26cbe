"""Old module paths, kept importable for one release with a ``DeprecationWarning``.

The code moved into stage packages (capture / analysis / plan / runtime / checkpoint /
integrations / tools).  ``import tpcompile.fsdp`` still works: it yields a stand-in module
whose attributes are looked up in the new homes listed below, in order.  No file is left
at the old path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
import warnings
from typing import Any

__all__ = ["MOVED", "install"]

# old module -> the modules that now hold its names (first hit wins)
MOVED: dict[str, tuple[str, ...]] = {
    "tpcompile.fsdp": ("tpcompile.api", "tpcompile.runtime.mesh", "tpcompile.runtime.fsdp",
                       "tpcompile.runtime.materialize"),
    "tpcompile.rewrite": ("tpcompile.plan.build", "tpcompile.runtime.apply", "tpcompile.analysis.fixups"),
    "tpcompile.translate": ("tpcompile.plan.table",),
    "tpcompile.inputs": ("tpcompile.capture.inputs",),
    "tpcompile.sequence": ("tpcompile.plan.sequence",),
    "tpcompile.comm": ("tpcompile.runtime.comm",),
    "tpcompile.loss": ("tpcompile.runtime.loss",),
    "tpcompile.loss_patch": ("tpcompile.runtime.loss",),
    "tpcompile.activations": ("tpcompile.runtime.activations",),
    "tpcompile.state_dict": ("tpcompile.runtime.state_dict",),
    "tpcompile.expert_parallel": ("tpcompile.runtime.experts", "tpcompile.runtime.mesh"),
    "tpcompile.backends": ("tpcompile.runtime.backend",),
    "tpcompile.backends.torch_backend": ("tpcompile.runtime.torch_backend",),
    "tpcompile.backends.te_backend": ("tpcompile.runtime.te_backend",),
    "tpcompile.backends.collectives": ("tpcompile.plan.modules",),
    "tpcompile.backends.sequence_parallel": ("tpcompile.runtime.sequence",),
    "tpcompile.analysis.experts": ("tpcompile.plan.experts",),
    "tpcompile.checkpoint.convert": ("tpcompile.checkpoint.translate",),
    "tpcompile.checkpoint.shards": ("tpcompile.runtime.shards",),
    **{f"tpcompile.{name}": (f"tpcompile.tools.{name}",)
       for name in ("cli", "cost", "demo", "launch", "presets", "shrink", "verify")},
}


class _MovedModule(types.ModuleType):
    """A stand-in for an old path: attribute lookups go to the new homes."""

    def __init__(self, name: str, homes: tuple[str, ...]) -> None:
        super().__init__(name, f"Moved: {name} is now {', '.join(homes)}.")
        self.__path__: list[str] = []  # so old sub-paths (tpcompile.backends.x) import too
        self._homes = homes

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        for home in self._homes:
            module = importlib.import_module(home)
            if hasattr(module, attr):
                return getattr(module, attr)
        raise AttributeError(f"{self.__name__}.{attr} does not exist any more (the module moved to "
                             f"{', '.join(self._homes)})")

    def __dir__(self) -> list[str]:
        return sorted({n for home in self._homes for n in dir(importlib.import_module(home))})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return _MovedModule(spec.name, MOVED[spec.name])

    def exec_module(self, module: types.ModuleType) -> None:
        homes = MOVED[module.__name__]
        warnings.warn(f"{module.__name__} is deprecated and will be removed in the next release; "
                      f"import from {homes[0]} (or the public tpcompile namespace) instead",
                      DeprecationWarning, stacklevel=2)


def install() -> None:
    """Put the old paths' finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.append(_Finder())
