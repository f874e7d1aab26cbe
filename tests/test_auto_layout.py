"""``parallelize(layout="auto")``, the stored layout, and the layout in checkpoints.

Single process: what ``layout=`` / ``hardware=`` / ``seq=`` / ``batch=`` refuse before any
work, the record's format, the GPU name → profile table.  World 2 (one launch, gloo): a
tiny Llama parallelized with ``layout="auto"`` applies exactly the layout
``plan_layout`` ranks first, on both ranks; trains to the unsplit model's losses; saves a
checkpoint that reports the layout back and still loads at another layout; the layout
applied again from its record is the same; the search runs on rank 0 only and its
failures reach every rank.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import CaseResults, global_step, refusal, run_cases

import tpcompile
import tpcompile.checkpoint as ckpt
from tpcompile.plan.layout import (
    LAYOUT_KEYS,
    Layout,
    layout_keywords,
    layout_record,
    layout_search,
    register_layout_search,
)
from tpcompile.tools.hardware import device_profile, get_profile, profile_for_device
from tpcompile.tools.layout import plan_layout
from tpcompile.tools.presets import build_meta_model_from_config, tiny_config

__all__: list[str] = []

SEQ = 16
LAYERS = 4
REL = 1e-5
LR = 1e-2


def _config() -> Any:
    return tiny_config("llama", num_hidden_layers=LAYERS)


def _build() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config())


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (2, SEQ), generator=g) for _ in range(3)]  # batch 2 = the default at world 2


# ------------------------------------------------------------------ single process


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"layout": "auto"}, r"needs seq="),
    ({"layout": "auto", "seq": 0}, r"seq must be an integer >= 1"),
    ({"layout": "auto", "seq": SEQ, "batch": True}, r"batch must be an integer >= 1"),
    ({"seq": SEQ}, r"seq= is read only with layout='auto'"),
    ({"hardware": "cpu", "batch": 4}, r"hardware=, batch= are read only with layout='auto'"),
    ({"layout": "auto", "seq": SEQ, "tp": 2, "pp": 2}, r"chooses the layout itself, but tp=, pp= were given"),
    ({"layout": "auto", "seq": SEQ, "dp_shard": 2}, r"but dp_shard= was given"),
    ({"layout": "auto", "seq": SEQ, "activation_checkpointing": True, "sharding_strategy": "NO_SHARD"},
     r"activation_checkpointing=, sharding_strategy="),
    ({"layout": "auto", "seq": SEQ, "plan": object()}, r"plan="),
    ({"layout": "tp2"}, r"layout must be 'auto', a Layout or a dict"),
    ({"layout": 2}, r"layout must be 'auto'"),
    ({"layout": {"tp": 2, "mixed_precision": "bf16"}}, r"'mixed_precision', which a layout does not set"),
    ({"layout": Layout(tp=2), "tp": 2}, r"layout= sets the degrees, but tp= was given"),
    ({"layout": {"tp": 2}, "seq": SEQ}, r"seq= is read only with layout='auto'"),
    ({"layout": "auto", "seq": SEQ}, r"initialized process group"),  # valid: the next check is the group
])
def test_layout_arguments_are_refused_before_any_work(kwargs: dict[str, Any], match: str) -> None:
    model = build_meta_model_from_config(_config())
    with pytest.raises(tpcompile.TPError, match=match):
        tpcompile.parallelize(model, **kwargs)
    assert not hasattr(model, "tpcompile_layout")


def test_a_stored_layout_is_read_back_as_keywords() -> None:
    lay = Layout(tp=2, pp=2, pp_schedule="1f1b", pp_microbatches=4, dp_shard=2, sequence_parallel=True)
    record = layout_record(lay.record_keywords(), source="layout", world=8)
    json.dumps(record)
    assert record["label"] == lay.label() == "tp2 pp2:1f1b/m4 dp_shard2 sp" and record["world"] == 8
    assert set(record["parallelize"]) == set(LAYOUT_KEYS)
    # a Layout, its record and the record's keywords give the same keywords; FP8 off is parallelize's None
    assert layout_keywords(lay) == layout_keywords(record) == layout_keywords(record["parallelize"])
    assert layout_keywords(lay)["fp8"] is None and layout_keywords(lay)["pp_microbatches"] == 4
    # without a pipeline nothing is scheduled; FP8 is stored as JSON (a recipe's name, or on)
    flat = layout_record({**lay.record_keywords(), "pp": 1, "pp_virtual": 2, "fp8": "rowwise"}, source="keywords",
                         world=4)
    kw = flat["parallelize"]
    assert (kw["pp_schedule"], kw["pp_microbatches"], kw["pp_virtual"], kw["fp8"]) == (None, None, 1, "rowwise")
    assert flat["label"] == "tp2 dp_shard2 sp fp8"


def test_gpu_names_map_to_built_in_profiles() -> None:
    assert profile_for_device("NVIDIA H100 80GB HBM3") == "h100-80gb"
    assert profile_for_device("NVIDIA H200") == "h200"
    assert profile_for_device("NVIDIA A100-SXM4-80GB") == "a100-80gb"
    assert profile_for_device("NVIDIA B200") == "b200"
    for other in ("NVIDIA A100-SXM4-40GB", "NVIDIA H100 PCIe", "NVIDIA GH200 480GB", "Tesla V100-SXM2-16GB"):
        with pytest.raises(tpcompile.TPError, match="hardware="):
            profile_for_device(other)
    assert device_profile("cpu") == "cpu"


def test_auto_without_the_tools_says_how_to_install_the_search() -> None:
    old = register_layout_search(None)
    try:
        with pytest.raises(tpcompile.TPError, match=r"`import tpcompile` installs"):
            layout_search()
    finally:
        register_layout_search(old)
    assert layout_search() is old is not None  # import tpcompile installed it


# ------------------------------------------------------------------ world 2


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _auto(rank: int, world: int, root: str) -> dict[str, Any]:
    log = logging.getLogger("tpcompile")
    lines, level = _Lines(), log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        model = tpcompile.parallelize(_build(), layout="auto", seq=SEQ, hardware="cpu")
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    cfg = model.tpcompile_parallel
    out: dict[str, Any] = {"record": model.tpcompile_layout, "log": lines.lines,
                           "applied": {k: getattr(cfg, k) for k in LAYOUT_KEYS if k not in ("pp_schedule",
                                                                                           "pp_microbatches")}}
    json.dumps(out["record"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = _batches()
    out["losses"] = [global_step(model, opt, ids) for ids in batches[:2]]
    ckpt.save(Path(root) / "auto", model, opt)
    out["saved"] = ckpt.saved_layout(Path(root) / "auto")
    # the stored layout is information: the checkpoint still loads at another one
    other = tpcompile.parallelize(_build(), tp=2, dp_shard=1)
    opt = torch.optim.AdamW(other.parameters(), lr=LR)
    ckpt.load(Path(root) / "auto", other, opt)
    out["resumed"] = global_step(other, opt, batches[2])
    out["other"] = other.tpcompile_layout
    again = tpcompile.parallelize(_build(), layout=model.tpcompile_layout["parallelize"])
    out["again"] = again.tpcompile_layout
    return out


def _transformed(rank: int, world: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2))
    return tpcompile.transform(model, tp=2).tpcompile_layout


def _failures(rank: int, world: int) -> dict[str, Any]:
    calls: list[dict[str, Any]] = []

    def stub(model: torch.nn.Module, **job: Any) -> dict[str, Any]:
        calls.append(job)
        raise tpcompile.TPError(f"stub saw gpus={job['gpus']} gpus_per_node={job['gpus_per_node']}")

    def boom(model: torch.nn.Module, **job: Any) -> dict[str, Any]:
        raise RuntimeError("boom")

    auto = {"layout": "auto", "seq": SEQ, "hardware": "cpu"}
    small = replace(get_profile("cpu"), name="tiny-memory", memory_bytes=200_000)
    out = {"no_fit": refusal(lambda: tpcompile.parallelize(_build(), layout="auto", seq=SEQ, hardware=small))}
    old = register_layout_search(stub)
    os.environ["LOCAL_WORLD_SIZE"] = "1"
    try:
        out["stub"] = refusal(lambda: tpcompile.parallelize(_build(), **auto))
        out["calls"] = len(calls)
        register_layout_search(boom)
        try:
            tpcompile.parallelize(_build(), **auto)
        except Exception as exc:  # noqa: BLE001 - which exception each rank sees is the point
            out["boom"] = f"{type(exc).__name__}: {exc}"
        register_layout_search(None)
        out["none"] = refusal(lambda: tpcompile.parallelize(_build(), **auto))
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
        register_layout_search(old)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> CaseResults:
    root = tmp_path_factory.mktemp("auto-layout")
    return run_cases(2, {"auto": (_auto, str(root)), "transform": (_transformed,), "failures": (_failures,)},
                     timeout=600)


@pytest.mark.slow  # one launch of 2 processes for every world-2 case below
def test_auto_applies_the_best_layout_on_every_rank(world2: CaseResults) -> None:
    best = plan_layout(_config(), gpus=2, hardware="cpu", seq=SEQ).best
    got = world2["auto"]
    assert got[0]["record"] == got[1]["record"]
    rec = got[0]["record"]
    assert rec["parallelize"] == best.layout.record_keywords() and rec["label"] == best.layout.label()
    assert (rec["source"], rec["hardware"], rec["gpus"], rec["seq"], rec["batch"], rec["world"]) == (
        "auto", "cpu", 2, SEQ, 2, 2)
    assert rec["predicted"]["step_seconds"] == pytest.approx(best.time["total"])
    assert rec["predicted"]["memory_bytes"] == pytest.approx(best.memory["total"])
    for r in got:  # what was applied is the layout, not just what was recorded
        want = best.layout.record_keywords()
        assert r["applied"] == {k: (want[k] if k != "fp8" else None) for k in r["applied"]}
        assert len(r["log"]) == 1 and best.layout.label() in r["log"][0] and "GiB per rank" in r["log"][0]


@pytest.mark.slow
def test_auto_trains_like_the_unsplit_model_and_checkpoints_its_layout(world2: CaseResults) -> None:
    model = _build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref = [global_step(model, opt, ids) for ids in _batches()]
    for r in world2["auto"]:
        assert r["losses"] == pytest.approx(ref[:2], rel=REL)
        assert r["saved"] == r["record"]  # the checkpoint reports the layout back
        assert r["resumed"] == pytest.approx(ref[2], rel=REL)  # and loads at tp=2 all the same
        assert r["other"]["parallelize"]["tp"] == 2 and r["other"]["source"] == "keywords"
        assert r["again"]["parallelize"] == r["record"]["parallelize"] and r["again"]["source"] == "layout"


@pytest.mark.slow
def test_transform_records_its_layout(world2: CaseResults) -> None:
    for rec in world2["transform"]:
        assert (rec["label"], rec["source"], rec["world"], rec["parallelize"]["tp"]) == ("tp2", "transform", 2, 2)


@pytest.mark.slow
def test_the_search_runs_on_rank_0_and_its_failures_reach_every_rank(world2: CaseResults) -> None:
    r0, r1 = world2["failures"]
    for r in (r0, r1):
        assert "no layout of" in r["no_fit"] and "needs" in r["no_fit"] and "usable" in r["no_fit"]
        assert r["stub"] == "stub saw gpus=2 gpus_per_node=1"  # LOCAL_WORLD_SIZE is the node
        assert "`import tpcompile` installs" in r["none"]
    assert r0["no_fit"] == r1["no_fit"]
    assert (r0["calls"], r1["calls"]) == (1, 0)
    assert r0["boom"] == "RuntimeError: boom" and r1["boom"] == "TPError: RuntimeError: boom"
