"""Section ``activation_memory``: a small Llama's saved activations, 4 ways.

Plain, activation checkpointing, offloading, and both.

Run alone: ``python benchmarks/activation_memory.py [--layers 8 --hidden 512 --batch 4 --seq 512]``
(``run.py``'s full mode uses those defaults; ``--quick`` a 4-layer, 256-wide model).

"On device" is what autograd holds at the end of forward, measured with an outermost
``saved_tensors_hooks`` that counts each saved tensor's storage once, parameters
excluded; inside offloaded blocks the offloader's own hooks see the saves, so their
device part is the offloader's ``kept_bytes`` and their host part its ``offloaded_bytes``.
Not counted: tensors a checkpoint holds through its closure rather than saving
(keyword arguments such as the rotary cos/sin, shared by all layers).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import SavedBytes, row, section_result  # noqa: E402

from tpcompile.runtime import checkpoint_blocks, offload_activations  # noqa: E402
from tpcompile.tools.presets import tiny_config  # noqa: E402

MIB = 1 << 20
MODES = ("plain", "checkpoint", "offload", "checkpoint+offload")


def build(layers: int, hidden: int) -> nn.Module:
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(
        "llama", hidden_size=hidden, num_hidden_layers=layers, intermediate_size=hidden * 11 // 4,
        num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
        vocab_size=4096, max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg)


def measure(base: nn.Module, mode: str, ids: torch.Tensor, horizon: int) -> dict[str, float]:
    model = copy.deepcopy(base)
    blocks = [f"model.layers.{i}" for i in range(model.config.num_hidden_layers)]
    if "checkpoint" in mode:
        checkpoint_blocks(model, blocks)
    handle = offload_activations(model, blocks, loading_horizon=horizon) if "offload" in mode else None
    t0 = time.perf_counter()
    saved = SavedBytes(model)
    with saved:
        loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    seconds = time.perf_counter() - t0
    stats = handle.stats if handle else None
    device = saved.total + (stats.kept_bytes if stats else 0)
    host = stats.offloaded_bytes if stats else 0
    per_block = host / len(blocks)
    return {
        "device": device / MIB,
        "host": host / MIB,
        # during backward at most horizon + 1 blocks' host copies are back on the device
        "backward_peak_extra": (min(horizon + 1, len(blocks)) * per_block / MIB) if stats else 0.0,
        "seconds": seconds,
        "max_resident": stats.max_resident_blocks if stats else 0,
    }


def measure_all(layers: int, hidden: int, batch: int, seq: int, horizon: int) -> dict[str, dict[str, float]]:
    """``measure`` of every mode on one model and one batch, in ``MODES`` order."""
    base = build(layers, hidden)
    ids = torch.randint(0, base.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {mode: measure(base, mode, ids, horizon) for mode in MODES}


def run(quick: bool) -> dict[str, Any]:
    size = {"layers": 4, "hidden": 256, "batch": 2, "seq": 256} if quick else \
        {"layers": 8, "hidden": 512, "batch": 4, "seq": 512}
    horizon = 2
    res = measure_all(**size, horizon=horizon)
    plain = res["plain"]["device"]
    rows = [row(f"{mode}: saved on device", [r["device"]], unit="MiB", baseline=plain,
                note=f"host {r['host']:.1f} MiB; fwd+bwd {r['seconds']:.2f} s")
            for mode, r in res.items()]
    table = {"title": "saved activations per mode (MiB) and one fwd+bwd",
             "header": ["mode", "on device", "on host", "bwd reload", "resident blocks", "fwd+bwd s"],
             "rows": [[mode, f"{r['device']:.1f}", f"{r['host']:.1f}", f"{r['backward_peak_extra']:.1f}",
                       str(r["max_resident"]), f"{r['seconds']:.2f}"] for mode, r in res.items()]}
    notes = [f"Llama hidden {size['hidden']}, {size['layers']} layers, batch {size['batch']}, seq {size['seq']}, "
             f"fp32, loading_horizon {horizon}; one process",
             "bwd reload = host copies back on the device at once during backward (horizon + 1 blocks)"]
    out = section_result("saved activations: checkpointing and offloading", rows, ratio_of="plain",
                         notes=notes, config={**size, "horizon": horizon})
    out["tables"] = [table]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--horizon", type=int, default=2)
    a = ap.parse_args()
    res = measure_all(a.layers, a.hidden, a.batch, a.seq, a.horizon)
    print(f"Llama hidden {a.hidden}, {a.layers} layers, batch {a.batch}, seq {a.seq}, fp32, "
          f"loading_horizon {a.horizon}")
    print(f"{'mode':<22}{'saved on device MiB':>20}{'on host MiB':>13}{'bwd reload MiB':>16}"
          f"{'resident':>10}{'fwd+bwd s':>11}")
    for mode, r in res.items():
        print(f"{mode:<22}{r['device']:>20.1f}{r['host']:>13.1f}{r['backward_peak_extra']:>16.1f}"
              f"{r['max_resident']:>10}{r['seconds']:>11.2f}")


if __name__ == "__main__":
    main()
