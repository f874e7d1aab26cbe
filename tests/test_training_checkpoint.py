"""Training checkpoints (sharded / local / full / async) over real gloo process groups.

A tiny Llama trains two AdamW steps at (dp_shard 2, tp 2) and is saved in every kind;
resumed at other layouts, the next two steps' losses must equal an uninterrupted run's
(the second one is computed after a resumed AdamW step, so it checks the optimizer state:
a lost or misplaced ``exp_avg`` would pass the first one).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from dist import free_port, global_step, kill_at_marker, run_distributed

import tpcompile
import tpcompile.checkpoint as ckpt
from tpcompile.tools.presets import tiny_config

REL = 1e-5
LR = 1e-2


def _build() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 9), generator=g) for _ in range(3)]


@functools.cache
def _uninterrupted() -> tuple[float, ...]:
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    return tuple(global_step(model, opt, ids) for ids in _after_resume(_batches()))


def _after_resume(batches: list[torch.Tensor]) -> list[torch.Tensor]:
    # the run's 3 batches, then batch 0 again: its loss follows a step on restored state
    return [*batches, batches[0]]


def _resumed(root: Path, name: str, **layout: int) -> tuple[float, float]:
    model = _build()
    if layout:
        tpcompile.parallelize(model, **layout)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    extra = ckpt.load(root / name, model, opt)
    assert extra == {"step": 2}, extra
    batches = _after_resume(_batches())
    return global_step(model, opt, batches[2]), global_step(model, opt, batches[3])


def _world4(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    model = _build()
    tpcompile.parallelize(model, dp_shard=2, tp=2)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = _batches()
    out: dict = {"before": [global_step(model, opt, b) for b in batches[:2]]}
    for kind in ("sharded", "local", "full"):
        ckpt.save(root / kind, model, opt, kind=kind, extra={"step": 2})
    out["hf"] = tpcompile.hf_state_dict(model)  # what the checkpoints hold
    handle = ckpt.save(root / "async", model, opt, kind="sharded", async_=True, step=2, extra={"step": 2})
    out["after"] = global_step(model, opt, batches[2])  # trains on while the save writes
    handle.wait()
    model = _build()
    tpcompile.parallelize(model, dp_shard=2, tp=2)
    out["fresh_hf"] = tpcompile.hf_state_dict(model)  # load must change these
    out["resumed"] = {
        "sharded@tp4": _resumed(root, "sharded", tp=4, dp_shard=1),
        "sharded@dp4": _resumed(root, "sharded", tp=1, dp_shard=4),
        "sharded@hsdp": _resumed(root, "sharded", tp=2, dp_replicate=2, dp_shard=1,
                                 sharding_strategy="HYBRID_SHARD"),
        "async@dp4": _resumed(root, "async", tp=1, dp_shard=4),
        "local@same": _resumed(root, "local", tp=2, dp_shard=2),
        "full@tp4": _resumed(root, "full", tp=4, dp_shard=1),
    }
    # async-save mirrors are found by layout, not id(mesh) (a dead mesh's id can be reused)
    from torch.distributed.device_mesh import init_device_mesh

    from tpcompile.checkpoint.chunks import mesh_key as _mesh_key

    names = ("dp_replicate", "dp_shard", "tp")
    a, b = (init_device_mesh("cpu", s, mesh_dim_names=names) for s in ((1, 2, 2), (1, 1, 4)))
    out["mesh_keys"] = [_mesh_key(a) != _mesh_key(b),
                        _mesh_key(a) == _mesh_key(init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=names))]
    try:
        _resumed(root, "local", tp=4, dp_shard=1)
        out["local_error"] = None
    except tpcompile.TPError as err:
        out["local_error"] = str(err)
    return out


def _world2(rank: int, world: int, root: str) -> dict:
    return {"sharded@tp2": _resumed(Path(root), "sharded", tp=2, dp_shard=1),
            "full@tp2": _resumed(Path(root), "full", tp=2, dp_shard=1)}


@pytest.mark.slow
def test_checkpoints_resume_at_other_layouts(tmp_path: Path) -> None:
    want = _uninterrupted()
    results = run_distributed(_world4, 4, str(tmp_path))
    first = results[0]
    torch.testing.assert_close(torch.tensor(first["before"]), torch.tensor(want[:2]), rtol=REL, atol=0)
    assert abs(want[3] - want[0]) > 1e-3  # the extra step is a real training step
    assert first["after"] == pytest.approx(want[2], rel=REL)
    for r in results:
        for case, loss in r["resumed"].items():
            assert loss == pytest.approx(want[2:], rel=REL), case
        assert r["mesh_keys"] == [True, True]
        assert "tp" in r["local_error"] and "'tp': 4" in r["local_error"] and "'tp': 2" in r["local_error"]
    for case, loss in run_distributed(_world2, 2, str(tmp_path))[0].items():
        assert loss == pytest.approx(want[2:], rel=REL), case
    assert ckpt.latest(tmp_path / "async") == tmp_path / "async" / "step-00000002"
    # single process, plain untransformed model, no process group
    assert _resumed(tmp_path, "sharded") == pytest.approx(want[2:], rel=REL)
    # translate: sharded and local checkpoints become HF directories of the saved weights
    from transformers import AutoModelForCausalLM

    from tpcompile.tools.cli import main

    saved = first["hf"]
    assert any(not torch.equal(saved[k], v) for k, v in first["fresh_hf"].items())
    for kind in ("sharded", "local", "full"):
        out = tmp_path / f"hf-{kind}"
        assert main(["translate", str(tmp_path / kind), str(out), "--quiet"]) == 0
        got = AutoModelForCausalLM.from_pretrained(out).state_dict()
        bad = [k for k in saved if not torch.equal(got[k], saved[k])]
        assert not bad, (kind, bad[:3])


_KILLED_ASYNC = """
import sys, time
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[2])
import tpcompile, tpcompile.checkpoint as ckpt
from tpcompile.checkpoint import training
from test_training_checkpoint import _build

dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[3], rank=0, world_size=1)
model = _build()
tpcompile.transform(model, tp=1)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt.save(sys.argv[1], model, opt, step=1, extra={"step": 1}).wait()
original = training._write_sharded
def stalled(*args):
    original(*args)
    print("MID-SAVE", flush=True)
    time.sleep(600)                       # killed before the directory is published
training._write_sharded = stalled
ckpt.save(sys.argv[1], model, opt, step=2, async_=True, extra={"step": 2})
time.sleep(600)
"""


@pytest.mark.slow  # spawns processes
def test_killed_async_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    kill_at_marker(["-c", _KILLED_ASYNC, str(tmp_path), str(Path(__file__).parent), str(free_port())])
    assert ckpt.latest(tmp_path) == tmp_path / "step-00000001"
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    assert ckpt.load(tmp_path, model, opt) == {"step": 1}
    partial = [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    assert len(partial) == 1 and not (tmp_path / "step-00000002").exists()
    with pytest.raises(tpcompile.TPError, match="not a complete tpcompile checkpoint"):
        ckpt.load(partial[0], model, opt)


def test_checkpoint_errors_are_clear(tmp_path: Path) -> None:
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with pytest.raises(tpcompile.TPError, match="kind must be one of"):
        ckpt.save(tmp_path / "x", model, opt, kind="zip")
    ckpt.save(tmp_path / "model-only", model, kind="sharded")
    with pytest.raises(tpcompile.TPError, match="holds no optimizer state"):
        ckpt.load(tmp_path / "model-only", model, opt)
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_config(tiny_config("llama", intermediate_size=96))
    with pytest.raises(tpcompile.TPError, match=r"different model .*gate_proj.weight: \[128, 64\] vs \[96, 64\]"):
        ckpt.load(tmp_path / "model-only", other, None)
    meta = json.loads((tmp_path / "model-only" / "tpcompile.json").read_text())
    assert meta["format"] == "tpcompile-sharded"
