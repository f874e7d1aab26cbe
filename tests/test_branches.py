"""Branches on data (``if not mask.any()``): planned on both sides, exact on each."""

from __future__ import annotations

import ast
import copy
import re

import pytest
import torch
import torch.nn.functional as F
from dist import CaseResults, run_cases
from test_transform import grad_errors
from torch import nn

import tpcompile
from tpcompile import Role, TPError

HEADS, HD, HIDDEN, VOCAB, PAD = 4, 16, 64, 256, 0


class _PadMasked(nn.Module):
    """FSMT's attention in miniature: a key-padding mask dropped when nothing is padded
    (``if not pad.any(): pad = None``), applied to scores viewed by the head count."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = HEADS
        self.qkv, self.o = nn.Linear(HIDDEN, 3 * HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
        b, n, _ = x.shape
        if not pad.any():
            pad = None
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, HD).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)).view(b * self.heads, n, n) / HD**0.5
        if pad is not None:
            scores = scores.view(b, self.heads, n, n).masked_fill(pad[:, None, None, :], -1e9)
            scores = scores.view(b * self.heads, n, n)
        out = (scores.softmax(-1) @ v.reshape(b * self.heads, n, HD)).view(b, self.heads, n, HD)
        return x + self.o(out.transpose(1, 2).reshape(b, n, -1))


class PadMaskedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Embedding(VOCAB, HIDDEN)
        self.s = nn.ModuleList([_PadMasked() for _ in range(2)])
        self.h = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x, pad = self.t(input_ids), input_ids == PAD
        for blk in self.s:
            x = blk(x, pad)
        return self.h(x)


class _Detour(nn.Module):
    """A branch on data whose sides read different parameters: no one plan fits both."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.wide = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x[..., 0] > 3).any():
            return x + self.down(self.wide(x).softmax(-1))  # the softmax ties `wide`'s features
        return x + self.down(F.silu(self.up(x)))


class Detours(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.t = nn.Embedding(VOCAB, HIDDEN)
        self.d = _Detour()
        self.h = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.h(self.d(self.t(input_ids)))


def _ids(padded: bool, vocab: int = VOCAB, pad: int = PAD) -> torch.Tensor:
    ids = torch.randint(pad + 2, vocab, (2, 9), generator=torch.Generator().manual_seed(5))
    if padded:
        ids[0, -3:] = pad
    return ids


def _errors(model: nn.Module, ref: nn.Module, world: int, run: object) -> tuple[float, float]:
    want, got = run(ref), run(model)
    want.square().mean().backward()
    got.square().mean().backward()
    return (got - want).abs().max().item(), max(grad_errors(model, ref, world).values())


def _pad_masked(rank: int, world: int) -> dict[str, tuple[float, float]]:
    torch.manual_seed(0)
    ref = PadMaskedStack()
    model = tpcompile.transform(copy.deepcopy(ref), tp=world)
    out = {}
    for padded in (False, True):
        ref.zero_grad(), model.zero_grad()
        out[f"padded={padded}"] = _errors(model, ref, world, lambda m, p=padded: m(_ids(p)))
    return out


def _fsmt(rank: int, world: int) -> dict[str, tuple[float, float]]:
    from transformers import FSMTConfig

    from tpcompile.tools.verify import build_small_model

    model = build_small_model(FSMTConfig(), tp=world)
    ref = copy.deepcopy(model)
    tpcompile.transform(model, tp=world)
    cfg = model.config
    out = {}
    for padded in (False, True):
        ref.zero_grad(), model.zero_grad()
        ids = _ids(padded, cfg.src_vocab_size, cfg.pad_token_id)
        dec = _ids(False, cfg.tgt_vocab_size, cfg.pad_token_id)
        out[f"padded={padded}"] = _errors(model, ref, world, lambda m, i=ids, d=dec: m(
            input_ids=i, attention_mask=(i != cfg.pad_token_id).long(), decoder_input_ids=d).logits)
    return out


@pytest.fixture(scope="module")
def world2() -> CaseResults:
    return run_cases(2, {"pad_masked": (_pad_masked,), "fsmt": (_fsmt,)})


def test_a_branch_on_data_is_planned_on_both_sides() -> None:
    with torch.device("meta"):
        model = PadMaskedStack()
    plan = tpcompile.plan_model(model, tp=2)
    assert plan.params["s.0.qkv.weight"].role is Role.COLUMN and plan.params["s.0.o.weight"].role is Role.ROW
    assert plan.modules["s.0"].attr_fixups["heads"] == [HEADS, HEADS // 2]
    line = f"test_branches.py:{_PadMasked.forward.__code__.co_firstlineno + 2}"
    assert any("both sides" in w and line in w for w in plan.warnings)


def test_a_branch_on_data_is_exact_on_either_side(world2: CaseResults) -> None:
    # a capture could not answer `pad.any()`: the model was refused at transform
    for per_batch in world2["pad_masked"]:
        for out_err, grad_err in per_batch.values():
            assert out_err < 1e-5 and grad_err < 1e-5


def test_fsmt_with_and_without_padding_is_exact(world2: CaseResults) -> None:
    for per_batch in world2["fsmt"]:
        assert set(per_batch) == {"padded=False", "padded=True"}
        for out_err, grad_err in per_batch.values():
            assert out_err < 1e-5 and grad_err < 1e-5


def test_sides_that_need_different_splits_are_refused_by_line() -> None:
    with torch.device("meta"):
        model = Detours()
    line = f"test_branches.py:{_Detour.forward.__code__.co_firstlineno + 1}"
    with pytest.raises(TPError, match=rf"branches on its data at {line}.*two sides need different splits.*d\.(up|wide)"
                       ) as err:
        tpcompile.plan_model(model, tp=2)
    # the fix it names plans the model: the modules involved whole on both sides
    keep = ast.literal_eval(re.search(r"overrides=(\{.*\})$", str(err.value)).group(1))
    plan = tpcompile.plan_model(model, tp=2, overrides=keep)
    assert plan.params["d.up.weight"].shard_dim is None and plan.params["d.down.weight"].shard_dim is None
