"""Bad input is refused, never silent: token ids outside the vocabulary, bad degrees, a
model transformed twice.

Split over the vocabulary, every rank masks an id outside its rows, so an id outside the
whole vocabulary would read a zero vector on every rank and the model would run silently
wrong; the unsplit embedding raises ``IndexError``.  Over gloo at tp=2 (tiny Llama, 256
ids): an id of 256 or -1 in eval and in training raises a ``TPError`` naming the module,
the id and its position; the largest valid id still gives the unsplit model's logits.  ``transform`` /
``from_pretrained`` refuse a degree that is not an integer >= 1 before anything is traced
or read, and ``transform`` / ``parallelize`` of an already transformed model name its tp.
Different prompts on the ranks of a TP group are refused in eval forwards and
``generate()`` as in training (every ``generate()`` call, and the first forwards of every
evaluation, not only the model's first), and so are different images (a ViT's
``pixel_values``) or ``inputs_embeds``.  A label outside the vocabulary that is not -100 is
refused by the default and the loss-parallel loss (the unsplit model's cross-entropy
raises ``IndexError``), and ids are checked under sequence parallelism and with a LoRA
adapter on the split embedding.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from dist import CaseResults, refusal, run_cases
from transformers import AutoModelForCausalLM

import tpcompile
from tpcompile import TPError
from tpcompile.tools.presets import tiny_config


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"))


def _ids(rank: int, world: int) -> dict:
    ref = _model().eval()
    model = tpcompile.transform(_model(), tp=world).eval()
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    ids[1, 7] = 255  # the last row: valid
    with torch.no_grad():
        err = (model(ids).logits - ref(ids).logits).abs().max().item()
    errors = {}
    for name, value, training in (("above", 256, False), ("negative", -1, False), ("training", 300, True)):
        bad = ids.clone()
        bad[1, 3] = value
        model.train(training)
        errors[name] = refusal(lambda bad=bad: model(input_ids=bad, labels=ids))
    return {"err": err, "errors": errors}


def _labels(rank: int, world: int) -> dict:
    """Labels outside the vocabulary (and not -100) under the default and the
    loss-parallel loss; ids outside it under sequence parallelism and with a LoRA adapter
    on the split embedding.  The unsplit model raises in each case (``ref``)."""
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
    errors, ref = {}, {}
    models = {"local": tpcompile.transform(_model(), tp=world),
              "loss_parallel": tpcompile.transform(_model(), tp=world, loss_parallel=True)}
    for kind, model in models.items():
        for value in (300, -5, 256):
            labels = ids.clone()
            labels[1, 3] = value
            errors[f"{kind} {value}"] = refusal(lambda m=model, labels=labels: m(input_ids=ids, labels=labels))
            ref[f"{kind} {value}"] = _raises(lambda labels=labels: _model()(input_ids=ids, labels=labels))
    ignored = ids.clone()
    ignored[1, 3], ignored[0, 0] = -100, 300  # ignore_index, and a first label (never a target): accepted
    loss = models["local"](input_ids=ids, labels=ignored).loss.item()
    want = _model()(input_ids=ids, labels=ignored).loss.item()
    bad = ids.clone()
    bad[1, 3] = 300
    sp = tpcompile.transform(_model(), tp=world, sequence_parallel=True)
    lora = get_peft_model(_model(), LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    lora = tpcompile.transform(lora, tp=world)
    for name, model in (("sp", sp), ("lora", lora)):
        errors[name] = refusal(lambda m=model: m(input_ids=bad, labels=ids))
    ref["ids"] = _raises(lambda: _model()(input_ids=bad))
    return {"errors": errors, "ref": ref, "loss": loss, "want": want}


def _raises(attempt: Any) -> str | None:
    """The exception type the unsplit model raises (None: it does not)."""
    try:
        attempt()
    except Exception as exc:  # noqa: BLE001 - the unsplit model's own error, whatever it is
        return type(exc).__name__
    return None


def _twice(rank: int, world: int) -> dict:
    model = tpcompile.transform(_model(), tp=world)
    return {"transform": refusal(lambda: tpcompile.transform(model, tp=world)),
            "parallelize": refusal(lambda: tpcompile.parallelize(model, tp=world))}


def _per_rank(rank: int, world: int) -> dict:
    """Different prompts on the two ranks of a TP group: refused in an eval forward and in
    generate(), as in training; the same prompts generate."""
    errors = {}
    for name in ("eval", "generate"):
        model = tpcompile.transform(_model(), tp=world).eval()
        ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(10 + rank))
        errors[name] = refusal(lambda model=model, ids=ids, name=name: model(ids) if name == "eval"
                               else model.generate(ids, max_new_tokens=2, do_sample=False))
    model = tpcompile.transform(_model(), tp=world).eval()
    same = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(10))
    tokens = model.generate(same, max_new_tokens=2, do_sample=False)[0].tolist()
    # every generate() compares its prompt, not only the first eval forwards: a later
    # call with each rank's own prompt is refused too (and a deepcopy guards itself)
    for _ in range(2):
        model.generate(same, max_new_tokens=1, do_sample=False)
    mine = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(20 + rank))
    errors["later generate"] = refusal(lambda: model.generate(mine, max_new_tokens=1, do_sample=False))
    # each evaluation is checked anew: after a training forward, an eval forward with each
    # rank's own ids is refused although earlier eval forwards were checked already
    model.eval()
    for _ in range(3):
        model(same)
    model.train()
    model(same)
    model.eval()
    errors["later evaluation"] = refusal(lambda: model(mine))
    copied = copy.deepcopy(model)
    errors["copy generate"] = refusal(lambda: copied.generate(mine, max_new_tokens=1, do_sample=False))
    return {"errors": errors, "tokens": tokens, "want": _model().eval().generate(same, max_new_tokens=2,
                                                                                do_sample=False)[0].tolist(),
            "copy_tokens": copied.generate(same, max_new_tokens=2, do_sample=False)[0].tolist()}


def _pixels(rank: int, world: int) -> dict:
    """Floating inputs are compared too: a ViT whose TP ranks get different images, and a
    Llama fed different ``inputs_embeds``, are refused (training and eval) where the same
    images still give the unsplit model's logits."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, intermediate_size=128,
                    image_size=16, patch_size=8, num_labels=3)
    ref = ViTForImageClassification(cfg).eval()
    model = tpcompile.transform(copy.deepcopy(ref), tp=world).eval()
    same = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    mine = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(30 + rank))
    with torch.no_grad():
        err = (model(pixel_values=same).logits - ref(pixel_values=same).logits).abs().max().item()
    errors = {"eval": refusal(lambda: model(pixel_values=mine))}
    model.train()
    errors["training"] = refusal(lambda: model(pixel_values=mine, labels=torch.tensor([0, 1])))
    llama = tpcompile.transform(_model(), tp=world).eval()
    embeds = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(40 + rank))
    errors["inputs_embeds"] = refusal(lambda: llama(inputs_embeds=embeds))
    return {"err": err, "errors": errors}


@pytest.fixture(scope="module")
def world2() -> CaseResults:
    return run_cases(2, {"ids": (_ids,), "twice": (_twice,), "per_rank": (_per_rank,), "labels": (_labels,),
                         "pixels": (_pixels,)}, timeout=300)


@pytest.mark.slow
def test_different_prompts_per_tp_rank_are_refused_in_eval_and_generate(world2: CaseResults) -> None:
    for r in world2["per_rank"]:
        for name, text in r["errors"].items():
            assert text is not None and "different batches" in text, (name, text)
        assert r["tokens"] == r["want"] == r["copy_tokens"], r


@pytest.mark.slow
def test_different_images_or_embeddings_per_tp_rank_are_refused(world2: CaseResults) -> None:
    for r in world2["pixels"]:
        assert r["err"] < 1e-5, r
        for name, text in r["errors"].items():
            assert text is not None and "different batches" in text, (name, text)


@pytest.mark.slow
def test_a_transformed_model_is_not_transformed_again(world2: CaseResults) -> None:
    for errors in world2["twice"]:
        for name, text in errors.items():
            assert text is not None and "already transformed at tp=2" in text and "load it" in text, (name, text)


@pytest.mark.parametrize("tp", [0, -2, "2", True, 1.5])
def test_bad_degrees_are_refused_before_any_work(tp: object) -> None:
    with pytest.raises(TPError, match=r"tp must be an integer >= 1, got"):
        tpcompile.transform(_model(), tp=tp)
    with pytest.raises(TPError, match=r"tp must be an integer >= 1, got"):
        tpcompile.from_pretrained("no/such/dir", tp=tp)
    with pytest.raises(TPError, match=r"tp must be an integer >= 1, got"):  # no process group needed
        tpcompile.parallelize(_model(), tp=tp)
    with pytest.raises(TPError, match=r"tp must be an integer >= 1, got"):
        tpcompile.plan_model(_model(), tp)


@pytest.mark.parametrize(("keywords", "message"), [
    ({"dp_shard": 0}, "dp_shard must be an integer >= 1 (-1 = the rest of the world), got 0"),
    ({"pp": "2"}, "pp must be an integer >= 1, got '2'"),
    ({"cp": -1}, "cp must be an integer >= 1, got -1"),
    ({"ep": 2.0}, "ep must be an integer >= 1, got 2.0"),
    ({"pp_microbatches": 0}, "pp_microbatches must be an integer >= 1, got 0"),
    ({"sequence_parallel": "yes"}, "sequence_parallel must be True or False, got 'yes'"),
    ({"sharding_strategy": "SHARD_EVERYTHING"}, "SHARD_EVERYTHING"),
    ({"config": {"tensor_parallel_degree": 0}}, "tp must be an integer >= 1, got 0"),
    ({"dp_shard": -1, "dp_replicate": -1}, "only one of dp_shard and dp_replicate can be -1"),
])
def test_parallelize_checks_its_options_before_it_needs_a_process_group(keywords: dict, message: str) -> None:
    with pytest.raises(TPError) as caught:
        tpcompile.parallelize(_model(), **keywords)
    assert message in str(caught.value) and "process group" not in str(caught.value), caught.value


@pytest.mark.slow
def test_ids_outside_the_vocabulary_are_refused(world2: CaseResults) -> None:
    for r in world2["ids"]:
        assert r["err"] < 1e-5, r
        for name, value in (("above", 256), ("negative", -1), ("training", 300)):
            text = r["errors"][name]
            assert text is not None and "model.embed_tokens" in text and f"token id {value}" in text, (name, text)
            assert "position [1, 3]" in text and "[0, 256)" in text, text


@pytest.mark.slow
def test_labels_outside_the_vocabulary_are_refused(world2: CaseResults) -> None:
    for r in world2["labels"]:
        assert abs(r["loss"] - r["want"]) <= 1e-5 * abs(r["want"]), r  # -100 and the first label pass
        for kind in ("local", "loss_parallel"):
            for value in (300, -5, 256):
                text = r["errors"][f"{kind} {value}"]
                assert text is not None and f"label {value} at position [1, 3]" in text, (kind, value, text)
                assert "[0, 256)" in text and "ignore_index" in text, text
                assert r["ref"][f"{kind} {value}"] == "IndexError", r["ref"]


@pytest.mark.slow
def test_ids_outside_the_vocabulary_are_refused_under_sp_and_peft(world2: CaseResults) -> None:
    for r in world2["labels"]:
        assert r["ref"]["ids"] == "IndexError", r["ref"]
        for name in ("sp", "lora"):
            text = r["errors"][name]
            assert text is not None and "token id 300" in text and "position [1, 3]" in text, (name, text)


def test_sizes_given_as_lists_are_guarded_too() -> None:
    # LLaVA-NeXT's image_sizes as a list picks each image's tiling: ranks given different
    # sizes compute differently, so the guards compare its numbers (and tensors in lists)
    from tpcompile.runtime.markers import guarded_inputs, input_checksum

    ids = torch.tensor([[5, 6, 7]])
    mine = guarded_inputs([ids, [[32, 32], [32, 64]], (torch.ones(2),), None, True])
    assert [tuple(t.shape) for t in mine] == [(1, 3), (2,), (4,)]
    other = guarded_inputs([ids, [[32, 32], [64, 32]], (torch.ones(2),), None, True])
    assert not torch.equal(input_checksum(mine[-1]), input_checksum(other[-1]))
    assert torch.equal(input_checksum(mine[0]), input_checksum(other[0]))
