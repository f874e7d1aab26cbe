"""Dropout masks over split features are drawn whole: where the plan puts them, and the
mode that draws them (the multi-process equality: ``test_transform``'s dropout cases)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import tpcompile
from tpcompile.plan.modules import WholeMasks
from tpcompile.runtime.masks import WholeMaskMode, may_drop
from tpcompile.tools.presets import tiny_config


def _meta(name: str, attn: str, **over: object) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(name, **over), attn_implementation=attn)


def test_attention_masks_are_sites_of_their_module() -> None:
    """SDPA's dropout (Llama) and GPT-2's ``attn_dropout`` on the eager scores: split by
    heads (4 at tp=2), two per rank; the whole-value dropouts (GPT-2's residual) are no
    sites."""
    plan = tpcompile.plan_model(_meta("llama", "sdpa"), tp=2)
    op = plan.modules["model.layers.1.self_attn"].op(WholeMasks)
    assert op is not None and op.sites == ((4, 1, 4, ((0, 1), (2, 3)), ()),), op
    plan = tpcompile.plan_model(_meta("gpt2", "eager"), tp=2)
    masked = {m for m, mp in plan.modules.items() if mp.op(WholeMasks) is not None}
    assert masked == {f"transformer.h.{i}.attn" for i in range(2)}, masked


class _Mlp(nn.Module):
    """An MLP dropping its split features, and then its whole output: at tp=2 the local
    width equals the output's (``same``), which a drawn mask could be taken for."""

    def __init__(self, same: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 64 if same else 128)
        self.down = nn.Linear(64 if same else 128, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = F.dropout(F.gelu(self.up(self.emb(input_ids))), 0.1, self.training)
        return F.dropout(self.down(h), 0.1, self.training)


def test_a_split_mask_a_whole_one_could_be_taken_for_is_no_site() -> None:
    for same, want in ((False, ((3, 2, 128, (tuple(range(64)), tuple(range(64, 128))), ()),)), (True, None)):
        with torch.device("meta"):
            model = _Mlp(same)
        op = tpcompile.plan_model(model, tp=2).modules.get("")
        got = op.op(WholeMasks).sites if op is not None and op.op(WholeMasks) else None
        assert got == want, (same, got)


def test_the_mode_keeps_the_rows_of_the_whole_mask_and_the_generator_where_it_was() -> None:
    op = WholeMasks(sites=((4, 1, 6, ((0, 1, 2), (3, 4, 5)), ((3, 8),)),))
    x = torch.ones(2, 6, 5, 8)
    torch.manual_seed(3)
    whole = F.dropout(x, 0.3)
    after = torch.rand(1)
    for rank in (0, 1):
        rows = list(op.sites[0][3][rank])
        torch.manual_seed(3)
        with WholeMaskMode(op, rank):
            local = F.dropout(x[:, rows], 0.3)
            other = F.dropout(torch.ones(2, 3, 5, 7), 0.3)  # another shape: drawn as it is
        assert torch.equal(local, whole[:, rows]) and other.shape == (2, 3, 5, 7)
    torch.manual_seed(3)
    with WholeMaskMode(op, 1):
        F.dropout(x[:, 3:], 0.3)
    assert torch.equal(torch.rand(1), after)  # the generator advanced as one process's
    # a transposed input (the noise laid out as the input) and a fused native_dropout
    xt = torch.randn(2, 5, 6, 8).transpose(1, 2)
    torch.manual_seed(4)
    whole = F.dropout(xt, 0.3)
    torch.manual_seed(4)
    with WholeMaskMode(op, 1):
        local = F.dropout(xt[:, 3:], 0.3)
    assert torch.equal(local, whole[:, 3:])
    torch.manual_seed(5)
    out, mask = torch.native_dropout(x, 0.3, True)
    torch.manual_seed(5)
    with WholeMaskMode(op, 0):
        lout, lmask = torch.native_dropout(x[:, :3], 0.3, True)
    assert torch.equal(lmask, mask[:, :3]) and torch.allclose(lout, out[:, :3])


def test_the_mode_stays_off_where_every_dropout_is_zero() -> None:
    """Most decoders train without attention dropout: no dispatch mode per op there."""
    off = _meta("llama", "sdpa").model.layers[0].self_attn
    on = _meta("llama", "sdpa", attention_dropout=0.1).model.layers[0].self_attn
    gpt2 = _meta("gpt2", "eager").transformer.h[0].attn.attn_dropout
    assert (may_drop(off), may_drop(on), may_drop(gpt2)) == (False, True, True)
