"""Vocab-parallel cross entropy: the LM loss without gathering the full logits.

With the LM head column-sharded over a tensor-parallel group of size ``n``, rank
``r`` holds logits ``z[:, j]`` for global vocab ids ``j`` in
``[vocab_start, vocab_start + V_local)``.  For one token with target ``t``::

    loss = log(sum_j exp(z_j)) - z_t
         = log(sum_r sum_{j in shard r} exp(z_j - m)) - (z_t - m),   m = max_j z_j

so three small per-token reductions over the group are enough:

* ``m``   -- all-reduce MAX of the per-shard maxima (for stability only; the value
  cancels mathematically, so no gradient flows through it);
* ``S``   -- all-reduce SUM of the per-shard ``sum exp(z_j - m)``;
* ``z_t`` -- all-reduce SUM where only the shard owning ``t`` contributes.

The last two travel in one fused all-reduce.  The gradient is local::

    dloss/dz_j = softmax(z)_j - [j == t] = exp(z_j - m) / S - [j == t]

and is computed in place in the single ``[tokens, V_local]`` float32 buffer kept
from the forward pass.  Columns whose global id is ``>= vocab_size`` (padding added
to make the vocabulary divisible by ``n``) are treated as ``-inf`` logits: they get
probability 0 and gradient 0.

The result matches ``F.cross_entropy(full_logits.float().view(-1, V), labels.view(-1),
ignore_index=..., reduction=...)`` on the unpadded logits.

**Wiring.** Hugging Face causal-LM heads compute their loss with ``self.loss_function(
logits, labels, vocab_size, ...)``. With ``loss_parallel=True`` the LM head keeps its
logits vocab-sharded and :func:`install_loss_parallel` points ``loss_function`` at
:func:`loss_parallel_causal_lm_loss`; by default (:func:`install_local_loss`) the logits
are gathered for the caller but the model's own loss still reads this rank's shard.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import FunctionCtx
from torch.distributed import ProcessGroup

from ..errors import TPError
from ..plan.types import Plan, Role

__all__ = [
    "install_local_loss", "install_loss_parallel", "is_causal_lm_loss", "loss_parallel_causal_lm_loss",
    "vocab_parallel_ce_collectives", "vocab_parallel_cross_entropy",
]

_REDUCTIONS = ("mean", "sum", "none")
# the per-token float32 rows of the second forward all-reduce (the first carries the max)
_FUSED_STATS = ("sum_exp", "target", "owners")


def vocab_parallel_ce_collectives() -> list[tuple[str, str, int]]:
    """``(phase, torch.distributed op, float32 values per token)`` of each collective one
    :func:`vocab_parallel_cross_entropy` call issues over a group of more than one rank:
    the max, then the fused stats. Backward is local. ``tpcompile.tools.cost`` prices these.
    """
    return [("forward", "all_reduce", 1), ("forward", "all_reduce", len(_FUSED_STATS))]


# --------------------------------------------------------------------------- validation


def _validate(
    logits: Tensor,
    labels: Tensor,
    vocab_start: int,
    vocab_size: int | None,
    reduction: str,
) -> None:
    """Raise ``ValueError`` for arguments ``F.cross_entropy`` would also reject."""
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if logits.dim() < 1:
        raise ValueError("logits must have at least one dimension (the local vocab shard)")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be floating point, got dtype {logits.dtype}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got dtype {labels.dtype}")
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} must equal logits shape without the "
            f"vocab dim {tuple(logits.shape[:-1])} (logits shape {tuple(logits.shape)})"
        )
    if labels.device != logits.device:
        raise ValueError(f"labels on {labels.device} but logits on {logits.device}")
    if vocab_start < 0:
        raise ValueError(f"vocab_start must be >= 0, got {vocab_start}")
    if vocab_size is not None and vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")


def _num_valid_columns(local_vocab: int, vocab_start: int, vocab_size: int | None) -> int:
    """How many leading local columns are real vocab entries (the rest are padding)."""
    if vocab_size is None:
        return local_vocab
    return max(0, min(local_vocab, vocab_size - vocab_start))


# --------------------------------------------------------------------------- autograd


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``loss = log S - (z_t - m)`` with backward ``(softmax - onehot) * g``."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        logits: Tensor,
        labels: Tensor,
        group: ProcessGroup | None,
        vocab_start: int,
        num_valid: int,
        ignore_index: int,
        reduction: str,
    ) -> Tensor:
        local_vocab = logits.shape[-1]
        world = dist.get_world_size(group)
        # The one float32 buffer: shifted logits -> exp -> softmax -> grad.  ``copy=True``
        # guarantees it never aliases a float32 ``logits``, so in-place work is safe.
        buf = logits.reshape(-1, local_vocab).to(torch.float32, copy=True)
        flat_labels = labels.reshape(-1).to(torch.int64)  # gather needs int64 indices
        tokens = buf.shape[0]

        # m: global max over real columns.  Padding may hold garbage (even inf/nan), so
        # it is excluded here and overwritten with -inf below.
        if num_valid > 0:
            row_max = buf[:, :num_valid].amax(dim=-1)
        else:
            row_max = buf.new_full((tokens,), float("-inf"))
        if world > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        buf.sub_(row_max.unsqueeze(-1))
        buf[:, num_valid:] = float("-inf")

        # z_t - m from the owning shard only; other shards contribute 0.
        valid = flat_labels != ignore_index
        local_ids = flat_labels - vocab_start
        owned = valid & (local_ids >= 0) & (local_ids < num_valid)
        local_ids = torch.where(owned, local_ids, torch.zeros_like(local_ids))
        target = buf.gather(1, local_ids.unsqueeze(-1)).squeeze(-1)
        target = torch.where(owned, target, torch.zeros_like(target))

        buf.exp_()
        # One fused all-reduce for S, z_t - m and the owner count (for label checks).
        fused = {"sum_exp": buf.sum(dim=-1), "target": target, "owners": owned.to(torch.float32)}
        stats = torch.stack([fused[k] for k in _FUSED_STATS])
        if world > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
        sum_exp, target, owners = stats.unbind(0)
        _check_labels_owned(owners, valid, flat_labels)

        per_token = torch.where(valid, sum_exp.log() - target, torch.zeros_like(target))
        buf.div_(sum_exp.unsqueeze(-1))  # exp(z - m) / S = softmax, kept for backward
        count = valid.sum().to(torch.float32)

        ctx.save_for_backward(buf, local_ids, owned, valid, count)
        ctx.reduction = reduction
        ctx.logits_shape, ctx.logits_dtype = logits.shape, logits.dtype

        if reduction == "none":
            return per_token.view(labels.shape)
        total = per_token.sum()
        return total / count if reduction == "mean" else total

    @staticmethod
    def backward(ctx: FunctionCtx, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        softmax, local_ids, owned, valid, count = ctx.saved_tensors
        # Per-row upstream scale g_i: g / count for "mean", g for "sum", g_i for "none";
        # ignored rows get 0.
        if ctx.reduction == "none":
            scale = grad_out.reshape(-1).to(torch.float32)
        else:
            scale = grad_out.to(torch.float32).expand(softmax.shape[0])
            if ctx.reduction == "mean":
                scale = scale / count
        scale = torch.where(valid, scale, torch.zeros_like(scale))

        # (softmax - onehot) * g, in place: the saved buffer becomes the gradient.  A
        # second backward through the same graph fails loudly on the version check.
        grad = softmax
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_ids] -= owned.to(grad.dtype)
        grad.mul_(scale.unsqueeze(-1))
        grad = grad.to(ctx.logits_dtype).view(ctx.logits_shape)
        return grad, None, None, None, None, None, None


def check_labels(labels: Tensor, vocab: int, ignore_index: int, what: str, shift: int = 0) -> None:
    """Refuse a label outside ``[0, vocab)`` that is not ``ignore_index``, as the unsplit
    model's cross-entropy does ("Target ... is out of bounds"): split over the vocabulary,
    no shard owns it.  No collective: a TP group's ranks hold the same labels (the input
    guard checks it); on CUDA the check is asynchronous (no host sync in the step).
    ``shift`` is added to the reported last index (``labels`` a shifted view)."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    if labels.is_cuda:
        torch._assert_async(~bad.any(), f"a label is outside the vocabulary [0, {vocab})")
        return
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        shown = [*where[:-1], where[-1] + shift] if where else []  # ``shift``: ``labels`` is the caller's [..., shift:]
        raise TPError(f"{what}: label {int(labels[where])} at position {shown} is outside the vocabulary "
                      f"[0, {vocab}) and is not ignore_index ({ignore_index}); the unsplit model's cross-entropy "
                      "raises here. Mask such positions with -100, or resize the embeddings for added tokens")


def _check_labels_owned(owners: Tensor, valid: Tensor, labels: Tensor) -> None:
    """Every non-ignored label must live in exactly one shard's real columns.

    ``owners`` is identical on all ranks (it was all-reduced), so either every rank
    raises or none does; no rank is left waiting in a later collective.  A label inside
    the vocabulary (:func:`check_labels` ran first) owned by no shard or by two means the
    group's ranks were handed different labels, or shards that overlap.
    """
    bad = owners != valid.to(owners.dtype)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        raise TPError(
            f"label {int(labels[first])} at flat position {first} is owned by {int(owners[first])} vocabulary "
            "shards instead of 1: the ranks of the tensor-parallel group were handed different labels (every "
            "rank of a TP group must get the same batch: load the slice tpcompile.data_parallel_rank(model) "
            "names), or the shards overlap"
        )


# --------------------------------------------------------------------------- public API


def vocab_parallel_cross_entropy(
    logits: Tensor,
    labels: Tensor,
    *,
    group: ProcessGroup | None,
    vocab_start: int,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Cross entropy over a vocab-sharded logits tensor, never gathering it.

    Args:
        logits: this rank's shard ``[..., V_local]`` covering global vocab ids
            ``[vocab_start, vocab_start + V_local)``; any float dtype.
        labels: global target ids ``[...]`` (same on every rank of ``group``).
        group: the tensor-parallel group the vocab is sharded over (``None`` means
            the default group).
        vocab_start: global id of this shard's first column.
        vocab_size: true vocabulary size ``V``; columns with global id ``>= V`` are
            padding and excluded (treated as ``-inf``).  ``None``: no padding.
        ignore_index: labels equal to this contribute neither loss nor gradient.
        reduction: ``"mean"`` (over non-ignored labels, ``nan`` if there are none, as
            in torch), ``"sum"`` or ``"none"`` (per token, shape of ``labels``, 0 at
            ignored positions).

    Returns:
        float32 loss equal to ``F.cross_entropy(full.float().view(-1, V),
        labels.view(-1), ignore_index=ignore_index, reduction=reduction)`` where
        ``full`` is the concatenation of all shards without padding; per-token
        losses keep ``labels.shape``.  Computation is in float32 whatever the input
        dtype; the logits gradient is returned in the logits dtype.

    Raises:
        ValueError: on malformed arguments; ``TPError`` (a ``ValueError``) for a
            non-ignored label outside ``[0, vocab_size)`` (no collective), or (on every
            rank alike) one that does not fall in exactly one shard's real columns.
    """
    _validate(logits, labels, vocab_start, vocab_size, reduction)
    check_labels(labels, _vocab_total(logits, group, vocab_size), ignore_index, "labels")
    return _checked_cross_entropy(logits, labels, group, vocab_start, vocab_size, ignore_index, reduction)


def _vocab_total(logits: Tensor, group: ProcessGroup | None, vocab_size: int | None) -> int:
    """The whole vocabulary: ``vocab_size``, or every rank's equal shard of columns."""
    return vocab_size if vocab_size is not None else logits.shape[-1] * dist.get_world_size(group)


def _checked_cross_entropy(logits: Tensor, labels: Tensor, group: ProcessGroup | None, vocab_start: int,
                           vocab_size: int | None, ignore_index: int, reduction: str) -> Tensor:
    """:func:`vocab_parallel_cross_entropy` on labels :func:`check_labels` has passed."""
    num_valid = _num_valid_columns(logits.shape[-1], vocab_start, vocab_size)
    return _VocabParallelCrossEntropy.apply(
        logits, labels, group, vocab_start, num_valid, ignore_index, reduction
    )


def loss_parallel_causal_lm_loss(
    logits: Tensor,
    labels: Tensor,
    *,
    group: ProcessGroup | None,
    vocab_start: int,
    vocab_size: int | None,
    ignore_index: int = -100,
    num_items_in_batch: int | Tensor | None = None,
    shift_labels: Tensor | None = None,
) -> Tensor:
    """Hugging Face causal-LM loss on vocab-sharded logits ``[..., T, V_local]``.

    Position ``t`` predicts token ``t + 1``: the loss pairs ``logits[..., :-1, :]``
    with ``labels[..., 1:]``.  Like transformers' ``ForCausalLMLoss`` this is done by
    shifting the labels left and padding the last position with ``ignore_index``,
    which gives the same value without copying the (large) sliced logits.

    Returns the mean over non-ignored targets, or, when ``num_items_in_batch`` is
    given (gradient accumulation), ``sum / num_items_in_batch``, as transformers
    does.  ``shift_labels``, if given, are used as the already-shifted targets
    ``[..., T]`` and ``labels`` is ignored.
    """
    if logits.dim() < 2:
        raise ValueError(
            f"causal-LM logits must be [..., T, V_local], got shape {tuple(logits.shape)}"
        )
    total = _vocab_total(logits, group, vocab_size)
    if shift_labels is None:
        labels = labels.to(logits.device)
        if tuple(labels.shape) != tuple(logits.shape[:-1]):
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal logits shape without the "
                f"vocab dim {tuple(logits.shape[:-1])}"
            )
        check_labels(labels[..., 1:], total, ignore_index, "labels", shift=1)  # the first is never a target
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    else:
        check_labels(shift_labels, total, ignore_index, "shift_labels")
    shift_labels = shift_labels.to(logits.device).contiguous()

    reduction = "mean" if num_items_in_batch is None else "sum"
    _validate(logits, shift_labels, vocab_start, vocab_size, reduction)
    # the labels were checked above, in the caller's positions: not a second pass here
    loss = _checked_cross_entropy(logits, shift_labels, group, vocab_start, vocab_size, ignore_index, reduction)
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


# ------------------------------------------------------------------ wiring into the model


def install_local_loss(model: nn.Module, plan: Plan, backend: Any) -> None:
    """Default mode: the logits are gathered for the caller, but the model's own loss is
    computed from this rank's vocab shard (the vocab-parallel cross-entropy), so no rank
    runs the full-vocabulary softmax and backward never touches the gathered logits.

    Only when ``loss_function`` receives exactly the gathered LM-head output; logits the
    model changed first (Gemma-2's soft-capping) take the original loss.
    """
    heads = [p for p in plan.params.values() if p.role is Role.LM_HEAD]
    original = getattr(model, "loss_function", None)
    if not heads or not is_causal_lm_loss(original) or not hasattr(backend, "gathered"):
        return
    local_loss = _local_loss_function(heads[0], backend)

    def loss_function(logits: torch.Tensor, labels: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        local = backend.gathered(logits)
        if local is None:
            return original(logits, labels, *args, **kwargs)
        return local_loss(local, labels, *args, **kwargs)

    model.loss_function = loss_function


def install_loss_parallel(model: nn.Module, plan: Plan, backend: Any) -> None:
    heads = [p for p in plan.params.values() if p.role is Role.LM_HEAD]
    if not heads:
        raise TPError("loss_parallel=True needs a vocab-sharded LM head, and the analysis found none")
    if not hasattr(type(model), "loss_function"):
        raise TPError(
            f"loss_parallel=True: {type(model).__name__} has no `loss_function` to route the loss "
            "through; compute the loss with tpcompile.runtime.loss.vocab_parallel_cross_entropy yourself"
        )
    if not is_causal_lm_loss(getattr(model, "loss_function", None)):
        raise TPError(
            f"loss_parallel=True: {type(model).__name__}'s loss is not transformers' causal-LM loss "
            "(ForCausalLMLoss), which is the one tpcompile computes vocab-parallel; use loss_parallel=False"
        )
    model.loss_function = _local_loss_function(heads[0], backend)


def is_causal_lm_loss(fn: Any) -> bool:
    """Is ``fn`` transformers' shifted next-token cross-entropy (``ForCausalLMLoss``), the
    only loss the shard-local CE mirrors?"""
    return getattr(fn, "__name__", "") == "ForCausalLMLoss"


def _local_loss_function(head: Any, backend: Any) -> Any:
    vocab_start = head.runs[backend.rank][0][0]
    vocab_size = head.global_shape[head.shard_dim]
    group = backend.group

    def loss_function(
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size_arg: int | None = None,  # HF passes config.vocab_size; the plan knows better
        num_items_in_batch: Any = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        return loss_parallel_causal_lm_loss(
            logits, labels, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
            ignore_index=ignore_index, num_items_in_batch=num_items_in_batch, shift_labels=shift_labels,
        )

    return loss_function
