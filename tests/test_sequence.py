"""Sequence parallelism: exact against the unsharded model, and the plan derived from
the dataflow.

Every case runs the same batch through the untransformed model and the tensor-parallel
model with ``sequence_parallel=True`` (fp32) and compares the logits, the loss and every
parameter's gradient (1e-5); sequence lengths that do not divide by tp are padded.
Cases of one world size share one launch.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dist import run_distributed
from test_transform import grad_errors

import tpcompile
from tpcompile.presets import tiny_config

TOL = 1e-5
FAMILIES = {"llama": "sdpa", "gemma2": "eager", "qwen3": "eager", "mixtral": "sdpa", "gpt2": "eager"}


def _build(name: str, attn: str, **overrides: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = tiny_config(name, **overrides)
    cfg._attn_implementation = attn
    for key in ("attention_dropout", "hidden_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    return AutoModelForCausalLM.from_config(cfg).float()


def _compare(model: torch.nn.Module, ref: torch.nn.Module, ids: torch.Tensor, tp: int) -> dict:
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    errs = grad_errors(model, ref, tp)
    return {
        # loss_parallel keeps the logits vocab-sharded: the loss and gradients say it all
        "logits": (out.logits - out_ref.logits).abs().max().item() if out.logits.shape == out_ref.logits.shape
        else 0.0,
        "loss": abs(out.loss.item() - out_ref.loss.item()),
        "grad": max(errs.items(), key=lambda kv: kv[1]),
        "regions": len(model.tpcompile_plan.sequence["regions"]),
    }


def _case(rank: int, world: int, name: str, attn: str, seq: int, kwargs: dict) -> dict:
    ref = _build(name, attn)
    model = copy.deepcopy(ref)
    tpcompile.transform(model, tp=world, sequence_parallel=True, **kwargs)
    ids = torch.randint(3, 256, (2, seq), generator=torch.Generator().manual_seed(seq))
    result = _compare(model, ref, ids, world)
    if name == "llama" and not kwargs:
        prompt = ids[:, :5]
        gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            result["generate"] = model.generate(prompt, **gen).tolist() == ref.generate(prompt, **gen).tolist()
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
            want = ref(input_ids=ids, output_hidden_states=True).hidden_states
        result["hidden_states"] = max((h - w).abs().max().item() for h, w in zip(hidden, want, strict=True))
    return result


def _session(rank: int, world: int, cases: list[tuple]) -> dict:
    return {case: _case(rank, world, *case[:3], dict(case[3])) for case in cases}


def _cases(tp: int) -> list[tuple]:
    cases = [(name, attn, 10 if tp == 2 else 12, ()) for name, attn in FAMILIES.items()]
    cases += [("llama", "sdpa", 7, ()), ("llama", "eager", 9, (("loss_parallel", True),))]
    return cases


def _check(results: list[dict]) -> None:
    for case, res in results[0].items():
        assert res["regions"] > 0, case
        assert res["logits"] < TOL and res["loss"] < TOL, (case, res)
        assert res["grad"][1] < TOL, (case, res["grad"])
        if "generate" in res:
            assert res["generate"], case
            assert res["hidden_states"] < TOL, case


@pytest.mark.slow
def test_sequence_parallel_tp2_exact() -> None:
    _check(run_distributed(_session, 2, _cases(2)))


@pytest.mark.slow
def test_sequence_parallel_tp4_exact() -> None:
    _check(run_distributed(_session, 4, _cases(4)))


def test_plan_names_regions_and_stream() -> None:
    model = _build("llama", "sdpa")
    plan = tpcompile.plan_model(model, 2, sequence_parallel=True)
    seq = plan.sequence
    assert seq["stacks"]["model.layers"]["first"] == "model.layers.0"
    assert set(seq["regions"]) == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")}
    # the rotary tables and the mask reach attention whole: only the normed stream is gathered
    assert seq["regions"]["model.layers.0.self_attn"]["gather"] == [[["kwargs", "hidden_states"], 1]]
    assert tpcompile.Plan.from_json(plan.to_json()).sequence == seq
