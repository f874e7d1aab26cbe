"""From a converged partition to roles: the analysis driver.

``analyze`` runs propagation + partition to a fixed point: a region that cannot be split
(one indivisible unit, a poisoned op, a replicated activation that would need slicing,
a partial sum reduced inside its own module) is forced replicated and the graph is
propagated again, until nothing changes.  Then every parameter gets its role.

A statistic over split features (:mod:`.stats`) is first left untied; if it turns out
not to split, or a region its features belong to cannot split (a partition failure, a
poisoned op, a partial sum or gradient nothing sums), the fixed point starts over with it
tied, from the overrides alone: what was forced while it was untied assumed a partition
it no longer has, and tying it gives that region what it had without split statistics.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from ..errors import TPError
from .addends import addend_params
from .entries import EntryPaths, EntrySlice, entry_slice
from .exits import loop_parents
from .gradients import along, applied_inside_entry, rank_of, unsummed_gradients, varies
from .heads import gathered_heads, heads_off_the_last_dim, readers_of_gathered_heads
from .lookup_tail import tail_mixes, tail_params
from .partition import BlockLayout, Partition, partition
from .propagate import Analysis, RuleSet, innermost_module, module_path
from .reads import split_raw_reads
from .reentry import Reentry, find_params_only, find_reentry
from .state import Feat, ParamRef
from .stats import STAT_OPS, SplitStat, find_split_stats

__all__ = ["SMALL_HEAD", "Analyzed", "analyze"]

# a head returning fewer outputs than this (a classifier's labels) stays whole
SMALL_HEAD = 32


def key_matches(key: str, fqn: str) -> bool:
    """Does an override key (a parameter FQN, or ``"re:<regex>"``) select ``fqn``?"""
    if key.startswith("re:"):
        return re.fullmatch(key[3:], fqn) is not None
    return key == fqn


@dataclass
class Analyzed:
    an: Analysis
    part: Partition
    layouts: dict[str, BlockLayout]  # fqn -> its one sharded dim
    column: dict[str, str]  # fqn -> module running the op
    row: dict[str, tuple[str, str | None]]  # fqn -> (module, bias fqn)
    embedding: dict[str, list[str]]  # fqn -> every module looking it up
    lm_head: dict[str, str]
    grad_allreduce: set[str] = field(default_factory=set)
    forced: set = field(default_factory=set)  # fqns (overrides) and (fqn, dim) blocks
    notes: list[str] = field(default_factory=list)
    passes: int = 0
    reentry: Reentry = field(default_factory=Reentry)  # row exits that also sum gradients
    # statistics over split features, by the module computing them (:mod:`.stats`), and
    # the whole values computed from them (their gradients the all-reduces sum)
    stats: dict[str, SplitStat] = field(default_factory=dict)
    stat_values: set = field(default_factory=set)
    stat_units: dict = field(default_factory=dict)  # statistic node -> unit labels it reduces
    retie: set = field(default_factory=set)  # statistics to tie again (see _opened_by)
    # why each forced block or fqn stays whole (the first reason found), for dump-plan
    why: dict = field(default_factory=dict)
    # module -> its parameters added to a partial sum inside its forward (:mod:`.addends`)
    addends: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # module -> the replicated arguments its call narrows to each rank's rows (:mod:`.entries`)
    entry_slices: dict[str, list[EntrySlice]] = field(default_factory=dict)
    # module -> {buffer path under it: its rows per rank}, narrowed for its forward
    buffer_slices: dict[str, dict[str, BlockLayout]] = field(default_factory=dict)
    # row module -> the parent whose call is the TP region instead (:mod:`.exits`)
    loop_parents: dict[str, str] = field(default_factory=dict)


def _region_blocks(part: Partition, an: Analysis, atoms: np.ndarray) -> set:
    """Blocks ``(fqn, dim)`` of every region the given atoms belong to (to force replicated)."""
    atoms = atoms[atoms >= 0]
    if atoms.size == 0:
        return set()
    base = part.base
    label = part.label
    hit_classes = set(np.unique(label[atoms]).tolist()) | set(np.unique(label[base[atoms]]).tolist())
    keys: set = set()
    for blk in an.atoms.blocks:
        ids = np.arange(blk.start, blk.start + blk.size)
        if hit_classes.intersection(np.unique(label[ids]).tolist()):
            keys.add(blk.key)
    return keys


def _split_by_stat(a: Analyzed, atoms: np.ndarray) -> bool:
    """Are some of ``atoms`` split only because a statistic over them did not tie them?
    Then that statistic is tied again (``a.retie``) instead of forcing a region: a split
    statistic must never make the plan replicate more than tying would (Falcon-H1's
    final norm over a residual stream its replicated mixer writes features into)."""
    units = set(np.unique(a.part.label[atoms[atoms >= 0]]).tolist())
    hit = {n for n, labels in a.stat_units.items() if units & labels}
    a.retie |= hit
    return bool(hit)


def _stat_blocks(an: Analysis, part: Partition) -> dict[fx.Node, set]:
    """The blocks of the regions each untied statistic reads features of."""
    return {u.node: _region_blocks(part, an, u.atoms.reshape(-1)) for u in an.stat_uses}


def _opened_by(stat_blocks: dict[fx.Node, set], blocks: set) -> set[fx.Node]:
    """The untied statistics over features of the regions ``blocks`` stand for.  A region
    that cannot split (a failure, a poisoned op, a partial sum or gradient nothing sums)
    may only be one because such a statistic left its features untied (OLMoE at tp=4 with
    2 KV heads: ``q_norm`` split, ``k_norm`` tied, the query heads each needing one of the
    KV heads every rank would then hold); tying them again gives what the plan was
    without statistics over split features, never an error or a larger replicated
    region in its place."""
    return {n for n, keys in stat_blocks.items() if keys & blocks}


def _aligned_checks(a: Analyzed, entry_paths: EntryPaths | None = None, gathered: bool = True) -> set:
    """Resolve elementwise meetings of unsharded values with sharded features;
    ``gathered``: the LM heads' logits are gathered where the head returns."""
    force: set = set()
    an, part = a.an, a.part
    for ev in an.aligned:
        ranks = rank_of(part, ev.atoms)
        nd = ranks.ndim
        shape = (1,) * (nd - len(ev.shape)) + tuple(ev.shape)
        split_dims = [d for d in range(nd) if varies(ranks, d)]
        multi = bool((ranks == -2).any())  # features of a KV head several ranks hold
        if not split_dims and not multi:
            continue
        sliced = [d for d in split_dims if shape[d] > 1]
        shared = [d for d in split_dims if shape[d] == 1] or ([-1] if multi else [])
        if isinstance(ev.operand, ParamRef):
            ref = ev.operand
            if ref.is_buffer and sliced and (not _slice_buffer(a, ev, ref, ranks, sliced) or gathered):
                # a buffer (no gradient) narrowed to the rank's rows for its owner's forward
                # (Falcon-H1's ``mup_vector`` scaling in_proj's split output).  Any other
                # is left to the self-check where the heads' logits are gathered: a root
                # buffer added to them (BART's ``final_logits_bias``) needs no slice at all.
                # (Taken as a parameter's slice there, a vocabulary padded to divide, BART's
                # 50265 words at tp=4, has none: its shared table stayed whole.)  On
                # vocab-split logits it must take the parameters' slice
                continue
            offset = nd - len(ref.dims)
            for d in sliced:
                pd = ref.dims[d - offset] if d - offset >= 0 else None
                lay = _slice_layout(ref.fqn, pd, part, ev.atoms, ranks, d)
                prev = a.layouts.get(ref.fqn) if lay is not None else None
                if lay is None or (prev is not None and (prev.dim != lay.dim
                                                         or not np.array_equal(prev.index, lay.index))):
                    # no slice of the parameter matches: its region stays whole, unless an
                    # untied statistic is what split it (that statistic ties again)
                    if not _split_by_stat(a, ev.atoms):
                        force |= _region_blocks(part, an, ev.atoms.reshape(-1))
                    continue
                a.layouts[ref.fqn] = lay
            if shared and not ref.is_buffer and not sliced:
                a.grad_allreduce.add(ref.fqn)
            continue
        node: fx.Node = ev.operand
        if not sliced and node in a.stat_values:
            continue  # a statistic's all-reduce sums its gradient (backward)
        if sliced and not ev.tainted and _uniform_along(an, node, sliced, nd):
            continue  # a fresh fill: rank-local once its size is (a fix-up; the dry run checks)
        if len(sliced) == 1 and not multi and _sliced_at_entry(a, ev, ranks, sliced[0], entry_paths):
            continue  # no gradient: each rank takes its rows where it enters the module
        if not sliced and shared and ev.tainted:
            found = find_reentry(an, part, a.layouts, node) or find_params_only(an, part, a.layouts, node)
            if found is not None:  # summed where the row's sum leaves its module
                a.reentry.update(found)
                a.grad_allreduce |= found.params
                continue
        if sliced or (shared and ev.tainted):
            if _split_by_stat(a, ev.atoms):
                continue
            what = "would need slicing" if sliced else "has a gradient the local features each add to"
            region = _region_blocks(part, an, ev.atoms.reshape(-1))
            behind = _rows_behind(an, part, node) if sliced else set()
            if behind and _width(an, behind) < _width(an, region):
                # the value is whole because a smaller region was split and summed before
                # it (a LoRA branch split over its rank, added into sharded heads): keep
                # that one replicated, and the branch follows the heads instead
                force |= behind
                continue
            a.notes.append(
                f"activation {node.name} ({module_path(ev.node)[-1:] or ['<root>']}) {what}; "
                "kept the region replicated"
            )
            force |= region
    return force


def _slice_buffer(a: Analyzed, ev: Any, ref: ParamRef, ranks: np.ndarray, sliced: list[int]) -> str:
    """Record the slice that narrows buffer ``ref`` to each rank's rows for its owner's
    forward; ``""`` if done, else why it cannot be.  Every use of the buffer must be inside
    that forward and sliced alike (the whole buffer is swapped for the call)."""
    an = a.an
    owner = ref.fqn.rpartition(".")[0]
    offset = ranks.ndim - len(ref.dims)
    pd = ref.dims[sliced[0] - offset] if len(sliced) == 1 and sliced[0] >= offset else None
    if not owner or not isinstance(pd, int):
        return "would need slicing along more than one dim, or outside a module"
    lay = _slice_layout(ref.fqn, pd, a.part, ev.atoms, ranks, sliced[0])
    if lay is None:
        return "would need unequal slices per rank"
    for node in an.graph.nodes:
        v = an.value.get(node)
        if isinstance(v, ParamRef) and v.fqn == ref.fqn and any(
                not (innermost_module(u) + ".").startswith(owner + ".") for u in node.users):
            return f"is read outside {owner}'s forward"
    known = a.buffer_slices.setdefault(owner, {})
    path = ref.fqn[len(owner) + 1:]
    prev = known.get(path)
    if prev is not None and (prev.dim != lay.dim or not np.array_equal(prev.index, lay.index)):
        return "is sliced two ways"
    known[path] = lay
    return ""


def _sliced_at_entry(a: Analyzed, ev: Any, ranks: np.ndarray, d: int, paths: EntryPaths | None) -> bool:
    """Record the entry slice that makes ``ev``'s replicated operand rank-local
    (:mod:`.entries`), if there is an exact one consistent with those found before."""
    nd = ranks.ndim
    node = ev.operand
    op_dim = d - (nd - a.an.ndim(node))
    if op_dim < 0:
        return False
    es = entry_slice(a.an, node, op_dim, along(ranks, d), along(ev.atoms, d), ev.node, a.part.tp, paths)
    if es is None:
        return False
    known = a.entry_slices.setdefault(es.module, [])
    same = [k for k in known if k.path == es.path]
    if same and same[0] != es:
        return False  # one argument, two different slices: keep the region whole
    if not same:
        known.append(es)
    return True


def _gradient_checks(a: Analyzed, strict: bool, stat_blocks: dict[fx.Node, set]) -> set:
    """The backward check (:mod:`.gradients`): a partial gradient nothing sums is an
    error (strict) or keeps its region replicated; in a region an untied statistic opened,
    that statistic is tied again instead (``a.retie``)."""
    force: set = set()
    found = unsummed_gradients(a.an, a.part, a.layouts, a.grad_allreduce, a.reentry)
    for u in found:
        a.retie |= _opened_by(stat_blocks, _region_blocks(a.part, a.an, u.atoms.reshape(-1)) - a.forced)
    if a.retie:
        return force
    for u in found:
        if strict:
            raise TPError(
                f"tpcompile cannot split this model exactly: {u}. Force the region replicated "
                "with overrides={'<param fqn>': 'replicated'}, or pass strict=False to do that "
                "with a warning."
            )
        a.notes.append(f"{u}; kept the region replicated")
        force |= _region_blocks(a.part, a.an, u.atoms.reshape(-1))
    return force


def _rows_behind(an: Analysis, part: Partition, node: fx.Node, depth: int = 16) -> set:
    """Blocks of the regions whose row-parallel partial sums ``node`` is computed from,
    looking back through values that carry no features."""
    row_of = {r.node: r for r in an.rows}
    found: set = set()
    todo, seen = [(node, 0)], set()
    while todo:
        n, d = todo.pop()
        if n in seen or d > depth:
            continue
        seen.add(n)
        row = row_of.get(n)
        if row is not None and (row.fqn, row.in_dim) in part.layouts:
            found |= _region_blocks(part, an, row.atoms)
            continue
        if isinstance(an.value.get(n), Feat):
            continue
        todo.extend((i, d + 1) for i in n.all_input_nodes)
    return found


def _width(an: Analysis, blocks: set) -> int:
    """How many parameter features the regions of ``blocks`` hold."""
    return sum(an.atoms.by_key[k].size for k in blocks if k in an.atoms.by_key)


def _uniform_along(an: Analysis, node: fx.Node, dims: list[int], nd: int) -> bool:
    flags = an.uniform.get(node)
    if flags is None:
        return False
    flags = (True,) * (nd - len(flags)) + flags
    return all(flags[d] for d in dims)


def _slice_layout(fqn: str, pd: int | None, part: Partition, atoms: np.ndarray, ranks: np.ndarray,
                  d: int) -> BlockLayout | None:
    """The rows of a parameter met elementwise by split features along ``d``: each
    rank's own, and the copies of a follower several ranks hold (Mamba-2's depthwise conv
    over the B/C channels of its one group, which every rank's heads read)."""
    if pd is None:
        return None
    line = along(ranks, d)
    if (line == -2).any():
        feats = along(np.broadcast_to(atoms, ranks.shape), d)
        index = [np.nonzero(part.holds(r, feats))[0] for r in range(part.tp)]
    else:
        index = [np.nonzero(line == r)[0] for r in range(part.tp)]
    if len({len(i) for i in index}) != 1:
        return None
    return BlockLayout(fqn, pd, int(line.size), np.stack(index))


def _reduce_checks(an: Analysis, part: Partition) -> set:
    """A partial sum must leave the module that computed it before it is reduced, and
    must not join, unreduced, a partial sum its module's caller computes: each row module
    all-reduces where it returns, so the caller's reduce would sum the inner one's again
    (PEFT's MiSS adds its own row product to its row-parallel base layer's output)."""
    force: set = set()
    for rp in an.reduce_points:
        path = module_path(rp.node) if rp.node.op != "output" else []
        split = [an.rows[ri] for ri in rp.rows if (an.rows[ri].fqn, an.rows[ri].in_dim) in part.layouts]
        for row in split:
            if row.module in path or any(_inside(row.module, other.module) for other in split):
                force |= _region_blocks(part, an, row.atoms)
    return force


def _inside(module: str, outer: str) -> bool:
    """Is ``module`` a strict descendant of ``outer``?"""
    return module != outer and (outer == "" or module.startswith(outer + "."))


def _structural(an: Analysis, part: Partition, outputs: np.ndarray, why: dict) -> set:
    new: set = set()
    for f in part.failures:
        if f.single_unit:
            new |= set(f.blocks)
            _because(why, set(f.blocks), "its features form one unit (tied by a reduction over all of them, "
                     "a norm or a softmax, or a single head): nothing to deal to the ranks")
    if new:  # the output head may only show up once those are replicated
        return new
    for e in an.embeddings:
        owner = e.fqn.rpartition(".")[0]
        if e.module == "" or owner.startswith(e.module + "."):
            # a module looking up its child's table in its own forward (PEFT's LoRA
            # embedding: F.embedding(ids, lora_A.T) beside base_layer(ids)): the masked
            # lookup and all-reduce of a vocab-parallel table wrap a whole module's
            # forward, so this table stays replicated
            key = (e.fqn, an.atoms.by_key_of(e.atoms))
            new.add(key)
            _because(why, {key}, f"looked up inside its owner's forward ({e.module or '<root>'})")
        elif (mixes := tail_mixes(an, e)) is not None:
            # the masked rows are zeroed where the module returns: code after the lookup
            # that mixes tokens would spread them first
            key = (e.fqn, an.atoms.by_key_of(e.atoms))
            new.add(key)
            _because(why, {key}, f"{e.module}'s forward goes on after the lookup: {mixes}")
    if new:
        return new
    out_set = set(np.unique(outputs[outputs >= 0]).tolist())
    vocab_sizes = {int(c.atoms.size) for c in an.columns if int(c.atoms[0]) in out_set}
    tables = {e.fqn for e in an.embeddings}
    for c in an.columns:
        if int(c.atoms[0]) in out_set and c.atoms.size < SMALL_HEAD and c.fqn not in tables:
            # a classifier's labels, a QA head's start and end: a split saves a few rows and
            # costs a gather, and a PEFT ``modules_to_save`` copy of it (added for every
            # SEQ_CLS task) would otherwise re-split it after transform
            key = (c.fqn, an.atoms.by_key_of(c.atoms))
            new.add(key)
            _because(why, {key}, f"a head of {c.atoms.size} outputs: a split would cost more than it saves")
    for e in an.embeddings:
        tied = any(c.fqn == e.fqn for c in an.columns)
        if not tied and e.atoms.size not in vocab_sizes and e.atoms.size < 16384:
            key = (e.fqn, an.atoms.by_key_of(e.atoms))
            new.add(key)
            _because(why, {key}, f"a small lookup table ({e.atoms.size} rows, not the vocabulary): a split would cost more "
                     "than it saves")
    return new


def analyze(
    graph: fx.Graph,
    rules: RuleSet,
    tp: int,
    *,
    param_of_placeholder: dict[str, str],
    buffer_of_placeholder: dict[str, str],
    strict: bool = True,
    overrides: dict[str, str] | None = None,
    max_passes: int | None = None,
    split_stats: bool = True,
    override_reasons: dict[str, str] | None = None,
    entry_paths: EntryPaths | None = None,
    gathered: bool = True,
) -> Analyzed:
    """Propagate and partition until stable; see module docstring.  ``split_stats=False``
    ties every statistic's features, as any other reduction's (no :mod:`.stats`);
    ``override_reasons``: why an override key forces its parameters whole (default: the
    user's override); ``entry_paths`` finds the forward argument that carries a value into
    a module (without it, no replicated value is sliced at a module's entry); ``gathered``:
    the LM heads' logits are gathered where the head returns (not loss-parallel)."""
    all_params = set(param_of_placeholder.values())
    if max_passes is None:
        # every pass but the last keeps at least one more (parameter, dim) block whole, so
        # an attempt ends within as many passes as there are blocks (HY-V4 takes 38)
        held = {**param_of_placeholder, **buffer_of_placeholder}
        max_passes = 2 + sum(n.meta["val"].dim() for n in graph.nodes if n.op == "placeholder"
                             and n.name in held and isinstance(n.meta.get("val"), torch.Tensor))
    why: dict = {}
    for k, v in (overrides or {}).items():
        if v != "replicated":
            continue
        for f in all_params:
            if key_matches(k, f):
                why.setdefault(f, (override_reasons or {}).get(k, f"overrides={{{k!r}: 'replicated'}}"))
    overridden = set(why)
    # statistics that tie their features (not split)
    whole_stats: set[fx.Node] = set() if split_stats else {
        n for n in graph.nodes if getattr(n.target, "overloadpacket", None) in STAT_OPS}
    total = 0
    while True:
        # every decision of an attempt assumed its untied statistics split; once one of
        # them ties again, those decisions may no longer hold (a region forced, an
        # embedding kept whole for a layout the tie removes), so the next attempt starts
        # from the overrides alone.  ``whole_stats`` only grows: at most one attempt per
        # statistic, and the last one is what tying those statistics from the start gives
        a, more, passes = _attempt(graph, rules, tp, param_of_placeholder, buffer_of_placeholder,
                                   strict, set(overridden), whole_stats, max_passes, dict(why), entry_paths,
                                   gathered)
        total += passes
        if a is not None:
            a.passes = total
            return a
        whole_stats |= more


def _because(why: dict, blocks: set, reason: str) -> None:
    for b in blocks:
        why.setdefault(b, reason)


def _attempt(graph: fx.Graph, rules: RuleSet, tp: int, param_of_placeholder: dict[str, str],
             buffer_of_placeholder: dict[str, str], strict: bool, forced: set,
             whole_stats: set[fx.Node], max_passes: int, why: dict,
             entry_paths: EntryPaths | None = None, gathered: bool = True
             ) -> tuple[Analyzed | None, set[fx.Node], int]:
    """Passes to a fixed point with ``whole_stats`` tied: the converged analysis, or
    ``None`` and the statistics found not to split (to tie in a fresh attempt); and the
    passes it took.  ``why`` collects the reason each forced block stays whole."""
    notes: list[str] = []
    for n_pass in range(1, max_passes + 1):
        an = Analysis(
            graph, rules, param_of_placeholder=param_of_placeholder,
            buffer_of_placeholder=buffer_of_placeholder, forced_replicated=set(forced),
            whole_stats=set(whole_stats),
        ).run()
        part = partition(an, tp)
        stat_blocks = _stat_blocks(an, part)
        outputs = np.concatenate([o.reshape(-1) for o in an.outputs]) if an.outputs else np.zeros(0, np.int64)
        # structural forcing first: one-unit regions (an MoE router, a norm over the whole
        # hidden size) and small lookup tables (positions, token types) stay replicated
        new = _structural(an, part, outputs, why)
        if new - forced:  # replicate those first: what they poison downstream may vanish
            forced |= new
            continue
        # a region that cannot split because an untied statistic opened it: tie that
        # statistic again (a fresh attempt) before anything is forced or refused
        refused = [_region_blocks(part, an, p.atoms) for p in an.poison]
        refused += [set(f.blocks) for f in part.failures if not f.single_unit]
        retie = set().union(*(_opened_by(stat_blocks, blocks - forced) for blocks in refused))
        if retie:
            return None, retie, n_pass
        for p in an.poison:
            touched = _region_blocks(part, an, p.atoms)
            if touched and touched <= new | forced:
                continue  # the region is replicated anyway (an MoE router's top-k, say)
            if p.unknown_op and strict:
                raise TPError(
                    f"{p.reason}. Add a rule for it (transform(..., rules=[...])), force the "
                    "region replicated with overrides={'<param fqn>': 'replicated'}, or pass "
                    "strict=False to replicate it with a warning."
                )
            notes.append(p.reason)
            _because(why, touched, p.reason)
            new |= touched
        for f in part.failures:
            fqns = {k[0] for k in f.blocks}
            if f.single_unit or set(f.blocks) <= new | forced:
                continue
            msg = (
                f"cannot split {', '.join(sorted(fqns))} over tp={tp}: {f.reason}. "
                f"tp values that work for it: {f.valid_tp}"
            )
            # a head count that does not divide tp is the user's to fix; a region of unequal
            # units (a low-rank latent), one no tp > 1 splits (Gemma 4's per-layer inputs:
            # one unit per layer, each layer's gate needing all of one) or one exposed by
            # later passes is simply replicated
            if strict and n_pass == 1 and not f.uneven_units and any(t > 1 for t in f.valid_tp):
                raise TPError(msg)
            notes.append(msg + " (kept replicated)")
            _because(why, set(f.blocks), msg)
            new |= set(f.blocks)
        new -= forced
        if new:  # the graph changes: re-propagate before judging finer interactions
            forced |= new
            continue
        a = Analyzed(an, part, {}, {}, {}, {}, {}, forced=forced, notes=notes, passes=n_pass, why=why)
        for key, lay in part.layouts.items():
            if key[0] not in forced and key not in forced:
                a.layouts[key[0]] = lay
        # statistics over split features: exact from partial sums, or tied in a fresh attempt
        a.stats, summed, whole = find_split_stats(an, part, a.layouts)
        if whole:
            return None, whole, n_pass
        a.stat_values = summed.nodes
        a.stat_units = {u.node: set(np.unique(part.label[u.atoms[u.atoms >= 0]]).tolist())
                        for u in an.stat_uses if u.node in summed.nodes}
        a.reentry.update(summed)
        a.grad_allreduce |= summed.params
        reduced = _reduce_checks(an, part) - forced
        a.addends, unplaced = addend_params(an, part)
        for m, names in a.addends.items():
            for name in names:  # whole by nature: what dump-plan says about it
                why.setdefault(f"{m}.{name}", f"added to the partial sum inside {m}: one rank adds it "
                               "before the all-reduce")
        for ri, reason in unplaced.items():
            blocks = _region_blocks(part, an, an.rows[ri].atoms) - forced
            _because(why, blocks, reason)
            reduced |= blocks
        a.retie |= _opened_by(stat_blocks, reduced)
        _because(why, reduced, "a partial sum is reduced inside the module that computed it, or joins one its caller computes")
        seen = len(notes)
        aligned = _aligned_checks(a, entry_paths, gathered) - forced
        _because(why, aligned, "; ".join(notes[seen:]) or "a whole value would need a slice of split features")
        for reason, atoms in split_raw_reads(an, a.layouts):
            blocks = _region_blocks(part, an, atoms) - forced
            if blocks and not _split_by_stat(a, atoms):
                notes.append(reason)
                _because(why, blocks, reason)
                aligned |= blocks
        new = aligned | reduced
        if not new and not a.retie:
            seen = len(notes)
            new = _gradient_checks(a, strict, stat_blocks) - forced
            _because(why, new, "; ".join(notes[seen:]) or "a partial gradient nothing sums")
        if not new and not a.retie:
            new = _gathered_head_readers(a, outputs, forced, why, notes)
        if a.retie:
            return None, a.retie, n_pass
        if not new:
            _assign(a, outputs)
            return a, set(), n_pass
        forced |= new
    raise TPError(f"analysis did not converge in {max_passes} passes (forced: {sorted(forced)})")


def _gathered_head_readers(a: Analyzed, outputs: np.ndarray, forced: set, why: dict, notes: list[str]) -> set:
    """The regions the runtime's gather of a head cannot serve (:mod:`.heads`), kept
    whole with the reason: a head whose features are off the last dim, and a row of
    another module reading a head's output (gathered whole there)."""
    heads = gathered_heads(a, outputs)
    off, readers = heads_off_the_last_dim(a, heads), readers_of_gathered_heads(a, heads)
    found = [(c.atoms, c.module, f"{c.module}'s split output is returned with its features off the last dim (a "
              "convolution's channels): the runtime gathers a head along the last dim")
             for c in a.an.columns if c.fqn in off]
    found += [(r.atoms, f"{r.module} and {readers[r.fqn]}", f"{r.module} reads the output of {readers[r.fqn]}, "
               "which the model also returns whole (gathered there): a row cannot take it split")
              for r in a.an.rows if r.fqn in readers]
    new: set = set()
    for atoms, modules, reason in found:
        blocks = _region_blocks(a.part, a.an, atoms) - forced
        if blocks - new:
            notes.append(f"{modules} kept replicated: {reason}")
        _because(why, blocks, reason)
        new |= blocks
    return new


def _assign(a: Analyzed, outputs: np.ndarray) -> None:
    an = a.an
    heads = {c.fqn for c in gathered_heads(a, outputs)}
    for c in an.columns:
        if c.fqn in a.layouts and a.layouts[c.fqn].dim == c.out_dim:
            (a.lm_head if c.fqn in heads else a.column)[c.fqn] = c.module
    # a module an expert loop calls once per expert: its parent is the TP region (:mod:`.exits`)
    keep = set(a.addends) | {r.module for r in an.rows if r.fqn in a.reentry.rows}
    a.loop_parents = loop_parents(an, a.layouts, an._params, keep)
    for r in an.rows:
        if r.fqn in a.layouts and a.layouts[r.fqn].dim == r.in_dim:
            a.row[r.fqn] = (a.loop_parents.get(r.module, r.module), r.bias)
    for e in an.embeddings:
        if e.fqn in a.layouts:
            a.embedding.setdefault(e.fqn, [])
            if e.module not in a.embedding[e.fqn]:  # a shared table looked up by several modules
                a.embedding[e.fqn].append(e.module)
            # what the module computes from each rank's masked rows holds partial gradients
            a.grad_allreduce |= tail_params(an, e)
    # a column whose own module enters the region (not a loop parent's): the whole
    # parameters that module applies to the contraction's input get partial gradients
    parents = set(a.loop_parents.values())
    a.grad_allreduce |= applied_inside_entry(an, {
        c.node: c.module for c in an.columns if c.fqn in a.column and c.fqn not in a.reentry.columns
        and not any(c.module == p or _inside(c.module, p) for p in parents)})
    for fqn in list(a.grad_allreduce):
        if fqn in a.layouts:
            a.grad_allreduce.discard(fqn)
    for n in a.notes:
        warnings.warn(f"tpcompile: {n}", stacklevel=3)

