"""The plan: what tpcompile decided, as plain data.

A :class:`Plan` says, for every parameter, its role and how its global (Hugging Face)
tensor maps to each rank's shard, and for every module, which collectives wrap it.
``dump-plan`` prints exactly this object; ``Plan.to_json`` / ``Plan.from_json`` round
trip it; ``transform(..., overrides=...)`` uses the same keys (parameter FQNs, or
``"re:<regex>"``) to force a role.

Index maps are stored as runs: rank ``r`` holds the global rows
``concat(range(a, b) for a, b in runs[r])`` of the sharded dim (``-1`` padding runs are
written ``[-1, n]``: ``n`` zero rows).
"""

from __future__ import annotations

import enum
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from .modules import ModulePlan
from .sequence_types import SequencePlan

__all__ = [
    "PLAN_VERSION", "ExpertsPlan", "ModulePlan", "ParamPlan", "Plan", "Role", "index_to_runs",
    "forward_holder", "renamed_fqn", "runs_to_index", "select_rows",
]

PLAN_VERSION = 2  # 2: module plans are typed ops (1: booleans, still read)


class Role(str, enum.Enum):
    """What a parameter does under tensor parallelism."""

    COLUMN = "column"  # output features split: Y_r = X W_r
    ROW = "row"  # input features split: Y = sum_r X_r W_r (all-reduce)
    VOCAB_EMBEDDING = "vocab_embedding"  # rows split, masked lookup + all-reduce
    LM_HEAD = "lm_head"  # column over the vocabulary; logits gathered or loss-parallel
    SHARDED = "sharded"  # a bias / per-head parameter split like the features it meets
    GRAD_ALLREDUCE = "replicated_grad_allreduce"  # replicated, applied to sharded features
    REPLICATED = "replicated"


def index_to_runs(index: np.ndarray) -> list[list[list[int]]]:
    """``(tp, local)`` index array → per-rank runs ``[[start, stop], ...]``."""
    out: list[list[list[int]]] = []
    for row in np.asarray(index, dtype=np.int64):
        if row.size == 0:
            out.append([])
            continue
        pad = row < 0
        # a run breaks where padding starts/stops or the next index is not previous + 1
        brk = np.ones(row.size, dtype=bool)
        brk[1:] = (pad[1:] != pad[:-1]) | (~pad[1:] & (row[1:] != row[:-1] + 1))
        starts = np.nonzero(brk)[0]
        ends = np.append(starts[1:], row.size)
        out.append([
            [-1, int(e - s)] if pad[s] else [int(row[s]), int(row[e - 1]) + 1]
            for s, e in zip(starts.tolist(), ends.tolist(), strict=True)
        ])
    return out


def select_rows(full: torch.Tensor, dim: int, index: np.ndarray) -> torch.Tensor:
    """``full``'s entries ``index`` along ``dim``; ``-1`` (padding) entries are zeros."""
    idx = torch.as_tensor(index, dtype=torch.long)
    pad = idx < 0  # decided on the CPU: ``full`` may be on the meta device
    local = full.index_select(dim, idx.clamp(min=0).to(full.device))
    if bool(pad.any()) and full.device.type != "meta":
        shape = [1] * local.dim()
        shape[dim] = -1
        local = local.masked_fill(pad.to(full.device).view(shape), 0)
    return local.contiguous()


def runs_to_index(runs: list[list[list[int]]]) -> np.ndarray:
    rows = []
    for rank_runs in runs:
        parts = [np.full(b, -1) if a == -1 else np.arange(a, b) for a, b in rank_runs]
        rows.append(np.concatenate(parts) if parts else np.zeros(0, np.int64))
    return np.stack(rows).astype(np.int64)


@dataclass(kw_only=True)
class ParamPlan:
    """One parameter's role and layout (``shard_dim`` is ``None`` unless split)."""

    fqn: str
    role: Role
    module: str
    global_shape: list[int]
    local_shape: list[int]
    shard_dim: int | None = None
    layout: str = "replicated"  # contiguous | fused | kv_replicated | padded | replicated
    runs: list[list[list[int]]] | None = None
    tied_to: list[str] = field(default_factory=list)
    # the module whose forward uses the parameter, when that is an ancestor of its owner
    # (Mamba's mixer calls conv1d(x, self.conv1d.weight)): its local tensor is swapped in
    # for that module's whole forward; ``None``: the owner
    scope: str | None = None
    # a parameter of 2+ dims the plan keeps whole: why (what in the dataflow stopped the split)
    whole_because: str = ""
    # rows the forward uses several times on one rank (a KV head read by several of its
    # query heads where they straddle KV groups) are held once: per rank, the positions
    # of the held rows (``runs``) the forward reads, as runs; ``None``: the rows as held
    expand: list[list[list[int]]] | None = None

    def index(self) -> np.ndarray | None:
        """Each rank's global rows along ``shard_dim``, as held (``-1``: padding)."""
        return None if self.runs is None else runs_to_index(self.runs)

    def compute_index(self) -> np.ndarray | None:
        """Each rank's global rows as its forward reads them (held rows repeated per
        ``expand``)."""
        index = self.index()
        if index is None or self.expand is None:
            return index
        return np.stack([row[at] for row, at in zip(index, runs_to_index(self.expand), strict=True)])

    def compute_shape(self) -> list[int]:
        """The local shape the forward sees (``local_shape`` unless rows are expanded)."""
        if self.expand is None or self.shard_dim is None:
            return list(self.local_shape)
        shape = list(self.local_shape)
        shape[self.shard_dim] = sum(b - a for a, b in self.expand[0])
        return shape


@dataclass(kw_only=True)
class ExpertsPlan:
    """One stacked-experts module found from the dataflow (``tpcompile.plan.experts``).

    Under expert parallelism over ``ep`` ranks, each rank holds experts
    ``[r * E/ep, (r+1) * E/ep)`` of every parameter in ``params`` (dim 0) and the
    module's attributes in ``size_attrs`` (``attr -> [E, E/ep]``, e.g. ``num_experts``)
    read their local value while it runs."""

    fqn: str
    num_experts: int
    params: list[str] = field(default_factory=list)  # names local to the module
    size_attrs: dict[str, list[int]] = field(default_factory=dict)


@dataclass(kw_only=True)
class Plan:
    """Everything ``transform`` decided for one model at one ``tp``.

    Example:
        >>> plan = tpcompile.plan_model(model, tp=8)             # doctest: +SKIP
        >>> plan.params["model.layers.0.self_attn.q_proj.weight"].role
        <Role.COLUMN: 'column'>
    """

    tp: int
    model_class: str = ""
    params: dict[str, ParamPlan] = field(default_factory=dict)
    modules: dict[str, ModulePlan] = field(default_factory=dict)
    loss_parallel: bool = False
    # the repeated transformer blocks the capture found (FSDP wrap units, checkpoint units)
    blocks: list[str] = field(default_factory=list)
    # stacked-experts modules (every MoE layer), and the expert-parallel degree planned for
    experts: dict[str, ExpertsPlan] = field(default_factory=dict)
    ep: int = 1
    # modules whose linear scores an MoE's topk (every block): kept high precision by fp8
    routers: list[str] = field(default_factory=list)
    # sequence parallelism (tpcompile.plan.sequence.plan_sequence): where the residual stream
    # is split and gathered; ``None``: off
    sequence: SequencePlan | None = None
    warnings: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION

    def roles(self) -> dict[str, str]:
        return {k: v.role.value for k, v in self.params.items()}

    def renamed(self, module_name: Callable[[str], str | None], model_class: str) -> Plan:
        """The same plan for the same modules under new names (``module_name`` maps an old
        module FQN to its new one, ``None``: the module is gone, and so are its entries).
        For a model whose modules moved (PEFT's ``merge_and_unload``)."""
        def fqn(name: str) -> str | None:
            return renamed_fqn(name, module_name)

        params = {}
        for name, pp in self.params.items():
            new = fqn(name)
            if new is not None:
                params[new] = replace(pp, fqn=new, module=module_name(pp.module) or "",
                                      tied_to=[a for a in map(fqn, pp.tied_to) if a is not None],
                                      scope=None if pp.scope is None else module_name(pp.scope))
        modules = {module_name(k): replace(m, fqn=module_name(k)) for k, m in self.modules.items()
                   if module_name(k) is not None}
        return replace(self, model_class=model_class, params=params, modules=modules,
                       blocks=[b for b in map(module_name, self.blocks) if b is not None],
                       experts={module_name(k): replace(x, fqn=module_name(k)) for k, x in self.experts.items()
                                if module_name(k) is not None},
                       routers=[r for r in map(module_name, self.routers) if r is not None])

    def over_ideal(self) -> float:
        """One rank's parameter elements over the ideal share (all of them / tp): 1.0 when
        everything splits, ``tp`` when nothing does."""
        total = sum(math.prod(p.global_shape) for p in self.params.values())
        local = sum(math.prod(p.local_shape) for p in self.params.values())
        return local * self.tp / total if total else 1.0

    def kept_whole(self, top: int = 3) -> list[dict[str, Any]]:
        """The largest parameters of 2+ dims the plan keeps whole, one row per name with
        its block index as ``*`` (``count`` copies), largest first, each with its reason."""
        groups: dict[str, dict[str, Any]] = {}
        for name, p in self.params.items():
            if not p.whole_because or p.shard_dim is not None:
                continue
            key = re.sub(r"\.\d+\.", ".*.", name)
            g = groups.setdefault(key, {"name": key, "count": 0, "elements": 0, "shape": p.global_shape,
                                        "because": p.whole_because})
            g["count"] += 1
            g["elements"] += math.prod(p.global_shape)
        return sorted(groups.values(), key=lambda g: -g["elements"])[:top]

    def to_dict(self) -> dict[str, Any]:
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        version = d.get("version")
        if version not in (1, PLAN_VERSION):
            raise ValueError(f"plan version {version} is not supported (expected {PLAN_VERSION}, or 1)")
        params = {k: ParamPlan(**{**v, "role": Role(v["role"])}) for k, v in d["params"].items()}
        read = ModulePlan.from_flags if version == 1 else ModulePlan.from_dict
        modules = {k: read(v) for k, v in d["modules"].items()}
        experts = {k: ExpertsPlan(**v) for k, v in d.get("experts", {}).items()}
        # "cost" (dump-plan's derived section, tpcompile.tools.cost) is recomputed, not stored
        rest = {k: v for k, v in d.items() if k not in ("params", "modules", "cost", "experts", "version")}
        if rest.get("sequence") is not None:
            rest["sequence"] = SequencePlan.from_dict(rest["sequence"])
        return cls(params=params, modules=modules, experts=experts, **rest)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def forward_holder(model: nn.Module, path: str) -> str:
    """``path``, or its nearest ancestor with a forward of its own: a container
    (``ModuleList``, ``ParameterDict``) is only indexed, so a swap around its forward
    would never run."""
    containers = (nn.ModuleList, nn.ModuleDict, nn.ParameterList, nn.ParameterDict)
    while path and isinstance(model.get_submodule(path), containers):
        path = path.rpartition(".")[0]
    return path


def renamed_fqn(name: str, module_name: Callable[[str], str | None]) -> str | None:
    """``name`` (``"<module>.<leaf>"``) under its module's new name (``None``: gone)."""
    owner, _, leaf = name.rpartition(".")
    new = module_name(owner)
    return None if new is None else f"{new}.{leaf}" if new else leaf


def _plain(value: Any) -> Any:
    """``value`` as JSON-ready data: typed entries through their own ``to_dict``."""
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value
