"""Section ``state_dict_cost``: what ``model.state_dict()`` of a transformed model costs at tp=2.

``state_dict()`` is honest (every entry's full value is the HF tensor): contiguous and
replicated parameters are returned as they are, a padded vocabulary as a view, and
every other layout (fused q|k|v / gate|up blocks, KV copies) is converted with one
all-gather over the TP group per tensor.  This script measures, on two mid-size models
whose layouts differ (a Llama: separate q/k/v and gate/up, all contiguous; a Phi-3:
fused ``qkv_proj`` and ``gate_up_proj``, so most of the weights convert):

* wall time of ``model.state_dict()`` (median of 5) beside a plain model's in one process;
* the bytes the returned dict holds beyond the parameters (new storages), per rank;
* the peak resident set increase (``VmHWM``) during one call, per rank: the first call
  (it also pays gloo's one-time buffers) and a later one (after freed memory went back
  to the OS).

    python benchmarks/state_dict_cost.py

(``run.py``'s full mode uses the same sizes; ``--quick`` halves width and depth.)
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from common import row, section_result, spawn_ranks  # noqa: E402

SIZE = {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4, "num_attention_heads": 16,
        "num_key_value_heads": 16, "vocab_size": 32000, "head_dim": 64}
QUICK_SIZE = {**SIZE, "hidden_size": 512, "intermediate_size": 2048, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 8}
MODELS = ("llama", "phi3")


def _build(name: str, size: dict[str, int] = SIZE) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from tpcompile.tools.presets import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(name, **{k: v for k, v in size.items() if k != "head_dim" or name == "llama"})
    return AutoModelForCausalLM.from_config(cfg).eval()


def _hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _reset_hwm() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _rss_peak_of(model: torch.nn.Module) -> float:
    """Peak resident-set increase (MB) during one ``state_dict()`` call."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    _reset_hwm()
    base = _hwm_mb()
    sd = model.state_dict()
    peak = _hwm_mb() - base
    del sd
    return peak


def _measure(model: torch.nn.Module) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    params |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    first = _rss_peak_of(model)  # includes one-time gloo buffers of the first gathers
    sd = model.state_dict()
    del sd
    steady = _rss_peak_of(model)  # a later call, freed memory handed back to the OS first
    sd = model.state_dict()
    times = []
    for _ in range(5):
        del sd
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        sd = model.state_dict()
        times.append(time.perf_counter() - t0)
    held = sum(local(v).untyped_storage().nbytes() for v in sd.values()
               if local(v).untyped_storage().data_ptr() not in params)
    total = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
    return {"median_s": statistics.median(times), "times_s": times, "held_mb": held / 2**20, "peak_rss_mb": steady,
            "first_rss_mb": first,
            "params_mb": total / 2**20, "converted": sum(1 for v in sd.values()
                                                         if local(v).untyped_storage().data_ptr() not in params)}


def _rank(rank: int, name: str, size: dict[str, int] = SIZE) -> dict[str, Any]:
    import tpcompile

    model = tpcompile.transform(_build(name, size), tp=2)
    return _measure(model)


def measure(name: str, size: dict[str, int] = SIZE) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """A plain model's ``_measure`` (this process, one thread) and each tp=2 rank's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like each rank
    try:
        plain = _measure(_build(name, size))
    finally:
        torch.set_num_threads(threads)
    return plain, spawn_ranks(_rank, 2, (name, size))


def run(quick: bool) -> dict[str, Any]:
    size = QUICK_SIZE if quick else SIZE
    rows, notes = [], []
    for name in MODELS:
        plain, ranks = measure(name, size)
        base = plain["median_s"]
        rows.append(row(f"{name}: plain model, one process", plain["times_s"], baseline=base))
        rows += [row(f"{name}: tp=2 rank {rank}", r["times_s"], baseline=base,
                     note=f"held beyond params {r['held_mb']:.0f} MB; peak RSS +{r['peak_rss_mb']:.0f} MB "
                          f"(first call +{r['first_rss_mb']:.0f} MB)")
                 for rank, r in sorted(ranks.items())]
        notes.append(f"{name}: params/rank {ranks[0]['params_mb']:.0f} MB, entries converted (new storage) "
                     f"{ranks[0]['converted']}")
    return section_result("model.state_dict() of a transformed model, tp=2", rows,
                          ratio_of="the plain model's state_dict() of the same family", notes=notes,
                          config={"size": size})


def main() -> None:
    for name in MODELS:
        plain, ranks = measure(name)
        r = ranks[0]
        print(f"{name}: params/rank {r['params_mb']:.0f} MB; state_dict() {r['median_s'] * 1e3:.1f} ms "
              f"(plain model, one process: {plain['median_s'] * 1e3:.2f} ms); converted entries {r['converted']}; "
              f"held beyond params {r['held_mb']:.0f} MB/rank; peak RSS +{r['peak_rss_mb']:.0f} MB/rank "
              f"(first call +{r['first_rss_mb']:.0f} MB; rank 1: {ranks[1]['median_s'] * 1e3:.1f} ms, "
              f"+{ranks[1]['peak_rss_mb']:.0f} MB, first +{ranks[1]['first_rss_mb']:.0f} MB)")


if __name__ == "__main__":
    main()
