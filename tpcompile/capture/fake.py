"""Shapes-only forwards: the model copied onto fake tensors and run as the capture runs it.

What only shapes decide needs no graph: which values cross a block boundary
(:mod:`tpcompile.analysis.boundaries`), and whether a module attribute reaches a shape
(:func:`shape_trace`, for the hard-coded sizes of :mod:`tpcompile.analysis.fixups`).  A
forward on fake tensors (no storage, every op's output shape computed by its meta rule)
costs a fifth of a ``torch.export`` trace of the same model, which records, functionalises
and checks a graph on top of it.

Example:
    >>> ops = shape_trace(model)                         # doctest: +SKIP
    >>> ops[0]
    ('aten.embedding.default', (2, 8, 64))
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

__all__ = ["as_if_exporting", "call_inputs", "fake_copy", "shape_trace"]


def fake_copy(model: nn.Module, mode: Any) -> nn.Module:
    """``model`` as fake tensors of ``mode`` (a DTensor's local shape): same modules and
    attributes, no storage."""
    memo: dict[int, Any] = {}
    with mode:
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            memo[id(p)] = nn.Parameter(torch.empty(local.shape, dtype=p.dtype), requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype)
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def as_if_exporting() -> Iterator[None]:
    """Model code takes the path it takes under ``torch.export`` (the capture's): code that
    asks ``torch.compiler.is_compiling()`` avoids kernels whose fake-tensor rules are
    stricter than their CPU ones (transformers' grouped-matmul experts, fp32 on CPU)."""
    original = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = original


def _shapes(value: Any) -> tuple:
    """The shapes of every tensor in ``value`` (a symbolic size as its name)."""
    return tuple(tuple(str(s) if isinstance(s, torch.SymInt) else s for s in t.shape)
                 for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor))


class _Record(TorchDispatchMode):
    """Every ATen op run under it, with the shapes it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops.append((str(func), _shapes(out)))
        return out


def _run_once(twin: nn.Module, kwargs: dict[str, Any], mode: Any, nonzero: Any) -> list[tuple[str, tuple]]:
    from .export import quiet_traces

    attempts = [dict(kwargs, use_cache=False), dict(kwargs)]  # as the capture: no cache where it has one
    for i, kw in enumerate(attempts):
        record = _Record()
        try:
            with quiet_traces(), mode, as_if_exporting(), nonzero, record, torch.no_grad():
                twin(**kw)
        except TypeError:  # the model takes no ``use_cache`` keyword
            if i:
                raise
            continue
        return record.ops
    raise AssertionError("unreachable")


def shape_trace(model: nn.Module, example_kwargs: dict[str, Any] | None = None) -> list[tuple[str, tuple]]:
    """The ATen ops one forward of ``model`` runs on fake tensors, in order, each with the
    shapes it returned: the capture's forward (stacks cut to their representatives, eval
    mode, no cache; a data-dependent loop over every position) without the graph.  Two
    traces differ where a shape does, not where only a constant does.  Raises what the
    forward raises."""
    return _fake_forward(model, example_kwargs)


def call_inputs(model: nn.Module, example_kwargs: dict[str, Any] | None = None
                ) -> dict[str, list[tuple[tuple, tuple, torch.dtype]]]:
    """Every module's tensor arguments at its first call in the capture's forward (as
    :func:`shape_trace` runs it), by module name: ``(path, shape, dtype)`` with paths as
    ``("kwargs", "position_bias")`` or ``("args", 0)``.  What the captured graph does not
    keep: which forward argument carries a value into a module."""
    from torch.utils._pytree import tree_flatten_with_path

    calls: dict[str, list[tuple[tuple, tuple, torch.dtype]]] = {}
    handles: list[Any] = []

    def record(name: str, mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if name in calls:
            return
        leaves, _ = tree_flatten_with_path({"args": args, "kwargs": kwargs})
        calls[name] = [(tuple(getattr(k, "key", getattr(k, "idx", None)) for k in kp),
                        tuple(str(s) if isinstance(s, torch.SymInt) else int(s) for s in t.shape), t.dtype)
                       for kp, t in leaves if isinstance(t, torch.Tensor)]

    def hook(twin: nn.Module) -> None:
        # each attempt records afresh: a failed one's calls (and hooks) are dropped
        for h in handles:
            h.remove()
        handles.clear()
        calls.clear()
        handles.extend(mod.register_forward_pre_hook(lambda m, a, k, _n=name: record(_n, m, a, k), with_kwargs=True)
                       for name, mod in twin.named_modules())

    _fake_forward(model, example_kwargs, hook)
    return calls


def _fake_forward(model: nn.Module, example_kwargs: dict[str, Any] | None,
                  on_twin: Callable[[nn.Module], None] | None = None) -> list[tuple[str, tuple]]:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from .branches import data_dependent, every_position_nonzero
    from .export import _find_stacks, _truncated
    from .inputs import _example_inputs

    kwargs = example_kwargs or _example_inputs(model)[1]
    with _truncated(model, _find_stacks(model)):
        mode = FakeTensorMode(shape_env=ShapeEnv())  # a data-dependent size becomes a symbol
        twin = fake_copy(model, mode).eval()
    with mode:
        fake = tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), dict(kwargs))

    def run(nonzero: Any) -> list[tuple[str, tuple]]:
        if on_twin is not None:
            on_twin(twin)
        return _run_once(twin, fake, mode, nonzero)

    try:
        return run(contextlib.nullcontext())
    except Exception as err:
        if not data_dependent(err):
            raise
    try:  # as the capture: every position of nonzero as Python ints, then as a tensor
        return run(every_position_nonzero(ints=True))
    except Exception:  # noqa: BLE001 - the tensor form below raises what is left
        pass
    return run(every_position_nonzero())
