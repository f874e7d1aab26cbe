"""Model attributes the ecosystem reads, set by the composer's last step.

:func:`mark_model` sets what transformers 5 honours for a model it sharded itself
(``DistributedConfig`` loading): ``_is_distributed_loading_by_transformers`` (the
``Trainer`` prepares the model without a DDP wrapper, builds the optimizer on the
sharded parameters, lets every rank into ``save_pretrained`` and defers FSDP2's gradient
sync during gradient accumulation) and ``config.distributed_config`` (the tp / FSDP /
replica degrees; never serialized into ``config.json``).  It also installs a guard that
raises a :class:`~tpcompile.errors.TPError` if the ranks of a TP group receive different
batches in the first forwards of training and of every evaluation, or different prompts
in any ``generate()`` call (tensor parallelism needs identical
inputs; without the guard a mis-sharded loader trains a silently wrong model, and
different prompts per rank generate garbage).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._pytree import tree_flatten

from ..errors import TPError
from .random_state import first_ranks_state, has_dropout, share_state, state_tensor

__all__ = ["CHECKSUM_BYTES", "GUARDED_FORWARDS", "GuardWindow", "differing_ranks", "input_checksum", "guarded_inputs",
           "mark_model", "mesh_degrees"]

# forwards whose inputs are compared across the TP (and CP) group after every switch between
# training and eval mode (generate() compares its prompt at every call besides)
GUARDED_FORWARDS = 2
CHECKSUM_BYTES = 3 * 8  # input_checksum: three int64 per input tensor


def mesh_degrees(model: nn.Module) -> tuple[int, int, int]:
    """``(dp_replicate, dp_shard, tp)`` of a transformed or parallelized model."""
    mesh: DeviceMesh = model.tpcompile_mesh
    names = mesh.mesh_dim_names or ()
    if "dp_shard" in names:  # parallelize: (dp_replicate, dp_shard, tp)
        return mesh.size(names.index("dp_replicate")), mesh.size(names.index("dp_shard")), \
            mesh.size(names.index("tp"))
    return 1, 1, mesh.size()


def _tp_group(model: nn.Module) -> Any:
    mesh: DeviceMesh = model.tpcompile_mesh
    return (mesh["tp"] if mesh.ndim > 1 else mesh).get_group()


def mark_model(model: nn.Module) -> None:
    """Set the attributes transformers' ``Trainer`` and accelerate read to recognise a
    model that distributes itself; called by ``transform`` and ``parallelize``.

    Example:
        >>> model = tpcompile.transform(model, tp=2)          # doctest: +SKIP
        >>> model.is_distributed_loading_by_transformers, model.config.distributed_config.tp_size
        (True, 2)
    """
    rep, shard, tp = mesh_degrees(model)
    model._is_distributed_loading_by_transformers = True
    config = getattr(model, "config", None)
    if config is not None:
        try:
            from transformers.distributed.configuration_utils import DistributedConfig
        except ImportError:  # older transformers: nothing reads it
            DistributedConfig = None  # noqa: N806
        if DistributedConfig is not None:
            config.distributed_config = DistributedConfig(tp_size=tp, fsdp_size=shard, dp_replicate_size=rep)
    if tp > 1 and not hasattr(model, "_tpcompile_input_guard"):
        model._tpcompile_input_guard = model.register_forward_pre_hook(_InputGuard(), with_kwargs=True)
        model.register_forward_hook(_refuse_split_attentions, with_kwargs=True)
        _guard_generate(model)


def _guard_generate(model: nn.Module) -> None:
    """Every ``generate()`` call compares its prompt over the TP group, not only the first
    eval forwards: an evaluation script that hands each rank its own prompts on its third
    call would otherwise decode each rank's own mix of shards silently.  Generation
    synchronises the host every token already, so one more small all-gather per call
    costs nothing that shows.  Bound as a method, so a ``deepcopy`` of the model (TRL's
    reference model) guards the copy."""
    if not callable(getattr(model, "generate", None)):
        return
    inner = model.__dict__.get("generate")  # a wrapper already set on the instance (FSDP2's root)
    if inner is not None:
        model._tpcompile_inner_generate = inner
    model.generate = types.MethodType(_guarded_generate, model)


def _guarded_generate(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    tensors = guarded_inputs((*args, *kwargs.values()))
    apart = False  # the ranks' generator states differ (sampling would draw different tokens)
    if tensors and dist.is_initialized():
        differ, apart = _differing(tensors, _tp_group(self), random_state=True)
        if differ:
            raise TPError(
                f"generate(): the ranks of a tensor-parallel group received different batches of prompts (TP-group ranks "
                f"{differ} differ from its first rank), which would decode a mix of each rank's shards; every "
                "rank of a TP group must generate from the same inputs (give the TP ranks one prompt batch, e.g. "
                "the slice tpcompile.data_parallel_rank(model) names)")
    inner = self.__dict__.get("_tpcompile_inner_generate")
    with first_ranks_state(_tp_group(self)) if apart else contextlib.nullcontext():
        return inner(*args, **kwargs) if inner is not None else type(self).generate(self, *args, **kwargs)


class _InputGuard:
    """Forward pre-hook: in the first forwards after every switch between training and
    eval mode (an evaluation loop's first batches, each time it runs; the training steps
    after it), every rank of the TP group must hold the same inputs (token ids, labels,
    images).  One all-gather of a few int64 checksums per checked forward; the steps in
    between cost nothing."""

    def __init__(self) -> None:
        self.window = GuardWindow()

    def __call__(self, model: nn.Module, args: tuple, kwargs: dict) -> None:
        if not dist.is_initialized() or not self.window.due(bool(model.training)):
            return
        tensors = guarded_inputs((*args, *kwargs.values()))
        if not tensors:
            return
        group = _tp_group(model)
        differ, apart = _differing(tensors, group, random_state=model.training and has_dropout(model))
        if apart and not differ:  # dropout masks would differ: one random stream for the group
            share_state(group)
        if differ:
            raise TPError(
                f"the ranks of a tensor-parallel group received different batches (TP-group ranks {differ} differ "
                "from its first rank); every rank of a TP group must see the same inputs. The HF Trainer does this "
                "itself once the model is transformed (tpcompile adds its TrainerSupport callback to every "
                "Trainer; do not remove it); with accelerate use "
                "tpcompile.integrations.prepare(accelerator, model, ...); in your own loop give each rank the "
                "slice tpcompile.data_parallel_rank(model) names")


def _refuse_split_attentions(model: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    """Forward hook: attention probabilities in the output (``output_attentions=True`` with
    eager attention) hold one map per head, and each tensor-parallel rank computes its
    own heads only: every rank would return a part of them, shaped by its local head
    count.  Refused while the plan splits anything (sdpa returns none: nothing to refuse)."""
    keys = getattr(output, "keys", None)
    if callable(keys):
        found = any(tree_flatten(output[k])[0] for k in keys() if k.endswith("attentions"))
    else:  # a plain tuple (return_dict=False): where the maps sit is the model's business
        found = bool(kwargs.get("output_attentions", getattr(getattr(model, "config", None), "output_attentions",
                                                             False)))
    plan = getattr(model, "tpcompile_plan", None)
    if found and plan is not None and any(pp.shard_dim is not None for pp in plan.params.values()):
        raise TPError(
            "output_attentions=True: the attention probabilities are returned per head, and each tensor-parallel "
            "rank computes only its own heads, so every rank would return a part of them. Run without "
            "output_attentions (and config.output_attentions=False), keep the attention whole with "
            "overrides={'re:.*attn.*': 'replicated'} when transforming, or inspect attention maps in a plain model")


class GuardWindow:
    """Which forwards compare their batch over a group: the first ``GUARDED_FORWARDS``
    after every switch between training and eval mode (so each evaluation, and the
    training after it, is checked anew; the steps in between cost nothing)."""

    def __init__(self) -> None:
        self.mode: bool | None = None
        self.left = 0

    def due(self, training: bool) -> bool:
        if training != self.mode:
            self.mode, self.left = training, GUARDED_FORWARDS
        if self.left <= 0:
            return False
        self.left -= 1
        return True


def guarded_inputs(values: Iterable[Any]) -> list[torch.Tensor]:
    """The non-empty tensors among ``values`` that the input guards compare: ids, labels
    and masks, and floating inputs too (``pixel_values``, ``input_features``,
    ``inputs_embeds``): a vision or audio model's ranks given different images would
    otherwise compute a mix of each rank's shards silently.  Tensors inside a list or
    tuple count too, and so do the numbers of one (LLaVA-NeXT's ``image_sizes`` given as
    a list picks each image's tiling)."""
    out: list[torch.Tensor] = []
    numbers: list[list[float]] = []
    for v in values:
        if isinstance(v, list | tuple):
            leaves = tree_flatten(v)[0]
            out += [t for t in leaves if isinstance(t, torch.Tensor) and t.numel()]
            found = [float(x) for x in leaves if isinstance(x, int | float) and not isinstance(x, bool)]
            if found:
                numbers.append(found)
        elif isinstance(v, torch.Tensor) and v.numel():
            out.append(v)
    device = out[0].device if out else torch.device("cpu")  # one device for the checksums' stack
    return out + [torch.tensor(n, dtype=torch.float64, device=device) for n in numbers]


def differing_ranks(tensors: list[torch.Tensor], group: Any) -> list[int]:
    """The ranks of ``group`` whose integer ``tensors`` differ from its first rank's: one
    all-gather of their checksums (every rank of the group calls)."""
    return _differing(tensors, group)[0]


def _differing(tensors: list[torch.Tensor], group: Any, random_state: bool = False) -> tuple[list[int], bool]:
    """:func:`differing_ranks`, and with ``random_state`` whether the ranks' generator
    states differ too (their checksum rides in the same all-gather,
    :mod:`.random_state`)."""
    if random_state:
        tensors = [*tensors, state_tensor(tensors[0].device)]
    sums = torch.stack([input_checksum(t) for t in tensors])
    everyone = [torch.empty_like(sums) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, sums, group=group)
    inputs = slice(0, len(tensors) - int(random_state))
    differ = [r for r, x in enumerate(everyone) if x.shape != sums.shape or not torch.equal(x[inputs], everyone[0][inputs])]
    apart = random_state and any(not torch.equal(x[-1], everyone[0][-1]) for x in everyone)
    return differ, apart


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def input_checksum(t: torch.Tensor) -> torch.Tensor:
    """Length, sum and position-weighted sum of a tensor's values (a floating tensor's
    bits, read as integers of its width): equal batches, equal sums."""
    flat = t.detach()
    if flat.is_complex():
        flat = torch.view_as_real(flat)
    if flat.is_floating_point():
        flat = flat.contiguous().view(_SAME_WIDTH_INT[flat.dtype.itemsize])
    flat = flat.reshape(-1).long()
    weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.long)
    return torch.stack([torch.tensor(flat.numel(), device=flat.device), flat.sum(), (flat * weights).sum()])
