"""Checkpoints of pipelined models: every stage writes and reads its own tensors, under
the names the unsplit model's checkpoint uses, so the files are those of one model.

A rank of a pipelined model holds only its stages' modules (:mod:`tpcompile.runtime.pipeline`)
and its translation table covers only them.  Three things make a checkpoint whole anyway:

* **names** — a tensor is stored under the key the *unsplit* model's checkpoint stores it
  under (``saved_as`` of the whole model's table, read off the meta twin the pipeline
  keeps): GPT-2's ``lm_head.weight`` on the last stage is stored as its tied
  ``transformer.wte.weight``, which the unsplit model saves and the last stage loads;
* **once** — of the pp ranks holding a tensor (a tie's copies on two stages), one writes
  it: the first holding it under its stored name.  The copies are equal (their gradients
  are summed over the stages and the same update applied), so any one is the tensor;
* **one metadata** — the stages' tables, file headers and optimizer entries are gathered
  over the pp group (one rank per stage: small objects, never tensors) and merged in the
  unsplit model's key order; rank 0 writes the result, which is what an unsplit model at
  the same ``tp`` writes.

Without pipeline parallelism every function here is the identity (no collective), so the
callers need not branch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import TPError
from ..plan.table import TensorMap, TranslationTable, build_table

__all__ = ["Entry", "StageKeys", "gather_entries", "gather_stages", "merged_plan", "pipeline_of", "pp_layout",
           "stage_keys", "stage_mesh", "stored_names", "whole_table"]

# (key, dtype, shape) of one tensor in a file header
Entry = tuple[str, torch.dtype, list[int]]


def pipeline_of(model: nn.Module) -> Any:
    """The model's :class:`~tpcompile.runtime.pipeline.PipelineRun`, or ``None``."""
    return getattr(model, "tpcompile_pipeline", None)


def gather_stages(model: nn.Module, value: Any) -> list[Any]:
    """``value`` from this rank's counterpart on every pp rank, in pp order (``[value]``
    without pp).  Collective over the pp group: every rank calls it, in the same order."""
    run = pipeline_of(model)
    if run is None:
        return [value]
    group = run.pp_mesh.get_group()
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def whole_table(model: nn.Module) -> TranslationTable | None:
    """The unsplit model's table (HF names, shapes, ties; layouts at tp=1), ``None``
    without pp.  Built from the meta twin: no collective, no storage."""
    run = pipeline_of(model)
    return None if run is None else build_table(run.twin, None)


def stored_names(model: nn.Module, table: TranslationTable) -> dict[str, str]:
    """``{local key: the key a checkpoint stores it under}`` for every key of ``table``."""
    whole = whole_table(model)
    if whole is None:
        return {k: t.saved_as for k, t in table.tensors.items()}
    return {k: whole.tensors[k].saved_as if k in whole.tensors else t.saved_as for k, t in table.tensors.items()}


@dataclass(frozen=True)
class StageKeys:
    """Which of this rank's tensors it writes, under which names, and the whole model's table."""

    stored: dict[str, str]  # every local key -> the key a checkpoint stores it under
    writes: list[str]  # local saved keys this rank writes (each stored key by one pp rank only)
    table: TranslationTable  # every stage's entries merged, in the unsplit model's order
    writer: dict[str, tuple[int, str]]  # stored key -> (pp rank, local key) of the one that writes it

    def written(self) -> set[str]:
        """The stored keys this rank writes."""
        return {self.stored[k] for k in self.writes}


def stage_keys(model: nn.Module, table: TranslationTable) -> StageKeys:
    """Who writes what (collective over the pp group; none without pp)."""
    stored = stored_names(model, table)
    run = pipeline_of(model)
    if run is None:
        return StageKeys(stored=stored, writes=table.saved_keys(), table=table,
                         writer={k: (0, k) for k in table.saved_keys()})
    whole = whole_table(model)
    mine = {"tensors": {k: asdict(t) for k, t in table.tensors.items()},
            "saved": [(k, stored[k]) for k in table.saved_keys()]}
    stages = gather_stages(model, mine)
    writer: dict[str, tuple[int, str]] = {}
    for pp_rank, stage in enumerate(stages):
        for key, name in stage["saved"]:
            # the first holder under the stored name wins; a copy under another name only
            # while no holder of the name itself has been seen
            if name not in writer or (writer[name][1] != name and key == name):
                writer[name] = (pp_rank, key)
    missing = [k for k in whole.saved_keys() if k not in writer]
    if missing:
        raise TPError(f"no pipeline stage holds {missing[:3]}: a checkpoint of this model would be incomplete")
    merged = TranslationTable(tp=table.tp, model_class=table.model_class)
    for key, t in whole.tensors.items():
        held = next((s["tensors"][key] for s in stages if key in s["tensors"]), None)
        if held is None and key in writer:  # a stored key no stage holds under its own name
            pp_rank, local = writer[key]
            held = stages[pp_rank]["tensors"][local]
        if held is not None:
            merged.tensors[key] = TensorMap(**{**held, "key": key, "saved_as": t.saved_as})
    writes = [k for k in table.saved_keys() if writer[stored[k]] == (run.pp_rank, k)]
    return StageKeys(stored=stored, writes=writes, table=merged, writer=writer)


def gather_entries(model: nn.Module, entries: list[Entry], order: list[str] | None = None) -> list[Entry]:
    """Every stage's file-header entries, each key once, in ``order`` (default: pp order).
    Collective over the pp group; ``entries`` itself without pp."""
    if pipeline_of(model) is None:
        return entries
    out: dict[str, Entry] = {}
    for stage in gather_stages(model, entries):
        for entry in stage:
            out.setdefault(entry[0], entry)
    if order is None:
        return list(out.values())
    rank = {k: i for i, k in enumerate(order)}
    return sorted(out.values(), key=lambda e: rank.get(e[0], len(rank)))


def merged_plan(model: nn.Module) -> dict[str, Any] | None:
    """The plan as metadata: with pp, every stage's entries in one dict (collective)."""
    plan = getattr(model, "tpcompile_plan", None)
    mine = plan.to_dict() if plan is not None else None
    if pipeline_of(model) is None or mine is None:
        return mine
    stages = gather_stages(model, mine)
    out = dict(stages[0])
    for field in ("params", "modules", "experts"):
        out[field] = {k: v for s in stages for k, v in s[field].items()}
    out["blocks"] = [b for s in stages for b in s["blocks"]]
    order = {b: i for i, b in enumerate(pipeline_of(model).plan.stage_of_block())}
    out["blocks"].sort(key=lambda b: order.get(b, len(order)))
    return out


def pp_layout(model: nn.Module) -> dict[str, int]:
    """``{"pp": size}`` of a pipelined model, ``{}`` otherwise (a checkpoint's layout)."""
    run = pipeline_of(model)
    return {} if run is None else {"pp": run.pp_mesh.size()}


_stage_meshes: dict[tuple, DeviceMesh] = {}


def stage_mesh(model: nn.Module, device: str) -> DeviceMesh | None:
    """A 1-D mesh (of ``device``'s type) over the ranks of this rank's pipeline stage (its
    pp coordinate), on which a sharded checkpoint cuts the stage's tensors into row
    chunks; ``None`` without pp.

    Created once per layout, by every rank in step (one ``new_group`` per stage).
    """
    run = pipeline_of(model)
    if run is None:
        return None
    root = run.pp_mesh._get_root_mesh()  # (pp, dp_replicate, dp_shard, tp)
    key = (device, tuple(root.shape), tuple(root.mesh.flatten().tolist()))
    if key not in _stage_meshes:
        mine = None
        for p in range(root.shape[0]):
            ranks = root.mesh[p].flatten().tolist()
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = DeviceMesh.from_group(group, device)
        _stage_meshes[key] = mine
    return _stage_meshes[key]
