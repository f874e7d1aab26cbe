"""Section ``pipeline``: step time, memory and the pipeline bubble of pp=2 against dp / tp,
and the bubble of every schedule (gpipe, 1f1b, interleaved 1F1B, zero bubble, ZBV, DualPipeV).

A Llama (8 layers, hidden 384, GQA 6/2, vocab 4096, sdpa, fp32) trains on one global
batch of 8 x 256 tokens per step at world 4 (gloo, one intra-op thread per rank, 4
processes on the host's 2 cores).  Every layout processes that same global batch: each
data-parallel rank (``tpcompile.data_parallel_rank``) takes its share, and the pipeline
ranks of one data-parallel group pass the same share, which ``pipeline_step`` splits
into ``M = 4`` microbatches.  Layouts, each in its own four fresh processes:

* ``dp_shard=4`` — FSDP2 over the four ranks, two sequences each (the ratio's baseline);
* ``tp=2 x dp_shard=2`` — tensor parallel pairs, four sequences per pair;
* ``pp=2 x dp_shard=2`` with ``gpipe``, ``1f1b`` and ``interleaved_1f1b`` (``pp_virtual=2``:
  four stages of two blocks, two per rank), four sequences per pipeline;
* then at world 2, pp=2 alone (the same global batch through one pipeline) with every
  schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zero_bubble`` (2 stages per rank,
  looped), ``zbv`` and ``dualpipev`` (V-shaped): the bubble each makes.

Quick mode: 4 layers, hidden 128, 64 tokens per sequence, and only ``dp_shard=4``,
``1f1b`` and ``interleaved_1f1b`` at world 4, ``gpipe`` and ``zbv`` at world 2 (process
start-up, not the model, sets its time).

Every model is built on the meta device and initialised by ``parallelize(seed=0)``
(delayed init), so the weights are the same tensors in every layout and a rank only ever
holds its shards.

* **Step time** — ``pipeline_step`` (forward + backward; on a non-pipelined model
  ``model(**batch).loss.backward()``) + AdamW ``step`` / ``zero_grad``, from a barrier to
  a barrier (so the slowest rank's time), median after warm-up; next to it the CPU
  seconds of the four processes per step, which a busy shared host disturbs far less.
* **Peak memory** — peak resident set per rank during the training steps (``VmHWM``
  reset after ``parallelize``, whose planning has its own transient peak) minus the
  resident set after imports and the process group, max over ranks, like
  ``load_memory``: it holds this rank's parameter shards, gradients, AdamW state and the
  step's activations (and ~140 MiB that ``parallelize`` imports and keeps, the same in
  every layout).  Next to it the exact bytes of the parameters + gradients + AdamW
  state (like ``moe_ep``).  Resident memory, not an allocator count: CPU torch has none.
* **Bubble** — ``1 - busy / wall`` per rank, averaged over the ranks, median over the
  steps, next to ``StagePlan.bubble()`` (what ``dump-plan --pp`` prints: torch's action
  order for the schedule simulated on the stages' forward FLOPs, backward twice that;
  equal stages give ``(pp - 1) / (v M + pp - 1)``).  ``wall`` is ``pipeline_step`` alone,
  barrier to barrier (the optimizer is in neither); ``busy`` is the time inside
  ``PipelineStage.forward_one_chunk``, ``backward_one_chunk`` and, for the split-backward
  schedules, ``backward_weight_one_chunk`` (timers wrapped around torch's methods in
  these processes only, :class:`MethodTimer`).

  Counted busy: the stage's model forward, the last stage's loss (computed by that
  forward: the stage's output is the loss), the backward, and whatever FSDP2 runs in
  its hooks inside a chunk (the first all-gather of each unit in the step: under a
  pipeline the units stay gathered across the microbatches).  Counted idle: the waits
  on the p2p sends and receives, the stages' imbalance, the fill and drain (the bubble
  the simulation predicts), and beside it FSDP2's once-per-step gradient reduce-scatter
  (``perform_reduce_grad``, priced by the cost model as exposed FSDP2 communication),
  the runtime's own unshard actions, the loss broadcast, the barrier and the schedule's
  Python.  The table splits the idle share into the reduce-scatter, the all-gathers
  outside chunks and the rest, the rest against the prediction.  Every schedule is also
  run at world 2 (pp=2 alone, one rank per core): with four processes on two cores a
  rank gets a fraction of a core even while it computes (the CPU share column, CPU /
  wall inside the chunks), and a wait lasts until the peer is scheduled again.
* **Equal work** — every layout's step-0 loss (the global batch's, averaged over the
  data-parallel groups) must equal ``dp_shard=4``'s (rel 1e-4); a mismatch is a note
  and a ❌ in the table.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from common import row, section_result, spawn_ranks

MIB = 2**20
LOSS_REL = 1e-4
BASELINE = "dp_shard=4"
# name -> parallelize keywords (the pipelined ones also get pp_microbatches); every
# layout trains the same global batch at world 4
LAYOUTS: dict[str, dict[str, Any]] = {
    BASELINE: {"dp_shard": 4},
    "tp=2 x dp_shard=2": {"tp": 2, "dp_shard": 2},
    "pp=2 x dp_shard=2, gpipe": {"pp": 2, "dp_shard": 2, "pp_schedule": "gpipe"},
    "pp=2 x dp_shard=2, 1f1b": {"pp": 2, "dp_shard": 2, "pp_schedule": "1f1b"},
    "pp=2 x dp_shard=2, interleaved_1f1b v=2": {"pp": 2, "dp_shard": 2, "pp_schedule": "interleaved_1f1b",
                                                 "pp_virtual": 2},
}


@dataclass(frozen=True)
class Spec:
    """Model, batch and schedule of one run."""

    layers: int = 8
    hidden: int = 384
    heads: int = 6
    kv_heads: int = 2  # tp=2 splits heads: 3 query heads and 1 KV head per rank
    intermediate: int = 1024
    vocab: int = 4096
    batch: int = 8  # global sequences per step
    seq: int = 256
    microbatches: int = 4
    world: int = 4
    warmup: int = 1  # the first step builds the schedule and AdamW's state
    repeats: int = 4
    timeout_s: float = 900.0
    layouts: dict[str, dict[str, Any]] = field(default_factory=lambda: dict(LAYOUTS))
    baseline: str = BASELINE  # the layout the others are compared with
    pipeline_label: str = "pp=2 x dp_shard=2"

    def config(self) -> Any:
        from tpcompile.tools.presets import tiny_config

        cfg = tiny_config("llama", num_hidden_layers=self.layers, hidden_size=self.hidden,
                          num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                          head_dim=self.hidden // self.heads, intermediate_size=self.intermediate,
                          vocab_size=self.vocab, max_position_embeddings=self.seq, tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        return cfg


FULL = Spec()
# every schedule at world 2 (pp=2 alone: each rank its own core, nothing shared): the
# bubble as the schedules make it, against the simulated prediction
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev")
BUBBLE = Spec(world=2, layouts={f"pp=2, {s}": {"pp": 2, "pp_schedule": s} for s in SCHEDULE_NAMES},
              baseline="pp=2, gpipe", pipeline_label="pp=2 (world 2, one rank per core)",
              repeats=8)  # a 1 s step: more of them steady the median against the host's noise
# process start-up (four ranks importing torch, transformers and tpcompile on two cores,
# ~45 s) dominates a small layout, so quick mode also runs fewer of them
QUICK = Spec(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=352, seq=64, warmup=1, repeats=2,
             timeout_s=600.0, layouts={k: LAYOUTS[k] for k in (BASELINE, "pp=2 x dp_shard=2, 1f1b",
                                                                "pp=2 x dp_shard=2, interleaved_1f1b v=2")})
QUICK_BUBBLE = Spec(layers=4, hidden=128, heads=4, kv_heads=2, intermediate=352, seq=64, warmup=1, repeats=2,
                    timeout_s=600.0, world=2, baseline="pp=2, gpipe", pipeline_label=BUBBLE.pipeline_label,
                    layouts={f"pp=2, {s}": {"pp": 2, "pp_schedule": s} for s in ("gpipe", "zbv")})


def _status(field_name: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field_name + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def _reset_peak() -> None:
    # writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")


class MethodTimer:
    """Wall and CPU seconds spent inside torch's pipeline-stage and FSDP2 methods, by key:
    ``forward`` / ``backward`` (``PipelineStage.forward_one_chunk`` / ``backward_one_chunk``
    and, for the split-backward schedules, ``backward_weight_one_chunk``),
    ``reduce`` (``perform_reduce_grad``: FSDP2's once-per-step reduce-scatter) and the
    all-gathers (``FSDPParamGroup.unshard`` + ``wait_for_unshard``), split into
    ``gather_in`` (inside a chunk: 1F1B and GPipe, through FSDP2's hooks) and
    ``gather_out`` (outside: the interleaved runtime's own unshard actions).

    Patches the classes for the ``with`` block only: every stage and parameter group
    tpcompile makes in this process is seen, and nothing outside the benchmark changes.
    """

    def __init__(self) -> None:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
        from torch.distributed.pipelining.stage import _PipelineStageBase

        self.targets = [(_PipelineStageBase, "forward_one_chunk", "forward"),
                        (_PipelineStageBase, "backward_one_chunk", "backward"),
                        (_PipelineStageBase, "backward_weight_one_chunk", "backward"),  # split backward's W
                        (_PipelineStageBase, "perform_reduce_grad", "reduce"),
                        (FSDPParamGroup, "unshard", "gather"), (FSDPParamGroup, "wait_for_unshard", "gather")]
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.in_chunk = 0
        self.reset()

    def reset(self) -> None:
        for key in ("forward", "backward", "reduce", "gather_in", "gather_out"):
            self.wall[key] = self.cpu[key] = 0.0

    def _wrap(self, key: str, fn: Any) -> Any:
        chunk = key in ("forward", "backward")

        def timed(*args: Any, **kwargs: Any) -> Any:
            where = key if key != "gather" else ("gather_in" if self.in_chunk else "gather_out")
            self.in_chunk += chunk
            w0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.wall[where] += time.perf_counter() - w0
                self.cpu[where] += time.thread_time() - c0
                self.in_chunk -= chunk
        return timed

    @contextlib.contextmanager
    def installed(self) -> Iterator[MethodTimer]:
        saved = [(cls, name, getattr(cls, name)) for cls, name, _ in self.targets]
        for (cls, name, fn), (_, _, key) in zip(saved, self.targets, strict=True):
            setattr(cls, name, self._wrap(key, fn))
        try:
            yield self
        finally:
            for cls, name, fn in saved:
                setattr(cls, name, fn)


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in model.parameters())
    return total + sum(local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _mean_over_world(value: torch.Tensor) -> float:
    # each rank holds its data-parallel group's loss (the same on its pp / tp peers); all
    # groups have equal token counts, so the world mean is the global batch's loss
    total = value.detach().clone().float()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def _plan_facts(model: torch.nn.Module) -> dict[str, Any]:
    """What the stage plan predicts: the bubble of torch's action order for the schedule
    run against the stages' forward FLOPs (``StagePlan.bubble()``, as ``dump-plan --pp``
    prints it), and the stages' blocks."""
    run = getattr(model, "tpcompile_pipeline", None)
    if run is None:
        return {"predicted": None, "blocks": [], "stage_flops": [], "stage_ranks": [], "pp_rank": None}
    stages = run.plan.stages
    return {"predicted": run.plan.bubble(), "blocks": [len(st.blocks) for st in stages],
            "stage_flops": [st.flops_per_token for st in stages], "stage_ranks": [st.rank for st in stages],
            "pp_rank": run.pp_rank}


def _timed_steps(spec: Spec, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Warm-up + timed steps; per timed step the step's and ``pipeline_step``'s wall, the
    process CPU time and the timer's parts."""
    import tpcompile

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    timer = MethodTimer()
    out: dict[str, Any] = {k: [] for k in ("steps", "cpu", "sched", "busy", "busy_cpu", "reduce", "gather_in",
                                           "gather_out", "runtime_cpu")}
    with timer.installed():
        for i in range(spec.warmup + spec.repeats):
            dist.barrier()
            timer.reset()
            t0, c0, s0 = time.perf_counter(), time.process_time(), time.thread_time()
            loss = tpcompile.pipeline_step(model, batch)
            s1 = time.thread_time()  # this thread's work in the step (gloo's waits block, they do not spin)
            dist.barrier()  # the slowest rank's schedule: a rank's own end is not the pipeline's
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            dist.barrier()
            t2, c2 = time.perf_counter(), time.process_time()
            if i == 0:
                out["loss0"] = _mean_over_world(loss)
            if i < spec.warmup:
                continue
            parts = {"steps": t2 - t0, "cpu": c2 - c0, "sched": t1 - t0,
                     "busy": timer.wall["forward"] + timer.wall["backward"],
                     "busy_cpu": timer.cpu["forward"] + timer.cpu["backward"], "reduce": timer.wall["reduce"],
                     "gather_in": timer.wall["gather_in"], "gather_out": timer.wall["gather_out"],
                     # the schedule runtime's own work outside the chunks (Python per action, p2p posting)
                     "runtime_cpu": s1 - s0 - sum(timer.cpu.values())}
            for key, value in parts.items():
                out[key].append(value)
    out["state_mb"] = _state_bytes(model, opt) / MIB
    return out


def _bench(rank: int, spec: Spec, name: str) -> dict[str, Any]:
    """One rank of one layout: build on meta, ``parallelize(seed=0)``, train on this
    data-parallel rank's share of the global batch; times, memory and the stage plan."""
    from transformers import AutoModelForCausalLM

    import tpcompile

    torch.set_num_threads(1)
    _reset_peak()  # the baseline includes imports and the gloo process group
    base = _status("VmRSS")
    kwargs = dict(spec.layouts[name])
    if kwargs.get("pp", 1) > 1:
        kwargs["pp_microbatches"] = spec.microbatches
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.config())
    model = tpcompile.parallelize(model, seed=0, **kwargs)
    model.train()
    setup_peak = _status("VmHWM") - base
    gc.collect()
    setup = _status("VmRSS") - base  # parameter shards + what parallelize imported and keeps
    _reset_peak()  # planning's transient peak is parallelize's, not the training step's
    dp_rank, dp_size = tpcompile.data_parallel_rank(model)
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(1))
    local = ids.chunk(dp_size)[dp_rank]
    out = _timed_steps(spec, model, {"input_ids": local, "labels": local})
    return {**out, **_plan_facts(model), "peak_mb": (_status("VmHWM") - base) / MIB,
            "setup_peak_mb": setup_peak / MIB, "setup_mb": setup / MIB}


def _bubble(res: dict[int, Any], spec: Spec) -> dict[str, Any]:
    """Measured bubble and its parts: shares of ``pipeline_step``'s wall, each a median
    over steps of the mean over ranks."""
    repeats = spec.repeats

    def share(key: str, ranks: list[dict[str, Any]]) -> float:
        return statistics.median(statistics.mean(r[key][i] / r["sched"][i] for r in ranks) for i in range(repeats))

    ranks = list(res.values())
    pp = max(r["pp_rank"] for r in ranks) + 1
    cpu_share = statistics.median(statistics.mean(r["busy_cpu"][i] / r["busy"][i] for r in ranks)
                                  for i in range(repeats))
    measured = 1 - share("busy", ranks)
    reduce, gather_out = share("reduce", ranks), share("gather_out", ranks)
    return {"measured": measured, "reduce": reduce, "gather_in": share("gather_in", ranks), "gather_out": gather_out,
            "runtime": share("runtime_cpu", ranks),
            "rest": measured - reduce - gather_out, "cpu_share": cpu_share,
            "per_pp_rank": [round(1 - share("busy", [r for r in ranks if r["pp_rank"] == p]), 4) for p in range(pp)],
            "sched": statistics.median(max(r["sched"][i] for r in ranks) for i in range(repeats))}


def _run_layouts(spec: Spec) -> dict[str, tuple[dict[int, Any], list[float]]]:
    """Each layout in four fresh processes (its own peak memory); the host's 1-min load
    average before and after it."""
    results = {}
    for name in spec.layouts:
        load, t0 = os.getloadavg()[0], time.perf_counter()
        res = spawn_ranks(_bench, spec.world, (spec, name), timeout_s=spec.timeout_s)
        print(f"  {name}: {time.perf_counter() - t0:.0f} s with process start-up", flush=True)
        results[name] = (res, [round(load, 2), round(os.getloadavg()[0], 2)])
    return results


def _summary(spec: Spec, res: dict[int, Any]) -> dict[str, Any]:
    """One layout's numbers over its ranks: the slowest rank's step, the largest peak."""
    steps = [max(r["steps"][i] for r in res.values()) for i in range(spec.repeats)]
    cpu = statistics.median(sum(r["cpu"][i] for r in res.values()) for i in range(spec.repeats))
    predicted = res[0]["predicted"]
    return {"steps": steps, "median": statistics.median(steps), "cpu": cpu, "loss0": res[0]["loss0"],
            "peak": max(r["peak_mb"] for r in res.values()), "state": max(r["state_mb"] for r in res.values()),
            "setup_peak": max(r["setup_peak_mb"] for r in res.values()),
            "setup": max(r["setup_mb"] for r in res.values()), "predicted": predicted,
            "blocks": res[0]["blocks"], "bubble": None if predicted is None else _bubble(res, spec)}


def _priced(spec: Spec) -> dict[str, float]:
    """The schedule idle share the cost model prices for each layout of a pp-only spec:
    the stages ``parallelize`` cuts, their forward FLOPs at the run's sequence times 3
    (forward + backward) at this host's calibrated fp32 rate (``calibrate(procs=world,
    threads=1)``), each hand-off at the calibrated p2p link's time for one microbatch's
    hidden state plus the pipeline runtime's own calibrated share (``pp_handoff``),
    torch's action order simulated on them."""
    from transformers import AutoModelForCausalLM

    from tpcompile.plan.schedule import idle_share, simulate_stages
    from tpcompile.plan.stages import plan_pipeline
    from tpcompile.tools.calibration import calibrate
    from tpcompile.tools.layout_price import collective_time

    profile = calibrate(procs=spec.world, threads=1, name=f"this host, {spec.world} ranks")
    rate = profile.achievable("fp32")
    tokens = spec.batch // spec.microbatches * spec.seq  # one pipeline: the whole batch
    hop = collective_time("p2p", 2, tokens * spec.hidden * 4, profile.link(inter_node=False)) + profile.pp_handoff
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.config())
    blocks = [f"model.layers.{i}" for i in range(spec.layers)]
    out = {}
    for name, kw in spec.layouts.items():
        sp, _ = plan_pipeline(model, blocks, pp=kw["pp"], schedule=kw["pp_schedule"], virtual=kw.get("pp_virtual", 2),
                              microbatches=spec.microbatches, seq=spec.seq)
        times = {s.index: 3 * s.flops_per_token * tokens / rate for s in sp.stages}
        out[name] = idle_share(simulate_stages(sp.schedule, sp.pp, sp.virtual, spec.microbatches, times, hop=hop,
                                               weight_shares=sp.weight_shares()))
    return out


def _tables(spec: Spec, summaries: dict[str, tuple[dict[str, Any], list[float]]],
            priced: dict[str, float] | None = None) -> list[dict[str, Any]]:
    base = summaries[spec.baseline][0]
    layouts, bubbles = [], []
    for name, (s, _) in summaries.items():
        same = abs(s["loss0"] - base["loss0"]) <= LOSS_REL * abs(base["loss0"])
        layouts.append([name, f"{s['median']:.3g} s", f"{s['median'] / base['median']:.2f}×", f"{s['cpu']:.3g} s",
                        f"{s['peak']:.0f} MiB", f"{s['peak'] / base['peak']:.2f}×", f"{s['state']:.1f} MiB",
                        f"{s['loss0']:.6f} {'✅' if same else '❌'}"])
        if s["bubble"] is not None:
            b, p = s["bubble"], s["predicted"]
            bubbles.append([spec.layouts[name]["pp_schedule"], "+".join(map(str, s["blocks"])), f"{p:.3f}",
                            f"**{b['measured']:.3f}**", f"{b['measured'] / p:.2f}×",
                            " / ".join(f"{x:.3f}" for x in b["per_pp_rank"]), f"{b['reduce']:.3f}",
                            f"{b['gather_out']:.3f}", f"{b['rest']:.3f}", f"{b['runtime']:.3f}",
                            f"**{b['rest'] / p:.2f}×**",
                            f"{b['gather_in']:.3f}",
                            f"{b['cpu_share']:.2f}", f"{b['sched']:.3g} s"])
            if priced is not None:
                bubbles[-1][3:3] = [f"{priced[name]:.3f}", f"**{b['rest'] / priced[name]:.2f}×**"]
    return [
        {"title": f"layouts at world {spec.world} (same global batch per step)",
         "header": ["layout", "step time", f"vs {spec.baseline}", f"CPU s/step ({spec.world} ranks)",
                    "peak RSS per rank", f"vs {spec.baseline}", "params+grads+AdamW per rank", "step-0 loss"],
         "rows": layouts},
        {"title": f"bubble at {spec.pipeline_label}, M={spec.microbatches} (mean over ranks, median over steps)",
         "header": ["schedule", "blocks per stage", "predicted (dump-plan --pp)",
                    *(["priced with hand-offs (calibrated)", "rest / priced"] if priced is not None else []),
                    "measured",
                    "measured / predicted", "measured per pp rank", "idle: grad reduce-scatter",
                    "idle: all-gathers outside chunks", "idle: the rest (p2p waits, imbalance)",
                    "of which runtime CPU outside chunks",
                    "rest / predicted", "busy: all-gathers inside chunks", "CPU share in chunks", "pipeline_step wall"],
         "rows": bubbles},
    ]


def _measured(spec: Spec, price: bool = False) -> tuple[list[Any], list[str], list[dict[str, Any]]]:
    """Rows, notes and tables of one spec's layouts (``price``: with the cost model's
    calibrated schedule idle, :func:`_priced`)."""
    priced = _priced(spec) if price else None
    summaries = {name: (_summary(spec, res), load) for name, (res, load) in _run_layouts(spec).items()}
    base = summaries[spec.baseline][0]
    tokens = spec.batch * spec.seq
    rows, notes = [], []
    for name, (s, load) in summaries.items():
        if abs(s["loss0"] - base["loss0"]) > LOSS_REL * abs(base["loss0"]):
            notes.append(f"LOSS MISMATCH: {name}'s step-0 loss {s['loss0']:.6f} is not {spec.baseline}'s "
                         f"{base['loss0']:.6f} (rel {LOSS_REL:g}): the layouts do not compute the same step")
        rows.append(row(f"{name}: train step", s["steps"], unit="s/step", baseline=base["median"],
                        note=f"{tokens / s['median']:,.0f} tok/s; slowest rank; CPU {s['cpu']:.2f} s/step "
                             f"({spec.world} ranks); load {load[0]:.1f} → {load[1]:.1f}", cpu_s=s["cpu"],
                        loss0=s["loss0"], loadavg_1m=load))
        rows.append(row(f"{name}: peak RSS per rank", [s["peak"]], unit="MiB", baseline=base["peak"],
                        note=f"training steps, max over ranks, above imports; params+grads+AdamW "
                             f"{s['state']:.1f} MiB/rank", state_mb=s["state"], setup_peak_mb=s["setup_peak"],
                        setup_mb=s["setup"]))
        if s["bubble"] is not None:
            rows.append(row(f"{name}: measured bubble", [s["bubble"]["measured"]], unit="", baseline=s["predicted"],
                            note=f"ratio = measured / predicted {s['predicted']:.3f}", predicted=s["predicted"],
                            blocks=s["blocks"], **s["bubble"]))
    if not notes:
        notes.append(f"world {spec.world}: every layout's step-0 loss equals {spec.baseline}'s (rel {LOSS_REL:g}): "
                     f"{base['loss0']:.6f}")
    return rows, notes, _tables(spec, summaries, priced)


def run(quick: bool) -> dict[str, Any]:
    """Time every layout at world 4, then every schedule's bubble at world 2; see the
    module docstring."""
    spec, sweep = (QUICK, QUICK_BUBBLE) if quick else (FULL, BUBBLE)
    rows, notes, tables = _measured(spec)
    more = _measured(sweep, price=True)
    rows, notes, tables = rows + more[0], notes + more[1], tables + more[2]
    notes.append("measured bubble = 1 - busy / wall of pipeline_step, averaged over the ranks, median over "
                 "steps; busy = inside PipelineStage.forward_one_chunk + backward_one_chunk (+ "
                 "backward_weight_one_chunk); predicted = StagePlan.bubble(): torch's action order simulated on "
                 "the stages' forward FLOPs")
    result = section_result(
        f"pipeline parallelism: Llama {spec.layers}L h{spec.hidden}, vocab {spec.vocab}, batch "
        f"{spec.batch}×{spec.seq}, M={spec.microbatches} (fwd+bwd+AdamW, fp32, gloo, 1 thread per rank): layouts "
        f"at world {spec.world}, every schedule at world {sweep.world}",
        rows, ratio_of=f"{BASELINE} / {sweep.baseline} (bubble rows: the predicted bubble)", notes=notes,
        config={**asdict(spec), "sweep": asdict(sweep), "dtype": "float32", "backend": "gloo",
                "threads_per_proc": 1})
    result["tables"] = tables
    return result
