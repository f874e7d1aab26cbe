"""``TPCOMPILE_PLAN_CACHE``: a plan is traced once per model and arguments, then read back.

Single process: a second plan of the same model is read (no trace) and equals a fresh
one; every input a plan depends on changes the key; what the key cannot see is not
cached; warnings are seen again; refusals are stored; broken entries are planned again;
two planners at once trace once.  The test suite itself plans through a session cache
(conftest), so every distributed test reads plans another rank wrote.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path

import pytest
import torch
from test_dataflow import Weird  # an op no rule places (cumprod over split features)
from transformers import AutoModelForCausalLM

import tpcompile
from tpcompile import TPError
from tpcompile.plan import build
from tpcompile.plan.cache import ENV, plan_key
from tpcompile.tools.presets import tiny_config


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(ENV, str(tmp_path))
    return tmp_path


@pytest.fixture
def traces(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The class of every model the planner traces, in order."""
    seen: list[str] = []
    real = build.capture

    def counted(model: torch.nn.Module, **kwargs: object) -> object:
        seen.append(type(model).__name__)
        return real(model, **kwargs)

    monkeypatch.setattr(build, "capture", counted)
    return seen


def _meta(name: str = "llama", **overrides: object) -> torch.nn.Module:
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(name, **overrides))


def test_a_second_plan_is_read_not_traced(cache: Path, traces: list[str]) -> None:
    model = _meta("qwen3")
    first = tpcompile.plan_model(model, tp=2, sequence_parallel=True)
    assert traces and "cached" not in first.stats
    traced = len(traces)
    again = tpcompile.plan_model(_meta("qwen3"), tp=2, sequence_parallel=True)
    assert len(traces) == traced and again.stats["cached"] is True
    again.stats = first.stats
    assert again == first  # every field, the sequence plan included
    assert len(list(cache.glob("*.json"))) == 1


def test_the_key_sees_everything_a_plan_depends_on() -> None:
    model = _meta("llama")
    base = plan_key(model, {"tp": 2})
    assert base is not None and base == plan_key(_meta("llama"), {"tp": 2})

    def attn(impl: str) -> torch.nn.Module:
        m = _meta("llama")
        m.config._attn_implementation = impl  # private: not in the config's JSON
        return m

    assert plan_key(attn("eager"), {"tp": 2}) != plan_key(attn("sdpa"), {"tp": 2})
    changed = {
        "tp": plan_key(model, {"tp": 4}),
        "sequence_parallel": plan_key(model, {"tp": 2, "sequence_parallel": True}),
        "overrides": plan_key(model, {"tp": 2, "overrides": {"lm_head.weight": "replicated"}}),
        "config": plan_key(_meta("llama", num_key_value_heads=1), {"tp": 2}),
        "example inputs": plan_key(model, {"tp": 2, "example_inputs": {"input_ids": torch.zeros(1, 5).long()}}),
        "input values": plan_key(model, {"tp": 2, "example_inputs": {"input_ids": torch.ones(1, 5).long()}}),
    }
    untied = _meta("llama", tie_word_embeddings=True)
    untied.lm_head.weight = torch.nn.Parameter(torch.empty_like(untied.lm_head.weight, device="meta"))
    changed["tying"] = plan_key(untied, {"tp": 2})
    changed["tied"] = plan_key(_meta("llama", tie_word_embeddings=True), {"tp": 2})
    attr = copy.deepcopy(model)
    attr.model.layers[0].self_attn.scaling = 0.5  # a constant the forward reads
    changed["module attribute"] = plan_key(attr, {"tp": 2})
    bf16 = _meta("llama").to(torch.bfloat16)
    changed["dtype"] = plan_key(bf16, {"tp": 2})
    for value in (0.5, 2.0):  # a 0-d buffer enters by value
        scalar = _meta("llama")
        scalar.model.register_buffer("scale", torch.tensor(value))
        changed[f"scalar buffer {value}"] = plan_key(scalar, {"tp": 2})
    changed["complex buffer"] = plan_key(model, {"tp": 2, "example_inputs": {"x": torch.ones(2, dtype=torch.cfloat)}})
    keys = list(changed.values())
    assert None not in keys and base not in keys and len(set(keys)) == len(keys), changed


def test_the_key_follows_the_source_of_the_model_classes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib
    import sys

    from tpcompile.plan import cache as cache_mod

    monkeypatch.syspath_prepend(str(tmp_path))
    source = tmp_path / "cached_plan_model.py"
    keys = []
    for body in ("x * 2", "x * 3"):
        source.write_text(f"import torch\nclass M(torch.nn.Linear):\n    def forward(self, x):\n"
                          f"        return super().forward({body})\n")
        sys.modules.pop("cached_plan_model", None)
        cache_mod._file_hashes.clear()  # a file edited inside one process: a test-only case
        module = importlib.import_module("cached_plan_model")
        keys.append(plan_key(module.M(4, 4, device="meta"), {"tp": 2}))
    assert None not in keys and keys[0] != keys[1]


def test_what_the_key_cannot_see_is_not_cached() -> None:
    from tpcompile.rules.pointwise import pointwise

    model = _meta()
    assert plan_key(model, {"tp": 2}, rules=[pointwise]) is None
    hooked = _meta()
    hooked.model.norm.register_forward_hook(lambda m, i, o: o * 2)
    assert plan_key(hooked, {"tp": 2}) is None
    patched = _meta()
    patched.model.norm.forward = lambda x: x
    assert plan_key(patched, {"tp": 2}) is None
    assert plan_key(model, {"tp": 2, "example_inputs": {"input_ids": object()}}) is None


def test_warnings_are_seen_again_and_refusals_are_stored(cache: Path, traces: list[str]) -> None:
    with torch.device("meta"):
        weird = Weird()
    for _ in range(2):
        with pytest.warns(UserWarning, match="cumprod"):
            plan = tpcompile.plan_model(weird, tp=2, strict=False)
        assert "cached" not in plan.stats  # a plan that warned is not stored
    traced = len(traces)
    for _ in range(2):
        with pytest.raises(TPError, match=r"cumprod.*Add a rule"):
            tpcompile.plan_model(weird, tp=2)
    assert len(traces) == traced + 1  # the second refusal is read from the cache


def test_a_broken_entry_is_planned_again(cache: Path) -> None:
    model = _meta()
    want = tpcompile.plan_model(model, tp=2)
    (entry,) = cache.glob("*.json")
    entry.write_text('{"plan": {"truncated')
    got = tpcompile.plan_model(model, tp=2)
    assert "cached" not in got.stats and got.params == want.params
    assert tpcompile.plan_model(model, tp=2).stats["cached"] is True  # rewritten whole


def test_planners_at_once_trace_once(cache: Path, traces: list[str]) -> None:
    """The file lock: the second planner waits for the first's entry (separate opens of
    the lock file conflict as separate processes' would)."""
    models = [_meta("gpt2"), _meta("gpt2")]
    plans: list = [None, None]

    def plan(i: int) -> None:
        plans[i] = tpcompile.plan_model(models[i], tp=2)

    threads = [threading.Thread(target=plan, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(bool(p.stats.get("cached")) for p in plans) == [False, True]
    assert plans[0].params == plans[1].params
