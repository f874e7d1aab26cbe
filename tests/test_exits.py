"""A whole value computed from parameters alone that only split code reads: its
parameters' gradients summed, or the region kept whole when it is read whole too.

Exactness of the split plan is tested on the family that needs it (DiffLlama's lambda:
tests/test_families.py); these plans check the walk and its refusal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tpcompile

HEADS, HD, HIDDEN, VOCAB = 4, 16, 64, 256


class _Scaled(nn.Module):
    """DiffLlama's lambda in miniature: a scalar from two parameters weighs the split
    heads; with ``leak`` it also scales the residual, read whole there."""

    def __init__(self, leak: bool) -> None:
        super().__init__()
        self.leak = leak
        self.a, self.b = nn.Parameter(torch.randn(HD) * 0.1), nn.Parameter(torch.randn(HD) * 0.1)
        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, -1, HD).permute(2, 0, 3, 1, 4)
        scale = torch.exp((self.a * self.b).sum())
        y = (F.scaled_dot_product_attention(q, k, v, is_causal=True) * scale).transpose(1, 2).reshape(b, n, -1)
        return x * scale + self.o(y) if self.leak else x + self.o(y)


class _Model(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.t, self.block, self.h = nn.Embedding(VOCAB, HIDDEN), block, nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.h(self.block(self.t(input_ids)))


def _plan(block: nn.Module) -> tpcompile.Plan:
    return tpcompile.plan_model(_Model(block), tp=2, strict=False)


def test_a_scalar_from_parameters_alone_has_their_gradients_summed() -> None:
    plan = _plan(_Scaled(leak=False))
    assert plan.params["block.qkv.weight"].role.value == "column"
    assert {plan.params[f"block.{n}"].role.value for n in ("a", "b")} == {"replicated_grad_allreduce"}


def test_a_scalar_from_parameters_also_read_whole_keeps_the_heads_whole() -> None:
    plan = _plan(_Scaled(leak=True))
    assert plan.params["block.qkv.weight"].shard_dim is None
    assert {plan.params[f"block.{n}"].role.value for n in ("a", "b")} == {"replicated"}
