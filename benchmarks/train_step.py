"""Section ``train_step``: training-step time of tpcompile against other TP stacks.

One step = forward with labels + backward + AdamW (fp32, gloo, 2 CPU processes with one
intra-op thread each) on a random-init Llama.  All competitors live in the same two
worker processes and are stepped round-robin (the order rotates every round), so slow
drift of the machine hits them all alike.  Competitors:

* ``tpcompile`` — ``tpcompile.transform(model, tp=2)`` (the baseline of the ratio column);
* ``tpcompile lp`` — the same with ``loss_parallel=True``;
* ``hf native tp`` — ``from_pretrained(dir, distributed_config=DistributedConfig(tp_size=2))``;
* ``dtensor plan`` — a hand-written torchtitan-style ``parallelize_module`` plan;
* ``tpcompile parallelize`` — ``tpcompile.parallelize(model, tp=2)`` (TP + FSDP2 over the
  one data-parallel rank), the eager twin of:
* ``tpcompile compiled`` — ``tpcompile.parallelize(model, tp=2, compile=True)``: every
  block's forward compiled by inductor, TP's hooks and collectives inside the graph;
* ``tpcompile layers compiled`` — ``tpcompile.transform`` and then the user's own
  ``layer.compile()`` on every decoder layer, as for:
* ``hf native compiled`` — HF native TP with every decoder layer ``.compile()``d, the
  regional compilation transformers documents;
* ``tpcompile tp=1`` and ``hf tp=1`` — one process (rank 0) while rank 1 waits in a
  barrier; they give the scaling efficiency ``t1 / (2 · t2)`` and the hook overhead.

Every competitor loads the same checkpoint, and their step-0 losses are checked against
the untransformed model before anything is timed.  Collectives per step are counted
with the profiler (gloo events), forward and backward separately.  tpcompile's per-step
input checks (token ids in the vocabulary-split embedding, labels in the split loss)
are timed inside the timed steps: their share of the step, target <= 1%.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from common import quiet_stderr, row, section_result, spawn_ranks
from torch import nn

WORLD = 2
LOSS_ATOL = 1e-4
BASELINE = "tpcompile"
TP2 = ("tpcompile", "tpcompile lp", "hf native tp", "dtensor plan", "tpcompile parallelize", "tpcompile compiled",
       "tpcompile layers compiled", "hf native compiled")
COMPILED = {"tpcompile compiled": "tpcompile parallelize", "tpcompile layers compiled": "tpcompile",
            "hf native compiled": "hf native tp"}  # -> its eager twin
TP1 = ("tpcompile tp=1", "hf tp=1")  # run on rank 0 only
REFERENCE = "hf tp=1"  # the untransformed model: the loss every competitor must match


@dataclass(frozen=True)
class Spec:
    """Model and schedule of one run."""

    hidden: int = 1024
    heads: int = 16
    kv_heads: int = 8
    intermediate: int = 2816
    vocab: int = 32000
    layers: int = 4
    batch: int = 2
    seq: int = 256
    warmup: int = 2
    repeats: int = 7
    timeout_s: float = 900.0

    def llama_config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, intermediate_size=self.intermediate,
            vocab_size=self.vocab, num_hidden_layers=self.layers,
            max_position_embeddings=max(self.seq, 512), tie_word_embeddings=False,
        )


FULL = Spec()
QUICK = Spec(layers=2, seq=128, warmup=1, repeats=3, timeout_s=300.0)


# ------------------------------------------------------------------------------ builders


def _load(model_dir: str, **kwargs: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa", **kwargs)


def _tpcompile(model_dir: str, *, loss_parallel: bool = False) -> nn.Module:
    import tpcompile

    return tpcompile.transform(_load(model_dir), tp=WORLD, loss_parallel=loss_parallel)


def _tpcompile_tp1(model_dir: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh

    import tpcompile

    # Collective on both ranks (it creates process groups); only rank 0 uses the model.
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("dp", "tp"))["tp"]
    model = _load(model_dir)
    return tpcompile.transform(model, tp=1, mesh=mesh) if dist.get_rank() == 0 else model


def _hf_native(model_dir: str) -> nn.Module:
    from transformers.distributed import DistributedConfig

    return _load(model_dir, distributed_config=DistributedConfig(tp_size=WORLD))


def _tpcompile_parallelize(model_dir: str, **kwargs: Any) -> nn.Module:
    import tpcompile

    return tpcompile.parallelize(_load(model_dir), tp=WORLD, **kwargs)


def _compile_layers(model: nn.Module) -> nn.Module:
    for layer in model.model.layers:  # regional compilation, as transformers documents it
        layer.compile()
    return model


def _dtensor_plan(model_dir: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))
    model = _load(model_dir)
    # torchtitan's Llama plan without sequence parallel.  HF Llama reshapes with
    # view(..., -1, head_dim), so local head counts follow the sharded weights; only
    # num_key_value_groups is a ratio and stays valid.
    plan: dict[str, Any] = {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}"
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                     "mlp.gate_proj", "mlp.up_proj"):
            plan[f"{pre}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"{pre}.{name}"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


BUILDERS: dict[str, Callable[[str], nn.Module]] = {
    "tpcompile": _tpcompile,
    "tpcompile lp": lambda d: _tpcompile(d, loss_parallel=True),
    "hf native tp": _hf_native,
    "dtensor plan": _dtensor_plan,
    "tpcompile parallelize": _tpcompile_parallelize,
    "tpcompile compiled": lambda d: _tpcompile_parallelize(d, compile=True),
    "tpcompile layers compiled": lambda d: _compile_layers(_tpcompile(d)),
    "hf native compiled": lambda d: _compile_layers(_hf_native(d)),
    "tpcompile tp=1": _tpcompile_tp1,
    "hf tp=1": _load,
}


# ------------------------------------------------------------------------------ worker


PHASES = ("fwd", "bwd", "opt")


def _step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> dict[str, float]:
    """One training step: wall and CPU seconds of each phase on this rank.

    CPU time (``process_time``: all threads of this process, gloo's included) is kept
    beside wall time because a shared machine's load inflates wall time unevenly.
    """
    marks = [(time.perf_counter(), time.process_time())]
    loss = model(input_ids=ids, labels=ids).loss
    marks.append((time.perf_counter(), time.process_time()))
    loss.backward()
    marks.append((time.perf_counter(), time.process_time()))
    opt.step()
    opt.zero_grad(set_to_none=True)
    marks.append((time.perf_counter(), time.process_time()))
    out = {}
    for i, phase in enumerate(PHASES):
        out[phase] = marks[i + 1][0] - marks[i][0]
        out[f"cpu_{phase}"] = marks[i + 1][1] - marks[i][1]
    return out


def _count_collectives(prof: Any) -> dict[str, list[int]]:
    """gloo collectives seen by ``prof``: name -> [calls, fp32 bytes]."""
    out: dict[str, list[int]] = {}
    for ev in prof.events():
        if not ev.name.startswith("gloo:"):
            continue
        numel = sum(_numel(s) for s in (ev.input_shapes or []))
        c = out.setdefault(ev.name.removeprefix("gloo:"), [0, 0])
        c[0] += 1
        c[1] += 4 * numel
    return out


def _numel(shape: Any) -> int:
    if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
        return 0
    n = 1
    for d in shape:
        n *= d
    return n


def _agree(ok: bool) -> bool:
    """True only if ``ok`` holds on every rank, so all ranks drop a competitor together."""
    flag = torch.tensor([0 if ok else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item()) == 0


GUARDED = ("tpcompile", "tpcompile lp")  # competitors whose input checks are timed in their steps


@contextlib.contextmanager
def _timed_checks(totals: dict[str, float]) -> Iterator[None]:
    """Time tpcompile's per-step input checks inside the real steps: the token-id check of
    the vocabulary-split embedding and the label check of the loss over split logits
    (the input guard's collective runs in the first forwards only, before timing)."""
    from tpcompile.runtime import loss, torch_backend

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                totals["s"] += time.perf_counter() - t0
                totals["calls"] += 1
        return wrapper

    saved = [(torch_backend, "check_ids"), (loss, "check_labels")]
    originals = [getattr(mod, name) for mod, name in saved]
    for (mod, name), fn in zip(saved, originals, strict=True):
        setattr(mod, name, timed(fn))
    try:
        yield
    finally:
        for (mod, name), fn in zip(saved, originals, strict=True):
            setattr(mod, name, fn)


def _bench(rank: int, spec: Spec, model_dir: str) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq),
                        generator=torch.Generator().manual_seed(1))
    models: dict[str, nn.Module] = {}
    errors: dict[str, str] = {}
    for name in (*TP2, *TP1):
        t0 = time.perf_counter()
        try:
            models[name] = BUILDERS[name](model_dir)
            err = None
        except Exception as exc:  # a competitor that cannot run is reported, not fatal
            err = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if not _agree(err is None):
            errors[name] = err or "failed on the other rank"
            models.pop(name, None)
        elif rank == 0:
            print(f"  built {name} in {time.perf_counter() - t0:.1f} s", flush=True)
    active = [n for n in (*TP2, *TP1) if n in models]
    if not active:
        raise RuntimeError("no competitor could be built: " + "; ".join(
            f"{n}: {e}" for n, e in errors.items()))
    mine = [n for n in active if n in TP2 or rank == 0]
    for name in mine:
        models[name].train()
    opts = {n: torch.optim.AdamW(models[n].parameters(), lr=1e-5) for n in mine}

    # Equal work: every competitor's step-0 loss against the untransformed model (a
    # compiled competitor's includes its compilation: timed apart, as its first step)
    losses: dict[str, float] = {}
    first_step: dict[str, float] = {}
    for name in active:
        if name in mine:
            t0 = time.perf_counter()
            losses[name] = float(models[name](input_ids=ids, labels=ids).loss.item())
            if name in COMPILED:
                _step(models[name], opts[name], ids)  # the backward graph compiles here
                first_step[name] = time.perf_counter() - t0
        dist.barrier()

    # Timed rounds, order rotated per round; barriers fence each step so the time is
    # that of the slower rank.  Rank 1 waits in the barrier during the tp=1 steps.
    samples: dict[str, list[dict[str, float]]] = {n: [] for n in active}
    checks = {n: {"s": 0.0, "calls": 0} for n in GUARDED if n in active}
    idle_cpu = idle_wall = 0.0
    for r in range(spec.warmup + spec.repeats):
        shift = r % len(active)
        for name in active[shift:] + active[:shift]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            timing = r >= spec.warmup and name in checks
            with _timed_checks(checks[name]) if timing else contextlib.nullcontext():
                parts = _step(models[name], opts[name], ids) if name in mine else {}
            dist.barrier()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            if name not in mine:
                idle_cpu += cpu
                idle_wall += wall
            if r >= spec.warmup:
                samples[name].append({"wall": wall, "cpu": cpu, **parts})

    # Collectives of one more (untimed) step, forward and backward apart.
    comms: dict[str, dict[str, Any]] = {}
    for name in active:
        if name not in TP2:
            continue
        with quiet_stderr():
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p_fwd:
                loss = models[name](input_ids=ids, labels=ids).loss
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p_bwd:
                loss.backward()
        opts[name].zero_grad(set_to_none=True)
        comms[name] = {"fwd": _count_collectives(p_fwd), "bwd": _count_collectives(p_bwd)}
    state = getattr(models.get("tpcompile compiled"), "tpcompile_compiled", None)
    return {"samples": samples, "losses": losses, "errors": errors, "comms": comms,
            "idle_cpu_s": idle_cpu, "idle_wall_s": idle_wall, "checks": checks, "first_step": first_step,
            "breaks": None if state is None else state.graph_breaks}


# ------------------------------------------------------------------------------ section


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _comm_table(comms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Collectives per step, per competitor: calls (MB) by kind and direction."""
    rows = []
    for name, by_dir in comms.items():
        cells = [name]
        for direction in ("fwd", "bwd"):
            seen = by_dir[direction]
            cells.append(", ".join(f"{n} {kind} ({b / 2**20:.1f} MB)"
                                   for kind, (n, b) in sorted(seen.items())) or "none")
        rows.append(cells)
    return {"title": "Collectives per training step on one rank (gloo events in the profiler; "
                     "fp32 payload)",
            "header": ["competitor", "forward", "backward"], "rows": rows}


def _cpu_table(cpu: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """CPU seconds per step summed over the ranks that ran it: robust to a busy host."""
    base = _med([s["cpu"] for s in cpu[BASELINE]]) if cpu.get(BASELINE) else None
    rows = []
    for name, steps in cpu.items():
        total = [s["cpu"] for s in steps]
        phases = " / ".join(f"{_med([s[f'cpu_{p}'] for s in steps]):.3f}" for p in PHASES)
        ratio = f"{_med(total) / base:.2f}×" if base else "—"
        rows.append([name, f"{_med(total):.3f} s", f"{min(total):.3f} – {max(total):.3f} s",
                     phases, ratio])
    return {"title": "CPU time per step, summed over the ranks that ran it (process_time; "
                     "ideal TP: tp=2 total = tp=1)",
            "header": ["competitor", "median", "spread (min–max)", "fwd / bwd / opt", "ratio"],
            "rows": rows}


def _merge_ranks(per_rank: dict[int, dict[str, Any]]) -> dict[str, list[dict[str, float]]]:
    """Per competitor and step: CPU seconds (total and per phase) summed over ranks."""
    out: dict[str, list[dict[str, float]]] = {}
    for name, steps in per_rank[0]["samples"].items():
        merged = []
        for i, step in enumerate(steps):
            ranks = [step] + ([per_rank[1]["samples"][name][i]] if name in TP2 else [])
            keys = ["cpu", *(f"cpu_{p}" for p in PHASES)]
            merged.append({k: sum(r[k] for r in ranks) for k in keys})
        out[name] = merged
    return out


def run(quick: bool) -> dict[str, Any]:
    """Time the competitors; see the module docstring."""
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec = QUICK if quick else FULL
    with tempfile.TemporaryDirectory(prefix="tpc-bench-") as model_dir:
        torch.manual_seed(0)
        LlamaForCausalLM(spec.llama_config()).save_pretrained(model_dir)
        per_rank = spawn_ranks(_bench, WORLD, (spec, model_dir), timeout_s=spec.timeout_s)

    res = per_rank[0]
    tokens = spec.batch * spec.seq
    samples = res["samples"]
    wall = {n: [s["wall"] for s in samples[n]] for n in samples}
    cpu = _merge_ranks(per_rank)
    base = _med(wall[BASELINE]) if wall.get(BASELINE) else None
    rows = []
    for name in (*TP2, *TP1):
        if name in res["errors"]:
            rows.append(row(name, None, unit="s/step", error=res["errors"][name],
                            note=f"could not run: {res['errors'][name]}"))
            continue
        phases = {p: _med([s[p] for s in samples[name]]) for p in PHASES}
        note = (" / ".join(f"{p} {v:.3f}" for p, v in phases.items())
                + f" s; {tokens / _med(wall[name]):,.0f} tok/s; "
                f"CPU {_med([s['cpu'] for s in cpu[name]]):.2f} s")
        rows.append(row(name, wall[name], unit="s/step", baseline=base, note=note,
                        loss0=res["losses"].get(name), phases_median_s=phases,
                        cpu_s=[round(s["cpu"], 4) for s in cpu[name]],
                        procs=1 if name in TP1 else WORLD))

    notes: list[str] = []
    ref_loss = res["losses"].get(REFERENCE)
    if ref_loss is not None:  # equal work: the untransformed model's step-0 loss
        diffs = {n: abs(v - ref_loss) for n, v in res["losses"].items()}
        status = "OK" if max(diffs.values()) <= LOSS_ATOL else "MISMATCH"
        notes.append(f"step-0 loss check {status} (atol {LOSS_ATOL:g}; {REFERENCE} = "
                     f"{ref_loss:.6f}): " + ", ".join(
                         f"{n} {v:.6f} (Δ {diffs[n]:.1e})" for n, v in res["losses"].items()))
    if wall.get("tpcompile tp=1"):
        t1 = _med(wall["tpcompile tp=1"])
        c1 = _med([s["cpu"] for s in cpu["tpcompile tp=1"]])
        notes.append("scaling efficiency vs tpcompile tp=1 — wall t1/(2·t2), CPU c1/c2: " + ", ".join(
            f"{n} {t1 / (WORLD * _med(wall[n])):.2f} / {c1 / _med([s['cpu'] for s in cpu[n]]):.2f}"
            for n in TP2 if wall.get(n)))
    for name, eager in COMPILED.items():
        if wall.get(name) and wall.get(eager):
            notes.append(f"{name}: {_med(wall[eager]) / _med(wall[name]):.2f}× faster than {eager} (eager); "
                         f"first step with compilation {res['first_step'].get(name, float('nan')):.1f} s")
    for name in ("tpcompile compiled", "tpcompile layers compiled"):
        if wall.get(name) and wall.get("hf native compiled"):
            notes.append(f"{name} vs hf native compiled: {_med(wall['hf native compiled']) / _med(wall[name]):.2f}×")
    if res["breaks"] is not None:
        notes.append(f"graph breaks in tpcompile compiled's blocks (all steps): {res['breaks']}")
    for name, total in res["checks"].items():  # the input checks' share of the step (target <= 1%)
        steps = len(samples[name])
        per_step = total["s"] / steps
        notes.append(f"input checks (token ids, labels) in {name}: {total['calls'] / steps:.0f} per step, "
                     f"{per_step * 1e3:.3f} ms = {per_step / _med(wall[name]):.3%} of the step (target <= 1%)")
    idle = per_rank[1]
    if idle["idle_wall_s"]:
        notes.append(f"idle rank 1 during tp=1 steps used {idle['idle_cpu_s']:.2f} s CPU in "
                     f"{idle['idle_wall_s']:.1f} s wall (≈0: the single-process rows had a "
                     "core to themselves)")
    config = {**asdict(spec), "dtype": "float32", "backend": "gloo", "threads_per_proc": 1,
              "optimizer": "AdamW(lr=1e-5)", "attn_implementation": "sdpa",
              "tokens_per_step": tokens}
    out = section_result(
        f"Training step, Llama {spec.layers}L h{spec.hidden} (fwd+bwd+AdamW, "
        f"batch {spec.batch}×{spec.seq}, fp32, gloo, {WORLD}×1 thread)",
        rows, ratio_of=f"median of {BASELINE} (tp=2); note: rank-0 wall per phase, CPU "
                       "summed over ranks", notes=notes, config=config)
    out["tables"] = [_cpu_table(cpu), _comm_table(res["comms"])]
    return out
