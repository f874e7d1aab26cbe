"""Section ``compile_time``: how long tpcompile takes to plan big models.

* ``tpcompile.plan_model(model, tp=8)`` on meta-device Llama presets (8B, 70B, 405B),
  split into capture and analysis from ``plan.stats``; the presets are interleaved
  round by round, the meta model is rebuilt each time (its build is not timed in).
* ``python -m tpcompile dump-plan llama-405b --tp 8`` as a subprocess: wall time
  including interpreter start and imports, what a user waits for.

Ratios are against the targets: plan_model < 10 s for 405B, dump-plan < 15 s.
"""

from __future__ import annotations

import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

from common import row, section_result

PRESETS = {"llama": "8B", "llama-70b": "70B", "llama-405b": "405B"}
TP = 8
PLAN_TARGET_S = 10.0
DUMP_TARGET_S = 15.0
DUMP_CMD = [sys.executable, "-m", "tpcompile", "dump-plan", "llama-405b", "--tp", str(TP)]
IMPORT_CMD = [sys.executable, "-c", "import tpcompile.tools.cli, tpcompile.api, tpcompile.tools.presets"]
DUMP_TIMEOUT_S = 120.0


def _plan_once(preset: str) -> dict[str, float]:
    """Build the preset on meta, plan it; seconds for build, plan and its two stages."""
    from tpcompile import plan_model
    from tpcompile.tools.presets import build_meta_model

    t0 = time.perf_counter()
    model = build_meta_model(preset)
    t1, c1 = time.perf_counter(), time.process_time()
    plan = plan_model(model, tp=TP)
    t2, c2 = time.perf_counter(), time.process_time()
    return {"build": t1 - t0, "plan": t2 - t1, "cpu": c2 - c1, "capture": plan.stats["capture_s"],
            "analysis": plan.stats["analysis_s"], "blocks": len(plan.blocks),
            "traced": plan.stats["traced_blocks"], "passes": plan.stats["analysis_passes"]}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _subprocess_once(cmd: list[str]) -> tuple[float, float, str]:
    """Wall and CPU seconds of one subprocess, and the ``time: ...`` line it printed."""
    t0, c0 = time.perf_counter(), _children_cpu()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=DUMP_TIMEOUT_S,
                          check=False)
    wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} exited {proc.returncode}: "
                           f"{proc.stderr.strip()[-500:]}")
    timing = re.search(r"^time: .*$", proc.stdout, flags=re.MULTILINE)
    return wall, cpu, timing.group(0) if timing else ""


def run(quick: bool) -> dict[str, Any]:
    """Median of 3 (quick: 2) of each measurement, interleaved across presets."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    repeats = 2 if quick else 3
    # The first plan in a process pays one-time costs (imports, torch.export set-up);
    # it is reported on its own so the medians below are the steady state.
    cold = _plan_once("llama")
    samples: dict[str, list[dict[str, float]]] = {p: [] for p in PRESETS}
    dump: list[tuple[float, float, str]] = []
    imports: list[tuple[float, float, str]] = []
    names = list(PRESETS)
    for r in range(repeats):
        for preset in names[r % len(names):] + names[: r % len(names)]:  # rotate the order
            samples[preset].append(_plan_once(preset))
        dump.append(_subprocess_once(DUMP_CMD))
        imports.append(_subprocess_once(IMPORT_CMD))

    rows = [row(f"plan_model llama (8B) tp={TP}, first call in process", [cold["plan"]],
                baseline=PLAN_TARGET_S, note="cold: includes one-time imports/set-up")]
    for preset, size in PRESETS.items():
        runs = samples[preset]
        last = runs[-1]
        build = statistics.median(r["build"] for r in runs)
        cpu = statistics.median(r["cpu"] for r in runs)
        rows.append(row(f"plan_model {preset} ({size}) tp={TP}", [r["plan"] for r in runs],
                        baseline=PLAN_TARGET_S,
                        note=f"{last['blocks']} blocks traced as "
                             f"{sum(last['traced'].values())}; "
                             f"{last['passes']} analysis passes; CPU {cpu:.2f} s; "
                             f"meta build {build:.2f} s (not included)"))
        for stage in ("capture", "analysis"):
            rows.append(row(f"  ↳ {stage}", [r[stage] for r in runs],
                            note="plan.stats" if stage == "capture" else
                            "plan.stats: rules, partition, fix-ups, build_plan"))
    dump_cpu = statistics.median(d[1] for d in dump)
    rows.append(row(f"dump-plan llama-405b --tp {TP} (subprocess)", [d[0] for d in dump],
                    baseline=DUMP_TARGET_S,
                    note=f"incl. interpreter start; CPU {dump_cpu:.2f} s; its own report "
                         f"(last run): {dump[-1][2].removeprefix('time: ')}"))
    rows.append(row("  ↳ interpreter start + imports (python -c 'import tpcompile.tools.cli, ...')",
                    [d[0] for d in imports],
                    note=f"the floor of any dump-plan run; CPU "
                         f"{statistics.median(d[1] for d in imports):.2f} s"))
    verdicts = []
    big = next(r for r in rows if r["name"].startswith("plan_model llama-405b"))
    dump_row = next(r for r in rows if r["name"].startswith("dump-plan"))
    for label, r, target in (("405B plan_model", big, PLAN_TARGET_S),
                             ("dump-plan", dump_row, DUMP_TARGET_S)):
        ok = r["median"] < target
        verdicts.append(f"{label}: median {r['median']:.2f} s vs target < {target:g} s → "
                        f"{'met' if ok else 'MISSED'}")
    return section_result(
        f"Compile time on the meta device (tp={TP})", rows,
        ratio_of=f"target ({PLAN_TARGET_S:g} s for plan_model, {DUMP_TARGET_S:g} s for dump-plan)",
        notes=verdicts, config={"tp": TP, "repeats": repeats, "presets": PRESETS,
                                "dump_cmd": " ".join(["python", *DUMP_CMD[1:]])})
