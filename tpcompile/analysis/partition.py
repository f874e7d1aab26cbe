"""Partition: from tied atoms to per-rank shards.

Connected components of the atom edges are *units* (a head with its KV group and its
``o_proj`` columns; one MLP feature with its gate, up and down entries).  Units that share
a parameter form a *region* (one attention block, one MLP, the vocabulary).  Each region's
units, in the order of their first parameter's features, are dealt out to ``tp`` ranks in
contiguous runs; a parameter's shard on rank ``r`` is then the sorted set of its features
held by rank ``r``'s units.  That set is a contiguous slice for a plain column/row linear,
``[q_r | k_r | v_r]`` for a fused QKV, and overlaps between ranks when KV heads are
replicated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .atoms import connected_components
from .propagate import Analysis

__all__ = ["BlockLayout", "Partition", "RegionFailure", "partition", "valid_tp_sizes"]


@dataclass
class BlockLayout:
    """How one parameter dim is split: ``index[r]`` lists the global indices rank ``r``
    holds, in local order (``-1`` marks a padding row)."""

    fqn: str
    dim: int
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


@dataclass
class RegionFailure:
    blocks: list[tuple[str, int]]
    units: int
    reason: str
    valid_tp: list[int]
    single_unit: bool = False


@dataclass
class Partition:
    tp: int
    layouts: dict[tuple[str, int], BlockLayout] = field(default_factory=dict)
    failures: list[RegionFailure] = field(default_factory=list)
    rank_of_atom: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    label: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))


@dataclass
class _Region:
    blocks: list[int]
    classes: np.ndarray  # class labels in deal order
    vocab: bool


def _deal(tp: int, n: int, pad: bool) -> np.ndarray | None:
    """Rank of each of ``n`` ordered units, or ``None`` if they cannot be split evenly."""
    if n % tp == 0:
        return np.arange(n) * tp // n
    if pad:
        per = -(-n // tp)
        return np.arange(n) // per
    return None


def _regions(an: Analysis, label: np.ndarray, base: np.ndarray, live: np.ndarray) -> list[_Region]:
    table = an.atoms
    block_of = np.full(table.size, -1, dtype=np.int64)
    for i, blk in enumerate(table.blocks):
        block_of[blk.start : blk.start + blk.size] = i
    atom_block = block_of[base]
    ids = np.nonzero(live & (atom_block >= 0))[0]
    cls = label[ids]
    blk = atom_block[ids]
    # tie classes that share a block: class <-> (size + block) in one label space
    n_cls = table.size
    comp = connected_components(n_cls + len(table.blocks), cls, n_cls + blk)
    region_of_class = comp[cls]
    embedding_fqns = {e.fqn for e in an.embeddings}
    regions: list[_Region] = []
    for rid in np.unique(region_of_class):
        sel = region_of_class == rid
        r_ids, r_cls, r_blk = ids[sel], cls[sel], blk[sel]
        uniq, first = np.unique(r_cls, return_index=True)
        # deal units in the order of their smallest base atom (first parameter's order)
        order_key = np.full(uniq.size, np.iinfo(np.int64).max)
        pos = np.searchsorted(uniq, r_cls)
        np.minimum.at(order_key, pos, base[r_ids])
        classes = uniq[np.argsort(order_key, kind="stable")]
        blocks = sorted(set(r_blk.tolist()))
        per_class = np.bincount(pos, minlength=uniq.size)
        vocab = bool(
            any(table.blocks[b].key[0] in embedding_fqns for b in blocks)
            or (per_class.max() <= len(blocks) and uniq.size >= 64)
        )
        regions.append(_Region(blocks, classes, vocab))
    return regions


def _layouts_for(
    an: Analysis, region: _Region, ranks: np.ndarray, label: np.ndarray, base: np.ndarray,
    live: np.ndarray, tp: int,
) -> dict[tuple[str, int], BlockLayout] | str:
    table = an.atoms
    class_rank = np.full(table.size, -1, dtype=np.int64)
    class_rank[region.classes] = ranks
    out: dict[tuple[str, int], BlockLayout] = {}
    for b in region.blocks:
        blk = table.blocks[b]
        atoms_ids = np.nonzero(live & (base >= blk.start) & (base < blk.start + blk.size))[0]
        atom_rank = class_rank[label[atoms_ids]]
        per_rank = [np.unique(base[atoms_ids[atom_rank == r]] - blk.start) for r in range(tp)]
        sizes = {len(p) for p in per_rank}
        if region.vocab and len(sizes) > 1:
            width = max(sizes)
            per_rank = [np.concatenate([p, np.full(width - len(p), -1)]) for p in per_rank]
            sizes = {width}
        if len(sizes) != 1 or 0 in sizes:
            return f"{blk.key[0]} dim {blk.key[1]} would get {sorted(len(p) for p in per_rank)} features per rank"
        out[blk.key] = BlockLayout(blk.key[0], blk.key[1], blk.size, np.stack(per_rank).astype(np.int64))
    return out


def valid_tp_sizes(n_units: int, upto: int = 128) -> list[int]:
    return [t for t in range(1, min(n_units, upto) + 1) if n_units % t == 0]


def partition(an: Analysis, tp: int) -> Partition:
    """Split every region's units over ``tp`` ranks; report regions that cannot split."""
    ea, eb = an.edges()
    table = an.atoms
    label = connected_components(table.size, ea, eb)
    base = table.base_of()
    is_rep = table.is_replica()
    bases_away = np.zeros(table.size, dtype=bool)
    for arr in an.replicated_bases:
        bases_away[arr[arr >= 0]] = True
    # a primary atom whose every use went through replicas does not vote on placement
    dormant_class = np.zeros(table.size, dtype=bool)
    live_primary = ~is_rep & ~bases_away
    cls_has_live = np.zeros(table.size, dtype=bool)
    cls_has_live[label[live_primary | is_rep]] = True
    dormant_class = ~cls_has_live
    live = ~dormant_class[label]
    result = Partition(tp=tp, label=label)
    rank_of_atom = np.full(table.size, -1, dtype=np.int64)
    for region in _regions(an, label, base, live):
        n = region.classes.size
        keys = [table.blocks[b].key for b in region.blocks]
        if n == 1:
            result.failures.append(RegionFailure(keys, 1, "one indivisible unit", [1], single_unit=True))
            continue
        ranks = _deal(tp, n, pad=region.vocab and n >= tp)
        layouts = _layouts_for(an, region, ranks, label, base, live, tp) if ranks is not None else None
        if not isinstance(layouts, dict):
            reason = layouts or f"{n} units do not split over tp={tp}"
            valid = [t for t in valid_tp_sizes(n) if isinstance(
                _layouts_for(an, region, _deal(t, n, False), label, base, live, t), dict)]
            result.failures.append(RegionFailure(keys, n, reason, valid))
            continue
        result.layouts.update(layouts)
        class_rank = np.full(table.size, -1, dtype=np.int64)
        class_rank[region.classes] = ranks
        hit = class_rank[label] >= 0
        rank_of_atom[hit] = class_rank[label[hit]]
    result.rank_of_atom = rank_of_atom
    return result
