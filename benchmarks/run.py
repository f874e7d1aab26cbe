"""Run the tpcompile benchmark suite and write ``results/latest.{json,md}``.

    python benchmarks/run.py [--quick] [--only SECTION ...] [--out DIR]

A section is a module in ``benchmarks/`` with ``run(quick: bool) -> dict`` returning
:func:`common.section_result` (rows with name, median, spread, ratio vs a baseline; an
optional ``tables`` list of extra ``{"title", "header", "rows"}`` tables).  To add one,
write the module and list it in ``SECTIONS``; sections run in the listed order, each in
this process (a section that needs several processes spawns them itself).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # sections import each other as top-level modules
    sys.path.insert(0, str(HERE))

from common import host_info  # noqa: E402  (needs the path above)

# name -> (module in benchmarks/, one-line description); a new section plugs in here with
# the same run(quick) interface.
SECTIONS: dict[str, tuple[str, str]] = {
    "train_step": ("train_step", "training-step time vs HF native TP and a DTensor plan"),
    "compile_time": ("compile_time", "plan_model and dump-plan wall time on meta models"),
    "load_memory": ("load_memory", "peak resident memory per rank when loading a checkpoint"),
    "checkpoint_io": ("checkpoint_io", "checkpoint save / translate throughput vs disk limit"),
    "moe_ep": ("moe_ep", "MoE training step: expert parallelism vs experts split over tp vs HF EP"),
    "sequence_parallel": ("sequence_parallel", "saved activations and step time, SP off vs on"),
    "activation_memory": ("activation_memory", "saved activations: plain, checkpointing, offloading, both"),
    "cost_memory": ("cost_memory", "dump-plan's memory estimate vs a training step's measured peak"),
    "state_dict_cost": ("state_dict_cost", "time and memory of model.state_dict() at tp=2"),
    "context_parallel": ("context_parallel", "saved activations and step time per rank, cp=1/2/4 at 4k and 8k"),
    "fp8": ("fp8", "FP8 vs bf16 vs fp32 at dp2 x tp2: weight all-gather bytes, memory, step time, loss curve"),
    "pipeline": ("pipeline", "pp=2 x dp2 (gpipe, 1f1b, interleaved) vs dp4, tp2 x dp2: step time, memory, bubble; "
                 "every schedule's bubble at pp=2 (world 2)"),
    "layout_rank": ("layout_rank", "layout planner vs measured steps: Spearman, top-1, memory per rank"),
    "dropout_masks": ("dropout_masks", "training step with dropout: masks drawn whole (one process's) vs local, tp=2"),
    "soak": ("soak", "1,000 steps at dp2 x tp2 with a checkpoint every 100: memory, hooks, file descriptors flat"),
}


def _fmt(value: float | None, unit: str) -> str:
    return "—" if value is None else f"{value:.4g} {unit}"


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    def esc(cell: str) -> str:
        return str(cell).replace("|", "\\|")

    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(esc(c) for c in r) + " |" for r in rows]
    return out


def render_section(name: str, res: dict[str, Any]) -> list[str]:
    """Markdown for one section's result (or its failure)."""
    lines = [f"## {name}: {res.get('title', '')}", ""]
    if res.get("date"):
        lines += [f"_{res.get('mode', '?')} run, {res['date']}_", ""]
    if "error" in res and not res.get("rows"):
        return [*lines, f"**FAILED**: {res['error']}", ""]
    header = ["benchmark", "median", "spread (min–max)", "n", "ratio", "note"]
    body = []
    for r in res["rows"]:
        unit = r.get("unit", "s")
        spread = (f"{_fmt(r['min'], unit)} – {_fmt(r['max'], unit)}"
                  if r.get("min") is not None else "—")
        ratio = f"{r['ratio']:.2f}×" if r.get("ratio") is not None else "—"
        body.append([r["name"], _fmt(r.get("median"), unit), spread, str(r.get("n", 0)),
                     ratio, r.get("note", "")])
    lines += _md_table(header, body)
    lines += ["", f"ratio = median / {res.get('ratio_of', 'baseline')}", ""]
    for table in res.get("tables", []):
        lines += [f"**{table['title']}**", "", *_md_table(table["header"], table["rows"]), ""]
    lines += [f"- {n}" for n in res.get("notes", [])]
    load = res.get("loadavg_1m")
    load_text = f"; host 1-min load average {load[0]:.1f} → {load[1]:.1f}" if load else ""
    lines += ["", f"section wall time: {res.get('elapsed_s', 0):.1f} s{load_text}", ""]
    return lines


def render(report: dict[str, Any]) -> str:
    """The whole report as markdown."""
    host = report["host"]
    lines = [
        "# tpcompile benchmarks", "",
        f"`{report['command']}` — {host['date']}, mode **{report['mode']}**", "",
        f"host: {host['cpu']}, {host['cores']} cores ({host['usable_cores']} usable); "
        f"Python {host['python']}, torch {host['torch']}, transformers {host['transformers']}; "
        f"{host['platform']}", "",
    ]
    for name, res in report["sections"].items():
        lines += render_section(name, res)
    return "\n".join(lines).rstrip() + "\n"


def run_section(name: str, quick: bool) -> dict[str, Any]:
    """Import and run one section; a crash becomes an ``error`` entry, not an abort."""
    module_name, _ = SECTIONS[name]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    try:
        res = importlib.import_module(module_name).run(quick)
    except Exception as exc:
        traceback.print_exc()
        res = {"title": SECTIONS[name][1], "rows": [],
               "error": f"{type(exc).__name__}: {exc}".strip()}
    res["elapsed_s"] = round(time.perf_counter() - t0, 2)
    # Other work on the host skews timings; the 1-minute load average says how much.
    res["loadavg_1m"] = [round(load_before[0], 2), round(os.getloadavg()[0], 2)]
    return res


def _carry_over(report: dict[str, Any], previous: Path) -> None:
    """Keep sections this run skipped (``--only``) from the previous ``latest.json``.

    Each carried section keeps its own ``date`` and ``mode``, so ``latest`` is always the
    newest result of every section rather than only of the last command.
    """
    try:
        old = json.loads(previous.read_text(encoding="utf-8"))["sections"]
    except (OSError, ValueError, KeyError, TypeError):
        return
    ran = report["sections"]
    merged = {n: ran.get(n) or old.get(n) for n in [*SECTIONS, *old] if n in ran or n in old}
    report["sections"] = merged


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller models, fewer repeats")
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), metavar="SECTION",
                        help=f"run only these sections (of: {', '.join(SECTIONS)})")
    parser.add_argument("--out", type=Path, default=HERE / "results",
                        help="output directory (default benchmarks/results)")
    args = parser.parse_args(argv)

    names = [n for n in SECTIONS if not args.only or n in args.only]
    report: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/run.py", *(argv if argv is not None
                                                              else sys.argv[1:])]),
        "mode": "quick" if args.quick else "full",
        "host": host_info(),
        "sections": {},
    }
    failed = []
    for name in names:
        print(f"== {name} ({'quick' if args.quick else 'full'})", flush=True)
        res = run_section(name, args.quick)
        res.update(date=report["host"]["date"], mode=report["mode"])
        report["sections"][name] = res
        if "error" in res:
            failed.append(name)
        print("\n".join(render_section(name, res)), flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    _carry_over(report, args.out / "latest.json")
    (args.out / "latest.json").write_text(json.dumps(report, indent=2, default=str) + "\n",
                                          encoding="utf-8")
    (args.out / "latest.md").write_text(render(report), encoding="utf-8")
    print(f"wrote {args.out / 'latest.json'} and {args.out / 'latest.md'}")
    if failed:
        print(f"failed sections: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
