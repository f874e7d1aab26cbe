"""Pipeline parallelism: one model, cut between blocks, each rank keeping its stages.

The model stays the Hugging Face model.  On each rank it holds only the modules of the
stages that rank runs (:class:`~tpcompile.plan.stages.StagePlan`), under their HF names,
so ``named_parameters()`` and ``state_dict()`` are this rank's part of the unsplit
model's.  A stage runs by calling the model's **own forward** on the microbatch:

* the blocks of the stack are looked up through :class:`_StageBlocks`, which hands the
  forward, for block ``i`` of stage ``s``: the real block if stage ``s`` owns it (the
  first of them taking the hidden state received from stage ``s - 1``), a pass-through
  for an earlier stage's block, and for a later stage's block a stop that ends the
  forward, returning the hidden state it was given — what is sent to stage ``s + 1``;
* modules outside the blocks that stage ``s`` does not own (the embedding on a later
  stage, the head on an earlier one) answer with zeros of the shape their meta copy
  computes: values that the received hidden state replaces or that are never reached.

So masks, rotary tables and positions are recomputed on every stage from the batch by the
model's own code (:mod:`tpcompile.analysis.boundaries` proves they carry no gradient),
and only the hidden state crosses a boundary — with the values transformers' output
capture records inside blocks for the code after them (MoE router logits): a stage sends
every entry recorded so far and a later stage's pass-through blocks record the received
ones where the earlier blocks would have.  The last stage's output is the model's own
loss, weighted by the microbatch's share of the batch's tokens, so the sum over
microbatches is the unsplit model's loss.  The schedules are torch's
(``torch.distributed.pipelining``): each stage is a :class:`StageModule` in a
``PipelineStage``; under FSDP2 the stage module is the FSDP root of its blocks, so
gradients are reduce-scattered once per step.  The training step is
:func:`tpcompile.pipeline_step`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_map_only

from ..analysis.boundaries import Boundaries, meta_copy, probe_boundaries, recorded_outputs
from ..errors import TPError
from ..plan.stages import Stage, StagePlan
from .markers import GUARDED_FORWARDS

__all__ = ["PipelineRun", "StageModule", "TiedParameter", "shape_key", "split_model", "sum_tied_gradients"]


class _Cut(Exception):  # noqa: N818 - a control-flow signal, not an error
    """Raised by a later stage's block: the forward of this stage ends here, sending the
    hidden state (and the carried entries recorded so far)."""

    def __init__(self, value: torch.Tensor | tuple[torch.Tensor, ...]) -> None:
        super().__init__("pipeline stage boundary")
        self.value = value


@dataclass
class TiedParameter:
    """A parameter several stages read (tied embeddings): its gradient is summed over
    the ranks holding it."""

    names: list[str]  # its names on the stages that hold it (one per owning module)
    pp_ranks: list[int]
    group: Any = None  # this rank's process group of those pp ranks (None: not held here)


@dataclass
class PipelineRun:
    """The stages one rank runs and the state of the step in flight."""

    model: nn.Module
    plan: StagePlan
    bounds: Boundaries
    twin: nn.Module  # the untransformed model on meta: shapes and attributes of absent parts
    pp_mesh: DeviceMesh
    pp_rank: int
    stage_of_block: dict[str, int]
    stages: list[StageModule] = field(default_factory=list)
    ties: list[TiedParameter] = field(default_factory=list)
    current: int | None = None  # the stage running right now
    received: torch.Tensor | None = None
    received_carried: tuple[torch.Tensor, ...] = ()  # carried entries received, in record order
    microbatches: list[dict[str, Any]] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    schedules: dict[Any, Any] = field(default_factory=dict)  # by microbatch shapes
    probed: dict[Any, Boundaries] = field(default_factory=dict)  # shapes(), by microbatch shapes
    hidden_dtype: torch.dtype | None = None  # mixed precision's parameter dtype, if any
    # what the parallelisms applied after the split change at a boundary: CP hands each
    # rank its slice of the microbatch (``localize``: the microbatch as this rank's model
    # sees it); SP sends the hidden state split along a dim (``splits``: (dim, ways)); a
    # stage entered mid-stack tells SP its stream is open (``on_enter``: the first block's
    # call, before the received state replaces the stand-in's)
    localize: list[Callable[[dict[str, Any]], dict[str, Any]]] = field(default_factory=list)
    splits: list[tuple[int, int]] = field(default_factory=list)
    on_enter: list[Callable[[tuple, dict], None]] = field(default_factory=list)
    batch_checks: int = GUARDED_FORWARDS  # steps whose batch is still compared over the pp group

    def owns(self, stage: Stage) -> bool:
        return stage.rank == self.pp_rank

    def shapes(self, microbatch: dict[str, Any]) -> Boundaries:
        """The block boundaries at this microbatch's shapes (a meta forward of the twin on
        what this rank's model sees), the hidden state's shape as it crosses (split).  Probed
        once per shape: a fake-tensor forward of the whole model costs as much as a step."""
        key = shape_key(microbatch)
        if key not in self.probed:
            self.probed[key] = self._probe(microbatch)
        return self.probed[key]

    def _probe(self, microbatch: dict[str, Any]) -> Boundaries:
        for localize in self.localize:
            microbatch = localize(microbatch)
        bounds = probe_boundaries(self.twin, microbatch, self.bounds.blocks)
        shape = list(bounds.hidden_shape)
        for dim, ways in self.splits:
            shape[dim] = -(-shape[dim] // ways)
        return replace(bounds, hidden_shape=tuple(shape))


def shape_key(microbatch: dict[str, Any]) -> tuple:
    """What a microbatch's boundaries and schedule depend on: each entry's shape and dtype
    (a non-tensor option by value)."""
    return tuple((k, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (k, repr(v))
                 for k, v in microbatch.items())


class _Absent:
    """Stands in for a module this stage does not own: zeros of its output's shape."""

    def __init__(self, twin: nn.Module, name: str) -> None:
        self._twin, self._name = twin, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        device = next((t.device for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
        margs, mkwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        out = self._twin(*margs, **mkwargs)
        return tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device), out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._twin, name)

    def __repr__(self) -> str:
        return f"<{self._name}: on another pipeline stage>"


class _Skip:
    """An earlier stage's block: returns the hidden state it is given, as the block would,
    and records what the block recorded (received from the earlier stage)."""

    def __init__(self, twin: nn.Module, run: PipelineRun, name: str) -> None:
        self._twin, self._run, self._name = twin, run, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bounds = self._run.bounds
        if bounds.carried:
            got = recorded_outputs()
            for entry, value in zip(bounds.carried, self._run.received_carried, strict=False):
                if entry.block == self._name and entry.key in got:
                    got[entry.key].append(value)
        hidden = _hidden(bounds, args, kwargs)
        return (hidden, *bounds.rest) if bounds.returns_tuple else hidden

    def __getattr__(self, name: str) -> Any:
        return getattr(self._twin, name)


class _Stop(_Skip):
    """A later stage's block: this stage's output is the hidden state it is given, with
    every carried entry recorded so far."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        hidden = _hidden(self._run.bounds, args, kwargs)
        keys = list(dict.fromkeys(e.key for e in self._run.bounds.carried))
        if not keys:
            raise _Cut(hidden)
        got = recorded_outputs()
        if any(k not in got for k in keys):
            raise TPError(f"pipeline stage {self._run.current}: the model's forward did not record "
                          f"{', '.join(k for k in keys if k not in got)} as the boundaries' probe did; pass the "
                          "same output_* options every step")
        recorded = {k: iter(got[k]) for k in keys}
        carried = tuple(next(recorded[e.key]) for e in self._run.bounds.carried_before(self._name))
        # a received entry goes on unchanged: a view gives it its own node in this stage's graph
        raise _Cut((hidden, *(t.view_as(t) for t in carried)))


class _Enter:
    """A stage's first block on a stage after the first: it reads the received state."""

    def __init__(self, block: nn.Module, run: PipelineRun) -> None:
        self._block, self._run = block, run

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        for hook in self._run.on_enter:
            hook(args, kwargs)
        slot = self._run.bounds.hidden_arg
        if isinstance(slot, int):
            args = (*args[:slot], self._run.received, *args[slot + 1:])
        else:
            kwargs = {**kwargs, slot: self._run.received}
        return self._block(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._block, name)


def _hidden(bounds: Boundaries, args: tuple, kwargs: dict) -> torch.Tensor:
    slot = bounds.hidden_arg
    return args[slot] if isinstance(slot, int) and slot < len(args) else kwargs[slot if isinstance(slot, str)
                                                                             else "hidden_states"]


class _StageBlocks(nn.ModuleList):
    """The stack's ``ModuleList`` holding only this rank's blocks (under their indices).
    Inside a stage's forward it reads as the whole stack (see the module docstring)."""

    _pp_run: PipelineRun
    _pp_prefix: str
    _pp_length: int

    def _item(self, i: int) -> Any:
        run = self._pp_run
        name = f"{self._pp_prefix}.{i}"
        owner = run.stage_of_block[name]
        if owner == run.current:
            block = self._modules[str(i)]
            first = run.plan.stages[owner].blocks[0] == name
            return _Enter(block, run) if first and owner > 0 else block
        twin = run.twin.get_submodule(name)
        return (_Skip if owner < run.current else _Stop)(twin, run, name)

    def _in_stage(self) -> bool:
        return self._pp_run.current is not None

    def __len__(self) -> int:
        return self._pp_length if self._in_stage() else len(self._modules)

    def __iter__(self) -> Any:
        if not self._in_stage():
            return iter(self._modules.values())
        return (self._item(i) for i in range(self._pp_length))

    def __getitem__(self, idx: int | slice) -> Any:
        if not self._in_stage():
            if isinstance(idx, slice):
                return list(self._modules.values())[idx]
            return self._modules[str(idx)]
        if isinstance(idx, slice):
            return [self._item(i) for i in range(self._pp_length)[idx]]
        return self._item(idx % self._pp_length)


class _StageParent:
    """Mixed into the class of a module holding pre / post modules: an attribute that names
    a module the running stage does not own resolves to its :class:`_Absent`."""

    _pp_run: PipelineRun
    _pp_children: dict[str, tuple[str, int]]  # attribute -> (module fqn, owning stage index)

    def __getattr__(self, name: str) -> Any:
        entry = self.__dict__.get("_pp_children", {}).get(name)
        if entry is not None:
            fqn, owner = entry
            run = self._pp_run
            present = name in self.__dict__["_modules"]
            if not present or (run.current is not None and run.current != owner):
                return _Absent(run.twin.get_submodule(fqn), fqn)
        return super().__getattr__(name)  # type: ignore[misc]


def _mix_parent(parent: nn.Module) -> None:
    if isinstance(parent, _StageParent):
        return
    cls = type(parent)
    recorded = _recordable(parent)
    parent.__class__ = type(f"Stage{cls.__name__}", (_StageParent, cls), {})
    if recorded:  # transformers keys what a model records by its class's name: the new class records the same
        _recordable(parent, recorded)


def _recordable(model: nn.Module, value: dict | None = None) -> dict | None:
    """What transformers' output capture records for ``model``'s class (``value``: set it)."""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return None
    if value is not None:
        _CAN_RECORD_REGISTRY[model] = value
    return _CAN_RECORD_REGISTRY.get(model)


class StageModule(nn.Module):
    """One pipeline stage, as ``PipelineStage`` drives it: ``forward(x, *carried, mb)`` runs the
    model's forward on microbatch ``mb`` as this stage (``x``: the hidden state received,
    or on the first stage the microbatch index).  Its children are the stage's own
    modules (the same objects as in the model), so ``parameters()`` are the stage's."""

    def __init__(self, run: PipelineRun, stage: Stage, modules: dict[str, nn.Module]) -> None:
        super().__init__()
        object.__setattr__(self, "_run", run)  # not a child: the model is the stages' union
        self.index, self.first, self.last = stage.index, stage.first, stage.last
        for name, mod in modules.items():
            self.add_module(name.replace(".", "__"), mod)

    def forward(self, x: torch.Tensor, *carried: torch.Tensor, mb: torch.Tensor) -> Any:
        run: PipelineRun = self._run
        k = int(mb.reshape(-1)[0])
        run.current, run.received = self.index, (None if self.first else x)
        run.received_carried = carried
        try:
            out = run.model(**run.microbatches[k])
        except _Cut as cut:
            if self.last:
                raise
            return cut.value
        finally:
            run.current, run.received, run.received_carried = None, None, ()
        if not self.last:
            raise TPError(f"pipeline stage {self.index} ran the model's forward to its end without reaching the "
                          "next stage's first block")
        loss = getattr(out, "loss", None)
        if loss is None:
            raise TPError("pipeline_step: the model returned no loss; put labels in the batch")
        return loss * run.weights[k]


def _detach_from_parent(model: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = fqn.rpartition(".")
    return (model.get_submodule(parent_name) if parent_name else model), attr


def split_model(model: nn.Module, plan: StagePlan, bounds: Boundaries, mesh: DeviceMesh,
                twin: nn.Module | None = None) -> PipelineRun:
    """Keep this rank's stages of ``model`` in place, drop the rest; the run that drives
    them.  ``mesh`` is the whole ``(pp, dp_replicate, dp_shard, tp)`` mesh."""
    pp_mesh = mesh["pp"]
    pp_rank = pp_mesh.get_local_rank()
    run = PipelineRun(model=model, plan=plan, bounds=bounds, twin=twin if twin is not None else meta_copy(model),
                      pp_mesh=pp_mesh, pp_rank=pp_rank, stage_of_block=plan.stage_of_block())
    ties = _tied(model, plan)
    last = len(plan.stages) - 1
    mine = plan.stages_of_rank(pp_rank)
    owner_of = {**{n: 0 for n in plan.pre}, **{n: last for n in plan.post}}
    # a module inside another listed one goes (or stands in) with it: BERT's head owns a
    # bias and holds the modules of its transform
    outermost = {f: o for f, o in owner_of.items()
                 if not any(f.startswith(other + ".") for other in owner_of if other != f)}
    for fqn, owner in outermost.items():
        parent, attr = _detach_from_parent(model, fqn)
        _mix_parent(parent)
        parent._pp_run = run
        parent.__dict__.setdefault("_pp_children", {})[attr] = (fqn, owner)
        if plan.stages[owner].rank != pp_rank:
            del parent._modules[attr]
    stack = model.get_submodule(plan.stack)
    length = len(stack)
    owned_blocks = {b for s in mine for b in s.blocks}
    for i in range(length):
        if f"{plan.stack}.{i}" not in owned_blocks:
            del stack._modules[str(i)]
    stack.__class__ = _StageBlocks
    stack._pp_run, stack._pp_prefix, stack._pp_length = run, plan.stack, length
    for stage in mine:
        modules = {b: model.get_submodule(b) for b in stage.blocks}
        part = plan.pre if stage.first else plan.post if stage.last else []
        modules.update({n: model.get_submodule(n) for n in part})
        run.stages.append(StageModule(run, stage, modules))
    run.ties = _tie_groups(ties, mesh)
    model.register_forward_pre_hook(lambda *_: _refuse_plain_forward(run))
    return run


def _refuse_plain_forward(run: PipelineRun) -> None:
    """A forward outside a stage (``model(...)``, ``generate()``, a Trainer's own step)
    would run this rank's stages alone on stand-ins for the rest: refused."""
    if run.current is None:
        raise TPError(f"this model is pipelined (pp={run.plan.pp}): each rank holds only its stages, so "
                      "model(...) and generate() cannot run on it. Train with "
                      "loss = tpcompile.pipeline_step(model, batch) (a Trainer's training_step cannot drive "
                      "the schedule); to generate or evaluate, model.save_pretrained(dir) and load it "
                      "without pp (tpcompile.from_pretrained(dir, tp=...) or transformers' from_pretrained)")


def _tied(model: nn.Module, plan: StagePlan) -> list[TiedParameter]:
    """Parameters read by modules of stages on different pp ranks (before splitting)."""
    stage_of = {**{n: 0 for n in plan.pre}, **{n: len(plan.stages) - 1 for n in plan.post}}
    stage_of.update({b: s for b, s in plan.stage_of_block().items()})
    holders: dict[int, list[tuple[str, int]]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        owner = next((s for prefix, s in stage_of.items() if mname == prefix or mname.startswith(prefix + ".")),
                     None)
        if owner is None:
            continue
        for attr, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((f"{mname}.{attr}", owner))
    out = []
    for entries in holders.values():
        by_rank: dict[int, set[int]] = {}
        for _, owner in entries:
            by_rank.setdefault(plan.stages[owner].rank, set()).add(owner)
        shared = next((sorted(st) for st in by_rank.values() if len(st) > 1), None)
        if shared is not None:
            # each stage module is an FSDP2 root of its own: two roots on one rank would
            # shard one parameter twice, untying it
            names = ", ".join(n for n, _ in entries)
            raise TPError(f"pp_schedule={plan.schedule!r} puts stages {shared} on one rank, and they share the "
                          f"parameter {names} (tied weights): a V-shaped schedule holds the first and the last "
                          "stage together. Use interleaved_1f1b or zero_bubble (stages looped over the ranks), "
                          "or untie the weights")
        if len(by_rank) > 1:
            out.append(TiedParameter(names=[n for n, _ in entries], pp_ranks=sorted(by_rank)))
    return out


def _tie_groups(ties: list[TiedParameter], mesh: DeviceMesh) -> list[TiedParameter]:
    """One process group per tie and pp group, created by every rank in the same order."""
    if not ties:
        return ties
    rank = dist.get_rank()
    grid = mesh.mesh.reshape(mesh.mesh.shape[0], -1)  # (pp, every other coordinate)
    for tie in ties:
        for col in range(grid.shape[1]):
            ranks = [int(grid[r, col]) for r in tie.pp_ranks]
            group = dist.new_group(ranks)
            if rank in ranks:
                tie.group = group
    return ties


def sum_tied_gradients(run: PipelineRun) -> None:
    """Every tied parameter's gradient summed over the ranks holding it (Megatron's
    embedding all-reduce between the first and the last stage)."""
    for tie in run.ties:
        if tie.group is None:
            continue
        params = {id(p): p for n, p in run.model.named_parameters(remove_duplicate=False) if n in tie.names}
        for p in params.values():
            if p.grad is not None:
                local = p.grad._local_tensor if hasattr(p.grad, "_local_tensor") else p.grad
                dist.all_reduce(local, group=tie.group)
