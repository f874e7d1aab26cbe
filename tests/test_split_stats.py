"""Statistics over split features: planned from the dataflow, on the meta device.

OLMo-2's ``q_norm`` / ``k_norm`` (an RMSNorm over every head's features) become partial
statistics (``SplitStats``): the attention splits, the norm weights are sharded like the
features, and one rank holds the ideal share of the parameters.  A statistic whose
result leaves the split code (here: added to the residual) keeps its region whole, and so
does one whose split would leave a region that cannot be placed (OLMoE's queries split
while fewer KV heads than ranks keep its keys whole): the plan is then what it was
without statistics over split features.
Exactness over gloo (outputs, loss, every gradient, an AdamW step, generate) is in
test_families.py; the rewrite's math in test_comm.py; its cost in test_cost.py.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import transformers as hf
from torch import nn

import tpcompile
from tpcompile import Plan
from tpcompile.plan.modules import Hook, SplitStats


def _olmo2(**overrides: object) -> nn.Module:
    with torch.device("meta"):
        return hf.Olmo2ForCausalLM(hf.Olmo2Config(**overrides))


def _over_ideal(model: nn.Module, plan: Plan) -> float:
    """One rank's parameter bytes over the ideal share (total / tp)."""
    total = local = 0
    for name, p in model.named_parameters():
        total += p.numel() * p.element_size()
        local += torch.Size(plan.params[name].local_shape).numel() * p.element_size()
    return local / (total / plan.tp)


def test_olmo2_default_config_holds_its_share_at_tp4() -> None:
    model = _olmo2(num_hidden_layers=2)  # the default sizes, fewer blocks (same structure)
    plan = tpcompile.plan_model(model, tp=4)
    assert _over_ideal(model, plan) <= 1.05  # was 1.94 with the attention kept whole
    assert plan.over_ideal() == pytest.approx(_over_ideal(model, plan))  # one dtype: elements = bytes
    assert plan.kept_whole() == []  # every matrix splits
    attn = "model.layers.0.self_attn."
    assert plan.params[attn + "q_proj.weight"].role.value == "column"
    assert plan.params[attn + "o_proj.weight"].role.value == "row"
    for norm in ("q_norm", "k_norm"):
        assert plan.params[f"{attn}{norm}.weight"].local_shape == [1024]
        assert plan.modules[attn + norm].ops == [SplitStats(dim=-1, size=4096, local=1024, ops=("mean",))]
    hooks = [c.hook for c in plan.modules[attn + "q_norm"].collectives()]
    assert hooks == [Hook.STAT_REDUCE, Hook.STAT_GRAD]
    again = Plan.from_json(plan.to_json())
    assert again.modules == plan.modules and again.to_dict() == plan.to_dict()


class _Norm(nn.Module):
    """An RMSNorm over every feature of its input."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Mlp(nn.Module):
    def __init__(self, leak: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 64)
        self.norm = _Norm(64)
        self.down = nn.Linear(64, 32)
        self.leak = leak

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(self.emb(input_ids)))
        out = self.down(self.norm(h))
        # the statistic added to the residual: every rank's gradient of it is whole
        return out + h.pow(2).mean(-1, keepdim=True) if self.leak else out


def test_a_statistic_read_only_by_split_code_splits() -> None:
    with torch.device("meta"):
        plan = tpcompile.plan_model(_Mlp(), tp=2)
    roles = plan.roles()
    assert (roles["up.weight"], roles["norm.weight"], roles["down.weight"]) == ("column", "sharded", "row")
    assert plan.modules["norm"].op(SplitStats) is not None


def test_a_statistic_that_leaves_split_code_keeps_the_region_whole() -> None:
    with torch.device("meta"):
        plan = tpcompile.plan_model(_Mlp(leak=True), tp=2)
    roles = plan.roles()
    assert (roles["up.weight"], roles["norm.weight"], roles["down.weight"]) == ("replicated",) * 3
    assert not any(m.op(SplitStats) for m in plan.modules.values())


def test_what_stays_whole_is_named_with_its_reason() -> None:
    # dump-plan and verify print one rank's share over the ideal and the largest parameters
    # kept whole, each with what in the dataflow stopped the split
    with torch.device("meta"):
        plan = tpcompile.plan_model(_Mlp(leak=True), tp=2)
    assert plan.over_ideal() == 2.0  # nothing splits at tp=2: twice the ideal share
    rows = plan.kept_whole()
    why = {r["name"]: r["because"] for r in rows}
    assert [(r["shape"], r["count"]) for r in rows] == [([64, 32], 1), ([64, 32], 1), ([32, 64], 1)]
    assert "small lookup table" in why["emb.weight"], why
    # the leaking statistic ties the features between up and down into one unit
    assert "one unit (tied by a reduction over all of them" in why["up.weight"], why
    assert why["down.weight"] == why["up.weight"]
    again = Plan.from_json(plan.to_json())
    assert again.kept_whole() == rows
    # a row per repeated name, copies counted, largest first
    # a per-head bias made from a parameter outside the split module carries a gradient:
    # it is not sliced where it enters, so its region stays whole
    whole = tpcompile.plan_model(_HeadBias(), tp=2, strict=False)
    assert whole.over_ideal() > 1.3
    why = {r["name"]: r["because"] for r in whole.kept_whole()}
    assert "would need slicing" in why["heads.up.weight"], why


class _Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        h = self.up(x).unflatten(-1, (4, 16)) + bias[:, None]  # 4 heads, each its bias
        return self.down(h.flatten(-2))


class _HeadBias(nn.Module):
    """Four heads whose per-head bias is computed outside their module from a parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.slopes = nn.Parameter(torch.ones(4))
        self.heads = _Heads()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.heads(self.emb(input_ids), torch.cumsum(self.slopes, 0))


class _Literal(_Mlp):
    """The normalised features reshaped by literal sizes: split, each rank's code would
    reshape its half of them into 4 heads of 16."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.up(self.emb(input_ids))))
        return self.down((h.unflatten(-1, (4, 16)) * 2).flatten(-2))  # not a view: no shape site


def test_a_split_the_self_check_refuses_plans_as_without_split_statistics() -> None:
    """A split the localized model does not match, that only a split statistic opened,
    gives the plan without split statistics (the region whole, as before), strict or not:
    never a self-check error the plan without them would not raise."""
    with torch.device("meta"):
        model = _Literal()
    for strict in (True, False):
        plan = _planned(model, 2, strict=strict)
        assert (plan.roles()["up.weight"], plan.roles()["norm.weight"]) == ("replicated", "replicated")
        assert not any(m.op(SplitStats) for m in plan.modules.values())


def test_qwen3_per_head_norm_is_unchanged() -> None:
    """A norm over ``head_dim`` keeps each head's features (per-head units, as before):
    no partial statistic, the replicated weight's gradient summed."""
    from tpcompile.tools.presets import tiny_config

    with torch.device("meta"):
        model = hf.AutoModelForCausalLM.from_config(tiny_config("qwen3"))
    plan = tpcompile.plan_model(model, tp=2)
    assert plan.params["model.layers.0.self_attn.q_norm.weight"].role.value == "replicated_grad_allreduce"
    assert not any(m.op(SplitStats) for m in plan.modules.values())


def test_a_rejected_statistic_leaves_no_forcing_behind() -> None:
    """LoRA on the embedding writes a column's features into the residual stream, so
    with its RMSNorms untied the whole stream looks split; those statistics are then
    rejected and tied again.  What was forced while they were untied (the vocab-split
    embedding, kept whole for a layout the tie removes) must not survive: the base
    parameters plan as the plain model's do, without warnings."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from tpcompile.tools.presets import tiny_config

    torch.manual_seed(0)
    plain = hf.AutoModelForCausalLM.from_config(tiny_config("llama"))
    lora = get_peft_model(copy.deepcopy(plain), LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    want = tpcompile.plan_model(plain, tp=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = tpcompile.plan_model(lora, tp=2)
    assert not [w for w in caught if "tpcompile" in str(w.message)] and not got.warnings
    base = {name.removeprefix("base_model.model.").replace(".base_layer.", "."): p
            for name, p in got.params.items() if ".lora_" not in name}
    assert base.keys() == want.params.keys()
    for name, p in want.params.items():
        assert (base[name].role, base[name].shard_dim, base[name].local_shape) == (p.role, p.shard_dim, p.local_shape), name
    assert want.params["model.embed_tokens.weight"].role.value == "vocab_embedding"
    assert want.params["model.layers.0.self_attn.q_proj.weight"].role.value == "column"
    assert want.params["model.layers.0.mlp.down_proj.weight"].role.value == "row"
    assert not any(m.op(SplitStats) for m in got.modules.values())


def _planned(model: nn.Module, tp: int, **kw: object) -> Plan:
    """``plan_model``, asserting it warns of nothing."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = tpcompile.plan_model(model, tp=tp, **kw)
    assert not [str(w.message) for w in caught if "tpcompile" in str(w.message)]
    return plan


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def test_fewer_kv_heads_than_tp_keep_the_attention_whole_as_before() -> None:
    """OLMoE at tp=4 with 2 KV heads: ``k_norm`` cannot split (each KV head on two
    ranks), so it ties the keys into one unit every rank holds whole, while ``q_norm``
    split leaves one query head per rank: each rank would broadcast both KV heads to it
    (the self-check failed in ``o_proj``).  The partition refuses that broadcast and
    ``q_norm`` is tied again: the attention is replicated as it was without split
    statistics, without a warning, the experts still split.  At tp=2 both norms split."""
    from families import build

    attn = "model.layers.0.self_attn."
    plan = _planned(build("olmoe", meta=True), 4)
    assert {plan.params[f"{attn}{n}.weight"].role.value for n in _ATTN} == {"replicated"}
    assert not any(m.op(SplitStats) for m in plan.modules.values())
    assert plan.params["model.layers.0.mlp.experts.gate_up_proj"].role.value == "column"
    plan = _planned(build("olmoe", meta=True), 2)
    assert plan.modules[attn + "q_norm"].ops == [SplitStats(dim=-1, size=64, local=32, ops=("mean",))]
    assert plan.modules[attn + "k_norm"].ops == [SplitStats(dim=-1, size=32, local=16, ops=("mean",))]


def test_one_kv_head_splits_the_queries_only() -> None:
    """One KV head at tp=4: ``k_norm`` reduces the one head every rank holds (no split
    statistic, its weight's gradient summed), ``q_norm`` the split query heads."""
    from families import build

    attn = "model.layers.0.self_attn."
    plan = _planned(build("olmoe_mqa", meta=True), 4)
    assert plan.modules[attn + "q_norm"].ops == [SplitStats(dim=-1, size=64, local=16, ops=("mean",))]
    assert not plan.modules[attn + "k_norm"].op(SplitStats)
    roles = plan.roles()
    assert (roles[attn + "q_proj.weight"], roles[attn + "k_norm.weight"]) == ("column", "replicated_grad_allreduce")
    assert plan.params[attn + "k_proj.weight"].local_shape == [16, 64]  # the KV head, on every rank


def test_query_heads_straddling_kv_groups_split_with_their_statistics() -> None:
    """20 query heads over 5 KV heads at tp=4: rank 0 reads KV head 0 four times and head
    1 once; it holds both once and reads them as five (``num_key_value_groups`` 4 -> 1),
    so the attention splits, and BitNet's sub-norm over the attention output is a split
    statistic (the attention was replicated before: 1.54x the ideal bytes per rank on the
    real config).  At tp=8 the 20 heads are dealt unevenly with padding heads *and*
    straddle groups."""
    from tpcompile.tools.shrink import shrink_config

    with torch.device("meta"):
        llama = hf.LlamaForCausalLM(hf.LlamaConfig(
            hidden_size=160, head_dim=8, num_attention_heads=20, num_key_value_heads=5, num_hidden_layers=1,
            intermediate_size=64, vocab_size=256))
        bitnet = hf.BitNetForCausalLM(shrink_config(hf.BitNetConfig(num_hidden_layers=1), 4))
    assert tpcompile.plan_model(llama, tp=4).roles()["model.layers.0.self_attn.q_proj.weight"] == "column"
    # tp=8: 3 + 3 + 3 + 3 + (2 and a padding head) x 4, straddling too; the padding
    # head reads a copy of its rank's last KV head (rank 7 holds KV head 4, twice: every
    # rank holds two)
    q, k = (tpcompile.plan_model(llama, tp=8).params[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qk")
    assert q.layout == "padded" and q.runs[7] == [[144, 160], [-1, 8]]
    assert k.layout == "kv_replicated" and k.compute_shape()[0] == 24 and k.runs[7] == [[32, 40], [32, 40]]
    assert bitnet.config.num_key_value_heads == 5
    plan = _planned(bitnet, 4)
    attn = "model.layers.0.self_attn."
    assert plan.params[attn + "k_proj.weight"].layout == "kv_replicated"
    assert {plan.params[f"{attn}{n}.weight"].layout for n in ("q_proj", "o_proj", "attn_sub_norm")} == {"contiguous"}
    assert plan.modules[attn + "attn_sub_norm"].op(SplitStats) is not None
    assert plan.modules["model.layers.0.mlp.ffn_sub_norm"].op(SplitStats) is not None
