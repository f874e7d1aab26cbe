"""Atoms: the unit of the dataflow analysis.

An *atom* is one feature index of one parameter dimension (row ``i`` of ``q_proj.weight``,
column ``j`` of ``o_proj.weight``).  The analysis attaches to every activation an integer
array of atoms, broadcastable to the activation's shape (size 1 on dims that carry no
feature), and records an *edge* whenever an op ties two atoms together: an elementwise
product of gate and up features, a contraction over a head's features, the alignment of a
query head with the key head it attends with.  Connected components of those edges are the
indivisible units (heads, query groups, MLP features) that must live on one rank.

Broadcast copies of an atom (``repeat_kv``'s expansion of a KV head to the query heads
that share it) become *replica* atoms: they point at their base atom instead of joining it,
so a KV head may be needed by several ranks (KV-head replication when tp > kv heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["AtomTable", "connected_components"]


@dataclass
class _Block:
    key: tuple[str, int]  # (parameter FQN, dim)
    start: int
    size: int


@dataclass
class AtomTable:
    """Allocates atom ids and remembers what each one is."""

    blocks: list[_Block] = field(default_factory=list)
    by_key: dict[tuple[str, int], _Block] = field(default_factory=dict)
    # replica id -> base id, kept as growing chunks to stay vectorized
    _rep_ids: list[np.ndarray] = field(default_factory=list)
    _rep_bases: list[np.ndarray] = field(default_factory=list)
    size: int = 0

    def param_atoms(self, fqn: str, dim: int, length: int) -> np.ndarray:
        """Atoms for ``length`` features of ``fqn``'s dimension ``dim`` (stable per key)."""
        block = self.by_key.get((fqn, dim))
        if block is None:
            block = _Block((fqn, dim), self.size, length)
            self.blocks.append(block)
            self.by_key[(fqn, dim)] = block
            self.size += length
        if block.size != length:
            raise ValueError(f"{fqn} dim {dim}: {block.size} features seen before, now {length}")
        return np.arange(block.start, block.start + length, dtype=np.int64)

    def replicas(self, base: np.ndarray) -> np.ndarray:
        """Fresh atoms standing for copies of ``base`` (same shape)."""
        flat = np.asarray(base, dtype=np.int64).reshape(-1)
        ids = np.arange(self.size, self.size + flat.size, dtype=np.int64)
        self.size += flat.size
        self._rep_ids.append(ids)
        self._rep_bases.append(flat)
        return ids.reshape(np.shape(base))

    def base_of(self) -> np.ndarray:
        """``base[a]`` is the parameter atom that ``a`` copies (``a`` itself if primary)."""
        base = np.arange(self.size, dtype=np.int64)
        for ids, bases in zip(self._rep_ids, self._rep_bases, strict=False):
            base[ids] = bases
        # replicas of replicas: follow the chain to a parameter atom
        for _ in range(8):
            nxt = base[base]
            if np.array_equal(nxt, base):
                break
            base = nxt
        return base

    def is_replica(self) -> np.ndarray:
        mask = np.zeros(self.size, dtype=bool)
        for ids in self._rep_ids:
            mask[ids] = True
        return mask

    def by_key_of(self, atoms: np.ndarray) -> int:
        """The parameter dim the (primary) ``atoms`` belong to."""
        return self.owner(int(np.asarray(atoms).reshape(-1)[0]))[1]

    def owner(self, atom: int) -> tuple[str, int, int]:
        """(FQN, dim, index) of a parameter atom."""
        for block in self.blocks:
            if block.start <= atom < block.start + block.size:
                return block.key[0], block.key[1], atom - block.start
        raise KeyError(atom)


def connected_components(size: int, edges_a: np.ndarray, edges_b: np.ndarray) -> np.ndarray:
    """Label of each of ``size`` nodes: the smallest node id in its component.

    Vectorized min-label propagation with pointer jumping; a few passes suffice for the
    shallow components attention and MLP blocks produce.
    """
    label = np.arange(size, dtype=np.int64)
    if edges_a.size == 0:
        return label
    a = edges_a.astype(np.int64)
    b = edges_b.astype(np.int64)
    while True:
        la, lb = label[a], label[b]
        low = np.minimum(la, lb)
        new = label.copy()
        np.minimum.at(new, la, low)
        np.minimum.at(new, lb, low)
        # pointer jumping: a label's own label
        for _ in range(64):
            jumped = new[new]
            if np.array_equal(jumped, new):
                break
            new = jumped
        if np.array_equal(new, label):
            return label
        label = new
