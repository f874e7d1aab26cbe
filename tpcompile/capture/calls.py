"""Blocks of one structure that the model calls differently.

The capture traces one block of each structure of a repeated stack and lets it stand for
the others (:func:`~tpcompile.capture.export.capture`).  That holds when the model calls
them alike.  Some models do not: NeoMME passes its value embeddings to some layers and
``None`` to the rest (``value_embeds if layer_idx in self.value_embedding_layers else
None``), so a layer that adds them takes code the traced one never ran.  Planned from
the first layer alone, the others added whole value embeddings to split values at run
time (a crash there; with other sizes it could broadcast silently).

:func:`split_by_calls` runs the cut model once on fake tensors with the rest of each
stack back in place as stubs.  A stub records how the model calls its block and returns
the hidden state it was given, shaped as its representative's output, without computing
anything.  Each block then stands with the first block of its structure called the same
way: which arguments are tensors (their shapes and dtypes) and which are ``None``.
Values such as a layer index do not count.

Example:
    >>> reps = split_by_calls(model, stacks, example_kwargs)      # doctest: +SKIP
    >>> reps["model.layers"][:4]      # layer 1 takes value embeddings, layer 0 does not
    [0, 1, 0, 1]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = ["split_by_calls"]


def _call_signature(args: tuple, kwargs: dict) -> tuple:
    """How a block is called, as far as its trace can depend on it: tensors by shape and
    dtype, ``None`` and booleans as themselves, anything else by type."""
    out: list[Any] = [tuple(sorted(kwargs))]
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            out.append((tuple(str(s) for s in leaf.shape), leaf.dtype))
        elif leaf is None or isinstance(leaf, bool):
            out.append(leaf)
        else:
            out.append(type(leaf).__name__)
    return tuple(out)


class _Stub(nn.Module):
    """Stands in for one block of a stack: records its call, returns the hidden state it
    got in its representative's output structure.  Plain attributes the model reads off a
    block (``attention_type``) are the block's own."""

    def __init__(self, block: nn.Module, rep: int, index: int, seen: dict[int, Any], calls: dict[int, tuple]) -> None:
        super().__init__()
        for key, value in block.__dict__.items():
            if not key.startswith("_") and not isinstance(value, nn.Module | torch.Tensor):
                self.__dict__[key] = value
        self._rep, self._index, self._seen, self._calls = rep, index, seen, calls

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self._calls[self._index] = _call_signature(args, kwargs)
        hidden = args[0] if args else kwargs.get("hidden_states")
        out = self._seen.get(self._rep)
        if isinstance(out, tuple) and out and isinstance(hidden, torch.Tensor):
            return (hidden, *out[1:])
        return hidden


def split_by_calls(model: nn.Module, stacks: dict[str, tuple[nn.ModuleList, list[int]]],
                   example_kwargs: dict[str, Any]) -> dict[str, list[int]]:
    """Each stack's representatives (block index -> the index of the first block of the
    same structure called the same way), from one shapes-only forward of the cut model
    (:func:`~tpcompile.capture.fake.shape_trace`'s, retried as it retries); the structural
    ones where that forward cannot run."""
    from .fake import _fake_forward

    calls: dict[str, dict[int, tuple]] = {fqn: {} for fqn in stacks}
    outs: dict[str, dict[int, Any]] = {fqn: {} for fqn in stacks}
    handles: list[Any] = []

    def install(twin: nn.Module) -> None:
        # each attempt records afresh: a failed one's calls (and hooks) are dropped
        for h in handles:
            h.remove()
        handles.clear()
        for fqn, (mod, reps) in stacks.items():
            calls[fqn].clear()
            cut = twin.get_submodule(fqn)
            keep = max(reps) + 1  # the traced blocks: their calls and outputs are recorded
            for i in range(keep):
                handles.append(cut[i].register_forward_pre_hook(
                    lambda m, a, k, _i=i, _c=calls[fqn]: _c.__setitem__(_i, _call_signature(a, k)),
                    with_kwargs=True))
                handles.append(cut[i].register_forward_hook(lambda m, a, o, _i=i, _o=outs[fqn]: _o.__setitem__(_i, o)))
            for i in range(keep, len(mod)):
                cut._modules[str(i)] = _Stub(mod[i], reps[i], i, outs[fqn], calls[fqn])

    try:
        _fake_forward(model, example_kwargs, install)
    except Exception:  # noqa: BLE001 - the model's code may refuse this forward: keep the structural reps
        return {fqn: reps for fqn, (_, reps) in stacks.items()}
    out: dict[str, list[int]] = {}
    for fqn, (_, reps) in stacks.items():
        first: dict[tuple, int] = {}
        seen = calls[fqn]
        out[fqn] = [first.setdefault((rep, seen.get(i)), i) for i, rep in enumerate(reps)] \
            if len(seen) == len(reps) else reps
    return out
