"""HF-format checkpoints of transformed models, over real gloo process groups.

The contract: a transformed model's weights leave as exactly the untransformed model's
state dict (bit-exact, every family and layout), enter from an HF directory with each
rank reading only its own rows, and every write is atomic.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from dist import run_distributed

import tpcompile
from tpcompile.presets import tiny_config

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "gpt2", "gpt_neox", "mixtral", "bert"]
KV_CASES = {2: [("llama", {"num_key_value_heads": 1}), ("qwen3", {"num_key_value_heads": 1})],
            4: [("llama", {"num_key_value_heads": 2}), ("mistral", {"num_key_value_heads": 2})]}


def _build(name: str, overrides: dict | None = None, seed: int = 0) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(seed)
    cfg = tiny_config(name, **(overrides or {}))
    auto = AutoModelForMaskedLM if name == "bert" else AutoModelForCausalLM
    return auto.from_config(cfg).eval()


def _state_dict_diffs(got: dict, want: dict) -> list[str]:
    if list(got) != list(want):
        return [f"keys differ: {sorted(set(got) ^ set(want))[:5]}"]
    bad = []
    for k, w in want.items():
        g = got[k]
        if g.shape != w.shape or g.dtype != w.dtype or not torch.equal(g, w):
            bad.append(k)
    return bad


def _round_trip(rank: int, world: int, cases: list) -> dict[str, list[str]]:
    out = {}
    for name, overrides in cases:
        ref = _build(name, overrides)
        model = copy.deepcopy(ref)
        tpcompile.transform(model, tp=world)
        sd = tpcompile.hf_state_dict(model)
        everywhere = tpcompile.hf_state_dict(model, rank0_only=False)
        want = ref.state_dict()
        if rank == 0:
            out[f"{name}{overrides}"] = _state_dict_diffs(sd, want)
        else:
            out[f"{name}{overrides}"] = ["rank0_only leaked"] if sd else []
        out[f"{name}{overrides} all ranks"] = _state_dict_diffs(everywhere, want)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_hf_state_dict_is_bit_exact_for_every_family(world: int) -> None:
    cases = [(f, {}) for f in FAMILIES] if world == 2 else []
    cases += KV_CASES[world]
    for result in run_distributed(_round_trip, world, cases):
        bad = {k: v for k, v in result.items() if v}
        assert not bad, bad
