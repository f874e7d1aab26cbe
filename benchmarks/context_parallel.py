"""Section ``context_parallel``: saved activations and step time per rank, cp=1 / 2 / 4.

A Llama (4 layers, hidden 512, sdpa) at 4k and 8k tokens per sequence, world 4 (gloo,
one intra-op thread per rank): ``parallelize(model, cp=C)`` with the other ``4/C`` ranks
as data-parallel shards (each rank always processes one full sequence's share of the
work: cp=1 is four data-parallel replicas of one sequence each), so the ratio column
shows what splitting one sequence over C ranks saves.

* **Saved activations** — bytes autograd holds per rank at the end of one forward with
  labels, parameters excluded (an outermost ``saved_tensors_hooks``, each storage once).
  Context parallelism keeps ``1/C`` of every per-position activation; the gathered keys
  and values of each attention layer are whole, so the ratio approaches ``1/C`` from
  above as the sequence grows.
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
from common import SavedBytes, row, section_result, spawn_ranks

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


def _bench(rank: int, spec: Spec, seq: int, cp: int) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    import tpcompile

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tpcompile.parallelize(AutoModelForCausalLM.from_config(spec.config(seq)), cp=cp)
    ids = torch.randint(0, spec.vocab, (1, seq), generator=torch.Generator().manual_seed(1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    saved = SavedBytes(model)
    with saved:
        loss = model(input_ids=ids, labels=ids).loss
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
    return {"saved": saved.total, "times": times, "loss": first}


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
            rows.append(row(f"{seq} tokens cp={cp}: train step", wall, unit="s/step", baseline=base_time,
                            note="slowest rank"))
    if not notes:
        notes.append("every cp>1 step-0 loss equals cp=1's (rel 1e-4)")
    return section_result("context parallelism: saved activations and step time per rank", rows,
                          ratio_of="cp=1 at the same length", notes=notes, config=asdict(spec))
