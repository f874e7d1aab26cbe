"""The attention cores of context parallelism: local queries against the gathered keys.

Two ways to compute ``softmax(q·kᵀ·scale + mask)·v`` for a rank's two mirrored query
chunks against the whole sequence's keys, both exact:

* **Blocks** (:func:`block_attention`, no ``[s_local, S]`` mask): with causal attention
  over plain positions (no padding, no packed documents) a query chunk ``g`` (global
  positions ``[g·c, (g+1)·c)``) sees every key of the chunks before it and the causal
  triangle of its own.  Each is one flash-attention call on CPU
  (``_scaled_dot_product_flash_attention_for_cpu``: no mask for the prefix,
  ``is_causal`` for the diagonal square), which also returns each row's log-sum-exp
  ``lse_b``; the two results merge exactly: ``lse = log Σ exp(lse_b)`` and
  ``out = Σ exp(lse_b - lse)·out_b``.  Backward runs the flash backward of each block
  with the *merged* output and log-sum-exp (then ``exp(s - lse)`` are the true
  probabilities of that block's keys and ``rowsum(dO·O)`` the true correction), adding
  the blocks' query gradients and scattering the key / value gradients into their
  ranges.  Autograd keeps ``q``, ``k``, ``v``, the output and ``lse`` (``O(s_local)``
  beyond the keys), as sdpa does at cp=1.  A sliding window that binds inside a chunk
  makes that chunk one call over the keys it can reach, with a band mask
  ``[c, c + window - 1]`` at most.
* **Mask** (:func:`eager_attention`, and torch's sdpa with the ``[s_local, S]`` mask
  :meth:`~tpcompile.runtime.context.ContextParallel.allowed` builds): everything else
  (padding, packed sequences, softcapping, sinks, dropout, non-causal layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["Block", "block_attention", "block_layout", "eager_attention"]

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@dataclass(frozen=True)
class Block:
    """One flash call: local query rows ``[rows)`` against global keys ``[keys)``."""

    rows: tuple[int, int]
    keys: tuple[int, int]
    causal: bool = False  # the square diagonal block: key j <= query j
    mask: torch.Tensor | None = None  # additive [rows, keys] (0 / -inf), a binding window only


def block_layout(rank: int, size: int, padded: int, window: int | None, dtype: torch.dtype,
                 device: torch.device) -> tuple[Block, ...]:
    """The blocks of rank ``rank``'s two chunks (``rank`` and ``2·size-1-rank`` of a
    ``padded`` sequence cut into ``2·size``) under a causal mask and ``window``.

    Example:
        >>> [(b.rows, b.keys, b.causal) for b in block_layout(0, 2, 8, None, torch.float32, "cpu")]
        [((0, 2), (0, 2), True), ((2, 4), (0, 6), False), ((2, 4), (6, 8), True)]
    """
    chunk = padded // (2 * size)
    blocks: list[Block] = []
    for local, g in enumerate((rank, 2 * size - 1 - rank)):
        rows, first, end = (local * chunk, (local + 1) * chunk), g * chunk, (g + 1) * chunk
        if window is None or window >= end:  # no query of the chunk reaches the window's edge
            if first:
                blocks.append(Block(rows, (0, first)))
            blocks.append(Block(rows, (first, end), causal=True))
            continue
        lo = max(0, first - window + 1)  # the earliest key the chunk's first query sees
        q = torch.arange(first, end, device=device)[:, None]
        k = torch.arange(lo, end, device=device)[None, :]
        seen = (k <= q) & (q - k < window)
        mask = torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill(~seen, float("-inf"))
        blocks.append(Block(rows, (lo, end), mask=mask))
    return tuple(blocks)


class _BlockAttention(torch.autograd.Function):
    """Exact softmax attention as flash blocks merged by log-sum-exp (module docstring)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: tuple[Block, ...],
                scale: float | None) -> torch.Tensor:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [b, h, s_local, d]
        lse = None  # [b, h, s_local], in the dtype flash returns it (float32 for half types)
        for rows in dict.fromkeys(b.rows for b in blocks):
            parts = [_flash(q[:, :, slice(*rows)], k[:, :, slice(*b.keys)], v[:, :, slice(*b.keys)], 0.0,
                            b.causal, attn_mask=b.mask, scale=scale) for b in blocks if b.rows == rows]
            lses = torch.stack([p[1] for p in parts])  # [n, b, h, c]
            total = torch.logsumexp(lses, dim=0)
            weights = torch.exp(lses - total)[..., None]  # each block's share of a row's softmax
            out[:, :, slice(*rows)] = sum(w * p[0].to(w.dtype) for w, p in zip(weights, parts, strict=True))
            if lse is None:
                lse = torch.empty(q.shape[:3], dtype=total.dtype, device=q.device)
            lse[:, :, slice(*rows)] = total
        ctx.blocks, ctx.scale = blocks, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for b in ctx.blocks:
            rows, keys = slice(*b.rows), slice(*b.keys)
            gq, gk, gv = _flash_backward(grad[:, :, rows], q[:, :, rows], k[:, :, keys], v[:, :, keys],
                                         out[:, :, rows], lse[:, :, rows], 0.0, b.causal, attn_mask=b.mask,
                                         scale=ctx.scale)
            dq[:, :, rows] += gq
            dk[:, :, keys] += gk
            dv[:, :, keys] += gv
        return dq, dk, dv, None, None


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: tuple[Block, ...],
                    scale: float | None) -> torch.Tensor:
    """``[b, h, s_local, d]`` local queries against ``[b, h_kv, S, d]`` keys and values
    in global order (GQA: ``h`` a multiple of ``h_kv``), as the ``blocks`` of
    :func:`block_layout` say; returns ``[b, h, s_local, d]``."""
    return _BlockAttention.apply(q, k, v, blocks, scale)


def eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, outside: torch.Tensor,
                    p: float, scaling: float | None, softcap: float | None, s_aux: torch.Tensor | None) -> torch.Tensor:
    """Softmax attention written out as transformers' eager attention computes it:
    softcapped scores, masked keys at the dtype's minimum (so a row without keys averages
    the whole sequence evenly), sinks as extra logits.  ``outside``: keys beyond the
    caller's sequence (CP's padding), left out of such rows."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    # added, not filled: a row without keys then still passes gradients to its scores,
    # as transformers' additive mask does
    bias = torch.zeros((), dtype=scores.dtype, device=scores.device).expand_as(scores)
    bias = bias.masked_fill(~allowed, torch.finfo(scores.dtype).min).masked_fill(outside, float("-inf"))
    scores = scores + bias
    if s_aux is not None:  # per-head sink logits, dropped after the softmax
        sinks = s_aux.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sinks.to(scores.dtype)], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return F.dropout(probs, p=p) @ v
