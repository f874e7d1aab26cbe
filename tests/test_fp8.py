"""FP8 training through torchao's float8, exact under tensor parallelism and FSDP2.

Over gloo: a tp=2 FP8 model (and dp2 x tp2 under ``parallelize``, world 4) trains 4
AdamW steps with the losses of single-process torchao FP8 on the same linears
(rel 1e-4), and differs from the high-precision run, so FP8 is really on: llama (eager
and sdpa), qwen3 with sequence parallelism, mixtral's dense parts.  The default choice
of linears comes from the plan (split projections only: no LM head, no router).  State
dicts stay in high precision; an HF save loads in plain transformers equal.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from dist import CaseResults, run_cases
from transformers import AutoModelForCausalLM

import tpcompile
from tpcompile import TPError
from tpcompile.tools.presets import tiny_config

pytest.importorskip("torchao.float8")

REL = 1e-4
CASES = {  # family, attention, transform / parallelize keywords
    "llama_sdpa": ("llama", "sdpa", {}),
    "llama_eager": ("llama", "eager", {}),
    "qwen3_sp": ("qwen3", "sdpa", {"sequence_parallel": True}),
    "mixtral": ("mixtral", "sdpa", {}),
}


def _build(name: str, attn: str) -> torch.nn.Module:
    cfg = tiny_config(name)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def _losses(model: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = []
    for _ in range(4):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _compare(model: torch.nn.Module, name: str, attn: str) -> dict[str, Any]:
    from torchao.float8 import convert_to_float8_training

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    chosen = set(model.tpcompile_fp8)
    ref = _build(name, attn)
    convert_to_float8_training(ref, module_filter_fn=lambda m, fqn: fqn in chosen)
    return {"fp8": _losses(model, ids), "ref": _losses(ref, ids), "hp": _losses(_build(name, attn), ids),
            "chosen": sorted(chosen)}


def _tp(rank: int, world: int, name: str, attn: str, kwargs: dict) -> dict:
    model = tpcompile.transform(_build(name, attn), tp=world, fp8=True, **kwargs)
    return _compare(model, name, attn)


def _fsdp(rank: int, world: int) -> dict:
    model = tpcompile.parallelize(_build("llama", "sdpa"), tp=2, fp8=True)
    return _compare(model, "llama", "sdpa")


def _storage(rank: int, world: int, out: str) -> dict:
    """FP8 is compute only: state dicts and HF saves hold the high-precision tensors."""
    ref = _build("llama", "sdpa")
    model = tpcompile.transform(_build("llama", "sdpa"), tp=world, fp8=True)
    sd = model.state_dict()
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in sd.items()}
    state = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    dtypes = sorted({str(v.dtype) for v in full.values()})
    model.save_pretrained(out)
    result = {"state": state, "dtypes": dtypes}
    if rank == 0:
        plain = AutoModelForCausalLM.from_pretrained(out)
        result["saved"] = max((plain.state_dict()[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    errors = []
    for fp8 in ("rowwise", "int4"):
        try:
            tpcompile.transform(_build("llama", "sdpa"), tp=world, fp8=fp8)
        except TPError as err:
            errors.append(str(err))
    result["errors"] = errors
    return result


def _all_reduces(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int]:
    """All-reduces in one forward and one backward, as issued (CommDebugMode sees the
    functional collectives torchao's amax uses and the c10d ones of the TP hooks)."""
    from torch.distributed.tensor.debug import CommDebugMode

    model(input_ids=ids, labels=ids).loss.backward()  # warm-up: first-forward checks
    counts = []
    with CommDebugMode() as mode:
        loss = model(input_ids=ids, labels=ids).loss
    counts.append(sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op) or "allreduce" in str(op)))
    with CommDebugMode() as mode:
        loss.backward()
    counts.append(sum(n for op, n in mode.get_comm_counts().items() if "all_reduce" in str(op) or "allreduce" in str(op)))
    return counts[0], counts[1]


def _counted(rank: int, world: int) -> dict:
    """FP8's extra all-reduces as run equal the cost model's (``dump-plan --fp8``)."""
    from tpcompile.tools.cost import estimate_cost

    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    ran = [_all_reduces(tpcompile.transform(_build("llama", "sdpa"), tp=world, fp8=fp8), ids) for fp8 in (None, True)]
    with torch.device("meta"):
        meta = _build("llama", "sdpa")
    plan = tpcompile.plan_model(meta, tp=world)
    priced = []
    for fp8 in (False, True):
        steps = estimate_cost(meta, plan, fp8=fp8)["per_step"]
        priced.append((steps["forward"]["all_reduce"]["count"], steps["backward"]["all_reduce"]["count"]))
    return {"ran": [b - a for a, b in zip(*ran, strict=True)], "priced": [b - a for a, b in zip(*priced, strict=True)]}


@pytest.fixture(scope="module")
def world2(tmp_path_factory: pytest.TempPathFactory) -> CaseResults:
    cases: dict = {key: (_tp, *spec) for key, spec in CASES.items()}
    cases["storage"] = (_storage, str(tmp_path_factory.mktemp("fp8")))
    cases["counted"] = (_counted,)
    return run_cases(2, cases, timeout=900)


@pytest.fixture(scope="module")
def world4() -> CaseResults:
    return run_cases(4, {"fsdp": (_fsdp,)}, timeout=900)


def _check(r: dict) -> None:
    for got, want in zip(r["fp8"], r["ref"], strict=True):
        assert abs(got - want) <= REL * abs(want), r
    assert max(abs(a - b) for a, b in zip(r["fp8"], r["hp"], strict=True)) > 1e-4, r  # FP8 is really on
    assert r["chosen"] and not any("lm_head" in n or "gate." in n or n.endswith(".gate") for n in r["chosen"]), r


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_under_tp_equals_single_process_torchao(world2: CaseResults, case: str) -> None:
    for r in world2[case]:
        _check(r)


@pytest.mark.slow
def test_fp8_under_fsdp2_and_tp_equals_single_process_torchao(world4: CaseResults) -> None:
    for r in world4["fsdp"]:
        _check(r)


@pytest.mark.slow
def test_fp8_is_a_compute_setting_not_a_storage_one(world2: CaseResults) -> None:
    for r in world2["storage"]:
        assert r["state"] == 0.0 and r["dtypes"] == ["torch.float32"], r
        assert "rowwise" in r["errors"][0] and "tensorwise" in r["errors"][0], r
        assert "fp8 must be True" in r["errors"][1], r
    assert world2["storage"][0]["saved"] == 0.0


@pytest.mark.slow
def test_fp8_amax_reductions_are_priced_as_they_run(world2: CaseResults) -> None:
    for r in world2["counted"]:
        assert r["ran"] == r["priced"] and r["ran"][0] > 0 and r["ran"][1] > 0, r
