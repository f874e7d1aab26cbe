"""Section ``context_parallel``: saved activations and step time per rank, cp=1 / 2 / 4.

A Llama (4 layers, hidden 512, sdpa) at 4k and 8k tokens per sequence, world 4 (gloo,
one intra-op thread per rank): ``parallelize(model, cp=C)`` with the other ``4/C`` ranks
as data-parallel shards (each rank always processes one full sequence's share of the
work: cp=1 is four data-parallel replicas of one sequence each), so the ratio column
shows what splitting one sequence over C ranks saves.

* **Saved activations** — bytes autograd holds per rank at the end of one forward with
  labels, parameters excluded (an outermost ``saved_tensors_hooks``, each storage once,
  its size read when the forward returns: FSDP2's unsharded weights, saved by the
  projections but freed after forward, count 0).  Context parallelism keeps ``1/C`` of
  every per-position activation; the gathered keys and values of each attention layer
  are whole, so the ratio approaches ``1/C`` from above as the sequence grows.
* **Estimate** — ``dump-plan --cp C --batch 1 --seq S``'s activation memory per rank
  (``estimate_cost``: a fake-tensor forward through CP's own split and attention) next
  to the measured bytes; its ratio is estimate / measured.
* **Step time** — forward with labels + backward + AdamW, median after warm-up, wall
  time of the slowest rank.  On CPU the all-gathers are gloo copies; the time is reported,
  not a target.
* **Equal work** — the cp>1 step-0 loss must equal cp=1's (rel 1e-4).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from common import SavedBytes, _local, _storages, row, section_result, spawn_ranks

MIB = 2**20
LOSS_REL = 1e-4


@dataclass(frozen=True)
class Spec:
    layers: int = 4
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    intermediate: int = 1408
    vocab: int = 4096
    seqs: tuple[int, ...] = (4096, 8192)
    cps: tuple[int, ...] = (1, 2, 4)
    world: int = 4
    warmup: int = 1
    repeats: int = 3
    timeout_s: float = 3000.0

    def config(self, seq: int) -> Any:
        from tpcompile.tools.presets import tiny_config

        cfg = tiny_config("llama", num_hidden_layers=self.layers, hidden_size=self.hidden,
                          num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                          head_dim=self.hidden // self.heads, intermediate_size=self.intermediate,
                          vocab_size=self.vocab, max_position_embeddings=seq, tie_word_embeddings=False)
        cfg._attn_implementation = "sdpa"
        return cfg


FULL = Spec()
QUICK = Spec(layers=2, hidden=256, heads=4, intermediate=704, seqs=(1024,), cps=(1, 2), world=2,
             repeats=2, timeout_s=900.0)


class HeldBytes(SavedBytes):
    """:class:`~common.SavedBytes`, each storage's size read at :attr:`total` (right after
    the forward) instead of when it was saved: a storage freed since counts 0."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.held: dict[int, torch.UntypedStorage] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        for s in _storages(_local(t)):
            # keyed by the storage itself (kept alive here), not its data pointer: memory
            # FSDP2 frees mid-forward is reused by later activations
            if s.data_ptr() not in self.params:
                self.held.setdefault(s._cdata, s)
        return t

    @property
    def total(self) -> int:
        return sum(s.nbytes() for s in self.held.values())


def _estimate(spec: Spec, seq: int, cp: int) -> float | None:
    """``dump-plan --cp cp --batch 1 --seq seq``'s activation bytes per rank, in MiB."""
    from transformers import AutoModelForCausalLM

    import tpcompile
    from tpcompile.tools.cost import estimate_cost

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(spec.config(seq))
    found = estimate_cost(model, tpcompile.plan_model(model, tp=1), batch=1, seq=seq, cp=cp)["activations"]
    return None if found["bytes"] is None else found["bytes"] / MIB


def _bench(rank: int, spec: Spec, seq: int, cp: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    import tpcompile

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tpcompile.parallelize(AutoModelForCausalLM.from_config(spec.config(seq)), cp=cp)
    ids = torch.randint(0, spec.vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    saved = HeldBytes(model)
    with saved:
        loss = model(input_ids=ids, labels=ids).loss
    held = saved.total
    saved.held.clear()  # not kept alive through the timed steps
    first = loss.item()
    loss.backward()
    opt.step()
    opt.zero_grad()
    times = []
    for i in range(spec.warmup + spec.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        dist.barrier()
        if i >= spec.warmup:
            times.append(time.perf_counter() - t0)
    return {"saved": held, "times": times, "loss": first}


def run(quick: bool) -> dict[str, Any]:
    spec = QUICK if quick else FULL
    rows, notes = [], []
    for seq in spec.seqs:
        base_saved = base_time = base_loss = None
        for cp in spec.cps:
            res = spawn_ranks(_bench, spec.world, (spec, seq, cp), timeout_s=spec.timeout_s)
            saved = max(r["saved"] for r in res.values()) / MIB
            wall = [max(r["times"][i] for r in res.values()) for i in range(spec.repeats)]
            loss = res[0]["loss"]
            if cp == spec.cps[0]:
                base_saved, base_time, base_loss = saved, statistics.median(wall), loss
            elif abs(loss - base_loss) > LOSS_REL * abs(base_loss):
                notes.append(f"seq {seq} cp={cp}: step-0 loss {loss:.6f} differs from cp=1's {base_loss:.6f}")
            rows.append(row(f"{seq} tokens cp={cp}: saved activations per rank", [saved], unit="MiB",
                            baseline=base_saved, note="ratio vs cp=1 (→ 1/cp)"))
            estimate = _estimate(spec, seq, cp)
            rows.append(row(f"{seq} tokens cp={cp}: dump-plan estimate", None if estimate is None else [estimate],
                            unit="MiB", baseline=saved, note="ratio = estimate / measured",
                            error=None if estimate is not None else "no estimate"))
            rows.append(row(f"{seq} tokens cp={cp}: train step", wall, unit="s/step", baseline=base_time,
                            note="slowest rank"))
    if not notes:
        notes.append("every cp>1 step-0 loss equals cp=1's (rel 1e-4)")
    return section_result("context parallelism: saved activations and step time per rank", rows,
                          ratio_of="cp=1 at the same length", notes=notes, config=asdict(spec))
