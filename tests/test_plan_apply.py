"""Plans are data that apply, and a model runs only the plan it was given.

Single-process: the typed module ops, JSON round trips (and version-1 plans), what an
edit means, and every way a plan can fail to fit a model. Over gloo: a plan planned on
the meta device, saved, loaded and applied gives the same logits, loss and gradients as
planning on the spot, for transform (world 2) and parallelize (world 4).  Modules added
to a transformed model (PEFT adapters) are tested in test_adapters.py.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from dist import CaseResults, run_cases
from transformers import AutoModelForCausalLM

import tpcompile
from tpcompile import Plan, TPError
from tpcompile.plan import check_plan
from tpcompile.plan.modules import (
    EnterRegion,
    GatherOutput,
    GradSum,
    Hook,
    ModulePlan,
    ReduceOutput,
    VocabEmbedding,
    WholeMasks,
)
from tpcompile.tools.presets import tiny_config

TOL = 1e-5


def _meta(name: str = "llama", **overrides: object) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(name, **overrides))


@pytest.fixture(scope="module")
def llama_plan() -> Plan:
    return tpcompile.plan_model(_meta(), tp=2)


def test_module_plans_are_typed_ops(llama_plan: Plan) -> None:
    mods = llama_plan.modules
    assert mods["model.embed_tokens"].ops == [VocabEmbedding(vocab_size=256)]
    assert mods["model.layers.0.self_attn.q_proj"].ops == [EnterRegion()]
    assert mods["model.layers.0.mlp.down_proj"].ops == [ReduceOutput()]
    assert mods["lm_head"].ops == [EnterRegion(), GatherOutput(vocab_size=256)]
    hooks = [c.hook for c in mods["lm_head"].collectives()]
    assert hooks == [Hook.ENTER, Hook.EXIT_GATHER]


def test_qwen3_norms_get_a_gradient_sum() -> None:
    plan = tpcompile.plan_model(_meta("qwen3"), tp=2)
    assert plan.modules["model.layers.0.self_attn.q_norm"].ops == [GradSum(params=("weight",))]


def test_plan_json_round_trip_is_exact(llama_plan: Plan) -> None:
    again = Plan.from_json(llama_plan.to_json())
    assert again.modules == llama_plan.modules
    assert again.params == llama_plan.params
    assert again.to_dict() == llama_plan.to_dict()


def test_version_1_plans_still_load(llama_plan: Plan) -> None:
    d = llama_plan.to_dict()
    flags = {}
    for fqn, m in llama_plan.modules.items():  # the booleans version 1 stored
        gather, vocab = m.op(GatherOutput), m.op(VocabEmbedding)
        flags[fqn] = {"fqn": fqn, "copy_inputs": m.enters, "reduce_output": m.reduces,
                      "gather_output": gather is not None, "vocab_parallel": vocab is not None,
                      "vocab_size": (gather or vocab).vocab_size if (gather or vocab) else None,
                      "row_biases": list(m.row_biases), "grad_allreduce": list(m.grad_params),
                      "attr_fixups": m.attr_fixups}
    old = Plan.from_dict({**d, "version": 1, "modules": flags})
    # version 1 knew no dropout mask sites: the rest of each module's plan is the same
    assert old.modules.keys() == llama_plan.modules.keys()
    for fqn, m in old.modules.items():
        new = llama_plan.modules[fqn]
        assert m.ops == [op for op in new.ops if not isinstance(op, WholeMasks)], fqn
        assert m.attr_fixups == new.attr_fixups


def test_an_edited_plan_is_what_planning_would_say(llama_plan: Plan) -> None:
    edited = Plan.from_json(llama_plan.to_json())
    edited.loss_parallel = True  # keep the logits vocab-sharded: the head gathers nothing
    edited.modules["lm_head"] = ModulePlan(fqn="lm_head", ops=[EnterRegion()])
    want = tpcompile.plan_model(_meta(), tp=2, loss_parallel=True)
    skip = ("stats", "warnings")
    assert {k: v for k, v in edited.to_dict().items() if k not in skip} == \
           {k: v for k, v in want.to_dict().items() if k not in skip}


def test_bad_module_plans_are_refused() -> None:
    with pytest.raises(TPError, match="unknown op kind 'shuffle'"):
        ModulePlan.from_dict({"fqn": "m", "ops": [{"kind": "shuffle"}]})
    with pytest.raises(TPError, match="reduces its own output"):
        ModulePlan(fqn="emb", ops=[VocabEmbedding(vocab_size=8), ReduceOutput()])
    with pytest.raises(TPError, match="at most once"):
        ModulePlan(fqn="m", ops=[EnterRegion(), EnterRegion()])


def test_a_plan_is_checked_against_the_model(llama_plan: Plan) -> None:
    check_plan(llama_plan, _meta(), 2)  # fits
    with pytest.raises(TPError, match="made for tp=2, not tp=4"):
        check_plan(llama_plan, _meta(), 4)
    with pytest.raises(TPError, match="made for a LlamaForCausalLM, not this Qwen3ForCausalLM"):
        check_plan(llama_plan, _meta("qwen3"), 2)
    with pytest.raises(TPError, match="global shape"):
        check_plan(llama_plan, _meta(intermediate_size=192), 2)
    with pytest.raises(TPError, match="have no entry"):
        check_plan(llama_plan, _meta(num_hidden_layers=3), 2)
    broken = Plan.from_json(llama_plan.to_json())
    broken.params["model.layers.0.mlp.up_proj.weight"].local_shape = [7, 64]
    with pytest.raises(TPError, match="up_proj.weight: its runs give local shape"):
        check_plan(broken, _meta(), 2)
    broken = Plan.from_json(llama_plan.to_json())
    broken.modules["model.layers.9.mlp"] = ModulePlan(fqn="model.layers.9.mlp", ops=[EnterRegion()])
    with pytest.raises(TPError, match="hooks modules the model does not have"):
        check_plan(broken, _meta(), 2)
    with pytest.raises(TPError, match="must be a tpcompile Plan"):
        check_plan(llama_plan.to_dict(), _meta(), 2)  # type: ignore[arg-type]


# ---------------------------------------------------------------- applied over gloo


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config(name)).eval()


def _apply_saved(rank: int, world: int, name: str) -> dict:
    """transform with a plan made on the meta device and saved as JSON, vs planning."""
    saved = tpcompile.plan_model(_meta(name), tp=world).to_json()
    ref = _build(name)
    planned, applied = copy.deepcopy(ref), copy.deepcopy(ref)
    tpcompile.transform(planned, tp=world)
    tpcompile.transform(applied, tp=world, plan=Plan.from_json(saved))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    outs = []
    for m in (planned, applied):
        out = m(ids, labels=ids)
        out.loss.backward()
        outs.append(out)
    grads = max((a.grad.full_tensor() - b.grad.full_tensor()).abs().max().item()
                for a, b in zip(planned.parameters(), applied.parameters(), strict=True))
    return {"logits": (outs[0].logits - outs[1].logits).abs().max().item(),
            "loss": (outs[0].loss - outs[1].loss).abs().item(), "grads": grads,
            "same_plan": applied.tpcompile_plan is not planned.tpcompile_plan
            and json.loads(saved)["modules"] == applied.tpcompile_plan.to_dict()["modules"]}


def _apply_errors(rank: int, world: int) -> list[str]:
    plan = tpcompile.plan_model(_meta(), tp=world)
    errors = []
    for kwargs in ({"tp": 1}, {"tp": world, "overrides": {"lm_head.weight": "replicated"}},
                   {"tp": world, "sequence_parallel": True}):
        try:
            tpcompile.transform(_build("llama"), plan=plan, **kwargs)
        except TPError as err:
            errors.append(str(err))
    return errors


def _parallelize_saved(rank: int, world: int) -> dict:
    saved = tpcompile.plan_model(_meta(), tp=2).to_json()
    ref = _build("llama")
    planned = tpcompile.parallelize(copy.deepcopy(ref), tp=2)
    applied = tpcompile.parallelize(copy.deepcopy(ref), tp=2, plan=Plan.from_json(saved))
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = planned(ids).logits, applied(ids).logits
    return {"logits": (a - b).abs().max().item(), "mesh": list(applied.tpcompile_mesh.shape)}


@pytest.fixture(scope="module")
def world2() -> CaseResults:
    return run_cases(2, {"llama": (_apply_saved, "llama"), "gpt2": (_apply_saved, "gpt2"),
                         "errors": (_apply_errors,)}, timeout=600)


@pytest.fixture(scope="module")
def world4() -> CaseResults:
    return run_cases(4, {"parallelize": (_parallelize_saved,)}, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_a_saved_plan_applies_exactly(world2: CaseResults, name: str) -> None:
    for r in world2[name]:
        assert r["logits"] < TOL and r["loss"] < TOL and r["grads"] < TOL, r
        assert r["same_plan"], "the applied model does not run the saved plan"


@pytest.mark.slow
def test_applying_a_plan_that_does_not_fit_raises(world2: CaseResults) -> None:
    for errors in world2["errors"]:
        assert len(errors) == 3, errors
        assert "made for tp=2, not tp=1" in errors[0]
        assert "overrides only matter while planning" in errors[1]
        assert "no sequence plan" in errors[2]


@pytest.mark.slow
def test_parallelize_applies_a_saved_plan(world4: CaseResults) -> None:
    for r in world4["parallelize"]:
        assert r["logits"] < TOL and r["mesh"] == [1, 2, 2], r
