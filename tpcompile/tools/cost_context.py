"""What context parallelism costs per rank: its collectives and its activations.

:func:`~tpcompile.tools.cost.estimate_cost` asks this module for ``cp > 1``.  Nothing is
a second description of the runtime (:mod:`tpcompile.runtime.context`):

* **Collectives** (:func:`context_issues`): per attention call of the captured graph, the
  keys and the values all-gathered over the CP group in forward (before ``repeat_kv``,
  TP-local heads) and their gradients reduce-scattered in backward; one all-reduce of the
  loss.
* **Activations** (:func:`context_forward`): the cost model's fake-tensor forward runs
  through context parallelism's own split (:class:`~tpcompile.runtime.context.ContextParallel`)
  and attention (:func:`~tpcompile.runtime.context.cp_attention`) as rank 0 runs them, the
  all-gathers replaced by ``cp`` copies of the local keys and values (same shapes);
  what the attention saves is marked (:data:`ATTENDING`) and reported apart
  (:func:`context_summary`, ``dump-plan --cp``'s line).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..analysis.propagate import innermost_module
from ..capture import Capture
from ..plan.types import Plan
from .cost import Issue, _capture_tokens, _label, _nbytes
from .fake_kernels import FakeKernelFixes

__all__ = ["ATTENDING", "context_forward", "context_issues", "context_summary"]

aten = torch.ops.aten

ATTENDING = [False]  # inside context parallelism's attention (the estimate's forward)
_ESTIMATE_KEY = "tpcompile_cp_estimate"


def _counted_attention(*args: Any, **kwargs: Any) -> Any:
    """Context parallelism's attention, with what it saves marked as attention's."""
    from ..runtime.context import cp_attention

    ATTENDING[0] = True
    try:
        return cp_attention(*args, **kwargs)
    finally:
        ATTENDING[0] = False


def context_forward(shadow: nn.Module, mode: Any, pack: Any, cp: int, batch: int,
                     seq: int) -> tuple[Any, int]:
    """One training forward of ``shadow`` (fake tensors) as rank 0 of a CP group runs it:
    the runtime's split of a ``batch × seq`` batch of plain positions and its attention,
    the all-gathers replaced by ``cp`` copies of the local keys and values (the same
    shapes, nothing else saved).  Returns the output and the local length."""
    from ..plan.context import attention_configs
    from ..runtime import context

    class Repeated(context.ContextParallel):
        def gather(self, t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t] * self.size, dim=2)

    implementation = getattr(getattr(shadow, "config", None), "_attn_implementation", None) or "sdpa"
    context.register_attention(_ESTIMATE_KEY, _counted_attention)
    for config in attention_configs(shadow):
        config._attn_implementation_internal = _ESTIMATE_KEY
    rank0 = Repeated(None, cp, 0, implementation)
    active = context._ACTIVE[0]
    try:
        # no group to compare batches over: the split checks nothing
        _, kwargs = rank0.split((), {"input_ids": torch.zeros(batch, seq, dtype=torch.long)}, None)
        with mode, FakeKernelFixes(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            for name, value in list(vars(rank0).items()):  # its positions, as fake tensors
                if isinstance(value, torch.Tensor):
                    setattr(rank0, name, mode.from_tensor(value))
            kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            context._ACTIVE[0] = rank0
            return shadow(**kwargs, use_cache=False), kwargs["input_ids"].shape[1]
    finally:
        context._ACTIVE[0] = active


def context_issues(model: nn.Module, plan: Plan, cp: int, cap: Capture | None = None) -> list[Issue]:
    """Context parallelism's collectives (runtime/context.py): per attention call, the keys
    and the values all-gathered over the CP group in forward (each rank passes its 1/cp
    of the positions, its TP-local KV heads) and their gradients reduce-scattered in
    backward (the gathered tensor passed in); one all-reduce of the loss.  ``cap``: the
    model's :func:`~tpcompile.plan.context.context_capture` graph, when the caller prices
    several plans of one model (the layout search) and captures once."""
    from ..plan.context import ATTENTION_OPS, context_capture

    if cap is None:
        cap, _ = context_capture(model)
    tokens = _capture_tokens(cap)
    issues: list[Issue] = []
    for node in cap.graph.nodes:
        if node.target not in ATTENTION_OPS:
            continue
        module = innermost_module(node)
        expanded = cap.stacks.expand(module)
        for arg, what in ((node.args[1], "keys"), (node.args[2], "values")):
            arg = _before_repeat(arg)  # gathered before repeat_kv: only the KV heads move
            local = Fraction(_nbytes(arg), tokens) * _local_fraction(arg, cap, plan)  # per token, TP-local
            base = dict(source=module, op="all_gather", group="cp", count=len(expanded), label=_label(expanded))
            issues.append(Issue(**base, phase="forward", what=f"{what} (this rank's positions)",
                                bytes_per_token=local / cp))
            issues.append(Issue(**{**base, "op": "reduce_scatter_tensor"}, phase="backward",
                                what=f"gradient of the gathered {what}", bytes_per_token=local))
    issues.append(Issue(source="loss", phase="forward", op="all_reduce", group="cp", count=1, fixed_bytes=4,
                        what="the sequence's loss (sum of the ranks' parts)"))
    return issues


_SHAPE_OPS = {aten.expand.default, aten.reshape.default, aten.view.default, aten._unsafe_view.default,
              aten.unsqueeze.default, aten.clone.default, aten.contiguous.default, aten.slice.Tensor}


def _before_repeat(node: fx.Node) -> fx.Node:
    """The smallest tensor ``node`` is a reshaped / expanded copy of (keys before
    ``repeat_kv``: ``k[:, :, None].expand(...).reshape(...)``)."""
    best, n = node, node
    while n.op == "call_function" and n.target in _SHAPE_OPS and isinstance(n.args[0], fx.Node):
        n = n.args[0]
        if _nbytes(n) < _nbytes(best):
            best = n
    return best


def _local_fraction(node: fx.Node, cap: Capture, plan: Plan) -> Fraction:
    """How much of ``node``'s features a TP rank holds: that of the projection producing
    them (1 when nothing is split)."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        for a in n.all_input_nodes:
            fqn = cap.param_of_placeholder.get(a.target) if a.op == "placeholder" else None
            pp = plan.params.get(fqn) if fqn else None
            if pp is not None and len(pp.global_shape) == 2 and plan.tp > 1:
                return Fraction(pp.local_shape[0], pp.global_shape[0])
        todo.extend(a for a in n.all_input_nodes if a.op != "placeholder")
    return Fraction(1)


def context_summary(cost: dict[str, Any]) -> list[str]:
    """``dump-plan --cp``'s line on context parallelism's activation memory per rank (empty
    without ``cp > 1`` or ``--batch/--seq``)."""
    act = cost.get("activations") or {}
    if cost.get("cp", 1) <= 1 or act.get("attention") is None:
        return []
    from .cost_render import human_bytes

    return [f"context parallelism cp={cost['cp']}: activations per rank {human_bytes(act['bytes'])}, of which "
            f"attention {human_bytes(act['attention'])} (gathered keys and values, queries, outputs, "
            f"log-sum-exp; rank 0's two chunks of each {cost['seq']}-token sequence)"]
