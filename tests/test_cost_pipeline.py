"""``dump-plan --pp``: the pipeline's stages priced (single process, meta models, no GPU).

What is checked against an independent number: p2p bytes against ``B/M x S x hidden x
4`` (fp32), the microbatches in flight against torch's own schedule IR, the per-stage
activations against the whole-model estimate they are a partition of, the parameter
bytes against the cost section's per-rank total.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from tpcompile.plan import plan_model
from tpcompile.plan.schedule import stage_idle_share
from tpcompile.tools import presets
from tpcompile.tools.cli import main
from tpcompile.tools.cost import estimate_activations
from tpcompile.tools.cost_params import memory
from tpcompile.tools.cost_pipeline import block_range, estimate_pipeline, in_flight, schedule_order

__all__: list[str] = []


def _tiny(name: str = "llama", **overrides: Any) -> nn.Module:
    config = presets.tiny_config(name, **{"num_hidden_layers": 4, **overrides})
    return presets.build_meta_model_from_config(config)


@pytest.fixture(scope="module")
def llama4() -> tuple[nn.Module, Any]:
    model = _tiny()
    return model, plan_model(model, 2)


def _tiny_config_file(tmp_path: Path, **overrides: Any) -> str:
    presets.tiny_config("llama", num_hidden_layers=4, **overrides).save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


def test_dump_plan_pp_prints_stages_and_bubble(capsys: pytest.CaptureFixture[str]) -> None:
    # 2 layers: fewer blocks than pp x pp_virtual, so the default schedule is 1f1b: 2 stages
    assert main(["dump-plan", "llama", "--tp", "2", "--layers", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    section = out[out.index("pipeline pp=2"):].splitlines()
    assert section[0].startswith("pipeline pp=2, schedule 1f1b (torch Schedule1F1B), 1 stage(s) per rank, "
                                 "4 microbatches")
    rows = [line.split() for line in section[3:5]]
    assert [r[:3] for r in rows] == [["0", "0", "model.layers.0"], ["1", "1", "model.layers.1"]]
    assert "model.embed_tokens" in section[3] and "model.norm, lm_head" in section[4]
    assert not section[5].startswith("  ")  # exactly two stage rows
    # the 32k-word head makes stage 1 3.4x stage 0 (0.436 / 1.487 GFLOP per token): stage 0
    # idles far beyond the balanced (pp - 1) / (m + pp - 1) = 20%
    flops = {int(r[0]): float(r[-4]) for r in rows}  # fwd GFLOP/token, before in flight and activations
    want = stage_idle_share("1f1b", 2, 1, 4, flops)  # from the FLOPs as printed (3 decimals)
    printed = float(out[out.index("bubble: ") + 8:].split("%")[0]) / 100
    assert abs(printed - want) < 2e-3 and printed > 0.3, (printed, want)
    assert "pp rank 1 (stages 1): memory" in out


def test_dump_plan_pp_json_section(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """p2p per microbatch = batch / M x seq x hidden x 4 bytes (fp32), each way."""
    batch, seq, m = 8, 32, 4
    code = main(["dump-plan", "--model", _tiny_config_file(tmp_path), "--tp", "2", "--pp", "2",
                 "--pp-schedule", "1f1b", "--pp-microbatches", str(m), "--batch", str(batch), "--seq", str(seq),
                 "--format", "json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    pipe = json.loads(captured.out)["pipeline"]
    assert (pipe["schedule"], pipe["microbatches"], pipe["microbatch"]) == ("1f1b", m, [batch // m, seq])
    p2p = pipe["p2p"]
    assert p2p["dtype"] == "float32" and p2p["hidden_shape"] == [batch // m, seq, 64]
    assert p2p["forward_bytes"] == p2p["backward_bytes"] == batch // m * seq * 64 * 4
    assert p2p["per_step_bytes"] == 2 * m * p2p["forward_bytes"]  # one boundary, both ways
    # the schedule replayed on the stages' FLOPs as listed (equal stages would give 1 / 5)
    flops = {i: s["flops_per_token"] for i, s in enumerate(pipe["stages"])}
    assert pipe["bubble"] == pytest.approx(stage_idle_share("1f1b", 2, 1, m, flops))
    assert [s["in_flight"] for s in pipe["stages"]] == [2, 1]  # min(M, pp - s)
    assert [s["blocks"] for s in pipe["stages"]] == ["model.layers.0-1", "model.layers.2-3"]
    assert [(s["embedding"], s["head"]) for s in pipe["stages"]] == [(True, False), (False, True)]


@pytest.mark.parametrize(("args", "message"), [
    (["--pp", "2", "--pp-schedule", "bogus"], "pp_schedule must be one of"),
    (["--pp", "8"], "needs 8 stages, but the model has only 4 blocks"),
    (["--pp", "2", "--pp-schedule", "interleaved_1f1b", "--pp-microbatches", "3"], "divisible by pp=2"),
    (["--pp", "2", "--batch", "6", "--seq", "16"], "does not split into 4 microbatches"),
    (["--pp-microbatches", "4"], "need --pp P"),
])
def test_dump_plan_pp_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump-plan", "llama", "--tp", "2", "--layers", "4", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.startswith("tpcompile: error: ")
    assert "Traceback" not in captured.err and captured.out == ""


@pytest.mark.parametrize(("args", "tokens"), [([], 64), (["--cp", "2"], 32), (["--sequence-parallel"], 32),
                                             (["--cp", "4", "--sequence-parallel"], 8)])
def test_dump_plan_pp_prices_the_hidden_state_as_it_crosses(args: list[str], tokens: int,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """With cp the boundary carries the rank's slice of the sequence (two of 2·cp chunks),
    with sequence parallelism that slice split over tp (the runtime's crossing shape is
    compared with this one at world 4 in test_pipeline)."""
    assert main(["dump-plan", "llama", "--tp", "2", "--layers", "4", "--pp", "2", "--batch", "4", "--seq", "64",
                 "--format", "json", *args]) == 0
    p2p = json.loads(capsys.readouterr().out)["pipeline"]["p2p"]
    assert p2p["hidden_shape"][:2] == [1, tokens]
    assert p2p["forward_bytes"] == tokens * p2p["hidden_shape"][2] * 2  # bf16


def test_large_vocabulary_moves_blocks_off_the_head_stage() -> None:
    """The head's ``2 x vocab x hidden`` FLOPs are priced on the last stage: with a small
    vocabulary 4 blocks split 2 / 2, with a large one the last stage keeps one block."""
    splits = {}
    for vocab in (256, 16384):
        model = _tiny(vocab_size=vocab)
        pipe = estimate_pipeline(model, plan_model(model, 1), pp=2, schedule="1f1b", microbatches=2)
        first, last = pipe["stages"]
        splits[vocab] = [len(s["block_list"]) for s in pipe["stages"]]
        head = 2 * vocab * 64
        per_block = first["flops_per_token"] / len(first["block_list"])  # no FLOPs in the embedding lookup
        assert last["flops_per_token"] == pytest.approx(per_block * len(last["block_list"]) + head)
    assert splits == {256: [2, 2], 16384: [3, 1]}


def test_activations_partition_the_whole_model_estimate(llama4: tuple[nn.Module, Any]) -> None:
    """Per microbatch, the stages' activations add up to the whole model's estimate at the
    microbatch's shape, plus one stage output (kept for backward) per boundary."""
    model, plan = llama4
    pipe = estimate_pipeline(model, plan, pp=2, schedule="interleaved_1f1b", virtual=2, microbatches=4,
                             batch=8, seq=16)
    whole = estimate_activations(model, plan, batch=2, seq=16)["bytes"]
    stages = pipe["stages"]
    assert len(stages) == 4 and [s["rank"] for s in stages] == [0, 1, 0, 1]
    hidden = pipe["p2p"]["forward_bytes"]
    assert sum(s["activation_bytes_per_microbatch"] for s in stages) == whole + 3 * hidden
    for s in stages:
        assert s["activation_bytes_in_flight"] == s["activation_bytes_per_microbatch"] * s["in_flight"]
    assert pipe["in_flight_rule"] == "replayed from torch ScheduleInterleaved1F1B"
    # a rank's peak is at most all its stages at their own peaks, at least the largest one
    for r in pipe["ranks"]:
        mine = [s["activation_bytes_in_flight"] for s in stages if s["rank"] == r["rank"]]
        assert max(mine) <= r["memory"]["activations"] <= sum(mine)


def test_parameter_bytes_are_per_rank(llama4: tuple[nn.Module, Any]) -> None:
    """Stages partition the (untied) parameters at the plan's TP shapes."""
    model, plan = llama4
    pipe = estimate_pipeline(model, plan, pp=2, schedule="1f1b")
    assert sum(s["param_bytes_per_rank"] for s in pipe["stages"]) == memory(model, plan, 1)["parameters"]
    assert sum(s["params"] for s in pipe["stages"]) == sum(p.numel() for p in model.parameters())
    assert pipe["p2p"]["bytes_per_token"] == 64 * 4 and pipe["p2p"]["forward_bytes"] is None


def test_tied_embedding_counts_on_both_stages() -> None:
    model = _tiny("gpt2", n_layer=4)
    pipe = estimate_pipeline(model, plan_model(model, 2), pp=2, schedule="1f1b")
    wte = 256 * 64
    total = sum(p.numel() for p in model.parameters())  # the tied tensor once
    assert sum(s["params"] for s in pipe["stages"]) == total + wte
    assert "lm_head" in pipe["stages"][-1]["modules"]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_single_stage_rules_match_torch_ir(name: str) -> None:
    """GPipe holds all M; 1F1B's stage s holds min(M, pp - s): torch's own IR agrees."""
    from torch.distributed.pipelining import schedules

    pp, m = 4, 6
    ours, _ = in_flight(schedule_order(name, pp, 1, m)[0])
    cls = schedules.ScheduleGPipe if name == "gpipe" else schedules.Schedule1F1B
    ir = cls._get_pipeline_order(SimpleNamespace(_num_stages=pp, _n_microbatches=m))
    order = {r: [(a.stage_index, a.computation_type.value) for a in ops if a is not None
                 and a.computation_type.value in "FB"] for r, ops in ir.items()}
    theirs, _ = in_flight(order)
    assert ours == theirs == {s: m if name == "gpipe" else min(m, pp - s) for s in range(pp)}


def test_every_schedule_is_replayed() -> None:
    for name, v, m in (("interleaved_1f1b", 2, 4), ("zero_bubble", 2, 4), ("zbv", 2, 4), ("dualpipev", 2, 8)):
        order, rule = schedule_order(name, 2, v, m)
        assert rule.startswith("replayed from torch"), name
        peaks, _ = in_flight(order)
        assert set(peaks) == {0, 1, 2, 3} and all(1 <= n <= m for n in peaks.values()), (name, peaks)
        for actions in order.values():  # every forward is freed by a backward
            assert sum(k == "F" for _, k in actions) == sum(k in "BW" for _, k in actions)


def test_block_range() -> None:
    assert block_range(["model.layers.4"]) == "model.layers.4"
    assert block_range([f"model.layers.{i}" for i in range(4, 8)]) == "model.layers.4-7"


def test_probe_runs_at_the_microbatch_shape(llama4: tuple[nn.Module, Any]) -> None:
    model, plan = llama4
    pipe = estimate_pipeline(model, plan, pp=2, schedule="gpipe", microbatches=2, batch=6, seq=8)
    assert pipe["p2p"]["hidden_shape"] == [3, 8, 64]
    assert [s["in_flight"] for s in pipe["stages"]] == [2, 2]
    assert torch.float32 == getattr(torch, pipe["p2p"]["dtype"])


def test_gradients_and_activations_peak_together_as_the_schedule_holds_them() -> None:
    """A stage's gradients exist from its first backward on: GPipe's peak is not all M
    microbatches plus all gradients (it runs every forward first), 1F1B's steady state
    holds both."""
    from tpcompile.tools.cost_pipeline import in_flight_parts

    held, grads = {0: 1.0, 1: 1.0}, {0: 10.0, 1: 10.0}
    _, _, gpipe = in_flight_parts(schedule_order("gpipe", 2, 1, 4)[0], held, grads)
    _, _, one = in_flight_parts(schedule_order("1f1b", 2, 1, 4)[0], held, grads)
    assert gpipe[0] == (3.0, 10.0)  # the first backward freed one microbatch and made the gradients
    assert one[0] == (2.0, 10.0)  # warm-up's two microbatches, again in flight beside the gradients
