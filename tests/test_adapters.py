"""Adapters on a transformed model (PEFT LoRA), in either order, exact.

Over gloo at tp=2, against a single-process PEFT model built with the same seeds (so the
adapters' random initialisation must match too):

* ``get_peft_model`` *after* ``transform`` (llama eager and sdpa; gpt2's fused
  ``c_attn`` Conv1D; phi3's fused ``qkv_proj`` / ``gate_up_proj``): the adapters are
  planned from the adapted model's dataflow when PEFT first walks the model, so an
  optimizer built right after holds the planned parameters; 3 AdamW losses (rel 1e-4)
  and every gradient of step 1 in HF rows (1e-5); the same trainable parameters;
* ``transform`` of a ``PeftModel`` (the other order): logits, loss, every gradient; and
  LoRA with ``parallelize`` at dp_shard 2 x tp 2 (world 4) in both orders: 3 AdamW losses;
* a hand-written adapter module is planned the same way; one that would re-split the
  module under it, or one added after ``parallelize`` with activation checkpointing, is
  refused naming it;
* other kinds: IA3, LoRA on the embedding and on the LM head exact in both orders,
  ``modules_to_save``, DoRA and DeLoRA exact when added first (DoRA refused after, naming why);
* saving: adapter files (PEFT's format, HF shapes, rank 0) that plain PEFT loads onto an
  untransformed base; ``PeftModel.from_pretrained(transformed_base, dir)``;
  ``merge_and_unload`` (the merged TP model) and its ``save_pretrained`` loaded by plain
  transformers — in both orders; a sharded training checkpoint holds the adapters and
  their optimizer state, and resumes.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from dist import CaseResults, global_step, plan_ahead, run_cases
from hf_grads import hf_grads
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

import tpcompile
from tpcompile import TPError
from tpcompile.tools.presets import tiny_config

pytest.importorskip("peft")

TOL = 1e-5
DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout")
AFTER = {  # family, attention, LoRA targets (fused layouts included)
    "llama_eager": ("llama", "eager", ["q_proj", "v_proj", "down_proj"]),
    "llama_sdpa": ("llama", "sdpa", ["q_proj", "v_proj", "down_proj"]),
    "gpt2_sdpa": ("gpt2", "sdpa", ["c_attn", "c_proj", "c_fc"]),
    "phi3_eager": ("phi3", "eager", ["qkv_proj", "gate_up_proj", "o_proj"]),
    # one KV head on both ranks (kv_replicated): the adapted twin takes the HF shape of
    # k_proj / v_proj, not the DTensor's tp x local rows
    "llama_kv1_sdpa": ("llama_kv1", "sdpa", ["k_proj", "v_proj", "o_proj"]),
}


def _build(name: str = "llama", attn: str = "sdpa", train: bool = True) -> torch.nn.Module:
    family, _, kv = name.partition("_kv")  # "llama_kv1": the tiny llama with one KV head
    cfg = tiny_config(family, **({"num_key_value_heads": int(kv)} if kv else {}))
    for key in DROPOUTS:
        if hasattr(cfg, key):
            setattr(cfg, key, 0.0)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).train(train)


def _lora(targets: list[str], **kw: Any) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, target_modules=targets, lora_dropout=0.0, **kw)


def _adapted(cls: str, kw: dict[str, Any], train: bool = True) -> torch.nn.Module:
    """A PEFT model of ``peft.<cls>(**kw)`` around a fresh ``_build()`` (in eval mode unless ``train``)."""
    import peft

    base = _build(train=train)
    return peft.get_peft_model(base, getattr(peft, cls)(**kw))


def _hf_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every gradient of a PEFT model around a transformed one, in HF rows (collective)."""
    part = model.get_base_model()
    prefix = next(n for n, m in model.named_modules() if m is part) + "."
    return hf_grads(part, part.tpcompile_mesh.size(), prefix)


def _train(model: torch.nn.Module, ids: torch.Tensor) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, grads = [], {}
    for step in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if step == 0:
            grads = (_hf_grads(model) if hasattr(model.get_base_model(), "tpcompile_table") else
                     {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def _after(rank: int, world: int, name: str, attn: str, targets: list[str]) -> dict:
    """get_peft_model after transform vs a single-process PEFT model, same seeds."""
    from peft import get_peft_model

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    base = _build(name, attn)
    torch.manual_seed(1)
    ref = get_peft_model(base, _lora(targets))
    transformed = tpcompile.transform(_build(name, attn), tp=world)
    torch.manual_seed(1)
    model = get_peft_model(transformed, _lora(targets))
    replans = transformed.tpcompile_plan.stats.get("replans")
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    dtensors = all(isinstance(p, DTensor) for n, p in model.named_parameters() if "lora_" in n)
    ref_losses, ref_grads = _train(ref, ids)
    losses, grads = _train(model, ids)
    return {"losses": losses, "ref_losses": ref_losses, "dtensors": dtensors, "replans": replans,
            "trainable": trainable == sorted(n for n, p in ref.named_parameters() if p.requires_grad),
            "n_trainable": len(trainable), "grad_keys": sorted(grads) == sorted(ref_grads),
            "grads": max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads),
            "lora_split": sorted({str(p.placements[0]) for n, p in model.named_parameters() if "lora_" in n})}


def _before(rank: int, world: int) -> dict:
    """transform of a PeftModel: the adapters are planned with the rest."""
    from peft import get_peft_model
    from test_transform import grad_errors

    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    ref = get_peft_model(_build().eval(), _lora(["q_proj", "down_proj"], init_lora_weights=False))
    model = tpcompile.transform(copy.deepcopy(ref), tp=world)
    r, o = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
    r.loss.backward()
    o.loss.backward()
    q = model.tpcompile_plan.params["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    return {"logits": (r.logits - o.logits).abs().max().item(), "loss": (r.loss - o.loss).abs().item(),
            "grads": max(grad_errors(model, ref, world).values()), "q_split": q.shard_dim,
            "lora_grads": sum(1 for n, p in model.named_parameters() if "lora_" in n and p.grad is not None)}


def _lora_dropout(rank: int, world: int) -> dict:
    """LoRA training with ``lora_dropout=0.1`` on every linear equals one process seeded
    alike, in both orders: the dropout on a row-parallel layer's input (its split
    features, before ``lora_A``) draws one process's mask (its gradients were 0.12 off)."""
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))

    def config() -> Any:
        return LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.1, init_lora_weights=False)

    torch.manual_seed(1)
    ref = get_peft_model(_build(), config())
    torch.manual_seed(7)
    want = ref(input_ids=ids, labels=ids).loss
    want.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    out = {}
    for order in ("before", "after"):
        torch.manual_seed(1)
        if order == "before":
            model = tpcompile.transform(get_peft_model(_build(), config()), tp=world)
        else:
            model = get_peft_model(tpcompile.transform(_build(), tp=world), config())
            model.load_state_dict(ref.state_dict(), strict=False)
        torch.manual_seed(7)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        got = _grads(model, world)
        out[order] = (abs(loss.item() - want.item()),
                      max((got[n] - g).abs().max().item() for n, g in grads.items() if n in got),
                      len(set(grads) - set(got)))
    return out


KINDS = {  # other adapter kinds: planned exactly, or refused with a TPError
    "ia3": ("IA3Config", {"target_modules": ["k_proj", "down_proj"], "feedforward_modules": ["down_proj"]}),
    "lora_embedding": ("LoraConfig", {"r": 4, "target_modules": ["embed_tokens", "q_proj"]}),
    "modules_to_save": ("LoraConfig", {"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]}),
    "dora": ("LoraConfig", {"r": 4, "target_modules": ["q_proj", "down_proj"], "use_dora": True}),
    # buffers shared by every layer it adapts (export then names modules by access path)
    "vera": ("VeraConfig", {"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}),
    # its vectors (ParameterDicts) applied in the projection's own forward before its split B
    "adalora": ("AdaLoraConfig", {"init_r": 4, "target_r": 2, "total_step": 10,
                                  "target_modules": ["q_proj", "v_proj", "down_proj"]}),
    # its own row product added to its row-parallel base layer's output, inside the wrapper
    "miss": ("MissConfig", {"r": 4, "target_modules": ["q_proj", "down_proj"]}),
    # one vector bank (a ParameterDict) every adapted layer holds and indexes in its forward
    "vblora": ("VBLoRAConfig", {"r": 4, "target_modules": ["q_proj", "v_proj"], "vector_length": 4,
                                "num_vectors": 16}),
    # the input embedding held a second time, as ``word_embeddings``
    "prompt": ("PromptTuningConfig", {"task_type": "CAUSAL_LM", "num_virtual_tokens": 4}),
    # keys and values for every head, passed in as a cache
    "prefix": ("PrefixTuningConfig", {"task_type": "CAUSAL_LM", "num_virtual_tokens": 4}),
    # a constant built from a tensor in its forward, which export cannot trace
    "hra": ("HRAConfig", {"r": 4, "target_modules": ["q_proj"]}),
    # its update scaled by norms of its own delora_B, which follows the heads: a rank's
    # rows would give a partial norm (a silent difference); its creation reads the weights
    "delora": ("DeloraConfig", {"r": 4, "target_modules": ["q_proj", "v_proj", "down_proj"]}),
    # LoRA on the vocabulary-split head: lora_B's logits are gathered like the base's
    "lora_lm_head": ("LoraConfig", {"r": 4, "target_modules": ["lm_head", "q_proj"]}),
}
UNPLANNED = ("prefix", "hra")  # refused before or while tracing: nothing to plan ahead


def _grads(model: torch.nn.Module, world: int) -> dict[str, torch.Tensor]:
    """Every gradient of a PEFT model, transformed whole or around a transformed model, in
    HF rows under the PEFT model's names (collective)."""
    if "tpcompile_table" in vars(model):  # transformed whole (PEFT forwards a base's attributes)
        return hf_grads(model, world)
    out = _hf_grads(model)
    # parameters outside the transformed model (a prompt encoder) are plain tensors
    out.update({n: p.grad for n, p in model.named_parameters() if p.grad is not None and n not in out})
    return out


def _kinds(rank: int, world: int) -> dict:
    """Each kind in both orders: trained-looking adapter weights (random, copied from the
    reference through the state dict), then logits and loss against one process."""
    import peft

    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    out: dict = {}
    for kind, (cls, kw) in KINDS.items():
        for order in ("after", "before"):
            try:
                torch.manual_seed(1)
                ref = _adapted(cls, kw)
                with torch.no_grad():
                    for p in ref.parameters():
                        if p.requires_grad:
                            p.add_(torch.randn_like(p) * 0.1)
                if order == "after":
                    model = peft.get_peft_model(tpcompile.transform(_build(), tp=world), getattr(peft, cls)(**kw))
                    model.load_state_dict(ref.state_dict(), strict=False)
                else:
                    model = tpcompile.transform(copy.deepcopy(ref), tp=world)
                a, b = ref(input_ids=ids, labels=ids), model(input_ids=ids, labels=ids)
                a.loss.backward()
                b.loss.backward()
                want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
                got = _grads(model, world)
                assert set(got) == set(want), sorted(set(got) ^ set(want))
                grads = max((got[n] - want[n]).abs().max().item() for n in want)
                out[f"{kind}_{order}"] = ("exact", max((a.logits - b.logits).abs().max().item(),
                                                       (a.loss - b.loss).abs().item(), grads))
            except TPError as err:
                out[f"{kind}_{order}"] = ("refused", str(err))
    return out


def _adalora_allocation(rank: int, world: int) -> dict:
    """AdaLoRA's rank allocation (``update_and_allocate`` in the loop) on a transformed
    model: through the budget's last masking step and past it, against one process."""
    import peft

    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    cfg = peft.AdaLoraConfig(init_r=4, target_r=2, target_modules=["q_proj", "v_proj", "down_proj"],
                             total_step=10, tinit=1, tfinal=3, deltaT=1)
    torch.manual_seed(1)
    ref = peft.get_peft_model(_build(), cfg)
    out: dict = {}
    for key, model in (("ref", ref), ("tp", tpcompile.transform(copy.deepcopy(ref), tp=world))):
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        for step in range(9):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            model.base_model.update_and_allocate(step)
            opt.zero_grad()
            losses.append(loss.item())
        out[key] = losses
        out[f"{key}_pattern"] = model.peft_config["default"].rank_pattern
    return out


def _shared_bank_fsdp(rank: int, world: int) -> dict:
    """VBLoRA's vector bank, one parameter every adapted layer holds (and its tuner), under
    FSDP2 (``parallelize(dp_shard=2)``): the root's unit holds it, not the first block's
    (the second block's unit refused the shard).  3 AdamW steps against one process."""
    import peft
    import torch.distributed as dist

    ids = torch.randint(0, 256, (4, 9), generator=torch.Generator().manual_seed(1))
    cfg = peft.VBLoRAConfig(r=4, target_modules=["q_proj", "v_proj"], vector_length=4, num_vectors=16)
    torch.manual_seed(1)
    ref = peft.get_peft_model(_build(), cfg)
    model = tpcompile.parallelize(copy.deepcopy(ref), dp_shard=world)
    out: dict = {"ref": [], "dp": []}
    for key, m, batch in (("ref", ref, ids), ("dp", model, ids.chunk(world)[rank])):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(3):
            loss = m(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            if key == "dp":  # equal tokens per rank: the mean of the ranks' losses
                dist.all_reduce(mean)
                mean /= world
            out[key].append(mean.item())
    return out


class _Adapter(torch.nn.Module):
    """A LoRA-shaped wrapper added by hand: base(x) + B(A(x))."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base = base
        self.a = torch.nn.Linear(base.in_features, 2, bias=False)
        self.b = torch.nn.Linear(2, base.out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


class _Whole(torch.nn.Module):
    """A wrapper that needs the whole output of the module it wraps (a softmax over it)."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base = base
        self.scale = torch.nn.Parameter(torch.ones(base.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return y * self.scale * y.softmax(-1)


def _by_hand(rank: int, world: int) -> dict:
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    out: dict = {}
    ref, model = _build().eval(), tpcompile.transform(_build().eval(), tp=world)
    model.lm_head = model.lm_head  # set back to itself: still the planned tree
    for m in (ref, model):
        attn = m.model.layers[0].self_attn
        torch.manual_seed(2)
        attn.q_proj = _Adapter(attn.q_proj)
    with torch.no_grad():
        out["by_hand"] = (model(ids).logits - ref(ids).logits).abs().max().item()
    out["b_split"] = str(model.model.layers[0].self_attn.q_proj.b.weight.placements[0])
    whole = tpcompile.transform(_build().eval(), tp=world)
    whole.model.layers[1].mlp.up_proj = _Whole(whole.model.layers[1].mlp.up_proj)
    for i in range(2):  # said when first seen, and again by the next forward
        try:
            whole(ids)
        except TPError as err:
            out[f"whole{i}"] = str(err)
    fsdp = tpcompile.parallelize(_build().eval(), tp=world, activation_checkpointing=True)
    fsdp.model.layers[0].self_attn.q_proj = _Adapter(fsdp.model.layers[0].self_attn.q_proj)
    try:
        list(fsdp.parameters())
    except TPError as err:
        out["parallelized"] = str(err)
    return out


def _saves(rank: int, world: int, out: str, order: str) -> dict:
    """Adapter files, loading onto a transformed base, merging and the merged save."""
    from peft import PeftModel, get_peft_model
    from safetensors.torch import load_file

    lora = _lora(["q_proj", "down_proj"], init_lora_weights=False)
    torch.manual_seed(0)
    ref = get_peft_model(_build().eval(), lora)
    if order == "before":
        model = tpcompile.transform(copy.deepcopy(ref), tp=world)
    else:
        torch.manual_seed(0)
        model = get_peft_model(tpcompile.transform(_build().eval(), tp=world), lora)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    model.save_pretrained(f"{out}/adapter")  # every rank
    result: dict = {}
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        result["logits"] = (model(input_ids=ids).logits - want).abs().max().item()
    if rank == 0:
        files = sorted(p.name for p in Path(f"{out}/adapter").iterdir())
        saved = load_file(f"{out}/adapter/adapter_model.safetensors")
        loaded = PeftModel.from_pretrained(_build().eval(), f"{out}/adapter")
        with torch.no_grad():
            err = (loaded(input_ids=ids).logits - want).abs().max().item()
        shapes = {k: list(v.shape) for k, v in ref.state_dict().items() if "lora_" in k}
        result.update(files=files, plain_load=err, tensors=len(saved), adapters=len(shapes),
                      shapes=sorted({tuple(v.shape) for v in saved.values()}),
                      want_shapes=sorted({tuple(s) for s in shapes.values()}))
    import torch.distributed as dist

    dist.barrier()
    onto = PeftModel.from_pretrained(tpcompile.transform(_build().eval(), tp=world), f"{out}/adapter")
    with torch.no_grad():
        result["tp_load"] = (onto(input_ids=ids).logits - want).abs().max().item()
    merged_ref = copy.deepcopy(ref).merge_and_unload()
    merged = model.merge_and_unload()
    with torch.no_grad():
        result["merged"] = (merged(ids).logits - merged_ref(ids).logits).abs().max().item()
    result["merged_plan"] = "model.layers.0.self_attn.q_proj.weight" in merged.tpcompile_plan.params
    merged.save_pretrained(f"{out}/merged")  # every rank, gather-free
    if rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(f"{out}/merged")
        with torch.no_grad():
            result["merged_saved"] = (plain(ids).logits - merged_ref(ids).logits).abs().max().item()
    return result


def _fsdp(rank: int, world: int, order: str) -> dict:
    """LoRA and parallelize (dp_shard 2 x tp 2), in either order: 3 AdamW steps equal one
    process (after: each adapter module becomes an FSDP2 unit of its own)."""
    from peft import get_peft_model

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    base = _build()
    torch.manual_seed(1)
    ref = get_peft_model(base, _lora(["q_proj", "v_proj", "down_proj"]))
    if order == "before":
        model = tpcompile.parallelize(copy.deepcopy(ref), tp=2)
    else:
        parallel = tpcompile.parallelize(_build(), tp=2)
        torch.manual_seed(1)
        model = get_peft_model(parallel, _lora(["q_proj", "v_proj", "down_proj"]))
    losses = []
    for m in (ref, model):
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
        losses.append([global_step(m, opt, ids) for _ in range(3)])  # each dp rank its slice
    return {"ref": losses[0], "fsdp": losses[1]}


@pytest.fixture(scope="module")
def world4() -> CaseResults:
    return run_cases(4, {f"fsdp_{o}": (_fsdp, o) for o in ("before", "after")}, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("order", ["before", "after"])
def test_lora_and_parallelize_in_either_order_train_exactly(world4: CaseResults, order: str) -> None:
    for r in world4[f"fsdp_{order}"]:
        for got, want in zip(r["fsdp"], r["ref"], strict=True):
            assert abs(got - want) <= 1e-4 * abs(want), r


def _resume(rank: int, world: int, out: str) -> dict:
    """A sharded training checkpoint of a LoRA model (added after transform) holds the
    adapters and their AdamW state: a fresh model resumed from it takes the same next step."""
    from peft import get_peft_model

    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(1)
        model = get_peft_model(tpcompile.transform(_build(), tp=world), _lora(["q_proj", "down_proj"]))
        return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    model, opt = fresh()
    for _ in range(2):
        global_step(model, opt, ids)
    tpcompile.checkpoint.save(out, model, opt, kind="sharded", step=2)
    want = [global_step(model, opt, ids) for _ in range(2)]
    other, other_opt = fresh()
    tpcompile.checkpoint.load(out, other, other_opt)
    got = [global_step(other, other_opt, ids) for _ in range(2)]
    return {"want": want, "got": got}


def _plans(world: int) -> list[tuple]:
    """What the world-2 cases transform before adapters are added after it (``plan_ahead``;
    a PEFT model transformed is planned whole, adapters included)."""
    saved = ("LoraConfig", {"r": 4, "target_modules": ["q_proj", "down_proj"], "lora_dropout": 0.0,
                            "init_lora_weights": False}, False)  # _before's and _saves' reference
    builds = [(_build, (name, attn)) for name, attn, _ in AFTER.values()] + [(_build, ("llama", "sdpa", False))]
    builds += [(_adapted, (cls, kw)) for k, (cls, kw) in KINDS.items() if k not in UNPLANNED] + [(_adapted, saved)]
    return [(build, args, {"tp": world}) for build, args in builds]


def _exactness(ref: torch.nn.Module, model: torch.nn.Module, world: int, run: Any) -> dict:
    """Logits and every gradient of ``model`` against ``ref`` after one forward and backward
    each (``run(m)`` gives the logits and the loss), and the names both have gradients for."""
    (a, loss_a), (b, loss_b) = run(ref), run(model)
    loss_a.backward()
    loss_b.backward()
    want = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
    got = _grads(model, world)
    return {"logits": (a - b).abs().max().item(), "same": set(got) == set(want), "names": set(got),
            "grads": max((got[n] - want[n]).abs().max().item() for n in want if n in got)}


def _expert_lora(rank: int, world: int) -> dict:
    """LoRA on a MoE model's fused expert parameters (``target_parameters``): PEFT folds
    the factors into the weight under ``torch.autocast`` on the weight's device, which
    torch refuses on the meta device every trace runs on (refused before); exact."""
    import peft

    cfg = tiny_config("mixtral")
    lora = {"r": 4, "target_modules": ["q_proj"], "target_parameters": ["mlp.experts.gate_up_proj",
                                                                         "mlp.experts.down_proj"]}
    torch.manual_seed(0)
    ref = peft.get_peft_model(AutoModelForCausalLM.from_config(cfg), peft.LoraConfig(**lora, init_lora_weights=False))
    model = tpcompile.transform(copy.deepcopy(ref), tp=world)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))

    def run(m: torch.nn.Module) -> tuple:
        out = m(input_ids=ids, labels=ids)
        return out.logits, out.loss

    return _exactness(ref, model, world, run)


def _seq_cls(rank: int, world: int) -> dict:
    """A sequence classifier's LoRA added after ``transform``: PEFT's SEQ_CLS task copies
    the score head into ``modules_to_save`` (a copy of a transformed module: its weight a
    DTensor, its tpcompile hooks bound to the original) and the wrapper reads the
    original's weight.  Refused before, as a re-split; a head of 2 labels now stays whole
    from the start, and the copy is planned afresh and trained."""
    import peft
    from transformers import AutoModelForSequenceClassification

    cfg = tiny_config("llama", pad_token_id=0, num_labels=2)
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"], "task_type": "SEQ_CLS", "init_lora_weights": False}

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        return AutoModelForSequenceClassification.from_config(cfg).eval()

    base = build()
    torch.manual_seed(1)
    ref = peft.get_peft_model(base, peft.LoraConfig(**lora))
    transformed = tpcompile.transform(build(), tp=world)
    torch.manual_seed(1)
    model = peft.get_peft_model(transformed, peft.LoraConfig(**lora))
    ids = torch.randint(1, 256, (2, 9), generator=torch.Generator().manual_seed(1))

    def run(m: torch.nn.Module) -> tuple:
        out = m(input_ids=ids, labels=torch.tensor([0, 1]))
        return out.logits, out.loss

    return _exactness(ref, model, world, run)


@pytest.mark.slow
def test_a_classifier_adapted_after_transform_is_exact(world2: CaseResults) -> None:
    for r in world2["seq_cls"]:
        assert "base_model.model.score.modules_to_save.default.weight" in r["names"], r  # the copy trains
        assert r["same"] and r["logits"] < TOL and r["grads"] < TOL, r


def _vlm_after(rank: int, world: int) -> dict:
    """LoRA on a vision-language model (LLaVA; ``q_proj`` / ``v_proj`` match both towers)
    added after ``transform``: the re-plan's twin of the model kept transformers' flag that
    its output-capturing hooks were installed, without the hooks; its vision tower then
    returned no hidden states, the images were dropped, and the re-plan (vision kept
    whole) was refused as a re-split."""
    import families
    import peft

    from tpcompile.capture import example_inputs

    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False}
    torch.manual_seed(0)
    base = families.build("llava", "sdpa")
    inputs = example_inputs(base, batch=2, seq=9, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(1)
    ref = peft.get_peft_model(base, peft.LoraConfig(**lora))
    torch.manual_seed(0)
    transformed = tpcompile.transform(families.build("llava", "sdpa"), tp=world)
    torch.manual_seed(1)
    model = peft.get_peft_model(transformed, peft.LoraConfig(**lora))

    def run(m: torch.nn.Module) -> tuple:
        logits = m(**inputs).logits
        return logits, logits.square().mean()

    return _exactness(ref, model, world, run)


@pytest.mark.slow
def test_lora_on_a_vision_language_model_after_transform_is_exact(world2: CaseResults) -> None:
    for r in world2["vlm_after"]:
        assert r["same"] and r["logits"] < TOL and r["grads"] < TOL, r


@pytest.mark.slow
def test_lora_dropout_draws_one_processs_masks(world2: CaseResults) -> None:
    for r in world2["lora_dropout"]:
        for order, (loss, grads, missing) in r.items():
            assert loss < TOL and grads < TOL and missing == 0, (order, r)


@pytest.mark.slow
def test_lora_on_expert_parameters_is_exact(world2: CaseResults) -> None:
    for r in world2["expert_lora"]:
        assert r["same"] and r["logits"] < TOL and r["grads"] < TOL, r


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> CaseResults:
    cases: dict = {"plans": (plan_ahead, _plans(2))}
    cases.update({key: (_after, *spec) for key, spec in AFTER.items()})
    for order in ("before", "after"):
        cases[f"save_{order}"] = (_saves, str(tmp_path_factory.mktemp(order)), order)
    cases.update(before=(_before,), by_hand=(_by_hand,), kinds=(_kinds,), adalora=(_adalora_allocation,),
                 shared_bank=(_shared_bank_fsdp,), expert_lora=(_expert_lora,),
                 seq_cls=(_seq_cls,), vlm_after=(_vlm_after,), lora_dropout=(_lora_dropout,),
                 resume=(_resume, str(tmp_path_factory.mktemp("resume"))))
    return run_cases(2, cases, timeout=900)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(AFTER))
def test_lora_added_after_transform_trains_exactly(world2: CaseResults, case: str) -> None:
    for r in world2[case]:
        assert r["dtensors"] and r["trainable"] and r["grad_keys"], r
        assert r["replans"] == 1, r  # every adapter of one get_peft_model planned at once
        assert r["n_trainable"] >= 2 * 3 * tiny_config(AFTER[case][0].partition("_kv")[0]).num_hidden_layers  # A, B per target
        assert r["grads"] < TOL, r
        for got, want in zip(r["losses"], r["ref_losses"], strict=True):
            assert abs(got - want) <= 1e-4 * abs(want), r
        # split like the bases they adapt: B with a column's output, A with a row's input
        assert "S(0)" in r["lora_split"] and "S(1)" in r["lora_split"], r


@pytest.mark.slow
def test_lora_added_before_transform_trains_exactly(world2: CaseResults) -> None:
    for r in world2["before"]:
        assert r["logits"] < TOL and r["loss"] < TOL and r["grads"] < TOL, r
        assert r["lora_grads"] == 4 * tiny_config("llama").num_hidden_layers  # A and B, two targets
        assert r["q_split"] == 0, r  # the attention stays split; the LoRA rank is not


@pytest.mark.slow
def test_other_adapter_kinds_are_exact_or_refused(world2: CaseResults) -> None:
    for r in world2["kinds"]:
        for case in ("ia3_after", "ia3_before", "lora_embedding_after", "lora_embedding_before",
                     "modules_to_save_before", "vera_before", "prompt_before", "prompt_after", "adalora_before",
                     "miss_before", "vblora_before", "delora_before", "lora_lm_head_before", "lora_lm_head_after",
                     "dora_before"):
            assert r[case][0] == "exact" and r[case][1] < TOL, (case, r[case])  # outputs and gradients
        # VeRA's projections, shared by q (64 rows) and v (32), cannot follow q's heads onto
        # their ranks: the adapted model keeps the attention whole, which transform had split
        assert r["vera_after"][0] == "refused" and "vera_lambda" in r["vera_after"][1], r
        # AdaLoRA's own gates read the bases' features whole: it would re-split the MLP
        assert r["adalora_after"][0] == "refused" and "lora_E" in r["adalora_after"][1], r
        for kind in ("miss", "vblora"):  # exact, or refused naming what it adds
            assert r[f"{kind}_after"][0] == "exact" and r[f"{kind}_after"][1] < TOL or kind in r[f"{kind}_after"][1], r
        # prefix tuning's keys and values for every head arrive as a cache: refused in both
        # orders before any forward, naming it and what splits instead
        for order in ("after", "before"):
            assert r[f"prefix_{order}"][0] == "refused" and "prefix tuning" in r[f"prefix_{order}"][1], r
            # a forward export cannot trace is a TPError at transform time too
            assert r[f"hra_{order}"][0] == "refused" and "could not capture" in r[f"hra_{order}"][1], r
        # a copy of the LM head beside it cannot keep the head's vocabulary split: said, not guessed
        assert r["modules_to_save_after"][0] == "refused" and "lm_head" in r["modules_to_save_after"][1], r
        # DoRA's magnitude reads the sharded base weight: refused after transform, naming why;
        # before it, the weight norms read the layers whole, so they stay whole (exact)
        assert r["dora_after"][0] == "refused" and "DoRA" in r["dora_after"][1], r
        # DeLoRA's weight norms are computed from the DTensors without an error: found by
        # what the injection made, refused all the same
        assert r["delora_after"][0] == "refused" and "delora_w_norm" in r["delora_after"][1], r


@pytest.mark.slow
def test_adalora_rank_allocation_runs_on_the_whole_adapters(world2: CaseResults) -> None:
    for r in world2["adalora"]:
        pattern = r["ref_pattern"]
        assert pattern and any(not all(v) for v in pattern.values()), r  # some ranks were masked
        assert r["tp_pattern"] == pattern, r
        for got, want in zip(r["tp"], r["ref"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), r


@pytest.mark.slow
def test_a_parameter_several_blocks_hold_trains_under_fsdp2(world2: CaseResults) -> None:
    for r in world2["shared_bank"]:
        for got, want in zip(r["dp"], r["ref"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), r


@pytest.mark.slow
def test_modules_added_by_hand_are_planned_or_refused_naming_them(world2: CaseResults) -> None:
    for r in world2["by_hand"]:
        assert r["by_hand"] < TOL and r["b_split"] == "S(0)", r
        assert "model.layers.1.mlp.up_proj" in r["whole0"] and "changes how" in r["whole0"], r["whole0"]
        assert "model.layers.1.mlp.up_proj (test_adapters._Whole)" in r["whole1"], r["whole1"]
        assert "after tpcompile.parallelize with cp / ep / activation checkpointing" in r["parallelized"], r
        assert "q_proj" in r["parallelized"], r


@pytest.mark.slow
@pytest.mark.parametrize("order", ["before", "after"])
def test_adapters_save_load_and_merge_in_peft_format(world2: CaseResults, order: str) -> None:
    first = world2[f"save_{order}"][0]
    assert "adapter_config.json" in first["files"] and "adapter_model.safetensors" in first["files"], first
    assert not any(f.startswith("model") for f in first["files"]), first["files"]  # no full model
    assert first["tensors"] == first["adapters"] and first["shapes"] == first["want_shapes"], first
    assert first["plain_load"] < TOL and first["merged_saved"] < TOL, first
    for r in world2[f"save_{order}"]:
        assert r["logits"] < TOL and r["tp_load"] < TOL, r
        assert r["merged"] < TOL and r["merged_plan"], r


@pytest.mark.slow
def test_adapters_and_their_optimizer_state_resume_from_a_sharded_checkpoint(world2: CaseResults) -> None:
    for r in world2["resume"]:
        # the second step after the checkpoint depends on the restored AdamW moments
        for got, want in zip(r["got"], r["want"], strict=True):
            assert abs(got - want) <= 1e-5 * abs(want), r


class _SwitchesItself(torch.nn.Module):
    """BigBird's habit: short inputs make the forward build a new attention module."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] < 8 and type(self.attn) is torch.nn.Linear:
            fresh = torch.nn.Sequential(self.attn)  # the same weights under a new module
            self.attn = fresh
        return self.attn(x)


def test_a_module_the_forward_replaces_is_refused_by_that_forward() -> None:
    from tpcompile.runtime.guard import watch_tree

    model = _SwitchesItself()
    watch_tree(model)
    assert model(torch.ones(1, 9, 4)).shape == (1, 9, 4)  # nothing replaced: runs
    # the new module ran unplanned within this very forward: its output is refused (before,
    # it was returned and only the next forward refused the model)
    with pytest.raises(TPError, match=r"attn \(torch.nn.modules.container.Sequential\).*during this forward"):
        model(torch.ones(1, 3, 4))


def test_a_peft_wrapper_takes_its_base_models_example_inputs() -> None:
    # a PeftModel without a task type forwards *args, **kwargs: its capture had token ids
    # only, and T5's encoder-decoder refused them
    import families
    import peft

    from tpcompile.capture import example_inputs

    model = peft.get_peft_model(families.build("t5", "sdpa"), peft.LoraConfig(r=4, target_modules=["q"]))
    assert set(example_inputs(model)) == {"input_ids", "decoder_input_ids"}
