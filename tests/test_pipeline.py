"""Pipeline parallelism over gloo: ``parallelize(pp=2, ...)`` + ``pipeline_step`` equal one process.

Every case trains 3 AdamW steps (batch 4 x 16 tokens, 4 microbatches) with
``tpcompile.pipeline_step`` and compares, against the unsplit model in one process, the
three losses (rel 1e-5) and every gradient of the first step (atol 1e-5 + rtol 1e-3),
each rank its own stages' parameters under their HF names.  World 2: pp=2 with gpipe,
1f1b, interleaved 1F1B (2 stages per rank) and the split-backward schedules (interleaved
zero bubble, DualPipeV: weight gradients in a pass of their own) for llama (eager and sdpa), qwen3, gemma2
(alternating sliding windows, tied embeddings), mixtral (experts) and gpt2 (absolute
positions, embeddings tied across the first and last stage); delayed init on meta equals
the unsplit layout's; ``clip_grad_norm_`` gives the global norm; each stage's activations per
microbatch as run are within 10% of ``dump-plan --pp``'s estimate.  World 4: pp2 x tp2,
pp2 x dp_shard2 (FSDP2 all-gathers and reduce-scatters once per step, not per
microbatch; ZBV), pp2 x tp2 with interleaved zero bubble (qwen3), with
activation checkpointing, and mixtral at pp2 x ep2 (experts dispatched by all-to-all in
every stage); pp2 x cp2 (llama, gemma2's windows and softcap) and pp2 x tp2 with sequence
parallelism (llama eager, qwen3): the hidden state crosses at CP's slice / split over tp,
the shape ``dump-plan --pp --cp`` prices.  Refusals: an encoder-decoder, activation offloading, a plain forward / ``generate()`` / the HF Trainer's own step, a
batch the microbatches do not divide.  Mixtral's load-balancing loss (output_router_logits)
at pp=2: every layer's router logits cross the boundary with the hidden state; losses and
gradients equal gradient accumulation over the same microbatches.
"""

from __future__ import annotations

import math
from typing import Any

import families
import pytest
import torch
from dist import CaseResults, plan_ahead, refusal, run_cases
from hf_grads import hf_grads
from transformers import AutoModelForCausalLM

import tpcompile
from tpcompile import TPError
from tpcompile.tools.presets import tiny_config

REL, GRAD_ATOL, GRAD_RTOL = 1e-5, 1e-5, 1e-3
FAMILIES = {"llama": "sdpa", "llama_eager": "eager", "qwen3": "sdpa", "gemma2": "eager", "mixtral": "sdpa",
            "gpt2": "sdpa"}


def _build(family: str, attn: str = "sdpa", layers: int = 4, meta: bool = False, **cfg_kw: Any) -> torch.nn.Module:
    cfg = tiny_config(family.removesuffix("_eager"))
    cfg.num_hidden_layers = layers
    cfg._attn_implementation = attn
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = (list(cfg.layer_types) * layers)[:layers]
    for key, value in cfg.to_dict().items():  # no dropout: the runs draw random numbers differently
        if ("drop" in key or key.endswith("_pdrop")) and isinstance(value, float):
            setattr(cfg, key, 0.0)
    for key, value in cfg_kw.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    if meta:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(cfg)
    return AutoModelForCausalLM.from_config(cfg)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :5] = -100  # unequal token counts per microbatch: the loss weights must follow them
    return {"input_ids": ids, "labels": labels}


def _train(model: torch.nn.Module, tp: int | None) -> dict[str, Any]:
    """3 AdamW steps through pipeline_step; the losses and the first step's gradients."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step in range(3):
        losses.append(tpcompile.pipeline_step(model, _batch()).item())
        if step == 0:
            grads = hf_grads(model, tp) if tp is not None else {
                n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}


def _compare(got: dict[str, Any], want: dict[str, Any]) -> dict[str, Any]:
    worst = {n: (g - want["grads"][n]).abs().max().item() - GRAD_RTOL * want["grads"][n].abs().max().item()
             for n, g in got["grads"].items()}
    return {"losses": got["losses"], "ref": want["losses"], "grad_excess": max(worst.values()),
            "names": sorted(got["grads"]), "ref_names": sorted(want["grads"])}


def _exact(rank: int, world: int, family: str, layout: dict) -> dict:
    attn = FAMILIES[family]
    model = tpcompile.parallelize(_build(family, attn), **layout)
    got = _train(model, layout.get("tp", 1))
    out = _compare(got, _train(_build(family, attn), None))
    run = model.tpcompile_pipeline
    out["stages"] = [s.index for s in run.stages]
    # the hidden state as it crosses a boundary (CP's slice, SP's split) and as dump-plan prices it
    out["crossing"] = list(run.shapes({k: v[:1] for k, v in _batch().items()}).hidden_shape)
    cp = getattr(model, "tpcompile_context", None)
    out["cp_paths"] = dict(cp.paths) if cp is not None else {}
    if layout.get("cp", 1) > 1 or layout.get("sequence_parallel"):
        from tpcompile.tools.cost_pipeline import estimate_pipeline

        meta = _build(family, attn, meta=True)
        plan = tpcompile.plan_model(meta, layout.get("tp", 1), sequence_parallel=layout.get("sequence_parallel",
                                                                                            False))
        out["priced"] = estimate_pipeline(meta, plan, pp=2, schedule=layout.get("pp_schedule"), microbatches=4,
                                          batch=4, seq=16, cp=layout.get("cp", 1))["p2p"]["hidden_shape"]
    return out


def _accumulated(model: torch.nn.Module, m: int = 4) -> dict[str, Any]:
    """3 AdamW steps of gradient accumulation over the microbatches ``pipeline_step`` cuts,
    each microbatch's loss weighted by its share of the loss tokens."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, grads = [], {}
    for step in range(3):
        mbs = [{k: v.chunk(m)[i] for k, v in _batch().items()} for i in range(m)]
        counts = [int((mb["labels"][..., 1:] != -100).sum()) for mb in mbs]
        total = 0.0
        for mb, count in zip(mbs, counts, strict=True):
            loss = model(**mb).loss * (count / sum(counts))
            loss.backward()
            total += loss.item()
        losses.append(total)
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "grads": grads}


def _router_loss(rank: int, world: int, layout: dict) -> dict:
    """MoE load-balancing loss (output_router_logits=True): the router logits each stage
    records cross with the hidden state, so the last stage's loss averages every layer's
    router; per microbatch, as gradient accumulation computes it (the loss is not linear
    in the batch: the whole batch's differs)."""
    model = tpcompile.parallelize(_build("mixtral", output_router_logits=True), **layout)
    out = _compare(_train(model, layout.get("tp", 1)), _accumulated(_build("mixtral", output_router_logits=True)))
    out["carried"] = [e.block for e in model.tpcompile_pipeline.bounds.carried]
    out["whole_batch"] = _build("mixtral", output_router_logits=True)(**_batch()).loss.item()
    batch = {**_batch(), "output_router_logits": False}
    out["per_call"] = refusal(lambda: tpcompile.pipeline_step(model, batch))
    return out


def _meta(rank: int, world: int) -> dict:
    """Delayed init: the pp=2 shards are the tensors the unsplit layout initialises."""
    model = tpcompile.parallelize(_build("gpt2", meta=True), pp=2, seed=0, pp_schedule="1f1b")
    ref = tpcompile.parallelize(_build("gpt2", meta=True), seed=0)  # dp_shard=2, pp=1
    full = {n: getattr(t, "full_tensor", lambda t=t: t)() for n, t in ref.state_dict().items()}
    mine = {n: getattr(t, "full_tensor", lambda t=t: t)() for n, t in model.state_dict().items()}
    return {"err": max((v - full[n]).abs().max().item() for n, v in mine.items()), "n": len(mine),
            "total": len(full)}


def _clip(rank: int, world: int) -> dict:
    model = tpcompile.parallelize(_build("gpt2"), pp=2, pp_schedule="1f1b")
    tpcompile.pipeline_step(model, _batch())
    norm = tpcompile.clip_grad_norm_(model, 0.5).item()
    ref = _build("gpt2")
    ref(**_batch()).loss.backward()
    return {"norm": norm, "ref": torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5).item()}


def _stage_activations(rank: int, world: int) -> dict:
    """Bytes each stage keeps for backward per microbatch, as run (autograd's saved tensors,
    each storage once and sized after the forward, parameters excluded, plus the output a
    non-last stage holds until its backward) and as ``dump-plan --pp`` prices them."""
    from tpcompile.tools.cost_pipeline import estimate_pipeline

    model = tpcompile.parallelize(_build("llama"), pp=2, pp_schedule="1f1b", pp_microbatches=4)
    ran: dict[int, list[int]] = {}
    for sm in model.tpcompile_pipeline.stages:
        sm.forward = _counting_forward(sm, ran)
    tpcompile.pipeline_step(model, _batch())
    with torch.device("meta"):
        meta = _build("llama")
    est = estimate_pipeline(meta, tpcompile.plan_model(meta, 1), pp=2, schedule="1f1b", microbatches=4, batch=4,
                            seq=16)
    return {"ran": ran, "estimated": {s["index"]: s["activation_bytes_per_microbatch"] for s in est["stages"]}}


def _counting_forward(sm: torch.nn.Module, ran: dict[int, list[int]]) -> Any:
    forward = sm.forward

    def counted(x: torch.Tensor, *carried: torch.Tensor, mb: torch.Tensor) -> torch.Tensor:
        saved: dict[int, Any] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, torch.nn.Parameter) and not isinstance(t._base, torch.nn.Parameter):
                s = getattr(t, "_local_tensor", t).untyped_storage()
                saved[s.data_ptr()] = s
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = forward(x, *carried, mb=mb)
        kept = 0 if sm.last else out.numel() * out.element_size()
        ran.setdefault(sm.index, []).append(sum(s.nbytes() for s in saved.values()) + kept)
        return out

    return counted


def _refusals(rank: int, world: int) -> dict:
    attempts = {
        "encoder_decoder": lambda: tpcompile.parallelize(_t5(), pp=2),
        "offloading": lambda: tpcompile.parallelize(_build("llama"), pp=2, activation_offloading=True),
        "too_few_blocks": lambda: tpcompile.parallelize(_build("llama", layers=2), pp=2,
                                                        pp_schedule="interleaved_1f1b"),
        "bad_schedule": lambda: tpcompile.parallelize(_build("llama"), pp=2, pp_schedule="zigzag"),
        # ZBV holds the first and the last stage on rank 0: GPT-2's tied embedding would be two FSDP2 roots' parameter
        "tied_v": lambda: tpcompile.parallelize(_build("gpt2"), pp=2, pp_schedule="zbv"),
        # DBRX's expert loop indexes by an entry of ``nonzero``: no shapes-only forward finds its boundaries
        "data_dependent": lambda: tpcompile.parallelize(families.build("dbrx", "sdpa"), pp=2),
    }
    model = tpcompile.parallelize(_build("llama"), pp=2, pp_microbatches=4)
    attempts["forward"] = lambda: model(**_batch())
    attempts["generate"] = lambda: model.generate(_batch()["input_ids"][:, :4], max_new_tokens=2)
    attempts["batch"] = lambda: tpcompile.pipeline_step(model, {k: v[:3] for k, v in _batch().items()})
    attempts["no_labels"] = lambda: tpcompile.pipeline_step(model, {"input_ids": _batch()["input_ids"]})
    attempts["trainer"] = lambda: _trainer(model).train()
    return {name: refusal(attempt) for name, attempt in attempts.items()}


def _bad_batches(rank: int, world: int) -> dict:
    """A token id or label outside the vocabulary, and different batches on the two pp
    ranks: refused on every rank before the schedule (a stage raising alone would leave
    its partner waiting in a receive); a good step runs afterwards."""
    model = tpcompile.parallelize(_build("llama"), pp=2, pp_microbatches=4)
    out: dict[str, Any] = {}
    for name, key, value in (("ids", "input_ids", 300), ("labels", "labels", 256)):
        bad = {k: v.clone() for k, v in _batch().items()}
        bad[key][1, 3] = value
        out[name] = refusal(lambda bad=bad: tpcompile.pipeline_step(model, bad))
    rolled = {k: v.roll(rank, 0) for k, v in _batch().items()}  # rank 1 holds another order
    out["differ"] = refusal(lambda: tpcompile.pipeline_step(model, rolled))
    out["after"] = tpcompile.pipeline_step(model, _batch()).item()
    return out


def _trainer(model: torch.nn.Module) -> Any:
    """A plain HF Trainer on a pipelined model: its training_step calls model(**inputs)."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    rows = [{"input_ids": ids, "labels": ids} for ids in _batch()["input_ids"]]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=2, max_steps=1,
                             report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    return Trainer(model=model, args=args, train_dataset=rows)


def _t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                               num_heads=4, decoder_start_token_id=0))


def _reduce_scatters(rank: int, world: int, microbatches: int) -> dict:
    """FSDP2's reduce-scatters and all-gathers in one step at pp2 x dp_shard2: once per
    unit, whatever the number of microbatches (the units stay gathered across them)."""
    import torch.distributed as dist

    model = tpcompile.parallelize(_build("llama"), pp=2, dp_shard=2, pp_schedule="1f1b",
                                  pp_microbatches=microbatches)
    tpcompile.pipeline_step(model, _batch())  # warm-up
    names = ("reduce_scatter_single", "all_gather_single")  # what FSDP2 issues
    originals = {n: getattr(dist, n) for n in names}
    calls = dict.fromkeys(names, 0)

    def counting(name: str) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return originals[name](*args, **kwargs)
        return counted

    for n in names:
        setattr(dist, n, counting(n))
    try:
        tpcompile.pipeline_step(model, _batch())
    finally:
        for n, fn in originals.items():
            setattr(dist, n, fn)
    return {"calls": calls["reduce_scatter_single"], "gathers": calls["all_gather_single"],
            "stages": len(model.tpcompile_pipeline.stages)}


WORLD2 = {f"{family}_interleaved": (_exact, family, {"pp": 2, "pp_microbatches": 4}) for family in FAMILIES}
WORLD2.update({
    "mixtral_router_loss": (_router_loss, {"pp": 2, "pp_microbatches": 4}),
    "llama_gpipe": (_exact, "llama", {"pp": 2, "pp_microbatches": 4, "pp_schedule": "gpipe"}),
    "llama_1f1b": (_exact, "llama", {"pp": 2, "pp_microbatches": 4, "pp_schedule": "1f1b"}),
    "gpt2_1f1b": (_exact, "gpt2", {"pp": 2, "pp_microbatches": 2, "pp_schedule": "1f1b"}),
    # the split-backward schedules: weight gradients in a pass of their own, after the input gradients
    # (ZBV runs at pp2 x dp_shard2 in the world-4 launch)
    **{f"llama_{s}": (_exact, "llama", {"pp": 2, "pp_microbatches": 4, "pp_schedule": s})
       for s in ("zero_bubble", "dualpipev")},
    "gpt2_zero_bubble": (_exact, "gpt2", {"pp": 2, "pp_microbatches": 4, "pp_schedule": "zero_bubble"}),
})
WORLD4 = {
    "llama_pp2_tp2": (_exact, "llama", {"pp": 2, "tp": 2, "pp_microbatches": 4}),
    "gpt2_pp2_tp2": (_exact, "gpt2", {"pp": 2, "tp": 2, "pp_microbatches": 4, "pp_schedule": "1f1b"}),
    "llama_pp2_dp2": (_exact, "llama", {"pp": 2, "dp_shard": 2, "pp_microbatches": 4}),
    "llama_pp2_dp2_zbv": (_exact, "llama", {"pp": 2, "dp_shard": 2, "pp_microbatches": 4, "pp_schedule": "zbv"}),
    "qwen3_pp2_tp2_zero_bubble": (_exact, "qwen3", {"pp": 2, "tp": 2, "pp_microbatches": 4,
                                                    "pp_schedule": "zero_bubble"}),
    "mixtral_pp2_dp2_ac": (_exact, "mixtral", {"pp": 2, "dp_shard": 2, "pp_microbatches": 4,
                                               "activation_checkpointing": True}),
    "mixtral_pp2_ep2": (_exact, "mixtral", {"pp": 2, "dp_shard": 2, "ep": 2, "pp_microbatches": 4}),
    # the hidden state crosses at CP's local length / split by SP over tp
    "llama_pp2_cp2": (_exact, "llama", {"pp": 2, "cp": 2, "pp_microbatches": 4}),
    "gemma2_pp2_cp2_gpipe": (_exact, "gemma2", {"pp": 2, "cp": 2, "pp_microbatches": 4, "pp_schedule": "gpipe"}),
    "llama_eager_pp2_tp2_sp": (_exact, "llama_eager", {"pp": 2, "tp": 2, "sequence_parallel": True,
                                                       "pp_microbatches": 4, "pp_schedule": "1f1b"}),
    "qwen3_pp2_tp2_sp": (_exact, "qwen3", {"pp": 2, "tp": 2, "sequence_parallel": True, "pp_microbatches": 4}),
}


def _plans(cases: dict[str, tuple]) -> list[tuple]:
    """The plans ``parallelize`` makes for the ``_exact`` cases (and ``dump-plan``'s, on
    meta, for CP and SP), for ``plan_ahead``."""
    jobs = []
    for fn, *args in cases.values():
        if fn is not _exact:
            continue
        family, layout = args
        tp, sp = layout.get("tp", 1), layout.get("sequence_parallel", False)
        jobs.append((_build, (family, FAMILIES[family]), {"tp": tp, "ep": layout.get("ep", 1),
                                                          "sequence_parallel": sp and tp > 1}))
        if layout.get("cp", 1) > 1 or sp:
            jobs.append((_build, (family, FAMILIES[family], 4, True), {"tp": tp, "sequence_parallel": sp}))
    return list({repr(job): job for job in jobs}.values())


@pytest.fixture(scope="module")
def world2() -> CaseResults:
    cases: dict = {"plans": (plan_ahead, _plans(WORLD2)), **WORLD2}
    cases.update({"meta": (_meta,), "clip": (_clip,), "refusals": (_refusals,), "memory": (_stage_activations,),
                  "bad_batches": (_bad_batches,)})
    return run_cases(2, cases, timeout=1800)


@pytest.fixture(scope="module")
def world4() -> CaseResults:
    cases: dict = {"plans": (plan_ahead, _plans(WORLD4)), **WORLD4}
    cases.update({"rs2": (_reduce_scatters, 2), "rs4": (_reduce_scatters, 4)})
    return run_cases(4, cases, timeout=1800)


def _check(results: list[dict]) -> None:
    for r in results:
        for got, want in zip(r["losses"], r["ref"], strict=True):
            assert abs(got - want) <= REL * abs(want), r
        assert r["grad_excess"] <= GRAD_ATOL, r
    # between them the ranks hold every parameter of the unsplit model
    held = {n for r in results for n in r["names"]}
    assert held == set(results[0]["ref_names"]), held ^ set(results[0]["ref_names"])


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(WORLD2))
def test_pipeline_equals_one_process(world2: CaseResults, case: str) -> None:
    _check(world2[case])
    if case == "mixtral_router_loss":
        for r in world2[case]:  # every layer's router reaches the loss; per-call options are refused
            assert r["carried"] == [f"model.layers.{i}" for i in range(4)], r["carried"]
            assert abs(r["whole_batch"] - r["losses"][0]) > 1e-5, r  # the microbatched loss is not the batch's
            assert r["per_call"] is not None and "output_router_logits" in r["per_call"], r["per_call"]
        return
    if "interleaved" in case:  # two stages per rank
        assert [r["stages"] for r in world2[case]] == [[0, 2], [1, 3]]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(WORLD4))
def test_pipeline_composes_with_tp_and_fsdp2(world4: CaseResults, case: str) -> None:
    _check(world4[case])
    _, _, layout = WORLD4[case]
    for r in world4[case]:  # microbatches of 1 x 16 tokens
        tokens = 16 // layout.get("cp", 1) // (layout.get("tp", 1) if layout.get("sequence_parallel") else 1)
        assert r["crossing"][1] == tokens, r["crossing"]
        if "priced" in r:
            assert r["priced"] == r["crossing"], r
        assert (sum(r["cp_paths"].values()) > 0) == (layout.get("cp", 1) > 1), r["cp_paths"]


@pytest.mark.slow
def test_fsdp2_gathers_and_reduces_once_per_step_not_per_microbatch(world4: CaseResults) -> None:
    for two, four in zip(world4["rs2"], world4["rs4"], strict=True):
        assert two["calls"] == four["calls"] > 0, (two, four)
        assert two["gathers"] == four["gathers"] > 0, (two, four)


@pytest.mark.slow
def test_delayed_init_under_pp_equals_the_unsplit_layout(world2: CaseResults) -> None:
    for r in world2["meta"]:
        assert r["err"] == 0.0 and 0 < r["n"] < r["total"], r


@pytest.mark.slow
def test_stage_activations_are_priced_within_10_percent(world2: CaseResults) -> None:
    for r in world2["memory"]:
        for stage, sizes in r["ran"].items():
            assert len(set(sizes)) == 1 and len(sizes) == 4, r  # every microbatch the same
            assert abs(r["estimated"][stage] - sizes[0]) <= 0.10 * sizes[0], r


@pytest.mark.slow
def test_clip_grad_norm_is_the_global_norm(world2: CaseResults) -> None:
    for r in world2["clip"]:
        assert abs(r["norm"] - r["ref"]) <= 1e-5 * r["ref"], r


@pytest.mark.slow
def test_what_a_pipeline_cannot_take_is_refused_by_name(world2: CaseResults) -> None:
    for errors in world2["refusals"]:
        wanted = {"encoder_decoder": "encoder", "offloading": "activation_offloading",
                  "too_few_blocks": "blocks", "bad_schedule": "pp_schedule", "forward": "pipeline_step",
                  "tied_v": "tied weights", "data_dependent": "blocks.0.ffn.experts (DbrxExperts",
                  "generate": "save_pretrained", "batch": "pp_microbatches", "no_labels": "labels",
                  "trainer": "pipeline_step"}
        for name, text in wanted.items():
            assert errors[name] is not None and text in errors[name], (name, errors[name])


@pytest.mark.slow
def test_bad_batches_are_refused_on_every_stage(world2: CaseResults) -> None:
    results = world2["bad_batches"]
    for r in results:
        assert r["ids"] is not None and "token id 300 at position [1, 3]" in r["ids"], r
        assert r["labels"] is not None and "label 256 at position [1, 3]" in r["labels"], r
        assert r["differ"] is not None and "different batches" in r["differ"], r
    assert results[0]["after"] == results[1]["after"] and math.isfinite(results[0]["after"]), results


def test_pipeline_step_without_pp_is_forward_and_backward() -> None:
    model, ref = _build("llama"), _build("llama")
    loss = tpcompile.pipeline_step(model, _batch())
    want = ref(**_batch()).loss
    want.backward()
    assert loss.item() == want.item() and not loss.requires_grad
    for (n, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), n


def test_config_keys_reach_the_pipeline_degrees() -> None:
    from tpcompile.config import resolve_config

    smp = resolve_config({"pipeline_parallel_degree": 2, "microbatches": 8, "pp_schedule": "1f1b",
                          "tensor_parallel_degree": 2}, world_size=8)
    assert (smp.pp, smp.pp_microbatches, smp.pp_schedule, smp.tp, smp.dp_shard) == (2, 8, "1f1b", 2, 2)
    acc = resolve_config({"distributed_type": "FSDP", "parallelism_config": {"parallelism_config_pp_size": 2}},
                         world_size=4)
    assert (acc.pp, acc.dp_shard) == (2, 2)
    with pytest.raises(TPError, match="pp_schedule must be"):
        resolve_config({"pp_schedule": 3}, world_size=2)
    with pytest.raises(TPError, match="pp=3"):
        resolve_config({"pipeline_parallel_degree": 3}, world_size=4)


@pytest.mark.slow
def test_verify_pp_passes_and_names_an_injected_fault() -> None:
    from tpcompile.tools.verify import resolve_config, verify

    config, task = resolve_config("llama")
    good = verify(config, tp=1, pp=2, task=task, layers=4)
    assert good.ok and good.pp == 2 and len(good.grads) > 10, good.to_dict()
    bad = verify(config, tp=1, pp=2, task=task, layers=4, fault="model.layers.1.mlp.down_proj")
    assert not bad.ok and "model.layers.1" in (bad.first_divergence() or ""), bad.to_dict()
