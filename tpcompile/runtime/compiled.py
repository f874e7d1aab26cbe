"""Compiled blocks: ``parallelize(compile=...)`` runs each block's ``forward`` through
``torch.compile`` (regional compilation, as torchtitan does), with tpcompile's hooks and
collectives traced into the block's graph.

What is compiled is the block's own ``forward``: the modules inside it (projections,
norms, experts) are inlined with their hooks, so TP's parameter swaps, the
``copy_to_tp`` / all-reduce autograd functions, sequence parallelism's gathers and
scatters and the experts' all-to-all are part of one graph per block class. The hooks on
the block itself (activation checkpointing, FSDP2's all-gathers) stay eager, outside the
graph, where they nest as they do without compile.

Three rules keep the compiled block computing what the eager one computes, and one graph
serving every block of a class:

* **the first call of each block also runs eagerly, as a probe**, with grad on, its
  saved tensors kept out of any checkpoint and the RNG state put back after it: it
  teaches the hooks what traced code cannot see (which column-module arguments are
  parameters seen through views, :class:`~tpcompile.runtime.torch_backend._EnterHooks`);
* **hook keys are positions, not ids**: dynamo guards a module's hook tables by key, and
  global hook ids differ per block, so every module inside a block gets its hooks
  re-keyed ``-1, -2, ...`` in order (a ``RemovableHandle`` taken before can no longer
  remove them);
* **the KV cache never enters a graph**: a call with a cache and no grad (``generate``)
  runs eagerly; with grad the cache is dropped (``use_cache=False``, warned once), as
  Hugging Face does under gradient checkpointing.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import TPError
from .activations import CACHE_KWARGS

__all__ = ["CompiledBlocks", "compile_blocks"]

_HOOK_TABLES = (("_forward_pre_hooks", ("_forward_pre_hooks_with_kwargs",)),
                ("_forward_hooks", ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")))


@dataclass
class CompiledBlocks:
    """What ``parallelize(compile=...)`` compiled, as ``model.tpcompile_compiled``.

    ``eager_calls`` counts the block calls that ran eagerly after the probe (``generate``
    with a KV cache); ``graph_breaks`` and ``graphs`` what dynamo reported while compiling
    these blocks (0 breaks and one graph per block class is the goal)."""

    options: dict[str, Any]
    blocks: list[str]
    probed: set[str] = field(default_factory=set)
    eager_calls: int = 0
    graph_breaks: int = 0
    graphs: int = 0
    warned: bool = False


def compile_blocks(model: nn.Module, blocks: list[str], options: dict[str, Any],
                   entry: Callable[[], None] | None = None) -> CompiledBlocks:
    """Compile each block's ``forward`` with ``torch.compile(**options)``.

    ``entry`` runs before every compiled call (the backend forgets the last input that
    entered the TP region, so the graph reads nothing an earlier block left behind).

    Example:
        >>> state = compile_blocks(model, list(model.tpcompile_plan.blocks), {"backend": "inductor"})  # doctest: +SKIP
        >>> model(ids, labels=ids).loss.backward(); state.graph_breaks
        0
    """
    modules = dict(model.named_modules())
    state = CompiledBlocks(options=dict(options), blocks=list(blocks))
    compiled: dict[type, Callable[..., Any]] = {}  # one compiled function per block class
    for name in blocks:
        block = modules[name]
        if "forward" in block.__dict__:
            raise TPError(f"{name} ({type(block).__name__}) has its own forward attribute (set by another "
                          "library's wrapper, e.g. accelerate's hooks); compile=... compiles the class's "
                          "forward: remove the wrapper or parallelize without compile")
        cls = type(block)
        if cls not in compiled:
            compiled[cls] = torch.compile(cls.forward, fullgraph=False, **options)
        block.forward = _BlockForward(name, block, compiled[cls], state, entry)
    return state


class _BlockForward:
    """A block's forward: the eager probe at the first call, then the compiled graph."""

    def __init__(self, name: str, block: nn.Module, compiled: Callable[..., Any], state: CompiledBlocks,
                 entry: Callable[[], None] | None) -> None:
        self.name, self.compiled, self.state, self.entry = name, compiled, state, entry
        self.eager = type(block).forward.__get__(block)
        # the block's instance attribute ``forward`` must not hold the block itself
        self.block = _WeakModule(block)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        block, state = self.block.get(), self.state
        if any(kwargs.get(k) is not None for k in CACHE_KWARGS):
            if not torch.is_grad_enabled():  # generate: the cache grows every call
                state.eager_calls += 1
                return self.eager(*args, **kwargs)
            kwargs = _drop_cache(kwargs, state)
        if self.name not in state.probed:
            _key_hooks_by_position(block)
            _probe(self.eager, args, kwargs)
            state.probed.add(self.name)
        if self.entry is not None:
            self.entry()
        before = _dynamo_counts()
        out = self.compiled(block, *args, **kwargs)
        after = _dynamo_counts()
        state.graph_breaks += after[0] - before[0]
        state.graphs += after[1] - before[1]
        return out


class _WeakModule:
    def __init__(self, module: nn.Module) -> None:
        self.ref = weakref.ref(module)

    def get(self) -> nn.Module:
        module = self.ref()
        if module is None:
            raise RuntimeError("the compiled block was freed")
        return module


def _drop_cache(kwargs: dict[str, Any], state: CompiledBlocks) -> dict[str, Any]:
    dropped = {k: None for k in CACHE_KWARGS if kwargs.get(k) is not None}
    if "use_cache" in kwargs:
        dropped["use_cache"] = False
    if not state.warned:
        state.warned = True
        warnings.warn("compiled blocks: the KV cache is not used while recording grad (use_cache=False), as "
                      "under Hugging Face's gradient checkpointing; generate() and no-grad calls keep it",
                      stacklevel=3)
    return {**kwargs, **dropped}


def _probe(forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> None:
    """Run ``forward`` once eagerly for what its hooks learn, leaving nothing behind: grad
    on (parameter views show as autograd nodes), saved tensors kept here (not in an
    enclosing checkpoint's or offloader's records) and the RNG state restored."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            forward(*args, **kwargs)
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _key_hooks_by_position(block: nn.Module) -> None:
    """Re-key the hooks of every module inside ``block`` by position (``-1, -2, ...``), in
    their order: the same keys in every block, so one graph's guards hold for all."""
    for mod in block.modules():
        if mod is block:  # the block's own hooks run eagerly, outside the graph
            continue
        for table, flags in _HOOK_TABLES:
            hooks = getattr(mod, table)
            if not hooks or all(k < 0 for k in hooks):
                continue
            new = {old: -(i + 1) for i, old in enumerate(hooks)}
            items = list(hooks.items())
            hooks.clear()
            hooks.update((new[k], h) for k, h in items)
            for flag in flags:
                marks = getattr(mod, flag)
                kept = {new[k]: v for k, v in marks.items() if k in new}
                marks.clear()
                marks.update(kept)


def _dynamo_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]
