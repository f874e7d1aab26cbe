"""Hard-coded sizes: module attributes the rewrite must make rank-local.

Modern HF attention reshapes with ``-1`` and needs nothing, but older code bakes global
sizes into attributes: GPT-2's ``split_size`` and ``Conv1D.nf``, ``num_key_value_groups``
when KV heads are replicated, Phi-3's ``config.num_attention_heads`` in a slice bound.
The traced graph holds each such size as a constant in a view / expand / split / slice
whose output carries sharded features.  Comparing that constant with the local size the
partition implies gives pairs ``global → local`` per module; an integer attribute of that
module (or of its ``config``) equal to a global value with one unambiguous local value is
a *candidate*.  Values can coincide (Gemma-2-9B's ``sliding_window`` is 4096, its query
width too), so :func:`verify_fixups` keeps a candidate only if setting it to its local
value changes the traced graph: an attribute the forward never turns into a shape is
left alone.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch import nn

from ..capture.export import quiet_traces
from .gradients import along
from .propagate import innermost_module
from .roles import Analyzed
from .state import Feat, ParamRef

__all__ = ["Local", "apply_fixups", "find_fixups", "global_config", "localize_embedding", "graph_signature", "quiet_traces", "verify_fixups"]

aten = torch.ops.aten
_CONV = (aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution, aten._convolution)


class Local:
    """Rank 0's view of the analysed graph: how many positions of a dim it holds."""

    def __init__(self, a: Analyzed) -> None:
        self.a = a
        table = a.an.atoms
        rank = a.part.rank_of_atom
        # atoms placed on one rank answer directly; the rest (unsplit blocks, and KV
        # features several ranks hold) follow their base parameter row's layout
        held = np.ones(table.size, dtype=bool)
        # rows rank 0 holds several times (KV heads copied once per query head that reads
        # them, where query heads straddle KV groups); a copy a broadcast made is counted
        # as itself
        copies = np.ones(table.size, dtype=np.int64)
        for blk in table.blocks:
            lay = a.layouts.get(blk.key[0])
            if lay is not None and lay.dim == blk.key[1]:
                held[blk.start : blk.start + blk.size] = False
                rows = lay.index[0][lay.index[0] >= 0]
                held[blk.start + rows] = True
                np.add.at(copies, blk.start + rows, 1)
                copies[blk.start + rows] -= 1
        base = table.base_of()
        self.rank0 = np.where(rank >= 0, rank == 0, held[base])
        self.copies = np.where(table.is_replica(), 1, copies[base])
        self.group = a.part.group[a.part.label]  # per atom: its KV head where broadcast

    def line(self, node: fx.Node, d: int) -> np.ndarray:
        """The atoms along dim ``d`` of ``node`` (first position of every other dim)."""
        v = self.a.an.value.get(node)
        atoms = self.a.an.aligned_to(v.atoms, self.a.an.ndim(node))
        return along(atoms, d)

    def count(self, line: np.ndarray) -> int:
        at = np.clip(line, 0, None)
        held = np.where(line < 0, True, self.rank0[at])
        copies = np.where(line < 0, 1, self.copies[at])
        # a line across KV heads counts each head's copies; one inside a head (its features)
        # counts each feature once, however often the head is copied
        if (copies[held] > 1).any() and np.unique(self.group[at[line >= 0]]).size > 1:
            return int(copies[held].sum())
        return int(held.sum())

    def size(self, node: fx.Node, d: int) -> int:
        shape = self.a.an.shape(node)
        v = self.a.an.value.get(node)
        if isinstance(v, ParamRef) and len(v.dims) == len(shape):
            # a view of a split parameter (stacked experts kept 2-D, viewed per expert)
            lay = self.a.layouts.get(v.fqn)
            return lay.local if lay is not None and v.dims[d] == lay.dim else shape[d]
        if not isinstance(v, Feat):
            return shape[d]
        line = self.line(node, d)
        return shape[d] if line.size == 1 else self.count(line)

    def carries(self, node: fx.Node, d: int) -> bool:
        """Does dim ``d`` of ``node`` carry distinct features?"""
        return isinstance(self.a.an.value.get(node), Feat) and self.line(node, d).size > 1

    def prefix(self, node: fx.Node, d: int, stop: int) -> int:
        return self.count(self.line(node, d)[:stop])


def _pairs(a: Analyzed, loc: Local, whole: set[fx.Node]) -> dict[str, dict[int, set[int]]]:
    an = a.an
    pairs: dict[str, dict[int, set[int]]] = defaultdict(lambda: defaultdict(set))
    for node in an.graph.nodes:
        if node.op != "call_function" or node in whole:
            continue
        packet = getattr(node.target, "overloadpacket", None)
        mod = innermost_module(node)
        out = an.value.get(node)
        if packet in (aten.view, aten.reshape, aten._unsafe_view, aten.expand):
            in_shape = an.shape(node.args[0])
            out_shape = an.shape(node)
            for i, v in enumerate(node.args[1]):
                copies = packet is aten.expand and (
                    len(out_shape) - len(in_shape) > i or in_shape[i - (len(out_shape) - len(in_shape))] == 1
                )
                if isinstance(v, int) and v > 1 and not copies:
                    pairs[mod][v].add(loc.size(node, i))
            if isinstance(out, Feat):
                for i, v in enumerate(out_shape):
                    if v > 1 and loc.carries(node, i):
                        pairs[mod][v].add(loc.size(node, i))
            if packet in (aten.view, aten.reshape):
                _expand_copies(a, loc, node, pairs)
        elif packet is aten.unflatten and isinstance(out, Feat):
            # ``unflatten(-2, (self.num_heads, 3))`` (Falcon's interleaved q|k|v): each
            # given size lands on one output dim from ``dim`` on
            dim = node.args[1] % an.ndim(node.args[0])
            for i, v in enumerate(node.args[2]):
                if isinstance(v, int) and v > 1:
                    pairs[mod][v].add(loc.size(node, dim + i))
        elif packet in (aten.split, aten.split_with_sizes) and isinstance(an.value.get(node.args[0]), Feat):
            src = node.args[0]
            dim = (node.args[2] if len(node.args) > 2 else 0) % an.ndim(src)
            sizes = node.args[1] if isinstance(node.args[1], list | tuple) else [node.args[1]]
            users = sorted((u for u in node.users), key=lambda u: u.args[1])
            for s, u in zip(sizes, users, strict=False):
                if isinstance(s, int):  # a size computed from data (a graph node) is no attribute
                    pairs[mod][s].add(loc.size(u, dim))
        elif packet in _CONV and isinstance(an.value.get(node.args[0]), Feat):
            groups = node.args[8] if packet in (aten.convolution, aten._convolution) else (
                node.args[6] if len(node.args) > 6 else 1)
            if isinstance(groups, int) and groups > 1:  # depthwise: one group per channel
                pairs[mod][groups].add(loc.size(node, 1))
        elif packet in (aten.group_norm, aten.native_group_norm) and isinstance(an.value.get(node.args[0]), Feat):
            groups = node.args[6] if packet is aten.native_group_norm else node.args[1]
            channels = an.shape(node.args[0])[1]
            if isinstance(groups, int) and groups > 1 and channels % groups == 0:
                pairs[mod][groups].add(loc.size(node.args[0], 1) * groups // channels)
        elif packet is aten.slice and isinstance(an.value.get(node.args[0]), Feat):
            src = node.args[0]
            dim = node.args[1] % an.ndim(src)
            size = an.shape(src)[dim]
            for bound in node.args[2:4]:
                if isinstance(bound, int) and 1 < bound < size:
                    pairs[mod][bound].add(loc.prefix(src, dim, bound))
    return pairs


def _expand_copies(a: Analyzed, loc: Local, node: fx.Node, pairs: dict) -> None:
    """``repeat_kv``: the local copy count of an expand merged into the head dim."""
    src = node.args[0]
    if not isinstance(src, fx.Node) or getattr(src.target, "overloadpacket", None) is not aten.expand:
        return
    in_shape = a.an.shape(src)
    strides = a.an.meta(src).stride()
    copy_dims = [d for d, (s, n) in enumerate(zip(strides, in_shape, strict=False)) if s == 0 and n > 1]
    if len(copy_dims) != 1:
        return
    d = copy_dims[0]
    out_local = int(np.prod([loc.size(node, i) for i in range(a.an.ndim(node))]))
    other = int(np.prod([loc.size(src, i) for i in range(len(in_shape)) if i != d]))
    if other and out_local % other == 0:
        pairs[innermost_module(src)][in_shape[d]].add(out_local // other)


def find_fixups(a: Analyzed, model: nn.Module, *, gathered: bool = False) -> tuple[
        dict[str, dict[str, list[int]]], dict[str, dict[str, list]]]:
    """``({module fqn: {attr or "config.attr": [global, local]}}, ambiguous)``, by
    representative FQNs.  ``ambiguous[module][attr] = [global, [locals]]`` lists the
    attributes whose global value maps to several local values in that module (two
    sizes that coincide globally); :mod:`.selfcheck` picks among them by tracing.
    ``gathered``: heads' outputs are gathered whole at run time, so no size read after
    them is made local (SEW's upsampling reshapes its gathered projection by
    ``squeeze_factor``: made local, the reshape was skipped and the output's shape wrong)."""
    from .heads import after_heads

    loc = Local(a)
    whole = after_heads(a, a.an.graph) if gathered else set()
    mods = dict(model.named_modules())
    result: dict[str, dict[str, list[int]]] = {}
    ambiguous: dict[str, dict[str, list]] = {}
    for mod_name, values in _pairs(a, loc, whole).items():
        module = mods.get(mod_name)
        if module is None:
            continue
        changes: dict[str, list[int]] = {}
        candidates = [(k, v) for k, v in vars(module).items() if type(v) is int]
        config = getattr(module, "config", None)
        if config is not None:
            candidates += [(f"config.{k}", v) for k, v in vars(config).items() if type(v) is int]
        for attr, value in candidates:
            locals_ = values.get(value)
            if not locals_:
                continue
            if len(locals_) == 1:
                local = next(iter(locals_))
                if local != value:
                    changes[attr] = [value, local]
            else:
                ambiguous.setdefault(mod_name, {})[attr] = [value, sorted(v for v in locals_ if v != value)]
        if changes:
            result[mod_name] = changes
    return result, ambiguous


class _ConfigView:
    """A module's own view of a shared config with some sizes made rank-local."""

    def __init__(self, base: Any, overrides: dict[str, int]) -> None:
        object.__setattr__(self, "_base", base)
        object.__setattr__(self, "_overrides", overrides)

    def __getattr__(self, name: str) -> Any:
        overrides = object.__getattribute__(self, "_overrides")
        if name in overrides:
            return overrides[name]
        return getattr(object.__getattribute__(self, "_base"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_base"), name, value)


def global_config(config: Any) -> Any:
    """The model's own config behind the private view :func:`apply_fixups` may have set."""
    return object.__getattribute__(config, "_base") if isinstance(config, _ConfigView) else config


def apply_fixups(module: nn.Module, fixups: dict[str, list[Any]]) -> None:
    """Set ``module``'s attributes (and its private config view) to their local values,
    and install its shape sites (:mod:`.shape_sites`)."""
    from .shape_sites import install_sites, is_site

    config_over: dict[str, int] = {}
    sites = {k: v for k, v in fixups.items() if is_site(k)}
    if sites:
        install_sites(module, sites)
    for attr, (_, local) in fixups.items():
        if is_site(attr):
            continue
        if attr.startswith("config."):
            config_over[attr[len("config."):]] = local
        else:
            setattr(module, attr, local)
    if config_over:
        module.config = _ConfigView(module.config, config_over)


@contextlib.contextmanager
def _patched(module: nn.Module, attr: str, local: int) -> Iterator[None]:
    saved = dict(vars(module))
    try:
        apply_fixups(module, {attr: [0, local]})
        yield
    finally:
        module.__dict__.clear()
        module.__dict__.update(saved)


def graph_signature(graph: fx.Graph) -> list[tuple[str, str, Any]]:
    """The graph's ops and the shapes they make, not its constants (for a model only
    ``torch.export`` can run; :func:`~tpcompile.capture.fake.shape_trace` is the same
    comparison for one a fake forward can run)."""
    def shapes(val: Any) -> Any:
        if isinstance(val, torch.Tensor):
            return tuple(val.shape)
        if isinstance(val, list | tuple):
            return tuple(shapes(v) for v in val)
        return None

    return [(n.op, str(n.target), shapes(n.meta.get("val"))) for n in graph.nodes]


def verify_fixups(
    model: nn.Module,
    fixups: dict[str, dict[str, list[int]]],
    signature: Callable[[], Any],
) -> dict[str, dict[str, list[int]]]:
    """Keep the candidates whose local value changes (or breaks) the model's ``signature()``:
    its ops and the shapes they make, not its constants.  A size only has to be rank-local
    where a shape depends on it; an attribute that merely equals a split size and enters
    the math as a value (Llama 4's ``floor_scale`` = 4 = the head count, a divisor of
    positions) must keep its global value.

    One trace per module class and distinct ``(attribute, global, local)``, set in every
    such module at once: modules of one class run the same code, so a size either
    reaches a shape in all of them or in none (T5: 7 traces instead of 30)."""
    want = signature()
    mods = dict(model.named_modules())
    groups: dict[tuple[str, str, int, int], list[str]] = defaultdict(list)
    for mod_name, changes in fixups.items():
        cls = type(mods[mod_name]).__qualname__
        for attr, (glob, local) in changes.items():
            groups[(cls, attr, glob, local)].append(mod_name)
    kept: dict[str, dict[str, list[int]]] = {}
    for (cls, attr, glob, local), names in groups.items():
        # its twins too: every module of the class holding the same plain value (the blocks
        # a traced one stands for).  Changed in one block alone, the setting would make
        # that block a structure of its own to the capture, and the trace would change
        # for that reason only
        twins = [m for m in mods.values() if type(m).__qualname__ == cls and "." not in attr
                 and type(vars(m).get(attr)) is int and vars(m)[attr] == glob]
        with contextlib.ExitStack() as stack:
            stack.enter_context(quiet_traces())
            for module in {id(m): m for m in [*(mods[n] for n in names), *twins]}.values():
                stack.enter_context(_patched(module, attr, local))
            try:
                matters = signature() != want
            except Exception:  # the new value reaches a shape and breaks the trace
                matters = True
        if matters:
            for name in names:
                kept.setdefault(name, {})[attr] = [glob, local]
    return kept


def localize_embedding(module: nn.Module, vocab_range: tuple[int, int], local_rows: int) -> None:
    """``nn.Embedding``'s own bookkeeping: local row count and padding index."""
    start, end = vocab_range
    if hasattr(module, "num_embeddings"):
        module.num_embeddings = local_rows
    pad = getattr(module, "padding_idx", None)
    if isinstance(pad, int):
        module.padding_idx = pad - start if start <= pad < end else None
