"""Sequence parallelism: the code between tensor-parallel regions runs on a slice of tokens.

With plain tensor parallelism every rank holds the whole residual stream between a
row-parallel output and the next column-parallel input, and runs the norms, residual
adds and dropout there on all tokens. With ``sequence_parallel=True`` each rank keeps
only its ``ceil(S / tp)`` tokens of that stream: activations saved for backward in those
regions shrink by ``tp``.

What is split is derived from the dataflow, per repeated block of the model:

* the **regions** are the children of a block that hold tensor-parallel modules
  (attention, MLP, a MoE layer with its router). Inside a region everything runs as in
  plain TP on all tokens, so attention, rotary tables and masks built for the whole
  sequence stay valid;
* the **stream** is the block input that reaches the block output outside the regions
  (the residual path). Every op on it outside regions must be token-local
  (:mod:`tpcompile.analysis.tokens`): a block whose code mixes tokens there keeps no
  sequence parallelism and the plan says which op;
* the stream is split (padded to a multiple of ``tp`` with copies of the last token) at
  the first block's input and gathered at the last block's output; each region gathers
  the token-carrying arguments on entry and splits its token-carrying outputs on exit.

The collectives are differentiable (``tpcompile.comm``): a split's backward gathers the
gradient slices, a gather's backward keeps this rank's slice (the gradient is already
complete there: the column modules' backward all-reduce summed it). Results are exact;
the communication per region is one all-gather more than plain TP in each direction.

Calls that ask for intermediate hidden states (``output_hidden_states=True``) would get
slices of them, so such calls run without sequence parallelism (exactly as plain TP).
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from . import comm
from .analysis.propagate import innermost_module, module_path
from .analysis.tokens import Mixes, Tokens, propagate_tokens
from .capture import Capture, LayerStacks, capture, layer_stacks

__all__ = ["gather_tokens", "install_sequence_parallel", "plan_sequence", "split_tokens"]

_SEQ = 7  # example tokens: no model dim is 7 (see capture)
_BATCH = 2  # > 1, so a view that folds batch rows into the tokens shows in the shapes

Path = list[Any]  # ["args", 0] / ["kwargs", "hidden_states", 1] / [] (the value itself)


# ---------------------------------------------------------------- collectives


def _pad_tokens(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``x`` padded along ``dim`` to a multiple of ``n`` with copies of the last token
    (finite wherever real tokens are; gradients of the copies are zero because every
    gather drops them)."""
    short = -x.shape[dim] % n
    if not short:
        return x
    last = x.narrow(dim, x.shape[dim] - 1, 1)
    return torch.cat([x, last.expand(*[short if d == dim else -1 for d in range(x.dim())])], dim)


def split_tokens(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` (padded to a multiple of the group size)."""
    return comm.scatter_to_tp(_pad_tokens(x, comm.group_size(group), dim), group, dim)


def gather_tokens(x: torch.Tensor, group: Any, dim: int, length: int) -> torch.Tensor:
    """All tokens of a split value (the padding dropped)."""
    full = comm.gather_from_tp(x, group, dim)
    # contiguous: model code .view()s its inputs, as it may with the unsplit tensor
    return full.narrow(dim, 0, length).contiguous() if full.shape[dim] != length else full


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
              if mp.copy_inputs or mp.reduce_output or mp.grad_allreduce or mp.gather_output}
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
                plan: Any) -> dict[str, Any]:
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
            tag = propagate_tokens(node, tags)
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
    gathers: dict[str, list] = {}
    splits: dict[str, list] = {}
    for r, (ins, outs) in io.items():
        for path, node in ins:
            tag = tags.get(node)
            if tag is not None:
                if tag.merged:
                    raise _Refused(r, "input", "gets tokens with batch rows merged")
                gathers.setdefault(r, []).append([path, tag.dim, _enters_columns(node, r, plan)])
        splits[r] = [[path, tags[n].dim, _leaving_row(n, plan)] for path, n in outs if n in tags]
    # parameters applied to token slices (norm weights): each rank's gradient covers its
    # tokens only, so it is summed over the group
    grad_sum = sorted(_params_feeding([n for n in tags if _inside(n, block) and n not in region_nodes],
                                      tags, cap.param_of_placeholder))
    return {"stream": [stream[0][0], tags[stream[0][1]].dim], "output": [out_paths[0][0], out_paths[0][1].dim],
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
        if leaves and mp.reduce_output:
            continue  # summed on the way out
        if (leaves and mp.copy_inputs and not mp.gather_output) or any(x in out for x in node.all_input_nodes):
            out.add(node)
    return out


def _enters_columns(node: fx.Node, region: str, plan: Any) -> bool:
    """Does every use of ``node`` inside ``region`` belong to a column-parallel module?
    Then the gather's backward may sum the partial gradients itself (a reduce-scatter)
    and the columns skip their own all-reduce. A router reading the same input (its
    gradient is whole on every rank) rules it out."""
    users = [u for u in node.users if _inside(u, region)]
    return bool(users) and all(
        (mp := plan.modules.get(innermost_module(u))) is not None and mp.copy_inputs for u in users)


def _leaving_row(node: fx.Node, plan: Any) -> str | None:
    """The row-parallel module whose own output ``node`` is (its partial sum can then
    leave with a reduce-scatter instead of an all-reduce and a split)."""
    m = innermost_module(node)
    mp = plan.modules.get(m)
    if mp is None or not mp.reduce_output or any(_inside(u, m) for u in node.users):
        return None
    return m


def _params_feeding(nodes: list[fx.Node], tags: dict, params: dict[str, str]) -> set[str]:
    """Parameters that reach ``nodes`` through values that carry no tokens
    (``1 + weight.float()`` as much as ``weight``)."""
    out: set[str] = set()
    seen: set[fx.Node] = set()
    todo = [x for n in nodes for x in n.all_input_nodes if x not in tags]
    while todo:
        x = todo.pop()
        if x in seen:
            continue
        seen.add(x)
        if x.op == "placeholder" and x.name in params:
            out.add(params[x.name])
        todo.extend(y for y in x.all_input_nodes if y not in tags)
    return out


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


def plan_sequence(model: nn.Module, plan: Any) -> dict[str, Any]:
    """Where the stream is split and gathered, for every block of every stack.

    Returns the plan's ``sequence`` section: ``{"stacks": {stack: {"first", "last",
    "stream", "output"}}, "regions": {module: {"stack", "gather", "split"}}, "refused":
    {block: reason}}``; paths name forward arguments (``["kwargs", "hidden_states"]``)."""
    from .inputs import example_inputs

    stacks = _block_lists(model, plan)
    blocks = {f"{stack}.{i}": stack for stack, n in stacks.traced_len.items() for i in range(n)}
    rep = stacks.representative
    modules = dict(model.named_modules())
    regions = {b: _regions(b, plan, rep, modules) for b in blocks}
    children = {b: _called_children(b, modules) for b in blocks if regions[b]}
    preserve = tuple(children) + tuple(c for cs in children.values() for c in cs)
    out: dict[str, Any] = {"stacks": {}, "regions": {}, "grad_sum": {}, "refused": {}}
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
            out["refused"][b] = "no tensor-parallel region" if rs == [] else "tensor-parallel ops in the block's own code"
            continue
        while b not in per_block:
            try:
                per_block[b] = _plan_block(b, rs, cap, names, plan)
            except _Refused as why:
                # a child whose code mixes tokens (attention kept replicated) runs whole
                # too: it becomes a region of its own, exact like any other
                child = next((c for c in children[b] if why.module == c or why.module.startswith(c + ".")), None)
                if child is None or child in rs or child not in cap.signatures:
                    out["refused"][b] = str(why)
                    break
                rs = sorted([*rs, child])
            except Exception as err:  # a call shape the planner does not know: stay whole
                out["refused"][b] = f"not planned ({type(err).__name__}: {err})"
                break
    for stack, reps in stacks.members.items():
        if any(f"{stack}.{r}" not in per_block for r in set(reps)):
            continue  # one refused block: the whole stack keeps the stream whole
        first, last = per_block[f"{stack}.{reps[0]}"], per_block[f"{stack}.{reps[-1]}"]
        out["stacks"][stack] = {"first": f"{stack}.0", "last": f"{stack}.{len(reps) - 1}",
                                "stream": first["stream"], "output": last["output"]}
        for i, r in enumerate(reps):
            pb = per_block[f"{stack}.{r}"]
            for fqn in pb["grad_sum"]:
                owner, _, leaf = (f"{stack}.{i}" + fqn[len(f"{stack}.{r}"):]).rpartition(".")
                out["grad_sum"].setdefault(owner, {"stack": stack, "params": []})["params"].append(leaf)
            def here(fqn: str, i: int = i, r: int = r, stack: str = stack) -> str:  # rep -> block i
                return f"{stack}.{i}" + fqn[len(f"{stack}.{r}"):]

            for region in set(pb["gather"]) | set(pb["split"]):
                out["regions"][here(region)] = {
                    "stack": stack, "gather": pb["gather"].get(region, []),
                    "split": [[p, d, here(m) if m else None] for p, d, m in pb["split"].get(region, [])]}
    warned: set[str] = set()
    for b, why in out["refused"].items():
        if blocks[b] in out["stacks"] or blocks[b] in warned:
            continue
        warned.add(blocks[b])  # the first refused block speaks for its stack
        plan.warnings.append(f"sequence parallelism: {blocks[b]} keeps whole sequences ({b}: {why})")
    return out


# ---------------------------------------------------------------- runtime


def _get(obj: Any, path: Path) -> Any:
    for key in path:
        if isinstance(obj, dict):
            obj = obj.get(key)
        elif isinstance(obj, list | tuple) and isinstance(key, int) and key < len(obj):
            obj = obj[key]
        else:
            return None
    return obj


def _set(obj: Any, path: Path, value: Any) -> Any:
    if not path:
        return value
    key, rest = path[0], path[1:]
    if isinstance(obj, dict):
        return {**obj, key: _set(obj[key], rest, value)}
    items = list(obj)
    items[key] = _set(items[key], rest, value)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*items)
    return type(obj)(items) if isinstance(obj, tuple | list) else items


def _map_call(args: tuple, kwargs: dict, paths: list, fn: Any) -> tuple[tuple, dict]:
    call = {"args": args, "kwargs": kwargs}
    for path, dim in paths:
        x = _get(call, path)
        if isinstance(x, torch.Tensor):
            call = _set(call, path, fn(x, dim))
    return call["args"], call["kwargs"]


def _map_out(out: Any, paths: list, fn: Any) -> Any:
    for path, dim in paths:
        x = _get(out, path)
        if isinstance(x, torch.Tensor):
            out = _set(out, path, fn(x, dim))
    return out


@dataclasses.dataclass
class _Stream:
    """One forward's state of one stack: on or off, and the true token count."""

    on: bool = False
    length: int = 0
    left: int = 0  # row outputs that left the current region already split
    open: bool = False  # split by the first block, not yet gathered by the last


def install_sequence_parallel(model: nn.Module, seq: dict[str, Any], backend: Any) -> None:
    """Hook the splits and gathers of ``seq`` (:func:`plan_sequence`) onto ``model``.

    Where the plan allows, a region's input enters with :func:`~tpcompile.comm.enter_tp`
    (its backward reduce-scatter replaces the columns' all-reduce) and a row module's
    partial sum leaves with :func:`~tpcompile.comm.leave_tp` (a reduce-scatter instead
    of an all-reduce and a split): the same traffic as plain TP."""
    group = backend.group
    fused = hasattr(backend, "mark_entered") and hasattr(backend, "exit_reducers")
    mods = dict(model.named_modules())
    streams = {stack: _Stream() for stack in seq["stacks"]}
    wanted = {"on": True, "depth": 0}
    _watch_outputs_asked(model, [s.rpartition(".")[0] for s in seq["stacks"]], wanted)
    _guard_open_streams(model, streams)
    for stack, spec in seq["stacks"].items():
        _hook_stack(mods[spec["first"]], mods[spec["last"]], spec, streams[stack], wanted, group)
    for name, spec in seq.get("grad_sum", {}).items():
        _sum_grads(mods[name], spec["params"], streams[spec["stack"]], group)
    for name, spec in seq["regions"].items():
        st = streams[spec["stack"]]
        for _path, dim, row in spec["split"]:
            if row and fused:
                backend.exit_reducers[id(mods[row])] = _leaver(st, group, dim)
        _hook_region(mods[name], spec, st, backend if fused else None, group)


def _watch_outputs_asked(model: nn.Module, stacks: list[str], wanted: dict) -> None:
    """Calls that ask for intermediate hidden states would get slices of them: such
    calls run whole. Watched on the model and every module above a stack, whichever
    the user calls: the outermost call decides, an inner one can only switch off."""
    mods = dict(model.named_modules())
    owners = {""} | {".".join(s.split(".")[:i]) for s in stacks for i in range(1, len(s.split(".")) + 1)}

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        asks = kwargs.get("output_hidden_states")
        if wanted["depth"] == 0:
            if asks is None:
                asks = getattr(getattr(mod, "config", None), "output_hidden_states", False)
            wanted["on"] = not asks
        elif asks:
            wanted["on"] = False
        wanted["depth"] += 1

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
        wanted["depth"] -= 1

    for name in owners:
        mod = mods.get(name)
        if mod is not None and not isinstance(mod, nn.ModuleList | nn.ModuleDict):
            mod.register_forward_pre_hook(pre, with_kwargs=True)
            mod.register_forward_hook(post, with_kwargs=True, always_call=True)


def _guard_open_streams(model: nn.Module, streams: dict[str, _Stream]) -> None:
    """A stack split at its first block but never gathered (its last block skipped:
    LayerDrop) would hand token slices to the model's head: refuse loudly."""
    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        for stack, st in streams.items():
            if st.open:
                st.open = False
                raise RuntimeError(f"sequence parallelism: {stack} was split but its last block did not run "
                                   "(LayerDrop?); transform without sequence_parallel for such training")

    model.register_forward_hook(post)


def _hook_stack(first: nn.Module, last: nn.Module, spec: dict, st: _Stream, wanted: dict, group: Any) -> None:
    """Split the stream entering the stack's first block, gather it leaving the last."""
    path, dim = spec["stream"]

    def first_pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        x = _get({"args": args, "kwargs": kwargs}, path)
        st.on = wanted["on"] and isinstance(x, torch.Tensor) and x.dim() > dim
        if not st.on:
            return args, kwargs
        st.length, st.open = x.shape[dim], True
        return _map_call(args, kwargs, [[path, dim]], lambda t, d: split_tokens(t, group, d))

    def last_post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        # ``st`` stays as this forward left it (the next forward's first block resets
        # it): activation checkpointing re-runs the regions' hooks in backward
        if not st.on:
            return out
        st.open = False
        return _map_out(out, [spec["output"]], lambda t, d: gather_tokens(t, group, d, st.length))

    first.register_forward_pre_hook(first_pre, with_kwargs=True, prepend=True)
    last.register_forward_hook(last_post, with_kwargs=True)


def _leaver(st: _Stream, group: Any, dim: int) -> Any:
    """A row module's exit while the stream is split: pad, then reduce-scatter."""
    def leave(t: torch.Tensor) -> torch.Tensor | None:
        if not st.on:
            return None
        st.left += 1
        return comm.leave_tp(_pad_tokens(t, comm.group_size(group), dim), group, dim)
    return leave


def _hook_region(module: nn.Module, spec: dict, st: _Stream, backend: Any, group: Any) -> None:
    def enter(t: torch.Tensor, dim: int, fuse: bool) -> torch.Tensor:
        n = comm.group_size(group)
        if t.shape[dim] * n != st.length + (-st.length % n):
            raise RuntimeError(f"sequence parallelism: a region got {t.shape[dim]} tokens, expected this "
                               f"rank's {(st.length + n - 1) // n} of {st.length} (was the stack's first "
                               "block skipped, LayerDrop?)")
        if not (fuse and backend is not None):
            return gather_tokens(t, group, dim, st.length)
        full = comm.enter_tp(t, group, dim)
        full = full.narrow(dim, 0, st.length).contiguous() if full.shape[dim] != st.length else full
        backend.mark_entered(full)  # the columns take it as it is: no second all-reduce
        return full

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        st.left = 0
        if not st.on:
            return args, kwargs
        for path, dim, fuse in spec["gather"]:
            args, kwargs = _map_call(args, kwargs, [[path, dim]], lambda t, d, f=fuse: enter(t, d, f))
        return args, kwargs

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if not st.on:
            return out
        for path, dim, row in spec["split"]:
            if row and backend is not None:
                if not st.left:  # the plan proved the row output is the region's output
                    raise RuntimeError(f"sequence parallelism: {row} did not leave its region split")
                continue
            out = _map_out(out, [[path, dim]], lambda t, d: split_tokens(t, group, d))
        return out

    # prepend: the tokens are whole before the TP hooks (copy_to_tp) see them
    module.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    module.register_forward_hook(post, with_kwargs=True)


def _sum_grads(module: nn.Module, names: list[str], st: _Stream, group: Any) -> None:
    """While the stream is split, ``module``'s parameters ``names`` are used through
    ``all_reduce_grad``: their gradient sums every rank's tokens."""
    mine: dict[str, Any] = {}

    def pre(mod: nn.Module, args: tuple) -> None:
        if not st.on:
            return
        for name in names:
            p = mod._parameters[name]
            # the backend swaps a DTensor for its local tensor and restores it itself;
            # (isinstance(local, nn.Parameter) is no test: to_local keeps the flag)
            if isinstance(p, DTensor) or type(p) is nn.Parameter:
                mine[name] = p
            local = p.to_local() if isinstance(p, DTensor) else p
            mod._parameters[name] = comm.all_reduce_grad(local, group)

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        while mine:
            name, p = mine.popitem()
            mod._parameters[name] = p

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post, always_call=True)
