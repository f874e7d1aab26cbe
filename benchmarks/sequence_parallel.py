"""Section ``sequence_parallel``: saved activations and step time, SP off vs on, at tp=2 and 4.

Both models of a world live in the same ``tp`` processes (gloo, one intra-op thread
each), built from the same random-init Llama: ``transform(model, tp=tp)`` (SP off, the
baseline of the ratio column) and ``transform(model, tp=tp, sequence_parallel=True)``.

* **Saved activations** — bytes autograd holds per rank at the end of one forward with
  labels, parameters excluded: an outermost ``saved_tensors_hooks`` counts each saved
  storage once, and forward pre/post hooks on every module say which module was running
  when it was saved (the innermost one). A save is *in regions* under an attention or
  MLP module (``plan.sequence.regions``), *between regions* under a decoder layer
  but outside its regions (norms, residual adds: what SP splits by tokens), and *outside
  layers* otherwise (embedding, final norm, LM head, loss: the stream is whole there).
* **Step time** — forward with labels + backward + AdamW, the two models stepped
  alternately (order swapped every round) with barriers around each step, median after
  warm-up; wall time of the slowest rank and CPU time summed over ranks.
* **Equal work** — the step-0 loss with SP on must equal SP off (atol 1e-5).
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from common import row, section_result, spawn_ranks
from torch import nn

LOSS_ATOL = 1e-5
MODES = ("sp off", "sp on")
PARTS = ("regions", "between", "outside")  # where a saved tensor was saved, see the docstring
MIB = 2**20


@dataclass(frozen=True)
class Spec:
    """Model and schedule of one run."""

    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4  # divides every tp measured
    intermediate: int = 1408
    vocab: int = 4096
    batch: int = 2
    seq: int = 512
    tps: tuple[int, ...] = (2, 4)
    warmup: int = 2
    repeats: int = 9
    timeout_s: float = 1200.0

    def config(self) -> Any:
        from tpcompile.tools.presets import tiny_config

        cfg = tiny_config(
            "llama", num_hidden_layers=self.layers, hidden_size=self.hidden,
            num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
            head_dim=self.hidden // self.heads, intermediate_size=self.intermediate,
            vocab_size=self.vocab, max_position_embeddings=max(self.seq, 128),
            tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        return cfg


FULL = Spec()
QUICK = Spec(layers=2, hidden=256, heads=4, intermediate=704, seq=128, warmup=1, repeats=3,
             timeout_s=600.0)


# ------------------------------------------------------------------------------ saved bytes


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding ``t``'s memory on this rank (a DTensor's local shard)."""
    return getattr(t, "_local_tensor", t)


class SavedByPart(torch.autograd.graph.saved_tensors_hooks):
    """Bytes of distinct non-parameter storages saved for backward, by :data:`PARTS`.

    Each storage is counted once, in the part of the innermost module running when it
    was first saved.

    Example:
        >>> with SavedByPart(model, regions=["model.layers.0.mlp"]) as saved:  # doctest: +SKIP
        ...     loss = model(input_ids=ids, labels=ids).loss
        >>> saved.bytes["between"]                                              # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, regions: list[str]) -> None:
        self.params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.regions = tuple(regions)
        # the decoder layers are the regions' parents
        self.blocks = tuple({r.rpartition(".")[0] for r in regions})
        self.bytes = dict.fromkeys(PARTS, 0)
        self._seen: set[int] = set()
        self._stack: list[str] = [""]
        self._handles: list[Any] = []
        for name, mod in model.named_modules():
            self._handles.append(mod.register_forward_pre_hook(self._enter(name)))
            self._handles.append(mod.register_forward_hook(self._leave))
        super().__init__(self._pack, lambda t: t)

    def _enter(self, name: str) -> Any:
        def pre(_mod: nn.Module, _args: tuple) -> None:
            self._stack.append(name)
        return pre

    def _leave(self, _mod: nn.Module, _args: tuple, _out: Any) -> None:
        self._stack.pop()  # returns None: a hook's return value would replace the output

    def _part(self, module: str) -> str:
        def under(prefixes: tuple[str, ...]) -> bool:
            return any(module == p or module.startswith(p + ".") for p in prefixes)

        return "regions" if under(self.regions) else "between" if under(self.blocks) else "outside"

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params and ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes[self._part(self._stack[-1])] += storage.nbytes()
        return t

    def __enter__(self) -> SavedByPart:
        super().__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for h in self._handles:
            h.remove()


# ------------------------------------------------------------------------------ worker


def _build(spec: Spec, tp: int, sequence_parallel: bool) -> nn.Module:
    from transformers import AutoModelForCausalLM

    import tpcompile

    torch.manual_seed(0)  # the same weights on every rank and in both modes
    model = AutoModelForCausalLM.from_config(spec.config()).float()
    return tpcompile.transform(model, tp=tp, sequence_parallel=sequence_parallel).train()


def _saved(model: nn.Module, ids: torch.Tensor, regions: list[str]) -> tuple[dict[str, int], float]:
    """Saved bytes by part at the end of one forward, and its loss (no optimizer step).

    ``regions`` come from the SP model's plan; SP off has the same modules, unsplit."""
    with SavedByPart(model, regions) as saved:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return saved.bytes, float(loss.item())


def _step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _bench(rank: int, spec: Spec, tp: int) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    # torch's deprecation notice for the reduce-scatter SP uses, once per rank: not a finding
    warnings.filterwarnings("ignore", message=".*reduce_scatter_tensor.* is deprecated")
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(1))
    models = {m: _build(spec, tp, m == "sp on") for m in MODES}
    regions = sorted(models["sp on"].tpcompile_plan.sequence.regions)
    if not regions:
        raise RuntimeError("sequence_parallel=True planned no regions: " + "; ".join(
            models["sp on"].tpcompile_plan.warnings))
    saved, losses = {}, {}
    for m in MODES:
        saved[m], losses[m] = _saved(models[m], ids, regions)
    opts = {m: torch.optim.AdamW(models[m].parameters(), lr=1e-5) for m in MODES}
    wall: dict[str, list[float]] = {m: [] for m in MODES}
    cpu: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(spec.warmup + spec.repeats):
        for m in MODES[r % 2:] + MODES[:r % 2]:  # alternate who goes first: drift hits both
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            _step(models[m], opts[m], ids)
            dist.barrier()  # the step lasts until the slowest rank is done
            if r >= spec.warmup:
                wall[m].append(time.perf_counter() - t0)
                cpu[m].append(time.process_time() - c0)
    return {"saved": saved, "losses": losses, "wall": wall, "cpu": cpu, "regions": len(regions)}


# ------------------------------------------------------------------------------ section


def _rows(tp: int, per_rank: dict[int, dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """Memory and time rows of one tp, and its equal-work note."""
    res = per_rank[0]
    saved = {m: {p: max(r["saved"][m][p] for r in per_rank.values()) for p in PARTS} for m in MODES}
    total = {m: sum(saved[m].values()) for m in MODES}
    rows = []
    for m in MODES:
        s = saved[m]
        note = (f"in regions {s['regions'] / MIB:.1f} / between regions {s['between'] / MIB:.1f} / "
                f"outside layers {s['outside'] / MIB:.1f} MiB")
        rows.append(row(f"tp={tp} {m}: saved activations", [total[m] / MIB], unit="MiB",
                        baseline=total["sp off"] / MIB, note=note,
                        saved_bytes=s, saved_total_bytes=total[m]))
    cpu = {m: statistics.median(sum(r["cpu"][m][i] for r in per_rank.values())
                                for i in range(len(res["wall"][m]))) for m in MODES}
    base = statistics.median(res["wall"]["sp off"])
    for m in MODES:
        rows.append(row(f"tp={tp} {m}: train step", res["wall"][m], unit="s/step", baseline=base,
                        note=f"CPU {cpu[m]:.2f} s/step summed over {tp} ranks ({cpu[m] / cpu['sp off']:.2f}×)",
                        cpu_s=cpu[m]))
    diff = abs(res["losses"]["sp on"] - res["losses"]["sp off"])
    status = "OK" if diff <= LOSS_ATOL else "MISMATCH"
    note = (f"tp={tp} step-0 loss check {status} (atol {LOSS_ATOL:g}): sp off "
            f"{res['losses']['sp off']:.6f}, sp on {res['losses']['sp on']:.6f} (Δ {diff:.1e}); "
            f"{res['regions']} regions")
    return rows, [note]


def _memory_table(results: dict[int, dict[int, dict[str, Any]]]) -> dict[str, Any]:
    """Per tp: saved MiB per part and the off/on ratios."""
    table = []
    for tp, per_rank in results.items():
        saved = {m: {p: max(r["saved"][m][p] for r in per_rank.values()) for p in PARTS} for m in MODES}
        off, on = saved["sp off"], saved["sp on"]
        cells = [f"tp={tp}"]
        for p in (*PARTS, "total"):
            a = sum(off.values()) if p == "total" else off[p]
            b = sum(on.values()) if p == "total" else on[p]
            cells.append(f"{a / MIB:.1f} → {b / MIB:.1f} ({a / b:.2f}×)" if b else "—")
        table.append(cells)
    return {"title": "Saved activations per rank (max over ranks), SP off → on (off/on)",
            "header": ["tp", "in regions", "between regions", "outside layers", "total"],
            "rows": table}


def run(quick: bool) -> dict[str, Any]:
    """Measure SP off vs on at every tp of the spec; see the module docstring."""
    spec = QUICK if quick else FULL
    results = {tp: spawn_ranks(_bench, tp, (spec, tp), timeout_s=spec.timeout_s) for tp in spec.tps}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for tp, per_rank in results.items():
        r, n = _rows(tp, per_rank)
        rows += r
        notes += n
    cores = len(os.sched_getaffinity(0))
    over = [tp for tp in spec.tps if tp > cores]
    if over:
        notes.append(f"world {', '.join(map(str, over))} runs {max(over)} processes on {cores} cores "
                     "(oversubscribed, one torch thread each): its wall times include waiting "
                     "for a core; the CPU column is the steadier comparison")
    notes.append("between regions = norms and residual adds inside the decoder layers (split by "
                 "tokens with SP, expected off/on ≈ tp); outside layers = embedding, final norm, "
                 "LM head and loss (whole tokens in both modes)")
    config = {**asdict(spec), "dtype": "float32", "backend": "gloo", "threads_per_proc": 1,
              "optimizer": "AdamW(lr=1e-5)", "attn_implementation": "sdpa"}
    out = section_result(
        f"Sequence parallelism, Llama {spec.layers}L h{spec.hidden} (batch {spec.batch}×{spec.seq}, "
        f"fp32, gloo): saved activations and train step, SP off vs on",
        rows, ratio_of="SP off at the same tp", notes=notes, config=config)
    out["tables"] = [_memory_table(results)]
    return out
