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
from dist import plan_ahead, run_distributed
from test_transform import grad_errors

import tpcompile
from tpcompile.tools.presets import tiny_config

TOL = 1e-5
FAMILIES = {"llama": "sdpa", "gemma2": "eager", "qwen3": "eager", "mixtral": "sdpa", "gpt2": "eager"}


def _build(name: str, attn: str, **overrides: object) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    if name == "bloom":  # no preset: ALiBi attention stays replicated, residual adds inside
        from transformers import BloomConfig

        cfg = BloomConfig(vocab_size=256, hidden_size=64, n_layer=2, n_head=4, **overrides)
    elif name == "bart":  # no preset: the MLP's fc1 / fc2 are two children of the layer
        from transformers import BartConfig

        cfg = BartConfig(vocab_size=256, d_model=64, encoder_layers=2, decoder_layers=2,
                         encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                         decoder_ffn_dim=128, max_position_embeddings=64, **overrides)
    else:
        cfg = tiny_config(name, **overrides)
    cfg._attn_implementation = attn
    for key, value in cfg.to_dict().items():  # every dropout off: the ranks' masks differ
        if "drop" in key and isinstance(value, float):
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
        "regions": len(model.tpcompile_plan.sequence.regions),
    }


def _wire_bytes(model: torch.nn.Module, ids: torch.Tensor, tp: int) -> int:
    """Bytes each rank sends in one forward + backward (ring algorithms): all-reduce
    2(n-1)/n of the tensor, all-gather (n-1) x its input, reduce-scatter (n-1)/n."""
    import torch.distributed as dist

    total = [0]
    saved = {k: getattr(dist, k) for k in ("all_reduce", "all_gather", "reduce_scatter_tensor")}
    scale = {"all_reduce": 2 * (tp - 1) / tp, "all_gather": tp - 1, "reduce_scatter_tensor": (tp - 1) / tp}

    def counted(name: str):  # noqa: ANN202
        def call(*args, **kwargs):  # noqa: ANN002, ANN003
            t = args[1] if name != "all_reduce" else args[0]
            total[0] += int(t.numel() * t.element_size() * scale[name])
            return saved[name](*args, **kwargs)
        return call

    for k in saved:
        setattr(dist, k, counted(k))
    try:
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        for k, fn in saved.items():
            setattr(dist, k, fn)
    return total[0]


def _case(rank: int, world: int, name: str, attn: str, seq: int, kwargs: dict) -> dict:
    ref = _build(name, attn)
    model = copy.deepcopy(ref)
    tpcompile.transform(model, tp=world, sequence_parallel=True, **kwargs)
    ids = torch.randint(3, 256, (2, seq), generator=torch.Generator().manual_seed(seq))
    result = _compare(model, ref, ids, world)
    if name == "llama" and not kwargs and seq == 10:
        prompt = ids[:, :5]
        gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            result["generate"] = model.generate(prompt, **gen).tolist() == ref.generate(prompt, **gen).tolist()
            hidden = model(input_ids=ids, output_hidden_states=True).hidden_states
            want = ref(input_ids=ids, output_hidden_states=True).hidden_states
            # asked of the inner model directly: the same
            hidden += model.model(input_ids=ids, output_hidden_states=True).hidden_states
            want += ref.model(input_ids=ids, output_hidden_states=True).hidden_states
        result["hidden_states"] = max((h - w).abs().max().item() for h, w in zip(hidden, want, strict=True))
        plain = copy.deepcopy(ref)
        tpcompile.transform(plain, tp=world)
        whole = ids[:, :8]  # a length tp divides: padding would add its own share
        result["wire"] = (_wire_bytes(model, whole, world), _wire_bytes(plain, whole, world))
    return result


def _fsdp_case(rank: int, kwargs: dict) -> list[float]:
    """test_fsdp's training run (10 AdamW steps, dp ranks take batch slices) with SP."""
    from test_fsdp import _build as build_llama
    from test_fsdp import _train

    model = build_llama()
    tpcompile.parallelize(model, sequence_parallel=True, **kwargs)
    assert model.tpcompile_plan.sequence.regions
    return _train(model)


def _session(rank: int, world: int, cases: list[tuple], fsdp: list[tuple[str, dict]]) -> dict:
    plan_ahead(rank, world, [(_build, case[:2], {"tp": world, "sequence_parallel": True, **dict(case[3])})
                             for case in cases])
    out: dict = {case: _case(rank, world, *case[:3], dict(case[3])) for case in cases}
    out.update({name: _fsdp_case(rank, kwargs) for name, kwargs in fsdp})
    return out


FSDP = [  # dp2 x tp2 at world 4, blocks recomputed in backward: 10 AdamW steps equal one process
    ("fsdp_sp_checkpointed", dict(tp=2, activation_checkpointing=True)),
]


def _cases(tp: int) -> list[tuple]:
    # 10 tokens: whole slices at tp=2, padded at tp=4; the odd lengths pad at tp=2
    cases = [(name, attn, 10, ()) for name, attn in FAMILIES.items()]
    if tp == 2:  # GPT-NeoX: parallel residual, row biases added to token slices; BLOOM:
        # its replicated attention runs as a region of its own; BART: the MLP's column and
        # row halves are two children (the sharded features between them stay whole)
        cases += [("llama", "sdpa", 7, ()), ("llama", "eager", 9, (("loss_parallel", True),)),
                  ("gpt_neox", "sdpa", 9, ()), ("bloom", "eager", 9, ()), ("bart", "eager", 9, ())]
    return cases


def _check(results: list[dict], fsdp: list[tuple[str, dict]] = ()) -> None:
    from test_fsdp import REL, _reference

    for name, _ in fsdp:
        for step, (a, b) in enumerate(zip(results[0].pop(name), _reference(), strict=True)):
            assert abs(a - b) <= REL * abs(b), f"{name} step {step}: {a} vs {b}"
    for case, res in results[0].items():
        assert res["regions"] > 0, case
        assert res["logits"] < TOL and res["loss"] < TOL, (case, res)
        assert res["grad"][1] < TOL, (case, res["grad"])
        if "generate" in res:
            assert res["generate"], case
            assert res["hidden_states"] < TOL, case
            # all-gather + reduce-scatter instead of all-reduces: the same traffic per
            # region; only the stack's own split/gather (backward / forward all-gather of
            # the stream, ~1/9 of this 2-layer model's traffic, 1/65 at 32 layers) is
            # extra. Without the fused pair every region would add ~50%.
            sp, tp = res["wire"]
            assert sp <= 1.15 * tp, (case, sp, tp)


@pytest.mark.slow
def test_sequence_parallel_tp2_exact() -> None:
    _check(run_distributed(_session, 2, _cases(2), [], timeout=900))


@pytest.mark.slow
def test_sequence_parallel_tp4_exact() -> None:
    _check(run_distributed(_session, 4, _cases(4), FSDP, timeout=1200), FSDP)


def test_plan_names_regions_and_stream() -> None:
    model = _build("llama", "sdpa")
    plan = tpcompile.plan_model(model, 2, sequence_parallel=True)
    seq = plan.sequence.to_dict()  # the JSON form dump-plan prints
    assert seq["stacks"]["model.layers"]["first"] == "model.layers.0"
    assert set(seq["regions"]) == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn", "mlp")}
    # the rotary tables and the mask reach attention whole: only the normed stream is gathered
    # and enters the columns by itself (all-gather, reduce-scatter backward); o_proj's
    # partial sum leaves split (reduce-scatter)
    attn = seq["regions"]["model.layers.1.self_attn"]
    assert attn["gather"] == [[["kwargs", "hidden_states"], 1, True]]
    assert attn["split"] == [[[0], 1, "model.layers.1.self_attn.o_proj"]]
    assert seq["grad_sum"]["model.layers.0.input_layernorm"]["params"] == ["weight"]
    assert tpcompile.Plan.from_json(plan.to_json()).sequence == plan.sequence


def test_plan_moe_router_reads_the_whole_input() -> None:
    """Mixtral's MoE layer is one region (router + experts); its router reads the
    gathered input directly, so that input keeps the columns' own backward all-reduce."""
    seq = tpcompile.plan_model(_build("mixtral", "sdpa"), 2, sequence_parallel=True).sequence.to_dict()
    moe = seq["regions"]["model.layers.0.mlp"]
    assert moe["gather"] == [[["args", 0], 1, False]]
    assert seq["regions"]["model.layers.0.self_attn"]["gather"][0][2] is True


def test_token_mixing_code_between_regions_keeps_the_stream_whole() -> None:
    """A block that mixes tokens outside its regions (a running mean over positions
    added to the residual) is not split, and the plan says which op."""
    model = _build("llama", "sdpa")
    for layer in model.model.layers:
        inner = type(layer).forward

        def forward(self, hidden_states, *args, _inner=inner, **kwargs):  # noqa: ANN001, ANN002, ANN003
            hidden_states = hidden_states + hidden_states.cumsum(dim=1) * 0.01
            return _inner(self, hidden_states, *args, **kwargs)

        layer.forward = forward.__get__(layer)
    plan = tpcompile.plan_model(model, 2, sequence_parallel=True)
    assert plan.sequence.stacks == {}
    assert any("cumsum" in w and "model.layers" in w for w in plan.warnings), plan.warnings


def test_config_key_and_tp1() -> None:
    from tpcompile.config import resolve_config

    assert resolve_config({"tp": 2, "sequence_parallel": True}, world_size=4).sequence_parallel
    # nothing to split at tp=1: the plan has no sequence section
    assert tpcompile.plan_model(_build("llama", "sdpa"), 1, sequence_parallel=True).sequence is None


def test_nothing_between_regions_keeps_the_stream_whole() -> None:
    """BERT keeps each norm and residual add inside its attention / output modules:
    splitting its stream would only add collectives, so the plan keeps it whole."""
    plan = tpcompile.plan_model(_build("bert", "eager"), 2, sequence_parallel=True)
    assert plan.sequence.stacks == {}
    assert any("no token-local work" in w for w in plan.warnings), plan.warnings
