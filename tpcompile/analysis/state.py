"""Abstract values the propagation attaches to graph nodes, and the events it records.

* ``None`` — a replicated value carrying no sharded feature (the residual stream, masks).
* :class:`Feat` — an activation carrying parameter features: ``atoms`` is an int array
  broadcastable to the activation's shape (size 1 on dims without features, ``-1`` where a
  position carries no feature).
* :class:`ParamRef` — a parameter or buffer, possibly transposed/cast (``dims[i]`` is the
  parameter dim behind tensor dim ``i``).
* :class:`Partial` — the output of a row-parallel contraction: a per-rank partial sum that
  must be all-reduced before any non-linear use.

A linear statistic over every feature of a value (an RMSNorm's ``mean(x**2)`` over all
heads) is recorded as a :class:`StatUse` instead of tying those features together; its
result carries no features (``None``) and :mod:`tpcompile.analysis.stats` decides whether
it can be computed from per-rank partial sums.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch.fx as fx

__all__ = [
    "Aligned",
    "ColumnUse",
    "EmbeddingUse",
    "Feat",
    "ParamRef",
    "Partial",
    "Poison",
    "RawRead",
    "RowAddend",
    "ReducePoint",
    "RowUse",
    "StatUse",
]


@dataclass
class Feat:
    atoms: np.ndarray


@dataclass(frozen=True)
class SubDim:
    """One factor of a parameter dim that a view splits: DBRX's experts keep ``w1`` as
    ``[E * F, H]`` and view it ``(E, F, H)``, so the view's dim 1 is
    ``SubDim(dim=0, sizes=(E, F), part=1)`` — each expert's ``F`` features.  The analysis
    places it like any dim; :func:`~tpcompile.analysis.partition.param_layout` turns its
    layout into rows of the real dim."""

    dim: int
    sizes: tuple[int, ...]
    part: int


@dataclass(frozen=True)
class ParamRef:
    fqn: str
    dims: tuple[int | SubDim | None, ...]
    is_buffer: bool = False


@dataclass(frozen=True)
class Partial:
    rows: tuple[int, ...]  # indices into Analysis.rows


@dataclass
class ColumnUse:
    """A contraction of a replicated activation with a parameter: output features sharded."""

    node: fx.Node
    fqn: str
    out_dim: int
    in_dim: int
    bias: str | None
    module: str
    atoms: np.ndarray  # output-feature atoms


@dataclass
class RowUse:
    """A contraction over sharded features: the parameter's input dim follows them."""

    node: fx.Node
    fqn: str
    in_dim: int
    bias: str | None
    module: str
    atoms: np.ndarray  # input-feature atoms of the parameter
    reduce_points: list[fx.Node] = field(default_factory=list)


@dataclass
class EmbeddingUse:
    node: fx.Node
    fqn: str
    module: str
    atoms: np.ndarray  # one atom per row (vocabulary entry)


@dataclass
class Aligned:
    """A value without features combined elementwise with a sharded activation.

    ``operand`` is a :class:`ParamRef` or the node of a replicated activation;
    ``atoms`` is the sharded side broadcast to the result's rank;
    ``shape`` is the operand's shape aligned to the result (size 1 = broadcast).
    """

    node: fx.Node
    operand: ParamRef | fx.Node
    atoms: np.ndarray
    shape: tuple[int, ...]
    tainted: bool


@dataclass
class RowAddend:
    """A replicated parameter added to a partial sum inside the module that computed it:
    a row's bias written as code (``out.add_(down_proj_bias[expert_ids])`` in a fused
    experts module).  Added by one rank only, the all-reduce at the module's exit adds it
    once (:mod:`tpcompile.analysis.addends`)."""

    node: fx.Node
    fqn: str
    rows: tuple[int, ...]


@dataclass
class RawRead:
    """A parameter's entries mixed by an op whose result the analysis takes as the same on
    every rank: a norm of the weight itself (PEFT DeLoRA's ``delora_B.norm(dim=0)``), a
    weight built from it and a mask.  ``dims``: the parameter dims the op mixes (a
    reduction's reduced dims; every dim for an op without a rule for parameters).  Split
    along one of them, each rank would compute it from its own slice: the parameter's
    region stays whole (:func:`~tpcompile.analysis.roles.analyze`)."""

    node: fx.Node
    fqn: str
    dims: frozenset[int]


@dataclass
class Poison:
    node: fx.Node
    reason: str
    atoms: np.ndarray
    unknown_op: bool = False


@dataclass
class ReducePoint:
    node: fx.Node
    rows: tuple[int, ...]


@dataclass
class StatUse:
    """A linear reduction (``sum`` / ``mean`` / ``var`` / ``std``) over every feature of its
    input: ``atoms`` is the input's atoms at its full rank, ``dims`` the dims reduced."""

    node: fx.Node
    atoms: np.ndarray
    dims: tuple[int, ...]
