"""Expert parallelism: experts split over ep ranks, tokens routed with all-to-all.

Every case is compared with one process running the same model on the whole global
batch (each data-parallel rank takes its slice; losses are token means): the loss and
*every* gradient (gathered back to the HF layout) to 1e-5 in fp32, then a few AdamW
steps.  mixtral, qwen3_moe and qwen2_moe (a shared expert beside the routed ones) run at
ep=2 (world 2, tp=1) and ep=2 x tp=2 (world 4); GPT-OSS (expert biases), activation
checkpointing, efsdp=2 and HSDP join them; the checkpoint cases share the world-2 launch.
At tp=2 x ep=2 a token id or label outside the vocabulary is refused (with and without
sequence parallelism).  Fast unit tests cover detection from the dataflow and the config
errors.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from dist import global_step, run_distributed
from hf_grads import hf_grads
from torch.distributed.tensor import DTensor

import tpcompile
from tpcompile.errors import TPError

FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe")
STEPS = 3
REL = 1e-5
_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
               vocab_size=256, max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_CONFIGS = {
    "mixtral": dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2),
    "qwen3_moe": dict(moe_intermediate_size=32, intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                      head_dim=16, decoder_sparse_step=1, norm_topk_prob=True),
    "qwen2_moe": dict(moe_intermediate_size=32, intermediate_size=64, shared_expert_intermediate_size=48,
                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1),
    # expert biases (E, 2I) / (E, H) ride along with the stacked weights
    "gpt_oss": dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
                    layer_types=["sliding_attention", "full_attention"], sliding_window=8),
}


def _config(family: str, **extra: int) -> object:
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**_COMMON, **_CONFIGS[family], **extra})


def _build(family: str, meta: bool = False, **extra: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = _config(family, **extra)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # GPT-OSS starts its expert biases at zero: draw them, to see where they are added
        for name, p in model.named_parameters():
            if name.endswith("_bias"):
                p.normal_(std=0.5)
    return model


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 256, (4, 9), generator=g) for _ in range(STEPS)]


@functools.cache
def _reference(family: str) -> dict:
    """One process, whole batch: the first step's loss and gradients, then AdamW losses."""
    model = _build(family)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step, ids in enumerate(_batches()):
        loss = model(ids, labels=ids).loss
        loss.backward()
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads}


def _hf_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient as the HF-layout tensor (collective: every rank calls)."""
    return hf_grads(model, model.tpcompile_parallel.tp)


def _train_case(family: str, layout: dict) -> dict:
    model = _build(family)
    tpcompile.parallelize(model, **layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    from tpcompile import data_parallel_rank

    rank, size = data_parallel_rank(model)
    losses, grads = [], {}
    for step, ids in enumerate(_batches()):
        if step == 0:  # the gradients of the first step, before the optimizer moves anything
            local = ids.chunk(size)[rank]
            loss = model(local, labels=local).loss
            loss.backward()
            grads = _hf_grads(model)
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / torch.distributed.get_world_size())
        else:
            losses.append(global_step(model, opt, ids))
    experts = model.tpcompile_plan.experts if hasattr(model, "tpcompile_plan") else None
    p = model.get_submodule("model.layers.0.mlp.experts").gate_up_proj
    return {"losses": losses, "grads": grads, "experts": experts is None or bool(experts),
            "expert_param": (tuple(p.shape), tuple(p.to_local().shape), p.device_mesh.mesh_dim_names),
            "ep_rank": model.tpcompile_expert_mesh["ep"].get_local_rank()}


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _checkpoints(rank: int, root: Path) -> dict:
    """ep=2: hf_state_dict, state_dict(), save_pretrained; a sharded checkpoint after one
    step loaded into an ep=1 model and back."""
    from tpcompile import checkpoint

    model = _build("mixtral")
    tpcompile.parallelize(model, ep=2)
    out: dict = {"hf": checkpoint.hf_state_dict(model),
                 "state_dict": {k: _full(v).clone() for k, v in model.state_dict().items()}}
    model.save_pretrained(root / "hf")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _batches()
    global_step(model, opt, ids[0])
    checkpoint.save(root / "ep2", model, opt)
    out["trained"] = checkpoint.hf_state_dict(model)
    # another model and layout: every expert on every rank (ep=1, plain FSDP2 over 2)
    other = _build("mixtral")
    tpcompile.parallelize(other, ep=1)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    checkpoint.load(root / "ep2", other, other_opt)
    out["resharded"] = checkpoint.hf_state_dict(other)
    # both continue: the optimizer state came along, so the next steps agree
    out["next"] = [global_step(model, opt, ids[1]), global_step(other, other_opt, ids[1])]
    checkpoint.save(root / "ep1", other, other_opt)
    checkpoint.load(root / "ep1", model, opt)  # and back into the ep=2 model
    checkpoint.save(root / "local", model, opt, kind="local")  # same layout only: ep included
    with pytest.raises(TPError, match="local checkpoints reload only at the layout that wrote them"):
        checkpoint.load(root / "local", other, other_opt)
    out["back"] = checkpoint.hf_state_dict(model)
    out["back_ref"] = checkpoint.hf_state_dict(other)
    # a meta model loading the HF directory: each rank reads only its experts' rows
    loaded = tpcompile.parallelize(_build("mixtral", meta=True), ep=2, load_from=root / "hf")
    out["load_from"] = checkpoint.hf_state_dict(loaded)
    return out


def _session(rank: int, world: int, cases: list[tuple[str, dict]], root: Path | None = None) -> dict:
    out = {f"{fam}/{i}": _train_case(fam, layout) for i, (fam, layout) in enumerate(cases)}
    if root is not None:
        out["checkpoints"] = _checkpoints(rank, root)
        from transformers import AutoModelForCausalLM

        from tpcompile.tools.presets import tiny_config

        with pytest.raises(TPError, match="found no stacked experts in LlamaForCausalLM.*drop ep"):
            tpcompile.parallelize(AutoModelForCausalLM.from_config(tiny_config("llama")), ep=2)
    if world == 4:  # SMP's state reports the same EP position parallelize uses
        import tpcompile.smp as tsm

        tsm.init({"tensor_parallel_degree": 2, "expert_parallel_degree": 2})
        with pytest.raises(TPError, match="expert_parallel_degree=2 is applied by tpcompile.parallelize"):
            tsm.transform(_build("mixtral"))
        out["smp"] = (tsm.state.ep_rank, tsm.state.ep_size)
        out["bad_input"] = _bad_input()
    return out


def _bad_input() -> dict[str, str | None]:
    """tp=2 x ep=2: a token id and a label outside the vocabulary are refused where they
    enter (the vocabulary-split embedding, the loss over split logits), with and without
    sequence parallelism; each data-parallel rank checks its own batch, no collective."""
    from dist import refusal

    ids = _batches()[0][:2]
    out = {}
    for sp in (False, True):
        model = tpcompile.parallelize(_build("mixtral"), tp=2, ep=2, sequence_parallel=sp)
        bad = ids.clone()
        bad[1, 4] = 256
        out[f"ids sp={sp}"] = refusal(lambda m=model, bad=bad: m(input_ids=bad, labels=ids))
        out[f"labels sp={sp}"] = refusal(lambda m=model, bad=bad: m(input_ids=ids, labels=bad))
    return out


def _check_training(results: list[dict], key: str) -> None:
    family = key.split("/")[0]
    ref = _reference(family)
    for r in results:
        got = r[key]
        for step, (a, b) in enumerate(zip(got["losses"], ref["losses"], strict=True)):
            assert abs(a - b) <= REL * abs(b), f"{key} step {step}: {a} vs {b}"
        assert set(got["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(got["grads"][name], g, rtol=REL, atol=REL, msg=lambda m, n=name: f"{key} {n}: {m}")


def _check_checkpoints(results: list[dict], root: Path) -> None:
    from transformers import AutoModelForCausalLM

    ref = _build("mixtral").state_dict()
    got = results[0]["checkpoints"]
    assert set(got["hf"]) == set(ref)
    for key, value in ref.items():
        assert torch.equal(got["hf"][key], value), key  # bit-exact
        for r in results:  # every rank: DTensors whose full value is the HF tensor
            assert torch.equal(r["checkpoints"]["state_dict"][key], value), key
    loaded = AutoModelForCausalLM.from_pretrained(root / "hf").state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in ref.items())
    assert all(torch.equal(got["load_from"][k], v) for k, v in ref.items())
    trained, resharded = got["trained"], got["resharded"]
    assert any(not torch.equal(trained[k], ref[k]) for k in ref)
    assert all(torch.equal(resharded[k], trained[k]) for k in trained)
    a, b = got["next"]
    assert abs(a - b) <= REL * abs(b), (a, b)
    assert all(torch.equal(got["back"][k], v) for k, v in got["back_ref"].items())


@pytest.mark.slow
def test_world2_ep2_matches_single_process_and_checkpoints(tmp_path: Path) -> None:
    cases = [(fam, dict(ep=2)) for fam in FAMILIES]
    cases.append(("mixtral", dict(ep=2, activation_checkpointing=True)))  # the dispatch recomputed
    cases.append(("gpt_oss", dict(ep=2)))
    results = run_distributed(_session, 2, cases, tmp_path)
    for i, (fam, _) in enumerate(cases):
        _check_training(results, f"{fam}/{i}")
        global_shape, local_shape, dims = results[0][f"{fam}/{i}"]["expert_param"]
        assert global_shape[0] == 4 and local_shape[0] == 2, (global_shape, local_shape)
    _check_checkpoints(results, tmp_path)


@pytest.mark.slow
def test_world4_ep2_tp2_matches_single_process() -> None:
    cases = [(fam, dict(tp=2, ep=2)) for fam in FAMILIES]
    # tp=1: experts also sharded by FSDP2 over efsdp=2, their gradients summed over the
    # two ranks holding the same experts; then HSDP (2 replicas of an ep=2 group)
    cases += [("mixtral", dict(ep=2)), ("mixtral", dict(ep=2, dp_replicate=2))]
    # and with sequence parallelism: the MoE layer is one region (router + dispatch) on all tokens
    cases += [("mixtral", dict(tp=2, ep=2, sequence_parallel=True))]
    # TP inside the experts with a bias their forward adds: one TP rank adds it
    cases += [("gpt_oss", dict(tp=2, ep=2))]
    results = run_distributed(_session, 4, cases)
    for i, (fam, _) in enumerate(cases):
        _check_training(results, f"{fam}/{i}")
    for i in range(len(FAMILIES)):
        global_shape, local_shape, dims = results[0][f"{FAMILIES[i]}/{i}"]["expert_param"]
        assert local_shape[0] == 2 and local_shape[1] == global_shape[1] // 2, (global_shape, local_shape)
    assert results[0]["mixtral/3"]["expert_param"][1][0] == 1  # 2 experts per ep rank, halved by efsdp
    # ranks (dp_shard, tp): ep rank = dp_shard coordinate (efsdp = 1)
    assert [r["mixtral/0"]["ep_rank"] for r in results] == [0, 0, 1, 1]
    assert [r["mixtral/3"]["ep_rank"] for r in results] == [0, 1, 0, 1]  # dp_shard = efsdp x ep
    assert [r["smp"] for r in results] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    for r in results:
        for name, text in r["bad_input"].items():
            what = "token id 256" if name.startswith("ids") else "label 256"
            assert text is not None and what in text and "position [1, 4]" in text, (name, text)


# ---------------------------------------------------------------- fast, one process


def test_config_key_and_ep_must_divide_dp_shard() -> None:
    from tpcompile.config import resolve_config

    cfg = resolve_config({"tensor_parallel_degree": 2, "expert_parallel_degree": 2}, world_size=8)
    assert (cfg.tp, cfg.ep, cfg.dp_shard) == (2, 2, 4)
    assert resolve_config(tp=2, ep=2, world_size=8) == cfg
    with pytest.raises(TPError, match=r"ep=3 must divide dp_shard=4.*ep values that work: \[1, 2, 4\]"):
        resolve_config(tp=2, ep=3, world_size=8)
    with pytest.raises(TPError, match="ep must be an integer >= 1"):
        resolve_config(ep=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_found_from_the_dataflow(family: str) -> None:
    model = _build(family, meta=True)
    plan = tpcompile.plan_model(model, 1, ep=2)
    assert sorted(plan.experts) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    xp = plan.experts["model.layers.1.mlp.experts"]
    assert (xp.num_experts, xp.params, xp.size_attrs) == (4, ["down_proj", "gate_up_proj"], {"num_experts": [4, 2]})
    from tpcompile.plan import Plan

    assert Plan.from_json(plan.to_json()).experts == plan.experts  # data: dump-plan shows it


def test_names_do_not_matter_and_dense_models_have_no_experts() -> None:
    """Renamed parameters are still found (the router's top-k picks their rows); a dense
    model has none; an expert count ep does not divide names the module."""
    from transformers import AutoModelForCausalLM

    from tpcompile.tools.presets import tiny_config

    model = _build("mixtral", meta=True)
    for layer in model.model.layers:
        ex = layer.mlp.experts
        ex.register_parameter("w_in", ex._parameters.pop("gate_up_proj"))
        ex.register_parameter("w_out", ex._parameters.pop("down_proj"))
        type(ex).gate_up_proj = property(lambda self: self.w_in)
        type(ex).down_proj = property(lambda self: self.w_out)
    try:
        plan = tpcompile.plan_model(model, 1)
    finally:
        del type(ex).gate_up_proj, type(ex).down_proj
    assert plan.experts["model.layers.0.mlp.experts"].params == ["w_in", "w_out"]
    with torch.device("meta"):
        dense = AutoModelForCausalLM.from_config(tiny_config("llama"))
    assert tpcompile.plan_model(dense, 1).experts == {}
    with pytest.raises(TPError, match=r"model.layers.0.mlp.experts \(MixtralExperts\) has 4 experts, not "
                                      r"divisible by ep=3; use an ep that divides it: \[1, 2, 4\]"):
        tpcompile.plan_model(_build("mixtral", meta=True), 1, ep=3)
