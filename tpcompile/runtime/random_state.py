"""One random stream per tensor-parallel group.

The ranks of a TP group compute one model, so whatever it draws at random must be drawn
alike on all of them: a dropout mask on a replicated activation (GPT-2's residual
dropout), a token sampled by ``generate(do_sample=True)``.  Ranks seeded apart (a data
loader's per-rank seed) drew different masks, so each rank's copy of the residual stream
differed and the all-reduces summed parts of different computations; and different
tokens, so the next step fed each rank its own prompt.  Both were silent.

No collective of its own in the normal case: the input guard's all-gather
(:mod:`.markers`) carries a checksum of the generator state beside the inputs' (in the
training forwards it checks, where a dropout is active, and in every ``generate()``
call).  Only where the states differ does the group's first rank broadcast its own.
Between the guarded forwards the ranks draw the same numbers in the same order, so they
stay together.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["first_ranks_state", "has_dropout", "is_dropout_field", "share_state", "state_tensor"]


def _states() -> list[torch.Tensor]:
    """This rank's generator states: the CPU's, and CUDA's once in use."""
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if cuda else [])


def _set_states(states: list[torch.Tensor]) -> None:
    torch.set_rng_state(states[0])
    if len(states) > 1:
        torch.cuda.set_rng_state(states[1])


def state_tensor(device: torch.device) -> torch.Tensor:
    """This rank's generator states as one byte tensor on ``device``, to checksum beside
    the inputs."""
    return torch.cat(_states()).to(device)


def is_dropout_field(key: str, value: object) -> bool:
    """A probability a dropout reads (``attention_dropout``, ``resid_pdrop``), above zero."""
    return isinstance(value, float) and value > 0 and ("dropout" in key or "pdrop" in key)


def has_dropout(model: nn.Module) -> bool:
    """A dropout module, or a config field (``attention_dropout``, ``resid_pdrop``) a
    functional dropout reads, with a probability above zero.  Asked in the guarded
    forwards only, so it is looked up afresh (a config changed since counts)."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    seen: set[int] = set()
    stack = [getattr(model, "config", None)]
    while stack:
        cfg = stack.pop()
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "__dict__"):
            continue
        seen.add(id(cfg))
        for key, value in vars(cfg).items():
            if is_dropout_field(key, value):
                return True
            if hasattr(value, "to_dict"):  # a sub-config (text_config, vision_config)
                stack.append(value)
    return False


def share_state(group: Any) -> None:
    """Every rank of ``group`` takes its first rank's CPU (and CUDA) generator state."""
    states = _states()
    dist.broadcast_object_list(states, group_src=0, group=group)
    _set_states(states)


@contextlib.contextmanager
def first_ranks_state(group: Any) -> Iterator[None]:
    """Inside: every rank draws from the group's first rank's generator state (a sampled
    token as one process samples it); after: each rank's own state again."""
    own = _states()
    share_state(group)
    try:
        yield
    finally:
        if dist.get_rank(group) != 0:
            _set_states(own)
