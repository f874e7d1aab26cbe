"""examples/train.py under torchrun: resumable, deterministic, exports a plain HF model.

Three launches of ``python -m torch.distributed.run --nproc-per-node 2`` on CPU: 4 steps
(checkpoints at 2 and 4), the same command with ``--steps 6`` (resumes from step 4), and
an uninterrupted 6-step run in a fresh directory. The resumed run's losses for steps 5-6
must equal the uninterrupted run's, and the exported directory must load with plain
``transformers`` and reproduce the script's own logits.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tpcompile.tools.launch import free_port

REL = 1e-5
SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train.py"
STEP_RE = re.compile(r"^step\s+(\d+) \| loss ([0-9.]+)", re.MULTILINE)


def _train(tmp: Path, steps: int, ckpt: str, out: str, log_json: str | None = None) -> tuple[dict[int, float], str]:
    """Run the example on 2 CPU processes; the losses rank 0 logged, and its stdout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(SCRIPT), "--steps", str(steps),
           "--save-every", "2", "--batch", "4", "--seq", "32",
           "--ckpt-dir", str(tmp / ckpt), "--out-dir", str(tmp / out)]
    if log_json:
        cmd += ["--log-json", str(tmp / log_json)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {int(s): float(v) for s, v in STEP_RE.findall(proc.stdout)}, proc.stdout


@pytest.mark.slow
def test_train_example_resumes_exactly_and_exports(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from tpcompile.tools.presets import tiny_config

    first, _ = _train(tmp_path, 4, "ckpt", "out-first")
    resumed, log = _train(tmp_path, 6, "ckpt", "out-resumed", "resumed.json")
    straight, _ = _train(tmp_path, 6, "ckpt-straight", "out-straight", "straight.json")

    assert sorted(first) == [1, 2, 3, 4] and sorted(straight) == [1, 2, 3, 4, 5, 6]
    assert "resumed from" in log and "step-00000004" in log
    assert sorted(resumed) == [5, 6]  # nothing before the checkpoint is recomputed
    for step, loss in [*first.items(), *resumed.items()]:
        assert loss == pytest.approx(straight[step], rel=REL), (step, loss, straight[step])
    assert straight[6] < straight[1]  # the synthetic task is learnable
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000006"

    # the export is a plain HF directory of the trained model
    meta = json.loads((tmp_path / "resumed.json").read_text())
    assert meta["resumed_from"] == 4
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out-resumed").eval()
    fresh = AutoModelForCausalLM.from_config(tiny_config("llama"))
    got, want = model.state_dict(), fresh.state_dict()
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    with torch.no_grad():
        logits = model(torch.tensor(meta["probe_ids"])).logits[:, -1, :1024]
    torch.testing.assert_close(logits, torch.tensor(meta["probe_logits"]), rtol=0, atol=1e-5)
    # and the resumed run ends with the uninterrupted run's weights
    other = AutoModelForCausalLM.from_pretrained(tmp_path / "out-straight").state_dict()
    for k, v in got.items():
        torch.testing.assert_close(v, other[k], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_lora_finetune_example_saves_a_peft_adapter_and_a_merged_model(tmp_path: Path) -> None:
    """examples/finetune_lora.py: TRL's SFTTrainer(peft_config) on a tp=2 model; the adapter
    it saves loads onto a plain base with plain PEFT and equals the merged export."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tpcompile.tools.presets import tiny_config

    script = SCRIPT.parent / "finetune_lora.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
           str(free_port()), str(script), "--steps", "4", "--output-dir", str(tmp_path / "out")]
    proc = subprocess.run(cmd, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config("llama"))
    adapted = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged").eval()
    ids = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, m = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert (a - m).abs().max().item() < 1e-4
    lora_b = [v for k, v in adapted.state_dict().items() if "lora_B" in k]
    assert lora_b and any(v.abs().max() > 0 for v in lora_b)  # trained: B left its zero init
