"""Section ``soak``: a long run at dp_shard 2 × tp 2 (world 4) must not leak.

One tiny Llama, ``parallelize(tp=2, dp_shard=2)``, AdamW on ``examples/train.py``'s
synthetic task, an asynchronous sharded checkpoint (``checkpoint.save(..., step=,
async_=True)``, as ``examples/train.py`` saves) every ``save_every`` steps.  Every rank
samples, at each checkpoint (before it starts, once the previous one has finished, after
a ``gc.collect()``) and once more at the end (after the last save):

* **resident set** (``VmRSS``): flat after warm-up — the first checkpoint and the
  ``save_every`` steps after it, by which point the async save's process group, mirror
  meshes and DCP machinery exist — growth to the end ≤ 2% is the target;
* **hooks and handles**: every module's forward / forward-pre / backward / backward-pre
  hooks, every parameter's tensor hooks (``register_hook`` and post-accumulate-grad),
  torch's global module hooks, and the live ``RemovableHandle`` objects (what every
  ``register_*hook`` call returns, in the whole process) — constant;
* **open file descriptors** (``/proc/self/fd``): no leak (files, sockets, pipes);
* threads, process groups and live Python objects, for diagnosis.

    python benchmarks/soak.py [--steps 1000 --save-every 100]    # or: run.py --only soak
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run on its own: the sections import common as top-level
    sys.path.insert(0, str(HERE))

from common import row, section_result, spawn_ranks  # noqa: E402

WORLD, TP, DP_SHARD = 4, 2, 2
MIB = 2**20
TARGET_GROWTH = 0.02


@dataclass(frozen=True)
class Spec:
    steps: int = 1000
    save_every: int = 100  # 0: no checkpoints (what the steps alone cost)
    sample_every: int = 100
    batch: int = 8  # global: 4 sequences per data-parallel rank
    seq: int = 32
    lr: float = 3e-3
    seed: int = 0
    timeout_s: float = 7200.0


def _rss() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not in /proc/self/status")


def _hooks(model: torch.nn.Module) -> dict[str, int]:
    """Hooks a training step could pile up: on modules, on parameters, torch's global ones."""
    from torch.nn.modules import module as nn_module
    from torch.utils.hooks import RemovableHandle

    mods = list(model.modules())
    forward = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in mods)
    backward = sum(len(m._backward_pre_hooks) + len(m._backward_hooks) for m in mods)
    tensor = 0
    for p in model.parameters():
        for t in (p, getattr(p, "_local_tensor", None)):  # a DTensor and its local shard
            if t is not None:
                tensor += len(t._backward_hooks or {}) + len(getattr(t, "_post_accumulate_grad_hooks", None) or {})
    global_ = sum(len(getattr(nn_module, name)) for name in dir(nn_module)
                  if name.startswith("_global_") and name.endswith("_hooks"))
    # every handle a register_*hook call returned that is still alive, model or not
    handles = sum(type(o) is RemovableHandle for o in gc.get_objects())
    return {"forward": forward, "backward": backward, "tensor": tensor, "global": global_,
            "handles": handles}


def _sample(step: int, model: torch.nn.Module) -> dict[str, Any]:
    gc.collect()  # count what is held, not garbage the collector has yet to reach
    from torch.distributed.distributed_c10d import _world

    return {"step": step, "rss": _rss(), "fds": len(os.listdir("/proc/self/fd")),
            "hooks": _hooks(model), "threads": threading.active_count(),
            "groups": len(_world.pg_map), "objects": len(gc.get_objects())}


def _rank(rank: int, spec: Spec, root: str) -> dict[str, Any]:
    """One rank's soak: its samples and step times."""
    from transformers import AutoModelForCausalLM

    import tpcompile
    import tpcompile.checkpoint as ckpt
    from tpcompile.tools.presets import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    tpcompile.parallelize(model, tp=TP, dp_shard=DP_SHARD, seed=spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr)
    dp_rank, dp_size = tpcompile.data_parallel_rank(model)
    vocab = model.config.vocab_size
    model.train()
    samples, times, losses, handle = [], [], [], None
    for step in range(1, spec.steps + 1):
        t = time.perf_counter()
        g = torch.Generator().manual_seed(spec.seed * 1_000_003 + step)  # train.py's global_batch
        start = torch.randint(0, vocab, (spec.batch, 1), generator=g)
        stride = torch.randint(1, 17, (spec.batch, 1), generator=g)
        ids = ((start + stride * torch.arange(spec.seq)) % vocab).chunk(dp_size)[dp_rank]
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
        losses.append(loss.item())
        if step % spec.sample_every == 0:
            if handle is not None:
                handle.wait()  # long done, steps later: the sample sees no write in flight
            samples.append(_sample(step, model))
        if spec.save_every and step % spec.save_every == 0:
            handle = ckpt.save(root, model, opt, kind="sharded", step=step, async_=True,
                               extra={"step": step})
    if handle is not None:
        handle.wait()
    samples.append(_sample(spec.steps, model))
    samples[-1]["step"] = "end"
    dist.barrier()
    return {"rank": rank, "samples": samples, "times": times, "first_loss": losses[0],
            "last_loss": losses[-1]}


def measure(spec: Spec) -> dict[int, dict[str, Any]]:
    with tempfile.TemporaryDirectory() as root:
        return spawn_ranks(_rank, WORLD, (spec, root), timeout_s=spec.timeout_s)


def _warm_index(samples: list[dict[str, Any]]) -> int:
    """The sample after warm-up: the second checkpoint's (the first has completed by then)."""
    return 1 if len(samples) > 2 else 0


def _total_hooks(sample: dict[str, Any]) -> int:
    return sum(n for kind, n in sample["hooks"].items() if kind != "handles")


def summarize_ranks(res: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: warm-up vs end of every quantity, and the verdicts."""
    out = []
    for rank in sorted(res):
        s = res[rank]["samples"]
        after = s[_warm_index(s):]
        warm, end = after[0], s[-1]
        growth = end["rss"] / warm["rss"] - 1
        out.append({
            "rank": rank, "warm_step": warm["step"], "rss_warm": warm["rss"] / MIB, "rss_end": end["rss"] / MIB,
            "rss_max_after_warm": max(x["rss"] for x in after) / MIB, "growth": growth,
            "hooks_warm": _total_hooks(warm), "hooks_end": _total_hooks(end),
            "handles_warm": warm["hooks"]["handles"], "handles_end": end["hooks"]["handles"],
            "hooks_constant": len({tuple(x["hooks"].values()) for x in s}) == 1, "hooks": end["hooks"],
            "fds_warm": warm["fds"], "fds_end": end["fds"], "fds_after_warm": [x["fds"] for x in after],
            "threads": [x["threads"] for x in s], "groups": [x["groups"] for x in s],
            "objects_warm": warm["objects"], "objects_end": end["objects"],
            "median_step_s": sorted(res[rank]["times"])[len(res[rank]["times"]) // 2],
        })
    return out


def _side_by_side(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    header = ["rank", "RSS after warm-up (MiB)", "RSS at the end (MiB)", "growth", "hooks (warm → end)",
              "handles (warm → end)", "open fds (warm → end)", "threads", "process groups",
              "Python objects (warm → end)"]
    rows = [[str(r["rank"]), f"{r['rss_warm']:.1f}", f"{r['rss_end']:.1f}", f"{100 * r['growth']:+.2f}%",
             f"{r['hooks_warm']} → {r['hooks_end']}", f"{r['handles_warm']} → {r['handles_end']}",
             f"{r['fds_warm']} → {r['fds_end']}",
             "/".join(map(str, sorted(set(r["threads"])))), "/".join(map(str, sorted(set(r["groups"])))),
             f"{r['objects_warm']:,} → {r['objects_end']:,}"] for r in ranks]
    return {"title": "per rank, side by side (warm-up = the second checkpoint's sample)", "header": header,
            "rows": rows}


def _over_time(res: dict[int, dict[str, Any]]) -> dict[str, Any]:
    steps = [str(x["step"]) for x in res[0]["samples"]]
    rows = [[f"rank {rank} RSS (MiB)", *(f"{x['rss'] / MIB:.1f}" for x in res[rank]["samples"])]
            for rank in sorted(res)]
    rows += [[f"rank {rank} open fds", *(str(x["fds"]) for x in res[rank]["samples"])] for rank in sorted(res)]
    return {"title": "samples at each checkpoint (before it starts) and at the end", "header": ["step", *steps],
            "rows": rows}


def _verdict(ranks: list[dict[str, Any]]) -> list[str]:
    worst = max(ranks, key=lambda r: r["growth"])
    rss_ok = worst["growth"] <= TARGET_GROWTH
    hooks_ok = all(r["hooks_constant"] for r in ranks)
    fds_ok = all(len(set(r["fds_after_warm"])) == 1 for r in ranks)
    return [f"resident set: worst growth after warm-up {100 * worst['growth']:+.2f}% (rank {worst['rank']}); "
            f"target ≤ {100 * TARGET_GROWTH:.0f}%: {'met' if rss_ok else 'NOT met'}",
            f"hooks and handles: {ranks[0]['hooks']} on rank 0; "
            f"{'constant on every rank' if hooks_ok else 'NOT constant'}",
            f"open file descriptors: {'constant after warm-up on every rank' if fds_ok else 'NOT constant'} "
            f"({', '.join(str(r['fds_end']) for r in ranks)} per rank)"]


def interval_medians(times: list[float], every: int) -> list[float]:
    """The median step time of each ``every`` steps (a row keeps these, not every step)."""
    return [statistics.median(times[i:i + every]) for i in range(0, len(times), every)]


def report(spec: Spec, res: dict[int, dict[str, Any]]) -> dict[str, Any]:
    ranks = summarize_ranks(res)
    rows = [row(f"rank {r['rank']}: resident set at the end", [r["rss_end"]], unit="MiB", baseline=r["rss_warm"],
                note=f"after warm-up (step {r['warm_step']}) {r['rss_warm']:.1f} MiB; "
                     f"growth {100 * r['growth']:+.2f}%") for r in ranks]
    rows.append(row(f"training step (rank 0): the medians of each {spec.sample_every} steps",
                    interval_medians(res[0]["times"], spec.sample_every), note="fwd + bwd + clip + AdamW"))
    notes = [f"tiny Llama (hidden 64, 2 layers, vocab 256), parallelize(tp={TP}, dp_shard={DP_SHARD}) at world {WORLD}, "
             f"global batch {spec.batch} x {spec.seq}, {spec.steps} AdamW steps, an async sharded "
             f"checkpoint every {spec.save_every}; loss {res[0]['first_loss']:.3f} -> {res[0]['last_loss']:.3f}",
             *_verdict(ranks)]
    out = section_result(f"{spec.steps} steps at dp_shard {DP_SHARD} x tp {TP}, a checkpoint every "
                         f"{spec.save_every}", rows, ratio_of="the resident set after warm-up", notes=notes,
                         config=asdict(spec))
    out["tables"] = [_side_by_side(ranks), _over_time(res)]
    out["ranks"] = ranks
    return out


def run(quick: bool) -> dict[str, Any]:
    spec = Spec(steps=200, save_every=50, sample_every=50) if quick else Spec()
    return report(spec, measure(spec))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=Spec.steps)
    ap.add_argument("--save-every", type=int, default=Spec.save_every, help="0: no checkpoints")
    ap.add_argument("--sample-every", type=int, default=None, help="default: --save-every, else 100")
    a = ap.parse_args()
    spec = Spec(steps=a.steps, save_every=a.save_every, sample_every=a.sample_every or a.save_every or 100)
    t0 = time.perf_counter()
    res = report(spec, measure(spec))
    print(res["title"])
    for r in res["rows"]:
        ratio = f" (ratio {r['ratio']:.4f})" if r.get("ratio") is not None else ""
        print(f"  {r['name']}: {r['median']:.4g} {r['unit']}{ratio}; {r['note']}")
    for table in res["tables"]:
        print(f"\n{table['title']}")
        widths = [max(len(str(c)) for c in col) for col in zip(table["header"], *table["rows"], strict=True)]
        for line in [table["header"], *table["rows"]]:
            print("  ".join(str(c).rjust(w) for c, w in zip(line, widths, strict=True)))
    print()
    for note in res["notes"]:
        print(f"- {note}")
    print(f"\nwall time {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
