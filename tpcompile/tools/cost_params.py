"""The parameter side of the cost model: FSDP2's shards and collectives, per-rank
parameter memory, FP8's amax all-reduces, and the totals of a step's collectives (the
training step, the eval step, the input guard); :mod:`tpcompile.tools.cost` adds the TP
collectives traced from the graph and the activations."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from torch import nn

from ..plan.types import Plan
from ..runtime.markers import CHECKSUM_BYTES, GUARDED_FORWARDS

__all__ = ["COLLECTIVES", "Issue", "eval_step", "fp8_gathered", "fp8_issues", "fsdp_issues", "input_guard", "local_shape",
           "memory", "totals"]


@dataclass(frozen=True, kw_only=True)
class Issue:
    """One collective issued ``count`` times per step by ``source``, per rank.

    Bytes of one call: ``bytes_per_token * tokens + fixed_bytes`` (tokens = ``B × S``).
    """

    source: str  # module FQN (the traced representative), "loss", or "fsdp:<unit>"
    phase: str  # "forward" | "backward"
    op: str  # a name of COLLECTIVES
    group: str  # "tp" | "dp_shard" | "cp"
    count: int
    bytes_per_token: Fraction = Fraction(0)
    fixed_bytes: int = 0
    what: str = ""
    label: str = ""  # every module the source stands for: model.layers.{0..31}.mlp.up_proj
    training: bool = False  # a training forward's only (BatchNorm's updated running statistics)

    def bytes(self, tokens: int) -> Fraction:
        return self.count * (self.bytes_per_token * tokens + self.fixed_bytes)


def _units(model: nn.Module, plan: Plan) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """FSDP2 units (each block, then the root) and the parameters each one shards."""
    units: dict[str, list[tuple[str, nn.Parameter]]] = {b: [] for b in plan.blocks}
    ordered = sorted(plan.blocks, key=len, reverse=True)
    units[""] = []
    for name, p in model.named_parameters():  # tied parameters once, as FSDP2 sees them
        unit = next((b for b in ordered if name.startswith(b + ".")), "")
        units[unit].append((name, p))
    return units


def local_shape(plan: Plan, name: str, p: nn.Parameter) -> list[int]:
    pp = plan.params.get(name)
    return list(pp.local_shape) if pp is not None and plan.tp > 1 else list(p.shape)


def _shard_numel(shape: list[int], dp: int) -> int:
    """FSDP2's padded dim-0 shard: ``torch.chunk`` chunk 0 (``ceil(d0 / dp)`` rows)."""
    if not shape:
        return 1
    rows = -(-shape[0] // dp)
    for d in shape[1:]:
        rows *= d
    return rows


def fsdp_issues(model: nn.Module, plan: Plan, dp_shard: int, fp8: frozenset[str] = frozenset()) -> list[Issue]:
    """FSDP2's collectives per unit; the weights named in ``fp8`` are gathered in FP8 (one
    byte per element, runtime/fp8_gather.py), their gradients reduced in their dtype."""
    issues = []
    for unit, params in _units(model, plan).items():
        if not params:
            continue
        shard = sum(_shard_numel(local_shape(plan, n, p), dp_shard) * (1 if n in fp8 else p.dtype.itemsize)
                    for n, p in params)
        grads = sum(_shard_numel(local_shape(plan, n, p), dp_shard) * p.dtype.itemsize
                    for n, p in params if p.requires_grad)
        src = f"fsdp:{unit or '<root>'}"
        ag = dict(source=src, op="all_gather_into_tensor", group="dp_shard", count=1, fixed_bytes=shard)
        issues.append(Issue(phase="forward", what="parameter shards", **ag))
        issues.append(Issue(phase="backward", what="parameter shards (resharded after forward)", **ag))
        if grads:
            issues.append(Issue(source=src, phase="backward", op="reduce_scatter_tensor", group="dp_shard",
                                count=1, fixed_bytes=grads * dp_shard, what="unsharded gradients"))
    return issues


def memory(model: nn.Module, plan: Plan, dp_shard: int) -> dict[str, int]:
    params = grads = tensors = 0
    for name, p in model.named_parameters():
        size = _shard_numel(local_shape(plan, name, p), dp_shard) * p.dtype.itemsize
        params += size
        if p.requires_grad:
            grads += size
            tensors += 1
    return {"parameters": params, "gradients": grads, "adamw_states": 2 * grads + 4 * tensors}


# ------------------------------------------------------------------ activations


def fp8_gathered(model: nn.Module, plan: Plan) -> frozenset[str]:
    """The weights ``parallelize(fp8=True)`` has FSDP2 all-gather in FP8."""
    from ..runtime.fp8 import fp8_modules, gathers_fp8

    return frozenset(f"{name}.weight" for name in fp8_modules(model, plan) if gathers_fp8(plan, name))


def fp8_issues(model: nn.Module, plan: Plan, gathered: frozenset[str] = frozenset()) -> list[Issue]:
    """FP8's amax all-reduces (runtime/fp8.py): one MAX of a scalar per split operand of
    every FP8 projection — the input and the weight in forward, the output gradient in
    backward.  A weight FSDP2 gathers in FP8 (``gathered``) is cast before its all-gather
    instead, with the scale of one MAX all-reduce over every rank per forward of the
    model, a float32 per gathered weight (runtime/fp8_gather.py)."""
    from ..runtime.fp8 import fp8_modules

    issues: list[Issue] = []
    width = {name: p.element_size() for name, p in model.named_parameters()}
    for name, spec in fp8_modules(model, plan).items():
        size = width.get(f"{name}.weight", 4)  # an amax has the parameter's dtype
        forward = int(spec.input_split) + int(spec.weight_split and f"{name}.weight" not in gathered)
        if forward:
            issues.append(Issue(source=name, phase="forward", op="all_reduce", group="tp", count=forward,
                                fixed_bytes=size, what="fp8 amax (input / weight)"))
        if spec.grad_split:
            issues.append(Issue(source=name, phase="backward", op="all_reduce", group="tp", count=1,
                                fixed_bytes=size, what="fp8 amax (output gradient)"))
    if gathered:
        issues.append(Issue(source="fp8:scales", phase="forward", op="all_reduce", group="world", count=1,
                            fixed_bytes=4 * len(gathered), what="fp8 amaxes of the FP8-gathered weights"))
    return issues


# every collective name the cost section may report (torch.distributed functions)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
               "all_to_all_single", "broadcast")


def totals(issues: list[Issue], tokens: int | None) -> dict[str, dict[str, dict[str, Any]]]:
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for phase in ("forward", "backward"):
        table: dict[str, dict[str, Any]] = {}
        for op in COLLECTIVES:
            mine = [i for i in issues if i.phase == phase and i.op == op]
            count = sum(i.count for i in mine)
            if tokens is None:
                per_token = sum((i.count * i.bytes_per_token for i in mine), Fraction(0))
                table[op] = {"count": count, "bytes_per_token": float(per_token),
                             "fixed_bytes": sum(i.count * i.fixed_bytes for i in mine)}
            else:
                table[op] = {"count": count, "bytes": int(sum((i.bytes(tokens) for i in mine), Fraction(0)))}
        out[phase] = table
    return out


def eval_step(issues: list[Issue], tokens: int | None) -> dict[str, dict[str, dict[str, Any]]]:
    """An evaluation loop's forward under ``no_grad``: the training forward's collectives
    (FSDP2 gathers every unit in it as in training, FP8 takes its amaxes) but those only
    a training forward issues (BatchNorm's running statistics), with labels, and without
    them (no loss, none of its collectives)."""
    evaluated = [i for i in issues if not i.training]
    return {"labels": totals(evaluated, tokens)["forward"],
            "no_labels": totals([i for i in evaluated if i.source != "loss"], tokens)["forward"]}


def input_guard(tp: int, cp: int, dropout: bool = False) -> dict[str, Any]:
    """What the input guard adds: in the first forwards after every switch between training
    and eval mode (each evaluation loop, and the training after it), every TP and CP group
    all-gathers a checksum of each input tensor (ids and labels: two), and in training,
    where a dropout is active, the TP group one more of its generator state
    (:mod:`tpcompile.runtime.random_state`); every ``generate()`` call compares its prompt
    over the TP group once more (``generate``: per input tensor, e.g. ids and attention
    mask, plus the generator state's)."""
    groups = [g for g, n in (("tp", tp), ("cp", cp)) if n > 1]
    return {"forwards": GUARDED_FORWARDS if groups else 0, "groups": groups,
            "all_gather": {"count": len(groups), "bytes": len(groups) * 2 * CHECKSUM_BYTES,
                           "bytes_no_labels": len(groups) * CHECKSUM_BYTES,
                           "training_extra_bytes": CHECKSUM_BYTES if tp > 1 and dropout else 0},
            "generate": {"count": int(tp > 1), "bytes_per_input": CHECKSUM_BYTES if tp > 1 else 0,
                         "fixed_bytes": CHECKSUM_BYTES if tp > 1 else 0}}
