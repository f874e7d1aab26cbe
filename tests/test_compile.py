"""parallelize(compile=...): every block's forward compiled, hooks and collectives traced.

Each case parallelizes a 4-layer Llama twice from the same weights, compiled
(``aot_eager``: dynamo and AOTAutograd, the graphs run without inductor's codegen) and
eager, in one launch of 2 gloo processes, and compares: the losses of 3 AdamW steps,
the first step's gradients in HF layout, no-cache eval logits and greedy ``generate``
tokens. The compiled model must show 0 graph breaks and one graph for its 4 blocks
(expert parallelism's data-dependent dispatch excepted).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from dist import refusal, run_cases
from hf_grads import hf_grads

import tpcompile
from tpcompile.config import compile_options, resolve_config
from tpcompile.errors import TPError
from tpcompile.tools.presets import tiny_config

STEPS = 3
LAYOUTS = {
    "tp2": {"tp": 2},
    "tp2_sp": {"tp": 2, "sequence_parallel": True},
    "dp2": {"tp": 1},
    "tp2_ac": {"tp": 2, "activation_checkpointing": True},
}
# the other parallelisms, each on its model, with one attention implementation
COMPOSED = {
    "fp8": ("llama", {"tp": 2, "fp8": True}),
    "cp2": ("llama", {"cp": 2}),
    "ep2": ("mixtral", {"ep": 2}),
    "pp2": ("llama", {"pp": 2, "pp_schedule": "1f1b"}),
    "bf16_dp2": ("llama", {"tp": 1, "mixed_precision": "bf16"}),
    "offload_tp2": ("llama", {"tp": 2, "activation_offloading": True}),
    "lora_tp2": ("llama", {"tp": 2, "lora": True}),
    "lora_dp2": ("llama", {"tp": 1, "lora": True}),
}


def _build(family: str, attn: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    cfg.num_hidden_layers = 4
    cfg._attn_implementation = attn
    for key, value in cfg.to_dict().items():  # no dropout: compiled and eager draw differently
        if ("drop" in key or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 10), generator=g) for _ in range(STEPS)]


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0))


def _run(rank: int, world: int, family: str, attn: str, layout: dict, compile_: object) -> dict:
    torch._dynamo.reset()  # each case compiles its own graphs (and counts them)
    layout = dict(layout)
    model = _build(family, attn)
    if layout.pop("lora", False):
        model = _lora(model)
    model = tpcompile.parallelize(model, seed=0, compile=compile_, **layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tp, pipelined = layout.get("tp", 1), layout.get("pp", 1) > 1
    losses, grads = [], None
    from tpcompile import data_parallel_rank

    dp_rank, dp = data_parallel_rank(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the cache dropped while recording grad (warned once)
        for ids in _batches():
            if pipelined:
                loss = tpcompile.pipeline_step(model, {"input_ids": ids, "labels": ids})
            else:
                local = ids.chunk(dp)[dp_rank]
                loss = model(input_ids=local, labels=local).loss
                loss.backward()
            if grads is None:
                grads = hf_grads(model, tp)
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
    state = getattr(model, "tpcompile_compiled", None)
    out = {"losses": losses, "grads": grads,
           "trained": None if state is None else (state.graph_breaks, state.graphs)}
    if pipelined:
        return out
    model.eval()
    ids = _batches()[0][:2, :6]
    with torch.no_grad():
        out["logits"] = model(input_ids=ids, use_cache=False).logits
        if state is not None:
            out.update(breaks=state.graph_breaks, graphs=state.graphs)
        if layout.get("cp", 1) == 1:  # context parallelism refuses a KV cache (generate)
            out["tokens"] = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False)
            # (new lengths without a cache: more graphs, e.g. a split sequence that pads)
            out["greedy"] = _greedy(model, ids, 4)
    if state is not None:
        out["eager_calls"] = state.eager_calls
    return out


def _run_transformed(rank: int, world: int, attn: str, compile_: object) -> dict:
    """``transform(tp=2)`` and then the user's own ``layer.compile()`` on every decoder
    layer (no probe, hooks keyed as registered): the model must train as uncompiled."""
    torch._dynamo.reset()
    model = tpcompile.transform(_build("llama", attn), tp=2)
    if compile_:
        for layer in model.model.layers:
            layer.compile(backend=compile_)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], None
    for ids in _batches():
        loss = model(ids, labels=ids).loss
        loss.backward()
        if grads is None:
            grads = hf_grads(model, 2)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    ids = _batches()[0][:2, :6]
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
        tokens = model.generate(ids, max_new_tokens=4, do_sample=False)
    return {"losses": losses, "grads": grads, "logits": logits, "tokens": tokens}


def _greedy(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding by whole forwards through the model's own call (no cache, no
    ``generate``): what ``generate`` must reproduce."""
    for _ in range(steps):
        ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def _refusals(rank: int, world: int) -> dict:
    return {
        "bad_key": refusal(lambda: tpcompile.parallelize(_build("llama", "eager"), tp=2,
                                                         compile={"fullgraph": True})),
        "bad_type": refusal(lambda: tpcompile.parallelize(_build("llama", "eager"), tp=2, compile=3)),
    }


_MODES = {"compiled": "aot_eager", "eager": False}
CASES = {f"{attn}-{name}-{mode}": (_run, "llama", attn, layout, c)
         for attn in ("eager", "sdpa") for name, layout in LAYOUTS.items() for mode, c in _MODES.items()}
CASES.update({f"{name}-{mode}": (_run, family, "sdpa", layout, c)
              for name, (family, layout) in COMPOSED.items() for mode, c in _MODES.items()})
CASES.update({f"transformed-{attn}-{mode}": (_run_transformed, attn, c)
              for attn in ("eager", "sdpa") for mode, c in _MODES.items()})
CASES["refusals"] = (_refusals,)


@pytest.fixture(scope="module")
def world2():
    return run_cases(2, CASES, timeout=900)


def _check(compiled: dict, eager: dict, whole: bool = True) -> None:
    """``whole``: the block compiles to one graph, without a break."""
    if whole:
        assert compiled["trained"] == (0, 1)  # no break; one graph serves the 4 blocks
    assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
    assert compiled["grads"].keys() == eager["grads"].keys()
    for name, g in eager["grads"].items():
        torch.testing.assert_close(compiled["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
    if "logits" in eager and whole:
        assert (compiled["breaks"], compiled["graphs"]) == (0, 2)  # and one more without grad (eval)
    if "logits" in eager:
        torch.testing.assert_close(compiled["logits"], eager["logits"], rtol=1e-4, atol=1e-5)
    if "tokens" in eager:
        assert compiled["eager_calls"] > 0  # generate's cached steps ran eagerly
        assert torch.equal(compiled["tokens"], eager["tokens"])
        assert torch.equal(eager["tokens"], eager["greedy"])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_compiled_equals_eager(world2, attn: str, layout: str) -> None:
    for compiled, eager in zip(world2[f"{attn}-{layout}-compiled"], world2[f"{attn}-{layout}-eager"], strict=True):
        _check(compiled, eager)


@pytest.mark.parametrize("name", list(COMPOSED))
def test_compiled_composes(world2, name: str) -> None:
    """FP8, context, expert and pipeline parallelism, FSDP2's mixed precision, activation
    offloading and LoRA adapters (PEFT, added before parallelize) with compiled blocks. An expert-parallel
    block compiles in pieces: its dispatch is data-dependent (token counts per expert,
    all-to-all split sizes read on the host) and the experts' own FSDP2 hooks run eagerly."""
    for compiled, eager in zip(world2[f"{name}-compiled"], world2[f"{name}-eager"], strict=True):
        _check(compiled, eager, whole=not name.startswith(("ep2", "lora")))
        if name == "ep2":
            assert compiled["trained"][0] > 0
        if name.startswith("lora"):  # frozen embeddings: the first block's input has no grad, a second graph
            assert compiled["trained"] == (0, 2)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_transformed_model_under_the_users_own_compile(world2, attn: str) -> None:
    """A ``transform``ed model whose layers the user compiles trains, evaluates and
    generates as uncompiled (breaks and recompiles are allowed there; ``parallelize(compile=...)``
    is the path held to one graph)."""
    for compiled, eager in zip(world2[f"transformed-{attn}-compiled"], world2[f"transformed-{attn}-eager"],
                               strict=True):
        assert compiled["losses"] == pytest.approx(eager["losses"], rel=1e-5)
        for name, g in eager["grads"].items():
            torch.testing.assert_close(compiled["grads"][name], g, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(compiled["logits"], eager["logits"], rtol=1e-4, atol=1e-5)
        assert torch.equal(compiled["tokens"], eager["tokens"])


def test_refusals(world2) -> None:
    for got in world2["refusals"]:
        assert "unknown torch.compile keywords ['fullgraph']" in got["bad_key"]
        assert "compile must be True, False" in got["bad_type"]


def test_compile_options() -> None:
    assert compile_options(False) is None and compile_options(None) is None
    assert compile_options(True) == {}
    assert compile_options("aot_eager") == {"backend": "aot_eager"}
    assert compile_options({"mode": "max-autotune"}) == {"mode": "max-autotune"}
    with pytest.raises(TPError, match="unknown torch.compile keywords"):
        compile_options({"fullgraph": True})


def test_accelerate_dynamo_config() -> None:
    """accelerate's ``dynamo_config`` section turns compile on (``NO``: off); fullgraph
    is refused (tpcompile compiles blocks)."""
    base = {"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2}}
    cfg = resolve_config({**base, "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_mode": "max-autotune",
                                                    "dynamo_use_regional_compilation": True}}, world_size=2)
    assert cfg.compile == {"backend": "inductor", "mode": "max-autotune"}
    assert resolve_config({**base, "dynamo_config": {"dynamo_backend": "NO"}}, world_size=2).compile is None
    with pytest.raises(TPError, match="dynamo_use_fullgraph"):
        resolve_config({**base, "dynamo_config": {"dynamo_backend": "INDUCTOR", "dynamo_use_fullgraph": True}},
                       world_size=2)
