"""The pipeline schedule simulator (:mod:`tpcompile.plan.schedule`): single process.

What it is held to, independently: the balanced-stage bubble ``(pp - 1) / (v M + pp - 1)``
of GPipe, 1F1B and interleaved 1F1B (Narayanan et al., 2021), a timeline worked by hand
for unequal stages, the zero-bubble family filling part of that bubble (with a weight pass
as long as the parameters' share of the backward), and an order that cannot finish
refused by name.
"""

from __future__ import annotations

import pytest

from tpcompile import TPError
from tpcompile.plan.schedule import (
    idle_share,
    simulate,
    simulate_stages,
    stage_idle_share,
    timed_order,
    weight_share,
)


@pytest.mark.parametrize(("name", "pp", "v", "m"), [("gpipe", 2, 1, 4), ("gpipe", 4, 1, 6), ("1f1b", 2, 1, 4),
                                                    ("1f1b", 4, 1, 8), ("interleaved_1f1b", 2, 2, 4),
                                                    ("interleaved_1f1b", 4, 2, 8), ("interleaved_1f1b", 2, 3, 6)])
def test_equal_stages_give_the_textbook_bubble(name: str, pp: int, v: int, m: int) -> None:
    n = pp * v
    got = stage_idle_share(name, pp, v, m, dict.fromkeys(range(n), 3.0))
    assert got == pytest.approx((pp - 1) / (v * m + pp - 1), abs=1e-12)


def test_unequal_stages_by_hand() -> None:
    # GPipe, 2 stages, 2 microbatches; stage 1 twice stage 0 (F 1 / 2, B 2 / 4):
    # rank 0: F 0-1, 1-2, then B at 9-11 and 13-15; rank 1: F 1-3, 3-5, B 5-9, 9-13
    runs = simulate(timed_order("gpipe", 2, 1, 2)[0], forward={0: 1.0, 1: 2.0}, backward={0: 2.0, 1: 4.0},
                    rank_of={0: 0, 1: 1})
    assert (runs[0].busy, runs[0].finish, runs[1].busy, runs[1].finish) == (6.0, 15.0, 12.0, 13.0)
    assert idle_share(runs) == pytest.approx(((1 - 6 / 15) + (1 - 12 / 15)) / 2)
    # a transfer costs its receiver a hop once both sides are there: rank 1's forwards start
    # at 1.5 and 4.0 (not 1 and 3), its backwards run 6-10 and 10-14; rank 0 receives
    # their gradients at 10.5 and 14.5
    hopped = simulate(timed_order("gpipe", 2, 1, 2)[0], forward={0: 1.0, 1: 2.0}, backward={0: 2.0, 1: 4.0},
                      rank_of={0: 0, 1: 1}, hop=0.5)
    assert (hopped[1].finish, hopped[0].finish) == (14.0, 16.5)
    assert (hopped[0].busy, hopped[1].busy) == (6.0, 12.0)  # the hops are idle time


def test_an_overlapped_group_sends_after_its_last_part() -> None:
    # rank 0 runs DualPipeV-style [F0.1 + B0.0] as one group: torch posts the group's sends
    # after both parts, so rank 1 gets F0.1 at 6 (not at 2, when it was computed):
    # rank 0: F0.0 0-1, F0.1 1-2, B0.0 4-6 (after rank 1's B1.0 2-4), B0.1 9-11;
    # rank 1: F1.0 1-2, B1.0 2-4, F1.1 6-7, B1.1 7-9
    order = {0: [[(0, "F", 0)], [(0, "F", 1), (0, "B", 0)], [(0, "B", 1)]],
             1: [[(1, "F", 0)], [(1, "B", 0)], [(1, "F", 1)], [(1, "B", 1)]]}
    runs = simulate(order, forward={0: 1.0, 1: 1.0}, backward={0: 2.0, 1: 2.0}, rank_of={0: 0, 1: 1})
    assert (runs[0].finish, runs[1].finish) == (11.0, 9.0)
    ungrouped = {0: [[(0, "F", 0)], [(0, "F", 1)], [(0, "B", 0)], [(0, "B", 1)]], 1: order[1]}
    runs = simulate(ungrouped, forward={0: 1.0, 1: 1.0}, backward={0: 2.0, 1: 2.0}, rank_of={0: 0, 1: 1})
    assert (runs[0].finish, runs[1].finish) == (9.0, 7.0)  # F1.1 at 4: sent as soon as computed


@pytest.mark.parametrize(("name", "m"), [("zero_bubble", 4), ("zbv", 4), ("dualpipev", 8)])
def test_split_backward_fills_the_bubble(name: str, m: int) -> None:
    # the weight gradients run in what would be idle: less than interleaved 1F1B's on the same stages
    stages = dict.fromkeys(range(4), 3.0)
    split = simulate_stages(name, 2, 2, m, stages)
    assert 0 < idle_share(split) < stage_idle_share("interleaved_1f1b", 2, 2, m, stages)
    assert all(run.busy == pytest.approx(3.0 * m * 2) for run in split.values())  # every action ran once


def test_weight_pass_share_of_the_backward() -> None:
    # weight gradients repeat the parameters' products once; the input gradients repeat them
    # and carry the products of two activations (attention) twice
    assert weight_share(10.0, 10.0) == 0.5  # all parameter products: half and half
    assert weight_share(6.0, 10.0) == pytest.approx(0.3)  # 4 of 10 FLOPs attention: B = 20, W = 6
    assert weight_share(6.0, 10.0, recompute=True) == pytest.approx(0.2)  # the recomputed forward is input-pass
    assert weight_share(0.0, 0.0) == 0.5


@pytest.mark.parametrize("name", ["zero_bubble", "zbv", "dualpipev"])
def test_a_longer_input_pass_delays_the_hand_off(name: str) -> None:
    stages = dict.fromkeys(range(4), 3.0)
    default = simulate_stages(name, 2, 2, 8, stages)
    half = simulate_stages(name, 2, 2, 8, stages, weight_shares=dict.fromkeys(range(4), 0.5))
    assert {r: (x.busy, x.finish) for r, x in default.items()} == {r: (x.busy, x.finish) for r, x in half.items()}
    # attention-heavy stages: the input pass (what the previous stage waits for) is longer,
    # the weight pass that fills the bubble shorter; the same work, more idle
    heavy = simulate_stages(name, 2, 2, 8, stages, weight_shares=dict.fromkeys(range(4), 0.3))
    assert all(heavy[r].busy == pytest.approx(default[r].busy) for r in default)
    assert idle_share(heavy) > idle_share(default)


def test_stage_costs_split_parameter_products_from_attention() -> None:
    import torch
    import transformers as hf

    from tpcompile.plan.stages import stage_costs

    cfg = hf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    with torch.device("meta"):
        model = hf.LlamaForCausalLM(cfg)
    costs = stage_costs(model, ["model.layers.0", "model.layers.1"], ["model.embed_tokens"], ["lm_head"], seq=32)
    matrices = sum(p.numel() for p in model.model.layers[0].parameters() if p.dim() == 2)
    assert costs["block_weight_flops"] == [2.0 * matrices] * 2
    assert costs["block_flops"] == [2.0 * matrices + 4.0 * 32 * 64] * 2
    assert costs["post_flops"] == 2.0 * 64 * 100 and costs["pre_flops"] == 0.0


def test_an_order_that_cannot_finish_is_refused() -> None:
    order = {0: [[(0, "B", 0)], [(0, "F", 0)]], 1: [[(1, "F", 0)], [(1, "B", 0)]]}  # backward before its forward
    with pytest.raises(TPError, match="cannot finish"):
        simulate(order, forward={0: 1.0, 1: 1.0}, backward={0: 2.0, 1: 2.0}, rank_of={0: 0, 1: 1})
