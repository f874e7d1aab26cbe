"""Section ``dropout_masks``: what drawing dropout masks whole costs a training step.

In training with dropout, a tensor-parallel model draws each mask over split features
(the attention probabilities of a rank's heads) at its whole shape and keeps the rank's
rows, so it trains as one process does (``tpcompile.runtime.masks``).  That costs each
rank ``tp`` times the random numbers it keeps and a Python dispatch per op of the
modules that draw.  This section times a GPT-2 training step (forward, backward, AdamW)
at tp=2 with dropout 0.1 everywhere, the masks drawn whole and, in the same processes
and alternating with it, drawn for the local shape as before (not one process's masks),
and a step of one process for scale.

    python benchmarks/dropout_masks.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import row, section_result, spawn_ranks  # noqa: E402

SIZE = {"n_embd": 512, "n_head": 8, "n_layer": 4, "vocab_size": 8192, "n_positions": 512}
QUICK_SIZE = {**SIZE, "n_embd": 256, "n_layer": 2}
BATCH, SEQ, STEPS = 4, 256, 6


def _build(size: dict[str, int]) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(**size, attn_pdrop=0.1, resid_pdrop=0.1, embd_pdrop=0.1)
    return GPT2LMHeadModel._from_config(cfg, attn_implementation="eager").train()


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    t0 = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0


def _rank(rank: int, size: dict[str, int], steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    import tpcompile
    from tpcompile.runtime import torch_backend

    torch.set_num_threads(1)
    model = tpcompile.transform(_build(size), tp=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, size["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    whole_check = torch_backend.may_drop
    times: dict[str, list[float]] = {"whole": [], "local": []}
    for i in range(steps + 1):
        for how in ("whole", "local") if i % 2 else ("local", "whole"):
            torch_backend.may_drop = whole_check if how == "whole" else (lambda m: False)
            dist.barrier()
            t = _step(model, opt, ids)
            if i:  # the first round warms up
                times[how].append(t)
    torch_backend.may_drop = whole_check
    return times


def _one_process(size: dict[str, int], steps: int) -> list[float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _build(size)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, size["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        return [_step(model, opt, ids) for _ in range(steps + 1)][1:]
    finally:
        torch.set_num_threads(threads)


def run(quick: bool) -> dict[str, Any]:
    size, steps = (QUICK_SIZE, 3) if quick else (SIZE, STEPS)
    ranks = spawn_ranks(_rank, 2, (size, steps))
    whole = [max(ranks[0]["whole"][i], ranks[1]["whole"][i]) for i in range(steps)]
    local = [max(ranks[0]["local"][i], ranks[1]["local"][i]) for i in range(steps)]
    single = _one_process(size, steps)
    base = statistics.median(local)
    rows = [row("tp=2, masks drawn for the local shape (not one process's)", local, baseline=base),
            row("tp=2, masks drawn whole (one process's masks)", whole, baseline=base),
            row("one process", single, baseline=base)]
    return section_result("training step with dropout 0.1: masks drawn whole vs local, GPT-2 at tp=2", rows,
                          ratio_of="tp=2 with local masks (slowest rank per step)",
                          notes=[f"GPT-2 {size}, batch {BATCH}x{SEQ}, fp32, eager attention, 1 thread per rank"],
                          config={"size": size, "batch": BATCH, "seq": SEQ, "steps": steps})


def main() -> None:
    result = run(quick="--quick" in sys.argv)
    for r in result["rows"]:
        print(f"{r['name']}: {r['median']:.3f} s (x{r['ratio']:.3f})")


if __name__ == "__main__":
    main()
