"""Experts under plain TP: a bias added to a partial sum inside the module that computed
it, and transformers' per-expert loop.

GPT-OSS's fused experts add ``down_proj_bias[expert_ids]`` to each token's partial
``down_proj`` product before the routing weights and the sum over slots.  The plan now
splits the experts (gate/up column, down row) and lets one rank add the bias
(``ReduceOutput.addends``), instead of keeping every expert whole; a parameter that is also
read otherwise, or a constant added to the partial sum, keeps the region whole as before.
Exactness over gloo (outputs, loss, every gradient, an AdamW step, generate, FSDP2 x TP
training) is in test_families.py; the runtime's first-rank identity in test_comm.py;
the loop path's exactness in test_families.py (mixtral_loop, gpt_oss_loop).
"""

from __future__ import annotations

import pytest
import torch
import transformers as hf
from torch import nn

import tpcompile
from tpcompile import Plan
from tpcompile.plan.modules import ReduceOutput


def test_gpt_oss_experts_split_and_one_rank_adds_their_bias() -> None:
    cfg = hf.AutoConfig.for_model("gpt_oss", num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    with torch.device("meta"):  # real widths: 128 experts of 2880 x 2 x 2880
        model = hf.AutoModelForCausalLM.from_config(cfg)
    plan = tpcompile.plan_model(model, tp=4)
    assert plan.over_ideal() <= 1.05  # was 3.95 with every expert kept whole
    roles = plan.roles()
    experts = "model.layers.0.mlp.experts."
    assert [roles[experts + n] for n in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")] == [
        "column", "sharded", "row", "replicated"]
    assert plan.modules[experts[:-1]].op(ReduceOutput).addends == ("down_proj_bias",)
    bias = next(k for k in plan.kept_whole() if k["name"].endswith("down_proj_bias"))
    assert "one rank adds it" in bias["because"]
    again = Plan.from_json(plan.to_json())
    assert again.modules == plan.modules


class _Ffn(nn.Module):
    """An MLP written as code: ``relu(x @ up) @ down + b``, inside one module."""

    def __init__(self, extra: str = "") -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(32, 64))
        self.down = nn.Parameter(torch.randn(64, 32))
        self.b = nn.Parameter(torch.randn(32))
        self.extra = extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(x @ self.up) @ self.down
        if self.extra == "constant":
            return y + 1.0  # every rank would add it: the sum must be reduced first
        if self.extra == "reused":  # also read here, where the first rank's alone would be wrong
            return (y + self.b) * self.b.abs().mean()
        return y + self.b


class _Model(nn.Module):
    def __init__(self, extra: str = "") -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.ffn = _Ffn(extra)
        self.head = nn.Linear(32, 64, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.ffn(self.emb(input_ids)))


def _roles(extra: str) -> tuple[dict, Plan]:
    with torch.device("meta"):
        plan = tpcompile.plan_model(_Model(extra), tp=2)
    return {k: v for k, v in plan.roles().items() if k.startswith("ffn.")}, plan


def test_a_bias_added_in_code_splits_the_region() -> None:
    roles, plan = _roles("")
    assert roles == {"ffn.up": "column", "ffn.down": "row", "ffn.b": "replicated"}
    assert plan.modules["ffn"].op(ReduceOutput).addends == ("b",)


@pytest.mark.parametrize("extra", ["reused", "constant"])
def test_what_one_rank_cannot_add_is_not_added_to_a_partial_sum(extra: str) -> None:
    roles, plan = _roles(extra)
    # the planner may turn the MLP around (down column, the head row) or keep it whole, but
    # no partial sum leaves ffn with the constant or the twice-read bias added on every rank
    assert roles["ffn.down"] != "row" and roles["ffn.b"] == "replicated", roles
    assert not plan.modules.get("ffn") or not plan.modules["ffn"].op(ReduceOutput)
    if extra == "reused":
        whole = {k["name"]: k["because"] for k in plan.kept_whole()}
        assert "also read otherwise" in whole["ffn.up"], whole


@pytest.mark.parametrize("family", ["mixtral", "gpt_oss"])
def test_the_per_expert_loop_is_captured_and_split(family: str) -> None:
    # transformers' eager experts: ``for expert_idx in mask.nonzero(): if expert_idx ==
    # num_experts: continue`` compares a picked index (a capture error before); traced over
    # every expert with plain ints, each expert's ``gate_up_proj[e]`` is the stacked weight
    # and ``index_add_`` carries the partial sums
    cfg = hf.AutoConfig.for_model(family, hidden_size=64, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                  num_experts_per_tok=2, vocab_size=256, experts_implementation="eager")
    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(cfg)
    plan = tpcompile.plan_model(model, tp=2)
    roles = plan.roles()
    experts = "model.layers.0.mlp.experts."
    assert (roles[experts + "gate_up_proj"], roles[experts + "down_proj"]) == ("column", "row")
    assert plan.over_ideal() <= 1.05
