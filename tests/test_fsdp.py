"""parallelize(): TP + FSDP2 over real gloo process groups.

Every training case runs 10 AdamW steps on a tiny Llama and compares the per-step loss
with one process training the same weights on the whole global batch (each data-parallel
rank takes its slice; losses are token means, so the mean over dp ranks is the global
loss). Several layouts share one launch: spawning 4 interpreters costs more than the
training itself.
"""

from __future__ import annotations

import functools

import pytest
import torch
from dist import global_step, run_distributed
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import tpcompile
from tpcompile.errors import TPError
from tpcompile.tools.presets import tiny_config

STEPS = 10
REL = 1e-5


def _build(meta: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config("llama")
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    return AutoModelForCausalLM.from_config(cfg)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 9), generator=g) for _ in range(STEPS)]


@functools.cache
def _reference() -> tuple[float, ...]:
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for ids in _batches():
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return tuple(losses)


def _train(model: torch.nn.Module) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return [global_step(model, opt, ids) for ids in _batches()]


def _case(rank: int, kwargs: dict) -> dict:
    kwargs = dict(kwargs)
    model = _build(meta=kwargs.pop("_meta_unless_rank0", False) and rank != 0)
    if kwargs.pop("_expect_error", False):
        with pytest.raises(TPError) as err:
            tpcompile.parallelize(model, **kwargs)
        return {"error": str(err.value)}
    tpcompile.parallelize(model, **kwargs)
    cfg = model.tpcompile_parallel
    return {
        "losses": _train(model),
        "mesh": tuple(model.tpcompile_mesh.shape),
        "strategy": cfg.sharding_strategy.value,
        "fsdp": any(isinstance(m, FSDPModule) for m in model.modules()),
        "reshard": cfg.reshard_after_forward,
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "offload_stats": getattr(getattr(model, "tpcompile_offload", None), "stats", None),
    }


def _delayed_init(rank: int, layout: dict) -> dict:
    """A meta model parallelized with seed=0: full HF-layout values, shard sizes, logits."""
    model = _build(meta=True)
    tpcompile.parallelize(model, seed=0, **layout)
    table = getattr(model, "tpcompile_table", None)
    tp = model.tpcompile_parallel.tp
    full, local_numel, total = {}, 0, 0
    for name, p in model.named_parameters():
        # one process: no data-parallel rank to shard over, so no FSDP2 and plain tensors
        local_numel += (p.to_local() if isinstance(p, DTensor) else p).numel()
        total += p.numel()
        value = p.full_tensor() if isinstance(p, DTensor) else p.detach().clone()
        tmap = table.tensors.get(name) if table is not None else None
        if tmap is not None and tmap.sharded:  # the TP layout back to HF rows
            value = tmap.to_hf(list(value.chunk(tp, dim=tmap.shard_dim)))
        full[name] = value
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return {"full": full, "local": local_numel, "total": total, "logits": logits, "buffers": buffers,
            "seed": torch.initial_seed()}


def _session(rank: int, world: int, cases: list[tuple[str, dict]], delayed: dict | None) -> dict:
    out = {name: _case(rank, kwargs) for name, kwargs in cases}
    if delayed is not None:
        out["delayed_init"] = _delayed_init(rank, delayed)
    return out


def _check(results: list[dict], name: str, mesh: tuple, strategy: str) -> None:
    for r in results:
        got = r[name]
        assert got["mesh"] == mesh and got["strategy"] == strategy, got
        assert got["dtensors"]
        for step, (a, b) in enumerate(zip(got["losses"], _reference(), strict=True)):
            assert abs(a - b) <= REL * abs(b), f"{name} step {step}: {a} vs {b}"


WORLD4 = [
    ("full_shard", dict(tp=2)),
    ("hybrid", dict(tp=2, dp_replicate=2, sharding_strategy="HYBRID_SHARD")),
    ("shard_grad_op", dict(tp=2, sharding_strategy="SHARD_GRAD_OP")),
    ("checkpointed", dict(tp=2, activation_checkpointing=True)),
]
WORLD2 = [
    ("tp_only", dict(tp=2)),
    ("no_shard", dict(sharding_strategy="NO_SHARD")),
    # accelerate's sync_module_states: rank 1 builds on meta, takes rank 0's weights
    ("rank0_weights", dict(tp=2, config={"fsdp_sync_module_states": True}, _meta_unless_rank0=True)),
    ("offloaded", dict(tp=2, activation_checkpointing=True, activation_offloading=True, cpu_offload=True)),
    ("bf16", dict(tp=2, mixed_precision="bf16")),
    ("wrong_wrap_class", dict(config={"fsdp_transformer_layer_cls_to_wrap": "GPT2Block"}, _expect_error=True)),
    ("meta_on_rank1_only", dict(_meta_unless_rank0=True, _expect_error=True)),  # raises on every rank
]


# one launch per world size, shared by the tests below: spawning costs more than training
@functools.cache
def _world4() -> list[dict]:
    return run_distributed(_session, 4, WORLD4, {"tp": 2})


@functools.cache
def _world2() -> list[dict]:
    return run_distributed(_session, 2, WORLD2, None)


@pytest.mark.slow
def test_world4_layouts_match_single_process() -> None:
    results = _world4()
    _check(results, "full_shard", (1, 2, 2), "FULL_SHARD")
    _check(results, "hybrid", (2, 1, 2), "HYBRID_SHARD")
    _check(results, "shard_grad_op", (1, 2, 2), "SHARD_GRAD_OP")
    assert not results[0]["shard_grad_op"]["reshard"] and results[0]["full_shard"]["reshard"]
    _check(results, "checkpointed", (1, 2, 2), "FULL_SHARD")
    assert all(r[name]["fsdp"] for r in results for name, _ in WORLD4)


@pytest.mark.slow
def test_world2_layouts_match_single_process() -> None:
    results = _world2()
    _check(results, "tp_only", (1, 1, 2), "FULL_SHARD")
    _check(results, "no_shard", (2, 1, 1), "NO_SHARD")
    _check(results, "rank0_weights", (1, 1, 2), "FULL_SHARD")
    _check(results, "offloaded", (1, 1, 2), "FULL_SHARD")
    assert results[0]["offloaded"]["offload_stats"].offloaded_bytes > 0
    # one data-parallel rank: FSDP2 only where a policy needs it (offload, mixed precision)
    fsdp = {name: results[0][name]["fsdp"] for name in ("tp_only", "rank0_weights", "no_shard", "offloaded", "bf16")}
    assert fsdp == {"tp_only": False, "rank0_weights": False, "no_shard": True, "offloaded": True, "bf16": True}
    bf16 = results[0]["bf16"]["losses"]  # bf16 compute: close, not equal
    assert all(abs(a - b) < 0.05 * b for a, b in zip(bf16, _reference(), strict=True)), bf16
    for r in results:
        assert "are of class ['LlamaDecoderLayer']" in r["wrong_wrap_class"]["error"]
        assert "ranks [1] built the model on the meta device" in r["meta_on_rank1_only"]["error"]


@pytest.mark.slow
def test_delayed_init_is_layout_independent() -> None:
    sharded = [r["delayed_init"] for r in _world4()]  # dp_shard=2 x tp=2
    (single,) = run_distributed(_session, 1, [], {})  # tp=1, one process
    single = single["delayed_init"]
    real = _build()
    for r in sharded:
        assert set(r["full"]) == set(single["full"])
        for name, value in r["full"].items():
            assert torch.equal(value, single["full"][name]), name
        # every rank holds about a quarter: nobody materialized the model
        assert r["local"] <= r["total"] / 4 * 1.1, (r["local"], r["total"])
        assert (r["logits"] - single["logits"]).abs().max().item() < 1e-5
        for name, b in real.named_buffers():  # rotary tables recomputed by the model's init
            assert torch.allclose(r["buffers"][name], b), name
    # the seed also seeds each process: equal within a TP group, distinct across dp
    assert sharded[0]["seed"] == sharded[1]["seed"] != sharded[2]["seed"] == sharded[3]["seed"]
    # the model's own init: norms are ones, projections ~ N(0, initializer_range)
    w = single["full"]["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(single["full"]["model.norm.weight"], torch.ones(64))
    assert 0.015 < w.std().item() < 0.025


def test_needs_a_process_group() -> None:
    with pytest.raises(TPError, match="initialized process group"):
        tpcompile.parallelize(torch.nn.Linear(2, 2))
