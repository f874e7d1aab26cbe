"""``dump-plan --auto``'s table: the top layouts and why the others lost."""

from __future__ import annotations

from typing import Any

from .cost_render import human_bytes, table

__all__ = ["render_report"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.0f}" if seconds >= 0.01 else f"{seconds * 1e3:.2f}"


def _exposed(t: dict[str, float]) -> float:
    return t["tp"] + t["cp"] + t["ep"] + t["fsdp_exposed"] + t["p2p"]


def _memory_text(mem: dict[str, float]) -> str:
    return (f"params {human_bytes(mem['parameters'])} + grads {human_bytes(mem['gradients'])} + AdamW "
            f"{human_bytes(mem['optimizer'])} + FSDP buffers {human_bytes(mem['fsdp_buffers'])} + activations "
            f"{human_bytes(mem['activations'])}")


def render_report(report: Any) -> str:
    """The report as text: one row per layout (fastest first), then the losers' reasons."""
    head = (f"{report.model} on {report.gpus} x {report.hardware} ({report.gpus_per_node} per node), batch "
            f"{report.batch} x seq {report.seq}, {report.dtype}: {report.priced:,} layouts priced, "
            f"{report.fitting:,} fit in {human_bytes(report.usable_memory)} per device")
    out = [head, ""]
    best = report.best
    if best is not None:
        header = ["#", "layout", "memory/rank", "step ms", "compute", "exposed comm", "bubble", "MFU",
                  "tok/s/GPU", "vs best"]
        rows = []
        for i, p in enumerate(report.ranked, 1):
            t = p.time
            slower = t["total"] / best.time["total"] - 1
            rows.append([str(i), p.layout.label(), human_bytes(p.memory["total"]), _ms(t["total"]),
                         _ms(t["compute"]), _ms(_exposed(t)), _ms(t["bubble"]), f"{p.mfu:.1%}",
                         f"{p.tokens_per_s / report.gpus:,.0f}", "best" if i == 1 else f"+{slower:.1%}"])
        out += table(header, rows)
        t = best.time
        kwargs = {k: v for k, v in best.layout.parallelize_kwargs().items()
                  if k == "tp" or not (v is None or v is False or (type(v) is int and v == 1))}
        out += ["", f"best: {best.layout.label()}: parallelize("
                    + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")",
                f"  memory per rank {human_bytes(best.memory['total'])} = {_memory_text(best.memory)}",
                f"  step {_ms(t['total'])} ms = compute {_ms(t['compute'])} + tp {_ms(t['tp'])} + cp {_ms(t['cp'])}"
                f" + ep {_ms(t['ep'])} + FSDP exposed {_ms(t['fsdp_exposed'])} + p2p {_ms(t['p2p'])} + bubble "
                f"{_ms(t['bubble'])} (ms)"
                + (f"; across nodes: {', '.join(best.inter_node)}" if best.inter_node else "")]
    out += ["", "why the others lost:"]
    if report.fitting > len(report.ranked):
        worst = report.ranked[-1].time["total"] / best.time["total"] - 1 if best else 0.0
        out.append(f"  {report.fitting - len(report.ranked):,} more layouts fit but are slower than #"
                   f"{len(report.ranked)} (by more than {worst:.1%})")
    if report.unfit_count:
        out.append(f"  {report.unfit_count:,} layouts do not fit in memory; the fastest of them:")
        for p in report.unfit:
            vs = f" ({p.time['total'] / best.time['total'] - 1:+.1%} vs best)" if best else ""
            out.append(f"    {p.layout.label()}: needs {human_bytes(p.memory['total'])} of "
                       f"{human_bytes(report.usable_memory)} ({_memory_text(p.memory)}), would take "
                       f"{_ms(p.time['total'])} ms{vs}")
    for why, n in sorted(report.refused.items(), key=lambda kv: -kv[1]):
        out.append(f"  not admitted ({n}): {why}")
    out += [f"note: {n}" for n in report.notes]
    out.append(f"time: {report.seconds:.1f} s; model and assumptions: docs/layout.md")
    return "\n".join(out)
