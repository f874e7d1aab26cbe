"""Activation checkpointing and offloading: exact gradients, prefetch window, TP + FSDP2.

Every numeric test compares against the same model run plainly from the same seed; fp32
recompute and host round trips are bit-exact, so tolerances are tight.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_distributed
from torch import nn
from torch.distributed.tensor import DTensor

import tpcompile
from tpcompile.runtime import OffloadHandle, checkpoint_blocks, offload_activations
from tpcompile.tools.presets import tiny_config

LAYERS = 4
BLOCKS = [f"model.layers.{i}" for i in range(LAYERS)]
EXACT = {"rtol": 0.0, "atol": 1e-6}


def _llama(layers: int = LAYERS) -> nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=layers)).eval()


def _ids(seq: int = 17) -> torch.Tensor:
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _apply(model: nn.Module, mode: str, blocks: list[str], **kw: int) -> OffloadHandle | None:
    handle = None
    if "checkpoint" in mode:
        checkpoint_blocks(model, blocks)
    if "offload" in mode:
        handle = offload_activations(model, blocks, **kw)
    return handle


@pytest.fixture(scope="module")
def base() -> nn.Module:
    return _llama()


@pytest.mark.parametrize("mode", ["checkpoint", "offload", "checkpoint+offload"])
def test_gradients_match_plain_run(base: nn.Module, mode: str) -> None:
    ids = _ids()
    want_loss, want = _step(copy.deepcopy(base), ids)
    model = copy.deepcopy(base)
    names = [n for n, _ in model.named_parameters()]
    handle = _apply(model, mode, BLOCKS)
    for _ in range(2):  # the second step proves hooks and swapped weights were restored
        loss, got = _step(model, ids)
        torch.testing.assert_close(loss, want_loss, **EXACT)
        for name in want:
            torch.testing.assert_close(got[name], want[name], **EXACT, msg=name)
    assert [n for n, _ in model.named_parameters()] == names  # FQNs untouched
    if handle is not None:
        assert handle.stats.offloaded_bytes > 0 and handle.resident_blocks == 0


def test_kv_cache_is_not_updated_twice(base: nn.Module) -> None:
    model = copy.deepcopy(base)
    checkpoint_blocks(model, BLOCKS)
    handle = offload_activations(model, BLOCKS)
    with pytest.warns(UserWarning, match="KV cache disabled"):
        out = model(_ids(), labels=_ids(), use_cache=True)
    out.loss.backward()
    assert out.past_key_values.get_seq_length() == 0  # not filled, so not filled twice
    # without grad nothing is saved or recomputed: the cache and generate() work as usual
    prompt, kw = _ids(5), {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert model.generate(prompt, **kw).tolist() == base.generate(prompt, **kw).tolist()
    assert handle.stats.offloaded_tensors == LAYERS  # only the recorded forward offloaded


@pytest.mark.parametrize("horizon", [1, 2])
def test_prefetch_window(base: nn.Module, horizon: int) -> None:
    model = copy.deepcopy(base)
    handle = offload_activations(model, BLOCKS, loading_horizon=horizon)
    _step(model, _ids())
    s = handle.stats
    # backward starts at the last block (loaded on demand), then each block entered starts
    # loading the next `horizon` blocks in backward order
    assert s.demand_loads == 1
    assert list(s.prefetch_order) == [f"model.layers.{i}" for i in range(LAYERS - 2, -1, -1)]
    assert s.prefetches == LAYERS - 1
    assert s.max_resident_blocks == horizon + 1
    assert handle.resident_blocks == 0  # all device copies dropped after backward
    s.reset()
    handle.remove()
    _step(model, _ids())
    assert s.offloaded_tensors == 0 and s.prefetches == 0


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64, bias=False)
        self.w = nn.Parameter(torch.randn(64, 64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # lin saves x and its weight; relu saves its output, and so does mm, with w.t(), a
        # view of a parameter
        return torch.relu(self.lin(x)) @ self.w.t() + 1e-3 * x.sum()


def test_parameters_and_small_tensors_stay_on_device() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    handle = offload_activations(model, ["0", "1"], min_bytes=1024)
    x = torch.randn(8, 64, requires_grad=True)  # 2 KiB activations
    model(x).sum().backward()
    s = handle.stats
    assert s.parameter_saves == 4  # lin.weight and w.t() per block
    assert s.offloaded_tensors == 4  # x and relu's output per block
    assert s.deduplicated == 2  # relu's output, saved twice, copied once
    assert s.offloaded_bytes == 4 * 8 * 64 * 4
    handle.remove()
    handle = offload_activations(model, ["0", "1"], min_bytes=1 << 20)
    model(x).sum().backward()
    assert handle.stats.offloaded_tensors == 0 and handle.stats.kept_tensors == 6


def test_hooks_the_block_already_has_run_once_inside_the_recompute() -> None:
    torch.manual_seed(0)
    block = nn.Linear(64, 64)
    # a block-level pre-hook that changes the inputs, like TP's on a block owning weights:
    # a recompute that re-entered it with already-transformed inputs would compute 4 * x
    block.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    ref = copy.deepcopy(block)
    x = torch.randn(4, 64)
    ref(x).square().sum().backward()
    model = nn.Sequential(block)
    checkpoint_blocks(model, ["0"])
    model(x).square().sum().backward()
    torch.testing.assert_close(block.weight.grad, ref.weight.grad, **EXACT)


def test_errors(base: nn.Module) -> None:
    model = copy.deepcopy(base)
    with pytest.raises(tpcompile.TPError, match=r"'model.layer.0'.*model\.layers\.0"):
        checkpoint_blocks(model, ["model.layer.0"])
    with pytest.raises(tpcompile.TPError, match="'nope'.*model.layers.3"):
        offload_activations(model, ["nope"])
    for bad in (0, -1, 1.5):
        with pytest.raises(tpcompile.TPError, match="loading_horizon"):
            offload_activations(model, BLOCKS, loading_horizon=bad)
    with pytest.raises(tpcompile.TPError, match="host memory"):
        offload_activations(model, BLOCKS, device="meta")
    with pytest.raises(tpcompile.TPError, match="nested"):
        checkpoint_blocks(model, ["model.layers", "model.layers.0"])
    checkpoint_blocks(model, BLOCKS[:1])
    with pytest.raises(tpcompile.TPError, match="already has checkpoint"):
        checkpoint_blocks(model, BLOCKS[:1])


# --------------------------------------------------------------------------- distributed


def _tp_parity(rank: int, world: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    base = _llama()
    ids = _ids()
    ref_loss, _ = _step(copy.deepcopy(base), ids)  # single-process reference
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    results: dict[str, tuple] = {}
    for variant in ("tp", "tp+checkpoint+offload", "tp+offload+fsdp2", "tp+checkpoint+offload+fsdp2"):
        # the documented order: TP -> checkpoint -> offload -> FSDP2
        model = tpcompile.transform(copy.deepcopy(base), tp=world, mesh=mesh["tp"])
        blocks = model.tpcompile_plan.blocks
        handle = _apply(model, variant, blocks)
        if variant.endswith("fsdp2"):
            modules = dict(model.named_modules())
            for b in blocks:
                fully_shard(modules[b], mesh=mesh["dp"])
        steps = [_step(model, ids) for _ in range(2)]
        local = [(loss, {n: g.to_local() if isinstance(g, DTensor) else g for n, g in grads.items()})
                 for loss, grads in steps]
        params_ok = all(isinstance(p, nn.Parameter) for _, p in model.named_parameters())
        results[variant] = (local, params_ok, None if handle is None else handle.stats)
    want = results["tp"][0]
    for variant, (got, params_ok, stats) in results.items():
        assert params_ok, f"{variant}: TP hooks left a local weight in place of a parameter"
        for (gl, gg), (wl, wg) in zip(got, want, strict=True):
            torch.testing.assert_close(gl, wl, **EXACT)
            for name in wg:
                torch.testing.assert_close(gg[name], wg[name], **EXACT, msg=f"{variant}: {name}")
        if stats is None:
            continue
        assert stats.prefetches == 2 * (LAYERS - 1) and stats.max_resident_blocks == 3, stats
        if "checkpoint" in variant:  # only the block inputs are saved, once per step
            assert stats.offloaded_tensors == 2 * LAYERS and stats.parameter_saves == 0, stats
        else:  # 7 local weights + 2 norm weights per layer, FSDP2's unsharded ones too
            assert stats.parameter_saves == 2 * 9 * LAYERS, stats
    torch.testing.assert_close(want[0][0], ref_loss, rtol=0.0, atol=1e-5)
    return blocks


@pytest.mark.slow
def test_tensor_parallel_with_checkpoint_offload_and_fsdp2_matches() -> None:
    for blocks in run_distributed(_tp_parity, 2):
        assert blocks == BLOCKS
