"""Whole values that only split code reads: summed where they are made, or not split at all.

Exactness of the split plans is tested on the families that need them (DeepSeek-V3's MLA,
DiffLlama's lambda: tests/test_families.py); these plans check the walks' refusals.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tpcompile

HEADS, HD, HIDDEN, VOCAB = 4, 16, 64, 256


class _SharedKey(nn.Module):
    """MLA in miniature: one projection kept whole makes a latent (lifted to the heads by
    ``up``) and one rotary-like key shared by every head; with ``leak`` that key is also
    added to the residual, where its gradient is whole on every rank."""

    def __init__(self, leak: bool) -> None:
        super().__init__()
        self.leak = leak
        self.down = nn.Linear(HIDDEN, 16 + HD)
        self.up = nn.Linear(16, 2 * HIDDEN)  # per head: a key and a value
        self.q = nn.Linear(HIDDEN, HEADS * 2 * HD)
        self.o = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        latent, shared = self.down(x).split([16, HD], dim=-1)
        kv = self.up(latent).view(b, n, -1, 2 * HD).transpose(1, 2)
        k, v = kv.split(HD, dim=-1)
        k = torch.cat([k, shared[:, None].expand(*k.shape[:-1], -1)], dim=-1)
        q = self.q(x).view(b, n, -1, 2 * HD).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, -1)
        out = x + self.o(y)
        return out + shared.sum(-1, keepdim=True) if self.leak else out


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


def test_a_shared_key_is_summed_where_its_projection_returns() -> None:
    plan = _plan(_SharedKey(leak=False))
    roles = {n: plan.params[f"block.{n}.weight"].role.value for n in ("down", "up", "q", "o")}
    assert roles == {"down": "replicated", "up": "column", "q": "column", "o": "row"}
    assert [op.kind for op in plan.modules["block.down"].ops] == ["exit_grad"]
    assert "block.up" not in plan.modules  # its input's sum is the exit's


def test_a_shared_key_also_read_whole_keeps_the_heads_whole() -> None:
    # the residual reads it whole: its gradient there is whole on every rank, and summing
    # it at the exit would count that part twice
    plan = _plan(_SharedKey(leak=True))
    assert plan.params["block.up.weight"].shard_dim is None and plan.params["block.o.weight"].shard_dim is None
    assert not any(op.kind == "exit_grad" for m in plan.modules.values() for op in m.ops)


def test_a_scalar_from_parameters_alone_has_their_gradients_summed() -> None:
    plan = _plan(_Scaled(leak=False))
    assert plan.params["block.qkv.weight"].role.value == "column"
    assert {plan.params[f"block.{n}"].role.value for n in ("a", "b")} == {"replicated_grad_allreduce"}


def test_a_scalar_from_parameters_also_read_whole_keeps_the_heads_whole() -> None:
    plan = _plan(_Scaled(leak=True))
    assert plan.params["block.qkv.weight"].shard_dim is None
    assert {plan.params[f"block.{n}"].role.value for n in ("a", "b")} == {"replicated"}
