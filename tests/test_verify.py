"""``python -m tpcompile verify``: real gloo processes, real transform, real comparisons.

One case runs the command in its own interpreter; the others call the same CLI entry
point in this process (its workers are spawned either way), which saves an interpreter
start-up and its torch/transformers imports per case.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import AutoConfig

from tpcompile.tools.cli import main

_REPO_ROOT = Path(__file__).resolve().parent.parent
_FAULTY = "model.layers.1.mlp.up_proj"


def _verify(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tpcompile", "verify", *args], cwd=_REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    return proc, time.perf_counter() - start


@pytest.mark.slow
def test_verify_preset_passes() -> None:
    proc, wall = _verify("llama", "--tp", "2")
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    assert out.startswith("verify LlamaForCausalLM at tp=2")
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("model.", "lm_head"))}
    # every module of the shrunk 2-layer Llama has a row, each with forward and gradient checks
    assert "model.layers.1.self_attn.q_proj" in rows and "lm_head" in rows and len(rows) == 21
    assert all(line.rstrip().endswith(" ok") and line.count("abs ") + line.count("rel ") == 2
               for line in rows.values())
    assert "<output loss>" in out and "<output logits>" in out
    assert "generate (greedy): match" in out and "\nOK: 21 modules, 2 outputs match" in out
    print(f"[verify llama --tp 2: {wall:.1f} s]")


def _verify_in_process(capfd: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``main(["verify", *args])``: exit code, stdout and stderr (the workers' too: fd level)."""
    code = main(["verify", *args])
    out, err = capfd.readouterr()
    return code, out, err


@pytest.mark.slow
def test_verify_injected_fault_names_the_module(capfd: pytest.CaptureFixture[str]) -> None:
    # in float64 the split's rounding is ~1e-16, so a tolerance of 1e-10 leaves no room
    # for anything but a real difference
    code, out, err = _verify_in_process(capfd, "llama", "--tp", "2", "--no-generate", "--format", "json",
                                        "--dtype", "float64", "--tol", "1e-10", "--inject-fault", _FAULTY)
    assert code == 1, out + err
    report = json.loads(out)
    assert report["ok"] is False and report["error"] is None and report["dtype"] == "float64"
    assert report["first_divergence"] == f"{_FAULTY} (forward)"
    assert _FAULTY in report["failing"]
    # Modules that ran before the faulty one still match: the report localizes the fault.
    order = list(report["forward"])
    for name in order[: order.index(_FAULTY)]:
        check = report["forward"][name]
        assert check is None or min(check["abs"], check["rel"]) <= 1e-10, name
    assert report["forward"][_FAULTY]["abs"] >= 1e-3  # the injected 1e-2, rank 1 only


@pytest.mark.slow
def test_verify_transform_error_exits_1(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # StableLM's per-head LayerNorms (a ModuleList zipped with the heads) cannot follow
    # the heads a rank holds: transform refuses it, naming the norm; the shrunk copy keeps them
    AutoConfig.for_model("stablelm", qk_layernorm=True).save_pretrained(tmp_path)
    code, out, err = _verify_in_process(capfd, str(tmp_path / "config.json"), "--tp", "2",
                                        "--no-generate")
    assert code == 1, out + err
    assert "FAILED: transform failed: SelfCheckError" in out and "layernorm" in out and "tp=2" in out
    assert "Traceback" not in out + err


def test_verify_unknown_model_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "no-such-model", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "llama" in err and "config.json" in err


def test_verify_compares_outputs_nested_in_a_tuple() -> None:
    import torch
    from transformers.utils import ModelOutput

    from tpcompile.tools.verify import _loss, _output_tensors

    # MGP-STR returns its three heads' logits as a tuple: skipped, its loss was an int 0
    heads = (torch.ones(2, 3), torch.full((2, 4), 2.0), torch.zeros(2, 5))
    out = ModelOutput(logits=heads, attentions=None)
    assert sorted(_output_tensors(out)) == ["logits.0", "logits.1", "logits.2"]
    assert float(_loss(out)) == 5.0
