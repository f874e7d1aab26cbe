"""Activation checkpointing and activation offloading per transformer block.

Both are applied from outside with module hooks, so parameter and module FQNs never
change (no ``_checkpoint_wrapped_module`` in names) and they compose with tpcompile's
tensor-parallel hooks and with FSDP2. The order is torchtitan's::

    tpcompile.transform(model, tp=...)          # 1. TP: DTensor params, collective hooks
    checkpoint_blocks(model, blocks)            # 2. activation checkpointing
    offload_activations(model, blocks)          # 3. offload what the blocks still save
    for b in blocks: fully_shard(get(b), ...)   # 4. FSDP2, outermost

Per block the hooks nest, outermost first: FSDP2 (it prepends its pre-hook), offload,
checkpoint, hooks the block already had (TP), ``forward``. The recompute re-enters the
block through ``__call__``, so it re-runs exactly the hooks inside the checkpoint,
including TP's collectives, in the same order on every rank.
"""

from __future__ import annotations

import difflib
import itertools
import warnings
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed._composable import checkpoint as _composable_checkpoint
from torch.distributed.tensor import DTensor

from ..errors import TPError

__all__ = ["CACHE_KWARGS", "OffloadHandle", "OffloadStats", "checkpoint_blocks", "offload_activations"]

# Saved tensors smaller than this stay on the device: copying them costs more than it frees.
DEFAULT_MIN_BYTES = 1 << 10
_ORDER_LOG = 1024
# Cache arguments a recompute would append to a second time (names differ per family).
CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
# Our hook ids per block and kind, so the kinds can be re-nested whatever order they came in.
_NESTING: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[list[int], list[int]]]]
_NESTING = weakref.WeakKeyDictionary()


def _resolve_blocks(model: nn.Module, blocks: Iterable[str], kind: str) -> list[tuple[str, nn.Module]]:
    """``[(fqn, module)]`` for ``blocks``; a clear TPError for unknown, nested or repeated use."""
    if isinstance(blocks, str):
        raise TPError(f"blocks must be a list of module FQNs, got the string {blocks!r}; pass [{blocks!r}]")
    modules = dict(model.named_modules())
    names = list(dict.fromkeys(blocks))
    for fqn in names:
        if fqn not in modules:
            cands = _candidate_blocks(model, modules)
            close = difflib.get_close_matches(fqn, cands or list(modules), n=3)
            hint = f"; did you mean {close}?" if close else ""
            shown = cands[:8] + (["..."] if len(cands) > 8 else [])
            raise TPError(f"unknown block {fqn!r}: no module has that FQN{hint} Block candidates: {shown}")
        if kind in _NESTING.get(modules[fqn], {}):
            raise TPError(f"block {fqn!r} already has {kind} applied; remove it first or pass each block once")
    for outer, inner in itertools.permutations(names, 2):
        if inner.startswith(outer + ".") or outer == "":
            raise TPError(f"blocks {outer!r} and {inner!r} are nested; pass the outer or the inner ones, not both")
    return [(fqn, modules[fqn]) for fqn in names]


def _candidate_blocks(model: nn.Module, modules: dict[str, nn.Module]) -> list[str]:
    plan = getattr(model, "tpcompile_plan", None)
    if plan is not None and plan.blocks:
        return list(plan.blocks)
    # without a plan: the members of every ModuleList, which is where HF keeps its layers
    return [f"{name}.{i}" if name else str(i)
            for name, mod in modules.items() if isinstance(mod, nn.ModuleList) for i in range(len(mod))]


def _register(block: nn.Module, kind: str, pre: list[int], post: list[int]) -> None:
    _NESTING.setdefault(block, {})[kind] = (pre, post)
    _renest(block)


def _renest(block: nn.Module) -> None:
    """Move our hooks outside the block's other hooks: offload outermost, then checkpoint.

    Hooks the block already had (TP on a block owning parameters) then run inside the
    checkpoint, so the recompute repeats them once, with the same arguments. Offload's
    ``saved_tensors_hooks`` are entered first so the checkpoint's sit on top of them: the
    checkpoint then saves only its inputs, through offload's hooks.
    """
    kinds = _NESTING.get(block, {})
    for kind in ("checkpoint", "offload"):  # inner kind first: the last one moved ends outermost
        pre, post = kinds.get(kind, ([], []))
        for key in reversed(pre):
            if key in block._forward_pre_hooks:
                block._forward_pre_hooks.move_to_end(key, last=False)
        for key in post:
            if key in block._forward_hooks:
                block._forward_hooks.move_to_end(key)


# --------------------------------------------------------------------------- checkpointing


def checkpoint_blocks(model: nn.Module, blocks: list[str]) -> None:
    """Recompute each block's activations in backward instead of keeping them.

    Uses the composable ``torch.distributed._composable.checkpoint`` (non-reentrant,
    hook based): FQNs are unchanged, so state dicts, optimizers and FSDP2 see the same
    names. Apply after :func:`tpcompile.transform` and before ``fully_shard``.

    Recompute runs to the end of the block (``early_stop=False``) so every TP hook that
    swapped in local weights also restores them. While grad is recorded, KV-cache
    arguments are dropped (with a warning), as in Hugging Face's gradient checkpointing:
    the recompute would append to the cache a second time.

    Args:
        model: the (possibly tensor-parallel) model.
        blocks: FQNs of the blocks to checkpoint, e.g. ``model.tpcompile_plan.blocks``.

    Example:
        >>> model = tpcompile.transform(model, tp=2)                   # doctest: +SKIP
        >>> checkpoint_blocks(model, ["model.layers.0", "model.layers.1"])
        >>> model(ids, labels=ids).loss.backward()   # layers recomputed in backward
    """
    for _, block in _resolve_blocks(model, blocks, "checkpoint"):
        before = set(block._forward_pre_hooks), set(block._forward_hooks)
        strip = block.register_forward_pre_hook(_drop_cache_while_recording, with_kwargs=True)
        _composable_checkpoint(block, early_stop=False)
        ac_pre = [k for k in block._forward_pre_hooks if k not in before[0] and k != strip.id]
        ac_post = [k for k in block._forward_hooks if k not in before[1]]
        _register(block, "checkpoint", [strip.id, *ac_pre], ac_post)


def _drop_cache_while_recording(block: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    if not torch.is_grad_enabled() or getattr(block, "_can_checkpoint_with_cache", False):
        return None  # nothing is saved, so nothing is recomputed: the cache is safe
    dropped = {k: None for k in CACHE_KWARGS if kwargs.get(k) is not None}
    if kwargs.get("use_cache"):
        dropped["use_cache"] = False
    if not dropped:
        return None
    warnings.warn(f"checkpointed {type(block).__name__}: KV cache disabled while recording grad "
                  f"({sorted(dropped)}); the recompute would update it twice", stacklevel=1)
    return args, {**kwargs, **dropped}


# --------------------------------------------------------------------------- offloading


@dataclass(slots=True)
class OffloadStats:
    """Counters of an :func:`offload_activations` handle (cumulative; ``reset()`` clears)."""

    offloaded_tensors: int = 0   # host copies made
    offloaded_bytes: int = 0     # bytes moved to host memory
    deduplicated: int = 0        # saves served by an existing copy (q/k/v share their input)
    kept_tensors: int = 0        # saved activations left on the device (small, subclasses)
    kept_bytes: int = 0
    parameter_saves: int = 0     # saves of parameters / their local views: never offloaded
    prefetches: int = 0          # blocks whose loads were started ahead of use
    demand_loads: int = 0        # blocks loaded when first needed (the first block of backward)
    max_resident_blocks: int = 0  # most blocks with device copies at once, during backward
    # the blocks prefetched, in order (the last _ORDER_LOG of them: bounded over training)
    prefetch_order: deque[str] = field(default_factory=lambda: deque(maxlen=_ORDER_LOG))

    def reset(self) -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, deque(maxlen=_ORDER_LOG) if f == "prefetch_order" else 0)


@dataclass(slots=True, eq=False)
class _Record:
    """One offloaded tensor: its host copy and, while resident, its copy back on device."""

    host: torch.Tensor
    device: torch.device
    loaded: torch.Tensor | None = None
    ready: Any = None  # CUDA event: the host-to-device copy is done


class _Group:
    """The saved tensors of one forward call of one block, in forward order by ``seq``."""

    __slots__ = ("__weakref__", "fqn", "seq", "records", "originals", "params",
                 "handles", "pending", "started", "resident")

    def __init__(self, fqn: str, seq: int, params: set[int]) -> None:
        self.fqn, self.seq, self.params = fqn, seq, params
        self.records: list[_Record] = []
        # dedup table for this forward: key -> (original, record). Holding the original
        # until the block's forward ends means its address cannot be reused by another
        # tensor meanwhile, so an equal key really is the same data.
        self.originals: dict[tuple, tuple[torch.Tensor, _Record]] = {}
        self.handles = self.pending = 0
        self.started = self.resident = False


@dataclass(slots=True, eq=False)
class _Packed:  # what autograd holds per save: an offloaded record, or the tensor kept as is
    group: _Group
    record: _Record | None = None
    tensor: torch.Tensor | None = None


class _Offloader:
    """Pack/unpack hooks, host copies and the backward prefetch window."""

    def __init__(self, horizon: int, host: torch.device, min_bytes: int) -> None:
        self.horizon, self.host, self.min_bytes = horizon, host, min_bytes
        self.stats = OffloadStats()
        self.groups: list[weakref.ref[_Group]] = []  # weak: a graph's groups die with it
        self._seq = itertools.count()
        self._streams: dict[torch.device, Any] = {}

    # ---- forward ------------------------------------------------------------------
    def enter(self, fqn: str, block: nn.Module) -> tuple[Any, _Group] | None:
        # A block run inside backward is a checkpoint recompute: its saves must reach the
        # checkpoint's own hooks, not ours.
        if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
            return None
        params = {_storage_ptr(t) for t in itertools.chain(block.parameters(), block.buffers())}
        group = _Group(fqn, next(self._seq), params)
        self.groups = [g for g in self.groups if g() is not None]
        self.groups.append(weakref.ref(group))
        ctx = torch.autograd.graph.saved_tensors_hooks(partial(self.pack, group), self.unpack)
        ctx.__enter__()
        return ctx, group

    def pack(self, group: _Group, t: torch.Tensor) -> _Packed:
        group.handles += 1
        group.pending += 1
        nbytes = t.numel() * t.element_size()
        if isinstance(t, nn.Parameter) or _storage_ptr(t) in group.params:
            # a parameter, or a view of one: TP's to_local() weight, FSDP2's unsharded one
            self.stats.parameter_saves += 1
            return _Packed(group, tensor=t)
        if type(t) is not torch.Tensor or t.layout != torch.strided or nbytes < self.min_bytes:
            # tiny tensors, and subclasses (DTensor activations) we cannot copy field by field
            self.stats.kept_tensors += 1
            self.stats.kept_bytes += nbytes
            return _Packed(group, tensor=t)
        key = (_storage_ptr(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t._version)
        hit = group.originals.get(key)
        if hit is not None:
            self.stats.deduplicated += 1
            return _Packed(group, hit[1])
        record = _Record(self._to_host(t.detach()), t.device)
        group.records.append(record)
        group.originals[key] = (t, record)
        self.stats.offloaded_tensors += 1
        self.stats.offloaded_bytes += nbytes
        return _Packed(group, record)

    def _to_host(self, src: torch.Tensor) -> torch.Tensor:
        if src.device.type != "cuda":
            # CPU compute: a real, separate copy, so the whole mechanism runs everywhere
            return torch.empty_like(src, device=self.host).copy_(src)
        host = torch.empty_like(src, device=self.host, pin_memory=True)
        stream = self._stream(src.device)
        stream.wait_stream(torch.cuda.current_stream(src.device))  # src is fully written
        with torch.cuda.stream(stream):
            host.copy_(src, non_blocking=True)
        src.record_stream(stream)  # the compute stream may free src before the copy ran
        return host

    # ---- backward -----------------------------------------------------------------
    def unpack(self, packed: _Packed) -> torch.Tensor:
        group = packed.group
        if not group.started:
            self._start(group)
        group.pending -= 1
        out = packed.tensor if packed.record is None else self._fetch(packed.record)
        if group.pending == 0:  # every save of this forward consumed: drop our device copies
            self._release(group)
            group.started, group.pending = False, group.handles  # ready for a retain_graph rerun
        return out

    def _start(self, group: _Group) -> None:
        """Backward reached ``group``: load it, prefetch the next ``horizon`` blocks."""
        group.started = True
        live = sorted((g for r in self.groups if (g := r()) is not None), key=lambda g: g.seq)
        for g in live:
            if g.seq > group.seq and g.resident:  # backward is past these blocks
                self._release(g)
        if not group.resident:
            self.stats.demand_loads += 1
            self._load(group)
        # the blocks backward reaches next, in backward order: seq - 1, ..., seq - horizon
        for g in reversed([g for g in live if g.seq < group.seq][-self.horizon:]):
            if not g.resident:
                self._load(g)
                self.stats.prefetches += 1
                self.stats.prefetch_order.append(g.fqn)
        resident = sum(g.resident for g in live)
        self.stats.max_resident_blocks = max(self.stats.max_resident_blocks, resident)

    def _load(self, group: _Group) -> None:
        for r in (r for r in group.records if r.loaded is None):
            self._load_record(r)
        group.resident = True

    def _load_record(self, r: _Record) -> None:
        if r.device.type != "cuda":
            r.loaded = torch.empty_like(r.host, device=r.device).copy_(r.host)
            return
        stream = self._stream(r.device)  # queued after this record's device-to-host copy
        with torch.cuda.stream(stream):
            r.loaded = torch.empty_like(r.host, device=r.device).copy_(r.host, non_blocking=True)
            r.ready = torch.cuda.Event()
            r.ready.record(stream)

    def _fetch(self, r: _Record) -> torch.Tensor:
        if r.loaded is None:  # released early (e.g. a partial backward): load on demand
            self._load_record(r)
        t = r.loaded
        if r.ready is not None:
            current = torch.cuda.current_stream(t.device)
            current.wait_event(r.ready)
            t.record_stream(current)  # allocated on the side stream, used on this one
            r.ready = None
        return t

    @staticmethod
    def _release(group: _Group) -> None:
        for r in group.records:
            r.loaded = r.ready = None
        group.resident = False

    def _stream(self, device: torch.device) -> Any:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def _storage_ptr(t: torch.Tensor) -> int:
    """Address of the memory behind ``t`` (a DTensor's local shard), shared by all its views."""
    if isinstance(t, DTensor):
        t = t._local_tensor
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # storage-less subclasses
        return -1


class OffloadHandle:
    """What :func:`offload_activations` returns: counters in ``stats``; ``remove()`` undoes.

    Graphs recorded before ``remove()`` stay valid: their saved tensors keep a reference
    to the host copies and load on demand.
    """

    def __init__(self, offloader: _Offloader, blocks: list[tuple[str, nn.Module]]) -> None:
        self._offloader = offloader
        self._hooks: list[Any] = []
        self.blocks = [fqn for fqn, _ in blocks]
        for fqn, block in blocks:
            stack: list[tuple[Any, _Group] | None] = []

            def pre(mod: nn.Module, args: tuple, fqn: str = fqn, stack: list = stack) -> None:
                stack.append(self._offloader.enter(fqn, mod))

            def post(mod: nn.Module, args: tuple, out: Any, stack: list = stack) -> None:
                entry = stack.pop() if stack else None
                if entry is not None:
                    ctx, group = entry
                    ctx.__exit__(None, None, None)
                    group.originals.clear()  # the block's forward is over: free the originals

            hpre = block.register_forward_pre_hook(pre)
            hpost = block.register_forward_hook(post, always_call=True)
            self._hooks += [hpre, hpost]
            _register(block, "offload", [hpre.id], [hpost.id])
        self._modules = [block for _, block in blocks]

    @property
    def stats(self) -> OffloadStats:
        return self._offloader.stats

    @property
    def resident_blocks(self) -> int:
        """Blocks whose saved tensors are on the device right now (backward only)."""
        return sum(1 for r in self._offloader.groups if (g := r()) is not None and g.resident)

    def remove(self) -> None:
        """Remove the hooks; blocks save their activations on the device again."""
        for h in self._hooks:
            h.remove()
        for block in self._modules:
            _NESTING.get(block, {}).pop("offload", None)
        self._hooks, self._modules = [], []


def offload_activations(
    model: nn.Module,
    blocks: list[str],
    *,
    loading_horizon: int = 2,
    device: str | torch.device = "cpu",
    min_bytes: int = DEFAULT_MIN_BYTES,
) -> OffloadHandle:
    """Keep the tensors each block saves for backward in host memory, not on the device.

    SageMaker SMP's ``sm_activation_offloading`` with ``activation_loading_horizon``: in
    forward, every tensor a block saves for backward is copied to (pinned) host memory on
    a side CUDA stream; in backward, when block ``i``'s first saved tensor is needed,
    blocks ``i-1 .. i-loading_horizon`` start loading back, so at most
    ``loading_horizon + 1`` blocks are resident. Parameters (and views of them, such as
    TP's local weights), tensor subclasses and tensors under ``min_bytes`` stay where they
    are; a tensor saved several times in one block (q/k/v's input) is copied once. On a
    CPU-only machine the host copy is still a separate copy, so the path is exercised.

    With :func:`checkpoint_blocks` on the same blocks only the block inputs are saved,
    and those are what gets offloaded.

    Args:
        model: the (possibly tensor-parallel, checkpointed) model.
        blocks: block FQNs, e.g. ``model.tpcompile_plan.blocks``.
        loading_horizon: how many blocks ahead of backward to load (>= 1).
        device: the host device, ``"cpu"``.
        min_bytes: saved tensors smaller than this are not offloaded.

    Example:
        >>> blocks = [f"model.layers.{i}" for i in range(4)]        # doctest: +SKIP
        >>> handle = offload_activations(model, blocks, loading_horizon=2)
        >>> model(ids, labels=ids).loss.backward()
        >>> list(handle.stats.prefetch_order), handle.stats.max_resident_blocks
        (['model.layers.2', 'model.layers.1', 'model.layers.0'], 3)
        >>> handle.remove()
    """
    if isinstance(loading_horizon, bool) or not isinstance(loading_horizon, int) or loading_horizon < 1:
        raise TPError(f"loading_horizon must be an integer >= 1 (blocks loaded ahead), got {loading_horizon!r}")
    host = torch.device(device)
    if host.type != "cpu":
        raise TPError(f"activations are offloaded to host memory: device must be 'cpu', got {device!r}")
    if min_bytes < 0:
        raise TPError(f"min_bytes must be >= 0, got {min_bytes!r}")
    resolved = _resolve_blocks(model, blocks, "offload")
    return OffloadHandle(_Offloader(loading_horizon, host, min_bytes), resolved)
