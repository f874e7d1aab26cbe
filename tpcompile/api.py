"""The front door: ``transform`` and ``plan_model``."""

from __future__ import annotations

import os
import re
import time
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .analysis.experts import expert_plans
from .analysis.fixups import find_fixups, verify_fixups
from .analysis.propagate import Rule, RuleSet, module_path
from .analysis.roles import Analyzed, analyze
from .analysis.selfcheck import (
    Mismatch,
    SelfCheckError,
    check_local,
    raise_mismatches,
    resolve_fixups,
)
from .analysis.state import Feat, Partial
from .capture import Capture, capture
from .errors import TPError
from .plan import Plan, key_matches
from .rewrite import apply_plan, build_plan
from .translate import build_table

__all__ = ["plan_model", "transform"]

_BACKENDS = ("auto", "torch", "te")
_SELF_CHECK_RETRIES = 4  # strict=False: modules replicated one by one until the check passes


def _ruleset(rules: Iterable[Rule] | None) -> RuleSet:
    from tpcompile.rules import default_rules

    return RuleSet().add(default_rules()).add(rules or [])


def plan_model(
    model: nn.Module,
    tp: int,
    *,
    loss_parallel: bool = False,
    rules: Iterable[Rule] | None = None,
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
    (:func:`tpcompile.inputs.example_inputs`).  The stacked-experts modules of a MoE
    model are recorded in ``plan.experts`` whatever ``ep``; with ``ep > 1`` (expert
    parallelism, applied by :func:`tpcompile.parallelize`) the expert count must divide
    by it and the attributes holding it are found.

    Example:
        >>> with torch.device("meta"):
        ...     model = AutoModelForCausalLM.from_config(cfg)      # doctest: +SKIP
        >>> plan = plan_model(model, tp=8)
        >>> plan.params["lm_head.weight"].role.value
        'lm_head'
    """
    if not isinstance(tp, int) or tp < 1:
        raise TPError(f"tp must be a positive integer, got {tp!r}")
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise TPError(f"ep must be a positive integer, got {ep!r}")
    t0 = time.perf_counter()
    cap = capture(model, example_kwargs=example_inputs)
    t1 = time.perf_counter()
    forced = dict(overrides or {})

    def run(cap: Capture) -> Analyzed:
        return analyze(cap.graph, _ruleset(rules), tp, param_of_placeholder=cap.param_of_placeholder,
                       buffer_of_placeholder=cap.buffer_of_placeholder, strict=strict, overrides=forced)

    for attempt in range(_SELF_CHECK_RETRIES + 1):
        a = run(cap)
        if _crosses_cut_blocks(a, cap):
            # one traced block stands for its copies only if no sharded value crosses a
            # block boundary (a conv stack without norms alternates column and row)
            cap = capture(model, example_kwargs=example_inputs, cut_stacks=False)
            a = run(cap)
        try:
            fixups = _local_fixups(model, cap, a, tp, example_inputs) if tp > 1 else {}
            break
        except SelfCheckError as err:
            # non-strict: the module the localized model failed in stays replicated
            if strict or not err.module or attempt == _SELF_CHECK_RETRIES:
                raise
            warnings.warn(f"tpcompile: {err.module} kept replicated: {err.first}", stacklevel=2)
            forced[f"re:{re.escape(err.module)}\\..*"] = "replicated"
            a.notes.append(f"{err.module} kept replicated (self-check: {err.first})")
    plan = build_plan(model, cap, a, loss_parallel=loss_parallel, fixups=fixups)
    plan.ep = ep
    plan.experts = expert_plans(model, cap.graph, cap.param_of_placeholder, cap.stacks.expand, ep,
                                retrace=lambda: capture(model, example_kwargs=example_inputs).graph)
    _check_overrides(plan, overrides)
    if sequence_parallel and tp > 1:
        from .sequence import plan_sequence

        plan.sequence = plan_sequence(model, plan)
    plan.stats = {
        "capture_s": round(t1 - t0, 4),
        "analysis_s": round(time.perf_counter() - t1, 4),
        "analysis_passes": a.passes,
        "traced_blocks": cap.stacks.traced_len,
    }
    return plan


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


def _local_fixups(model: nn.Module, cap: Capture, a: Analyzed, tp: int,
                  example_inputs: dict[str, Any] | None) -> dict[str, dict[str, list[int]]]:
    """Hard-coded sizes made rank-local, proven by tracing rank 0's localized model.

    Candidates whose local value does not change the traced graph are dropped; sizes
    two attributes share globally are resolved by trying assignments; whatever remains
    inconsistent (or crashes) raises a :class:`TPError` naming module, op and shapes."""
    def retrace() -> fx.Graph:
        return capture(model, example_kwargs=example_inputs).graph

    fixups, ambiguous = find_fixups(a, model)
    if fixups:
        fixups = verify_fixups(model, fixups, cap.graph, retrace)

    def trace(shadow: nn.Module) -> fx.Graph:
        inputs = None if example_inputs is None else {
            k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in example_inputs.items()}
        return capture(shadow, example_kwargs=inputs).graph

    def check(trial: dict[str, dict[str, list[int]]]) -> list[Mismatch]:
        return check_local(model, a, cap.graph, trial, trace=trace, expand=cap.stacks.expand,
                           representative=cap.stacks.representative)

    problems = check(fixups)
    if problems and ambiguous:  # only then: keep the attributes the forward turns into a shape
        probe = {m: {k: [g, locs[0]] for k, (g, locs) in attrs.items()} for m, attrs in ambiguous.items()}
        kept = verify_fixups(model, probe, cap.graph, retrace)
        ambiguous = {m: {k: ambiguous[m][k] for k in attrs} for m, attrs in kept.items()}
    fixups, problems = resolve_fixups(fixups, ambiguous, check, problems)
    raise_mismatches(problems, model, tp)
    return fixups


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


def _resolve_mesh(model: nn.Module, tp: int, mesh: DeviceMesh | None) -> DeviceMesh:
    if mesh is not None:
        if mesh.ndim != 1:
            raise TPError(f"mesh must be a 1-D tensor-parallel DeviceMesh, got {mesh.ndim}-D; pass mesh['tp']")
        if mesh.size() != tp:
            raise TPError(f"mesh has {mesh.size()} ranks but tp={tp}; pass tp={mesh.size()}")
        return mesh
    if not dist.is_available() or not dist.is_initialized():
        raise TPError(
            "tpcompile.transform needs an initialized process group: launch with torchrun and "
            "call torch.distributed.init_process_group() first, or pass mesh=<1-D DeviceMesh>"
        )
    world = dist.get_world_size()
    if world % tp != 0:
        ok = [t for t in range(1, world + 1) if world % t == 0]
        raise TPError(f"world size {world} is not divisible by tp={tp}; tp values that work: {ok}")
    try:
        device = next(model.parameters()).device.type
    except StopIteration:
        device = "cpu"
    device = "cuda" if device == "cuda" else os.environ.get("TPCOMPILE_DEVICE", "cpu")
    full = init_device_mesh(device, (world // tp, tp), mesh_dim_names=("dp", "tp"))
    return full["tp"]


def _backend(name: str, mesh: DeviceMesh) -> Any:
    if name not in _BACKENDS:
        raise TPError(f"backend must be one of {_BACKENDS}, got {name!r}")
    if name == "te":
        from .backends.te_backend import TEBackend

        return TEBackend(mesh)
    from .backends.torch_backend import TorchBackend

    return TorchBackend(mesh)


def transform(
    model: nn.Module,
    tp: int,
    *,
    mesh: DeviceMesh | None = None,
    backend: str = "auto",
    loss_parallel: bool = False,
    rules: Iterable[Rule] | None = None,
    overrides: dict[str, str] | None = None,
    strict: bool = True,
    load_state_dict_from_rank0: bool = False,
    example_inputs: dict[str, Any] | None = None,
    sequence_parallel: bool = False,
    ep: int = 1,
) -> nn.Module:
    """Rewrite ``model`` in place into a tensor-parallel model over ``tp`` ranks.

    The model is traced with ``torch.export`` (no weights copied), every module's role is
    read off the dataflow, parameters are sharded as DTensors and collectives are hooked
    around the modules. The result is a drop-in: same forward signature, outputs, loss,
    ``generate()`` and gradients.

    Args:
        model: a Hugging Face (or any token-in) model, on CPU, GPU or meta.
        tp: tensor-parallel degree; the world size must be a multiple of it.
        mesh: a 1-D TP ``DeviceMesh``; default: the ``tp`` dim of a (dp, tp) mesh over
            the default process group.
        backend: ``"auto"`` / ``"torch"`` (DTensor, everywhere) or ``"te"`` (Transformer
            Engine, GPU).
        loss_parallel: keep logits vocab-sharded and compute the LM loss with a
            vocab-parallel cross-entropy (no full-logit gather).
        rules: extra propagation rules (see ``tpcompile.rules``).
        overrides: ``{fqn or "re:<regex>": "replicated"}`` to keep parameters replicated.
        strict: raise on ops no rule can place; ``False`` replicates them with a warning.
        load_state_dict_from_rank0: rank 0 holds the real weights, the other ranks may
            have built the model on the meta device; rank 0 sends each rank its shards.
        example_inputs: one batch of keyword arguments the forward accepts, to trace
            with; default: built from the model (``main_input_name`` and config sizes).
        sequence_parallel: between tensor-parallel regions (norms, residual adds) each
            rank keeps only its slice of the tokens (:mod:`tpcompile.sequence`).
        ep: the expert-parallel degree to plan for (``plan.experts``); the experts are
            split over ep ranks by :func:`tpcompile.parallelize`, transform keeps every
            expert and splits each over tp.

    The result carries ``model.tpcompile_plan`` (the :class:`Plan`) and
    ``model.tpcompile_table`` (the :class:`~tpcompile.translate.TranslationTable`
    between HF and per-rank layouts, used by every checkpoint function).

    Example:
        >>> dist.init_process_group("gloo")                       # doctest: +SKIP
        >>> model = tpcompile.transform(AutoModelForCausalLM.from_config(cfg), tp=2)
        >>> model.tpcompile_plan.params["lm_head.weight"].role.value
        'lm_head'
    """
    if backend not in _BACKENDS:
        raise TPError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    tp_mesh = _resolve_mesh(model, tp, mesh)
    be = _backend(backend, tp_mesh)
    plan = plan_model(model, tp, loss_parallel=loss_parallel, rules=rules, overrides=overrides,
                      strict=strict, example_inputs=example_inputs, sequence_parallel=sequence_parallel,
                      ep=ep)
    table = build_table(model, plan)
    full = None
    if load_state_dict_from_rank0 and dist.get_rank() == 0:
        full = dict(model.state_dict())  # the real tensors, released one by one while sent
    apply_plan(model, plan, be)
    from .loss_patch import install_local_loss, install_loss_parallel

    (install_loss_parallel if loss_parallel else install_local_loss)(model, plan, be)
    if plan.sequence:
        from .backends.sequence_parallel import install_sequence_parallel

        install_sequence_parallel(model, plan.sequence, be)
    model.tpcompile_mesh = tp_mesh
    model.tpcompile_table = table
    if load_state_dict_from_rank0:
        from .checkpoint.pretrained import scatter_from_rank0

        scatter_from_rank0(model, table, full)
    from .integrations import mark_model

    mark_model(model)  # what the HF Trainer / accelerate read to leave its parallelism alone
    return model

