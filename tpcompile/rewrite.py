"""Rewrite: turn the analysis into a :class:`Plan` and apply it to the model in place.

``build_plan`` expands the analysed representative blocks to every block of the same
structure and records, per parameter, role and index map, and per module, its
collectives and attribute fix-ups.  ``apply_plan`` shards each parameter (never holding
more than one full tensor at a time), installs the backend's hooks, fixes hard-coded
sizes and returns the model.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .analysis.fixups import apply_fixups
from .analysis.propagate import innermost_module
from .analysis.roles import Analyzed
from .capture import Capture
from .errors import TPError
from .plan import ModulePlan, ParamPlan, Plan, Role, index_to_runs

__all__ = ["apply_plan", "build_plan", "localize_embedding"]


def _owner(fqn: str) -> tuple[str, str]:
    mod, _, name = fqn.rpartition(".")
    return mod, name


def _layout_kind(index: np.ndarray, size: int) -> str:
    tp, local = index.shape
    flat = index.reshape(-1)
    if (flat < 0).any():
        return "padded"
    if np.unique(flat).size < flat.size:
        return "kv_replicated"
    if np.array_equal(flat, np.arange(size)):
        return "contiguous"
    return "fused"


def build_plan(model: nn.Module, cap: Capture, a: Analyzed, *, loss_parallel: bool = False,
               fixups: dict[str, dict[str, list[int]]] | None = None) -> Plan:
    tp = a.part.tp
    plan = Plan(tp=tp, model_class=type(model).__name__, loss_parallel=loss_parallel, warnings=list(a.notes))
    names_of: dict[int, list[str]] = defaultdict(list)
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of[id(p)].append(name)
    modules: dict[str, ModulePlan] = {}

    def mod_plan(fqn: str) -> ModulePlan:
        return modules.setdefault(fqn, ModulePlan(fqn=fqn))

    rep_modules: dict[str, dict[str, Any]] = defaultdict(dict)
    for m in a.column.values():
        rep_modules[m]["copy_inputs"] = True
    for fqn, m in a.lm_head.items():
        rep_modules[m]["copy_inputs"] = True
        rep_modules[m]["gather_output"] = not loss_parallel
        rep_modules[m]["vocab_size"] = int(a.layouts[fqn].size)
    for m, bias in a.row.values():
        rep_modules[m]["reduce_output"] = True
        if bias is not None:
            owner, pname = _owner(bias)
            if owner != m:
                raise TPError(f"row-parallel {m} adds bias {bias} owned by another module")
            rep_modules[m].setdefault("row_biases", []).append(pname)
    for fqn, users in a.embedding.items():
        for m in users:
            rep_modules[m]["vocab_parallel"] = True
            rep_modules[m]["vocab_size"] = int(a.layouts[fqn].size)

    encoded: dict[str, tuple[str, list]] = {}
    scopes = _use_scopes(cap)
    for name, p in model.named_parameters():
        rep = cap.stacks.representative(name)
        aliases = [n for n in names_of[id(p)] if n != name]
        # a tied parameter is traced under one of its names: look each of them up
        key = next(
            (r for r in (rep, *map(cap.stacks.representative, aliases)) if r in a.layouts or r in a.grad_allreduce),
            rep,
        )
        lay = a.layouts.get(key)
        owner, _ = _owner(name)
        if lay is None:
            role = Role.GRAD_ALLREDUCE if key in a.grad_allreduce else Role.REPLICATED
            plan.params[name] = ParamPlan(fqn=name, role=role, module=owner, global_shape=list(p.shape),
                                          local_shape=list(p.shape), tied_to=aliases)
            if role is Role.GRAD_ALLREDUCE:
                for n in [name, *aliases]:
                    mo, pn = _owner(n)
                    mod_plan(mo).grad_allreduce.append(pn)
            continue
        role = (Role.LM_HEAD if key in a.lm_head else Role.COLUMN if key in a.column else Role.ROW
                if key in a.row else Role.VOCAB_EMBEDDING if key in a.embedding else Role.SHARDED)
        local = list(p.shape)
        local[lay.dim] = lay.local
        if key not in encoded:  # every block of one structure shares its representative's
            encoded[key] = (_layout_kind(lay.index, lay.size), index_to_runs(lay.index))
        kind, runs = encoded[key]
        plan.params[name] = ParamPlan(
            fqn=name, role=role, module=owner, global_shape=list(p.shape), local_shape=local,
            shard_dim=lay.dim, layout=kind, runs=runs, tied_to=aliases,
        )
    for name, pp in plan.params.items():
        up = scopes.get(cap.stacks.representative(name))
        if up:  # same number of levels above the owner in every block of a stack
            pp.scope = ".".join(name.split(".")[:-1 - up])
    for mname, _ in model.named_modules():
        rep = cap.stacks.representative(mname)
        if rep in rep_modules:
            mp = mod_plan(mname)
            for k, v in rep_modules[rep].items():
                setattr(mp, k, list(v) if isinstance(v, list) else v)
        if fixups and rep in fixups:
            mod_plan(mname).attr_fixups = dict(fixups[rep])
    plan.modules = dict(sorted(modules.items()))
    plan.blocks = [f"{stack}.{i}" for stack, reps in cap.stacks.members.items() for i in range(len(reps))]
    return plan


def _use_scopes(cap: Capture) -> dict[str, int]:
    """``{param fqn: levels}`` for parameters that code of an ancestor of their owner reads
    directly: how many levels above the owner the outermost such reader sits."""
    out: dict[str, int] = {}
    for node in cap.graph.nodes:
        fqn = cap.param_of_placeholder.get(node.name) if node.op == "placeholder" else None
        if fqn is None:
            continue
        owner = fqn.split(".")[:-1]
        for user in node.users:
            path = innermost_module(user).split(".") if innermost_module(user) else []
            if len(path) < len(owner) and owner[: len(path)] == path:
                out[fqn] = max(out.get(fqn, 0), len(owner) - len(path))
    return out


def apply_plan(model: nn.Module, plan: Plan, backend: Any) -> nn.Module:
    """Shard parameters and install hooks per ``plan`` (in place)."""
    mods = dict(model.named_modules())
    swaps: dict[str, list[str]] = defaultdict(list)
    scoped: dict[str, list[str]] = defaultdict(list)  # module -> descendants' param paths
    done: dict[int, nn.Parameter] = {}
    for name, pp in plan.params.items():
        mname, pname = _owner(name)
        old = mods[mname]._parameters[pname]
        new = done.get(id(old))
        if new is None:
            # replicated parameters become replicated DTensors too: optimizers' foreach
            # kernels and grad clipping refuse a mix of DTensors and plain tensors
            with torch.no_grad():
                local = old.detach() if pp.shard_dim is None else backend.local_shard(old.detach(), pp)
            new = backend.make_param(local, pp, old.requires_grad)
            done[id(old)] = new
        for alias in [name, *pp.tied_to]:
            am, ap = _owner(alias)
            mods[am]._parameters[ap] = new
            if alias == name and pp.scope is not None:
                scoped[pp.scope].append(name[len(pp.scope) + 1:] if pp.scope else name)
            else:
                swaps[am].append(ap)
        del old
    by_alias = {alias: pp for pp in plan.params.values() for alias in [pp.fqn, *pp.tied_to]}
    hooked = [m for m, mp in plan.modules.items()
              if mp.copy_inputs or mp.reduce_output or mp.grad_allreduce or mp.gather_output]
    for mname in dict.fromkeys([*swaps, *hooked]):
        names = swaps.get(mname, [])
        mp = plan.modules.get(mname) or ModulePlan(fqn=mname)
        vocab_range = None
        if mp.vocab_parallel:
            emb = next(by_alias[f"{mname}.{n}"] for n in names if f"{mname}.{n}" in by_alias)
            runs = emb.runs[backend.rank]
            vocab_range = (runs[0][0], runs[0][0] + emb.local_shape[emb.shard_dim])
            localize_embedding(mods[mname], vocab_range, emb.local_shape[emb.shard_dim])
        replicas = {n: by_alias[f"{mname}.{n}"] for n in names
                    if f"{mname}.{n}" in by_alias and by_alias[f"{mname}.{n}"].layout == "kv_replicated"}
        backend.install(mods[mname], mp, sorted(set(names)), vocab_range, replicas)
    for mname, paths in scoped.items():
        _install_scoped_swap(mods[mname], paths)
    for mname, mp in plan.modules.items():
        if mp.attr_fixups:
            apply_fixups(mods[mname], mp.attr_fixups)
    if getattr(backend, "tp", 1) > 1:
        # state_dict()/load_state_dict() speak HF tensors, whatever the local layout
        from .state_dict import install_state_dict_hooks

        install_state_dict_hooks(model, plan.params, backend.mesh)
        # transformers' own model.save_pretrained would gather onto one rank: route it
        from .checkpoint.hf_methods import bind_save_pretrained

        bind_save_pretrained(model)
    if hasattr(backend, "reset"):  # an input shared by column modules never spans two passes
        model.register_forward_pre_hook(lambda *_: backend.reset())
        model.register_forward_hook(lambda *_: backend.reset())
    model.tpcompile_plan = plan
    return model


def _install_scoped_swap(module: nn.Module, paths: list[str]) -> None:
    """For ``module``'s whole forward, its descendants' parameters at ``paths`` are their
    local tensors (the code reads them directly, outside the owner's forward)."""
    saved: list[tuple[nn.Module, str, Any]] = []

    def pre(mod: nn.Module, args: tuple) -> None:
        for path in paths:
            owner, _, leaf = path.rpartition(".")
            sub = mod.get_submodule(owner) if owner else mod
            p = sub._parameters[leaf]
            saved.append((sub, leaf, p))
            sub._parameters[leaf] = p.to_local() if isinstance(p, DTensor) else p

    def post(mod: nn.Module, args: tuple, out: Any) -> None:
        while saved:  # always_call: restored even when the forward raised
            sub, leaf, p = saved.pop()
            sub._parameters[leaf] = p

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post, always_call=True)


def localize_embedding(module: nn.Module, vocab_range: tuple[int, int], local_rows: int) -> None:
    """``nn.Embedding``'s own bookkeeping: local row count and padding index."""
    start, end = vocab_range
    if hasattr(module, "num_embeddings"):
        module.num_embeddings = local_rows
    pad = getattr(module, "padding_idx", None)
    if isinstance(pad, int):
        module.padding_idx = pad - start if start <= pad < end else None
