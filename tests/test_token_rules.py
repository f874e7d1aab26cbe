"""Token rules are rules: a user's ``rules=[...]`` extends sequence parallelism, and the
typed sequence plan round-trips through JSON."""

from __future__ import annotations

import torch
from tpcompile.rules import Mixes, Rule, RuleSet, TokenRule, Tokens, default_rules, token_rule
from transformers import AutoModelForCausalLM

import tpcompile
from tpcompile.plan.sequence import SequencePlan
from tpcompile.plan.sequence_types import RegionGather, RegionSplit, StackPlan
from tpcompile.tools.presets import tiny_config

aten = torch.ops.aten


@torch.library.custom_op("tpc_test_tokens::rowwise", mutates_args=())
def rowwise(x: torch.Tensor) -> torch.Tensor:
    """Each token scaled by its own norm: token-local, but no built-in rule knows it."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1.0)


@rowwise.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@token_rule(torch.ops.tpc_test_tokens.rowwise)
def rowwise_tokens(node: torch.fx.Node, tags: dict) -> Tokens:
    tag = tags.get(node.args[0])
    if tag is None:
        raise Mixes("tokens in a non-leading operand")
    return tag


def _llama(custom_op: bool = False) -> torch.nn.Module:
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    if custom_op:  # the custom op on the residual stream, outside attention and the MLP
        for layer in model.model.layers:
            inner = type(layer).forward

            def forward(self, hidden_states, *args, _inner=inner, **kwargs):  # noqa: ANN001, ANN002, ANN003
                return _inner(self, torch.ops.tpc_test_tokens.rowwise(hidden_states), *args, **kwargs)

            layer.forward = forward.__get__(layer)
    return model


def test_an_op_without_a_token_rule_keeps_the_stack_whole_and_a_user_rule_splits_it() -> None:
    model = _llama(custom_op=True)
    plan = tpcompile.plan_model(model, 2, sequence_parallel=True)
    assert plan.sequence.stacks == {}
    assert any("model.layers" in w and "rowwise" in w and "no token rule" in w for w in plan.warnings), plan.warnings

    plan = tpcompile.plan_model(model, 2, sequence_parallel=True, rules=[rowwise_tokens])
    assert list(plan.sequence.stacks) == ["model.layers"]
    assert set(plan.sequence.regions) == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")}
    assert not any("sequence parallelism" in w for w in plan.warnings), plan.warnings
    # the token rule is only a token rule: the tensor-parallel roles are those of plain Llama
    assert plan.roles() == tpcompile.plan_model(_llama(), 2).roles()


def test_token_rules_and_feature_rules_live_side_by_side() -> None:
    """A rule set keeps one table per kind: a user's token rule for ``add`` overrides the
    built-in token rule, never the feature rule for the same op."""

    @token_rule(aten.add)
    def add_mixes(node: torch.fx.Node, tags: dict) -> Tokens:
        raise Mixes("says the user")

    base = RuleSet().add(default_rules())
    feature = base.find(aten.add.Tensor)
    assert isinstance(feature, Rule)
    assert base.find_tokens(aten.add.Tensor).name == "pointwise_tokens"
    assert base.find_tokens(aten.gelu.default).name == "pointwise_tokens"  # by ATen's pointwise tag
    assert base.find_tokens(aten.cumsum.default).name == "along_tokens"
    assert base.find_tokens(torch.ops.tpc_test_tokens.rowwise.default) is None  # mixes, by default
    mine = RuleSet().add(default_rules()).add([add_mixes])
    assert mine.find(aten.add.Tensor) is feature
    assert isinstance(mine.find_tokens(aten.add.Scalar), TokenRule)
    assert mine.find_tokens(aten.add.Scalar).name == "add_mixes"


def test_typed_sequence_plan_round_trips() -> None:
    plan = tpcompile.plan_model(_llama(), 2, sequence_parallel=True)
    seq = plan.sequence
    assert isinstance(seq, SequencePlan)
    stack = seq.stacks["model.layers"]
    assert isinstance(stack, StackPlan) and (stack.first, stack.last) == ("model.layers.0", "model.layers.1")
    attn = seq.regions["model.layers.1.self_attn"]
    assert attn.gather == [RegionGather(path=["kwargs", "hidden_states"], dim=1, fused=True)]
    assert attn.split == [RegionSplit(path=[0], dim=1, row="model.layers.1.self_attn.o_proj")]
    assert seq.grad_sum["model.layers.0.input_layernorm"].params == ["weight"]
    back = tpcompile.Plan.from_json(plan.to_json())
    assert isinstance(back.sequence, SequencePlan)
    assert back.sequence == seq
    # the JSON section keeps its compact list form
    section = plan.to_dict()["sequence"]
    assert section["regions"]["model.layers.1.self_attn"]["gather"] == [[["kwargs", "hidden_states"], 1, True]]
    assert section["stacks"]["model.layers"]["stream"] == [stack.stream.path, stack.stream.dim]
    assert SequencePlan.from_dict(section) == seq


def test_rotations_along_the_features_keep_the_positions() -> None:
    """Cohere's rotary (``repeat_interleave(freqs, 2, dim=-1)``, ``stack((-x2, x1), -1)``)
    runs along the features: context parallelism's position check passes it; a
    ``repeat_interleave`` without a dim flattens positions into features and mixes."""
    from transformers import AutoConfig

    from tpcompile.plan.context import check_context
    from tpcompile.tools.shrink import shrink_config

    with torch.device("meta"):
        cohere = AutoModelForCausalLM.from_config(shrink_config(AutoConfig.for_model("cohere"), 2))
    assert check_context(cohere, RuleSet().add(default_rules())) >= 1

    from tpcompile.rules.tokens import along_tokens

    class Repeats(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return torch.repeat_interleave(x, 2, dim=-1), torch.repeat_interleave(x, 2)

    graph = torch.export.export(Repeats(), (torch.zeros(1, 5, 4),)).graph
    x = next(n for n in graph.nodes if n.op == "placeholder")
    along, flat = [n for n in graph.nodes if n.target is torch.ops.aten.repeat_interleave.self_int]
    assert along_tokens.fn(along, {x: Tokens(1, False)}) == Tokens(1, False)
    try:
        along_tokens.fn(flat, {x: Tokens(1, False)})
    except Mixes as err:
        assert "flattens" in str(err), err
    else:
        raise AssertionError("a flattening repeat_interleave kept the positions")
