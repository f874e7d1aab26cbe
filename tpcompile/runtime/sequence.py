"""Sequence parallelism at run time: the splits and gathers a plan's ``sequence`` section
asks for, hooked around the model's own modules (the plan: :mod:`tpcompile.plan.sequence`).

* the stream is split (padded to a multiple of ``tp`` with copies of the last token)
  entering a stack's first block and all-gathered leaving its last;
* a region gathers its token-carrying arguments on entry and splits its token-carrying
  outputs on exit; where the plan allows, the pair is Megatron's
  (:func:`~tpcompile.runtime.comm.enter_tp` / :func:`~tpcompile.runtime.comm.leave_tp`): the same
  traffic as plain tensor parallelism;
* parameters applied to token slices get their gradient summed over the group;
* calls asking for intermediate hidden states run whole; a stack split but never
  gathered (LayerDrop) raises;
* a block's training forward draws its dropout masks over the rank's tokens whole, the
  rows of its tokens kept (:func:`token_masks`), so they are one process's masks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..plan.modules import WholeMasks
from ..plan.sequence_types import Path, RegionPlan, SequencePlan, StackPlan, TokenSlot
from . import comm
from .masks import WholeMaskMode, may_drop

__all__ = ["gather_tokens", "install_sequence_parallel", "pad_tokens", "split_tokens", "token_masks"]

def pad_tokens(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``x`` padded along ``dim`` to a multiple of ``n`` with copies of the last token
    (finite wherever real tokens are; gradients of the copies are zero because every
    gather drops them)."""
    short = -x.shape[dim] % n
    if not short:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*[short if d == dim else -1 for d in range(x.dim())])], dim)


def split_tokens(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (padded to a multiple of the group size)."""
    return comm.scatter_to_tp(pad_tokens(x, comm.group_size(group), dim), group, dim)


def gather_tokens(x: torch.Tensor, group: Any, dim: int, length: int) -> torch.Tensor:
    """All tokens of a split value (the padding dropped)."""
    return _unpad(comm.gather_from_tp(x, group, dim), dim, length)


def _unpad(full: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """The first ``length`` tokens, contiguous: model code ``.view()``s its inputs, as it
    may with the unsplit tensor."""
    return full.narrow(dim, 0, length).contiguous() if full.shape[dim] != length else full


# ---------------------------------------------------------------- hooks


def _get(obj: Any, path: Path) -> Any:
    for key in path:
        if isinstance(obj, dict):
            obj = obj.get(key)
        elif isinstance(obj, list | tuple) and isinstance(key, int) and key < len(obj):
            obj = obj[key]
        else:
            return None
    return obj


def _set(obj: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(obj, dict):
        return {**obj, key: _set(obj[key], rest, value)}
    items = list(obj)
    items[key] = _set(items[key], rest, value)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*items)
    return type(obj)(items) if isinstance(obj, tuple | list) else items


def _map_call(args: tuple, kwargs: dict, path: Path, dim: int, fn: Any) -> tuple[tuple, dict]:
    call = {"args": args, "kwargs": kwargs}
    x = _get(call, path)
    if isinstance(x, torch.Tensor):
        call = _set(call, path, fn(x, dim))
    return call["args"], call["kwargs"]


def _map_out(out: Any, path: Path, dim: int, fn: Any) -> Any:
    x = _get(out, path)
    return _set(out, path, fn(x, dim)) if isinstance(x, torch.Tensor) else out


@dataclasses.dataclass
class _Stream:
    """One forward's state of one stack: on or off, and the true token count."""

    on: bool = False
    length: int = 0
    left: int = 0  # row outputs that left the current region already split
    open: bool = False  # split by the first block, not yet gathered by the last
    shape: torch.Size | None = None  # the whole stream's shape, where a forward records grad
    masks: WholeMasks | None = None  # its dropout masks, built at the first draw of a forward


def token_masks(shape: torch.Size, dim: int, tp: int) -> WholeMasks:
    """Dropout masks over a split stream of whole ``shape`` (``dim``: its tokens) drawn at
    that shape: rank ``r`` keeps its ``ceil(S / tp)`` tokens' rows, a padding token the
    last token's row (its values are the last token's copies, dropped at the gather).

    Example:
        >>> token_masks(torch.Size([2, 5, 8]), 1, 2).sites[0][3]
        ((0, 1, 2), (3, 4, 4))
    """
    length = shape[dim]
    chunk = -(-length // tp)
    index = tuple(tuple(min(i, length - 1) for i in range(r * chunk, (r + 1) * chunk)) for r in range(tp))
    fixed = tuple((d, int(n)) for d, n in enumerate(shape) if d != dim)
    return WholeMasks(sites=((len(shape), dim, length, index, fixed),))


def install_sequence_parallel(model: nn.Module, seq: SequencePlan | dict[str, Any], backend: Any) -> None:
    """Hook the splits and gathers of ``seq`` (:func:`plan_sequence`; its JSON form is
    read too) onto ``model``.

    Where the plan allows, a region's input enters with :func:`~tpcompile.runtime.comm.enter_tp`
    (its backward reduce-scatter replaces the columns' all-reduce) and a row module's
    partial sum leaves with :func:`~tpcompile.runtime.comm.leave_tp` (a reduce-scatter instead
    of an all-reduce and a split): the same traffic as plain TP."""
    if isinstance(seq, dict):
        seq = SequencePlan.from_dict(seq)
    group = backend.group
    fused = hasattr(backend, "mark_entered") and hasattr(backend, "leave_with")
    mods = dict(model.named_modules())
    streams = {stack: _Stream() for stack in seq.stacks}
    wanted = {"on": True, "depth": 0}
    _watch_outputs_asked(model, [s.rpartition(".")[0] for s in seq.stacks], wanted)
    _guard_open_streams(model, streams)
    # a pipeline stage holds some modules only: the others' hooks run on the ranks holding them
    run = getattr(model, "tpcompile_pipeline", None)
    for stack, spec in seq.stacks.items():
        _hook_stack(mods.get(spec.first), mods.get(spec.last), spec, streams[stack], wanted, group, run)
        for block in _blocks(mods, stack, spec):
            _hook_masks(block, streams[stack], spec.stream.dim, group)
    for name, gs in seq.grad_sum.items():
        if name in mods:
            _sum_grads(mods[name], gs.params, streams[gs.stack], group)
    for name, region in seq.regions.items():
        if name not in mods:
            continue
        st = streams[region.stack]
        for out in region.split:
            if out.row and fused:
                backend.leave_with(mods[out.row], _leaver(st, group, out.dim))
        _hook_region(mods[name], region, st, backend if fused else None, group)


def _watch_outputs_asked(model: nn.Module, stacks: list[str], wanted: dict) -> None:
    """Calls that ask for intermediate hidden states would get slices of them: such
    calls run whole. Watched on the model and every module above a stack, whichever
    the user calls: the outermost call decides, an inner one can only switch off."""
    mods = dict(model.named_modules())
    owners = {""} | {".".join(s.split(".")[:i]) for s in stacks for i in range(1, len(s.split(".")) + 1)}

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        asks = kwargs.get("output_hidden_states")
        if wanted["depth"] == 0:
            if asks is None:
                asks = getattr(getattr(mod, "config", None), "output_hidden_states", False)
            wanted["on"] = not asks
        elif asks:
            wanted["on"] = False
        wanted["depth"] += 1

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        wanted["depth"] -= 1

    for name in owners:
        mod = mods.get(name)
        if mod is not None and not isinstance(mod, nn.ModuleList | nn.ModuleDict):
            mod.register_forward_pre_hook(pre, with_kwargs=True)
            mod.register_forward_hook(post, with_kwargs=True, always_call=True)


def _guard_open_streams(model: nn.Module, streams: dict[str, _Stream]) -> None:
    """A stack split at its first block but never gathered (its last block skipped:
    LayerDrop) would hand token slices to the model's head: refuse loudly."""
    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        for stack, st in streams.items():
            if st.open:
                st.open = False
                raise RuntimeError(f"sequence parallelism: {stack} was split but its last block did not run "
                                   "(LayerDrop?); transform without sequence_parallel for such training")

    model.register_forward_hook(post)


def _hook_stack(first: nn.Module | None, last: nn.Module | None, spec: StackPlan, st: _Stream, wanted: dict,
                group: Any, run: Any = None) -> None:
    """Split the stream entering the stack's first block, gather it leaving the last.
    Under pipeline parallelism the split stream crosses stages as it is: a stage entered
    mid-stack opens it (the received state is split already) and the state is sent split."""
    path, dim = spec.stream.path, spec.stream.dim
    output: TokenSlot = spec.output

    def open_stream(args: tuple, kwargs: dict) -> bool:
        x = _get({"args": args, "kwargs": kwargs}, path)
        st.on = wanted["on"] and isinstance(x, torch.Tensor) and x.dim() > dim
        if st.on:
            st.length, st.open = x.shape[dim], True
            st.shape, st.masks = (x.shape if torch.is_grad_enabled() else None), None
        return st.on

    def first_pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not open_stream(args, kwargs):
            return args, kwargs
        return _map_call(args, kwargs, path, dim, lambda t, d: split_tokens(t, group, d))

    def last_post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        # ``st`` stays as this forward left it (the next forward's first block resets
        # it): activation checkpointing re-runs the regions' hooks in backward
        if not st.on:
            return out
        st.open = False
        return _map_out(out, output.path, output.dim, lambda t, d: gather_tokens(t, group, d, st.length))

    if run is not None and spec.first.startswith(run.plan.stack + "."):
        run.on_enter.append(open_stream)  # the stand-in's full-length state sets the length
        run.splits.append((dim, comm.group_size(group)))
    if first is not None:
        first.register_forward_pre_hook(first_pre, with_kwargs=True, prepend=True)
    if last is not None:
        last.register_forward_hook(last_post, with_kwargs=True)


def _blocks(mods: dict[str, nn.Module], stack: str, spec: StackPlan) -> list[nn.Module]:
    """The blocks of ``stack`` from its first to its last (those this rank holds)."""
    first, last = (int(name.rpartition(".")[2]) for name in (spec.first, spec.last))
    return [mods[f"{stack}.{i}"] for i in range(first, last + 1) if f"{stack}.{i}" in mods]


def _hook_masks(block: nn.Module, st: _Stream, dim: int, group: Any) -> None:
    """While the stream is split, the training forward of each dropout module under
    ``block`` draws the stream's masks whole (:mod:`tpcompile.runtime.masks`); regions,
    whose tokens are whole, draw their own.  The dropout modules are hooked, not the
    block: transformers' gradient checkpointing recomputes a block's ``forward`` without
    its hooks, and a recomputed mask drawn otherwise than in the forward would give
    wrong gradients (a functional dropout in a block's own code draws its rows' mask,
    in the forward and its recomputation alike).  The masks' rows (a tuple per rank, as
    long as the stream) are built at a forward's first draw: a forward without dropout
    pays nothing."""
    rank, tp = dist.get_rank(group), comm.group_size(group)

    def pre(mod: nn.Module, args: tuple) -> None:
        if not torch.compiler.is_compiling() and st.on and st.shape is not None and mod.training \
                and may_drop(mod):
            if st.masks is None:
                st.masks = token_masks(st.shape, dim, tp)
            mode = WholeMaskMode(st.masks, rank)
            mode.__enter__()
            mod.__dict__["_tpcompile_token_masks"] = mode

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        if torch.compiler.is_compiling():
            return
        mode = mod.__dict__.pop("_tpcompile_token_masks", None)
        if mode is not None:
            mode.__exit__(None, None, None)

    for drop in block.modules():
        if isinstance(drop, nn.modules.dropout._DropoutNd):
            drop.register_forward_pre_hook(pre)
            drop.register_forward_hook(post, always_call=True)


def _leaver(st: _Stream, group: Any, dim: int) -> Any:
    """A row module's exit while the stream is split: pad, then reduce-scatter."""
    def leave(t: torch.Tensor) -> torch.Tensor | None:
        if not st.on:
            return None
        st.left += 1
        return comm.leave_tp(pad_tokens(t, comm.group_size(group), dim), group, dim)
    return leave


def _hook_region(module: nn.Module, spec: RegionPlan, st: _Stream, backend: Any, group: Any) -> None:
    def enter(t: torch.Tensor, dim: int, fuse: bool) -> torch.Tensor:
        n = comm.group_size(group)
        if t.shape[dim] * n != st.length + (-st.length % n):
            raise RuntimeError(f"sequence parallelism: a region got {t.shape[dim]} tokens, expected this "
                               f"rank's {(st.length + n - 1) // n} of {st.length} (was the stack's first "
                               "block skipped, LayerDrop?)")
        if not (fuse and backend is not None):
            return gather_tokens(t, group, dim, st.length)
        full = _unpad(comm.enter_tp(t, group, dim), dim, st.length)
        backend.mark_entered(full)  # the columns take it as it is: no second all-reduce
        return full

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        st.left = 0
        if not st.on:
            return args, kwargs
        for g in spec.gather:
            args, kwargs = _map_call(args, kwargs, g.path, g.dim, lambda t, d, f=g.fused: enter(t, d, f))
        return args, kwargs

    # whether each split output left through its row module already: booleans, not the
    # row's name, so that a compiled block reads the same values in every block
    left_split = [bool(s.row) and backend is not None for s in spec.split]

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if not st.on:
            return out
        for s, left in zip(spec.split, left_split, strict=True):
            if left:
                if not st.left:  # the plan proved the row output is the region's output
                    raise RuntimeError(f"sequence parallelism: {s.row} did not leave its region split")
                continue
            out = _map_out(out, s.path, s.dim, lambda t, d: split_tokens(t, group, d))
        return out

    # prepend: the tokens are whole before the TP hooks (copy_to_tp) see them
    module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    module.register_forward_hook(post, with_kwargs=True)


def _sum_grads(module: nn.Module, names: list[str], st: _Stream, group: Any) -> None:
    """While the stream is split, ``module``'s parameters ``names`` are used through
    ``all_reduce_grad``: their gradient sums every rank's tokens."""
    mine: dict[str, Any] = {}

    def pre(mod: nn.Module, args: tuple) -> None:
        if not st.on:
            return
        for name in names:
            # whatever is there (the parameter, or the backend's local tensor for it) goes
            # back in ``post``, which runs before the backend's own restore: swaps undone
            # in reverse order. (Deciding by the value's type instead failed compiled:
            # dynamo's ``type()`` of a DTensor's local tensor says Parameter, and the step's
            # autograd output stayed in place of the parameter.)
            p = mine[name] = mod._parameters[name]
            local = p.to_local() if isinstance(p, DTensor) else p
            mod._parameters[name] = comm.all_reduce_grad(local, group)

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        while mine:
            name, p = mine.popitem()
            mod._parameters[name] = p

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post, always_call=True, prepend=True)
