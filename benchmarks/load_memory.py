"""Section ``load_memory``: resident memory per rank when loading a ~0.5B checkpoint.

Competitors, each in fresh processes (so nothing is shared with an earlier load):

* ``single process`` — plain ``AutoModelForCausalLM.from_pretrained(dir)``;
* ``tpcompile tp=2`` — ``tpcompile.from_pretrained(dir, tp=2)`` (shard-on-read);
* ``hf native tp=2`` — ``from_pretrained(dir, distributed_config=DistributedConfig(tp_size=2))``.

Each process first imports torch + transformers (+ tpcompile) and records its resident
set (the baseline); it then loads the checkpoint and runs one forward pass, and reports
the peak resident set (``VmHWM``) minus that baseline.  The forward pass matters:
safetensors files are memory-mapped by transformers, so weights never touched are not
resident, and a peak read right after loading would flatter every system.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from common import row, section_result, spawn_ranks, summarize  # noqa: E402

WORLD = 2
MB = 1024 * 1024


def _config(quick: bool) -> Any:
    from transformers import LlamaConfig

    # 0.46B parameters: 32k vocabulary (untied head), 1024 wide, 32 layers of GQA + SwiGLU
    return LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8 if quick else 32,
        num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048,
        tie_word_embeddings=False, dtype="float32",
    )


def _status(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    # writing 5 to clear_refs resets VmHWM to the current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")


def _load(kind: str, path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if kind == "single":
        return AutoModelForCausalLM.from_pretrained(path)
    if kind == "tpcompile":
        import tpcompile

        return tpcompile.from_pretrained(path, tp=WORLD)
    from transformers.distributed import DistributedConfig

    return AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=WORLD))


def _worker(rank: int, kind: str, path: str) -> dict[str, int]:
    import transformers  # noqa: F401  (part of the baseline)

    import tpcompile  # noqa: F401

    _reset_peak()  # the baseline includes the (gloo) process group the launcher started
    base = _status("VmRSS")
    model = _load(kind, path)
    loaded = _status("VmRSS")
    with torch.no_grad():
        model(torch.arange(16).view(1, 16))
    return {"peak": _status("VmHWM") - base, "after_load": loaded - base,
            "after_forward": _status("VmRSS") - base}


def _measure(kind: str, path: str, world: int) -> list[dict[str, int]]:
    got = spawn_ranks(_worker, world, (kind, path), timeout_s=1800, collective_timeout_s=600)
    return [got[r] for r in range(world)]


def run(quick: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(_config(quick))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(tmp)
        del model
        weights = sum(f.stat().st_size for f in Path(tmp).glob("*.safetensors"))
        samples: dict[str, list[float]] = {"single": [], "tpcompile": [], "hf": []}
        extra: dict[str, list[dict[str, int]]] = {k: [] for k in samples}
        errors: dict[str, str] = {}
        for _ in range(repeats):  # alternate competitors so drift hits them all alike
            for kind, world in (("single", 1), ("tpcompile", WORLD), ("hf", WORLD)):
                if kind in errors:
                    continue
                try:
                    per_rank = _measure(kind, tmp, world)
                except Exception as err:  # noqa: BLE001 - reported in the table
                    errors[kind] = f"{type(err).__name__}: {str(err).splitlines()[-1][:200]}"
                    continue
                samples[kind].append(max(r["peak"] for r in per_rank) / MB)
                extra[kind].extend(per_rank)
    base = summarize(samples["single"])["median"] if samples["single"] else None
    names = {"single": "single-process from_pretrained", "tpcompile": "tpcompile.from_pretrained tp=2",
             "hf": "HF native TP tp=2"}
    rows = []
    for kind, name in names.items():
        after = [r["after_forward"] / MB for r in extra[kind]]
        note = f"RSS after forward {summarize(after)['median']:.0f} MB" if after else ""
        rows.append(row(name, samples[kind], unit="MB", baseline=base, note=note, error=errors.get(kind)))
    notes = [f"checkpoint: Llama {params / 1e9:.2f}B params, {weights / MB:.0f} MB fp32 safetensors; "
             f"ideal per rank at tp=2 ≈ {weights / WORLD / MB:.0f} MB (half the weights)",
             "peak = max over ranks of VmHWM after one forward pass minus the RSS after imports"]
    notes += [f"{names[k]} failed: {e}" for k, e in errors.items()]
    return section_result("peak resident memory per rank, loading a checkpoint", rows,
                          ratio_of="single-process from_pretrained", notes=notes,
                          config={"params": params, "weights_bytes": weights, "repeats": repeats})
