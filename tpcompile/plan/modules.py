"""Module plans: the collectives around one module's forward, one typed entry per kind.

A :class:`ModulePlan` lists *ops*, each one collective kind with its own data::

    EnterRegion()                      identity forward, all-reduce of the input grads
    VocabEmbedding(vocab_size=V)       masked lookup of this rank's rows, all-reduce
    ReduceOutput(row_biases=["bias"])  all-reduce of the partial sum, bias added once after
    ReduceOutput(reenter=True)         ... and of its gradient (only split code reads it)
    ReduceOutput(addends=["b"])        ... a bias the forward adds to the partial sum: rank 0
                                       adds it, every rank passes its gradient through
    GatherOutput(vocab_size=V)         all-gather of the vocab-sharded logits (unpadded to V)
    GradSum(params=["weight"])         all-reduce of a replicated parameter's gradient
    SplitStats(dim=-1, size=N, ...)    mean / sum / var over split features: local partial
                                       sums all-reduced (and their gradients, backward)
    SliceInputs(slices=[...])          replicated arguments without gradient narrowed to this
                                       rank's rows as the call enters (no collective)
    SliceBuffers(slices=[...])         buffers applied to split features narrowed to this
                                       rank's rows for the call (no collective)
    WholeMasks(sites=[...])            dropout masks over split features drawn at their
                                       whole shape, this rank's rows kept (no collective)

``dump-plan`` prints these objects, the cost model prices :meth:`ModulePlan.collectives`
and the runtime installs one handler per op type
(:class:`~tpcompile.runtime.torch_backend.TorchBackend`), so what is read, priced and
run is one list.  Each :class:`Collective` names its hook site:

==================  ========  ==========  ================================================
hook                phase     op          tensor each rank passes in
==================  ========  ==========  ================================================
``ENTER``           backward  all_reduce  gradient of each floating input that requires
                                          grad (column modules reading the same input
                                          share one)
``EMBED_REDUCE``    forward   all_reduce  the masked embedding output
``EXIT_REDUCE``     forward   all_reduce  each floating output (row-parallel partial sum)
``EXIT_GRAD``       backward  all_reduce  gradient of each floating output a re-entering
                                          row's split readers each partly compute
``EXIT_GATHER``     forward   all_gather  the vocab-sharded logits (local shard)
``GRAD_SUM``        backward  all_reduce  the replicated parameter's gradient
``REPLICA_SUM``     backward  all_reduce  the KV-replica parameter's gradient over its
                                          global rows
``STAT_REDUCE``     forward   all_reduce  each partial statistic (``index``: which one of
                                          the module's, in execution order)
``STAT_GRAD``       backward  all_reduce  the gradient of that statistic (split code reads
                                          it: each rank's is partial)
==================  ========  ==========  ================================================
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from ..errors import TPError

__all__ = [
    "Collective", "EnterRegion", "GatherOutput", "GradSum", "Hook", "ModuleOp", "ModulePlan", "ReduceOutput",
    "SliceBuffers", "SliceInputs", "SplitStats", "VocabEmbedding", "WholeMasks",
]

# all-reduces one split statistic issues (var / std: the mean, then the squared deviations)
STAT_ALL_REDUCES: dict[str, int] = {"sum": 1, "mean": 1, "var": 2, "std": 2}


def _lists(value: Any) -> Any:
    return [_lists(v) for v in value] if isinstance(value, tuple | list) else value


class Hook(str, enum.Enum):
    """Where around a module's forward a collective is hooked."""

    ENTER = "enter"  # copy_to_tp on the inputs: identity forward, all-reduce of grads
    EMBED_REDUCE = "embed_reduce"  # masked vocab-parallel lookup, then reduce_from_tp
    EXIT_REDUCE = "exit_reduce"  # reduce_from_tp of the partial-sum output
    EXIT_GATHER = "exit_gather"  # gather_from_tp of the vocab-sharded logits
    EXIT_GRAD = "exit_grad"  # copy_to_tp after the reduce: the output re-enters split code
    GRAD_SUM = "grad_sum"  # all_reduce_grad of a replicated parameter on sharded features
    REPLICA_SUM = "replica_sum"  # the gradient sum over the copies of a KV-replicated parameter
    STAT_REDUCE = "stat_reduce"  # sum_over_tp of a partial statistic (forward)
    STAT_GRAD = "stat_grad"  # ... and of its gradient (backward)
    BUFFER_GATHER = "buffer_gather"  # gather_from_tp of a sliced buffer a training forward updated


_PHASE_OP = {
    Hook.ENTER: ("backward", "all_reduce"),
    Hook.EMBED_REDUCE: ("forward", "all_reduce"),
    Hook.EXIT_REDUCE: ("forward", "all_reduce"),
    Hook.EXIT_GATHER: ("forward", "all_gather"),
    Hook.EXIT_GRAD: ("backward", "all_reduce"),
    Hook.GRAD_SUM: ("backward", "all_reduce"),
    Hook.REPLICA_SUM: ("backward", "all_reduce"),
    Hook.STAT_REDUCE: ("forward", "all_reduce"),
    Hook.STAT_GRAD: ("backward", "all_reduce"),
    Hook.BUFFER_GATHER: ("forward", "all_gather"),
}


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective a module's hooks issue per call of the module (``tp > 1``).

    ``op`` is the ``torch.distributed`` function called over the TP group; ``param`` the
    module-local parameter name for the gradient sums; ``index`` which of the module's
    split statistics (in execution order) a ``STAT_*`` collective sums.
    """

    hook: Hook
    param: str | None = None
    index: int | None = None

    @property
    def phase(self) -> str:
        return _PHASE_OP[self.hook][0]

    @property
    def op(self) -> str:
        return _PHASE_OP[self.hook][1]


@dataclass(frozen=True, kw_only=True)
class ModuleOp:
    """One collective kind around a module; subclasses carry its data."""

    kind: ClassVar[str] = ""
    order: ClassVar[int] = 0  # hook order: gradient sums, then inputs, then outputs

    def collectives(self) -> list[Collective]:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        """The op as JSON holds it: nested tuples as lists, so a plan read back from its JSON
        has the same dict."""
        return {"kind": self.kind, **{k: _lists(v) for k, v in asdict(self).items()}}


@dataclass(frozen=True, kw_only=True)
class GradSum(ModuleOp):
    """Replicated parameters applied to sharded features (Qwen3's ``q_norm``): each
    rank's gradient is partial, so it is all-reduced over the TP group."""

    kind: ClassVar[str] = "grad_sum"
    order: ClassVar[int] = 0
    params: tuple[str, ...] = ()  # names local to the module

    def collectives(self) -> list[Collective]:
        return [Collective(hook=Hook.GRAD_SUM, param=n) for n in self.params]


@dataclass(frozen=True, kw_only=True)
class EnterRegion(ModuleOp):
    """A column-parallel module's inputs enter the TP region: ``Y_r = X · W_r``; the
    input gradient is all-reduced (once for consecutive columns reading one input)."""

    kind: ClassVar[str] = "enter"
    order: ClassVar[int] = 1

    def collectives(self) -> list[Collective]:
        return [Collective(hook=Hook.ENTER)]


@dataclass(frozen=True, kw_only=True)
class VocabEmbedding(ModuleOp):
    """Vocab-parallel embedding: ids outside this rank's rows read row 0 and are zeroed,
    then the outputs are all-reduced."""

    kind: ClassVar[str] = "vocab_embedding"
    order: ClassVar[int] = 2
    vocab_size: int | None = None  # real (unpadded) rows

    def collectives(self) -> list[Collective]:
        return [Collective(hook=Hook.EMBED_REDUCE)]


@dataclass(frozen=True, kw_only=True)
class ReduceOutput(ModuleOp):
    """Row-parallel: ``Y = Σ_r X_r · W_r`` all-reduced; the biases are added once, after.

    ``reenter``: only split code reads ``Y`` (Mamba's ``x_proj``, whose ``B`` / ``C``
    every channel of the scan reads), so each rank computes part of its gradient, which
    is all-reduced here too (:mod:`tpcompile.analysis.reentry`).

    ``addends``: parameters the module's own forward adds to the partial sum (a fused
    experts module's ``down_proj_bias[expert_ids]``): during the forward they read as
    themselves on the group's first rank and as zeros elsewhere, so the all-reduce adds
    them once; their gradient, whole on every rank, passes through unchanged
    (:mod:`tpcompile.analysis.addends`)."""

    kind: ClassVar[str] = "reduce_output"
    order: ClassVar[int] = 2
    row_biases: tuple[str, ...] = ()  # names local to the module
    reenter: bool = False
    addends: tuple[str, ...] = ()  # names local to the module

    def collectives(self) -> list[Collective]:
        return [Collective(hook=Hook.EXIT_REDUCE)] + ([Collective(hook=Hook.EXIT_GRAD)] if self.reenter else [])


@dataclass(frozen=True, kw_only=True)
class GatherOutput(ModuleOp):
    """The LM head's vocab-sharded logits are all-gathered (and unpadded) for the caller."""

    kind: ClassVar[str] = "gather_output"
    order: ClassVar[int] = 3
    vocab_size: int | None = None

    def collectives(self) -> list[Collective]:
        return [Collective(hook=Hook.EXIT_GATHER)]


@dataclass(frozen=True, kw_only=True)
class SplitStats(ModuleOp):
    """Statistics over features split across the TP group (OLMo-2's ``q_norm``: an
    RMSNorm over all heads), computed in this module's forward from partial sums::

        mean(x, dim) = Σ_r sum(x_r, dim) / size        (all-reduce forward and backward)

    Every ``ops`` entry (``sum`` / ``mean`` / ``var`` / ``std``, in execution order) reduces
    over ``dim`` (counted from the end), where this rank holds ``local`` of ``size``
    features; ``mean`` and ``var`` divide by the global count.  The result is whole on
    every rank and only split code reads it, so each rank's gradient of it is partial:
    the backward all-reduces it too (:mod:`tpcompile.analysis.stats`)."""

    kind: ClassVar[str] = "split_stats"
    order: ClassVar[int] = 1
    dim: int = -1
    size: int = 0
    local: int = 0
    ops: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        unknown = [o for o in self.ops if o not in STAT_ALL_REDUCES]
        if unknown or self.dim >= 0 or not 0 < self.local <= self.size:
            raise TPError(f"split statistics need a negative dim, 0 < local <= size and ops among "
                          f"{sorted(STAT_ALL_REDUCES)}; got dim={self.dim}, local={self.local}, "
                          f"size={self.size}, ops={list(self.ops)}")

    def collectives(self) -> list[Collective]:
        out = []
        for i, name in enumerate(self.ops):
            for _ in range(STAT_ALL_REDUCES[name]):
                out += [Collective(hook=Hook.STAT_REDUCE, index=i), Collective(hook=Hook.STAT_GRAD, index=i)]
        return out


@dataclass(frozen=True, kw_only=True)
class SliceInputs(ModuleOp):
    """Replicated arguments that carry no gradient, narrowed as the call enters to the
    rows of this rank's features (MPT's ALiBi ``position_bias`` to the local heads:
    :mod:`tpcompile.analysis.entries`).  Each entry of ``slices`` is ``(path, dim, size,
    index, period)``: the argument (``("kwargs", "position_bias")`` or ``("args", 2)``),
    its dim of ``size`` global rows, per TP rank the rows it keeps, and ``period`` (0, or
    ``size`` where the rows repeat per batch entry: BLOOM's ``batch * heads`` ALiBi).  No
    collective.

    Example:
        >>> import torch
        >>> op = SliceInputs(slices=((("kwargs", "bias"), 0, 4, ((0, 1), (2, 3)), 0),))
        >>> _, kw = op.apply((), {"bias": torch.arange(4.0)}, rank=1)
        >>> kw["bias"].tolist()
        [2.0, 3.0]
    """

    kind: ClassVar[str] = "slice_inputs"
    order: ClassVar[int] = 1
    slices: tuple = ()

    def __post_init__(self) -> None:  # JSON gives lists: the canonical form is tuples
        norm = tuple(((str(e[0][0]), e[0][1]), int(e[1]), int(e[2]), tuple(tuple(int(i) for i in r) for r in e[3]),
                      int(e[4]) if len(e) > 4 else 0) for e in self.slices)
        if any(p[0] not in ("args", "kwargs") for p, *_ in norm):
            raise TPError(f"slice_inputs: a path is ('args', i) or ('kwargs', name), got {[p for p, *_ in norm]}")
        object.__setattr__(self, "slices", norm)

    def collectives(self) -> list[Collective]:
        return []

    def apply(self, args: tuple, kwargs: dict, rank: int, where: str = "") -> tuple[tuple, dict]:
        """``(args, kwargs)`` with each sliced argument narrowed to ``rank``'s rows; an
        argument missing or of another size than planned is a :class:`TPError`."""
        from ..analysis.entries import narrow_args

        return narrow_args(args, kwargs, self.slices, rank, where)


@dataclass(frozen=True, kw_only=True)
class SliceBuffers(ModuleOp):
    """Buffers this module's forward applies elementwise to split features, narrowed to
    this rank's rows for the call and restored after it (Falcon-H1's ``mup_vector``
    scaling ``in_proj``'s split output): the module keeps the whole buffer, so
    ``state_dict``, delayed init and checkpoints see it unchanged.  Each entry of
    ``slices`` is ``(path, dim, size, runs)``: the buffer's path under this module, its dim
    of ``size`` global rows and, per TP rank, the runs ``[start, stop)`` of rows it keeps
    (``[-1, n]``: ``n`` padding rows, which meet only zero features).  No collective, but
    for the ``updated`` buffers of a module in training mode: one all-gather each.

    Example:
        >>> import torch
        >>> op = SliceBuffers(slices=(("scale", 0, 4, (((0, 2),), ((2, 4),))),))
        >>> op.local(torch.arange(4.0), 0, rank=1).tolist()
        [2.0, 3.0]
    """

    kind: ClassVar[str] = "slice_buffers"
    order: ClassVar[int] = 1
    slices: tuple = ()
    # paths a training forward updates in place (BatchNorm's running statistics): after
    # it, every rank's rows are all-gathered back into the whole buffer
    updated: tuple[str, ...] = ()

    def __post_init__(self) -> None:  # JSON gives lists: the canonical form is tuples
        from .types import runs_to_index

        object.__setattr__(self, "slices", tuple(
            (str(e[0]), int(e[1]), int(e[2]), tuple(tuple((int(a), int(b)) for a, b in r) for r in e[3]))
            for e in self.slices))
        # each slice's rows per rank, built once (``local`` runs in every forward); not a field
        object.__setattr__(self, "_rows", tuple(tuple(runs_to_index([list(r)])[0] for r in e[3])
                                                for e in self.slices))

    def collectives(self) -> list[Collective]:
        # a training forward only: what a training step prices
        return [Collective(hook=Hook.BUFFER_GATHER, param=path) for path in self.updated]

    def local(self, buffer: Any, i: int, rank: int, where: str = "") -> Any:
        """``rank``'s rows of the ``i``-th sliced buffer (padding rows: zeros)."""
        from .types import select_rows

        path, dim, size, _ = self.slices[i]
        if buffer.dim() <= dim or buffer.shape[dim] != size:
            raise TPError(f"{where or 'a module'}: the plan slices its buffer {path} to this rank's rows of "
                          f"{size} along dim {dim}, but it holds {list(buffer.shape)}: the buffer changed "
                          "since the model was planned; plan it again")
        return select_rows(buffer, dim, self._rows[i][rank])


@dataclass(frozen=True, kw_only=True)
class WholeMasks(ModuleOp):
    """Dropout masks this module's training forward draws over split features, drawn at
    their whole shape from the same generator and narrowed to this rank's rows, so they
    are the masks one process draws (:mod:`tpcompile.analysis.masks`).  Each site is
    ``(ndim, dim, size, index, fixed)``: the mask's dims, its split dim of ``size`` global
    rows, per TP rank the rows it keeps, and ``(dim, local size)`` of its other feature
    dims.  No collective: each rank draws ``size / local`` times the numbers it keeps.

    Example:
        >>> op = WholeMasks(sites=((4, 1, 8, ((0, 1, 2, 3), (4, 5, 6, 7)), ()),))
        >>> op.collectives()
        []
    """

    kind: ClassVar[str] = "whole_masks"
    order: ClassVar[int] = 1
    sites: tuple = ()

    def __post_init__(self) -> None:  # JSON gives lists: the canonical form is tuples
        object.__setattr__(self, "sites", tuple(
            (int(e[0]), int(e[1]), int(e[2]), tuple(tuple(int(i) for i in r) for r in e[3]),
             tuple((int(d), int(n)) for d, n in e[4])) for e in self.sites))

    def collectives(self) -> list[Collective]:
        return []


OP_KINDS: dict[str, type[ModuleOp]] = {c.kind: c for c in (GradSum, EnterRegion, VocabEmbedding, ReduceOutput,
                                                            GatherOutput, SplitStats, SliceInputs, SliceBuffers,
                                                            WholeMasks)}


@dataclass(kw_only=True)
class ModulePlan:
    """The collectives around one module's forward, and its attribute fix-ups.

    Example:
        >>> mp = ModulePlan(fqn="model.layers.0.self_attn.o_proj", ops=[ReduceOutput()])
        >>> [(c.phase, c.op) for c in mp.collectives()]
        [('forward', 'all_reduce')]
    """

    fqn: str
    ops: list[ModuleOp] = field(default_factory=list)
    attr_fixups: dict[str, list[int]] = field(default_factory=dict)  # attr -> [global, local]

    def __post_init__(self) -> None:
        kinds = [op.kind for op in self.ops]
        if len(set(kinds)) != len(kinds):
            raise TPError(f"module plan {self.fqn}: each op kind at most once, got {kinds}")
        if {"vocab_embedding", "reduce_output"} <= set(kinds) or {"vocab_embedding", "gather_output"} <= set(kinds):
            raise TPError(f"module plan {self.fqn}: a vocab-parallel embedding reduces its own output ({kinds})")
        self.ops = sorted(self.ops, key=lambda op: op.order)

    def op(self, kind: type[ModuleOp]) -> ModuleOp | None:
        """This module's op of type ``kind``, if it has one."""
        return next((op for op in self.ops if isinstance(op, kind)), None)

    def add(self, op: ModuleOp) -> None:
        """Add ``op``, merging a :class:`GradSum` / :class:`ReduceOutput` of the same kind."""
        old = self.op(type(op))
        if old is not None:
            self.ops.remove(old)
            if isinstance(op, GradSum):
                op = GradSum(params=(*old.params, *op.params))
            elif isinstance(op, ReduceOutput):
                op = ReduceOutput(row_biases=(*old.row_biases, *op.row_biases), reenter=old.reenter or op.reenter)
        self.ops = sorted([*self.ops, op], key=lambda o: o.order)

    def collectives(self, replicas: Iterable[str] = ()) -> list[Collective]:
        """The collectives one call issues, in hook order; ``replicas`` are the module-local
        names of parameters whose rows several ranks hold (``layout == "kv_replicated"``)."""
        out = [Collective(hook=Hook.REPLICA_SUM, param=n) for n in sorted(set(replicas))]
        for op in self.ops:
            out += op.collectives()
        return out

    # -- queries the analysis stages read (derived from ``ops``, never stored) --------
    @property
    def hooked(self) -> bool:
        return bool(self.ops)

    @property
    def enters(self) -> bool:
        return self.op(EnterRegion) is not None

    @property
    def reduces(self) -> bool:
        return self.op(ReduceOutput) is not None

    @property
    def gathers(self) -> bool:
        return self.op(GatherOutput) is not None

    @property
    def row_biases(self) -> tuple[str, ...]:
        op = self.op(ReduceOutput)
        return op.row_biases if op is not None else ()

    @property
    def grad_params(self) -> tuple[str, ...]:
        op = self.op(GradSum)
        return op.params if op is not None else ()

    def to_dict(self) -> dict[str, Any]:
        return {"fqn": self.fqn, "ops": [op.to_dict() for op in self.ops], "attr_fixups": dict(self.attr_fixups)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModulePlan:
        ops = []
        for entry in d.get("ops", []):
            entry = dict(entry)
            kind = entry.pop("kind", None)
            if kind not in OP_KINDS:
                raise TPError(f"module plan {d.get('fqn')!r}: unknown op kind {kind!r}; known: {sorted(OP_KINDS)}")
            ops.append(OP_KINDS[kind](**{k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()}))
        return cls(fqn=d["fqn"], ops=ops, attr_fixups=dict(d.get("attr_fixups", {})))

    @classmethod
    def from_flags(cls, d: dict[str, Any]) -> ModulePlan:
        """A version-1 plan's module entry (a set of booleans) as typed ops."""
        ops: list[ModuleOp] = []
        if d.get("grad_allreduce"):
            ops.append(GradSum(params=tuple(d["grad_allreduce"])))
        if d.get("copy_inputs"):
            ops.append(EnterRegion())
        if d.get("vocab_parallel"):
            ops.append(VocabEmbedding(vocab_size=d.get("vocab_size")))
        else:
            if d.get("reduce_output"):
                ops.append(ReduceOutput(row_biases=tuple(d.get("row_biases", ()))))
            if d.get("gather_output"):
                ops.append(GatherOutput(vocab_size=d.get("vocab_size")))
        return cls(fqn=d["fqn"], ops=ops, attr_fixups=dict(d.get("attr_fixups", {})))
