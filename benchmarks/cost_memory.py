"""Section ``cost_memory``: dump-plan's memory estimate vs a training step's peak RSS.

``python benchmarks/cost_memory.py`` (or ``run.py``'s full mode) plans a Llama (hidden 1024, 4 layers, GQA 16/8,
vocab 32k, fp32) at tp=2 with ``tpcompile.tools.estimate_cost`` (batch 2 × seq 256),
then runs it on 2 gloo processes: each builds the model on the meta device, transforms
it, allocates only its shards (``to_empty``), records its resident set (the baseline:
interpreter, libraries, the shards), and runs three AdamW steps. Reported per rank:
the peak resident set (``VmHWM``) minus the baseline, next to the estimate of
gradients + AdamW states + activations (the parameters are in the baseline).
``run.py --quick`` uses 2 layers and seq 128.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import row, section_result, spawn_ranks  # noqa: E402

TP, BATCH, SEQ, STEPS, LAYERS = 2, 2, 256, 3, 4
MB = 1024 * 1024  # MiB


def _config(layers: int = LAYERS) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
                       num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
                       tie_word_embeddings=False, dtype="float32")


def _meta_model(layers: int = LAYERS) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(_config(layers))


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _rank(rank: int, layers: int = LAYERS, seq: int = SEQ) -> dict[str, int]:
    import tpcompile

    model = tpcompile.transform(_meta_model(layers), tp=TP)
    model.to_empty(device="cpu")  # this rank's shards only
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_(0.0, 0.02)
        for b in model.buffers():
            b.zero_()
    model.model.rotary_emb.inv_freq.copy_(1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64)))
    baseline = _status("VmRSS")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 32000, (BATCH, seq), generator=torch.Generator().manual_seed(0))
    for _ in range(STEPS):
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {"baseline": baseline, "peak": _status("VmHWM")}


def measure(layers: int = LAYERS, seq: int = SEQ) -> tuple[dict[str, int], dict[int, dict[str, int]]]:
    """The estimate's memory per rank (bytes) and each rank's measured baseline and peak."""
    import tpcompile
    from tpcompile.tools.cost import estimate_cost

    model = _meta_model(layers)
    cost = estimate_cost(model, tpcompile.plan_model(model, TP), batch=BATCH, seq=seq)
    return cost["memory_per_rank"], spawn_ranks(_rank, TP, (layers, seq))


def run(quick: bool) -> dict[str, Any]:
    layers, seq = (2, 128) if quick else (LAYERS, SEQ)
    mem, measured = measure(layers, seq)
    est = (mem["gradients"] + mem["adamw_states"] + mem["activations"]) / MB
    rows = [row("estimate: gradients + AdamW states + activations", [est], unit="MiB", baseline=est,
                note=", ".join(f"{k} {v / MB:.0f}" for k, v in mem.items()))]
    rows += [row(f"measured rank {r}: peak RSS above baseline", [(m["peak"] - m["baseline"]) / MB], unit="MiB",
                 baseline=est, note=f"baseline {m['baseline'] / MB:.0f} MiB, peak {m['peak'] / MB:.0f} MiB")
             for r, m in sorted(measured.items())]
    notes = [f"Llama hidden 1024, {layers} layers, GQA 16/8, vocab 32k, fp32, tp={TP}, batch {BATCH} × seq {seq}, "
             f"{STEPS} AdamW steps; baseline = RSS after the shards are allocated (parameters included)"]
    return section_result("memory estimate vs measured peak per rank", rows, ratio_of="the estimate",
                          notes=notes, config={"layers": layers, "seq": seq, "batch": BATCH, "tp": TP})


def main() -> None:
    mem, measured = measure()
    est = mem["gradients"] + mem["adamw_states"] + mem["activations"]
    out = {"estimate": {k: round(v / MB, 1) for k, v in mem.items()},
           "estimate_above_baseline_mib": round(est / MB, 1),
           "measured": {r: {k: round(v / MB, 1) for k, v in m.items()} for r, m in measured.items()},
           "measured_above_baseline_mib": {r: round((m["peak"] - m["baseline"]) / MB, 1)
                                          for r, m in measured.items()}}
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
