"""Sequence parallelism, the plan: which code between tensor-parallel regions may run on
a slice of the tokens, and where the stream is split and gathered.

With plain tensor parallelism every rank holds the whole residual stream between a
row-parallel output and the next column-parallel input, and runs the norms, residual
adds and dropout there on all tokens. With ``sequence_parallel=True`` each rank keeps
only its ``ceil(S / tp)`` tokens of that stream: activations saved for backward there
shrink by ``tp``. What is split is derived from the dataflow, per block of each stack:

* the **regions** are the modules the block calls that hold tensor-parallel modules
  (attention, the MLP, a MoE layer with its router), plus any whose code mixes tokens
  (an attention kept replicated). Inside a region everything runs on all tokens, as in
  plain TP, so masks and rotary tables built for the whole sequence stay valid;
* the **stream** is the block input shaped like its output that reaches it; every op on
  token-carrying values outside the regions must be token-local
  (:mod:`tpcompile.analysis.tokens`), else the stack stays whole and the plan's warnings
  name block, module and op; a region output holding this rank's features (a column
  module's) is never split;
* where only column modules read a region's input, and where a row module's output is
  the region's output, the collectives become Megatron's all-gather / reduce-scatter pair.

Which ops are token-local is asked of the token rules (:mod:`tpcompile.rules.tokens`, and
a user's own passed in ``rules=[...]``). The module arguments are located through
``torch.export``'s preserved call signatures. The result is the plan's ``sequence``
section, a :class:`~tpcompile.plan.sequence_types.SequencePlan`; the hooks that run it
live in :mod:`tpcompile.runtime.sequence`.
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from ..analysis.propagate import RuleSet, innermost_module, module_path, params_feeding
from ..analysis.tokens import Mixes, Tokens, propagate_tokens
from ..capture import Capture, LayerStacks, capture, layer_stacks
from .sequence_types import (
    Path,
    RegionGather,
    RegionPlan,
    RegionSplit,
    SequencePlan,
    StackPlan,
    TokenGradSum,
    TokenSlot,
)

__all__ = ["SequencePlan", "plan_sequence"]

_SEQ = 7  # example tokens: no model dim is 7 (see capture)
_BATCH = 2  # > 1, so a view that folds batch rows into the tokens shows in the shapes


# ---------------------------------------------------------------- planning


def _paths(spec: Any, n: int) -> list[Path]:
    """The argument path of each flattened leaf of a call signature's pytree spec."""
    tree = pytree.tree_unflatten(list(range(n)), spec)
    out: list[Path] = [[] for _ in range(n)]

    def walk(obj: Any, path: Path) -> None:
        if isinstance(obj, int) and not isinstance(obj, bool):
            out[obj] = path
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, [*path, k])
        elif isinstance(obj, list | tuple):
            for i, v in enumerate(obj):
                walk(v, [*path, i])

    walk(tree, [])
    return out


def _call_io(sig: Any, names: dict[str, fx.Node]) -> tuple[list[tuple[Path, fx.Node]], list[tuple[Path, fx.Node]]]:
    """``(path, node)`` of each tensor input and output of a preserved module call."""
    def pairs(specs: list, spec: Any, top: bool) -> list[tuple[Path, fx.Node]]:
        paths = _paths(spec, len(specs))
        res = []
        for path, arg in zip(paths, specs, strict=True):
            name = getattr(arg, "name", None)
            if name in names and type(arg).__name__ == "TensorArgument":
                if top:  # (args, kwargs) -> ["args", i] / ["kwargs", name]
                    path = ["args" if path[0] == 0 else "kwargs", *path[1:]]
                res.append((path, names[name]))
        return res

    return pairs(sig.inputs, sig.in_spec, True), pairs(sig.outputs, sig.out_spec, False)


def _token_count(v: torch.Tensor) -> int:
    """Tokens per sequence in a block's output: the example's ``_SEQ`` for text; for a
    ``(batch, tokens, features)`` output the non-batch dim (patches, audio frames)."""
    if _SEQ in [int(x) for x in v.shape]:
        return _SEQ
    dims = [int(x) for x in v.shape[:-1] if int(x) != _BATCH]
    return dims[0] if len(dims) == 1 else _SEQ


def _token_dim(node: fx.Node, seq: int = _SEQ) -> int | None:
    v = node.meta.get("val")
    if not isinstance(v, torch.Tensor):
        return None
    dims = [d for d, s in enumerate(v.shape) if int(s) == seq]
    return dims[0] if len(dims) == 1 else None


def _inside(node: fx.Node, fqn: str) -> bool:
    return fqn in module_path(node)


def _regions(block: str, plan: Any, cap_rep: Any, modules: dict[str, nn.Module]) -> list[str] | None:
    """The outermost *called* modules under ``block`` that hold tensor-parallel modules:
    its children, or a container's members (T5's ``layer[i]``). ``None``: the block's
    own code runs a tensor-parallel op, so no child can stand for it."""
    hooked = {cap_rep(m) for m, mp in plan.modules.items()
              if mp.hooked}
    hooked |= {cap_rep(p.module) for p in plan.params.values() if p.shard_dim is not None}
    if block in hooked:
        return None
    out: set[str] = set()
    for m in hooked:
        if not m.startswith(block + "."):
            continue
        parts, name = m[len(block) + 1:].split("."), block
        for part in parts:  # step over containers: they are never called themselves
            name = f"{name}.{part}"
            if not isinstance(modules.get(name), nn.ModuleList | nn.ModuleDict):
                break
        out.add(name)
    return sorted(out)


def _called_children(block: str, modules: dict[str, nn.Module]) -> list[str]:
    """The modules ``block``'s own forward calls: its children, a container's members."""
    out, todo = [], [block]
    while todo:
        name = todo.pop()
        for child, _ in modules[name].named_children():
            fqn = f"{name}.{child}"
            (todo if isinstance(modules[fqn], nn.ModuleList | nn.ModuleDict) else out).append(fqn)
    return sorted(out)


class _Refused(Exception):
    def __init__(self, module: str, op: str, why: str) -> None:
        super().__init__(f"{module or '<block>'}: {op} {why}")
        self.module = module


def _plan_block(block: str, regions: list[str], cap: Capture, names: dict[str, fx.Node],
                plan: Any, rules: RuleSet) -> dict[str, Any]:
    """Stream path and region boundaries of one representative block; raises _Refused."""
    b_in, b_out = _call_io(cap.signatures[block], names)
    io = {r: _call_io(cap.signatures[r], names) for r in regions}
    region_nodes = {n for n in cap.graph.nodes if any(_inside(n, r) for r in regions)}
    # the residual stream: the floating input shaped like the block's output that
    # reaches it (through regions too: BLOOM adds the residual inside attention and MLP);
    # of several (a cross-attention's encoder states), the one that gets there outside
    # the regions (rotary tables and masks only feed regions)
    out_val = b_out[0][1].meta.get("val") if b_out else None
    if not isinstance(out_val, torch.Tensor):
        raise _Refused(block, "output", "is not a tensor")
    seq = _token_count(out_val)
    stream = [(p, n) for p, n in b_in if _token_dim(n, seq) is not None and n.meta["val"].is_floating_point()
              and n.meta["val"].shape == out_val.shape and _reaches(n, b_out[0][1], set())]
    if len(stream) > 1:
        stream = [(p, n) for p, n in stream if _reaches(n, b_out[0][1], region_nodes)]
    if len(stream) != 1:
        raise _Refused(block, "input", f"has {len(stream)} residual streams, needs one")
    tags: dict[fx.Node, Tokens] = {}
    sharded = _sharded_features(cap.graph, block, plan)
    for r, (_, outs) in io.items():
        for _path, node in outs:
            dim = _token_dim(node, seq)
            # an output carrying this rank's features (BERT's intermediate, BART's fc1)
            # stays whole: a token split would hand other ranks' features across
            if dim is not None and node not in sharded and any(not _inside(u, r) for u in node.users):
                tags[node] = Tokens(dim)
    tags[stream[0][1]] = Tokens(_token_dim(stream[0][1], seq))
    for node in cap.graph.nodes:
        if node in region_nodes or node in tags or not _inside(node, block):
            continue
        try:
            tag = propagate_tokens(node, tags, rules)
        except Mixes as why:
            raise _Refused(innermost_module(node), str(getattr(node.target, "__name__", node.target)),
                           str(why)) from None
        if tag is not None:
            tags[node] = tag
    work = [n for n in tags if _inside(n, block) and n not in region_nodes
            and n.target not in (operator.getitem, torch.ops.aten.alias.default)]
    if not work:  # T5: each sub-layer holds its own norm and residual add
        raise _Refused(block, "stream", "has no token-local work between its regions (nothing to save)")
    out_paths = [(p, tags[n]) for p, n in b_out if n in tags]
    if len(out_paths) != 1 or out_paths[0][1].merged:
        raise _Refused(block, "output", "is not one token-split stream")
    gathers: dict[str, list[RegionGather]] = {}
    splits: dict[str, list[RegionSplit]] = {}
    for r, (ins, outs) in io.items():
        for path, node in ins:
            tag = tags.get(node)
            if tag is not None:
                if tag.merged:
                    raise _Refused(r, "input", "gets tokens with batch rows merged")
                gathers.setdefault(r, []).append(
                    RegionGather(path=path, dim=tag.dim, fused=_enters_columns(node, r, plan)))
        splits[r] = [RegionSplit(path=path, dim=tags[n].dim, row=_leaving_row(n, plan))
                     for path, n in outs if n in tags]
    # parameters applied to token slices (norm weights): each rank's gradient covers its
    # tokens only, so it is summed over the group
    grad_sum = sorted(params_feeding([n for n in tags if _inside(n, block) and n not in region_nodes],
                                      tags, cap.param_of_placeholder))
    return {"stream": TokenSlot(path=stream[0][0], dim=tags[stream[0][1]].dim),
            "output": TokenSlot(path=out_paths[0][0], dim=out_paths[0][1].dim),
            "gather": gathers, "split": splits, "grad_sum": grad_sum}


def _sharded_features(graph: fx.Graph, block: str, plan: Any) -> set[fx.Node]:
    """Nodes of ``block`` whose values hold only this rank's features or partial sums:
    downstream of a column-parallel module's output, until a row-parallel module's
    output (its hook all-reduces)."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        if not _inside(node, block):
            continue
        m = innermost_module(node)
        mp = plan.modules.get(m)
        leaves = mp is not None and any(not _inside(u, m) for u in node.users)
        if leaves and mp.reduces:
            continue  # summed on the way out
        if (leaves and mp.enters and not mp.gathers) or any(x in out for x in node.all_input_nodes):
            out.add(node)
    return out


def _enters_columns(node: fx.Node, region: str, plan: Any) -> bool:
    """Does every use of ``node`` inside ``region`` belong to a column-parallel module?
    Then the gather's backward may sum the partial gradients itself (a reduce-scatter)
    and the columns skip their own all-reduce. A router reading the same input (its
    gradient is whole on every rank) rules it out."""
    users = [u for u in node.users if _inside(u, region)]
    return bool(users) and all(
        (mp := plan.modules.get(innermost_module(u))) is not None and mp.enters for u in users)


def _leaving_row(node: fx.Node, plan: Any) -> str | None:
    """The row-parallel module whose own output ``node`` is (its partial sum can then
    leave with a reduce-scatter instead of an all-reduce and a split)."""
    m = innermost_module(node)
    mp = plan.modules.get(m)
    if mp is None or not mp.reduces or any(_inside(u, m) for u in node.users):
        return None
    return m


def _reaches(src: fx.Node, dst: fx.Node, blocked: set[fx.Node]) -> bool:
    seen, todo = {src}, [src]
    while todo:
        n = todo.pop()
        if n is dst:
            return True
        for u in n.users:
            if u not in seen and u not in blocked:
                seen.add(u)
                todo.append(u)
    return False


def _block_lists(model: nn.Module, plan: Any) -> LayerStacks:
    """The stacks of blocks: the repeated ones capture cuts, and module lists whose
    blocks all differ (a shrunk T5: block 0 holds the position bias) but hold
    tensor-parallel modules; lists inside another stack's blocks are part of those."""
    stacks = layer_stacks(model)
    hooked = list(plan.modules)
    for fqn, mod in model.named_modules():
        if (not isinstance(mod, nn.ModuleList) or fqn in stacks.members or len(mod) < 2
                or any(fqn.startswith(s + ".") for s in stacks.members)
                or not any(m.startswith(fqn + ".") for m in hooked)):
            continue
        stacks.members[fqn] = list(range(len(mod)))
        stacks.traced_len[fqn] = len(mod)
    return stacks


def plan_sequence(model: nn.Module, plan: Any, rules: RuleSet | None = None) -> SequencePlan:
    """Where the stream is split and gathered, for every block of every stack.

    Returns the plan's ``sequence`` section: per stack its first and last block and
    the stream's argument and output, per region the arguments gathered and outputs
    split, per module the parameters whose gradient is summed, and the blocks refused
    with why; paths name forward arguments (``["kwargs", "hidden_states"]``).
    ``rules``: the rule set whose token rules decide which ops are token-local (by
    default the built-in ones, :mod:`tpcompile.rules.tokens`)."""
    from ..capture.inputs import example_inputs

    if rules is None:
        from tpcompile.rules import default_rules

        rules = RuleSet().add(default_rules())

    stacks = _block_lists(model, plan)
    blocks = {f"{stack}.{i}": stack for stack, n in stacks.traced_len.items() for i in range(n)}
    rep = stacks.representative
    modules = dict(model.named_modules())
    regions = {b: _regions(b, plan, rep, modules) for b in blocks}
    children = {b: _called_children(b, modules) for b in blocks if regions[b]}
    preserve = tuple(children) + tuple(c for cs in children.values() for c in cs)
    out = SequencePlan()
    try:
        cap = capture(model, example_kwargs=example_inputs(model, batch=_BATCH, seq=_SEQ, generator=None),
                      preserve=preserve)
    except Exception as err:  # sequence parallelism is an optimization: never a crash
        plan.warnings.append(f"sequence parallelism: off (capturing the blocks' call signatures failed: "
                             f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
        return out
    names = {n.name: n for n in cap.graph.nodes}
    per_block: dict[str, dict] = {}
    for b, rs in regions.items():
        if not rs:
            out.refused[b] = "no tensor-parallel region" if rs == [] else "tensor-parallel ops in the block's own code"
            continue
        while b not in per_block:
            try:
                per_block[b] = _plan_block(b, rs, cap, names, plan, rules)
            except _Refused as why:
                # a child whose code mixes tokens (attention kept replicated) runs whole
                # too: it becomes a region of its own, exact like any other
                child = next((c for c in children[b] if why.module == c or why.module.startswith(c + ".")), None)
                if child is None or child in rs or child not in cap.signatures:
                    out.refused[b] = str(why)
                    break
                rs = sorted([*rs, child])
            except Exception as err:  # a call shape the planner does not know: stay whole
                out.refused[b] = f"not planned ({type(err).__name__}: {err})"
                break
    for stack, reps in stacks.members.items():
        if any(f"{stack}.{r}" not in per_block for r in set(reps)):
            continue  # one refused block: the whole stack keeps the stream whole
        first, last = per_block[f"{stack}.{reps[0]}"], per_block[f"{stack}.{reps[-1]}"]
        out.stacks[stack] = StackPlan(first=f"{stack}.0", last=f"{stack}.{len(reps) - 1}",
                                      stream=first["stream"], output=last["output"])
        for i, r in enumerate(reps):
            pb = per_block[f"{stack}.{r}"]
            for fqn in pb["grad_sum"]:
                owner, _, leaf = (f"{stack}.{i}" + fqn[len(f"{stack}.{r}"):]).rpartition(".")
                out.grad_sum.setdefault(owner, TokenGradSum(stack=stack)).params.append(leaf)
            def here(fqn: str, i: int = i, r: int = r, stack: str = stack) -> str:  # rep -> block i
                return f"{stack}.{i}" + fqn[len(f"{stack}.{r}"):]

            for region in set(pb["gather"]) | set(pb["split"]):
                out.regions[here(region)] = RegionPlan(
                    stack=stack, gather=[replace(g, path=list(g.path)) for g in pb["gather"].get(region, [])],
                    split=[replace(s, path=list(s.path), row=here(s.row) if s.row else None)
                           for s in pb["split"].get(region, [])])
    warned: set[str] = set()
    for b, why in out.refused.items():
        if blocks[b] in out.stacks or blocks[b] in warned:
            continue
        warned.add(blocks[b])  # the first refused block speaks for its stack
        plan.warnings.append(f"sequence parallelism: {blocks[b]} keeps whole sequences ({b}: {why})")
    return out
