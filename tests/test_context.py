"""Context parallelism: sequences split over ranks, exact, on CPU.

Over gloo, every rank handed the same full batch; the model splits each sequence into
mirrored chunks, gathers keys and values in attention and returns the whole sequence's
loss.  Against the single-process model (fp32): the loss, the logits put back in order
(``gather_sequence``) and every gradient within 1e-5 — at cp=2 (world 2) for llama (sdpa
and eager, an odd length, a left-padded batch with an ``attention_mask``), qwen3, mistral
with a sliding window shorter than the sequence, gpt2 (absolute positions), gemma2
(softcapping, alternating windows), mixtral (MoE), packed sequences (position ids
restarting) under activation checkpointing; at cp=2 x tp=2 (with and without sequence
parallelism), dp_shard=2 x cp=2 and dp_shard=2 x cp=2 x ep=2 (world 4); two AdamW steps
equal too; each case asserts which attention core ran (the mask-free blocks or the mask),
and the blocks equal the masked softmax on their own.  A model that mixes positions
outside attention (Mamba's convolution over time) is refused at parallelize time, naming
the module and op; ``generate()`` (a KV cache) is refused clearly, and so are a router's
load-balancing loss and a loader that hands the ranks of a CP group different sequences
(in training and in eval); a sharded checkpoint taken at cp=2 resumes at cp=1.  The cost model's collectives and
activation memory match a real step; ``verify --cp`` passes and names an injected fault.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from dist import CaseResults, run_cases
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import tpcompile
from tpcompile import TPError
from tpcompile.runtime import gather_sequence
from tpcompile.tools.presets import tiny_config

TOL = 1e-5
DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout")
CASES = {  # name: family, attention, length, padded, tp, the attention core it runs, parallelize options
    "llama_sdpa": ("llama", "sdpa", 12, False, 1, "blocks", {}),
    "llama_eager_odd": ("llama", "eager", 13, False, 1, "blocks", {}),
    "llama_padded": ("llama", "sdpa", 11, True, 1, "mask", {}),
    "qwen3_padded_eager": ("qwen3", "eager", 12, True, 1, "mask", {}),
    "mistral_window": ("mistral", "sdpa", 16, False, 1, "blocks", {}),
    "gpt2": ("gpt2", "sdpa", 10, False, 1, "blocks", {}),
    # softcapped scores (the eager core), a sliding window every other layer
    "gemma2_softcap_window": ("gemma2", "eager", 16, False, 1, "mask", {}),
    "mixtral_moe": ("mixtral", "sdpa", 12, False, 1, "blocks", {}),
    # ep=2 carved from the CP group itself (dp_shard 1)
    "cp2_ep2": ("mixtral", "sdpa", 12, False, 1, "blocks", {"ep": 2}),
}
CASES4 = {
    "cp2_tp2": ("llama", "sdpa", 12, True, 2, "mask", {}),
    "dp2_cp2": ("qwen3", "eager", 11, False, 1, "blocks", {}),
    "cp2_tp2_sp": ("llama", "sdpa", 12, False, 2, "blocks", {"sequence_parallel": True}),
    "cp2_tp2_sp_padded": ("qwen3", "eager", 11, True, 2, "mask", {"sequence_parallel": True}),
    # ep=2 carved from dp_shard 2 x cp 2: each EP group is one CP group
    "dp2_cp2_ep2": ("mixtral", "sdpa", 12, False, 1, "blocks", {"ep": 2}),
}


def _build(name: str, attn: str) -> torch.nn.Module:
    cfg = tiny_config(name)
    cfg._attn_implementation = attn
    if name in ("mistral", "gemma2"):
        cfg.sliding_window = 5  # shorter than the sequence: the window crosses chunks
    for key in DROPOUTS:
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _batch(length: int, padded: bool) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(3))
    if not padded:
        return {"input_ids": ids, "labels": ids}
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding in one row
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _compare(rank: int, world: int, name: str, attn: str, length: int, padded: bool, tp: int, core: str,
             options: dict) -> dict[str, Any]:
    ref = _build(name, attn)
    model = tpcompile.parallelize(copy.deepcopy(ref), tp=tp, cp=2, **options)
    batch = _batch(length, padded)
    out, want = model(**batch), ref(**batch)
    out.loss.backward()
    want.loss.backward()
    logits = gather_sequence(model, out.logits)
    keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    grads = dict(ref.named_parameters())
    grad = max(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - grads[n].grad).abs().max().item()
               for n, p in model.named_parameters())
    # two AdamW steps: the losses stay equal
    losses = []
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        opt.step()
        opt.zero_grad()
        losses.append(m(**batch).loss.item())
    return {"loss": (out.loss - want.loss).abs().item(), "logits": (logits[keep] - want.logits[keep]).abs().max().item(),
            "grads": grad, "step2": abs(losses[0] - losses[1]), "shape": list(logits.shape),
            "local": list(out.logits.shape), "dp": list(tpcompile.data_parallel_rank(model)),
            "paths": sorted(model.tpcompile_context.paths), "sp": bool(model.tpcompile_plan.sequence),
            "dispatch": sum(type(m.__dict__.get("forward")).__name__ == "_Dispatch" for m in model.modules())}


def _packed(rank: int, world: int) -> dict[str, float]:
    """Three documents packed in one row (position ids restarting, no cache): each attends
    to itself only, as transformers' own mask does; with activation checkpointing, whose
    recompute runs the gathered attention again in backward."""
    ref = _build("llama", "sdpa")
    model = tpcompile.parallelize(copy.deepcopy(ref), cp=2, activation_checkpointing=True)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "labels": ids, "use_cache": False,
             "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])}
    out, want = model(**batch), ref(**batch)
    out.loss.backward()
    want.loss.backward()
    grads = dict(ref.named_parameters())
    return {"loss": (out.loss - want.loss).abs().item(),
            "logits": (gather_sequence(model, out.logits) - want.logits).abs().max().item(),
            "grads": max(((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) - grads[n].grad)
                         .abs().max().item() for n, p in model.named_parameters())}


def _refusals(rank: int, world: int, out: str) -> dict[str, str]:
    from transformers import MambaConfig

    result: dict[str, Any] = {}
    with torch.device("meta"):
        mamba = AutoModelForCausalLM.from_config(MambaConfig(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                                                             state_size=8))
    try:
        tpcompile.parallelize(mamba, cp=2, seed=0)
    except TPError as err:
        result["mamba"] = str(err)
    # a router's load-balancing loss averages over the whole sequence: refused
    cfg = tiny_config("mixtral", output_router_logits=True)
    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(cfg)
    try:
        tpcompile.parallelize(moe, cp=2, seed=0)
    except TPError as err:
        result["router"] = str(err)
    # a sharded checkpoint at cp=2 resumes at cp=1 (CP holds no parameter shards of its own)
    model = tpcompile.parallelize(_build("llama", "sdpa"), cp=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = _batch(12, False)
    model(**batch).loss.backward()
    opt.step()
    tpcompile.checkpoint.save(out, model, opt, kind="sharded", step=1)
    want = model(**batch).loss.item()
    plain = tpcompile.parallelize(_build("llama", "sdpa"), cp=1)
    opt2 = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    tpcompile.checkpoint.load(out, plain, opt2)
    result["resumed"] = abs(plain(**batch).loss.item() - want)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(1))
    try:
        model.generate(ids, max_new_tokens=2, do_sample=False)
    except TPError as err:
        result["generate"] = str(err)
    # a loader that hands the ranks of a CP group different sequences is refused
    other = tpcompile.parallelize(_build("llama", "sdpa"), cp=2)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(rank))
    try:
        other(input_ids=ids, labels=ids)
    except TPError as err:
        result["batches"] = str(err)
    other = tpcompile.parallelize(_build("llama", "sdpa"), cp=2).eval()  # an evaluation loop too
    try:
        with torch.no_grad():
            other(input_ids=ids, labels=ids)
    except TPError as err:
        result["eval_batches"] = str(err)
    return result


def _step_counts(model: torch.nn.Module, batch: dict) -> dict[str, dict[str, tuple[int, int]]]:
    """(count, bytes passed in) of every all_gather / reduce_scatter_tensor / all_reduce in
    one forward and one backward, after two warm-up steps (one-time checks)."""
    import contextlib

    import torch.distributed as dist

    for _ in range(2):
        model(**batch).loss.backward()
    log: dict[str, list[int]] = {}
    wrapped = {"all_gather": 1, "reduce_scatter_tensor": 1, "all_reduce": 0}

    @contextlib.contextmanager
    def counting() -> Any:
        saved = {n: getattr(dist, n) for n in wrapped}

        def wrap(name: str, where: int) -> Any:
            def counted(*args: Any, **kwargs: Any) -> Any:
                t = args[where]
                log.setdefault(name, []).append(t.numel() * t.element_size())
                return saved[name](*args, **kwargs)
            return counted
        for n, where in wrapped.items():
            setattr(dist, n, wrap(n, where))
        try:
            yield
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)

    out = {}
    with counting():
        loss = model(**batch).loss
    out["forward"], log = {k: (len(v), sum(v)) for k, v in log.items()}, {}
    with counting():
        loss.backward()
    out["backward"] = {k: (len(v), sum(v)) for k, v in log.items()}
    return out


def _counted(rank: int, world: int) -> dict:
    """CP's collectives as run (cp=2 minus cp=1, which keeps FSDP2's) equal dump-plan --cp's."""
    from tpcompile.tools.cost import estimate_cost

    batch = _batch(12, False)
    ran = [_step_counts(tpcompile.parallelize(_build("llama", "sdpa"), cp=c), batch) for c in (1, 2)]
    with torch.device("meta"):
        meta = _build("llama", "sdpa")
    plan = tpcompile.plan_model(meta, tp=1)
    priced = {}
    for phase in ("forward", "backward"):
        steps = [estimate_cost(meta, plan, batch=2, seq=12, cp=c)["per_step"][phase] for c in (1, 2)]
        priced[phase] = {op: (steps[1][op]["count"] - steps[0][op]["count"], steps[1][op]["bytes"] - steps[0][op]["bytes"])
                         for op in ("all_gather", "reduce_scatter_tensor", "all_reduce")}
    diff = {phase: {op: tuple(b - a for a, b in zip(ran[0][phase].get(op, (0, 0)), ran[1][phase].get(op, (0, 0)),
                                                      strict=True))
                    for op in ("all_gather", "reduce_scatter_tensor", "all_reduce")} for phase in ran[0]}
    return {"ran": diff, "priced": priced}


def _held_after_forward(model: torch.nn.Module, batch: dict) -> tuple[int, int]:
    """Bytes autograd holds at the end of one forward with labels (parameters excluded;
    each storage once, its size read after the forward: FSDP2's unsharded weights, freed
    by then, count 0), and the part saved inside CP's attention."""
    from transformers import AttentionInterface

    from tpcompile.runtime import context

    params = {getattr(p, "_local_tensor", p).untyped_storage().data_ptr() for p in model.parameters()}
    held: dict[int, Any] = {}
    attention: set[int] = set()
    inside = [False]

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = getattr(t, "_local_tensor", t).untyped_storage()
        if s.data_ptr() not in params:  # keyed by the storage: freed memory is reused
            held.setdefault(s._cdata, s)
            if inside[0]:
                attention.add(s._cdata)
        return t

    def marked(*args: Any, **kwargs: Any) -> Any:
        inside[0] = True
        try:
            return context.cp_attention(*args, **kwargs)
        finally:
            inside[0] = False

    AttentionInterface.register(context.ATTENTION_KEY, marked)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**batch).loss.item()
    finally:
        AttentionInterface.register(context.ATTENTION_KEY, context.cp_attention)
    return sum(s.nbytes() for s in held.values()), sum(held[p].nbytes() for p in attention)


def _estimated(rank: int, world: int) -> dict[str, tuple]:
    """dump-plan --cp 2 --batch 2 --seq S's activation memory per rank against what a real
    cp=2 forward holds: llama (blocks), mistral with a window and an odd length (band-masked
    blocks, CP padding), qwen3 eager with a padding mask (the [s_local, S] mask path's
    bytes are the estimate's too: it runs the same attention)."""
    from tpcompile.tools.cost import estimate_cost

    out = {}
    for name, attn, length in (("llama", "sdpa", 64), ("mistral", "sdpa", 61), ("gemma2", "eager", 48)):
        model = tpcompile.parallelize(_build(name, attn), cp=2)
        ids = torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(0))
        measured = _held_after_forward(model, {"input_ids": ids, "labels": ids})
        with torch.device("meta"):
            meta = _build(name, attn)
        found = estimate_cost(meta, tpcompile.plan_model(meta, tp=1), batch=2, seq=length, cp=2)["activations"]
        out[name] = (measured, (found["bytes"], found["attention"]), sorted(model.tpcompile_context.paths))
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> CaseResults:
    cases: dict = {key: (_compare, *spec) for key, spec in CASES.items()}
    cases["refusals"] = (_refusals, str(tmp_path_factory.mktemp("cp")))
    cases["counted"] = (_counted,)
    cases["packed"] = (_packed,)
    cases["estimated"] = (_estimated,)
    return run_cases(2, cases, timeout=900)


@pytest.fixture(scope="module")
def world4() -> CaseResults:
    return run_cases(4, {key: (_compare, *spec) for key, spec in CASES4.items()}, timeout=900)


def _check(r: dict, spec: tuple) -> None:
    assert r["loss"] < TOL and r["logits"] < TOL and r["grads"] < TOL and r["step2"] < 1e-4, r
    assert r["shape"][1] == spec[2] and r["local"][1] < spec[2], r  # split, and put back whole
    # plain causal positions run as blocks (no [s_local, S] mask); padding or softcapping
    # need the mask
    assert r["paths"] == [spec[5]], r
    assert r["sp"] == spec[6].get("sequence_parallel", False), r
    assert (r["dispatch"] > 0) == ("ep" in spec[6]), r  # the experts dispatch over ep ranks


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_block_attention_equals_the_masked_softmax(cp: int, dtype: torch.dtype) -> None:
    """Each rank's two chunks against every key, as flash blocks merged by log-sum-exp,
    equal sdpa with the whole causal (and sliding-window) mask: output and the gradients
    of queries, keys and values; GQA (4 query heads on 2 key heads); float64 to rounding."""
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from tpcompile.runtime.context_attention import block_attention, block_layout

    length, tol = 32, (1e-12 if dtype == torch.float64 else TOL)
    chunk = length // (2 * cp)
    gen = torch.Generator().manual_seed(0)
    q_all, k, v, grad = (torch.randn(2, h, length, 8, generator=gen, dtype=dtype) for h in (4, 2, 2, 4))
    for rank in range(cp):
        mine = torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk),
                          torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)])
        for window in (None, 1, 3, chunk, chunk + 1, 2 * chunk + 3, length - 1, length):
            got, want = [], []
            for fn, into in ((True, got), (False, want)):
                q, kk, vv = (t.clone().requires_grad_() for t in (q_all[:, :, mine], k, v))
                if fn:
                    out = block_attention(q, kk, vv, block_layout(rank, cp, length, window, dtype, q.device), None)
                else:
                    qp, kp = mine[:, None], torch.arange(length)[None]
                    ok = (kp <= qp) & ((qp - kp < window) if window else True)
                    out = sdpa(q, kk, vv, attn_mask=ok, enable_gqa=True)
                (out * grad[:, :, mine]).sum().backward()
                into.extend([out.detach(), q.grad, kk.grad, vv.grad])
            err = max((a - b).abs().max().item() for a, b in zip(got, want, strict=True))
            assert err < tol, (rank, window, err)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_context_parallel_cp2_is_exact(world2: CaseResults, case: str) -> None:
    for r in world2[case]:
        _check(r, CASES[case])
        assert r["dp"] == [0, 1], r  # both ranks of the CP group get the same batch


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES4))
def test_context_parallel_composes_with_tp_and_fsdp(world4: CaseResults, case: str) -> None:
    for rank, r in enumerate(world4[case]):
        _check(r, CASES4[case])
        if case == "dp2_cp2":  # ranks 0,1 one CP group, 2,3 the other: two data shards
            assert r["dp"] == [rank // 2, 2], r


@pytest.mark.slow
def test_context_parallel_refuses_what_it_cannot_split(world2: CaseResults) -> None:
    for r in world2["refusals"]:
        assert "mixes positions outside attention" in r["mamba"] and "conv1d" in r["mamba"], r["mamba"]
        assert "mixer" in r["mamba"], r["mamba"]
        assert "KV cache" in r["generate"], r["generate"]
        assert "different batches" in r["batches"], r["batches"]
        assert "different batches" in r.get("eval_batches", ""), r
        assert "output_router_logits" in r["router"], r
        assert r["resumed"] < TOL, r


@pytest.mark.slow
def test_context_parallel_collectives_are_priced_as_they_run(world2: CaseResults) -> None:
    for r in world2["counted"]:
        assert r["ran"] == r["priced"], r
        assert r["ran"]["forward"]["all_gather"][0] > 0 and r["ran"]["backward"]["reduce_scatter_tensor"][0] > 0, r


@pytest.mark.slow
def test_packed_sequences_with_activation_checkpointing(world2: CaseResults) -> None:
    for r in world2["packed"]:
        assert r["loss"] < TOL and r["logits"] < TOL and r["grads"] < TOL, r


@pytest.mark.slow
def test_verify_cli_compares_a_cp_run_per_module(capsys: pytest.CaptureFixture[str]) -> None:
    """``verify MODEL --tp 1 --cp 2``: every module's output on each rank's positions, every
    gradient, the loss and the logits put back in order match the unsplit copy (mixtral:
    its experts read positions merged with the batch); a fault injected into one module on
    one rank is found and named as the first divergence; GPT-OSS (attention sinks, experts)
    passes too."""
    import json

    from tpcompile.tools.cli import main

    assert main(["verify", "mixtral", "--tp", "1", "--cp", "2", "--no-generate", "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["cp"] == 2, report
    compared = [m for m, c in report["forward"].items() if c is not None]
    assert "model.layers.0.mlp.experts" in compared and "lm_head" in compared, compared
    assert report["outputs"]["logits"]["abs"] < TOL and report["outputs"]["loss"]["abs"] < TOL, report
    from tpcompile.tools.verify import resolve_config, verify

    config, task = resolve_config("llama")
    bad = verify(config, tp=1, cp=2, task=task, generate=False, fault="model.layers.1.mlp.up_proj")
    assert not bad.ok and bad.first_divergence() == "model.layers.1.mlp.up_proj (forward)", bad.failing()
    # GPT-OSS: attention sinks (the eager core's extra logits) and its experts
    from transformers import AutoConfig

    sinks = verify(AutoConfig.for_model("gpt_oss"), tp=1, cp=2, task="causal-lm", generate=False)
    assert sinks.ok and "'mask'" in " ".join(sinks.warnings), (sinks.error, sinks.failing(), sinks.warnings)


@pytest.mark.slow
def test_cost_model_activation_memory_matches_a_cp_forward(world2: CaseResults) -> None:
    """The estimate runs CP's own split and attention on fake tensors: its attention part
    equals what the attention saves within 1%, the whole within 5% (it counts the rotary
    tables of repeated blocks once per block)."""
    for r in world2["estimated"]:
        for name, ((held, attention), (total, priced), paths) in r.items():
            assert abs(priced - attention) <= 0.01 * attention, (name, attention, priced, paths)
            assert abs(total - held) <= 0.05 * held, (name, held, total)


def test_dump_plan_prints_cp_attention_memory(capsys: pytest.CaptureFixture[str]) -> None:
    """``dump-plan --cp 2 --batch B --seq S`` adds the activation memory per rank and its
    attention part; the attention part shrinks with cp (the gathered keys and values stay
    whole, the queries, outputs and log-sum-exp are split)."""
    from tpcompile.tools.cli import main
    from tpcompile.tools.cost import estimate_cost

    assert main(["dump-plan", "llama", "--layers", "1", "--tp", "1", "--cp", "2", "--batch", "1", "--seq", "64"]) == 0
    assert "context parallelism cp=2: activations per rank" in capsys.readouterr().out
    with torch.device("meta"):
        meta = _build("llama", "sdpa")
    plan = tpcompile.plan_model(meta, tp=1)
    att = [estimate_cost(meta, plan, batch=2, seq=64, cp=c)["activations"]["attention"] for c in (2, 4)]
    kv = 2 * 2 * 2 * 64 * 16 * 4 * meta.config.num_hidden_layers  # gathered K and V, [2, 2 heads, 64, 16] fp32
    assert kv < att[1] < att[0], (att, kv)
