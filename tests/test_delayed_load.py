"""parallelize(load_from=<HF dir>): delayed init from a checkpoint, over real gloo processes.

A tiny Llama is saved with Hugging Face's own ``save_pretrained``. Every rank builds it on
the meta device and ``parallelize(..., load_from=dir)`` shards it, allocates only this
rank's shards and reads only the rows of its TP shard. Checked at (dp_shard 2 × tp 2),
(dp_shard 2, tp 1) and (tp 2):

* the HF state dict, rotary buffers and logits equal the eagerly loaded HF model (logits
  bit-exact where the layout does not reorder sums: tp=1; at tp=2 within 1e-5, and
  bit-exact against the eagerly loaded model parallelized the same way);
* two AdamW steps give the single-process losses (rel 1e-5);
* no random init runs; each rank holds 1/world of the parameter bytes and reads exactly
  its TP shard of the sharded tensors plus the replicated ones.

A bigger Llama (hidden 512, 8 layers, vocab 8000, fp32, ~108 MB) measures the peak RSS of
a rank during ``parallelize(load_from=...)`` against one process loading the whole model
with ``transformers``; the numbers are printed (``pytest -s``).
"""

from __future__ import annotations

import ctypes
import gc
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist import global_step, run_distributed
from torch.distributed.tensor import DTensor

import tpcompile
import tpcompile.checkpoint as ckpt
from tpcompile.tools.presets import tiny_config

REL = 1e-5
LR = 1e-2
BIG = dict(hidden_size=512, num_hidden_layers=8, vocab_size=8000, intermediate_size=1024,
           num_attention_heads=8, num_key_value_heads=4, head_dim=64)


# ---- helpers (run in the spawned ranks and in the test process) ----------------------


def _meta_model(path: str) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))


def _eager_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def _probe() -> torch.Tensor:
    return torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(3))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 9), generator=g) for _ in range(2)]


def _train(model: torch.nn.Module) -> list[float]:
    """Two AdamW steps; each dp rank takes its slice of the global batch. Global losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = [global_step(model, opt, ids) for ids in _batches()]
    model.tpcompile_test_optimizer = opt
    return losses


def _cloned(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items()}


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(_probe()).logits


def _status(field: str) -> int:
    """A ``/proc/self/status`` memory field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0) and return that RSS, after handing
    the heap's free memory back to the system (else an earlier load's freed memory is
    reused without showing in the RSS)."""
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _touch(model: torch.nn.Module) -> None:
    """Read every byte of this rank's parameters, so that all of them are resident."""
    with torch.no_grad():
        for p in model.parameters():
            (p.to_local() if isinstance(p, DTensor) else p).sum()


def _fail_init(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("load_from must not run the random-init materializer")


def _bytes(model: torch.nn.Module) -> dict[str, int]:
    """This rank's parameter bytes, the model's, and what reading its TP shard costs."""
    table = model.tpcompile_table
    tp = model.tpcompile_parallel.tp
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    sharded = replicated = largest = 0
    for key in table.saved_keys():
        t = table.tensors[key]
        n = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="meta")
        size = n.numel() * n.element_size()
        largest = max(largest, size)
        if t.sharded:
            sharded += size
        else:
            replicated += size
    return {"local": local, "total": total, "largest": largest, "replicated": replicated,
            "expected_read": sharded // tp + replicated,
            "read": model.tpcompile_load_stats["bytes_read"]}


def _load_case(tiny: str, layout: dict[str, int]) -> dict[str, Any]:
    """Delayed load at ``layout``; the same layout from an eagerly loaded model; training."""
    from tpcompile.runtime.materialize import Materializer

    original = Materializer.run
    Materializer.run = _fail_init  # nothing may be initialized, only read
    try:
        model = tpcompile.parallelize(_meta_model(tiny), load_from=tiny, **layout)
    finally:
        Materializer.run = original
    out: dict[str, Any] = {
        "mesh": tuple(model.tpcompile_mesh.shape),
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "bytes": _bytes(model),
        # cloned: where nothing needs gathering, hf_state_dict returns the live parameters
        # (as state_dict() does), and training below would change them
        "hf": _cloned(tpcompile.hf_state_dict(model)),
        "buffers": {n: b.clone() for n, b in model.named_buffers()},
        "logits": _logits(model),
    }
    # the eagerly loaded model under the same layout computes bit-identical logits
    eager = tpcompile.parallelize(_eager_model(tiny), **layout)
    out["same_as_eager_layout"] = torch.equal(_logits(eager), out["logits"])
    del eager
    out["losses"] = _train(model)
    out["trained"] = model
    return out


def _rss_case(big: str, layout: dict[str, int]) -> dict[str, int]:
    """Peak RSS above the baseline while parallelize(load_from=...) runs: the second
    load in this process, so the code it runs is resident already (a first run faults
    in tens of MiB of torch's code pages that are no model's memory)."""
    for _ in range(2):  # the second load is measured
        dist.barrier()
        base = _reset_peak()
        model = tpcompile.parallelize(_meta_model(big), load_from=big, **layout)
        _touch(model)
        peak = _status("VmHWM") - base
        out = {"peak": peak, **_bytes(model)}
        del model
        gc.collect()
    dist.barrier()
    return out


def _eager_rss(tiny: str, big: str) -> int:
    """Peak RSS above the baseline of one process loading the whole model with HF (the
    second load, as :func:`_rss_case` measures)."""
    _eager_model(big)  # warm up: lazy imports, code pages and caches are not the model's memory
    gc.collect()
    base = _reset_peak()
    model = _eager_model(big)
    _touch(model)  # transformers may leave weights in a lazily paged-in file mapping
    peak = _status("VmHWM") - base
    del model
    return peak


# ---- sessions: one launch per world size (spawning costs more than the work) --------


def _world4(rank: int, world: int, tiny: str, big: str) -> dict[str, Any]:
    out = _load_case(tiny, dict(dp_shard=2, tp=2))
    out.pop("trained")
    out["rss"] = _rss_case(big, dict(dp_shard=2, tp=2))
    return out


def _rss2(rank: int, world: int, tiny: str, big: str) -> dict[str, Any]:
    """Peak RSS of HF's eager load (rank 0, first: nothing big loaded yet) and of
    parallelize(load_from=...) at dp_shard=2, in new interpreters: a measurement of a
    process's own memory starts from nothing another test left in it."""
    eager = _eager_rss(tiny, big) if rank == 0 else None
    dist.barrier()
    return {"eager_rss": eager, "rss": _rss_case(big, dict(dp_shard=2, tp=1))}


def _world2(rank: int, world: int, tiny: str, big: str, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    case = _load_case(tiny, dict(dp_shard=2, tp=1))
    case.pop("trained")
    out["dp2_tp1"] = case
    case = _load_case(tiny, dict(dp_shard=1, tp=2))
    trained = case.pop("trained")
    out["tp2"] = case

    # a materialized model is overwritten in place (buffers untouched)
    torch.manual_seed(123)
    real = tpcompile.parallelize(_eager_model(tiny).apply(_scramble), tp=2, load_from=tiny)
    out["real_overwritten"] = tpcompile.hf_state_dict(real)

    # a training checkpoint loads into a meta-built model once parallelize has
    # materialized it (seed=: per-tensor init, shards only) ...
    root = Path(root)
    ckpt.save(root / "sharded", trained, trained.tpcompile_test_optimizer, kind="sharded",
              extra={"step": 2})
    out["trained_hf"] = _cloned(tpcompile.hf_state_dict(trained))
    fresh = tpcompile.parallelize(_meta_model(tiny), tp=1, dp_shard=2, seed=0)
    opt = torch.optim.AdamW(fresh.parameters(), lr=LR)
    out["resumed_extra"] = ckpt.load(root / "sharded", fresh, opt)
    out["resumed_hf"] = tpcompile.hf_state_dict(fresh)
    # ... and load_from names that route when given a training checkpoint
    try:
        tpcompile.parallelize(_meta_model(tiny), tp=2, load_from=root / "sharded")
        out["training_dir_error"] = None
    except tpcompile.TPError as err:
        out["training_dir_error"] = str(err)
    bad = root / "missing" if rank == 1 else Path(tiny)  # only rank 1 cannot read it
    try:
        tpcompile.parallelize(_meta_model(tiny), tp=2, load_from=bad)
        out["missing_error"] = None
    except tpcompile.TPError as err:
        out["missing_error"] = str(err)
    return out


def _scramble(module: torch.nn.Module) -> None:
    for p in module.parameters(recurse=False):
        torch.nn.init.uniform_(p.data)


# ---- the test process ----------------------------------------------------------------


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("delayed_load")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(root / "tiny")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config("llama", **BIG)).save_pretrained(root / "big")
    (root / "ckpt").mkdir()
    return {"tiny": str(root / "tiny"), "big": str(root / "big"), "ckpt": str(root / "ckpt")}


@pytest.fixture(scope="module")
def reference(dirs: dict[str, str]) -> dict[str, Any]:
    model = _eager_model(dirs["tiny"])
    return {"hf": {k: v.clone() for k, v in model.state_dict().items()},
            "buffers": {n: b.clone() for n, b in model.named_buffers()},
            "logits": _logits(model), "losses": _train(model)}


@pytest.fixture(scope="module")
def world4(dirs: dict[str, str]) -> list[dict[str, Any]]:
    return run_distributed(_world4, 4, dirs["tiny"], dirs["big"])


@pytest.fixture(scope="module")
def world2(dirs: dict[str, str]) -> list[dict[str, Any]]:
    return run_distributed(_world2, 2, dirs["tiny"], dirs["big"], dirs["ckpt"])


@pytest.fixture(scope="module")
def rss2(dirs: dict[str, str]) -> list[dict[str, Any]]:
    return run_distributed(_rss2, 2, dirs["tiny"], dirs["big"], interpreter=True)


def _check_load(results: list[dict[str, Any]], reference: dict[str, Any], mesh: tuple,
                world: int, exact_logits: bool) -> None:
    hf = results[0]["hf"]
    assert set(hf) == set(reference["hf"])
    bad = [k for k, v in reference["hf"].items() if not torch.equal(hf[k], v)]
    assert not bad, bad
    for r in results:
        assert r["mesh"] == mesh and r["dtensors"]
        for name, b in reference["buffers"].items():  # rotary tables recomputed, not garbage
            assert torch.equal(r["buffers"][name], b), name
        assert r["same_as_eager_layout"]
        if exact_logits:
            assert torch.equal(r["logits"], reference["logits"])
        else:
            torch.testing.assert_close(r["logits"], reference["logits"], rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(reference["losses"]),
                                   rtol=REL, atol=0)
        b = r["bytes"]
        # nobody materialized the model: 1/world of the parameter bytes on every rank
        assert abs(b["local"] - b["total"] / world) <= 0.01 * b["total"] / world, b
        # shard-on-read: exactly this rank's TP rows of sharded tensors + replicated ones
        assert b["read"] == b["expected_read"], b


@pytest.mark.slow
def test_world4_delayed_load(world4: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    _check_load(world4, reference, (1, 2, 2), 4, exact_logits=False)


@pytest.mark.slow
def test_world2_delayed_load(world2: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    _check_load([r["dp2_tp1"] for r in world2], reference, (1, 2, 1), 2, exact_logits=True)
    _check_load([r["tp2"] for r in world2], reference, (1, 1, 2), 2, exact_logits=False)
    first = world2[0]
    for k, v in reference["hf"].items():
        assert torch.equal(first["real_overwritten"][k], v), k
    assert first["resumed_extra"] == {"step": 2}
    for k, v in first["trained_hf"].items():
        assert torch.equal(first["resumed_hf"][k], v), k
    for r in world2:
        assert "tpcompile.checkpoint.load(path, model, optimizer)" in r["training_dir_error"]
        assert "on ranks [1]" in r["missing_error"], r["missing_error"]


@pytest.mark.slow
def test_delayed_load_peak_rss_below_eager(world4: list[dict[str, Any]],
                                           rss2: list[dict[str, Any]]) -> None:
    eager = rss2[0]["eager_rss"]
    mib = 2**20
    lines = [f"eager HF from_pretrained, 1 process: peak RSS +{eager / mib:.1f} MiB"]
    for name, results in (("dp_shard 2 x tp 2", [r["rss"] for r in world4]),
                          ("dp_shard 2, tp 1", [r["rss"] for r in rss2])):
        for rank, r in enumerate(results):
            lines.append(f"{name} rank {rank}: peak RSS +{r['peak'] / mib:.1f} MiB, params "
                         f"{r['local'] / mib:.1f}/{r['total'] / mib:.1f} MiB, read "
                         f"{r['read'] / mib:.1f} MiB (largest tensor {r['largest'] / mib:.1f} MiB)")
            assert r["read"] == r["expected_read"], r
            assert r["local"] <= r["peak"] < eager, (name, rank, r["peak"], eager)  # it sees the params
    print("\n" + "\n".join(lines))
    if os.environ.get("TPCOMPILE_RSS_REPORT"):
        Path(os.environ["TPCOMPILE_RSS_REPORT"]).write_text("\n".join(lines) + "\n")
