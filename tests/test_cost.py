"""dump-plan's cost section against a real training step with every collective counted.

The prediction (``tpcompile.tools.estimate_cost`` on a meta-device copy, no process
group) must equal, per rank, the collectives one forward + backward actually issues
(after two warm-up steps, so one-time work is not counted), and the eval step
(``no_grad`` forwards with and without labels; the first two add the input guard's
all-gather) equals dump-plan's ``eval_step`` and ``input_guard``:
every ``torch.distributed`` function the code can reach is wrapped and counted, with
the bytes of the tensor the rank passes in; a dispatch mode counts the same step's
``c10d`` ops, so a collective that bypassed the wrappers would show up as a mismatch.
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import Collectives, run_distributed

import tpcompile
from tpcompile.errors import TPError
from tpcompile.tools import presets
from tpcompile.tools.cost import COLLECTIVES, estimate_activations, estimate_cost, trace_collectives

BATCH, SEQ = 2, 16
_WARMUP = 2  # steps before the counted one (lazy init, first-forward input checks)

# torch.distributed name -> (reported name, the argument that is "the tensor passed in")
_COUNTED: dict[str, tuple[str, int | str]] = {
    "all_reduce": ("all_reduce", 0),
    "all_gather": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather_into_tensor", 1),
    "all_gather_single": ("all_gather_into_tensor", 1),  # torch >= 2.13's name; FSDP2 calls it
    "reduce_scatter_tensor": ("reduce_scatter_tensor", 1),
    "reduce_scatter_single": ("reduce_scatter_tensor", "input"),
    "all_to_all_single": ("all_to_all_single", 1),
    "broadcast": ("broadcast", 0),
}
# reachable but never expected in a training step: counted, must stay zero
_UNEXPECTED = ("reduce_scatter", "all_to_all", "reduce", "gather", "scatter", "send", "recv", "isend",
               "irecv", "barrier", "all_gather_object", "broadcast_object_list", "all_reduce_coalesced",
               "batch_isend_irecv")


def _tensor_arg(args: tuple, kwargs: dict, where: int | str) -> torch.Tensor:
    if isinstance(where, str):
        return kwargs[where] if where in kwargs else args[1]
    names = {0: ("tensor",), 1: ("input_tensor", "tensor", "input")}[where]
    return args[where] if len(args) > where else next(kwargs[n] for n in names if n in kwargs)


@contextlib.contextmanager
def _counting(log: dict[str, list[int]]) -> Iterator[None]:
    """Wrap the torch.distributed functions; ``log[name]`` collects bytes per call."""
    saved = {}

    def wrap(fname: str, report: str, where: int | str | None) -> None:
        original = getattr(dist, fname)
        saved[fname] = original

        @functools.wraps(original)
        def counted(*args: Any, **kwargs: Any) -> Any:
            nbytes = 0 if where is None else _tensor_arg(args, kwargs, where)
            log[report].append(0 if where is None else nbytes.numel() * nbytes.element_size())
            return original(*args, **kwargs)

        setattr(dist, fname, counted)

    try:
        for fname, (report, where) in _COUNTED.items():
            wrap(fname, report, where)
        for fname in _UNEXPECTED:
            if hasattr(dist, fname):
                wrap(fname, fname, None)
        yield
    finally:
        for fname, fn in saved.items():
            setattr(dist, fname, fn)


def _build(name: str, overrides: dict, meta: bool = False) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    # mamba: a re-entering row (x_proj), its output's gradient all-reduced too; olmo2:
    # q_norm / k_norm over all heads, partial statistics all-reduced forward and backward;
    # dbrx: experts looped over, one all-reduce per MoE layer each way
    if name in ("mamba", "olmo2", "dbrx"):
        from families import build

        return build(name, meta=meta).train()
    torch.manual_seed(0)
    if name == "vit":  # no token ids: priced per image
        from transformers import ViTConfig, ViTForImageClassification

        cfg = ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        image_size=16, patch_size=4, num_labels=10)
        with torch.device("meta") if meta else contextlib.nullcontext():
            return ViTForImageClassification(cfg)
    auto = AutoModelForMaskedLM if name == "bert" else AutoModelForCausalLM
    with torch.device("meta") if meta else contextlib.nullcontext():
        return auto.from_config(presets.tiny_config(name, **overrides))


def _batch(name: str, seed: int) -> tuple[dict, dict]:
    """A step's inputs with labels, and without them."""
    gen = torch.Generator().manual_seed(seed)
    if name == "vit":
        pixels = torch.randn(BATCH, 3, 16, 16, generator=gen)
        return {"pixel_values": pixels, "labels": torch.randint(0, 10, (BATCH,), generator=gen)}, \
            {"pixel_values": pixels}
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids}, {"input_ids": ids}


def _predicted(name: str, overrides: dict, tp: int, dp_shard: int, loss_parallel: bool) -> dict:
    model = _build(name, overrides)  # a fresh, untransformed copy: no process group needed
    plan = tpcompile.plan_model(model, tp, loss_parallel=loss_parallel)
    cost = estimate_cost(model, plan, batch=BATCH, seq=None if name == "vit" else SEQ, dp_shard=dp_shard)
    out = {phase: {op: (v["count"], v["bytes"]) for op, v in ops.items() if v["count"]}
           for phase, ops in (*cost["per_step"].items(), *cost["eval_step"].items())}
    out["guard"] = cost["input_guard"]
    return out


def _step(rank: int, world: int, cases: list[tuple]) -> list[tuple[dict, dict, dict]]:
    """Per case: (predicted, counted by the wrappers, counted at the dispatcher)."""
    out = []
    for name, overrides, tp, dp_shard, loss_parallel in cases:
        model = _build(name, overrides)
        if dp_shard > 1:
            tpcompile.parallelize(model, tp=tp, dp_shard=dp_shard)
        else:
            tpcompile.transform(model, tp=tp, loss_parallel=loss_parallel)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        dp_rank = tpcompile.data_parallel_rank(model)[0] if dp_shard > 1 else 0
        labelled, bare = _batch(name, dp_rank)
        for _ in range(_WARMUP):  # a step's cost is the steady state's: no one-time work
            model(**labelled).loss.backward()
            opt.step()
            opt.zero_grad()
        counted: dict[str, dict[str, tuple[int, int]]] = {}
        debug: dict[str, int] = {}
        for phase in ("forward", "backward", "step"):
            log: dict[str, list[int]] = defaultdict(list)
            with _counting(log), Collectives() as mode:
                if phase == "forward":
                    loss = model(**labelled).loss
                elif phase == "backward":
                    loss.backward()
                else:
                    opt.step()
            counted[phase] = {op: (len(v), sum(v)) for op, v in log.items() if v}
            debug[phase] = mode.count
        out.append((_predicted(name, overrides, tp, dp_shard, loss_parallel), counted, debug,
                    _eval_steps(model, labelled, bare)))
        dist.barrier()
    return out


def _eval_steps(model: torch.nn.Module, labelled: dict, bare: dict) -> list[tuple[str, dict, int]]:
    """Eval forwards under ``no_grad`` as an evaluation loop runs them: the first two with
    labels are the input guard's (its all-gather on top), the third is the steady state;
    then one without labels (no loss)."""
    model.eval()
    out = []
    with torch.no_grad():
        for kind in ("guarded", "guarded", "labels", "no_labels"):
            log: dict[str, list[int]] = defaultdict(list)
            with _counting(log), Collectives() as mode:
                model(**bare) if kind == "no_labels" else model(**labelled)
            out.append((kind, {op: (len(v), sum(v)) for op, v in log.items() if v}, mode.count))
    model.train()
    return out


_TP_CASES = [
    ("llama", {}, 2, 1, False),
    ("llama", {}, 2, 1, True),  # loss_parallel
    ("llama", {"num_key_value_heads": 1}, 2, 1, False),  # KV head replicated on both ranks
    ("qwen3", {}, 2, 1, False),  # q_norm / k_norm: replicated, gradients all-reduced
    ("gpt2", {}, 2, 1, False),
    ("mixtral", {}, 2, 1, False),
    ("bert", {}, 2, 1, False),
    ("mamba", {}, 2, 1, False),
    ("olmo2", {}, 2, 1, False),
    ("dbrx", {}, 2, 1, False),  # an expert loop's module: its parent is the TP region
    ("vit", {}, 2, 1, False),  # no token ids: a step priced per image
    ("llama", {}, 1, 2, False),  # FSDP2 alone (parallelize at tp=1, dp_shard=2)
]
_FSDP_CASES = [(name, {}, 2, 2, False) for name in ("llama", "gpt2", "mixtral", "bert")]


def _check(results: list[list[tuple[dict, dict, dict]]], cases: list[tuple]) -> None:
    for rank_results in results:
        for case, (predicted, counted, debug, evals) in zip(cases, rank_results, strict=True):
            _check_eval(case, predicted, evals)
            assert counted["step"] == {}, (case, counted["step"])  # AdamW on DTensors: local
            for phase in ("forward", "backward"):
                assert set(counted[phase]) <= set(COLLECTIVES), (case, phase, counted[phase])
                assert predicted[phase] == counted[phase], (case, phase, predicted[phase], counted[phase])
                # nothing reached the process group around the wrappers
                assert debug[phase] == sum(c for c, _ in counted[phase].values()), (case, phase, debug)


def _check_eval(case: tuple, predicted: dict, evals: list[tuple[str, dict, int]]) -> None:
    """Every eval forward against dump-plan's eval step; the guarded ones add the input
    guard's all-gather (tp > 1), the forwards after them are the eval step exactly."""
    guard = predicted["guard"]
    assert guard["forwards"] == (2 if case[2] > 1 else 0), (case, guard)
    for i, (kind, counted, dispatched) in enumerate(evals):
        want = dict(predicted["no_labels" if kind == "no_labels" else "labels"])
        if kind == "guarded" and guard["forwards"] > i:
            n, b = want.get("all_gather", (0, 0))
            want["all_gather"] = (n + guard["all_gather"]["count"], b + guard["all_gather"]["bytes"])
        assert counted == want, (case, i, kind, counted, want)
        assert dispatched == sum(c for c, _ in counted.values()), (case, kind, dispatched)


@pytest.mark.slow
def test_cost_equals_counted_collectives_world2() -> None:
    results = run_distributed(_step, 2, _TP_CASES)
    _check(results, _TP_CASES)
    llama = results[0][0][1]
    # the issue's numbers: forward 7 all-reduce + 1 all-gather, backward 2 per block + 1
    assert llama["forward"]["all_reduce"][0] == 7 and llama["forward"]["all_gather"][0] == 1
    assert llama["backward"]["all_reduce"][0] == 5


@pytest.mark.slow
def test_cost_equals_counted_collectives_world4_dp2_tp2() -> None:
    results = run_distributed(_step, 4, _FSDP_CASES)
    _check(results, _FSDP_CASES)
    fsdp_ops = results[0][0][1]["backward"]
    assert "reduce_scatter_tensor" in fsdp_ops and "all_gather_into_tensor" in fsdp_ops


def test_shared_inputs_come_from_the_graph() -> None:
    model = _build("llama", {}, meta=True)
    _, shared = trace_collectives(model, tpcompile.plan_model(model, 2))
    assert shared == {
        "model.layers.0.self_attn.k_proj": "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj": "model.layers.0.self_attn.q_proj",
        "model.layers.0.mlp.up_proj": "model.layers.0.mlp.gate_proj",
    }


class _Normed(torch.nn.Module):
    """Batch norm over split channels between a column and a row, on token ids."""

    def __init__(self) -> None:
        super().__init__()
        self.t = torch.nn.Embedding(256, 64)
        self.up = torch.nn.Linear(64, 128)
        self.norm = torch.nn.BatchNorm1d(128)
        self.down = torch.nn.Linear(128, 64)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.up(self.t(input_ids)).transpose(1, 2)
        return self.down(torch.relu(self.norm(h)).transpose(1, 2))


def test_running_statistics_gathered_back_are_priced_in_training_only() -> None:
    with torch.device("meta"):
        model = _Normed()
    plan = tpcompile.plan_model(model, 2)
    issues, _ = trace_collectives(model, plan)
    gathered = sorted((i.what, i.op, i.phase, i.fixed_bytes, i.training) for i in issues if i.source == "norm")
    # each rank's 64 rows of each statistic (float32), all-gathered after a training forward
    assert gathered == [("updated buffer running_mean", "all_gather", "forward", 256, True),
                        ("updated buffer running_var", "all_gather", "forward", 256, True)]
    cost = estimate_cost(model, plan, batch=BATCH, seq=SEQ)
    assert cost["per_step"]["forward"]["all_gather"]["count"] == 2
    assert cost["eval_step"]["labels"]["all_gather"]["count"] == 0  # eval leaves the statistics alone


def test_cost_without_tokens_is_per_token() -> None:
    model = _build("llama", {}, meta=True)
    plan = tpcompile.plan_model(model, 2)
    per_token = estimate_cost(model, plan)
    fixed = estimate_cost(model, plan, batch=BATCH, seq=SEQ)
    for phase in ("forward", "backward"):
        for op, v in per_token["per_step"][phase].items():
            want = fixed["per_step"][phase][op]
            assert v["count"] == want["count"]
            assert v["bytes_per_token"] * BATCH * SEQ + v["fixed_bytes"] == want["bytes"]
    assert per_token["memory_per_rank"]["activations"] is None
    assert fixed["memory_per_rank"]["activations"] > 0


def test_a_model_without_token_ids_is_priced_per_sample() -> None:
    from tpcompile.tools.cost_render import render_summary

    model = _build("vit", {}, meta=True)
    plan = tpcompile.plan_model(model, 2)
    per_sample = estimate_cost(model, plan)
    fixed = estimate_cost(model, plan, batch=BATCH)
    assert per_sample["unit"] == fixed["unit"] == "sample"
    for phase in ("forward", "backward"):
        for op, v in per_sample["per_step"][phase].items():
            assert v["bytes_per_token"] * BATCH + v["fixed_bytes"] == fixed["per_step"][phase][op]["bytes"]
    assert fixed["memory_per_rank"]["activations"] > 0
    assert f"{BATCH} samples per rank" in render_summary(fixed) and "/sample" in render_summary(per_sample)
    with pytest.raises(TPError, match="without seq"):
        estimate_cost(model, plan, batch=BATCH, seq=SEQ)


def test_memory_per_rank_shards_with_fsdp() -> None:
    model = _build("llama", {}, meta=True)
    plan = tpcompile.plan_model(model, 2)
    tp = estimate_cost(model, plan)["memory_per_rank"]
    both = estimate_cost(model, plan, dp_shard=2)["memory_per_rank"]
    local = sum(torch.Size(p.local_shape).numel() * 4 for p in plan.params.values())
    replicated = sum(torch.Size(p.global_shape).numel() * 4 for p in plan.params.values() if p.shard_dim is None)
    assert tp["parameters"] == local == (sum(p.numel() * 4 for p in model.parameters()) + replicated) // 2
    assert both["parameters"] == tp["parameters"] // 2
    assert tp["adamw_states"] == 2 * tp["gradients"] + 4 * len(list(model.parameters()))


def test_activation_estimate_scales_with_tokens() -> None:
    model = _build("llama", {}, meta=True)
    plan = tpcompile.plan_model(model, 2)
    one, two, four = (estimate_activations(model, plan, batch=b, seq=16)["bytes"] for b in (1, 2, 4))
    # per-sequence tensors scale with the batch; rotary tables and masks are shared
    assert four - two == 2 * (two - one) > 0
    assert two < 2 * one


def test_cost_rejects_half_a_token_count() -> None:
    model = _build("llama", {}, meta=True)
    plan = tpcompile.plan_model(model, 2)
    with pytest.raises(TPError, match="both batch and seq"):
        estimate_cost(model, plan, batch=2)


def test_the_cost_section_reads_the_plans_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning a meta model traces it once (and its localized copy once); the cost
    section, with and without tokens, traces nothing more (dump-plan paid a third trace)."""
    from tpcompile.capture import export

    traced: list[str] = []
    real = export._export

    def counting(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        traced.append(type(model).__name__)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(export, "_export", counting)
    model = _build("llama", {"num_hidden_layers": 3}, meta=True)  # a shape no other test plans (the plan cache)
    plan = tpcompile.plan_model(model, 2)
    planned = len(traced)
    estimate_cost(model, plan)
    estimate_cost(model, plan, batch=BATCH, seq=SEQ)
    assert planned >= 1 and len(traced) == planned, traced
