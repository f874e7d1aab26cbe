"""Read saved model directories with plain transformers, in a fresh interpreter.

``plain_logits(ids, dirs)`` loads each directory with ``AutoModelForCausalLM.from_pretrained``
in a new Python process where ``import tpcompile`` fails, so the files alone must be a
complete Hugging Face checkpoint, and returns each model's logits for ``ids``. It fails
(pytest assertion) on a crash or on transformers reporting missing / uninitialized weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

__all__ = ["plain_logits"]

_PLAIN_LOAD = """
import sys, json, torch
sys.modules["tpcompile"] = None  # prove the directories need no tpcompile
from transformers import AutoModelForCausalLM
ids = torch.tensor(json.loads(sys.argv[1]))
out = []
for d in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    with torch.no_grad():
        out.append(model(ids).logits.tolist())
print(json.dumps(out))
"""


def plain_logits(ids: torch.Tensor, dirs: list[Path]) -> list[list]:
    """Logits of every directory's model for ``ids``, loaded by plain transformers."""
    proc = subprocess.run([sys.executable, "-c", _PLAIN_LOAD, json.dumps(ids.tolist()), *map(str, dirs)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "were not initialized" not in proc.stderr and "MISSING" not in proc.stderr, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])
