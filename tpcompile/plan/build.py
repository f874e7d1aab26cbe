"""Building the plan: analyse the captured model and write down every decision.

:func:`plan_model` is the planning front door (no process group, no weights): capture,
analysis, the self-check of rank 0's localized model, then :func:`build_plan`, which
expands the analysed representative blocks to every block of the same structure and
records, per parameter, role and index map, and per module, its collectives and
attribute fix-ups; the expert and sequence plans are added last.
"""

from __future__ import annotations

import re
import time
import warnings
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
import torch.fx as fx
from torch import nn

from ..analysis.entries import EntryPaths
from ..analysis.masks import mask_sites
from ..analysis.partition import param_layout
from ..analysis.propagate import Rule, RuleSet, innermost_module, module_path
from ..analysis.reads import read_outside
from ..analysis.roles import Analyzed, analyze, key_matches
from ..analysis.selfcheck import SelfCheckError
from ..analysis.state import Feat, Partial
from ..analysis.tokens import TokenRule
from ..capture import Capture, capture, layer_stacks
from ..capture.fake import call_inputs
from ..capture.inputs import text_only
from ..config import check_degree
from ..errors import TPError
from .cache import cached_plan, plan_key
from .experts import expert_plans, find_routers
from .local_sizes import local_fixups, size_signature
from .modules import (
    EnterRegion,
    GatherOutput,
    GradSum,
    ModuleOp,
    ModulePlan,
    ReduceOutput,
    SliceBuffers,
    SliceInputs,
    SplitStats,
    VocabEmbedding,
    WholeMasks,
)
from .sides import plan_both_sides
from .types import ParamPlan, Plan, Role, forward_holder, index_to_runs, runs_to_index

__all__ = ["build_plan", "plan_model"]

_SELF_CHECK_RETRIES = 4  # strict=False: modules replicated one by one until the check passes


def _ruleset(rules: Iterable[Rule | TokenRule] | None) -> RuleSet:
    from tpcompile.rules import default_rules

    return RuleSet().add(default_rules()).add(rules or [])


def plan_model(
    model: nn.Module,
    tp: int,
    *,
    loss_parallel: bool = False,
    rules: Iterable[Rule | TokenRule] | None = None,
    overrides: dict[str, str] | None = None,
    strict: bool = True,
    example_inputs: dict[str, Any] | None = None,
    ep: int = 1,
    sequence_parallel: bool = False,
) -> Plan:
    """Decide how to split ``model`` over ``tp`` ranks, without touching it.

    Needs no process group and no weights: build the model on the meta device to plan a
    405B model on a laptop.  ``example_inputs`` is one batch of keyword arguments the
    forward accepts; by default it is built from the model itself
    (:func:`tpcompile.capture.example_inputs`).  The stacked-experts modules of a MoE
    model are recorded in ``plan.experts`` whatever ``ep``; with ``ep > 1`` (expert
    parallelism, applied by :func:`tpcompile.parallelize`) the expert count must divide
    by it and the attributes holding it are found.  ``rules`` extend the built-in ones
    (:mod:`tpcompile.rules`), later wins: feature rules steer the analysis, token rules
    which code ``sequence_parallel`` may run on a slice of the tokens.  With
    ``TPCOMPILE_PLAN_CACHE=<dir>`` set, the plan is traced once per model and arguments
    and read back by every other rank and run (:mod:`tpcompile.plan.cache`).

    Example:
        >>> with torch.device("meta"):
        ...     model = AutoModelForCausalLM.from_config(cfg)      # doctest: +SKIP
        >>> plan = plan_model(model, tp=8)
        >>> plan.params["lm_head.weight"].role.value
        'lm_head'
    """
    check_degree("tp", tp)
    check_degree("ep", ep)
    arguments = dict(tp=tp, loss_parallel=loss_parallel, overrides=overrides, strict=strict,
                     example_inputs=example_inputs, ep=ep, sequence_parallel=sequence_parallel)
    return cached_plan(plan_key(model, arguments, rules), lambda: _plan_or_text(model, rules=rules, **arguments))


def _plan_or_text(model: nn.Module, **arguments: Any) -> Plan:
    """The plan on the default inputs; where those splice images into the text and the
    vision side cannot be split (an op no rule knows, a self-check failure), the plan of
    the text alone, the vision side whole as it was never run (with a warning)."""
    def plan() -> Plan:  # on both sides of any branch on data (:mod:`.sides`)
        return plan_both_sides(lambda: _plan(model, **arguments), type(model).__name__)

    try:
        return plan()
    except TPError as err:
        if arguments["example_inputs"] is not None or not text_only(model, err):
            raise
        return plan()


def _plan(model: nn.Module, tp: int, *, loss_parallel: bool, rules: Iterable[Rule | TokenRule] | None,
          overrides: dict[str, str] | None, strict: bool, example_inputs: dict[str, Any] | None, ep: int,
          sequence_parallel: bool) -> tuple[Plan, tuple[str, ...]]:
    t0 = time.perf_counter()
    cap = capture(model, example_kwargs=example_inputs)
    t1 = time.perf_counter()
    forced = dict(overrides or {})
    reasons: dict[str, str] = {}  # override key -> why (the self-check's, not the user's)
    split_stats = True

    entry_paths = _entry_paths(model, example_inputs)
    for fqn, reader in read_outside(cap.graph, cap.param_of_placeholder, _all_names(model)).items():
        key = f"re:{re.escape(fqn)}"
        forced.setdefault(key, "replicated")
        reasons[key] = f"read outside its module's forward (in {reader or 'the model'}'s own code): kept whole for it"

    def run(cap: Capture) -> Analyzed:
        return analyze(cap.graph, _ruleset(rules), tp, param_of_placeholder=cap.param_of_placeholder,
                       buffer_of_placeholder=cap.buffer_of_placeholder, strict=strict, overrides=forced,
                       split_stats=split_stats, override_reasons=reasons, entry_paths=entry_paths,
                       gathered=not loss_parallel)

    for attempt in range(_SELF_CHECK_RETRIES + 1):
        a = run(cap)
        if _crosses_cut_blocks(a, cap):
            # one traced block stands for its copies only if no sharded value crosses a
            # block boundary (a conv stack without norms alternates column and row)
            cap = capture(model, example_kwargs=example_inputs, cut_stacks=False)
            a = run(cap)
        try:
            fixups = local_fixups(model, cap, a, tp, example_inputs, gathered=not loss_parallel) if tp > 1 else {}
            break
        except SelfCheckError as err:
            if a.stats and attempt < _SELF_CHECK_RETRIES:
                # the localized model does not match a plan that splits statistics over
                # split features: plan as without them (each ties its features, as any
                # other reduction), so they never fail where that plan would not
                split_stats = False
                continue
            # non-strict: the module the localized model failed in stays replicated
            if strict or not err.module or attempt == _SELF_CHECK_RETRIES:
                raise
            warnings.warn(f"tpcompile: {err.module} kept replicated: {err.first}", stacklevel=2)
            forced[f"re:{re.escape(err.module)}\\..*"] = "replicated"
            reasons[f"re:{re.escape(err.module)}\\..*"] = f"the localized model fails in it: {err.first}"
            a.notes.append(f"{err.module} kept replicated (self-check: {err.first})")
    plan = build_plan(model, cap, a, loss_parallel=loss_parallel, fixups=fixups)
    plan.ep = ep
    plan.experts = expert_plans(model, cap.graph, cap.param_of_placeholder, cap.stacks.expand, ep,
                                signature=size_signature(model, example_inputs))
    plan.routers = sorted({m for r in find_routers(cap.graph, cap.param_of_placeholder) for m in cap.stacks.expand(r)})
    _check_overrides(plan, overrides)
    if sequence_parallel and tp > 1:
        from .sequence import plan_sequence

        plan.sequence = plan_sequence(model, plan, _ruleset(rules))
    plan.stats = {
        "capture_s": round(t1 - t0, 4),
        "analysis_s": round(time.perf_counter() - t1, 4),
        "analysis_passes": a.passes,
        "traced_blocks": cap.stacks.traced_len,
    }
    return plan, cap.branches


def _crosses_cut_blocks(a: Analyzed, cap: Capture) -> bool:
    """Does a sharded activation (features or a partial sum) enter or leave a block of a
    stack the capture cut short?  Then the blocks it stands for may need other roles."""
    cut = [stack for stack, reps in cap.stacks.members.items() if cap.stacks.traced_len[stack] < len(reps)]
    if not cut:
        return False

    def block(node: fx.Node) -> str | None:
        for path in module_path(node):
            for stack in cut:
                head, _, rest = path.partition(stack + ".")
                if not head and rest:
                    return f"{stack}.{rest.split('.')[0]}"
        return None

    for node, value in a.an.value.items():
        if not isinstance(value, Feat | Partial):
            continue
        here = block(node)
        if any(block(u) != here for u in node.users if u.op == "call_function"):
            return True
    return False


_LARGER = 3  # the second fake forward's batch, over the capture's


def _entry_paths(model: nn.Module, example_inputs: dict[str, Any] | None) -> EntryPaths:
    """Which forward argument carries a value into a module (:mod:`~tpcompile.analysis.entries`):
    the one tensor argument of the module's call, in a fake forward on the capture's
    inputs, with the value's shape and dtype; and whose size along the sliced dim stays
    the same in a forward on a larger batch and sequence (a bias of ``batch * heads``
    rows cannot be sliced by a fixed index).  The forwards run once, at the first
    question (most models never ask)."""
    calls: list[dict] = []

    def find(module: str, value: fx.Node, dim: int, per_batch: bool) -> list | None:
        val = value.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return None
        if not calls:
            try:
                calls.extend(call_inputs(model, kw) for kw in (example_inputs, _larger_inputs(model, example_inputs)))
            except Exception:  # noqa: BLE001 - no fake forward: nothing is sliced at an entry
                calls[:] = [{}, {}]
        shape = tuple(int(s) for s in val.shape)
        hits = [path for path, sh, dt in calls[0].get(module, []) if sh == shape and dt == val.dtype]
        if len(hits) != 1:
            return None
        again = [sh for path, sh, _ in calls[1].get(module, []) if path == hits[0]]
        # the same size on a larger batch, or (rows per batch entry) _LARGER times it
        want = shape[dim] * (_LARGER if per_batch else 1)
        return list(hits[0]) if len(again) == 1 and again[0][dim] == want else None

    return find


def _larger_inputs(model: nn.Module, example_inputs: dict[str, Any] | None) -> dict[str, Any]:
    """The capture's inputs with more sequences (and, when built from the model, more
    tokens): every tensor whose first dim is the batch is repeated along it."""
    from ..capture.inputs import _EXAMPLE_BATCH, _EXAMPLE_SEQ
    from ..capture.inputs import example_inputs as build_inputs

    if example_inputs is None:
        return build_inputs(model, batch=_LARGER * _EXAMPLE_BATCH, seq=_EXAMPLE_SEQ + 4)
    ids = next((v for v in example_inputs.values() if isinstance(v, torch.Tensor) and v.dim() >= 2), None)
    if ids is None:
        return example_inputs
    batch = ids.shape[0]
    return {k: torch.cat([v] * _LARGER) if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch else v
            for k, v in example_inputs.items()}


def _check_overrides(plan: Plan, overrides: dict[str, str] | None) -> None:
    for key, role in (overrides or {}).items():
        hits = [f for f in plan.params if key_matches(key, f)]
        if not hits:
            raise TPError(f"override {key!r} matches no parameter; keys are parameter FQNs or 're:<regex>'")
        if role == "replicated":
            continue
        wrong = [f for f in hits if plan.params[f].role.value != role]
        if wrong:
            raise TPError(
                f"override {key!r} -> {role!r} contradicts the dataflow for {wrong[:3]} "
                f"(found {plan.params[wrong[0]].role.value!r}); only 'replicated' can be forced"
            )


def _owner(fqn: str) -> tuple[str, str]:
    mod, _, name = fqn.rpartition(".")
    return mod, name


def held_rows(index: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """``(held, expand)`` for a layout whose ranks read some rows several times (a KV head
    copied per query head that reads it): each rank holds its distinct rows once, in
    order of first use — every rank as many, the shorter repeating their first — and
    ``expand[r]`` gives the held position of each row its forward reads.  A layout
    without repeats is held as it is read (``expand`` ``None``)."""
    rows = [list(dict.fromkeys(row.tolist())) for row in index]
    if (index < 0).any() or all(len(r) == index.shape[1] for r in rows):
        return index, None
    width = max(len(r) for r in rows)
    held = np.array([r + (r * width)[: width - len(r)] for r in rows], dtype=np.int64)
    where = [{g: i for i, g in enumerate(r)} for r in rows]
    expand = np.array([[w[g] for g in row.tolist()] for w, row in zip(where, index, strict=True)], dtype=np.int64)
    return held, expand


def _layout_kind(index: np.ndarray, size: int) -> str:
    tp, local = index.shape
    flat = index.reshape(-1)
    real = flat[flat >= 0]
    if np.unique(real).size < real.size:  # rows several ranks hold (padded or not): their gradients are summed
        return "kv_replicated"
    if real.size < flat.size:
        return "padded"
    if np.array_equal(flat, np.arange(size)):
        return "contiguous"
    return "fused"


def _whole_because(why: dict, fqn: str) -> str:
    """Why the analysis kept ``fqn`` (its representative) whole: the reason recorded when
    it or one of its dims was forced replicated, else that nothing split it."""
    found = why.get(fqn) or next((r for k, r in why.items() if isinstance(k, tuple) and k[0] == fqn), None)
    return found or "no column, row or embedding use in the captured dataflow splits it"


def build_plan(model: nn.Module, cap: Capture, a: Analyzed, *, loss_parallel: bool = False,
               fixups: dict[str, dict[str, list[int]]] | None = None) -> Plan:
    tp = a.part.tp
    plan = Plan(tp=tp, model_class=type(model).__name__, loss_parallel=loss_parallel, warnings=list(a.notes))
    names_of = _all_names(model)
    modules: dict[str, ModulePlan] = {}

    def mod_plan(fqn: str) -> ModulePlan:
        return modules.setdefault(fqn, ModulePlan(fqn=fqn))

    # per representative module: its ops, by kind (a vocab-parallel embedding reduces its
    # own output, so it takes neither a row reduce nor a gather)
    rep_ops: dict[str, dict[type, ModuleOp]] = defaultdict(dict)
    parents = set(a.loop_parents.values())
    for fqn, m in a.column.items():
        if fqn not in a.reentry.columns:  # else its input's gradient is summed at a row's exit
            # inside an expert loop's parent, the parent's inputs enter once (analysis.exits)
            rep_ops[next((p for p in parents if m.startswith(p + ".")), m)][EnterRegion] = EnterRegion()
    for fqn, m in a.lm_head.items():
        rep_ops[m][EnterRegion] = EnterRegion()
        if not loss_parallel:
            rep_ops[m][GatherOutput] = GatherOutput(vocab_size=int(a.layouts[fqn].size))
    for fqn, (m, bias) in a.row.items():
        prev = rep_ops[m].get(ReduceOutput)
        biases = prev.row_biases if prev is not None else ()
        reenter = fqn in a.reentry.rows or (prev is not None and prev.reenter)
        if bias is not None:
            owner, pname = _owner(bias)
            if owner != m:
                raise TPError(f"row-parallel {m} adds bias {bias} owned by another module")
            biases = (*biases, pname)
        rep_ops[m][ReduceOutput] = ReduceOutput(row_biases=biases, reenter=reenter, addends=a.addends.get(m, ()))
    for m, stat in a.stats.items():
        rep_ops[m][SplitStats] = SplitStats(dim=stat.dim, size=stat.size, local=stat.local, ops=stat.ops)
    for m, slices in a.entry_slices.items():
        rep_ops[m][SliceInputs] = SliceInputs(slices=tuple(es.as_tuple() for es in slices))
    for m, sites in mask_sites(a).items():
        rep_ops[m][WholeMasks] = WholeMasks(sites=sites)
    for m, buffers in a.buffer_slices.items():
        rep_ops[m][SliceBuffers] = SliceBuffers(slices=tuple(
            (path, lay.dim, lay.size, index_to_runs(lay.index)) for path, lay in sorted(buffers.items())),
            updated=tuple(p for p in sorted(buffers) if (f"{m}.{p}" if m else p) in a.an.updated_buffers))
    for fqn, users in a.embedding.items():
        for m in users:
            rep_ops[m][VocabEmbedding] = VocabEmbedding(vocab_size=int(a.layouts[fqn].size))
            rep_ops[m].pop(ReduceOutput, None)
            rep_ops[m].pop(GatherOutput, None)

    encoded: dict[str, tuple[str, list]] = {}
    scopes = _use_scopes(cap, names_of)
    for name, p in model.named_parameters():
        rep = cap.stacks.representative(name)
        aliases = [n for n in names_of[name] if n != name]
        # a tied parameter is traced under one of its names: look each of them up, a name
        # the graph uses before one it only lists (export lifts BART's shared table under
        # all four names and reads it under ``lm_head.weight`` alone: the unread
        # ``model.shared.weight`` has only a reason to stay whole)
        traced = (rep, *map(cap.stacks.representative, aliases))
        key = next((r for found in (a.layouts, a.grad_allreduce, a.why) for r in traced if r in found), rep)
        lay = a.layouts.get(key)
        lay = param_layout(lay) if lay is not None else None
        owner, _ = _owner(name)
        if lay is None:
            role = Role.GRAD_ALLREDUCE if key in a.grad_allreduce else Role.REPLICATED
            plan.params[name] = ParamPlan(fqn=name, role=role, module=owner, global_shape=list(p.shape),
                                          local_shape=list(p.shape), tied_to=aliases,
                                          whole_because=_whole_because(a.why, key) if p.dim() >= 2 else "")
            if role is Role.GRAD_ALLREDUCE:
                for n in [name, *aliases]:
                    mo, pn = _owner(n)
                    mod_plan(mo).add(GradSum(params=(pn,)))
            continue
        role = (Role.LM_HEAD if key in a.lm_head else Role.COLUMN if key in a.column else Role.ROW
                if key in a.row else Role.VOCAB_EMBEDDING if key in a.embedding else Role.SHARDED)
        if key not in encoded:  # every block of one structure shares its representative's
            held, expand = held_rows(lay.index)
            encoded[key] = (_layout_kind(held, lay.size), index_to_runs(held),
                            None if expand is None else index_to_runs(expand))
        kind, runs, expand_runs = encoded[key]
        local = list(p.shape)
        local[lay.dim] = len(runs_to_index(runs)[0])
        plan.params[name] = ParamPlan(
            fqn=name, role=role, module=owner, global_shape=list(p.shape), local_shape=local,
            shard_dim=lay.dim, layout=kind, runs=runs, tied_to=aliases, expand=expand_runs,
        )
    captured = {cap.param_of_placeholder[n.name] for n in cap.graph.nodes  # export lists every parameter
                if n.op == "placeholder" and n.name in cap.param_of_placeholder and n.users}
    for name, pp in plan.params.items():
        for n in [name, *pp.tied_to]:  # the name under which an outside read reaches it
            up = scopes.get(cap.stacks.representative(n))
            if up:  # same number of levels above the owner in every block of a stack
                pp.scope = forward_holder(model, ".".join(n.split(".")[:-1 - up]))
                if pp.role is Role.GRAD_ALLREDUCE:
                    _grad_sum_in_scope(pp, modules)
                break
        else:
            if pp.module and not any(cap.stacks.representative(n) in captured for n in [name, *pp.tied_to]):
                # never run in the capture (a vision tower the text alone does not reach):
                # nothing says who reads it, and ``nn.MultiheadAttention`` reads its
                # ``out_proj``'s weight in its own forward, so the owner's parent swaps it
                pp.scope = pp.module.rpartition(".")[0]
    for mname, _ in model.named_modules():
        rep = cap.stacks.representative(mname)
        for op in rep_ops.get(rep, {}).values():
            mod_plan(mname).add(op)
        if fixups and rep in fixups:
            mod_plan(mname).attr_fixups = dict(fixups[rep])
    plan.modules = dict(sorted(modules.items()))
    # the blocks are the model's structure, whether or not the capture cut its stacks (it
    # traces them whole where a split value crosses a block): checkpointing, FSDP2's
    # units, compile and the pipeline's cuts need them all the same
    stacks = cap.stacks if cap.stacks.members else layer_stacks(model)
    plan.blocks = [f"{stack}.{i}" for stack, reps in stacks.members.items() for i in range(len(reps))]
    return plan


def _grad_sum_in_scope(pp: ParamPlan, modules: dict[str, ModulePlan]) -> None:
    """The gradient sum of a parameter its scope reads moves from its owner to the scope,
    under its path there: the scope's swap hands the code the local tensor for its whole
    forward (an owner's forward may never run: PEFT keeps AdaLoRA's vectors in a
    ``ParameterDict``), and sums its gradient there, once."""
    prefix = f"{pp.scope}." if pp.scope else ""
    for name in [pp.fqn, *pp.tied_to]:
        owner, _, leaf = name.rpartition(".")
        mp = modules.get(owner)
        op = mp.op(GradSum) if mp is not None else None
        if op is not None and leaf in op.params:
            mp.ops.remove(op)
            if len(op.params) > 1:
                mp.add(GradSum(params=tuple(x for x in op.params if x != leaf)))
            elif not mp.ops and not mp.attr_fixups:
                del modules[owner]
    scoped = modules.setdefault(pp.scope, ModulePlan(fqn=pp.scope))
    scoped.add(GradSum(params=(pp.fqn[len(prefix):],)))


def _all_names(model: nn.Module) -> dict[str, list[str]]:
    """``{name: every name of that parameter}`` (tied parameters have several)."""
    by_id: dict[int, list[str]] = defaultdict(list)
    named = list(model.named_parameters(remove_duplicate=False))
    for name, p in named:
        by_id[id(p)].append(name)
    return {name: by_id[id(p)] for name, p in named}


def _use_scopes(cap: Capture, names_of: dict[str, list[str]]) -> dict[str, int]:
    """``{parameter name: levels}`` for parameters that code outside their owner reads
    directly: how many levels above the owner sits the innermost module whose forward
    holds every such read (the reader where it is an ancestor, as Mamba's mixer reading
    its conv's weight; else the reader's and the owner's common ancestor, as Gemma 4's
    multimodal model reading its text model's table, traced under its tied name
    ``lm_head.weight``).  ``names_of``: every name of each traced parameter."""
    out: dict[str, int] = {}
    for node in cap.graph.nodes:
        fqn = cap.param_of_placeholder.get(node.name) if node.op == "placeholder" else None
        if fqn is None:
            continue
        names = names_of.get(fqn, [fqn])
        for user in node.users:
            reader = innermost_module(user).split(".") if innermost_module(user) else []
            if any(reader[: len(o)] == o for o in (n.split(".")[:-1] for n in names)):
                continue  # read in the forward of a module holding it (a tied name's owner)
            for name in names:
                owner = name.split(".")[:-1]
                common = 0
                while common < min(len(owner), len(reader)) and owner[common] == reader[common]:
                    common += 1
                if common < len(owner):
                    out[name] = max(out.get(name, 0), len(owner) - common)
    return out
