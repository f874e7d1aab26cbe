"""The sequence plan as data: where the residual stream is split and gathered.

:func:`~tpcompile.plan.sequence.plan_sequence` builds a :class:`SequencePlan`,
:func:`~tpcompile.runtime.sequence.install_sequence_parallel` hooks it onto the model,
and ``Plan.to_json`` / ``Plan.from_json`` round trip it (its JSON section keeps the
compact list form: ``[path, dim]``, ``[path, dim, fused]``, ``[path, dim, row]``).

A *path* names a forward argument or output leaf: ``["kwargs", "hidden_states"]``,
``["args", 0]``, ``[0]`` (the first output), ``[]`` (the value itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["Path", "RegionGather", "RegionPlan", "RegionSplit", "SequencePlan", "StackPlan", "TokenGradSum",
           "TokenSlot"]

Path = list[Any]


@dataclass(kw_only=True)
class TokenSlot:
    """A token-carrying argument or output: where it is and its token dim."""

    path: Path
    dim: int

    def to_list(self) -> list[Any]:
        return [self.path, self.dim]

    @classmethod
    def from_list(cls, v: list[Any]) -> TokenSlot:
        path, dim = v
        return cls(path=list(path), dim=int(dim))


@dataclass(kw_only=True)
class StackPlan:
    """One stack of blocks: the stream is split entering ``first`` and gathered leaving
    ``last``."""

    first: str
    last: str
    stream: TokenSlot  # the first block's residual-stream argument
    output: TokenSlot  # the last block's stream output

    def to_dict(self) -> dict[str, Any]:
        return {"first": self.first, "last": self.last, "stream": self.stream.to_list(),
                "output": self.output.to_list()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StackPlan:
        return cls(first=d["first"], last=d["last"], stream=TokenSlot.from_list(d["stream"]),
                   output=TokenSlot.from_list(d["output"]))


@dataclass(kw_only=True)
class RegionGather:
    """A region argument that arrives token-split and is all-gathered on entry.
    ``fused``: only column-parallel modules read it, so the gather's backward
    reduce-scatter replaces their all-reduce (Megatron's pair)."""

    path: Path
    dim: int
    fused: bool = False

    def to_list(self) -> list[Any]:
        return [self.path, self.dim, self.fused]

    @classmethod
    def from_list(cls, v: list[Any]) -> RegionGather:
        path, dim, fused = v
        return cls(path=list(path), dim=int(dim), fused=bool(fused))


@dataclass(kw_only=True)
class RegionSplit:
    """A region output that leaves token-split. ``row``: the row-parallel module whose
    own output it is (its partial sum leaves with a reduce-scatter); ``None``: split."""

    path: Path
    dim: int
    row: str | None = None

    def to_list(self) -> list[Any]:
        return [self.path, self.dim, self.row]

    @classmethod
    def from_list(cls, v: list[Any]) -> RegionSplit:
        path, dim, row = v
        return cls(path=list(path), dim=int(dim), row=row)


@dataclass(kw_only=True)
class RegionPlan:
    """A module that runs on all tokens inside a split stack."""

    stack: str
    gather: list[RegionGather] = field(default_factory=list)
    split: list[RegionSplit] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"stack": self.stack, "gather": [g.to_list() for g in self.gather],
                "split": [s.to_list() for s in self.split]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RegionPlan:
        return cls(stack=d["stack"], gather=[RegionGather.from_list(g) for g in d.get("gather", [])],
                   split=[RegionSplit.from_list(s) for s in d.get("split", [])])


@dataclass(kw_only=True)
class TokenGradSum:
    """A module's parameters applied to token slices (norm weights): their gradient is
    summed over the group. ``params``: names local to the module."""

    stack: str
    params: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"stack": self.stack, "params": list(self.params)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenGradSum:
        return cls(stack=d["stack"], params=list(d.get("params", [])))


@dataclass(kw_only=True)
class SequencePlan:
    """The plan's ``sequence`` section: per split stack, per region, per module summing
    gradients; ``refused``: blocks kept whole and why."""

    stacks: dict[str, StackPlan] = field(default_factory=dict)
    regions: dict[str, RegionPlan] = field(default_factory=dict)
    grad_sum: dict[str, TokenGradSum] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"stacks": {k: v.to_dict() for k, v in self.stacks.items()},
                "regions": {k: v.to_dict() for k, v in self.regions.items()},
                "grad_sum": {k: v.to_dict() for k, v in self.grad_sum.items()},
                "refused": dict(self.refused)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SequencePlan:
        return cls(stacks={k: StackPlan.from_dict(v) for k, v in d.get("stacks", {}).items()},
                   regions={k: RegionPlan.from_dict(v) for k, v in d.get("regions", {}).items()},
                   grad_sum={k: TokenGradSum.from_dict(v) for k, v in d.get("grad_sum", {}).items()},
                   refused=dict(d.get("refused", {})))
