"""Checkpoints of pipelined models over real gloo process groups.

A pipelined rank holds only its stages' tensors, so every checkpoint path must still
write the unsplit model's files: each stage its own tensors under their HF names, a tie
held by two stages (GPT-2's wte / lm_head) once, one metadata file.

* world 4: a tiny Llama trains two AdamW steps at pp2 x tp2, is saved sharded and resumed
  at pp1 x tp2 and at pp2 x dp_shard2 (and a pp1 x tp2 checkpoint at pp2 x tp2); the next
  two losses must equal the saving run's own (the second follows a resumed AdamW step,
  so it checks the optimizer state too).  Its ``save_pretrained`` and its sharded, local
  and full checkpoints, translated, must hold the weights a pp=1 model loads from the
  sharded one, bit for bit.
* world 2: ``save_pretrained`` of pp=2 Llama and GPT-2 loads with plain transformers
  into exactly the unsplit model's weights; a trained pp=2 GPT-2 resumes at pp=1 and
  back at pp=2, and its checkpoint holds the same keys as a pp=1 one.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import CaseResults, run_cases

import tpcompile
import tpcompile.checkpoint as ckpt
from tpcompile.tools.presets import tiny_config

REL = 1e-5
LR = 1e-2
PP = {"pp_schedule": "1f1b", "pp_microbatches": 2}


def _build(family: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    cfg.num_hidden_layers = 4
    for key, value in cfg.to_dict().items():
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(cfg, key, 0.0)  # GPT-2 names its dropouts *_pdrop
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _parallel(family: str, **layout: int) -> torch.nn.Module:
    model = _build(family)
    if layout.get("pp", 1) > 1:
        layout = {**PP, **layout}
    tpcompile.parallelize(model, **layout)
    return model


def _batches() -> list[torch.Tensor]:
    """Three batches, then the first again: its loss follows a step on restored state."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (4, 16), generator=g) for _ in range(3)]
    return [*batches, batches[0]]


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    # every rank passes the whole batch: data-parallel ranks average equal gradients
    loss = tpcompile.pipeline_step(model, {"input_ids": ids, "labels": ids})
    opt.step()
    opt.zero_grad()
    return loss.item()


def _adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


@functools.cache
def _single(family: str) -> tuple[float, ...]:
    """The losses of one process training the unsplit model on the same batches."""
    model = _build(family)
    opt = _adamw(model)
    return tuple(_step(model, opt, ids) for ids in _batches())


def _resumed(path: Path, family: str, loaded: dict | None = None, **layout: int) -> tuple[float, float]:
    """The two losses after loading ``path``; ``loaded`` receives the loaded weights
    (gathered onto rank 0: a model without pp)."""
    model = _parallel(family, **layout)
    opt = _adamw(model)
    assert ckpt.load(path, model, opt) == {"step": 2}
    if loaded is not None:
        loaded.update(tpcompile.hf_state_dict(model))
    batches = _batches()
    return _step(model, opt, batches[2]), _step(model, opt, batches[3])


def _train_and_save(root: Path, name: str, family: str, *, kinds: tuple[str, ...] = ("sharded",),
                    **layout: int) -> dict[str, Any]:
    """Two steps, saves at step 2 (``<name>``: sharded, ``<name>-<kind>`` the others,
    ``<name>-hf``: save_pretrained), then the uninterrupted run's next two steps."""
    model = _parallel(family, **layout)
    opt = _adamw(model)
    batches = _batches()
    out = {"before": [_step(model, opt, b) for b in batches[:2]]}
    for kind in kinds:
        path = root / (name if kind == "sharded" else f"{name}-{kind}")
        ckpt.save(path, model, opt, kind=kind, step=2, extra={"step": 2})
    model.save_pretrained(root / f"{name}-hf")
    out["after"] = [_step(model, opt, b) for b in batches[2:]]
    return out


def _world4(rank: int, world: int, root: str) -> dict[str, Any]:
    root = Path(root)
    out = {"pp2tp2": _train_and_save(root, "pp2tp2", "llama", kinds=("sharded", "local", "full"), pp=2, tp=2,
                                     dp_shard=1),
           "pp1tp2": _train_and_save(root, "pp1tp2", "llama", tp=2, dp_shard=2)}
    out["loaded_hf"] = {}  # what the pp checkpoint holds, as a pp=1 model loads it
    out["resumed"] = {
        "pp2tp2@pp1tp2": _resumed(root / "pp2tp2", "llama", out["loaded_hf"], tp=2, dp_shard=2),
        "pp2tp2@pp2dp2": _resumed(root / "pp2tp2", "llama", pp=2, dp_shard=2, tp=1),
        "pp1tp2@pp2tp2": _resumed(root / "pp1tp2", "llama", pp=2, tp=2, dp_shard=1),
    }
    return out


def _world2(rank: int, world: int, root: str) -> dict[str, Any]:
    root = Path(root)
    for family in ("llama", "gpt2"):  # untrained: the parent rebuilds the very same weights
        model = _parallel(family, pp=2, tp=1, dp_shard=1)
        model.save_pretrained(root / f"{family}-init-hf")
    with pytest.raises(tpcompile.TPError, match="save_pretrained"):  # rank 0 holds one stage only
        tpcompile.hf_state_dict(model)
    out = _train_and_save(root, "gpt2-pp2", "gpt2", pp=2, tp=1, dp_shard=1)
    model = _parallel("gpt2", tp=1, dp_shard=2)  # the tie, written by one stage, into one tensor
    opt = _adamw(model)
    ckpt.load(root / "gpt2-pp2", model, opt)
    ckpt.save(root / "gpt2-pp1", model, opt, kind="sharded", step=2, extra={"step": 2})
    batches = _batches()
    out["resumed"] = {"pp2@pp1": (_step(model, opt, batches[2]), _step(model, opt, batches[3])),
                      # and back into both stages' copies
                      "pp1@pp2": _resumed(root / "gpt2-pp1", "gpt2", pp=2, tp=1, dp_shard=1)}
    return out


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pp-ckpt")


@pytest.fixture(scope="module")
def world4(root: Path) -> CaseResults:
    return run_cases(4, {"train": (_world4, str(root))}, timeout=600)


@pytest.fixture(scope="module")
def world2(root: Path) -> CaseResults:
    return run_cases(2, {"train": (_world2, str(root))}, timeout=600)


def _step_dir(root: Path, name: str) -> Path:
    return root / name / "step-00000002"


def _dcp_keys(path: Path) -> set[str]:
    import torch.distributed.checkpoint as dcp

    return set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)


def _hf(path: Path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).state_dict()


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad[:3]


@pytest.mark.slow
def test_sharded_checkpoints_move_between_pp_and_other_layouts(world4: CaseResults, root: Path) -> None:
    want = _single("llama")
    assert abs(want[3] - want[0]) > 1e-3  # the repeated batch's loss moved: real training steps
    for r in world4["train"]:
        for run in ("pp2tp2", "pp1tp2"):  # the saving runs train as one process does
            assert r[run]["before"] + r[run]["after"] == pytest.approx(want, rel=REL), run
        for case, losses in r["resumed"].items():
            saved_at = case.split("@")[0]
            assert losses == pytest.approx(r[saved_at]["after"], rel=REL), case
    # the same files whatever the layout: every tensor once, under its HF name
    assert _dcp_keys(_step_dir(root, "pp2tp2")) == _dcp_keys(_step_dir(root, "pp1tp2"))


@pytest.mark.slow
def test_pp_save_pretrained_and_translate_hold_the_checkpoint(world4: CaseResults, root: Path) -> None:
    from tpcompile.tools.cli import main

    loaded = world4["train"][0]["loaded_hf"]  # the pp2 x tp2 checkpoint, read at pp1 x tp2
    for name in ("pp2tp2", "pp2tp2-local", "pp2tp2-full"):  # every kind, as written by the stages
        out = root / f"{name}-translated"
        assert main(["translate", str(_step_dir(root, name)), str(out), "--quiet"]) == 0
        _assert_equal(_hf(out), loaded)
    _assert_equal(_hf(root / "pp2tp2-hf"), loaded)  # model.save_pretrained at the same step
    assert not (root / "pp2tp2-hf" / "tpcompile.json").exists()  # a plain HF directory


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pp_save_pretrained_is_the_unsplit_model(world2: CaseResults, root: Path, family: str) -> None:
    world2["train"]  # raises if the launch failed
    got = root / f"{family}-init-hf"
    _assert_equal(_hf(got), _build(family).state_dict())
    if family == "gpt2":  # the tie is stored once, as transformers stores it
        from safetensors import safe_open

        with safe_open(str(got / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys


@pytest.mark.slow
def test_tied_weights_resume_across_pp(world2: CaseResults, root: Path) -> None:
    want = _single("gpt2")
    assert abs(want[3] - want[0]) > 1e-3
    for r in world2["train"]:
        assert r["before"] + r["after"] == pytest.approx(want, rel=REL)
        for case, losses in r["resumed"].items():
            assert losses == pytest.approx(r["after"], rel=REL), case
    pp2, pp1 = _step_dir(root, "gpt2-pp2"), _step_dir(root, "gpt2-pp1")
    assert _dcp_keys(pp2) == _dcp_keys(pp1)
    assert "model/lm_head.weight" not in _dcp_keys(pp2)
    from tpcompile.tools.cli import main

    for path in (pp2, pp1):  # pp1 was loaded from pp2 and saved again: the same weights
        assert main(["translate", str(path), str(root / f"{path.parent.name}-tr"), "--quiet"]) == 0
    _assert_equal(_hf(root / "gpt2-pp2-tr"), _hf(root / "gpt2-pp1-tr"))
    _assert_equal(_hf(root / "gpt2-pp2-hf"), _hf(root / "gpt2-pp2-tr"))
