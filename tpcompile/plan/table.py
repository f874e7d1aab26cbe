"""The translation table: every state-dict tensor's HF name and layout, both ways.

tpcompile keeps the model's own module tree, so a parameter's name in the transformed
model is its Hugging Face name.  What changes is the layout: rank ``r`` holds the rows
``index[r]`` of the HF tensor along ``shard_dim`` (fused QKV / gate-up blocks, per-head
interleaves, KV heads copied onto several ranks, zero padding rows for a vocabulary
that does not divide).  The table stores exactly that, per tensor, as index runs, and
converts:

* HF → rank: ``to_local(key, hf, rank)`` = ``hf.index_select(dim, index[r])`` with
  padding rows zeroed; ``read_runs(key, rank)`` gives the HF row ranges to read from a
  file (shard-on-read);
* ranks → HF: ``to_hf(key, [local_0, ..., local_{tp-1}])`` takes each HF row from the
  first rank that holds it (KV copies deduplicated, padding dropped);
* tied weights: every alias has an entry; ``saved_as`` names the one key an HF file
  stores (the tie *source*, as ``save_pretrained`` keeps it).

Example:
    >>> table = model.tpcompile_table                                 # doctest: +SKIP
    >>> table.tensors["model.layers.0.self_attn.q_proj.weight"].read_runs(0)
    [(0, 0, 32)]
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import TPError
from .types import Plan, runs_to_index, select_rows

__all__ = ["TABLE_VERSION", "TensorMap", "TranslationTable", "build_table"]

TABLE_VERSION = 1


@dataclass(kw_only=True)
class TensorMap:
    """One state-dict key: HF shape/dtype and which HF rows each rank holds."""

    key: str
    saved_as: str  # the key an HF checkpoint stores this tensor under (itself unless tied)
    shape: list[int]  # HF (global) shape
    dtype: str  # "float32", "bfloat16", ...
    kind: str = "param"  # param | buffer
    shard_dim: int | None = None
    layout: str = "replicated"
    runs: list[list[list[int]]] | None = None  # per rank, [start, stop] or [-1, n] padding

    @cached_property
    def index(self) -> np.ndarray | None:
        return None if self.runs is None else runs_to_index(self.runs)

    @property
    def sharded(self) -> bool:
        return self.shard_dim is not None

    def local_shape(self) -> list[int]:
        shape = list(self.shape)
        if self.sharded:
            shape[self.shard_dim] = self.index.shape[1]
        return shape

    def read_runs(self, rank: int) -> list[tuple[int, int, int]]:
        """``(local_start, hf_start, hf_stop)`` for each non-padding run of ``rank``."""
        out, pos = [], 0
        for a, b in self.runs[rank]:
            n = b if a == -1 else b - a
            if a != -1:
                out.append((pos, a, b))
            pos += n
        return out

    def to_local(self, hf: torch.Tensor, rank: int) -> torch.Tensor:
        """This rank's shard of the HF tensor (padding rows are zeros)."""
        self.check_hf(hf)
        if not self.sharded:
            return hf
        return select_rows(hf, self.shard_dim, self.index[rank])

    @cached_property
    def _first_position(self) -> np.ndarray:
        """Flat position (rank-major) of the first copy of each HF row."""
        flat = self.index.reshape(-1)
        rows = self.shape[self.shard_dim]
        first = np.full(rows, -1, dtype=np.int64)
        valid = np.nonzero(flat >= 0)[0]
        # reversed assignment leaves the earliest position for duplicated rows
        first[flat[valid[::-1]]] = valid[::-1]
        if (first < 0).any():
            raise TPError(f"{self.key}: HF rows {np.nonzero(first < 0)[0][:5].tolist()} are held by no rank")
        return first

    def to_hf(self, locals_: list[torch.Tensor]) -> torch.Tensor:
        """The HF tensor from every rank's shard, in rank order."""
        if not self.sharded:
            return locals_[0]
        full = torch.cat(locals_, dim=self.shard_dim)
        if self.layout == "contiguous":  # rank r holds the r-th block: the concatenation is it
            return full
        idx = torch.as_tensor(self._first_position, device=full.device)
        return full.index_select(self.shard_dim, idx)

    def owned_rows(self, rank: int) -> list[tuple[int, int, int]]:
        """Like :meth:`read_runs`, restricted to the rows this rank is the first to hold:
        every HF row has exactly one owner, so sharded saves write it once."""
        local = self.index.shape[1]
        mine = (self._first_position >= rank * local) & (self._first_position < (rank + 1) * local)
        rows = np.nonzero(mine)[0]
        if rows.size == 0:
            return []
        pos = self._first_position[rows] - rank * local
        out: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, rows.size + 1):
            if i == rows.size or rows[i] != rows[i - 1] + 1 or pos[i] != pos[i - 1] + 1:
                out.append((int(pos[start]), int(rows[start]), int(rows[i - 1]) + 1))
                start = i
        return out

    def check_hf(self, hf: torch.Tensor) -> None:
        if list(hf.shape) != self.shape:
            raise TPError(
                f"{self.key}: checkpoint tensor has shape {list(hf.shape)}, the model expects {self.shape} "
                "(a checkpoint of another architecture or config?)"
            )


@dataclass(kw_only=True)
class TranslationTable:
    """HF ⇄ tpcompile for every state-dict key of one transformed model."""

    tp: int
    model_class: str = ""
    tensors: dict[str, TensorMap] = field(default_factory=dict)
    version: int = TABLE_VERSION

    def saved_keys(self) -> list[str]:
        """Keys an HF checkpoint holds (one per tied group), in state-dict order."""
        return [k for k, t in self.tensors.items() if t.saved_as == k]

    def aliases(self, key: str) -> list[str]:
        return [k for k, t in self.tensors.items() if t.saved_as == key and k != key]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def renamed(self, rename: Callable[[str], str | None], model_class: str) -> TranslationTable:
        """The table of the same tensors under new keys (``rename`` gives ``None``: gone);
        a tied group whose saved key is gone is saved under its first remaining key."""
        kept = {k: rename(k) for k in self.tensors}
        kept = {k: v for k, v in kept.items() if v is not None}
        groups: dict[str, list[str]] = {}
        for k in kept:
            groups.setdefault(self.tensors[k].saved_as, []).append(k)
        out = TranslationTable(tp=self.tp, model_class=model_class)
        for old, new in kept.items():
            t = self.tensors[old]
            saved = t.saved_as if t.saved_as in kept else groups[t.saved_as][0]
            out.tensors[new] = replace(t, key=new, saved_as=kept[saved])
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TranslationTable:
        if d.get("version") != TABLE_VERSION:
            raise TPError(f"translation table version {d.get('version')} is not supported "
                          f"(expected {TABLE_VERSION})")
        tensors = {k: TensorMap(**v) for k, v in d["tensors"].items()}
        return cls(tp=d["tp"], model_class=d.get("model_class", ""), tensors=tensors)

    @classmethod
    def from_json(cls, text: str) -> TranslationTable:
        return cls.from_dict(json.loads(text))


def _dtype_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _tie_targets(model: nn.Module) -> set[str]:
    """Names HF drops on save because they are tie *targets* (e.g. ``lm_head.weight``)."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    return set(tied)


def build_table(model: nn.Module, plan: Plan | None) -> TranslationTable:
    """The table for ``model`` (still untransformed: HF shapes) under ``plan``
    (``None``: an untransformed model, every tensor whole)."""
    plan = plan or Plan(tp=1, model_class=type(model).__name__)
    table = TranslationTable(tp=plan.tp, model_class=plan.model_class)
    targets = _tie_targets(model)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    saved_as = {n: next((k for k in names if k not in targets), names[0])
                for names in groups.values() for n in names}
    params = dict(model.named_parameters(remove_duplicate=False))
    for key, value in model.state_dict(keep_vars=True).items():
        pp = plan.params.get(key) if key in params else None
        if key in params and pp is None:
            pp = next((plan.params[a] for a in groups[id(params[key])] if a in plan.params), None)
        table.tensors[key] = TensorMap(
            key=key,
            saved_as=saved_as.get(key, key),
            shape=list(value.shape),
            dtype=_dtype_str(value.dtype),
            kind="param" if key in params else "buffer",
            shard_dim=pp.shard_dim if pp is not None else None,
            layout=pp.layout if pp is not None else "replicated",
            runs=pp.runs if pp is not None else None,
        )
    return table
