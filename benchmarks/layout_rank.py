"""Section ``layout_rank``: the layout planner's predictions against measured training steps.

For each scenario — a Llama (8 layers) at world 2 and at world 4, a Mixtral (4 layers, 8
experts top-2) at world 4 — on this host (gloo, one intra-op thread per rank, the ranks
sharing the host's cores):

1. ``calibrate(procs=world, threads=1)`` measures the host as the job's ranks see it
   (every rank multiplying at once, the links of a gloo group of ``world``);
2. :func:`tpcompile.tools.layout.price_layouts` prices each listed layout on that
   profile, exactly as ``plan_layout`` / ``dump-plan --auto`` price it;
3. one launch of ``world`` fresh processes builds every layout (the model on the meta
   device, initialised by ``parallelize(seed=0)``), then steps them in rounds on the same
   global batch (each data-parallel rank takes its share; a pipeline splits it into the
   layout's microbatches): each round one step of every layout, rotating which goes
   first, so a shared host's load, which drifts over minutes, falls on every layout
   alike; one warm-up round, then timed steps of ``pipeline_step`` + AdamW, barrier to
   barrier (the slowest rank), median over the rounds; then one more step of each under
   the profiler for memory.

Reported: Spearman's rank correlation of predicted and measured step times over the
layouts (issue target ≥ 0.8), the measured time of the predicted best against the
fastest measured (target: within 10%), and per layout the predicted peak memory per rank
against the measured one (target: within 10%).  **Measured memory** is allocator bytes,
what the prediction prices (``torch.cuda.max_memory_allocated``'s meaning; CPU torch has
no such counter, so it is rebuilt from the profiler's allocation events): the bytes of
the rank's parameters, buffers and AdamW state alive before the step, plus the highest
running total of the step's allocations minus frees (forward, backward and the optimizer
step), max over ranks.  Resident memory would add the interpreter, gloo's buffers and
glibc's arenas, which no layout choice changes.  Every layout's step-0 loss must equal
the first layout's (rel 1e-4): they train the same step.

``python benchmarks/layout_rank.py [--quick] [--json]`` runs it alone; ``--quick`` runs the
world-2 Llama with a smaller model and fewer layouts.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import row, section_result, spawn_ranks  # noqa: E402

MIB = 2**20
LOSS_REL = 1e-4


@dataclass(frozen=True)
class Scenario:
    """One model at one world size and the layouts ranked for it (keywords of ``Layout``)."""

    name: str
    family: str
    world: int
    layouts: tuple[dict[str, Any], ...]
    config: dict[str, Any] = field(default_factory=dict)
    batch: int = 8  # global sequences per step
    seq: int = 256
    warmup: int = 1
    repeats: int = 6

    def model_config(self) -> Any:
        from tpcompile.tools.presets import tiny_config

        cfg = tiny_config(self.family, max_position_embeddings=self.seq, tie_word_embeddings=False, **self.config)
        cfg._attn_implementation = "sdpa"
        return cfg


_LLAMA = {"num_hidden_layers": 8, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
          "head_dim": 64, "intermediate_size": 768, "vocab_size": 4096}
_MIXTRAL = {"num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 4,
            "head_dim": 64, "intermediate_size": 512, "vocab_size": 4096, "num_local_experts": 8,
            "num_experts_per_tok": 2}


def _pp(pp: int, schedule: str, m: int, v: int = 1, **rest: Any) -> dict[str, Any]:
    return {"pp": pp, "pp_schedule": schedule, "pp_microbatches": m, "pp_virtual": v, **rest}


SCENARIOS = (
    Scenario("llama 8L, world 2", "llama", 2, config=_LLAMA, layouts=(
        {"dp_shard": 2}, {"dp_replicate": 2}, {"dp_shard": 2, "activation_checkpointing": True},
        {"tp": 2}, {"tp": 2, "sequence_parallel": True}, {"tp": 2, "activation_checkpointing": True},
        {"cp": 2}, _pp(2, "gpipe", 4), _pp(2, "1f1b", 4), _pp(2, "interleaved_1f1b", 4, 2), _pp(2, "1f1b", 8))),
    Scenario("llama 8L, world 4", "llama", 4, config=_LLAMA, layouts=(
        {"dp_shard": 4}, {"dp_shard": 2, "dp_replicate": 2}, {"dp_shard": 4, "activation_checkpointing": True},
        {"tp": 2, "dp_shard": 2}, {"tp": 4}, {"tp": 2, "dp_shard": 2, "sequence_parallel": True},
        {"cp": 2, "dp_shard": 2}, _pp(2, "1f1b", 4, dp_shard=2), _pp(2, "gpipe", 4, dp_shard=2),
        _pp(2, "1f1b", 4, tp=2), _pp(4, "1f1b", 8))),
    Scenario("mixtral 4L 8 experts, world 4", "mixtral", 4, config=_MIXTRAL, layouts=(
        {"dp_shard": 4}, {"dp_shard": 4, "ep": 2}, {"dp_shard": 4, "ep": 4}, {"tp": 2, "dp_shard": 2},
        {"tp": 2, "dp_shard": 2, "ep": 2}, {"tp": 4}, {"cp": 2, "dp_shard": 2}, _pp(2, "1f1b", 4, dp_shard=2),
        {"dp_shard": 4, "activation_checkpointing": True})),
)
QUICK = (Scenario("llama 4L, world 2 (quick)", "llama", 2, seq=128, repeats=2,
                  config={**_LLAMA, "num_hidden_layers": 4, "hidden_size": 128, "head_dim": 32,
                          "intermediate_size": 384},
                  layouts=({"dp_shard": 2}, {"tp": 2}, {"cp": 2}, _pp(2, "1f1b", 4), {"dp_replicate": 2},
                           {"dp_shard": 2, "activation_checkpointing": True})),)


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else 0.0


# ----------------------------------------------------------------------------- ranks


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _allocation_peak(step: Any) -> int:
    """The highest running total of allocations minus frees while ``step()`` runs."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, size in sorted(events):
        live += size
        peak = max(peak, live)
    return peak


def _built(sc: Scenario, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """One layout's model (delayed init, ``seed=0``), optimizer and training step."""
    from transformers import AutoModelForCausalLM

    import tpcompile

    config = sc.model_config()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model = tpcompile.parallelize(model, seed=0, **kwargs)
    model.train()
    dp_rank, dp_size = tpcompile.data_parallel_rank(model)
    ids = torch.randint(0, config.vocab_size, (sc.batch, sc.seq), generator=torch.Generator().manual_seed(1))
    local = ids.chunk(dp_size)[dp_rank]
    batch = {"input_ids": local, "labels": local}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> torch.Tensor:
        loss = tpcompile.pipeline_step(model, batch)
        opt.step()
        opt.zero_grad()
        return loss

    return (model, opt), step


def _rank(rank: int, sc: Scenario) -> list[dict[str, Any]]:
    """Every layout built first, then stepped in rounds: each round runs one step of every
    layout (rotating which goes first), so the host's load, which drifts over minutes on
    a shared machine, falls on all layouts alike instead of on whichever ran then."""
    torch.set_num_threads(1)
    built = []
    for kwargs in sc.layouts:
        t0 = time.perf_counter()
        built.append(_built(sc, kwargs))
        if rank == 0:
            print(f"    {kwargs}: built in {time.perf_counter() - t0:.1f} s", flush=True)
    n = len(built)
    times: list[list[float]] = [[] for _ in range(n)]
    loss0: list[float] = [0.0] * n
    for r in range(sc.warmup + sc.repeats):
        for i in [(r + k) % n for k in range(n)]:
            dist.barrier()
            t0 = time.perf_counter()
            loss = built[i][1]()
            dist.barrier()
            if r == 0:
                total = loss.detach().clone().float()
                dist.all_reduce(total)
                loss0[i] = total.item() / dist.get_world_size()
            if r >= sc.warmup:
                times[i].append(time.perf_counter() - t0)
        if rank == 0:
            print(f"    round {r + 1} of {sc.warmup + sc.repeats} done", flush=True)
    out = []
    for i, ((model, opt), step) in enumerate(built):
        before = _storage_bytes([*model.parameters(), *model.buffers(),
                                 *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))])
        dist.barrier()
        out.append({"times": times[i], "loss0": loss0[i], "memory": before + _allocation_peak(step),
                    "resident_state": before})
    built.clear()
    gc.collect()
    return out


# ----------------------------------------------------------------------------- parent


def _predict(sc: Scenario, profile: Any) -> list[Any]:
    from transformers import AutoModelForCausalLM

    from tpcompile.plan.layout import Layout
    from tpcompile.tools.layout import price_layouts

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(sc.model_config())
    layouts = [Layout(**kw) for kw in sc.layouts]
    return price_layouts(model, layouts, gpus=sc.world, hardware=profile, batch=sc.batch, seq=sc.seq,
                         gpus_per_node=sc.world, dtype="fp32", headroom=0.0)


def _scenario(sc: Scenario) -> dict[str, Any]:
    from tpcompile.tools.calibration import calibrate

    print(f"  {sc.name}: calibrating over {sc.world} processes", flush=True)
    profile = calibrate(procs=sc.world, threads=1, name=f"this host, {sc.world} ranks")
    preds = _predict(sc, profile)
    load = os.getloadavg()[0]
    res = spawn_ranks(_rank, sc.world, (sc,), timeout_s=3600.0)
    layouts = []
    for i, pred in enumerate(preds):
        steps = [max(res[r][i]["times"][k] for r in res) for k in range(sc.repeats)]
        layouts.append({"label": pred.layout.label(), "predicted_s": pred.time["total"], "time_parts": pred.time,
                        "measured_s": statistics.median(steps), "best_s": min(steps), "steps": steps,
                        "predicted_memory": pred.memory["total"], "memory_parts": pred.memory,
                        "measured_memory": max(res[r][i]["memory"] for r in res), "loss0": res[0][i]["loss0"]})
    predicted = [x["predicted_s"] for x in layouts]
    measured = [x["measured_s"] for x in layouts]
    best_pred = min(range(len(layouts)), key=predicted.__getitem__)
    return {"name": sc.name, "world": sc.world, "layouts": layouts, "spearman": spearman(predicted, measured),
            # the fastest round of each: what noise (which only ever adds time) leaves least
            "spearman_best": spearman(predicted, [x["best_s"] for x in layouts]),
            "top1_gap": measured[best_pred] / min(measured) - 1, "predicted_best": layouts[best_pred]["label"],
            "measured_best": layouts[min(range(len(layouts)), key=measured.__getitem__)]["label"],
            "profile": {"fp32_flops": profile.achievable("fp32"), "link_bandwidth": profile.intra_node.bandwidth,
                        "link_latency": profile.intra_node.latency},
            "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)]}


def _rows(s: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    rows, notes = [], []
    base = s["layouts"][0]
    for x in s["layouts"]:
        rows.append(row(f"{s['name']}: {x['label']}: step (measured)", x["steps"], unit="s/step",
                        baseline=x["predicted_s"], note=f"predicted {x['predicted_s']:.3f} s; memory predicted "
                        f"{x['predicted_memory'] / MIB:.1f} MiB, measured {x['measured_memory'] / MIB:.1f} MiB "
                        f"({x['predicted_memory'] / x['measured_memory']:.2f}x)", **x))
        if abs(x["loss0"] - base["loss0"]) > LOSS_REL * abs(base["loss0"]):
            notes.append(f"LOSS MISMATCH in {s['name']}: {x['label']} step-0 loss {x['loss0']:.6f} vs "
                         f"{base['label']}'s {base['loss0']:.6f}")
    mem = [x["predicted_memory"] / x["measured_memory"] for x in s["layouts"]]
    notes.append(f"{s['name']}: Spearman {s['spearman']:.2f} over {len(s['layouts'])} layouts (target >= 0.8; "
                 f"{s['spearman_best']:.2f} on each layout's fastest round); "
                 f"predicted best {s['predicted_best']} measures {s['top1_gap']:+.1%} vs the fastest measured, "
                 f"{s['measured_best']} (target within 10%); memory predicted / measured "
                 f"{min(mem):.2f}-{max(mem):.2f}x (target 0.9-1.1x); load {s['loadavg_1m'][0]} -> {s['loadavg_1m'][1]}")
    return rows, notes


def _table(s: dict[str, Any]) -> dict[str, Any]:
    by_pred = sorted(s["layouts"], key=lambda x: x["predicted_s"])
    by_meas = {x["label"]: i + 1 for i, x in enumerate(sorted(s["layouts"], key=lambda x: x["measured_s"]))}
    return {"title": f"{s['name']}: Spearman {s['spearman']:.2f}, top-1 {s['top1_gap']:+.1%}",
            "header": ["predicted rank", "layout", "predicted step", "measured step", "measured rank",
                       "predicted memory", "measured memory", "predicted / measured"],
            "rows": [[str(i + 1), x["label"], f"{x['predicted_s']:.3f} s", f"{x['measured_s']:.3f} s",
                      str(by_meas[x["label"]]), f"{x['predicted_memory'] / MIB:.1f} MiB",
                      f"{x['measured_memory'] / MIB:.1f} MiB", f"{x['predicted_memory'] / x['measured_memory']:.2f}x"]
                     for i, x in enumerate(by_pred)]}


def run(quick: bool) -> dict[str, Any]:
    """Calibrate, predict, measure and compare every scenario; see the module docstring."""
    results = [_scenario(sc) for sc in (QUICK if quick else SCENARIOS)]
    rows, notes = [], []
    for s in results:
        r, n = _rows(s)
        rows += r
        notes += n
    out = section_result("layout planner: predicted vs measured step time and memory (fp32, gloo, 1 thread/rank)",
                         rows, ratio_of="the predicted step", notes=notes,
                         config={"scenarios": [s["name"] for s in results]})
    out["tables"] = [_table(s) for s in results]
    out["scenarios"] = results
    return out


if __name__ == "__main__":
    import json

    res = run("--quick" in sys.argv)
    for t in res["tables"]:
        print(t["title"])
        print(" | ".join(t["header"]))
        for r in t["rows"]:
            print(" | ".join(r))
    print("\n".join(res["notes"]))
    if "--json" in sys.argv:
        print(json.dumps(res["scenarios"], indent=1, default=str))
