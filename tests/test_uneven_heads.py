"""Heads that no tp divides, dealt unevenly: 7 heads at tp=4 as 2/2/2/1 plus a padding head.

The plan (single process): each rank holds the same local shapes, the short rank a
padding head of zero rows where the model's code finds its next head; query heads that
share KV heads are padded within their groups; a region whose padded features would
enter a statistic stays whole; a padding head that computes a NaN reaches nothing.  Training (one world-4
launch over gloo): under FSDP2 the losses of AdamW steps equal one process's, the padding
rows stay zero through the steps, a sharded checkpoint taken at tp=2 x dp_shard=2
resumes at tp=4 (another padding) with equal losses, delayed init gives the same
weights at both layouts, pp=2 x tp=2 trains equal losses, and ``clip_grad_norm_`` counts
each copied KV row once (Falcon's one KV head at tp=4, straddled KV heads under FSDP2);
straddled KV heads (20 query heads over 5) checkpoint at tp=2 x dp_shard=2 and resume
at tp=4 with equal losses.  Exactness of outputs, every gradient and ``generate`` per
family is in ``test_families`` (the ``*_uneven`` cases).
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import pytest
import torch
from dist import global_step, run_distributed
from families import build
from torch import nn
from torch.distributed.tensor import DTensor

import tpcompile
import tpcompile.checkpoint as ckpt

REL = 1e-5
LR = 1e-2
QKV = "transformer.h.0.self_attention.query_key_value.weight"
DENSE = "transformer.h.0.self_attention.dense.weight"


def test_seven_heads_at_tp4_are_dealt_with_a_padding_head() -> None:
    plan = tpcompile.plan_model(build("falcon_uneven", "sdpa"), tp=4)
    qkv, dense = plan.params[QKV], plan.params[DENSE]
    # [q heads | k | v] rows, 16 per head: ranks 0-2 hold two query heads, rank 3 one and
    # a padding head before the one KV head every rank holds
    assert qkv.layout == "kv_replicated" and qkv.local_shape == [64, 112]
    assert qkv.runs[0] == [[0, 32], [112, 144]]
    assert qkv.runs[3] == [[96, 112], [-1, 16], [112, 144]]
    assert dense.layout == "padded" and dense.runs[3] == [[96, 112], [-1, 16]]
    assert plan.modules["transformer.h.0.self_attention"].attr_fixups["num_heads"] == [7, 2]
    # GPT-2's [Q | K | V] sections get a padding head each
    gpt2 = tpcompile.plan_model(build("gpt2_uneven", "eager"), tp=4).params["transformer.h.0.attn.c_attn.weight"]
    assert gpt2.runs[3] == [[96, 112], [-1, 16], [208, 224], [-1, 16], [320, 336], [-1, 16]]


def test_query_heads_are_padded_within_their_kv_groups() -> None:
    # 14 heads over 2 KV heads at tp=4: each group's 7 heads on two ranks (4, and 3 with
    # a padding head), each rank one KV head, never heads of two groups
    plan = tpcompile.plan_model(build("qwen2_uneven", "sdpa"), tp=4)
    q, k = (plan.params[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qk")
    assert q.runs == [[[0, 32]], [[32, 56], [-1, 8]], [[56, 88]], [[88, 112], [-1, 8]]]
    assert k.runs == [[[0, 8]], [[0, 8]], [[8, 16]], [[8, 16]]]
    assert plan.modules["model.layers.0.self_attn"].attr_fixups["num_key_value_groups"] == [7, 4]


def test_a_statistic_over_padded_heads_keeps_them_whole() -> None:
    # BitNet's attn_sub_norm reduces over every head's output: a padding head's output is
    # not zero, so it would enter the statistic; the attention stays whole
    plan = tpcompile.plan_model(build("bitnet_uneven", "eager"), tp=2)
    assert plan.params["model.layers.0.self_attn.o_proj.weight"].layout == "replicated"
    assert plan.params["model.layers.0.mlp.down_proj.weight"].layout == "contiguous"


def test_query_heads_straddling_kv_groups_hold_each_kv_head_once() -> None:
    # 20 query heads over 5 KV heads (groups of 4) at tp=4: rank 0's 5 query heads read KV
    # head 0 four times and head 1 once.  Each rank holds its 2 KV heads once and reads
    # them as 5 (``expand``), broadcasting by one: num_key_value_groups 4 -> 1
    plan = tpcompile.plan_model(build("llama_straddle", "sdpa"), tp=4)
    k = plan.params["model.layers.0.self_attn.k_proj.weight"]
    assert k.layout == "kv_replicated" and k.local_shape == [16, 160] and k.compute_shape() == [40, 160]
    assert k.runs == [[[0, 16]], [[8, 24]], [[16, 32]], [[24, 40]]]
    # held positions read, as runs: head 0 (rows 0-7) four times, then head 1 (8-15)
    assert k.expand[0] == [[0, 8], [0, 8], [0, 8], [0, 16]]
    assert k.expand[1] == [[0, 8], [0, 8], [0, 16], [8, 16]]
    assert plan.modules["model.layers.0.self_attn"].attr_fixups["num_key_value_groups"] == [4, 1]
    # a rank reading fewer distinct KV heads holds as many as the others (12 heads over 4 at
    # tp=6: rank 0 reads head 0 twice, rank 1 heads 0 and 1): its last one held twice
    from transformers import LlamaConfig, LlamaForCausalLM

    six = tpcompile.plan_model(LlamaForCausalLM(LlamaConfig(
        hidden_size=96, intermediate_size=96, num_hidden_layers=1, num_attention_heads=12,
        num_key_value_heads=4, vocab_size=96)), tp=6)
    k6 = six.params["model.layers.0.self_attn.k_proj.weight"]
    assert k6.runs[0] == [[0, 8], [0, 8]] and k6.expand[0] == [[0, 8], [0, 8]]
    assert k6.runs[1] == [[0, 16]] and k6.expand[1] == [[0, 16]]


@pytest.mark.parametrize("family, shape", [
    ("bitnet", {}),  # BitNet b1.58 2B: 20 heads over 5 KV heads
    ("phi3", dict(hidden_size=5120, num_attention_heads=40, num_key_value_heads=10,  # Phi-3-medium
                  intermediate_size=17920, vocab_size=32064)),
])
def test_straddling_real_configs_split_to_the_ideal(family: str, shape: dict) -> None:
    # refused (Phi-3-medium at tp=4 and 8) or kept whole (BitNet: 1.54x at tp=4) before
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, num_hidden_layers=2, **shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    for tp in (4, 8) if family == "phi3" else (4,):
        assert tpcompile.plan_model(model, tp=tp).over_ideal() <= 1.05, tp


class _UnitHeads(nn.Module):
    """Seven heads, each scaled to unit length without an epsilon: a padding head's zero
    query becomes 0 / 0 = NaN, which zero weights alone would carry to the output."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.up = nn.Linear(32, 7 * 8)
        self.down = nn.Linear(7 * 8, 32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.up(self.emb(input_ids)).unflatten(-1, (-1, 8))
        return self.down((h / h.norm(dim=-1, keepdim=True)).flatten(-2))


def _unit_heads() -> dict:
    torch.manual_seed(0)
    ref = _UnitHeads()
    model = tpcompile.transform(copy.deepcopy(ref), tp=4)
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(2))
    want, got = ref(ids), model(ids)
    want.square().mean().backward()
    got.square().mean().backward()
    grad = model.up.weight.grad
    grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
    return {"layout": model.tpcompile_plan.params["up.weight"].layout, "out": (got - want).abs().max().item(),
            "finite_grad": bool(torch.isfinite(grad).all())}


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 9), generator=g) for _ in range(4)]


@functools.cache
def _reference() -> tuple[float, ...]:
    model = build("falcon_uneven", "sdpa").train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return tuple(global_step(model, opt, ids) for ids in _batches())


def _padding_values(model: torch.nn.Module) -> float:
    """The largest magnitude in this rank's padding rows (of the TP-local tensors)."""
    worst = 0.0
    plan = model.tpcompile_plan
    tp = model.tpcompile_parallel.tp
    for name in (QKV, DENSE):
        p, pp = dict(model.named_parameters())[name], plan.params[name]
        full = p.full_tensor() if isinstance(p, DTensor) else p  # FSDP2's dp shards gathered
        for part, index in zip(full.chunk(tp, dim=pp.shard_dim), pp.index(), strict=True):
            pad = torch.as_tensor(index < 0).nonzero().flatten()
            worst = max(worst, part.index_select(pp.shard_dim, pad).abs().max().item() if pad.numel() else 0.0)
    return worst


def _norm_cases() -> list[tuple[str, dict]]:
    # a KV head several TP ranks hold: Falcon's one KV head at tp=4, straddled KV heads at
    # tp=4, and at tp=2 under FSDP2 (whose dp chunks cut the copied rows' dim)
    return [("falcon_uneven", {"tp": 4}), ("llama_straddle", {"tp": 4}), ("llama_straddle", {"tp": 2, "dp_shard": 2})]


def _grad_norm(name: str, layout: dict | None) -> float:
    """The gradient norm ``torch.nn.utils.clip_grad_norm_`` returns after one backward."""
    model = build(name, "sdpa").train()
    if layout is not None:
        tpcompile.parallelize(model, **layout)
    ids = _batches()[0]
    model(input_ids=ids, labels=ids).loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def _norms() -> list[float]:
    return [_grad_norm(name, layout) for name, layout in _norm_cases()]


def _straddle_steps(layouts: tuple[dict, dict] | None, root: str = "") -> list[float]:
    """Four AdamW steps of the 20-head / 5-KV-head Llama: two at ``layouts[0]``, a sharded
    checkpoint, two more at ``layouts[1]`` (``None``: one process throughout)."""
    batches = _batches()
    model = build("llama_straddle", "sdpa").train()
    if layouts is not None:
        tpcompile.parallelize(model, **layouts[0])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = [global_step(model, opt, b) for b in batches[:2]]
    if layouts is None:
        return losses + [global_step(model, opt, b) for b in batches[2:]]
    ckpt.save(Path(root) / "straddle", model, opt, kind="sharded")
    resumed = build("llama_straddle", "sdpa").train()
    tpcompile.parallelize(resumed, **layouts[1])
    opt = torch.optim.AdamW(resumed.parameters(), lr=LR)
    ckpt.load(Path(root) / "straddle", resumed, opt)
    return losses + [global_step(resumed, opt, b) for b in batches[2:]]


def _straddle_resume(root: str) -> list[float]:
    # tp=2 x dp_shard=2 (each rank's 10 query heads read 3 KV heads) -> tp=4 (5 read 2)
    return _straddle_steps(({"tp": 2, "dp_shard": 2}, {"tp": 4}), root)


def _world4(rank: int, world: int, root: str) -> dict:
    batches = _batches()
    model = build("falcon_uneven", "sdpa").train()
    tpcompile.parallelize(model, tp=2, dp_shard=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out: dict = {"before": [global_step(model, opt, b) for b in batches[:2]], "padding": _padding_values(model)}
    ckpt.save(Path(root) / "sharded", model, opt, kind="sharded")
    out["hf"] = tpcompile.hf_state_dict(model)  # what the checkpoint holds, padding dropped
    resumed = build("falcon_uneven", "sdpa").train()
    tpcompile.parallelize(resumed, tp=4, dp_shard=1)
    opt = torch.optim.AdamW(resumed.parameters(), lr=LR)
    ckpt.load(Path(root) / "sharded", resumed, opt)
    out["resumed"] = [global_step(resumed, opt, b) for b in batches[2:]]
    out["padding_tp4"] = _padding_values(resumed)
    delayed = {}
    for layout in ({"tp": 2, "dp_shard": 2}, {"tp": 4}):
        meta = build("falcon_uneven", "sdpa", meta=True)
        tpcompile.parallelize(meta, seed=0, **layout)
        delayed[layout["tp"]] = tpcompile.hf_state_dict(meta)
        out[f"padding_delayed_tp{layout['tp']}"] = _padding_values(meta)
    out["delayed_equal"] = all(torch.equal(v, delayed[4][k]) for k, v in delayed[2].items())
    out["unit_heads"] = _unit_heads()
    out["norms"] = _norms()
    out["straddle"] = _straddle_resume(root)
    piped = build("falcon_uneven", "sdpa").train()  # pp=2 x tp=2: each stage's heads padded
    tpcompile.parallelize(piped, tp=2, pp=2, pp_microbatches=2, pp_schedule="1f1b")
    opt = torch.optim.AdamW(piped.parameters(), lr=LR)
    out["pipelined"] = []
    for b in batches[:2]:
        out["pipelined"].append(float(tpcompile.pipeline_step(piped, {"input_ids": b, "labels": b})))
        opt.step()
        opt.zero_grad()
    return out


@pytest.mark.slow
def test_uneven_heads_train_resume_and_init_across_layouts(tmp_path: Path) -> None:
    want = _reference()
    results = run_distributed(_world4, 4, str(tmp_path), timeout=900)
    # the sharded checkpoint translates to an HF directory of exactly the trained weights
    from transformers import FalconForCausalLM

    from tpcompile.tools.cli import main

    assert main(["translate", str(tmp_path / "sharded"), str(tmp_path / "hf"), "--quiet"]) == 0
    got = FalconForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert all(torch.equal(got[k], v) for k, v in results[0]["hf"].items())
    straddle = _straddle_steps(None)
    for r in results:
        assert r["before"] == pytest.approx(want[:2], rel=REL)
        assert r["resumed"] == pytest.approx(want[2:], rel=REL)  # tp=2 x dp2 -> tp=4: another padding
        assert r["pipelined"] == pytest.approx(want[:2], rel=REL)
        for key in ("padding", "padding_tp4", "padding_delayed_tp2", "padding_delayed_tp4"):
            assert r[key] == 0.0, key
        assert r["delayed_equal"]
        # straddled KV heads train, checkpoint at tp=2 x dp2 and resume at tp=4 exactly
        assert r["straddle"] == pytest.approx(straddle, rel=REL)
        # a copied KV row counts once in the gradient norm (4x for Falcon's KV head before)
        assert r["norms"] == pytest.approx([_grad_norm(n, None) for n, _ in _norm_cases()], rel=REL)
        # the padding head's NaN is zeroed where it enters the row-parallel linear
        unit = r["unit_heads"]
        assert unit["layout"] == "padded" and unit["out"] < 1e-6 and unit["finite_grad"], unit
