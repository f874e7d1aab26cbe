"""transform() end to end over real gloo process groups: numerics, gradients, generate.

Every test compares the tensor-parallel model with the untransformed one built from the
same seed: forward logits, loss, and every parameter's gradient reassembled from the
shards with the plan's own index map.  All cases of one world size run in one launch
(module fixtures ``world2`` / ``world4``); each test reads and checks its own case.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers as hf
from dist import CaseResults, plan_ahead, run_cases
from torch.distributed.tensor import DTensor

import tpcompile
from tpcompile import TPError
from tpcompile.tools.presets import tiny_config

TOL = 1e-5


def _build(name: str, overrides: dict) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    torch.manual_seed(0)
    cfg = tiny_config(name, **overrides)
    auto = AutoModelForMaskedLM if name == "bert" else AutoModelForCausalLM
    return auto.from_config(cfg).eval()


def grad_errors(model: torch.nn.Module, ref: torch.nn.Module, tp: int) -> dict[str, float]:
    """Max abs difference of every gradient, the TP one mapped back to HF rows."""
    plan = model.tpcompile_plan
    ref_params = dict(ref.named_parameters())
    errors: dict[str, float] = {}
    for name, p in model.named_parameters():
        want = ref_params[name].grad
        g = p.grad
        if g is None or want is None:  # unused by the loss (a pooler): both must agree
            errors[name] = 0.0 if g is None and want is None else float("inf")
            continue
        pp = plan.params[name]
        if isinstance(g, DTensor) and pp.shard_dim is None:
            g = g.full_tensor()
        if isinstance(g, DTensor):
            chunks = g.full_tensor().chunk(tp, dim=pp.shard_dim)
            index = torch.as_tensor(pp.index())
            err = 0.0
            for r in range(tp):
                keep = index[r] >= 0
                got = chunks[r].index_select(pp.shard_dim, torch.nonzero(keep).flatten())
                exp = want.index_select(pp.shard_dim, index[r][keep])
                err = max(err, (got - exp).abs().max().item())
            errors[name] = err
        else:
            errors[name] = (g - want).abs().max().item()
    return errors


def _transformed_step(ref: torch.nn.Module, tp: int) -> tuple[torch.nn.Module, Any, Any]:
    """A copy of ``ref`` transformed at ``tp``, and both models' outputs of one forward
    and backward on the same batch (labels = ids)."""
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    out_ref = ref(ids, labels=ids)
    out_ref.loss.backward()
    tpcompile.transform(model, tp=tp)
    out = model(ids, labels=ids)
    out.loss.backward()
    return model, out, out_ref


def _equivalence(rank: int, world: int, name: str, tp: int, overrides: dict) -> dict:
    ref = _build(name, overrides)
    model, out, out_ref = _transformed_step(ref, tp)
    roles = {p.role.value for p in model.tpcompile_plan.params.values()}
    return {
        "logits": (out.logits - out_ref.logits).abs().max().item(),
        "loss": (out.loss - out_ref.loss).abs().item(),
        "grads": grad_errors(model, ref, tp),
        "roles": sorted(roles),
    }


CASES = [
    ("llama", 2, {}),
    ("mistral", 2, {}),
    ("qwen2", 2, {}),
    ("qwen3", 2, {}),
    ("gemma2", 2, {}),
    ("phi3", 2, {}),
    ("gpt2", 2, {}),
    ("gpt_neox", 2, {}),
    ("mixtral", 2, {}),
    ("bert", 2, {}),
    # KV-head replication: tp > num_key_value_heads
    ("llama", 2, {"num_key_value_heads": 1}),
    ("llama", 4, {"num_key_value_heads": 2}),
    ("qwen3", 2, {"num_key_value_heads": 1}),
    ("mistral", 4, {"num_key_value_heads": 2}),
    ("qwen2", 2, {"num_key_value_heads": 1}),
]


def _case(name: str, tp: int, overrides: dict) -> str:
    return f"{name} tp={tp} {overrides}"


def _cases(world: int) -> dict[str, tuple]:
    """Every case this module runs at ``world`` processes, by name."""
    jobs = [(_build, (name, overrides), {"tp": tp}) for name, tp, overrides in CASES if tp == world]
    cases: dict[str, tuple] = {"plans": (plan_ahead, jobs)}  # first: the ranks plan side by side
    cases.update({_case(*c): (_equivalence, *c) for c in CASES if c[1] == world})
    if world == 2:
        cases.update({"generate": (_generate,), "loss_parallel": (_loss_parallel,),
                      "backward_all_reduces": (_backward_all_reduces,), "foreach": (_foreach_step,),
                      "embedding_tail": (_embedding_tail, False), "embedding_tail_mixing": (_embedding_tail, True),
                      "outside_read": (_outside_read,), "gathered_head": (_gathered_head,), "grad_hooks": (_grad_hooks,),
                      "attention_maps": (_attention_maps,), "sampling": (_sampling,),
                      "dropout_rng": (_dropout_rng,), "dropout_exact": (_dropout_exact,), "reshaping": (_reshaping,),
                      "batch_norm": (_batch_norm_training,), "hf_checkpointing": (_hf_checkpointing,)})
    return cases


@pytest.fixture(scope="module")
def world2() -> CaseResults:
    return run_cases(2, _cases(2), timeout=900)


@pytest.fixture(scope="module")
def world4() -> CaseResults:
    return run_cases(4, _cases(4), timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "tp", "overrides"), CASES, ids=lambda v: str(v))
def test_family_matches_unsharded(
    name: str, tp: int, overrides: dict, request: pytest.FixtureRequest
) -> None:
    results = request.getfixturevalue(f"world{tp}")[_case(name, tp, overrides)]
    for r in results:
        assert r["logits"] < TOL, r
        assert r["loss"] < TOL, r
        worst = max(r["grads"].items(), key=lambda kv: kv[1])
        assert worst[1] < TOL, f"gradient of {worst[0]} off by {worst[1]}"
        assert "column" in r["roles"] and "row" in r["roles"], r["roles"]


def _generate(rank: int, world: int) -> tuple[list, list]:
    ref = _build("llama", {})
    model = copy.deepcopy(ref)
    tpcompile.transform(model, tp=world)
    prompt = torch.randint(0, 256, (2, 5), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0)
    return ref.generate(prompt, **kw).tolist(), model.generate(prompt, **kw).tolist()


@pytest.mark.slow
def test_generate_greedy_tokens_match(world2: CaseResults) -> None:
    for want, got in world2["generate"]:
        assert got == want


def _loss_parallel(rank: int, world: int) -> tuple[float, float, float]:
    ref = _build("llama", {})
    model = copy.deepcopy(ref)
    tpcompile.transform(model, tp=world, loss_parallel=True)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    out_ref, out = ref(ids, labels=ids), model(ids, labels=ids)
    out_ref.loss.backward()
    out.loss.backward()
    local_vocab = out.logits.shape[-1]
    errs = grad_errors(model, ref, world)
    return (out.loss - out_ref.loss).abs().item(), float(local_vocab), max(errs.values())


@pytest.mark.slow
def test_loss_parallel_keeps_logits_sharded(world2: CaseResults) -> None:
    for loss_err, local_vocab, grad_err in world2["loss_parallel"]:
        assert loss_err < TOL
        assert local_vocab == 128  # 256 / tp: the full logits never exist
        assert grad_err < TOL


def _backward_all_reduces(rank: int, world: int) -> int:
    import torch.distributed as dist

    model = _build("llama", {})
    tpcompile.transform(model, tp=world)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    loss = model(ids, labels=ids).loss
    calls = []
    original = dist.all_reduce

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003 - a transparent wrapper
        calls.append(args[0].shape)
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        loss.backward()
    finally:
        dist.all_reduce = original
    return len(calls)


@pytest.mark.slow
def test_one_backward_all_reduce_per_tp_region(world2: CaseResults) -> None:
    # q|k|v share one input, gate|up another: one all-reduce each, plus the LM head's input
    layers = tiny_config("llama").num_hidden_layers
    assert world2["backward_all_reduces"] == [2 * layers + 1] * 2


def _foreach_step(rank: int, world: int) -> float:
    ref = _build("llama", {})
    model = copy.deepcopy(ref)
    tpcompile.transform(model, tp=world)
    assert all(isinstance(p, DTensor) for p in model.parameters())  # no Tensor/DTensor mix
    # default mode: logits are gathered for the caller, the loss runs on the local shard
    assert model.loss_function.__name__ == "loss_function"
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    for m in (ref, model):
        m(ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5, foreach=True)
        torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=True).step()
    with torch.no_grad():
        return (model(ids).logits - ref(ids).logits).abs().max().item()


@pytest.mark.slow
def test_foreach_optimizer_and_grad_clipping_work(world2: CaseResults) -> None:
    # GPU optimizers default to foreach kernels, which reject a mix of DTensors and tensors
    assert max(world2["foreach"]) < TOL


class _NormedEmbedding(torch.nn.Embedding):
    """An embedding whose forward goes on after the lookup (Inkling's normed embedding):
    a LayerNorm with a bias, or (``mix``) a running sum over the positions first."""

    def __init__(self, rows: int, width: int, mix: bool) -> None:
        super().__init__(rows, width)
        self.norm, self.mix = torch.nn.LayerNorm(width), mix

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = super().forward(ids)
        return self.norm(rows.cumsum(1) if self.mix else rows)


def _embedding_tail(rank: int, world: int, mix: bool) -> dict:
    ref = _build("llama", {})
    table = ref.model.embed_tokens.weight
    tail = _NormedEmbedding(*table.shape, mix)
    with torch.no_grad():
        tail.weight.copy_(table)
        tail.norm.bias.normal_(generator=torch.Generator().manual_seed(2))
    ref.model.embed_tokens = tail
    model, out, out_ref = _transformed_step(ref, world)
    return {"loss": (out.loss - out_ref.loss).abs().item(), "grads": grad_errors(model, ref, world),
            "table": model.tpcompile_plan.params["model.embed_tokens.weight"].role.value,
            "norm": model.tpcompile_plan.params["model.embed_tokens.norm.weight"].role.value}


def test_embedding_forward_after_its_lookup_is_exact(world2: CaseResults) -> None:
    # a row-wise tail (a norm) keeps the table vocab-parallel; the norm's parameters see
    # only each rank's tokens, so their gradients are summed (they were silently partial)
    for got in world2["embedding_tail"]:
        assert got["loss"] < TOL and max(got["grads"].values()) < TOL, got
        assert (got["table"], got["norm"]) == ("vocab_embedding", "replicated_grad_allreduce")
    # a tail mixing positions would spread the masked rows before they are zeroed: the
    # table stays whole (it computed a different loss)
    for got in world2["embedding_tail_mixing"]:
        assert got["loss"] < TOL and max(got["grads"].values()) < TOL, got
        assert got["table"] == "replicated"


class _PadRow(torch.nn.Module):
    """Reads its inner model's embedding table in its own code, outside the table's
    module (Gemma 4's multimodal model: ``embed_tokens.weight[pad_id, :]`` replaces the
    placeholder tokens' embeddings)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        table = self.inner.model.embed_tokens
        pad = table.weight[0].view(1, 1, -1)
        embeds = torch.where((input_ids < 8)[..., None], pad, table(input_ids))
        return self.inner(inputs_embeds=embeds, labels=labels, use_cache=False)


def _outside_read(rank: int, world: int) -> dict:
    ref = _PadRow(_build("llama", {}))
    model, out, out_ref = _transformed_step(ref, world)  # crashed: the table was a DTensor outside its module
    plan = model.tpcompile_plan
    return {"loss": (out.loss - out_ref.loss).abs().item(), "grads": grad_errors(model, ref, world),
            "table": plan.params["inner.model.embed_tokens.weight"].role.value,
            "scope": plan.params["inner.model.embed_tokens.weight"].scope,
            "mlp": plan.params["inner.model.layers.0.mlp.up_proj.weight"].role.value}


def test_a_parameter_read_outside_its_module_is_whole_and_local_there(world2: CaseResults) -> None:
    for got in world2["outside_read"]:
        assert got["loss"] < TOL and max(got["grads"].values()) < TOL, got
        # whole (a read of one row would see another rank's rows), local for the whole
        # forward of the module whose code reads it (here the root)
        assert (got["table"], got["scope"], got["mlp"]) == ("replicated", "", "column")


def _grad_hooks(rank: int, world: int) -> dict:
    """Gradient hooks registered before transform (a mask on a norm weight's gradient,
    PEFT OSF's projections) run on the transformed parameter as on the plain one; on a
    split parameter they are refused, naming it (deepcopy drops tensor hooks: each model
    registers its own)."""
    def hooked(on: str) -> torch.nn.Module:
        m = _build("llama", {})
        mask = (torch.arange(m.config.hidden_size) % 3 != 0).float()
        m.get_parameter(on).register_hook(lambda g: g * mask)
        return m

    ref, model = hooked("model.norm.weight"), hooked("model.norm.weight")
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    ref(ids, labels=ids).loss.backward()
    tpcompile.transform(model, tp=world)
    model(ids, labels=ids).loss.backward()
    try:
        tpcompile.transform(hooked("model.layers.0.mlp.down_proj.weight"), tp=world)
        refused = ""
    except TPError as err:
        refused = str(err)
    try:  # FSDP2 swaps every parameter for its shard: the hooks would not run
        tpcompile.parallelize(hooked("model.norm.weight"), dp_shard=world)
        fsdp = ""
    except TPError as err:
        fsdp = str(err)
    return {"grads": grad_errors(model, ref, world), "masked": ref.model.norm.weight.grad[::3].abs().max().item(),
            "refused": refused, "fsdp": fsdp}


def _attention_maps(rank: int, world: int) -> dict:
    """``output_attentions=True``: eager attention returns one map per head, each rank
    its own heads (it returned them silently, shaped [B, heads/tp, S, S]): refused; sdpa
    returns none, so the forward runs as asked."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    out: dict = {}
    for attn in ("eager", "sdpa"):
        torch.manual_seed(0)
        cfg = tiny_config("llama")
        cfg._attn_implementation = attn
        ref = AutoModelForCausalLM.from_config(cfg).eval()
        model = tpcompile.transform(copy.deepcopy(ref), tp=world)
        try:
            got = model(ids, output_attentions=True).logits
            out[attn] = (got - ref(ids, output_attentions=True).logits).abs().max().item()
        except TPError as err:
            out[attn] = str(err)
    return out


def _sampling(rank: int, world: int) -> dict:
    """``generate(do_sample=True)`` with each rank seeded apart (a loader's per-rank seed):
    every rank samples what one process seeded as the first rank samples, and keeps its
    own generator afterwards (they drew different tokens and decoded a mix of shards)."""
    ref = _build("llama", {})
    model = tpcompile.transform(copy.deepcopy(ref), tp=world)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    model.generate(ids, max_new_tokens=2, pad_token_id=0)  # spend the input guard's first forwards
    torch.manual_seed(100)
    want = ref.generate(ids, do_sample=True, max_new_tokens=8, pad_token_id=0)
    torch.manual_seed(100 + rank)
    got = model.generate(ids, do_sample=True, max_new_tokens=8, pad_token_id=0)
    after = torch.rand(1).item()
    torch.manual_seed(100 + rank)
    return {"equal": torch.equal(got, want), "own_rng": rank == 0 or after == torch.rand(1).item()}


def _dropout_rng(rank: int, world: int) -> dict:
    """Training with dropout (GPT-2's residual, embedding and attention dropout at 0.1),
    the ranks seeded apart: each rank's copy of the residual stream is the same, and the
    step is the one of ranks seeded alike (the residual masks differed per rank, and the
    all-reduces summed parts of different computations)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(tiny_config("gpt2")).train()
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    out = {}
    for how, seed in (("alike", 5), ("apart", 5 + rank)):
        model = tpcompile.transform(copy.deepcopy(ref), tp=world)
        torch.manual_seed(seed)
        for _ in range(3):  # past the input guard's first forwards
            step = model(ids, labels=ids, output_hidden_states=True)
        hidden = step.hidden_states[-2].detach()
        copies = [torch.zeros_like(hidden) for _ in range(world)]
        dist.all_gather(copies, hidden)
        out[how] = (max((c - hidden).abs().max().item() for c in copies), step.loss.item())
    return {"spread": out["apart"][0], "loss": abs(out["apart"][1] - out["alike"][1])}


def test_dropout_draws_one_mask_per_tp_group(world2: CaseResults) -> None:
    for got in world2["dropout_rng"]:
        assert got == {"spread": 0.0, "loss": 0.0}, got


def _dropout_exact(rank: int, world: int) -> dict:
    """Training with dropout at 0.1 equals one process seeded alike: masks over a rank's
    heads (attention probabilities, eager and SDPA's), its MLP features (T5) and its
    unevenly dealt heads are drawn whole and narrowed, so the masks are one process's
    and so is every draw after them (the residual dropouts); with sequence parallelism
    the stream's masks over the rank's tokens too, also under transformers' gradient
    checkpointing, which recomputes a block without its hooks.  Two steps of loss,
    logits and every gradient; before, the first loss differed by 1e-2 to 5."""
    from families import _config
    from transformers import AutoModelForCausalLM

    def dropping(cfg: object) -> object:
        for key in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "dropout_rate", "dropout",
                "hidden_dropout"):
            if hasattr(cfg, key):
                setattr(cfg, key, 0.1)
        return cfg

    out = {}
    for name, attn, sp in (("gpt2", "eager", False), ("gpt2", "sdpa", False), ("llama", "sdpa", False),
                           ("t5", "sdpa", False), ("falcon_uneven", "eager", False), ("gpt_neox", "eager", True)):
        torch.manual_seed(0)
        if name in ("gpt2", "llama", "gpt_neox"):
            ref = AutoModelForCausalLM.from_config(dropping(tiny_config(name)), attn_implementation=attn)
        else:
            cls, cfg = _config(name, None)
            ref = cls._from_config(dropping(cfg), attn_implementation=attn)
        model = tpcompile.transform(copy.deepcopy(ref).eval(), tp=world, sequence_parallel=sp).train()
        ref.train()
        if sp:
            for m in (ref, model):
                m.gradient_checkpointing_enable()
        ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
        worst = 0.0
        for step in range(2):
            outs = []
            for m in (ref, model):
                torch.manual_seed(100 + step)
                o = m(input_ids=ids, labels=ids)
                o.loss.backward()
                outs.append(o)
            worst = max(worst, abs(outs[0].loss.item() - outs[1].loss.item()),
                        (outs[0].logits - outs[1].logits).abs().max().item())
        out[f"{name}/{attn}{' sp' if sp else ''}"] = (worst, max(grad_errors(model, ref, world).values()))
    return out


def test_dropout_in_training_equals_one_process(world2: CaseResults) -> None:
    for got in world2["dropout_exact"]:
        for case, (worst, grad) in got.items():
            assert worst < 1e-5 and grad < 1e-5, (case, worst, grad)


def _reshaping(rank: int, world: int) -> dict:
    """transformers' methods that change a split shape are refused, naming the fix (they
    crashed in DTensor dispatch: ``aten._is_all_true`` has no sharding strategy)."""
    model = tpcompile.transform(_build("llama", {}), tp=world)
    out = {}
    for name, args in (("resize_token_embeddings", (300,)),):
        try:
            getattr(model, name)(*args)
            out[name] = "ran"
        except TPError as err:
            out[name] = str(err)
    return out


def test_methods_that_reshape_a_split_model_are_refused(world2: CaseResults) -> None:
    for got in world2["reshaping"]:
        assert "resize_token_embeddings" in got, got
        for name, text in got.items():
            assert text.startswith(f"{name}() on a transformed model") and "before tpcompile.transform" in text, text


def test_attention_maps_of_split_heads_are_refused(world2: CaseResults) -> None:
    for got in world2["attention_maps"]:
        assert got["eager"].startswith("output_attentions=True"), got
        assert got["sdpa"] < TOL, got


def test_sampling_draws_the_first_ranks_tokens_on_every_rank(world2: CaseResults) -> None:
    for got in world2["sampling"]:
        assert got == {"equal": True, "own_rng": True}, got


def test_gradient_hooks_run_on_the_transformed_parameters(world2: CaseResults) -> None:
    for got in world2["grad_hooks"]:
        assert max(got["grads"].values()) < TOL and got["masked"] == 0.0, got
        assert "down_proj.weight has gradient hooks" in got["refused"], got["refused"]
        assert "model.norm.weight has gradient hooks" in got["fsdp"] and "FSDP2" in got["fsdp"], got["fsdp"]


class _HeadRead(torch.nn.Module):
    """Returns a projected hidden state and projects it once more (AIMv2's pooling head,
    returned as ``pooler_output`` and read by ``visual_projection``): the first projection
    is a head the runtime gathers, so the second reads it whole."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        width = inner.config.hidden_size
        self.inner, self.head, self.proj = inner, torch.nn.Linear(width, 2 * width), torch.nn.Linear(2 * width, width)

    def forward(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        pooled = self.head(self.inner.model(input_ids).last_hidden_state)
        return {"pooled": pooled, "embeds": self.proj(pooled)}


def _gathered_head(rank: int, world: int) -> dict:
    ref = _HeadRead(_build("llama", {}))
    model = copy.deepcopy(ref)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))

    def step(m: torch.nn.Module) -> dict[str, torch.Tensor]:
        out = m(ids)
        (out["pooled"].square().mean() + out["embeds"].square().mean()).backward()
        return out

    want = step(ref)
    tpcompile.transform(model, tp=world)  # refused before: the self-check saw proj take a split input
    got = step(model)
    roles = {k: model.tpcompile_plan.params[f"{k}.weight"].role.value
             for k in ("head", "proj", "inner.model.layers.0.mlp.up_proj")}
    return {"out": max((got[k] - want[k]).abs().max().item() for k in want),
            "grads": grad_errors(model, ref, world), "roles": roles}


def test_a_head_the_model_returns_and_reads_on_is_whole_for_its_reader(world2: CaseResults) -> None:
    for got in world2["gathered_head"]:
        assert got["out"] < TOL and max(got["grads"].values()) < TOL, got
        # the head whole; its reader, whose output is returned too, is now the gathered head
        assert got["roles"] == {"head": "replicated", "proj": "lm_head", "inner.model.layers.0.mlp.up_proj": "column"}


def _batch_norm_training(rank: int, world: int) -> dict:
    """MobileNetV2 trained two AdamW steps in training mode: BatchNorm over split
    channels normalizes each rank's channels with their batch statistics and updates
    their running statistics, which the runtime writes back whole on every rank."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(0)
    cfg = MobileNetV2Config(image_size=32, depth_multiplier=0.35, num_labels=10, classifier_dropout_prob=0.0)
    # float64: a batch statistic over 4 images at 1x1 makes large, ill-conditioned
    # gradients, where fp32 rounding alone moves them by 1e-3 (measured); exactness shows in float64
    ref = MobileNetV2ForImageClassification(cfg).double().train()
    model = copy.deepcopy(ref)
    tpcompile.transform(model, tp=world)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 3, 32, 32, generator=gen, dtype=torch.float64), torch.randint(0, 10, (4,), generator=gen))
               for _ in range(2)]
    losses, grads = [], {}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    for i, (x, y) in enumerate(batches):
        pair = [m(pixel_values=x, labels=y).loss for m in (model, ref)]
        for loss in pair:
            loss.backward()
        losses.append(abs(pair[0].item() - pair[1].item()))
        if i == 0:
            grads = grad_errors(model, ref, world)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    want = ref.state_dict()
    stats = {k: (v - want[k]).abs().max().item() for k, v in model.state_dict().items() if "running_" in k}
    with torch.no_grad():
        x = batches[0][0]
        logits = (model.eval()(pixel_values=x).logits - ref.eval()(pixel_values=x).logits).abs().max().item()
    bn = model.tpcompile_plan.params["mobilenet_v2.conv_stem.first_conv.normalization.weight"]
    return {"losses": losses, "grads": grads, "stats": stats, "logits": logits, "bn": bn.role.value}


def test_batch_norm_over_split_channels_trains_and_keeps_its_running_statistics(world2: CaseResults) -> None:
    for got in world2["batch_norm"]:
        assert max(got["losses"]) < TOL and max(got["grads"].values()) < TOL, got
        # every running mean and variance equals one process's on every rank (each rank
        # updated its own channels; without the write-back the others stayed at init)
        assert len(got["stats"]) >= 60 and max(got["stats"].values()) < TOL, got["stats"]
        assert got["logits"] < TOL and got["bn"] == "sharded", got


def _hf_checkpointing(rank: int, world: int) -> dict[str, tuple[float, float, bool]]:
    """transformers' own ``gradient_checkpointing_enable()`` (what the Trainer calls for
    ``gradient_checkpointing=True``), before or after ``transform``, either reentrancy:
    the recomputed forward runs the hooks and collectives again."""
    out = {}
    for attn in ("sdpa", "eager"):
        for reentrant in (True, False):
            for when in ("before", "after"):
                torch.manual_seed(0)
                ref = hf.LlamaForCausalLM(hf.LlamaConfig(
                    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, attn_implementation=attn))
                model = copy.deepcopy(ref)
                kw = {"gradient_checkpointing_kwargs": {"use_reentrant": reentrant}}
                if when == "before":
                    model.gradient_checkpointing_enable(**kw)
                tpcompile.transform(model, tp=world)
                if when == "after":
                    model.gradient_checkpointing_enable(**kw)
                ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(1))
                want, got = ref(input_ids=ids, labels=ids).loss, model(input_ids=ids, labels=ids).loss
                want.backward(), got.backward()
                out[f"{attn} reentrant={reentrant} {when}"] = (
                    abs(got.item() - want.item()), max(grad_errors(model, ref, world).values()),
                    model.is_gradient_checkpointing)
    return out


def test_transformers_gradient_checkpointing_keeps_the_gradients(world2: CaseResults) -> None:
    for per_case in world2["hf_checkpointing"]:
        assert len(per_case) == 8
        for name, (loss_err, grad_err, on) in per_case.items():
            assert on and loss_err < 1e-5 and grad_err < 1e-5, name


@pytest.mark.parametrize("family", ["mixtral", "llama"])
def test_planning_leaves_transformers_output_capture_whole(family: str) -> None:
    """The capture traces a copy of the stack cut to one block; transformers installs its
    output-capture hooks at a model's first forward, on the modules present then.  Were
    they left from the cut trace, every later forward would record one layer's router
    logits (a silently different MoE load-balancing loss) and too few hidden states."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family)
    cfg.num_hidden_layers = 4
    if family == "mixtral":
        cfg.output_router_logits = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    ref = copy.deepcopy(model)
    tpcompile.plan_model(model, 2)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    got, want = (m(input_ids=ids, labels=ids, output_hidden_states=True) for m in (model, ref))
    assert len(got.hidden_states) == len(want.hidden_states) == 5
    assert torch.equal(got.loss, want.loss)
    if family == "mixtral":
        assert len(got.router_logits) == 4 and torch.equal(got.aux_loss, want.aux_loss)
