"""HF-format checkpoints of transformed models, over real gloo process groups.

The contract: a transformed model's weights leave as exactly the untransformed model's
state dict (bit-exact, every family and layout), enter from an HF directory with each
rank reading only its own rows, and every write is atomic.  The multi-process cases of
one world size share one launch (module fixtures ``world2`` / ``world4``).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from dist import CaseResults, free_port, kill_at_marker, plan_ahead, run_cases
from plain import plain_logits

import tpcompile
from tpcompile.tools.presets import tiny_config

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
    plan_ahead(rank, world, [(_build, (name, overrides), {"tp": world}) for name, overrides in cases])
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


READ_CASES = {2: [("llama", {}), ("gpt2", {}), ("gemma2", {})],
              4: [("llama", {"num_key_value_heads": 2})]}


def _cases(world: int, root: Path) -> dict[str, tuple]:
    """Every multi-process case of this module at ``world`` processes, by name."""
    round_trip = [(f, {}) for f in FAMILIES] if world == 2 else []
    for sub in ("read", "saved", "translate"):  # each case writes under its own directory
        (root / sub).mkdir()
    cases: dict[str, tuple] = {
        "round trip": (_round_trip, round_trip + KV_CASES[world]),
        "shard on read": (_shard_on_read, str(root / "read"), READ_CASES[world]),
    }
    if world == 2:
        cases.update({"train and save": (_train_and_save, str(root / "saved")),
                      "from rank0": (_from_rank0,),
                      "save native": (_save_native, str(root / "translate"))})
    return cases


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> tuple[CaseResults, Path]:
    root = tmp_path_factory.mktemp("hf_checkpoint_world2")
    return run_cases(2, _cases(2, root), timeout=900), root


@pytest.fixture(scope="module")
def world4(tmp_path_factory: pytest.TempPathFactory) -> tuple[CaseResults, Path]:
    root = tmp_path_factory.mktemp("hf_checkpoint_world4")
    return run_cases(4, _cases(4, root), timeout=900), root


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_hf_state_dict_is_bit_exact_for_every_family(world: int, request: pytest.FixtureRequest) -> None:
    results, _ = request.getfixturevalue(f"world{world}")
    for result in results["round trip"]:
        bad = {k: v for k, v in result.items() if v}
        assert not bad, bad


SAVE_FAMILIES = ["llama", "gpt2", "phi3", "gemma2", "mixtral"]  # plain, tied+Conv1D, fused, tied, MoE
IDS = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))


def _train_and_save(rank: int, world: int, root: str) -> dict[str, list]:
    logits = {}
    for name in SAVE_FAMILIES:
        model = _build(name)
        tpcompile.transform(model, tp=world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model.train()
        model(IDS, labels=IDS).loss.backward()
        opt.step()
        model.eval()
        tpcompile.save_pretrained(model, Path(root) / name, max_shard_size="40KB")
        with torch.no_grad():
            logits[name] = model(IDS).logits.tolist()
    return logits


@pytest.mark.slow
def test_save_pretrained_loads_with_plain_transformers(world2: tuple[CaseResults, Path]) -> None:

    results, root = world2
    got, saved = results["train and save"][0], root / "saved"
    dirs = [saved / name for name in SAVE_FAMILIES]
    for out in dirs:
        assert (out / "config.json").exists() and (out / "model.safetensors.index.json").exists()
    assert not [p for p in saved.iterdir() if p.name.startswith(".")]  # no partial left
    # one interpreter loads every family: starting one costs more than loading a tiny model
    loaded = plain_logits(IDS, dirs)
    for name, want in zip(SAVE_FAMILIES, loaded, strict=True):
        torch.testing.assert_close(torch.tensor(got[name]), torch.tensor(want), atol=1e-5, rtol=0,
                                   msg=name)


def _expected_bytes(model: torch.nn.Module) -> int:
    """Bytes a rank must read: its non-padding rows of sharded tensors, all of the rest."""
    from tpcompile.runtime.shards import tp_context

    table, rank = model.tpcompile_table, tp_context(model).rank
    total = 0
    for key in table.saved_keys():
        t = table.tensors[key]
        numel = 1
        for s in t.shape:
            numel *= s
        if t.sharded:
            rows = sum(b - a for _, a, b in t.read_runs(rank))
            numel = numel // t.shape[t.shard_dim] * rows
        total += numel * getattr(torch, t.dtype).itemsize
    return total


def _shard_on_read(rank: int, world: int, root: str, cases: list) -> list[dict]:
    import torch.distributed as dist

    out = []
    for name, overrides in cases:
        path = Path(root) / f"{name}-{world}"
        ref = _build(name, overrides)
        if rank == 0:
            ref.save_pretrained(path)  # transformers' own writer
        dist.barrier()
        model = tpcompile.from_pretrained(str(path), tp=world)
        stats = model.tpcompile_load_stats
        on_disk = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        with torch.no_grad():
            err = (model(IDS).logits - ref(IDS).logits).abs().max().item()
        out.append({"case": name, "err": err, "read": stats["bytes_read"],
                    "expected": _expected_bytes(model), "on_disk": on_disk,
                    "training": model.training})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_from_pretrained_reads_only_each_ranks_slices(
    world: int, request: pytest.FixtureRequest
) -> None:
    results, _ = request.getfixturevalue(f"world{world}")
    for per_rank in results["shard on read"]:
        for r in per_rank:
            assert r["err"] < 1e-5, r
            assert r["read"] == r["expected"], r  # exactly its rows, nothing else
            assert r["read"] < r["on_disk"] * (0.7 if world == 2 else 0.5), r
            assert not r["training"]


def _from_rank0(rank: int, world: int) -> float:
    ref = _build("llama")
    if rank == 0:
        model = copy.deepcopy(ref)
    else:
        with torch.device("meta"):
            model = _build("llama")
    tpcompile.transform(model, tp=world, load_state_dict_from_rank0=True)
    with torch.no_grad():
        return (model(IDS).logits - ref(IDS).logits).abs().max().item()


@pytest.mark.slow
def test_load_state_dict_from_rank0_fills_meta_ranks(world2: tuple[CaseResults, Path]) -> None:
    assert max(world2[0]["from rank0"]) < 1e-5


def _save_native(rank: int, world: int, root: str) -> None:
    model = _build("llama")
    tpcompile.transform(model, tp=world)
    tpcompile.save_pretrained(model, Path(root) / "native", translate_on_save=False)


@pytest.mark.slow
def test_translate_cli_turns_native_checkpoint_into_hf(
    world2: tuple[CaseResults, Path], tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    from tpcompile.tools.cli import main

    results, root = world2
    assert results["save native"] == [None, None]
    native = root / "translate" / "native"
    meta = json.loads((native / "tpcompile.json").read_text())
    assert meta["format"] == "tpcompile-full" and meta["table"]["tp"] == 2
    assert main(["translate", str(native), str(tmp_path / "hf"), "--quiet"]) == 0
    assert main(["translate", str(native), str(tmp_path / "hf-bf16"), "--dtype", "bf16", "--quiet"]) == 0
    want = _build("llama").state_dict()
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    assert not _state_dict_diffs(got, want)
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-bf16", dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(half[k], want[k].bfloat16()) for k in want)
    assert main(["translate", str(native), str(tmp_path / "hf"), "--quiet"]) == 2  # exists


_KILLED_SAVE = """
import os, sys, time, datetime
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
import tpcompile
from tpcompile.checkpoint import parallel_write
from test_hf_checkpoint import _build

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=1)
model = _build("llama")
tpcompile.transform(model, tp=1)
out = sys.argv[1]
tpcompile.save_pretrained(model, out, max_shard_size="40KB")   # the good checkpoint
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)                                            # the next one differs
writes = 0
original = parallel_write._pwrite
def slow_write(*args):
    global writes
    original(*args)
    writes += 1
    if writes == 3:
        print("MID-SAVE", flush=True)
        time.sleep(600)                                        # killed here
parallel_write._pwrite = slow_write
tpcompile.save_pretrained(model, out, max_shard_size="40KB")
"""


@pytest.mark.slow  # spawns processes
def test_killed_save_leaves_previous_checkpoint(tmp_path: Path) -> None:

    from transformers import AutoModelForCausalLM

    from tpcompile.checkpoint.hf import load_hf_weights

    out = tmp_path / "ckpt"
    kill_at_marker(["-c", _KILLED_SAVE, str(out), str(Path(__file__).parent), str(free_port())])
    # the previous checkpoint is intact and loads with plain transformers
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert not _state_dict_diffs(got, _build("llama").state_dict())
    partial = [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt.partial-")]
    assert len(partial) == 1
    model = _build("llama")
    model.tpcompile_table = tpcompile.TranslationTable.from_dict(
        json.loads(json.dumps(_table_tp1(model).to_dict())))
    with pytest.raises(tpcompile.TPError, match="incomplete|truncated|missing|partial directory"):
        load_hf_weights(model, partial[0])


def _table_tp1(model: torch.nn.Module) -> tpcompile.TranslationTable:
    from tpcompile.plan import build_table

    return build_table(model, tpcompile.plan_model(model, 1))


def test_bad_checkpoints_fail_with_the_file_and_key_named(tmp_path: Path) -> None:
    from tpcompile.checkpoint.hf import load_hf_weights

    llama = _build("llama")
    llama.save_pretrained(tmp_path / "llama", max_shard_size="40KB")
    model = _build("llama")
    model.tpcompile_table = _table_tp1(model)
    stats = load_hf_weights(model, tmp_path / "llama")
    assert stats["tensors"] == len(model.tpcompile_table.saved_keys())
    # another architecture: keys named
    _build("gpt2").save_pretrained(tmp_path / "gpt2")
    with pytest.raises(tpcompile.TPError, match=r"missing \['model.embed_tokens.weight'"):
        load_hf_weights(model, tmp_path / "gpt2")
    # same keys, other shapes
    _build("llama", {"intermediate_size": 96}).save_pretrained(tmp_path / "wide")
    with pytest.raises(tpcompile.TPError, match=r"mlp.gate_proj.weight has shape \[96, 64\]"):
        load_hf_weights(model, tmp_path / "wide")
    # a missing shard file
    shards = sorted((tmp_path / "llama").glob("model-*.safetensors"))
    shards[1].rename(tmp_path / "moved.safetensors")
    with pytest.raises(tpcompile.TPError, match=f"shard file {shards[1].name} .* is missing"):
        load_hf_weights(model, tmp_path / "llama")
    (tmp_path / "moved.safetensors").rename(shards[1])
    # a truncated file
    data = shards[0].read_bytes()
    shards[0].write_bytes(data[: len(data) - 100])
    with pytest.raises(tpcompile.TPError, match=f"{shards[0].name} is truncated"):
        load_hf_weights(model, tmp_path / "llama")
    with pytest.raises(tpcompile.TPError, match="not transformed by tpcompile"):
        tpcompile.hf_state_dict(_build("llama"))
