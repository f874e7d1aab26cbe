"""Section ``moe_ep``: a MoE training step with expert parallelism vs experts split over tp.

One step = forward with labels + backward + AdamW (fp32, gloo, 2 CPU processes with one
intra-op thread each) on a random-init Mixtral (8 experts, top-2).  Competitors, each in
its own pair of fresh processes (so the peak resident memory is its own):

* ``tpcompile ep=2`` — ``parallelize(model, ep=2)``: each rank holds 4 whole experts and
  its half of the global batch; tokens reach their experts with all-to-all (the baseline
  of the ratio column);
* ``tpcompile tp=2`` — ``parallelize(model, tp=2)``: every expert split column/row over
  the two ranks, both ranks run the whole batch (tpcompile's layout before EP);
* ``hf ep`` — transformers' own expert parallelism, ``from_pretrained(dir,
  distributed_config=DistributedConfig(ep_size=2, ...))``, if it runs on CPU / gloo;
  otherwise the row carries the exact error.

Every competitor processes the same global batch per step; tokens/s = global tokens /
step time.  Before timing, each competitor's step-0 loss is checked against the
untransformed model.  Memory: peak resident set size per rank (``ru_maxrss``, max over
the ranks) minus the resident size after imports, and the bytes of this rank's
parameters + gradients + AdamW state.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from common import row, section_result, spawn_ranks
from torch import nn

WORLD = 2
LOSS_ATOL = 1e-4
BASELINE = "tpcompile ep=2"
COMPETITORS = ("tpcompile ep=2", "tpcompile tp=2", "hf ep")


@dataclass(frozen=True)
class Spec:
    """Model and schedule of one run."""

    hidden: int = 512
    intermediate: int = 1024
    experts: int = 8
    top_k: int = 2
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    vocab: int = 8000
    batch: int = 4
    seq: int = 256
    warmup: int = 2
    repeats: int = 5
    timeout_s: float = 900.0

    def config(self) -> Any:
        from transformers import MixtralConfig

        return MixtralConfig(
            hidden_size=self.hidden, intermediate_size=self.intermediate, num_local_experts=self.experts,
            num_experts_per_tok=self.top_k, num_hidden_layers=self.layers, num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads, vocab_size=self.vocab, max_position_embeddings=max(self.seq, 512),
            tie_word_embeddings=False)


FULL = Spec()
QUICK = Spec(hidden=256, intermediate=512, seq=128, warmup=1, repeats=3, timeout_s=600.0)


def _rss_mb() -> float:
    with open("/proc/self/statm", encoding="utf-8") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize() / 2**20


def _load(model_dir: str, **kwargs: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa",
                                                **kwargs)


def _build(name: str, model_dir: str) -> tuple[nn.Module, bool]:
    """The model and whether each rank trains on its own half of the batch."""
    import tpcompile

    if name == "tpcompile ep=2":
        return tpcompile.parallelize(_load(model_dir), ep=WORLD), True
    if name == "tpcompile tp=2":
        return tpcompile.parallelize(_load(model_dir), tp=WORLD), False
    from transformers.distributed import DistributedConfig

    # EP over the two ranks with tokens exchanged (ep_size > tp_size needs the all-to-all
    # dispatch) and FSDP over the same two ranks for the dense layers
    cfg = DistributedConfig(ep_size=WORLD, fsdp_size=WORLD, tp_size=1, ep_implementation="all_to_all")
    return _load(model_dir, distributed_config=cfg), True


def _state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    total = sum(local(p) + (local(p.grad) if p.grad is not None else 0) for p in model.parameters())
    return total + sum(local(v) for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))


def _bench(rank: int, name: str, spec: Spec, model_dir: str, ref_loss: float) -> dict[str, Any]:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    base_rss = _rss_mb()
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(1))
    try:
        model, split = _build(name, model_dir)
    except Exception as exc:  # a competitor that cannot run is reported, not fatal
        return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:300]}
    local = ids.chunk(WORLD)[rank] if split else ids
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> float:
        loss = model(input_ids=local, labels=local).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean.item() / WORLD

    with torch.no_grad():  # equal work: the untransformed model's loss, before any step
        loss0 = model(input_ids=local, labels=local).loss.detach().clone()
    dist.all_reduce(loss0)
    times, cpu = [], []
    for r in range(spec.warmup + spec.repeats):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        dist.barrier()
        if r >= spec.warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    loss = model(input_ids=local, labels=local).loss
    loss.backward()  # gradients held: the state bytes below include them
    state = _state_bytes(model, opt)
    return {"times": times, "cpu": cpu, "loss0": loss0.item() / WORLD, "ref_loss": ref_loss, "state_mb": state / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_rss}


def _reference_loss(spec: Spec, model_dir: str) -> float:
    ids = torch.randint(0, spec.vocab, (spec.batch, spec.seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return float(_load(model_dir)(input_ids=ids, labels=ids).loss)


def run(quick: bool) -> dict[str, Any]:
    """Time the competitors; see the module docstring."""
    from transformers import MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec = QUICK if quick else FULL
    results: dict[str, dict[int, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="tpc-moe-") as model_dir:
        torch.manual_seed(0)
        MixtralForCausalLM(spec.config()).save_pretrained(model_dir)
        ref = _reference_loss(spec, model_dir)
        for name in COMPETITORS:
            try:
                results[name] = spawn_ranks(_bench, WORLD, (name, spec, model_dir, ref), timeout_s=spec.timeout_s)
            except RuntimeError as exc:
                last = [ln for ln in str(exc).splitlines() if ln.strip()][-1]
                results[name] = {0: {"error": last[:300]}, 1: {"error": last[:300]}}
    tokens = spec.batch * spec.seq
    base = None
    rows, losses = [], {}
    for name in COMPETITORS:
        per_rank = results[name]
        if "error" in per_rank[0]:
            rows.append(row(name, None, unit="s/step", error=per_rank[0]["error"],
                            note=f"could not run: {per_rank[0]['error']}"))
            continue
        times = per_rank[0]["times"]
        med = statistics.median(times)
        base = med if name == BASELINE else base
        peak = max(r["peak_rss_mb"] for r in per_rank.values())
        state = max(r["state_mb"] for r in per_rank.values())
        losses[name] = per_rank[0]["loss0"]
        # CPU seconds of both ranks per step: robust to a busy shared host
        cpu = statistics.median(sum(r["cpu"][i] for r in per_rank.values()) for i in range(len(times)))
        rows.append(row(name, times, unit="s/step", baseline=base,
                        note=f"{tokens / med:,.0f} tok/s; CPU {cpu:.2f} s/step (both ranks); peak RSS "
                             f"+{peak:.0f} MB/rank; params+grads+AdamW {state:.1f} MB/rank",
                        tokens_per_s=tokens / med, cpu_s=cpu, peak_rss_mb=peak, state_mb=state))
    notes = []
    if losses:
        diffs = {n: abs(v - ref) for n, v in losses.items()}
        status = "OK" if max(diffs.values()) <= LOSS_ATOL else "MISMATCH"
        notes.append(f"step-0 loss check {status} (atol {LOSS_ATOL:g}; one process = {ref:.6f}): "
                     + ", ".join(f"{n} {v:.6f}" for n, v in losses.items()))
    notes.append("EP ranks train on half of the global batch each (data parallel outside the experts); "
                 "tp=2 ranks both run the whole batch; tokens/s counts the global batch once")
    config = {**asdict(spec), "dtype": "float32", "backend": "gloo", "threads_per_proc": 1,
              "optimizer": "AdamW(lr=1e-5)", "tokens_per_step": tokens}
    return section_result(
        f"MoE training step, Mixtral {spec.layers}L h{spec.hidden} {spec.experts} experts top-{spec.top_k} "
        f"(fwd+bwd+AdamW, batch {spec.batch}×{spec.seq}, fp32, gloo, {WORLD}×1 thread)",
        rows, ratio_of=f"median of {BASELINE}", notes=notes, config=config)
