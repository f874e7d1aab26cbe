"""Partition: from tied atoms to per-rank shards.

Connected components of the atom edges are *units* (a head with its KV group and its
``o_proj`` columns; one MLP feature with its gate, up and down entries).  Units that share
a parameter form a *region* (one attention block, one MLP, the vocabulary).  Each region's
units, in the order of their first parameter's features, are dealt out to ``tp`` ranks in
contiguous runs; a parameter's shard on rank ``r`` is then the sorted set of its features
held by rank ``r``'s units.  That set is a contiguous slice for a plain column/row linear,
``[q_r | k_r | v_r]`` for a fused QKV, and overlaps between ranks when KV heads are
replicated.  Units that do not divide by ``tp`` are dealt unevenly, the short ranks
holding padding units (``-1`` rows) where their code finds its next unit, plainly or
within the query heads' KV groups.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .atoms import connected_components
from .propagate import Analysis
from .state import SubDim

__all__ = ["BlockLayout", "Partition", "RegionFailure", "param_layout", "partition", "valid_tp_sizes"]


@dataclass
class BlockLayout:
    """How one parameter dim is split: ``index[r]`` lists the global indices rank ``r``
    holds, in local order (``-1`` marks a padding row)."""

    fqn: str
    dim: int | SubDim  # SubDim: a factor of a dim a view splits (see param_layout)
    size: int
    index: np.ndarray  # (tp, local)

    @property
    def local(self) -> int:
        return int(self.index.shape[1])

    @property
    def contiguous(self) -> bool:
        tp, local = self.index.shape
        return local * tp == self.size and np.array_equal(
            self.index.reshape(-1), np.arange(self.size)
        )

    @property
    def padded(self) -> bool:
        return bool((self.index < 0).any())

    @property
    def replicated_rows(self) -> bool:
        """Some global index lives on more than one rank (KV-head replication)."""
        flat = self.index[self.index >= 0]
        return np.unique(flat).size < flat.size


def param_layout(lay: BlockLayout) -> BlockLayout:
    """``lay`` in the parameter's real dims.  A :class:`SubDim` layout (each expert's
    ``F`` features of a ``[E * F, H]`` weight viewed ``(E, F, H)``) becomes the rows of
    the real dim whose factor ``part`` is one the rank holds, in row-major order: every
    expert's local features, expert by expert, as the model's own view of the local
    weight (``view(-1, F / tp, H)``) reads them."""
    sub = lay.dim
    if not isinstance(sub, SubDim):
        return lay
    if lay.padded:
        raise ValueError(f"{lay.fqn}: a padded layout of a viewed dim has no rows of the real one")
    grid = np.arange(int(np.prod(sub.sizes))).reshape(sub.sizes)
    index = np.stack([np.take(grid, row, axis=sub.part).reshape(-1) for row in lay.index])
    return BlockLayout(lay.fqn, sub.dim, int(grid.size), index)


@dataclass
class RegionFailure:
    blocks: list[tuple[str, int]]
    units: int
    reason: str
    valid_tp: list[int]
    single_unit: bool = False
    # units of unequal sizes (a norm-tied latent beside a few rotary pairs): not a
    # count of heads that does not divide, but a region that cannot be split at all
    uneven_units: bool = False


@dataclass
class Partition:
    tp: int
    layouts: dict[tuple[str, int], BlockLayout] = field(default_factory=dict)
    failures: list[RegionFailure] = field(default_factory=list)
    # per class label: the KV head it belongs to where broadcast (:attr:`_Atoms.group`)
    group: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    # rank holding each atom; -1 unplaced, -2 held by several ranks (replicated KV head)
    rank_of_atom: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    label: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    base: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # atom -> param atom
    # the ranks holding each class several ranks hold (a follower's copies): class -> ranks
    shared_by: dict[int, tuple[int, ...]] = field(default_factory=dict)

    def holds(self, r: int, atoms: np.ndarray) -> np.ndarray:
        """Does rank ``r`` hold each of ``atoms`` (``-1``: no)?"""
        ranks = np.where(atoms < 0, -1, self.rank_of_atom[np.clip(atoms, 0, None)])
        out = ranks == r
        for i in np.nonzero(ranks == -2)[0] if ranks.ndim == 1 else ():
            out[i] = r in self.shared_by.get(int(self.label[atoms[i]]), ())
        return out


@dataclass
class _Region:
    blocks: list[int]
    classes: np.ndarray  # dealt units' class labels, in deal order
    followers: np.ndarray  # classes placed wherever their replicas land
    vocab: bool
    uneven: bool = False  # its units hold different numbers of features


@dataclass
class _Atoms:
    """Per-atom facts shared by every region."""

    label: np.ndarray
    base: np.ndarray
    is_rep: np.ndarray
    follower: np.ndarray  # per class label: holds features used only through replicas
    block_of: np.ndarray  # per atom: index of its base's block, -1 if none
    # per broadcast: the classes of its base features, the base atoms and their copies
    broadcasts: list[tuple[set[int], np.ndarray, np.ndarray]] = field(default_factory=list)
    # per class label: the class of its first broadcast copy (a KV head's features: the
    # first query head reading them, one key for the head), else the class itself
    group: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


def _deal(tp: int, n: int, pad: bool) -> np.ndarray | None:
    """Rank of each of ``n`` ordered units, or ``None`` if they cannot be split evenly."""
    if n % tp == 0:
        return np.arange(n) * tp // n
    if pad:
        per = -(-n // tp)
        return np.arange(n) // per
    return None


def _deal_padded(tp: int, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Units that do not divide by ``tp`` (Falcon-7B's 71 heads at tp=4) dealt 18/18/18/17:
    the first ``n % tp`` ranks hold ``ceil(n / tp)``, the others one fewer and a padding
    unit in its place, so every rank holds the same local shapes.  The rank of each
    unit and the padding units per rank, or ``None`` when some rank would hold none."""
    per, extra = -(-n // tp), n % tp
    if not extra or per < 2:
        return None
    counts = np.array([per if r < extra else per - 1 for r in range(tp)])
    return np.repeat(np.arange(tp), counts), per - counts


def _deal_grouped(tp: int, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Query heads dealt within their KV groups when the groups do not divide ``tp``'s
    query heads evenly (Qwen2-7B's 28 heads over 4 KV heads at tp=8): each group's heads
    go to ``tp / groups`` ranks, unevenly with padding (4 + 3 and a padding head), so no
    rank holds heads of two groups.  ``groups``: each unit's group, in deal order."""
    ids, first, counts = np.unique(groups, return_index=True, return_counts=True)
    n_groups = ids.size
    if tp % n_groups or len(set(counts.tolist())) != 1:
        return None
    size, span = int(counts[0]), tp // n_groups
    order = ids[np.argsort(first)]
    if not np.array_equal(groups, np.repeat(order, size)):  # each group's heads one run
        return None
    inner = _deal_padded(span, size)
    if inner is None:
        return None
    return (np.concatenate([k * span + inner[0] for k in range(n_groups)]), np.tile(inner[1], n_groups))


def _groups(region: _Region, f: _Atoms) -> np.ndarray | None:
    """The KV group of each of the region's units in deal order — the follower classes
    whose broadcast copies it reads (a KV head's features), named by the first — or
    ``None`` when some unit reads none."""
    followers = set(region.followers.tolist())
    pairs = [np.stack([f.label[copies].reshape(-1), np.broadcast_to(f.label[base], copies.shape).reshape(-1)], 1)
             for classes, base, copies in f.broadcasts if classes & followers]
    if not pairs:
        return None
    read: dict[int, set[int]] = {}
    for unit, group in np.unique(np.concatenate(pairs), axis=0).tolist():
        read.setdefault(unit, set()).add(group)
    out = [read.get(int(c)) for c in region.classes]
    if any(g is None for g in out):
        return None
    names = {frozenset(g): i for i, g in enumerate(dict.fromkeys(frozenset(g) for g in out))}
    return np.array([names[frozenset(g)] for g in out])


def _facts(an: Analysis) -> _Atoms:
    table = an.atoms
    ea, eb = an.edges()
    label = connected_components(table.size, ea, eb)
    base = table.base_of()
    is_rep = table.is_replica()
    follower = np.zeros(table.size, dtype=bool)
    for arr in an.replicated_bases:
        follower[label[arr[arr >= 0]]] = True
    block_of = np.full(table.size, -1, dtype=np.int64)
    for i, blk in enumerate(table.blocks):
        block_of[blk.start : blk.start + blk.size] = i
    broadcasts = []
    group = np.arange(table.size, dtype=np.int64)
    for bases, copies in zip(an.replicated_bases, an.replica_copies, strict=True):
        keep = bases >= 0
        if keep.any():
            broadcasts.append((set(np.unique(label[bases[keep]]).tolist()), bases[keep], copies[:, keep]))
            group[label[bases[keep]]] = label[copies[0, keep]]
    return _Atoms(label, base, is_rep, follower, block_of[base], broadcasts, group)


def _regions(an: Analysis, f: _Atoms) -> list[_Region]:
    table = an.atoms
    ids = np.nonzero(f.block_of >= 0)[0]
    cls, blk = f.label[ids], f.block_of[ids]
    reps = np.nonzero(f.is_rep)[0]
    n_cls = table.size
    # classes sharing a block, and a replica's class with its base's class, are one region
    comp = connected_components(
        n_cls + len(table.blocks),
        np.concatenate([cls, f.label[reps]]),
        np.concatenate([n_cls + blk, f.label[f.base[reps]]]),
    )
    region_of = comp[cls]
    embedding_fqns = {e.fqn for e in an.embeddings}
    regions: list[_Region] = []
    for rid in np.unique(region_of):
        sel = region_of == rid
        r_ids, r_cls, r_blk = ids[sel], cls[sel], blk[sel]
        uniq = np.unique(r_cls)
        dealt = uniq[~f.follower[uniq]]
        # deal units in the order of their smallest base atom (first parameter's order)
        order_key = np.full(dealt.size, np.iinfo(np.int64).max)
        keep = ~f.follower[r_cls]
        pos = np.searchsorted(dealt, r_cls[keep])
        np.minimum.at(order_key, pos, f.base[r_ids[keep]])
        classes = dealt[np.argsort(order_key, kind="stable")]
        blocks = sorted(set(r_blk.tolist()))
        per_class = np.bincount(pos, minlength=dealt.size) if dealt.size else np.zeros(1, np.int64)
        vocab = bool(
            any(table.blocks[b].key[0] in embedding_fqns for b in blocks)
            or (per_class.max() <= len(blocks) and dealt.size >= 64)
        )
        uneven = bool(dealt.size > 1 and per_class.min() != per_class.max())
        regions.append(_Region(blocks, classes, uniq[f.follower[uniq]], vocab, uneven))
    return regions


def _holdings(region: _Region, ranks: np.ndarray, f: _Atoms, tp: int) -> np.ndarray:
    """``on[r, class]``: rank ``r`` holds that unit (dealt to it, or a follower whose
    features one of its units uses through a replica)."""
    on = np.zeros((tp, f.label.size), dtype=bool)
    on[ranks, region.classes] = True
    reps = np.nonzero(f.is_rep)[0]
    rep_rank_cls = on[:, f.label[reps]]  # (tp, n_reps)
    for r in range(tp):
        on[r, f.label[f.base[reps[rep_rank_cls[r]]]]] = True
    return on


def _padded(mine: np.ndarray, labels: np.ndarray, template: int, pads: int) -> np.ndarray:
    """A rank's features of one block with its ``pads`` padding units in place: after
    each run of its last unit's (``template``) consecutive features, as many ``-1`` rows
    as the run holds, times ``pads`` — where the model's own code would find a further head (after
    the last query head of a ``[q | k | v]`` fused projection, inside each section of a
    ``[Q | K | V]`` one, after a head's interleaved ``q k v``)."""
    if not pads:
        return mine
    is_t = labels[mine] == template
    out: list[np.ndarray] = []
    start = run = 0
    for j in range(mine.size):
        run = run + 1 if is_t[j] else 0
        # a run of the template's consecutive features ends here (GPT-2's head 6 at tp=4
        # holds q, k and v features far apart: three runs, a padding head in each section)
        if run and (j + 1 == mine.size or not is_t[j + 1] or mine[j + 1] != mine[j] + 1):
            out += [mine[start : j + 1], np.full(run * pads, -1)]
            start, run = j + 1, 0
    out.append(mine[start:])
    return np.concatenate(out)


def _layouts_for(
    an: Analysis, region: _Region, on: np.ndarray, f: _Atoms, tp: int,
    pads: tuple[np.ndarray, np.ndarray] | None = None, *, flatten: bool = True,
) -> dict[tuple[str, int], BlockLayout] | str:
    """Each block's layout given the holdings ``on`` (:func:`_holdings`), or why the
    region cannot be placed so.  ``pads``: the ranks of the dealt units and each rank's
    padding units (:func:`_deal_padded`); ``flatten``: query heads may straddle KV
    groups (:func:`_copy_counts`)."""
    table = an.atoms
    out: dict[tuple[str, int], BlockLayout] = {}
    # each rank's last unit (where its padding goes) and its number of padding units
    padding = None if pads is None else ([int(region.classes[pads[0] == r][-1]) for r in range(tp)], pads[1])
    uneven = _uneven_copies(region, on, f, padding)
    # query heads straddling KV groups: each rank holds one copy of a KV head per query
    # head that reads it, and its code broadcasts by one (:func:`_copy_counts`)
    mult = _copy_counts(region, on, f, padding) if uneven and flatten else None
    for b in region.blocks:
        blk = table.blocks[b]
        prim = np.arange(blk.start, blk.start + blk.size)
        held = on[:, f.label[prim]]  # (tp, size)
        per_rank = [np.nonzero(held[r])[0] for r in range(tp)]
        if padding is not None:
            labels = f.label[prim]
            per_rank = [_padded(p, labels, padding[0][r], int(padding[1][r])) for r, p in enumerate(per_rank)]
        if mult is not None:
            labels = f.label[prim]
            per_rank = [_repeated(p, labels, f.group[labels], mult[r]) for r, p in enumerate(per_rank)]
        sizes = {len(p) for p in per_rank}
        if region.vocab and len(sizes) > 1:
            width = max(sizes)
            per_rank = [np.concatenate([p, np.full(width - len(p), -1)]) for p in per_rank]
            sizes = {width}
        if len(sizes) != 1 or 0 in sizes:
            return f"{blk.key[0]} dim {blk.key[1]} would get {sorted(len(p) for p in per_rank)} features per rank"
        out[blk.key] = BlockLayout(blk.key[0], blk.key[1], blk.size, np.stack(per_rank).astype(np.int64))
    return out if mult is not None else uneven or out


def _copy_counts(region: _Region, on: np.ndarray, f: _Atoms,
                 pads: tuple[list[int], np.ndarray] | None = None) -> list[dict[int, int]] | None:
    """Per rank, how many copies of each broadcast (KV) class its units read —
    ``[{class: copies}]`` — when query heads straddle KV groups (20 heads over 5 KV heads
    at tp=4: rank 0 reads 4 copies of KV head 0 and 1 of head 1), or ``None`` where that
    cannot be made local: a class whose features are read a different number of times
    (a norm tying all KV heads into one unit), or one a rank holds but none of its units
    reads.  Holding those copies as rows (:func:`_repeated`), the rank's code broadcasts
    each by one (``num_key_value_groups`` becomes 1): the local KV heads pair with the
    local query heads in order.  A padding unit (``pads``: each rank's last unit and its
    number of padding units) reads a copy of what its rank's last unit reads: its zero
    query meets only zero columns of the output projection, whatever KV head it reads."""
    followers = set(region.followers.tolist())
    out: list[dict[int, int]] = [{} for _ in range(on.shape[0])]
    for classes, base, copies in f.broadcasts:
        if not classes & followers:
            continue
        held = on[:, f.label[base]]
        counts = on[:, f.label[copies]].sum(axis=1)
        if pads is not None:
            for r, (template, n) in enumerate(zip(*pads, strict=True)):
                counts[r] += n * (f.label[copies] == template).sum(axis=0)
        for r in range(on.shape[0]):
            for cls, n in zip(f.label[base][held[r]].tolist(), counts[r][held[r]].tolist(), strict=True):
                if n == 0 or out[r].setdefault(cls, n) != n:
                    return None
    return out


def _repeated(mine: np.ndarray, labels: np.ndarray, groups: np.ndarray, mult: dict[int, int]) -> np.ndarray:
    """A rank's features of one block (``labels``: their classes, ``groups``: their
    :attr:`_Atoms.group`) with each run of one group's consecutive features — one KV
    head's — repeated as many times as the rank reads copies of them (``mult``): KV head
    0's rows four times, then head 1's once, so the ``i``-th local KV head is the one the
    ``i``-th local query head reads."""
    out: list[np.ndarray] = []
    start = 0
    key = np.where(mine >= 0, groups[np.clip(mine, 0, None)], -1)  # padding rows: their own runs
    for j in range(mine.size):
        if j + 1 == mine.size or key[j + 1] != key[j] or mine[j + 1] != mine[j] + 1:
            out += [mine[start : j + 1]] * (mult.get(int(labels[mine[j]]), 1) if mine[j] >= 0 else 1)
            start = j + 1
    return np.concatenate(out) if out else mine


def _uneven_copies(region: _Region, on: np.ndarray, f: _Atoms,
                   pads: tuple[list[int], np.ndarray] | None = None) -> str | None:
    """Why a broadcast in the region cannot run on the local features, or ``None``.

    A rank computes every base feature it holds (a follower lands whole on each rank that
    uses a copy of it) and its code broadcasts each of them by one local count
    (``repeat_kv`` by a localized ``num_key_value_groups``): on every rank, each base
    feature held must have the same number of copies held, and that number must be the
    same on every rank.  A norm tying all KV heads into one unit while each rank's query
    heads use only one of them breaks that (OLMoE's ``k_norm`` with 2 KV heads at tp=4:
    every rank would expand both heads), as do query heads straddling KV groups (20
    heads over 5 KV heads at tp=4: 4 copies of one head and 1 of the next).  A padding
    unit (``pads``: each rank's last unit and its number of padding units) uses the copies
    its rank's last unit uses: the code broadcasts to it too."""
    followers = set(region.followers.tolist())
    for classes, base, copies in f.broadcasts:
        if not classes & followers:
            continue
        held = on[:, f.label[base]]  # (tp, base position): the rank computes it
        counts = on[:, f.label[copies]].sum(axis=1)  # (tp, base position): copies it holds
        if pads is not None:
            for r, (template, n) in enumerate(zip(*pads, strict=True)):
                counts[r] += n * (f.label[copies] == template).sum(axis=0)
        per_rank = set()
        for r in np.nonzero(held.any(axis=1))[0]:
            per_rank |= set(np.unique(counts[r][held[r]]).tolist())
        if len(per_rank) > 1 or 0 in per_rank:
            return (f"its units would use {sorted(per_rank)} copies of the {base.size} broadcast features a "
                    "rank holds (KV heads shared by query heads), where its code makes one number of copies of each")
    return None


def valid_tp_sizes(n_units: int, upto: int = 128) -> list[int]:
    return [t for t in range(1, min(n_units, upto) + 1) if n_units % t == 0]


def _place(an: Analysis, region: _Region, f: _Atoms, tp: int) -> tuple[
        np.ndarray | None, np.ndarray | None, dict[tuple[str, int], BlockLayout] | str | None]:
    """``(ranks, holdings, layouts)`` of ``region`` over ``tp`` ranks — dealt evenly, else
    unevenly with padding units, plainly or within KV groups (not the vocabulary, which
    pads its own way, nor units of unequal sizes) — or the layouts slot holds why not
    (``None``: the units do not divide)."""
    n = region.classes.size
    ranks = _deal(tp, n, pad=region.vocab and n >= tp)
    held = _holdings(region, ranks, f, tp) if ranks is not None else None
    layouts = _layouts_for(an, region, held, f, tp, flatten=False) if held is not None else None
    if isinstance(layouts, dict):
        return ranks, held, layouts
    if region.vocab or region.uneven:
        return ranks, held, _layouts_for(an, region, held, f, tp) if held is not None else None
    groups = _groups(region, f)
    deals = [(ranks, held, None)] if held is not None else []
    for padded in (_deal_padded(tp, n), None if groups is None else _deal_grouped(tp, groups)):
        if padded is not None:
            deals.append((padded[0], _holdings(region, padded[0], f, tp), padded))
    # ranks reading whole KV groups first (Qwen2-7B's 28 heads at tp=8 within their groups
    # hold one KV head each), then query heads straddling KV groups (each held KV head
    # read once per query head: more copies)
    for flatten in (False, True):
        for dealt, on, padded in deals:
            if not flatten and padded is None:
                continue  # the even deal without straddling: tried above
            tried = _layouts_for(an, region, on, f, tp, padded, flatten=flatten)
            if isinstance(tried, dict):
                return dealt, on, tried
            layouts = layouts or tried
    return ranks, held, layouts


def partition(an: Analysis, tp: int) -> Partition:
    """Split every region's units over ``tp`` ranks; report regions that cannot split.
    Units that do not divide by ``tp`` are dealt unevenly, with padding units filling
    the ranks that hold fewer (:func:`_deal_padded`, :func:`_deal_grouped`)."""
    f = _facts(an)
    table = an.atoms
    result = Partition(tp=tp, label=f.label, base=f.base, group=f.group)
    rank_of_atom = np.full(table.size, -1, dtype=np.int64)
    for region in _regions(an, f):
        n = region.classes.size
        keys = [table.blocks[b].key for b in region.blocks]
        if n <= 1:
            result.failures.append(RegionFailure(keys, 1, "one indivisible unit", [1], single_unit=True))
            continue
        ranks, held, layouts = _place(an, region, f, tp)
        if not isinstance(layouts, dict):
            reason = layouts or f"{n} units do not split over tp={tp}"
            # what would work, the uneven deals included: every divisor and power of two
            tries = sorted(set(valid_tp_sizes(n)) | {t for t in (2, 4, 8, 16, 32, 64) if t <= n})
            valid = [t for t in tries if t == 1 or isinstance(_place(an, region, f, t)[2], dict)]
            result.failures.append(RegionFailure(keys, n, reason, valid, uneven_units=region.uneven))
            continue
        result.layouts.update(layouts)
        class_rank = np.full(table.size, -1, dtype=np.int64)
        class_rank[region.classes] = ranks
        # followers: their one rank, or -2 when several ranks hold a copy (replicated KV)
        on = held[:, region.followers]
        count = on.sum(axis=0)
        class_rank[region.followers] = np.where(count == 1, on.argmax(axis=0), np.where(count > 1, -2, -1))
        for c in region.followers[count > 1].tolist():
            result.shared_by[c] = tuple(np.nonzero(held[:, c])[0].tolist())
        hit = class_rank[f.label] != -1
        rank_of_atom[hit] = class_rank[f.label[hit]]
    result.rank_of_atom = rank_of_atom
    return result
