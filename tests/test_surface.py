"""The public surface is small and frozen; the code is lint-clean."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tpcompile

ROOT = Path(__file__).resolve().parent.parent


def test_public_api_names_are_frozen() -> None:
    assert sorted(tpcompile.__all__) == [
        "ModulePlan", "ParamPlan", "Plan", "Role", "TPError", "TranslationTable", "from_pretrained",
        "hf_state_dict", "load_hf_weights", "parallelize", "plan_model", "save_pretrained", "transform",
    ]


def test_rules_ship_inside_the_package() -> None:
    import tpcompile.rules

    names = {r.name for r in tpcompile.rules.default_rules()}
    assert {"linear", "sdpa", "embedding", "view", "elementwise", "softmax"} <= names


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff not installed")
def test_ruff_clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "tpcompile", "rules", "tests", "examples", "benchmarks"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
