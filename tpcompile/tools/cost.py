"""What one training step costs per rank: collectives as executed, bytes, memory.

``dump-plan`` answers "what will this cost?" before a GPU is spent. Nothing here is a
second description of the runtime: every collective is derived from the code path that
issues it.

* **TP hooks**: :meth:`~tpcompile.plan.modules.ModulePlan.collectives` is the list
  ``TorchBackend.install`` installs one handler per entry of; each record is bound to the captured
  graph to size its tensor. ``copy_to_tp`` sharing follows ``TorchBackend.copy_in``'s
  rule statically: consecutive column modules whose input is the *same graph node* (the
  same tensor object at runtime: q|k|v, gate|up) enter the TP region once, so one
  backward all-reduce; an input that does not require grad (a mask, rotary tables)
  issues none.
* **Loss**: the vocab-parallel cross-entropy's collectives
  (:func:`~tpcompile.runtime.loss.vocab_parallel_ce_collectives`) when the model's own
  causal-LM loss runs on the local vocab shard (``loss_parallel``, or the default mode
  when ``loss_function`` receives the LM head's gathered output unchanged).
* **FSDP2** (``dp_shard > 1``, ``FULL_SHARD``): per unit (each block of ``Plan.blocks``,
  then the root) one all-gather of its parameter shards forward, one again backward (the
  unit was resharded after forward) and one reduce-scatter of its gradients, with
  FSDP2's dim-0 padding.
* **Split statistics** (``SplitStats``: OLMo-2's ``q_norm`` over all heads): one
  all-reduce per partial statistic forward (two for ``var`` / ``std``) and the same
  backward where the statistic requires grad, each the size of the statistic's graph
  node (a float32 per token for an RMSNorm over the last dim).

Activation collectives scale with the number of tokens ``B × S``; parameter-sized ones
(gradient sums, FSDP2) do not. Memory per rank: parameters, gradients and AdamW states
(``exp_avg``, ``exp_avg_sq`` in the parameter dtype plus a float32 ``step`` per tensor)
under the sharding given, and an activation estimate (see
:func:`estimate_activations`).

Names are the ``torch.distributed`` functions: ``all_gather_into_tensor`` /
``reduce_scatter_tensor`` are FSDP2's collectives (torch >= 2.13 calls them
``all_gather_single`` / ``reduce_scatter_single``: the same operation).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..analysis.propagate import innermost_module
from ..analysis.stats import STAT_OPS
from ..capture import Capture, capture
from ..config import check_degree
from ..errors import TPError
from ..plan.modules import Hook, ModulePlan
from ..plan.types import ParamPlan, Plan, Role
from ..runtime.loss import vocab_parallel_ce_collectives
from ..runtime.random_state import has_dropout
from .cost_params import (
    COLLECTIVES,
    Issue,
    eval_step,
    fp8_gathered,
    fp8_issues,
    fsdp_issues,
    input_guard,
    local_shape,
    memory,
    totals,
)

__all__ = ["COLLECTIVES", "Issue", "estimate_activations", "estimate_cost", "trace_collectives"]


aten = torch.ops.aten
# ops whose floating output carries no gradient although a floating input does
_NO_GRAD_OPS = {
    aten.detach.default, aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
    aten.full_like.default, aten.rand_like.default, aten.randn_like.default, aten.new_empty.default,
    aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
}


# ------------------------------------------------------------------ the graph


def _val(node: fx.Node) -> Any:
    return node.meta.get("val")


def _floating(node: fx.Node) -> bool:
    v = _val(node)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def _nbytes(node: fx.Node) -> int:
    v = _val(node)
    return v.numel() * v.dtype.itemsize


def _requires_grad(graph: fx.Graph, cap: Capture, model: nn.Module) -> set[fx.Node]:
    """Nodes whose value requires grad in training: reached from a trainable parameter
    through differentiable ops (the capture ran under no_grad, so this is recomputed)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n.op == "placeholder":
            fqn = cap.param_of_placeholder.get(n.name)
            if fqn is not None and params[fqn].requires_grad:
                out.add(n)
        elif n.op == "call_function" and n.target not in _NO_GRAD_OPS:
            v = _val(n)
            differentiable = isinstance(v, list | tuple) or _floating(n)
            if differentiable and any(a in out for a in n.all_input_nodes):
                out.add(n)
    return out


@dataclass
class _Call:
    """One call of a module in the captured graph: the nodes it consumes and produces."""

    fqn: str
    inputs: list[fx.Node]  # first-use order
    outputs: list[fx.Node]
    stats: list[fx.Node]  # statistic ops run in the module's own code (split ones: SplitStats)


def _module_calls(cap: Capture) -> list[_Call]:
    """Every module call in the graph, in execution order (a call = an nn_module_stack key)."""
    members: dict[str, list[fx.Node]] = {}
    paths: dict[str, str] = {}
    for n in cap.graph.nodes:
        for key, (path, _) in (n.meta.get("nn_module_stack") or {}).items():
            members.setdefault(key, []).append(n)
            paths[key] = path
    weights = set(cap.param_of_placeholder) | set(cap.buffer_of_placeholder)
    calls = []
    for key, nodes in members.items():
        inside = set(nodes)
        inputs: dict[fx.Node, None] = {}
        for n in nodes:
            for a in n.all_input_nodes:
                if a not in inside and a.op != "get_attr" and a.name not in weights:
                    inputs.setdefault(a, None)
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        stats = [n for n in nodes if getattr(n.target, "overloadpacket", None) in STAT_OPS
                 and innermost_module(n) == paths[key]]
        calls.append(_Call(paths[key], list(inputs), outputs, stats))
    return calls


def capture_unit(cap: Capture) -> tuple[int, str]:
    """What the graph's activation sizes scale with, and how many of them it was traced
    with: its token ids (``"token"``: ``B × S`` of them), else its main input's batch
    (``"sample"``: an image, a clip or a spectrogram, whose size the config fixes)."""
    samples = None
    for n in cap.graph.nodes:
        if n.op == "placeholder" and n.name in cap.user_inputs:
            v = _val(n)
            if isinstance(v, torch.Tensor) and not v.is_floating_point():
                return v.numel(), "token"
            if isinstance(v, torch.Tensor) and v.dim() and samples is None:
                samples = int(v.shape[0])
    if samples is None:
        raise TPError("cannot size collectives: the captured graph has no tensor input")
    return samples, "sample"


def _capture_tokens(cap: Capture) -> int:
    """How many units (tokens, else samples) the graph was traced with: its sizes are per this."""
    return capture_unit(cap)[0]


# ------------------------------------------------------------------ tensor parallel


def _replicas(plan: Plan, fqn: str) -> list[str]:
    """Module-local names of the KV-replicated parameters ``fqn``'s forward swaps in (as
    apply_plan passes them): its own, and its descendants' its code reads directly."""
    out = []
    for p in plan.params.values():
        if p.layout != "kv_replicated":
            continue
        if p.scope is None and p.module == fqn:
            out.append(p.fqn.rpartition(".")[2])
        elif p.scope is not None and p.scope == fqn:
            out.append(p.fqn[len(fqn) + 1:] if fqn else p.fqn)
    return out


def _head_param(plan: Plan, fqn: str | None = None) -> ParamPlan | None:
    """The LM head's weight plan (of module ``fqn``, which may hold it as a tied alias)."""
    for p in plan.params.values():
        if p.role is Role.LM_HEAD:
            owners = {p.module, *(t.rpartition(".")[0] for t in p.tied_to)}
            if fqn is None or fqn in owners:
                return p
    return None


def _head_module(plan: Plan) -> str | None:
    """The module the LM head's hooks wrap (it enters the TP region; a tied embedding does not)."""
    head = _head_param(plan)
    if head is None:
        return None
    owners = [head.module, *(t.rpartition(".")[0] for t in head.tied_to)]
    return next((m for m in owners if m in plan.modules and plan.modules[m].enters), head.module)


def _gathered_per_token(node: fx.Node, plan: Plan, fqn: str, tokens: int) -> Fraction:
    """Bytes per token of the logits shard this rank passes to the all-gather."""
    full = Fraction(_nbytes(node), tokens)
    head = _head_param(plan, fqn)
    if head is None:
        return full
    return full / _val(node).shape[-1] * head.local_shape[head.shard_dim]


def trace_collectives(model: nn.Module, plan: Plan, cap: Capture | None = None) -> tuple[list[Issue], dict[str, str]]:
    """The TP and loss collectives one training step issues, per rank.

    Returns the issues (one per module and collective, ``count`` = calls × blocks of
    that structure) and ``{module: module whose copy_to_tp input it shares}``.

    Example:
        >>> issues, shared = trace_collectives(model, plan_model(model, tp=8))  # doctest: +SKIP
        >>> shared["model.layers.0.self_attn.k_proj"]
        'model.layers.0.self_attn.q_proj'
    """
    if plan.tp == 1:
        return [], {}
    cap = cap or capture(model)
    tokens = _capture_tokens(cap)
    grad = _requires_grad(cap.graph, cap, model)
    issues: list[Issue] = []
    shared: dict[str, str] = {}
    last: tuple[fx.Node, str] | None = None  # TorchBackend.copy_in remembers one input
    for call in _module_calls(cap):
        mplan = plan.modules.get(call.fqn) or ModulePlan(fqn=call.fqn)
        expanded = cap.stacks.expand(call.fqn)
        blocks, label = len(expanded), _label(expanded)
        for c in mplan.collectives(_replicas(plan, call.fqn)):
            base = dict(source=call.fqn, phase=c.phase, op=c.op, group="tp", label=label)
            if c.hook is Hook.ENTER:
                for node in call.inputs:
                    if not _floating(node):
                        continue
                    if last is not None and last[0] is node:
                        shared[call.fqn] = last[1]
                        continue
                    last = (node, call.fqn)
                    if node in grad:
                        issues.append(Issue(**base, count=blocks, what=f"grad of input {node.name}",
                                            bytes_per_token=Fraction(_nbytes(node), tokens)))
            elif c.hook is Hook.EXIT_GRAD:  # a re-entering row: its output's gradient
                for node in call.outputs:
                    if _floating(node) and node in grad:
                        issues.append(Issue(**base, count=blocks, what=f"grad of output {node.name}",
                                            bytes_per_token=Fraction(_nbytes(node), tokens)))
            elif c.hook in (Hook.EMBED_REDUCE, Hook.EXIT_REDUCE, Hook.EXIT_GATHER):
                for node in call.outputs:
                    if _floating(node):
                        size = _gathered_per_token(node, plan, call.fqn, tokens) \
                            if c.hook is Hook.EXIT_GATHER else Fraction(_nbytes(node), tokens)
                        issues.append(Issue(**base, count=blocks, what=f"output {node.name}", bytes_per_token=size))
            elif c.hook in (Hook.STAT_REDUCE, Hook.STAT_GRAD):  # a partial statistic (its gradient)
                node = call.stats[c.index]
                if c.hook is Hook.STAT_REDUCE or node in grad:
                    what = f"partial statistic {node.name}" + (" (grad)" if c.hook is Hook.STAT_GRAD else "")
                    issues.append(Issue(**base, count=blocks, what=what,
                                        bytes_per_token=Fraction(_nbytes(node), tokens)))
            elif c.hook is Hook.BUFFER_GATHER:  # this rank's rows of an updated running statistic
                buffer = model.get_buffer(f"{call.fqn}.{c.param}")
                issues.append(Issue(**base, count=blocks, what=f"updated buffer {c.param}", training=True,
                                    fixed_bytes=buffer.numel() * buffer.dtype.itemsize // plan.tp))
            else:  # GRAD_SUM / REPLICA_SUM: the parameter's gradient
                pp = plan.params[f"{call.fqn}.{c.param}"]
                shape = pp.global_shape if c.hook is Hook.REPLICA_SUM else pp.local_shape
                numel = 1
                for d in shape:
                    numel *= d
                dtype = model.get_parameter(pp.fqn).dtype
                issues.append(Issue(**base, count=blocks, what=f"grad of {c.param}",
                                    fixed_bytes=numel * dtype.itemsize))
    issues += _loss_issues(model, plan, cap)
    return issues, shared


def _label(fqns: list[str]) -> str:
    """``[a.0.b, a.1.b, a.3.b]`` → ``a.{0..1,3}.b`` (the first numeric component varies)."""
    if len(fqns) == 1:
        return fqns[0]
    parts = [f.split(".") for f in fqns]
    at = next(i for i, p in enumerate(parts[0]) if p.isdigit())
    runs: list[list[int]] = []
    for i in sorted(int(p[at]) for p in parts):
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ",".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)
    return ".".join([*parts[0][:at], "{" + text + "}", *parts[0][at + 1:]])


def _same_tensor(node: fx.Node) -> bool:
    """A conversion that returns its input itself (``.to(dtype)`` / ``.float()`` of a tensor
    already of that dtype, an alias)."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet not in (torch.ops.aten.to, torch.ops.aten.alias) or not node.all_input_nodes:
        return False
    src, val = _val(node.all_input_nodes[0]), _val(node)
    return (isinstance(src, torch.Tensor) and isinstance(val, torch.Tensor) and src.dtype == val.dtype
            and tuple(src.shape) == tuple(val.shape))


def _loss_issues(model: nn.Module, plan: Plan, cap: Capture) -> list[Issue]:
    """The vocab-parallel CE's collectives, when the model's loss runs on the local shard."""
    from ..runtime.loss import is_causal_lm_loss

    head = _head_module(plan)
    if head is None:
        return []
    if not plan.loss_parallel:
        if not is_causal_lm_loss(getattr(model, "loss_function", None)):
            return []
        # the local loss runs only if loss_function receives the gathered logits as the
        # LM head returned them; a model that changes them first (soft-capping) does not
        out = next(n for n in cap.graph.nodes if n.op == "output")
        direct = set(out.all_input_nodes)
        for n in list(direct):  # ``logits.float()`` in fp32 is the same tensor at runtime
            while n.op == "call_function" and _same_tensor(n):
                n = n.all_input_nodes[0]
                direct.add(n)
        head_nodes = {n for call in _module_calls(cap) if call.fqn == head for n in call.outputs}
        if not direct & head_nodes:
            return []
    return [Issue(source="loss", phase=phase, op=op, group="tp", count=1,
                  bytes_per_token=Fraction(values * 4), what=f"{values} float32 per token")
            for phase, op, values in vocab_parallel_ce_collectives()]


# ------------------------------------------------------------------ activations


def estimate_activations(model: nn.Module, plan: Plan, *, batch: int, seq: int | None, cp: int = 1,
                         cap: Capture | None = None, fp8: bool = False) -> dict[str, Any]:
    """Activation bytes one rank holds at the end of forward, for ``batch × seq`` tokens
    (a model without token ids: ``batch`` samples of the size its config gives, ``seq``
    unused).

    How: a copy of the model with every parameter at this rank's local (TP) shape, as
    fake CPU tensors (no memory), with the plan's attribute fix-ups, runs one training
    forward under ``saved_tensors_hooks``; every tensor autograd saves for backward is
    counted once per storage, parameters excluded. Repeated blocks run once and count
    once per block of their structure. Added: the gathered logits the caller holds
    (default mode) and the loss's saved buffer (the vocab-parallel CE's float32
    ``[tokens, local vocab]``, or a float32 log-softmax over the full vocabulary).
    Kernels are CPU's (SDPA's saved tensors differ by backend), and FSDP2's unsharded
    parameters and temporaries are not included. ``fp8``: the FP8 projections run as at
    runtime (under TP they save their FP8 casts of input and weight, 1 byte per element).

    ``cp > 1``: the forward runs on rank 0's slice of each sequence through context
    parallelism's own split and attention (:func:`~.cost_context.context_forward`: keys and values
    "gathered" as ``cp`` copies of the local ones), and ``attention`` is the part saved
    inside that attention (the gathered keys and values, queries, outputs, log-sum-exp,
    any mask).

    ``parts`` splits ``saved_for_backward`` by where it was saved: ``blocks`` maps each traced
    representative block to what one block of its structure saves, ``pre`` / ``post`` what
    is saved outside the blocks before the first and after the last (a pipeline's first and
    last stage, :mod:`~tpcompile.tools.cost_pipeline`).

    Returns ``{"bytes", "saved_for_backward", "logits", "loss", "attention", "parts", "method"}``, or
    ``{"bytes": None, "error"}`` when the model does not run on fake tensors.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..analysis.fixups import apply_fixups
    from .cost_context import ATTENDING, context_forward
    from .fake_kernels import FakeKernelFixes

    cap = cap or capture(model)
    stacks = cap.stacks
    # the loss runs on the local vocab shard exactly when the vocab-parallel CE is issued
    local_loss = plan.tp > 1 and bool(_loss_issues(model, plan, cap))
    mode = FakeTensorMode()
    memo: dict[int, Any] = {}
    with mode:
        for name, p in model.named_parameters(remove_duplicate=False):  # primary name first
            if id(p) not in memo:  # as the forward reads it (rows read twice: twice)
                pp = plan.params.get(name)
                shape = pp.compute_shape() if pp is not None and plan.tp > 1 else local_shape(plan, name, p)
                memo[id(p)] = nn.Parameter(torch.empty(shape, dtype=p.dtype), requires_grad=p.requires_grad)
        for b in model.buffers():
            memo[id(b)] = torch.empty(b.shape, dtype=b.dtype)
    shadow = copy.deepcopy(model, memo)
    if plan.tp > 1:
        for mname, mp in plan.modules.items():
            if mp.attr_fixups:
                apply_fixups(shadow.get_submodule(mname), mp.attr_fixups)
    if fp8:
        _to_float8(model, plan, shadow)
    weight: dict[str, int] = {}
    for stack, reps in stacks.members.items():  # run one block per structure
        mlist = shadow.get_submodule(stack)
        mlist._modules = dict(list(mlist._modules.items())[: max(reps) + 1])
        weight.update({f"{stack}.{i}": reps.count(i) for i in set(reps)})
    # outside the blocks: before the first ("<pre>") or after one ("<post>"), so a pipeline
    # stage can be given its own part (cost_pipeline.py)
    current: list[str] = ["<pre>"]
    for fqn in weight:
        block = shadow.get_submodule(fqn)
        block.register_forward_pre_hook(lambda _m, _a, f=fqn: current.__setitem__(0, f))
        block.register_forward_hook(lambda *_: current.__setitem__(0, "<post>"))
    owned = {p.untyped_storage()._cdata for p in shadow.parameters()}
    saved: dict[int, tuple[str, int]] = {}
    in_attention: set[int] = set()  # storages saved inside CP's attention

    def count(t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):  # FP8: the tensors it holds
            for name in t.__tensor_flatten__()[0]:
                count(getattr(t, name))
            return
        s = t.untyped_storage()
        if s._cdata not in owned and s._cdata not in saved:
            saved[s._cdata] = (current[0], s.nbytes())
            if ATTENDING[0]:
                in_attention.add(s._cdata)

    def pack(t: torch.Tensor) -> torch.Tensor:
        count(t)
        return t

    shadow.train()
    try:
        if cp > 1:
            out, local = context_forward(shadow, mode, pack, cp, batch, seq)
        elif capture_unit(cap)[1] == "sample":  # images, audio: the config sizes each sample
            from ..capture import example_inputs

            local = 1
            with mode, FakeKernelFixes(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = shadow(**example_inputs(shadow, batch=batch, splice=False))
        else:
            local = seq
            with mode, FakeKernelFixes(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                ids = torch.zeros(batch, seq, dtype=torch.long)
                try:
                    out = shadow(ids, use_cache=False)
                except TypeError:
                    out = shadow(ids)
    except Exception as err:  # noqa: BLE001 - any model code may refuse fake tensors
        return {"bytes": None, "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    body = sum(n * weight.get(block, 1) for block, n in saved.values())
    attention = sum(saved[c][1] * weight.get(saved[c][0], 1) for c in in_attention) if cp > 1 else None
    logits = getattr(out, "logits", None) if not isinstance(out, torch.Tensor) else out
    tokens = batch * local  # this rank's positions (CP: two chunks of each padded sequence)
    head = _head_param(plan)
    vocab = logits.shape[-1] if logits is not None else 0
    full_vocab = head.global_shape[head.shard_dim] if head is not None and plan.tp > 1 else vocab
    gathered = head is not None and plan.tp > 1 and not plan.loss_parallel
    held = tokens * full_vocab * logits.dtype.itemsize if gathered and logits is not None else 0
    if local_loss and head is not None:
        loss = tokens * (vocab * 4 + 8 + 2)  # float32 softmax buffer, int64 ids, two masks
    else:
        loss = tokens * full_vocab * 4  # cross_entropy's float32 log-softmax
    parts = {"pre": 0, "post": 0, "blocks": dict.fromkeys(weight, 0)}  # blocks: one of each structure
    for block, n in saved.values():
        if block in weight:
            parts["blocks"][block] += n
        else:
            parts[block[1:-1]] += n
    return {"bytes": body + held + loss, "saved_for_backward": body, "logits": held, "loss": loss,
            "attention": attention, "parts": parts,
            "method": "saved-for-backward tensors of a fake-tensor forward at local shapes "
                      "(repeated blocks once) + gathered logits + loss buffer"}


def _to_float8(model: nn.Module, plan: Plan, shadow: nn.Module) -> None:
    """The shadow's FP8 projections as the runtime runs them (runtime/fp8.py)."""
    from ..runtime.fp8 import convert_fp8_estimate

    convert_fp8_estimate(shadow, model, plan)


# ------------------------------------------------------------------ the report


def estimate_cost(model: nn.Module, plan: Plan, *, batch: int | None = None, seq: int | None = None,
                  dp_shard: int = 1, fp8: bool = False, cp: int = 1) -> dict[str, Any]:
    """The ``cost`` section of ``dump-plan``: per-rank collectives and memory of one step.

    ``batch × seq`` are the tokens each TP group processes per step (each data-parallel
    rank's micro-batch); without them, collective bytes are given per token (plus the
    fixed, parameter-sized part) and activations are left out.  A model without token
    ids (vision, audio: ``unit`` is ``"sample"``) is priced per sample of the size its
    config gives: ``batch`` alone, no ``seq``.  ``dp_shard > 1`` adds
    FSDP2 (``FULL_SHARD``) on top of ``tp``, as ``tpcompile.parallelize`` builds it.
    ``fp8=True`` adds the amax all-reduces of FP8 projections (``fp8=True`` in transform);
    with ``dp_shard > 1`` their weights are all-gathered in FP8 (``parallelize``'s default);
    ``cp > 1`` context parallelism's key / value all-gathers (``batch × seq`` are then
    the whole sequences a CP group shares).  ``eval_step`` is an evaluation loop's
    forward (with and without labels); ``input_guard`` the all-gather the first forwards
    in training and in eval mode add (tp or cp > 1).

    Example:
        >>> plan = plan_model(model, tp=2)                          # doctest: +SKIP
        >>> cost = estimate_cost(model, plan, batch=2, seq=16)
        >>> cost["per_step"]["backward"]["all_reduce"]["count"]    # 2 per block + LM head
        5
    """
    for key, value in (("batch", batch), ("seq", seq), ("dp_shard", dp_shard)):
        if value is not None:
            check_degree(key, value)
    cap = capture(model)
    unit = capture_unit(cap)[1]
    if unit == "sample":  # no token ids: the config sizes each sample, so a step is its batch
        if seq is not None or cp > 1:
            raise TPError(f"{type(model).__name__} takes no token ids (its input is sized by its config): give "
                          "batch (samples per step) without seq" + (", and no cp (it splits token sequences)"
                                                                    if cp > 1 else ""))
    elif (batch is None) != (seq is None):
        raise TPError("give both batch and seq (tokens per step = batch × seq), or neither")
    issues, shared = trace_collectives(model, plan, cap)
    # under FSDP2 (parallelize) fp8=True gathers the FP8 projections' weights in FP8
    gathered = fp8_gathered(model, plan) if fp8 and dp_shard > 1 else frozenset()
    if dp_shard > 1:
        issues += fsdp_issues(model, plan, dp_shard, gathered)
    if fp8 and (plan.tp > 1 or gathered):
        issues += fp8_issues(model, plan, gathered)
    if cp > 1:
        from .cost_context import context_issues

        issues += context_issues(model, plan, cp)
    tokens = None if batch is None else batch * (seq or 1)
    mem: dict[str, Any] = memory(model, plan, dp_shard)
    notes = []
    activations: dict[str, Any] | None = None
    if tokens is not None:
        activations = estimate_activations(model, plan, batch=batch, seq=seq, cp=cp, cap=cap, fp8=fp8)
        if gathered and activations["bytes"] is not None:
            # a weight gathered in FP8 is saved as FSDP2's unsharded parameter (left out
            # here, as every unsharded parameter is), not as a cast of its own
            casts = sum(math.prod(local_shape(plan, n, p)) + 4 for n, p in model.named_parameters() if n in gathered)
            activations["bytes"] -= casts
            activations["saved_for_backward"] -= casts
        mem["activations"] = activations["bytes"]
        if activations["bytes"] is None:
            notes.append(f"activation estimate unavailable: {activations['error']}")
    else:
        mem["activations"] = None
        notes.append("activations need --batch and --seq" if unit == "token" else "activations need --batch")
    mem["total"] = sum(v for v in mem.values() if v is not None)
    per_step = totals(issues, tokens)
    return {
        "tp": plan.tp, "dp_shard": dp_shard, "cp": cp, "batch": batch, "seq": seq, "tokens": tokens, "fp8": fp8,
        "unit": unit,
        "per_step": per_step,
        "eval_step": eval_step(issues, tokens),
        "input_guard": input_guard(plan.tp, cp, dropout=has_dropout(model)),
        "memory_per_rank": mem,
        "activations": activations,
        "issues": [_issue_dict(i) for i in issues],
        "shared_inputs": shared,
        "notes": notes,
    }


def _issue_dict(i: Issue) -> dict[str, Any]:
    return {"source": i.source, "modules": i.label or i.source, "phase": i.phase, "op": i.op, "group": i.group,
            "count": i.count, "bytes_per_token": float(i.bytes_per_token), "fixed_bytes": i.fixed_bytes,
            "what": i.what}
