"""``plan_layout`` / ``dump-plan --auto`` and hardware profiles (single process, meta models).

What is checked against an independent number: a layout's parameters, gradients and
AdamW states against the cost section's per-rank memory for the same tp and FSDP2
degree (equal), its activations against the fake-tensor estimate at the rank's batch
(within 5%: the search scales one sequence's estimate), and its TP time on a link of
1 byte/s and no latency against the cost section's collective bytes (equal at tp=2,
where an all-reduce's ring moves its size once).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from tpcompile.errors import TPError
from tpcompile.tools import presets
from tpcompile.tools.cli import main
from tpcompile.tools.cost import estimate_activations, estimate_cost
from tpcompile.tools.cost_params import memory
from tpcompile.tools.hardware import (
    PROFILES,
    HardwareProfile,
    Link,
    get_profile,
    load_profile,
    save_profile,
)
from tpcompile.tools.layout import Layout, LayoutReport, Prediction, plan_layout, price_layouts

__all__: list[str] = []

_SEQ = 64


def _tiny(name: str = "llama", **overrides: Any) -> nn.Module:
    return presets.build_meta_model_from_config(presets.tiny_config(name, **{"num_hidden_layers": 2, **overrides}))


@pytest.fixture(scope="module")
def llama() -> nn.Module:
    return _tiny()


@pytest.fixture(scope="module")
def report4(llama: nn.Module) -> LayoutReport:
    return plan_layout(llama, gpus=4, hardware="h100-80gb", batch=8, seq=_SEQ, top=100)


def _find(report: LayoutReport, **degrees: Any) -> Prediction:
    """The fastest ranked layout with these degrees (the others at their defaults)."""
    want = {"pp": 1, "cp": 1, "ep": 1, "sequence_parallel": False, "activation_checkpointing": False, "fp8": False,
            **degrees}
    dp = want.pop("dp", None)
    for p in report.ranked:
        lay = p.layout
        if all(getattr(lay, k) == v for k, v in want.items()) and dp in (None, lay.dp_shard * lay.dp_replicate):
            return p
    raise AssertionError(f"no ranked layout with {degrees}")


# ------------------------------------------------------------------ profiles


def test_profiles_round_trip(tmp_path: Path) -> None:
    for name, profile in PROFILES.items():
        path = tmp_path / f"{name}.json"
        save_profile(profile, path)
        assert load_profile(path) == profile
        assert get_profile(str(path)) == profile  # a file is a profile too
        assert profile.intra_node.bandwidth >= profile.inter_node.bandwidth
    h100 = get_profile("h100-80gb")
    assert h100.achievable("bf16") == pytest.approx(0.5 * 989e12) and h100.peak("fp8") == pytest.approx(1979e12)
    assert get_profile("a100-80gb").achievable("fp8") == 0.0  # no FP8 tensor cores
    with pytest.raises(TPError, match="h100-80gb"):
        get_profile("tpu-v9")
    with pytest.raises(TPError, match="version"):
        HardwareProfile.from_dict({**h100.to_dict(), "version": 99})
    with pytest.raises(TPError, match="dtype"):
        replace(h100, peak_flops={"int4": 1.0})


# ------------------------------------------------------------------ the search


def test_ranks_layouts_that_multiply_to_gpus_and_fit(report4: LayoutReport) -> None:
    assert report4.ranked and report4.fitting == len(report4.ranked)
    times = [round(p.time["total"], 9) for p in report4.ranked]  # equal times: less memory first
    assert times == sorted(times)
    for p in report4.ranked:
        lay = p.layout
        assert lay.world == 4 and p.fits
        assert p.memory["total"] <= report4.usable_memory
        assert math.isclose(p.time["total"], sum(v for k, v in p.time.items() if k != "total"))
        assert 0 < p.mfu < 0.5  # below the achievable fraction of the profile
        assert lay.parallelize_kwargs()["tp"] == lay.tp
    # one row per layout: its best pipeline schedule and split of dp into shards x replicas
    seen = {(p.layout.tp, p.layout.pp, p.layout.cp, p.layout.dp_shard * p.layout.dp_replicate) for p in report4.ranked}
    assert {(1, 1, 1, 4), (2, 1, 1, 2), (4, 1, 1, 1), (1, 2, 1, 2), (2, 2, 1, 1), (1, 1, 2, 2)} <= seen
    assert len(seen) * 2 <= len(report4.ranked)  # activation checkpointing and SP variants too
    assert any(p.layout.sequence_parallel for p in report4.ranked)  # tiny llama: SP splits its stack
    assert _find(report4, tp=1, pp=2, dp=2).layout.pp_schedule in ("1f1b", "gpipe")
    assert any("2 blocks" in why for why in report4.refused)  # pp=4 needs 4 stages
    assert report4.to_dict()["ranked"][0]["label"] == report4.best.layout.label()
    json.dumps(report4.to_dict())  # JSON-able


def test_prices_agree_with_the_cost_section(llama: nn.Module) -> None:
    # a link of 1 byte/s without latency: seconds = bytes on the wire
    unit = HardwareProfile(name="unit", peak_flops={"bf16": 1.0}, achievable_flops={"bf16": 1.0}, memory_bytes=1e15,
                           intra_node=Link(bandwidth=1.0, latency=0.0), inter_node=Link(bandwidth=1.0, latency=0.0))
    report = plan_layout(llama, gpus=4, hardware=unit, batch=8, seq=_SEQ, top=1000, headroom=0.0)
    p = _find(report, tp=2, dp_shard=2, dp_replicate=1)
    from tpcompile import plan_model

    plan = plan_model(llama, 2)
    mem = memory(llama, plan, 2)
    assert (p.memory["parameters"], p.memory["gradients"], p.memory["optimizer"]) == (
        mem["parameters"], mem["gradients"], mem["adamw_states"])
    acts = estimate_activations(llama, plan, batch=4, seq=_SEQ)["bytes"]  # 8 sequences over dp 2
    assert p.memory["activations"] == pytest.approx(acts, rel=0.05)
    cost = estimate_cost(llama, plan, batch=4, seq=_SEQ)
    wire = sum(v["bytes"] for phase in cost["per_step"].values() for v in phase.values())
    assert p.time["tp"] == pytest.approx(wire)
    # compute at 1 FLOP/s: forward + backward = 3 x the forward FLOPs of 8 sequences over 4 ranks
    from tpcompile.plan.stages import stage_costs

    c = stage_costs(llama, ["model.layers.0", "model.layers.1"], ["model.embed_tokens"], ["model.norm", "lm_head"],
                    _SEQ)
    assert p.time["compute"] == pytest.approx(3 * (sum(c["block_flops"]) + c["post_flops"]) * 8 * _SEQ / 4)
    assert _find(report, tp=2, dp_shard=2, activation_checkpointing=True).time["compute"] == pytest.approx(
        p.time["compute"] + sum(c["block_flops"]) * 8 * _SEQ / 4)  # + one forward of the blocks


def test_impossible_memory_budget_reports_does_not_fit(llama: nn.Module) -> None:
    small = replace(get_profile("h100-80gb"), name="tiny-memory", memory_bytes=200_000)
    report = plan_layout(llama, gpus=4, hardware=small, batch=8, seq=_SEQ)
    assert report.ranked == [] and report.best is None and report.unfit_count > 0
    text = report.render()
    assert "do not fit in memory" in text and "no layout fits" in text
    assert all(not p.fits and p.memory["total"] > report.usable_memory for p in report.unfit)


def test_gpus_per_node_changes_nothing_for_tp_within_the_node(llama: nn.Module, report4: LayoutReport) -> None:
    narrow = plan_layout(llama, gpus=4, hardware="h100-80gb", batch=8, seq=_SEQ, top=100, gpus_per_node=2)
    base = {p.layout: p for p in report4.ranked}
    both = [p for p in narrow.ranked if p.layout in base and p.layout.tp == 2]
    assert both
    for p in both:  # tp=2 stays inside a node of 2: its time and memory are the same
        assert p.time["tp"] == base[p.layout].time["tp"] and p.memory == base[p.layout].memory
        assert "tp" not in p.inter_node
    # what crosses nodes now is slower: FSDP2 / replicas over 2 nodes of 2
    crossing = [p for p in both if p.inter_node]
    assert crossing and all(p.time["total"] > base[p.layout].time["total"] for p in crossing)
    assert all(not base[p.layout].inter_node for p in crossing)


def test_experts_are_searched_for_a_moe_model() -> None:
    model = _tiny("mixtral")  # float32: torch's meta grouped matmul wants bf16, the estimate runs it anyway
    report = plan_layout(model, gpus=4, hardware="h100-80gb", batch=8, seq=_SEQ, top=1000)
    eps = {p.layout.ep for p in report.ranked}
    assert eps == {1, 2, 4}  # 4 experts: ep divides them and dp_shard
    for p in report.ranked:
        if p.layout.ep > 1:
            assert p.time["ep"] > 0 and p.layout.dp_shard % p.layout.ep == 0
    # every parallelism composes with pp: experts inside pipeline stages are searched too
    assert any(p.layout.ep > 1 and p.layout.pp > 1 for p in report.ranked)


def test_price_layouts_prices_as_the_search_does(llama: nn.Module, report4: LayoutReport) -> None:
    ranked = report4.ranked[:5]
    again = price_layouts(llama, [p.layout for p in ranked], gpus=4, hardware="h100-80gb", batch=8, seq=_SEQ)
    assert [(p.time, p.memory) for p in again] == [(p.time, p.memory) for p in ranked]
    with pytest.raises(TPError, match="tp3 dp_shard2 is not one the search admits"):
        price_layouts(llama, [Layout(tp=3, dp_shard=2)], gpus=6, hardware="h100-80gb", batch=6, seq=_SEQ)
    with pytest.raises(TPError, match="at least one"):
        price_layouts(llama, [], gpus=4, hardware="h100-80gb", seq=_SEQ)


def test_overlap_and_shared_compute_change_what_is_exposed(llama: nn.Module) -> None:
    h100 = get_profile("h100-80gb")
    slow = Link(bandwidth=1e9, latency=1e-5)  # FSDP2's traffic comparable to the compute
    base = replace(h100, intra_node=slow, inter_node=slow)
    fsdp, pipe = Layout(dp_shard=4), Layout(pp=2, pp_schedule="1f1b", pp_microbatches=4, dp_shard=2)
    job = {"gpus": 4, "batch": 8, "seq": _SEQ}
    full, half, none = (price_layouts(llama, [fsdp, pipe], hardware=replace(base, comm_overlap=c), **job)
                        for c in (1.0, 0.5, 0.0))
    fs = full[0].time
    assert none[0].time["fsdp_exposed"] > fs["fsdp_exposed"]  # nothing hides: all of FSDP2's traffic is exposed
    # what hides is the overlap share of the hideable part: linear in the share
    assert half[0].time["fsdp_exposed"] == pytest.approx((fs["fsdp_exposed"] + none[0].time["fsdp_exposed"]) / 2)
    assert none[0].time["compute"] == fs["compute"]
    # ranks sharing cores: a pipeline's idle ranks lend theirs, so its bubble shrinks, to none at 2x
    bubble = full[1].time["bubble"]
    less = price_layouts(llama, [pipe], hardware=replace(base, solo_flops={"bf16": 1.1 * base.achievable("bf16")}),
                         **job)[0].time["bubble"]
    gone = price_layouts(llama, [pipe], hardware=replace(base, solo_flops={"bf16": 4 * base.achievable("bf16")}),
                         **job)[0].time["bubble"]
    assert bubble > less > gone == 0.0
    # per collective links: a slow reduce-scatter costs FSDP2, not TP without SP
    slow_gather = replace(slow, ops={"reduce_scatter": [1e7, 1e-5]})
    gathered = price_layouts(llama, [fsdp, Layout(tp=4)], hardware=replace(base, intra_node=slow_gather,
                                                                            inter_node=slow_gather), **job)
    assert gathered[0].time["fsdp_exposed"] > fs["fsdp_exposed"]
    assert gathered[1].time["tp"] == price_layouts(llama, [Layout(tp=4)], hardware=base, **job)[0].time["tp"]
    # sequence parallelism runs each TP all-reduce as an all-gather and a reduce-scatter: as
    # dear on one link (NCCL's bus-bandwidth convention), dearer where all-gathers are slow (gloo)
    tp4, sp4 = Layout(tp=4), Layout(tp=4, sequence_parallel=True)
    even = price_layouts(llama, [tp4, sp4], hardware=base, **job)
    assert even[1].time["tp"] == pytest.approx(even[0].time["tp"])
    slow_ag = replace(slow, ops={"all_gather": [1e8, 1e-5]})
    uneven = price_layouts(llama, [tp4, sp4], hardware=replace(base, intra_node=slow_ag, inter_node=slow_ag), **job)
    # (TP alone all-gathers the LM head's logits: it pays too, a fraction of SP's extra)
    assert uneven[1].time["tp"] - even[1].time["tp"] > 2 * (uneven[0].time["tp"] - even[0].time["tp"]) > 0
    # the pipeline runtime's own share of a hand-off: 1F1B at pp=2, M=4 makes one per microbatch at
    # least on its critical path (here, compute next to nothing, about five); only the pipeline pays it
    slower = price_layouts(llama, [fsdp, pipe], hardware=replace(base, pp_handoff=1e-3), **job)
    assert slower[1].time["p2p"] - full[1].time["p2p"] >= 4e-3, (slower[1].time, full[1].time)
    assert slower[0].time == fs


def test_profile_fields_are_checked_and_round_trip(tmp_path: Path) -> None:
    hw = replace(get_profile("cpu"), comm_overlap=0.25, solo_flops={"fp32": 1e11}, pp_handoff=2e-3,
                 intra_node=Link(bandwidth=1e9, latency=1e-4, ops={"all_gather": [2e8, 3e-4]}))
    save_profile(hw, tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json") == hw
    assert hw.intra_node.for_op("all_gather_into_tensor") == (2e8, 3e-4)
    assert hw.intra_node.for_op("all_reduce") == (1e9, 1e-4) and hw.solo("fp32") == 1e11
    assert hw.solo("bf16") == hw.achievable("bf16")  # nothing shared: the achievable rate
    with pytest.raises(TPError, match="comm_overlap"):
        replace(hw, comm_overlap=1.5)
    with pytest.raises(TPError, match="pp_handoff"):
        replace(hw, pp_handoff=-1.0)
    with pytest.raises(TPError, match="ops are"):
        Link(bandwidth=1.0, latency=0.0, ops={"gather": [1.0, 0.0]})
    with pytest.raises(TPError, match="bandwidth > 0"):
        Link(bandwidth=1.0, latency=0.0, ops={"p2p": [0.0, 0.0]})


def test_layout_kwargs_name_parallelize_arguments() -> None:
    import inspect

    from tpcompile import parallelize

    lay = Layout(tp=2, pp=2, pp_schedule="interleaved_1f1b", pp_microbatches=8, pp_virtual=2, dp_shard=2,
                 activation_checkpointing=True, fp8=True)
    kwargs = lay.parallelize_kwargs()
    assert set(kwargs) <= set(inspect.signature(parallelize).parameters)
    assert kwargs["pp_virtual"] == 2 and kwargs["fp8"] is True and lay.world == 8
    assert lay.label() == "tp2 pp2:interleaved_1f1bx2/m8 dp_shard2 ac fp8"


def test_errors_are_named(llama: nn.Module) -> None:
    with pytest.raises(TPError, match="gpus"):
        plan_layout(llama, gpus=0, hardware="h100-80gb", seq=_SEQ)
    with pytest.raises(TPError, match="fp32|dtype"):
        plan_layout(llama, gpus=2, hardware=replace(get_profile("cpu"), achievable_flops={"bf16": 1.0}),
                    seq=_SEQ, dtype="fp32")


# ------------------------------------------------------------------ the CLI


def test_dump_plan_auto_prints_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    presets.tiny_config("llama", num_hidden_layers=2).save_pretrained(tmp_path)
    args = ["dump-plan", "--model", str(tmp_path / "config.json"), "--auto", "--gpus", "4", "--hardware",
            "h100-80gb", "--batch", "8", "--seq", str(_SEQ), "--top", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("#"))
    assert "memory/rank" in lines[header] and "MFU" in lines[header] and "vs best" in lines[header]
    rows = lines[header + 2: header + 5]
    assert rows[0].split()[0] == "1" and rows[0].rstrip().endswith("best") and "+" in rows[1]
    assert "best: " in out and "parallelize(tp=" in out and "why the others lost:" in out


def test_dump_plan_auto_flag_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump-plan", "llama", "--auto", "--tp", "2", "--gpus", "4", "--hardware", "cpu", "--seq", "8"]) == 2
    assert "drop --tp" in capsys.readouterr().err
    assert main(["dump-plan", "llama", "--auto", "--gpus", "4"]) == 2
    assert "--hardware" in capsys.readouterr().err
    assert main(["dump-plan", "llama", "--gpus", "4"]) == 2
    assert "only read with --auto" in capsys.readouterr().err


@pytest.mark.slow  # spawns 2 processes (~20-40 s on a loaded 2-core host)
def test_calibrate_measures_positive_links(tmp_path: Path) -> None:
    from tpcompile.tools.calibration import calibrate

    hw = calibrate(procs=2, sizes=(4096, 1 << 20), repeats=3, seconds_per_dtype=0.05, threads=1)
    assert hw.intra_node.bandwidth > 0 and hw.intra_node.latency > 0
    assert hw.achievable("fp32") > 0 and hw.memory_bytes > 0 and 0.0 <= hw.comm_overlap <= 1.0
    assert hw.solo("fp32") >= hw.achievable("fp32") and hw.measurements["threads"] == 1
    # a GPipe step of two idle stages, M=8: 16 hand-offs in a row; the runtime's share is what the transfer leaves
    hand = hw.measurements["pp_handoff"]
    assert hand["span"] == 16 and hand["wall"] > 0 and 0 <= hw.pp_handoff <= hand["hop"]
    for op in ("all_reduce", "all_gather", "reduce_scatter", "p2p"):
        m = hw.measurements["collectives"][op]
        assert m["bus_bandwidth"] > 0 and m["latency"] > 0
        if op != "all_reduce":  # the link's own pair is the all-reduce's; every other its own
            assert hw.intra_node.for_op(op) == (m["bus_bandwidth"], m["latency"])
    save_profile(hw, tmp_path / "me.json")
    assert load_profile(tmp_path / "me.json") == hw
