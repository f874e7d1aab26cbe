"""The CLI's layout commands: ``dump-plan MODEL --auto`` and ``calibrate``.

``dump-plan --auto --gpus N --hardware NAME|FILE.json --seq S [--batch B]`` ranks the
layouts that fit N devices (:func:`~tpcompile.tools.layout.plan_layout`); ``calibrate``
measures this machine into a hardware profile (:func:`~tpcompile.tools.calibration.calibrate`).
:mod:`tpcompile.tools.cli` owns the parser; this module adds the flags and runs them.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from torch import nn

from ..errors import TPError

__all__ = ["add_auto_flags", "add_calibrate", "auto_conflicts", "positive_int", "run_auto"]

_AUTO_ONLY = ("gpus", "gpus_per_node", "hardware", "dtype", "top")


def positive_int(text: str) -> int:
    """argparse's type for a count (degrees, processes): an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_auto_flags(dump: argparse.ArgumentParser) -> None:
    """dump-plan's ``--auto`` and the flags only it reads."""
    dump.add_argument("--auto", action="store_true",
                      help="rank the layouts (tp, pp + schedule, cp, ep, dp_shard, dp_replicate, SP, activation "
                           "checkpointing; FP8 too with --fp8) that fit --gpus devices by predicted step time; "
                           "--batch is then the global batch (default: --gpus sequences)")
    dump.add_argument("--gpus", type=positive_int, help="with --auto: devices of the job")
    dump.add_argument("--gpus-per-node", type=positive_int, help="with --auto: default the hardware profile's (8)")
    dump.add_argument("--hardware", metavar="NAME|FILE.json",
                      help="with --auto: h100-80gb, h200, a100-80gb, b200, cpu, or a profile JSON "
                           "(python -m tpcompile calibrate --out FILE.json)")
    dump.add_argument("--dtype", choices=("bf16", "fp16", "fp32"),
                      help="with --auto: the compute dtype (default bf16)")
    dump.add_argument("--top", type=positive_int, help="with --auto: layouts to list (default 10)")


def auto_conflicts(args: argparse.Namespace) -> str | None:
    """Why the flags given cannot run (None: they can)."""
    if not args.auto:
        given = [f"--{k.replace('_', '-')}" for k in _AUTO_ONLY if getattr(args, k) is not None]
        return f"{', '.join(given)}: only read with --auto" if given else None
    fixed = [flag for flag, on in (("--tp", args.tp is not None), ("--dp-shard", args.dp_shard != 1),
                                   ("--cp", args.cp != 1), ("--sequence-parallel", args.sequence_parallel), ("--pp", args.pp != 1), ("--table", args.table), ("--pp-schedule", args.pp_schedule is not None),
                                   ("--pp-microbatches", args.pp_microbatches is not None),
                                   ("--pp-virtual", args.pp_virtual is not None)) if on]
    if fixed:
        return f"--auto searches the layout itself: drop {', '.join(fixed)}"
    missing = [flag for flag, v in (("--gpus", args.gpus), ("--hardware", args.hardware), ("--seq", args.seq))
               if v is None]
    return f"--auto needs {', '.join(missing)}" if missing else None


def run_auto(model: nn.Module, name: str, args: argparse.Namespace) -> int:
    """Rank the layouts and print them (table or JSON); returns the exit code."""
    from .layout import plan_layout

    try:
        report = plan_layout(model, gpus=args.gpus, hardware=args.hardware, batch=args.batch, seq=args.seq,
                             gpus_per_node=args.gpus_per_node, dtype=args.dtype or "bf16", top=args.top or 10,
                             fp8=args.fp8)
    except TPError as exc:
        print(f"tpcompile: error: {exc}", file=sys.stderr)
        return 2
    report.model = name or report.model
    print(json.dumps(report.to_dict(), indent=2) if args.format == "json" else report.render())
    return 0


def add_calibrate(sub: Any) -> None:
    cal = sub.add_parser(
        "calibrate",
        help="measure this machine into a hardware profile (matmul FLOP/s, collective bandwidth and latency)",
        description="Time torch.mm per dtype and all-reduce / all-gather / all-to-all / p2p over --procs local "
        "gloo processes; print the profile and write it as JSON for dump-plan --auto --hardware FILE.json.",
    )
    cal.add_argument("--out", metavar="FILE.json", help="write the profile here")
    cal.add_argument("--procs", type=positive_int, default=2, help="local processes to measure links over (default 2)")
    cal.set_defaults(handler=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    from .calibration import calibrate
    from .cost_render import human_bytes
    from .hardware import save_profile

    try:
        hw = calibrate(procs=args.procs)
    except TPError as exc:
        print(f"tpcompile: error: {exc}", file=sys.stderr)
        return 2
    rates = ", ".join(f"{d} {r / 1e9:,.2f}" for d, r in hw.achievable_flops.items())
    print(f"matmul GFLOP/s: {rates}")
    for op, m in hw.measurements["collectives"].items():
        print(f"{op}: bus bandwidth {m['bus_bandwidth'] / 1e9:.3f} GB/s, latency {m['latency'] * 1e6:,.0f} us "
              f"per step")
    print(f"memory per process: {human_bytes(hw.memory_bytes)}; links (from the all-reduce): "
          f"{hw.intra_node.bandwidth / 1e9:.3f} GB/s, {hw.intra_node.latency * 1e6:,.0f} us")
    if args.out:
        save_profile(hw, args.out)
        print(f"wrote {args.out} (use: dump-plan MODEL --auto --hardware {args.out} ...)")
    return 0
