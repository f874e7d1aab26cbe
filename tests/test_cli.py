"""Tests of the command line: ``dump-plan`` on every family, its table, errors, and ``demo``.

Roles are checked by parameter-name substrings here only: the compiler itself reads
roles off the dataflow and never looks at names.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tpcompile.tools import presets
from tpcompile.tools.cli import build_parser, main

__all__: list[str] = []

_REPO_ROOT = Path(__file__).resolve().parent.parent

COLUMN, ROW, REPLICATED = "column", "row", "replicated"

# (weight-name substring, expected role) per family; every substring must match.
_LLAMA_LIKE = [
    (".self_attn.q_proj.weight", COLUMN),
    (".self_attn.k_proj.weight", COLUMN),
    (".self_attn.v_proj.weight", COLUMN),
    (".self_attn.o_proj.weight", ROW),
    (".mlp.gate_proj.weight", COLUMN),
    (".mlp.up_proj.weight", COLUMN),
    (".mlp.down_proj.weight", ROW),
]
_ATTENTION_ONLY = _LLAMA_LIKE[:4]

# name -> (tp, role rules, token embedding fqn, LM head fqn)
_CASES: dict[str, tuple[int, list[tuple[str, str]], str, str]] = {
    "llama": (8, _LLAMA_LIKE, "model.embed_tokens.weight", "lm_head.weight"),
    "mistral": (8, _LLAMA_LIKE, "model.embed_tokens.weight", "lm_head.weight"),
    # Qwen2-7B: 28 query heads, 4 KV heads.
    "qwen2": (4, _LLAMA_LIKE, "model.embed_tokens.weight", "lm_head.weight"),
    "qwen3": (8, _LLAMA_LIKE, "model.embed_tokens.weight", "lm_head.weight"),
    "gemma2": (8, _LLAMA_LIKE, "model.embed_tokens.weight", "lm_head.weight"),
    "phi3": (8, [
        (".self_attn.qkv_proj.weight", COLUMN),
        (".self_attn.o_proj.weight", ROW),
        (".mlp.gate_up_proj.weight", COLUMN),
        (".mlp.down_proj.weight", ROW),
    ], "model.embed_tokens.weight", "lm_head.weight"),
    # GPT-2 and BERT-base have 12 heads: tp=8 cannot split them.
    "gpt2": (4, [
        (".attn.c_attn.weight", COLUMN),
        (".attn.c_proj.weight", ROW),
        (".mlp.c_fc.weight", COLUMN),
        (".mlp.c_proj.weight", ROW),
    ], "transformer.wte.weight", "lm_head.weight"),
    "gpt_neox": (8, [
        (".attention.query_key_value.weight", COLUMN),
        (".attention.dense.weight", ROW),
        (".mlp.dense_h_to_4h.weight", COLUMN),
        (".mlp.dense_4h_to_h.weight", ROW),
    ], "gpt_neox.embed_in.weight", "lm_head.weight"),
    # The MoE experts are checked separately (test_dump_plan_mixtral_experts).
    "mixtral": (8, _ATTENTION_ONLY, "model.embed_tokens.weight", "lm_head.weight"),
    "bert": (4, [
        (".attention.self.query.weight", COLUMN),
        (".attention.self.key.weight", COLUMN),
        (".attention.self.value.weight", COLUMN),
        (".attention.output.dense.weight", ROW),
        (".intermediate.dense.weight", COLUMN),
        (".output.dense.weight", ROW),
    ], "bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"),
}

def _dump_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code = main(["dump-plan", *args, "--format", "json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def _check_roles(params: dict[str, Any], rules: list[tuple[str, str]]) -> None:
    for substring, role in rules:
        hits = {f: p["role"] for f, p in params.items() if substring in f}
        assert hits, f"no parameter matches {substring!r}"
        wrong = {f: r for f, r in hits.items() if r != role}
        assert not wrong, f"{substring!r} should be {role}: {wrong}"


def _check_embedding_and_head(plan: dict[str, Any], embed: str, head: str) -> None:
    params, modules = plan["params"], plan["modules"]
    embed_module = embed.rsplit(".", 1)[0]
    kinds = {m: [op["kind"] for op in entry["ops"]] for m, entry in modules.items()}
    assert "vocab_embedding" in kinds[embed_module], f"{embed_module} is not vocab-parallel"
    if head in params:  # untied
        assert params[embed]["role"] == "vocab_embedding"
        assert params[head]["role"] == "lm_head"
    else:  # tied: one tensor, split over the vocabulary, used as both
        assert head in params[embed]["tied_to"], f"{head} is neither planned nor tied"
        assert params[embed]["role"] in ("lm_head", "vocab_embedding")
        assert params[embed]["shard_dim"] == 0
    head_module = head.rsplit(".", 1)[0]
    assert "gather_output" in kinds[head_module], f"{head_module} does not gather its logits"


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=()) if n == "bert" else n for n in _CASES],
)
def test_dump_plan_roles(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    tp, rules, embed, head = _CASES[name]
    plan = _dump_json(capsys, name, "--tp", str(tp))
    assert plan["tp"] == tp
    _check_roles(plan["params"], rules)
    _check_embedding_and_head(plan, embed, head)


def test_dump_plan_mixtral_experts(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _dump_json(capsys, "mixtral", "--tp", "8", "--layers", "2")
    params = plan["params"]
    _check_roles(params, [(".mlp.gate.weight", REPLICATED)])  # the router
    _check_roles(params, [(".mlp.experts.gate_up_proj", COLUMN),
                          (".mlp.experts.down_proj", ROW)])


def test_dump_plan_json_is_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from tpcompile import Plan, plan_model

    main(["dump-plan", "llama", "--tp", "2", "--layers", "2", "--format", "json"])
    out = capsys.readouterr().out
    assert out.endswith("\n") and not out.endswith("\n\n")
    got = Plan.from_json(out)  # the derived "cost" section is not part of the Plan
    assert set(json.loads(out)["cost"]["per_step"]) == {"forward", "backward"}
    want = plan_model(presets.build_meta_model("llama", num_hidden_layers=2), 2)
    got.stats = want.stats = {}  # timings differ run to run
    assert got.to_json(indent=2) == want.to_json(indent=2)


def test_dump_plan_table_llama(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump-plan", "llama", "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.{0..31}.self_attn.q_proj.weight" in out
    assert "column" in out and "row" in out
    assert "[4096, 4096] → [512, 4096]" in out
    # o_proj and down_proj reduce forward; q|k|v and gate|up share one input all-reduce each.
    assert "per block: fwd 2 all-reduce, bwd 2 all-reduce" in out
    assert "(input all-reduce shared with k_proj, v_proj)" in out
    # the last line sums one step: 32 blocks x 2 + LM head backward, embedding + rows + loss forward
    lines = out.rstrip().splitlines()
    summary, evaluation = lines[-2], lines[-1]
    assert summary.startswith("per step (bytes per token")
    # then the eval step: the training forward's collectives, without labels no loss ones
    assert evaluation.startswith("eval step (forward only): with labels 67 all_reduce"), evaluation
    assert "without 65 all_reduce" in evaluation and "input guard" in evaluation
    assert "fwd 67 all_reduce" in summary and "1 all_gather" in summary and "bwd 65 all_reduce" in summary
    assert "memory per rank" in summary and "activations need --batch/--seq" in summary
    assert "tp: 8" in out and "parameters per rank:" in out
    # Llama-3-8B in bf16 over 8 ranks: about 2.0e9 bytes each.
    per_rank = int(out.split("parameters per rank:")[1].split("(")[1].split(" bytes")[0]
                   .replace(",", ""))
    assert 1.9e9 < per_rank < 2.1e9
    # Every layer collapsed: no row names a single layer.
    assert "model.layers.0." not in out


def test_dump_plan_cost_section(capsys: pytest.CaptureFixture[str]) -> None:
    plan = _dump_json(capsys, "llama", "--tp", "2", "--layers", "2", "--dp-shard", "2", "--batch", "2",
                      "--seq", "16")
    cost = plan["cost"]
    assert (cost["tp"], cost["dp_shard"], cost["tokens"]) == (2, 2, 32)
    for phase in ("forward", "backward"):
        assert set(cost["per_step"][phase]) == {"all_reduce", "all_gather", "all_gather_into_tensor",
                                                "reduce_scatter_tensor", "all_to_all_single", "broadcast"}
        assert all(set(v) == {"count", "bytes"} for v in cost["per_step"][phase].values())
    fwd, bwd = cost["per_step"]["forward"], cost["per_step"]["backward"]
    assert (fwd["all_reduce"]["count"], fwd["all_gather"]["count"], bwd["all_reduce"]["count"]) == (7, 1, 5)
    # FSDP2 units: 2 blocks + root, each gathered forward and backward, reduce-scattered backward
    assert fwd["all_gather_into_tensor"]["count"] == 3 and bwd["reduce_scatter_tensor"]["count"] == 3
    mem = cost["memory_per_rank"]
    assert mem["total"] == mem["parameters"] + mem["gradients"] + mem["adamw_states"] + mem["activations"]
    assert mem["activations"] > 0


def test_dump_plan_cost_needs_batch_and_seq(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump-plan", "llama", "--tp", "2", "--layers", "1", "--batch", "2"]) == 2
    assert "both batch and seq" in capsys.readouterr().err


def test_dump_plan_table_tied_counted_once(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump-plan", "gpt2", "--tp", "4", "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "(tied: lm_head.weight)" in out
    assert "transformer.h.{0..1}.attn.c_attn.weight" in out
    assert sum(line.startswith("lm_head.weight") for line in out.splitlines()) == 0


def test_dump_plan_llama_405b(capsys: pytest.CaptureFixture[str]) -> None:
    start = time.perf_counter()
    assert main(["dump-plan", "llama-405b", "--tp", "8"]) == 0
    wall = time.perf_counter() - start
    out = capsys.readouterr().out
    assert "model.layers.{0..125}.mlp.down_proj.weight" in out
    with capsys.disabled():
        print(f"\n[dump-plan llama-405b --tp 8: {wall:.1f} s wall in-process]")


@pytest.mark.parametrize("as_file", [False, True], ids=["dir", "config.json"])
def test_dump_plan_local_model(tmp_path: Path, as_file: bool,
                               capsys: pytest.CaptureFixture[str]) -> None:
    presets.tiny_config("llama").save_pretrained(tmp_path)
    target = tmp_path / "config.json" if as_file else tmp_path
    plan = _dump_json(capsys, "--model", str(target), "--tp", "2", "--layers", "1")
    assert plan["model_class"] == "LlamaForCausalLM"
    assert not any(".layers.1." in f for f in plan["params"])
    _check_roles(plan["params"], _LLAMA_LIKE)
    # the path as the positional MODEL, as verify takes it
    assert _dump_json(capsys, str(target), "--tp", "2", "--layers", "1")["params"] == plan["params"]


def test_dump_plan_any_family_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # an encoder-decoder's config.json (no architectures): the class is the one verify and
    # from_pretrained build (its seq2seq head), not only causal / masked LMs
    from transformers import T5Config

    T5Config(d_model=64, d_ff=128, num_layers=1, num_decoder_layers=1, num_heads=4, d_kv=16,
             vocab_size=256).save_pretrained(tmp_path)
    plan = _dump_json(capsys, str(tmp_path / "config.json"), "--tp", "2")
    assert plan["model_class"] == "T5ForConditionalGeneration"
    _check_roles(plan["params"], [(".SelfAttention.q.weight", COLUMN), (".SelfAttention.o.weight", ROW),
                                  (".EncDecAttention.k.weight", COLUMN), (".DenseReluDense.wo.weight", ROW)])


def test_dump_plan_shows_kv_heads_read_per_query_head(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # 20 query heads over 5 KV heads at tp=4: two KV heads held per rank, read as five
    presets.tiny_config("llama", num_attention_heads=20, num_key_value_heads=5, hidden_size=160).save_pretrained(tmp_path)
    assert main(["dump-plan", str(tmp_path), "--tp", "4", "--layers", "1"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if ".k_proj.weight" in line)
    assert "kv_replicated, read as 40" in row and "[40, 160] → [16, 160]" in row, row


def test_dump_plan_unknown_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump-plan", "no-such-model", "--tp", "8"]) == 2
    captured = capsys.readouterr()
    assert "no-such-model" in captured.err
    for name in ("llama", "mixtral", "gpt2"):
        assert name in captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_dump_plan_tp_error_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    # 32 heads over 48 ranks would leave ranks without a head (tp=3 and tp=5 now deal the
    # heads unevenly, their KV groups straddled)
    assert main(["dump-plan", "llama", "--tp", "48", "--layers", "1"]) == 2
    err = capsys.readouterr().err
    assert "tp=48" in err and "Traceback" not in err


def test_dump_plan_missing_model_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump-plan", "--model", str(tmp_path / "absent")]) == 2
    assert "absent" in capsys.readouterr().err


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert len(actions) == 1
    return dict(actions[0].choices)


def test_cli_surface_frozen() -> None:
    subs = _subcommands(build_parser())
    assert set(subs) == {"dump-plan", "demo", "translate", "verify", "calibrate"}
    flags = {s for a in subs["dump-plan"]._actions for s in a.option_strings}
    assert flags == {"-h", "--help", "--tp", "--format", "--model", "--layers", "--table", "--dp-shard",
                     "--batch", "--seq", "--fp8", "--cp", "--sequence-parallel", "--pp", "--pp-schedule",
                     "--pp-microbatches",
                     "--pp-virtual", "--auto", "--gpus", "--gpus-per-node", "--hardware", "--dtype", "--top"}
    calibrate_flags = {s for a in subs["calibrate"]._actions for s in a.option_strings}
    assert calibrate_flags == {"-h", "--help", "--out", "--procs"}
    tr_flags = {s for a in subs["translate"]._actions for s in a.option_strings}
    assert tr_flags == {"-h", "--help", "--dtype", "--max-shard-size", "--overwrite", "--quiet"}
    positionals = [a.dest for a in subs["dump-plan"]._actions if not a.option_strings]
    assert positionals == ["name"]
    demo_flags = {s for a in subs["demo"]._actions for s in a.option_strings}
    assert demo_flags == {"-h", "--help", "--tp", "--steps"}
    verify_flags = {s for a in subs["verify"]._actions for s in a.option_strings}
    assert verify_flags == {"-h", "--help", "--tp", "--tol", "--layers", "--no-generate", "--format",
                            "--attn", "--sequence-parallel", "--inject-fault", "--cp", "--pp", "--dtype"}
    assert [a.dest for a in subs["verify"]._actions if not a.option_strings] == ["model"]


@pytest.mark.slow  # spawns processes
def test_demo_subprocess() -> None:
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "tpcompile", "demo", "--tp", "2", "--steps", "3"],
        cwd=_REPO_ROOT, capture_output=True, text=True, timeout=180,
    )
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "logits: max abs diff" in out and "-> match" in out
    assert "losses: match" in out and "tokens: match" in out
    assert out.count("  step ") == 3
    print(f"[demo --tp 2 --steps 3: {wall:.1f} s]")


def test_dump_plan_table_shows_hf_rows_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dump-plan", "gpt2", "--tp", "2", "--layers", "2", "--table"]) == 0
    out = capsys.readouterr().out
    # the fused Q|K|V projection: rank 0 takes the first half of each of q, k and v
    assert "0:384 768:1152 1536:1920" in out and "384:768 1152:1536 1920:2304" in out
    assert "25129:50257 pad×1" in out  # vocabulary 50257 padded to 2 × 25129
    assert main(["dump-plan", "llama", "--tp", "2", "--layers", "1", "--table", "--format", "json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert table["tensors"]["lm_head.weight"]["runs"] == [[[0, 64128]], [[64128, 128256]]]
