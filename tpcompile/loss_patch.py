"""Loss-parallel wiring: the model's own loss call runs the vocab-parallel cross-entropy.

Hugging Face causal-LM heads compute their loss with ``self.loss_function(logits,
labels, vocab_size, ...)``.  With ``loss_parallel=True`` the LM head keeps its logits
vocab-sharded, so tpcompile points ``loss_function`` at
:func:`~tpcompile.loss.loss_parallel_causal_lm_loss`, which never gathers the full
logits: one all-reduce MAX and one all-reduce SUM of ``[tokens]``-sized tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .errors import TPError
from .loss import loss_parallel_causal_lm_loss
from .plan import Plan, Role

__all__ = ["install_local_loss", "install_loss_parallel", "is_causal_lm_loss"]


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
            "through; compute the loss with tpcompile.loss.vocab_parallel_cross_entropy yourself"
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
