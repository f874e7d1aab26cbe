"""Section ``checkpoint_io``: checkpoint write speed against the disk's own limit.

* ``save_pretrained`` (2 ranks, tp=2: each rank pwrites its own rows, fsynced) vs a
  raw ``safetensors.torch.save_file`` of the same tensors already gathered in memory on
  rank 0 (plus an fsync, so both pay for durability) — throughput ratio;
* async sharded save: time the training loop is blocked vs a synchronous sharded save;
* ``translate`` of a sharded checkpoint vs accelerate's ``merge_fsdp_weights`` on an
  equivalent ``torch.distributed.checkpoint`` directory (if accelerate is installed).

Competitors alternate within each repeat so drift hits them alike.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import row, section_result, spawn_ranks, summarize  # noqa: E402

WORLD = 2
MB = 1024 * 1024


def _config(quick: bool) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                       num_hidden_layers=2 if quick else 8, num_attention_heads=16,
                       num_key_value_heads=8, tie_word_embeddings=False)


def _timed(fn: Any) -> float:
    os.sync()  # earlier writes' dirty pages must not be flushed on this competitor's clock
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _fsynced_save_file(sd: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(sd, str(path))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def _worker(rank: int, root: str, repeats: int) -> dict[str, list[float]] | None:
    """One rank's timings (rank 0 reports them; the ranks time the same barriers)."""
    import tpcompile
    import tpcompile.checkpoint as ckpt

    root = Path(root)
    model = tpcompile.from_pretrained(root / "hf", tp=WORLD)
    sd = tpcompile.hf_state_dict(model)  # rank 0: the tensors raw save_file writes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.arange(16).view(1, 16)
    model.train()
    model(ids, labels=ids).loss.backward()
    opt.step()
    res: dict[str, list[float]] = {"save_pretrained": [], "raw": [], "sync": [], "async_block": [],
                                   "async_total": []}
    for _ in range(repeats):
        res["save_pretrained"].append(_timed(lambda: tpcompile.save_pretrained(model, root / "ours")))

        def raw() -> None:
            if rank == 0:
                _fsynced_save_file(sd, root / "raw.safetensors")
        res["raw"].append(_timed(raw))
        res["sync"].append(_timed(lambda: ckpt.save(root / "sync", model, opt, kind="sharded")))
        os.sync()
        dist.barrier()
        start = time.perf_counter()
        handle = ckpt.save(root / "async", model, opt, kind="sharded", async_=True)
        res["async_block"].append(time.perf_counter() - start)
        handle.wait()
        res["async_total"].append(time.perf_counter() - start)
        dist.barrier()
    return res if rank == 0 else None


def _translate_vs_merge(root: Path, repeats: int) -> tuple[list[float], list[float], str | None]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from tpcompile.checkpoint.translate import translate_checkpoint

    try:
        from accelerate.utils import merge_fsdp_weights
    except ImportError:
        merge_fsdp_weights = None
    # an equivalent DCP checkpoint, as accelerate's FSDP SHARDED_STATE_DICT saves it
    sd = {k: v for f in sorted((root / "ours").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    dcp.save({"model": sd}, checkpoint_id=root / "dcp", no_dist=True)
    ours, theirs = [], []
    for i in range(repeats):
        start = time.perf_counter()
        translate_checkpoint(root / "sync", root / f"tr-{i}", progress=False)
        ours.append(time.perf_counter() - start)
        if merge_fsdp_weights is not None:
            start = time.perf_counter()
            merge_fsdp_weights(str(root / "dcp"), str(root / f"merged-{i}"), safe_serialization=True)
            theirs.append(time.perf_counter() - start)
        shutil.rmtree(root / f"tr-{i}", ignore_errors=True)
        shutil.rmtree(root / f"merged-{i}", ignore_errors=True)
    return ours, theirs, None if merge_fsdp_weights else "accelerate not installed (pip install accelerate)"


def run(quick: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    repeats = 2 if quick else 5
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(quick)).save_pretrained(root / "hf")
        weights = sum(f.stat().st_size for f in (root / "hf").glob("*.safetensors"))
        res = spawn_ranks(_worker, WORLD, (tmp, repeats), timeout_s=3600, collective_timeout_s=900)[0]
        ours_tr, merge, merge_err = _translate_vs_merge(root, repeats)
    mbps = weights / MB
    raw = summarize(res["raw"])["median"]
    sync = summarize(res["sync"])["median"]
    rows = [
        row("raw save_file (rank 0, tensors in memory)", res["raw"], baseline=raw,
            note=f"{mbps / raw:.0f} MB/s"),
        row("save_pretrained tp=2 (each rank writes its rows)", res["save_pretrained"], baseline=raw,
            note=f"{mbps / summarize(res['save_pretrained'])['median']:.0f} MB/s; throughput "
                 f"{raw / summarize(res['save_pretrained'])['median']:.2f}× raw"),
        row("sharded save, synchronous", res["sync"], baseline=sync),
        row("sharded save, async: blocking part", res["async_block"], baseline=sync,
            note=f"total until written {summarize(res['async_total'])['median']:.2f} s"),
        row("translate sharded → HF", ours_tr, baseline=summarize(ours_tr)["median"]),
        row("accelerate merge_fsdp_weights (equivalent DCP)", merge or None,
            baseline=summarize(ours_tr)["median"], error=merge_err),
    ]
    notes = [f"model: Llama, {weights / MB:.0f} MB fp32 weights; sharded saves include AdamW state "
             "(3× the weights)"]
    return section_result("checkpoint I/O", rows, ratio_of="the first row of each group", notes=notes,
                          config={"weights_bytes": weights, "repeats": repeats})
