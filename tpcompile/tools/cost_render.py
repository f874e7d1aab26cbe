"""Rendering the cost model's numbers for ``dump-plan``'s table form.

:func:`~tpcompile.tools.cost.estimate_cost` computes; this module only formats: the
per-module collectives section, the per-step summary, byte sizes, aligned tables.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

__all__ = ["human_bytes", "render_eval", "render_modules", "render_summary", "table"]


def human_bytes(n: float) -> str:
    """``n`` bytes in B / KiB / MiB / GiB / TiB, for tables."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, except the last (bytes), right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        out = [c.ljust(w) for c, w in zip(cells[:-1], widths[:-1], strict=True)]
        return "  ".join([*out, cells[-1].rjust(widths[-1])]).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _ops_text(counts: dict[str, int]) -> str:
    return ", ".join(f"{n} {op.replace('_', '-')}" for op, n in counts.items() if n) or "none"


def kept_whole_lines(groups: list[dict[str, Any]]) -> list[str]:
    """``Plan.kept_whole()``'s rows as text: each name, shape, copies and why."""
    lines = []
    for g in groups:
        copies = f" x{g['count']}" if g["count"] > 1 else ""
        lines.append(f"  kept whole: {g['name']} {list(g['shape'])}{copies}: {g['because']}")
    return lines


def render_modules(cost: dict[str, Any], blocks: list[str]) -> list[str]:
    """The table's collectives section: one line per (collapsed) module, then one block."""
    calls: dict[str, dict[str, dict[str, int]]] = {}
    per_block: dict[str, dict[str, dict[str, int]]] = {}
    first: dict[str, str] = {}
    stats: dict[str, float] = {}  # modules computing split statistics: bytes per token, forward
    for i in cost["issues"]:
        if i["source"] == "loss" or i["source"].startswith("fsdp:"):
            continue
        if i["what"].startswith("partial statistic") and i["phase"] == "forward":
            stats[i["modules"]] = stats.get(i["modules"], 0.0) + i["bytes_per_token"]
        entry = calls.setdefault(i["modules"], {"forward": {}, "backward": {}})
        entry[i["phase"]][i["op"]] = entry[i["phase"]].get(i["op"], 0) + 1
        first.setdefault(i["modules"], i["source"])
        block = next((b for b in blocks if i["source"].startswith(b + ".")), None)
        if block is not None:
            b = per_block.setdefault(block, {"forward": {}, "backward": {}})
            b[i["phase"]][i["op"]] = b[i["phase"]].get(i["op"], 0) + 1
    sharers: dict[str, list[str]] = defaultdict(list)
    for reader, owner in cost["shared_inputs"].items():
        sharers[owner].append(reader.rpartition(".")[2])
    lines = []
    for label, entry in calls.items():
        line = f"{label}: fwd {_ops_text(entry['forward'])}; bwd {_ops_text(entry['backward'])}"
        if sharers.get(first[label]):
            line += f" (input all-reduce shared with {', '.join(sharers[first[label]])})"
        if label in stats:
            line += f" (partial statistics over split features, {stats[label]:g} B/token)"
        lines.append(line)
    if per_block:
        block, entry = next(iter(per_block.items()))
        # a block module's issue is counted once per block of the same structure
        repeats = next(i["count"] for i in cost["issues"] if i["source"].startswith(block + "."))
        lines.append(f"per block: fwd {_ops_text(entry['forward'])}, bwd {_ops_text(entry['backward'])}"
                     f"   (e.g. {block}; {repeats} blocks like it)")
    loss = [i for i in cost["issues"] if i["source"] == "loss"]
    if loss:
        lines.append(f"loss (vocab-parallel cross-entropy): fwd {len(loss)} all-reduce of "
                     f"{'+'.join(str(int(i['bytes_per_token'])) for i in loss)} B/token")
    units = [i for i in cost["issues"] if i["source"].startswith("fsdp:")]
    if units:
        n = len({i["source"] for i in units})
        lines.append(f"FSDP2 dp_shard={cost['dp_shard']}, {n} units: each fwd 1 all-gather-into-tensor; "
                     "bwd 1 all-gather-into-tensor, 1 reduce-scatter-tensor")
    return lines or ["none"]


def _ops(table: dict[str, dict[str, Any]], tokens: int | None, unit: str = "token") -> str:
    parts = []
    for op, v in table.items():
        if not v["count"]:
            continue
        if tokens is None:
            size = f"{human_bytes(v['bytes_per_token'])}/{unit}" + \
                (f" + {human_bytes(v['fixed_bytes'])}" if v["fixed_bytes"] else "")
        else:
            size = human_bytes(v["bytes"])
        parts.append(f"{v['count']} {op} {size}")
    return ", ".join(parts) or "none"


def _unit(cost: dict[str, Any]) -> str:
    """What the step's sizes scale with: ``token`` (B × S ids) or ``sample`` (an image, a clip)."""
    return cost.get("unit", "token")


def render_eval(cost: dict[str, Any]) -> str:
    """The eval step (an evaluation loop's forward) and what the input guard adds."""
    tokens, ev, guard, unit = cost["tokens"], cost["eval_step"], cost["input_guard"], _unit(cost)
    line = (f"eval step (forward only): with labels {_ops(ev['labels'], tokens, unit)}; "
            f"without {_ops(ev['no_labels'], tokens, unit)}")
    if guard["forwards"]:
        g = guard["all_gather"]
        line += (f"; input guard: the first {guard['forwards']} forwards after each switch between training and eval "
                 f"mode add {g['count']} all_gather of {g['bytes']} B ({' and '.join(guard['groups'])} group: "
                 "checksums of the inputs")
        if g.get("training_extra_bytes"):
            line += f"; in training {g['training_extra_bytes']} B more: the random state, for dropout"
        line += ")"
        gen = guard["generate"]
        if gen["count"]:
            line += (f", and every generate() call {gen['count']} all_gather of {gen['bytes_per_input']} B per "
                     f"input tensor and {gen.get('fixed_bytes', 0)} B (tp group: the prompt and the random state)")
    return line


def render_summary(cost: dict[str, Any]) -> str:
    """The one summary line of a step: collectives, bytes, memory per rank."""
    tokens, unit = cost["tokens"], _unit(cost)
    phases = [f"{'fwd' if phase == 'forward' else 'bwd'} {_ops(cost['per_step'][phase], tokens, unit)}"
              for phase in ("forward", "backward")]
    mem = cost["memory_per_rank"]
    flags = "--batch/--seq" if unit == "token" else "--batch"
    act = f"activations need {flags}" if tokens is None else \
        "activations n/a" if mem["activations"] is None else f"activations {human_bytes(mem['activations'])}"
    if tokens is None:
        head = f"per step (bytes per {unit}; {flags} for totals)"
    elif unit == "token":
        head = f"per step, {cost['batch']}×{cost['seq']} tokens per rank"
    else:
        head = f"per step, {cost['batch']} samples per rank"
    return (f"{head}: {'; '.join(phases)}; memory per rank {human_bytes(mem['total'])} = params "
            f"{human_bytes(mem['parameters'])} + grads {human_bytes(mem['gradients'])} + AdamW "
            f"{human_bytes(mem['adamw_states'])} + {act}")
