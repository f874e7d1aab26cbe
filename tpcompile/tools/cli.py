"""Command-line interface: ``python -m tpcompile`` / ``tpcompile``.

Subcommands:

* ``dump-plan NAME --tp 8`` plans a model built on the meta device (no weights, no
  process group) and prints the plan as a table (repeated layers collapsed into one
  row, collectives per block, per-rank bytes, timings) or as the plan's JSON.
* ``demo --tp 2`` runs the whole story on local CPU processes: a tiny Llama is
  transformed, then its logits, training losses and greedy generations are compared
  against a single-process copy of the same model.
* ``verify MODEL --tp 2`` checks a shrunk copy of any model the same way, per module.
* ``dump-plan NAME --auto --gpus N --hardware h100-80gb --seq S`` ranks the layouts that
  fit N devices; ``calibrate`` measures this machine into a hardware profile
  (:mod:`tpcompile.tools.cli_layout`).

Exit codes: 0 success, 1 demo / verify mismatch (or a transform error in verify), 2 user
error (unknown preset, bad config, a model or ``tp`` the compiler cannot split); the
message is printed, not a traceback.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedConfig

from ..errors import TPError
from ..plan import Plan
from .cli_layout import add_auto_flags, add_calibrate, auto_conflicts, positive_int
from .cost_render import human_bytes
from .cost_render import table as _table

__all__ = ["build_parser", "main"]

_EXIT_OK = 0
_EXIT_MISMATCH = 1
_EXIT_USAGE = 2



# ---------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``tpcompile`` command (exposed so tests can freeze it)."""
    parser = argparse.ArgumentParser(
        prog="tpcompile",
        description="Compile Hugging Face transformers models into tensor-parallel models.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    dump = sub.add_parser(
        "dump-plan",
        help="plan a model on the meta device and print the plan",
        description="Build a model on the meta device, plan it for --tp ranks and print the plan.",
    )
    dump.add_argument("name", nargs="?", help="model preset name (optional with --model)")
    dump.add_argument("--tp", type=positive_int, help="tensor-parallel degree (default 8)")
    dump.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    dump.add_argument("--model", metavar="DIR_OR_CONFIG_JSON",
                      help="a local model directory or config.json instead of a preset")
    dump.add_argument("--layers", type=positive_int, help="override the number of layers")
    dump.add_argument("--table", action="store_true",
                      help="print the HF <-> per-rank translation table instead of the plan")
    dump.add_argument("--dp-shard", type=positive_int, default=1,
                      help="FSDP2 shard degree on top of --tp, for the cost section (default 1: no FSDP)")
    dump.add_argument("--batch", type=positive_int,
                      help="sequences per step per rank, for the cost section (with --auto: the global batch)")
    dump.add_argument("--seq", type=positive_int, help="sequence length, for the cost section")
    dump.add_argument("--cp", type=positive_int, default=1,
                      help="price context parallelism over this many ranks (parallelize(cp=...))")
    dump.add_argument("--sequence-parallel", action="store_true",
                      help="plan with sequence_parallel=True (the residual stream split by tokens over --tp; "
                           "with --pp: the hidden state crosses stages split)")
    dump.add_argument("--fp8", action="store_true",
                      help="price FP8 projections (fp8=True): their amax all-reduces and, with --dp-shard, "
                           "FSDP2's FP8 all-gathers (1 byte per element) and their scale all-reduce; with --auto: "
                           "search FP8 layouts too")
    _add_pipeline_flags(dump)
    add_auto_flags(dump)
    dump.set_defaults(handler=_cmd_dump_plan)

    tr = sub.add_parser(
        "translate",
        help="convert a tpcompile checkpoint into a Hugging Face directory",
        description="Stream a checkpoint written by tpcompile (full, sharded or local) into an "
        "HF safetensors directory that transformers' from_pretrained loads.",
    )
    tr.add_argument("src", help="checkpoint directory written by tpcompile")
    tr.add_argument("out", help="output directory (must not exist unless --overwrite)")
    tr.add_argument("--dtype", choices=sorted(_DTYPES), help="cast floating-point tensors")
    tr.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    tr.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    tr.add_argument("--quiet", action="store_true", help="no progress bar")
    tr.set_defaults(handler=_cmd_translate)

    demo = sub.add_parser(
        "demo",
        help="transform a tiny Llama on local CPU processes and check it against the original",
        description="Spawn --tp gloo processes, transform a tiny Llama and compare logits, "
        "training losses and greedy generations with a single-process reference.",
    )
    demo.add_argument("--tp", type=positive_int, default=2, help="number of processes (default 2)")
    demo.add_argument("--steps", type=positive_int, default=5, help="training steps (default 5)")
    demo.set_defaults(handler=_cmd_demo)
    _add_verify(sub)
    add_calibrate(sub)
    return parser


def _add_pipeline_flags(dump: argparse.ArgumentParser) -> None:
    """dump-plan's pipeline flags: parallelize's ``pp``, ``pp_schedule``, ``pp_microbatches``,
    ``pp_virtual``, with the same defaults."""
    dump.add_argument("--pp", type=positive_int, default=1,
                      help="price pipeline parallelism over this many stages' ranks (parallelize(pp=...)): "
                           "a stage table, p2p bytes, bubble, memory per pp rank")
    # a string, not argparse choices: a bad name is the same TPError parallelize raises
    dump.add_argument("--pp-schedule", metavar="NAME",
                      help="gpipe, 1f1b, interleaved_1f1b, zero_bubble, zbv or dualpipev (default: "
                           "interleaved_1f1b when the blocks and microbatches allow it, else 1f1b)")
    dump.add_argument("--pp-microbatches", type=positive_int, help="microbatches per step (default 2 x pp)")
    dump.add_argument("--pp-virtual", type=positive_int,
                      help="stages per rank of the interleaved / zero-bubble schedules (default 2)")


def _add_verify(sub: Any) -> None:
    ver = sub.add_parser(
        "verify",
        help="check a shrunk copy of a model split over --tp local CPU processes",
        description="Shrink MODEL (same classes and head/expert structure, sizes keeping their "
        "relation to --tp), transform it on --tp gloo processes and compare every module's "
        "forward output and gradients, the loss and greedy generate against the unsharded copy. "
        "Exit code 0 only if everything matches.",
    )
    ver.add_argument("model", help="a preset name, a local HF model directory or a config.json")
    ver.add_argument("--tp", type=positive_int, default=2, help="number of processes (default 2)")
    ver.add_argument("--tol", type=float, default=1e-5,
                     help="pass when the absolute or the relative difference is within it (default 1e-5)")
    ver.add_argument("--layers", type=positive_int, default=2,
                     help="layers of the shrunk model; one of each layer kind is kept anyway (default 2)")
    ver.add_argument("--no-generate", action="store_true", help="skip the greedy generate comparison")
    ver.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    ver.add_argument("--attn", choices=("eager", "sdpa"),
                     help="attention implementation (default: the model's own default)")
    ver.add_argument("--sequence-parallel", action="store_true",
                     help="transform with sequence_parallel=True (norms and residuals split by tokens)")
    ver.add_argument("--cp", type=positive_int, default=1,
                     help="context parallelism: parallelize(tp=--tp, cp=CP) on tp x cp processes, each "
                     "sequence split over cp ranks, modules compared on each rank's positions (default 1)")
    ver.add_argument("--pp", type=positive_int, default=1,
                     help="pipeline parallelism: parallelize(tp=--tp, pp=PP) on tp x pp processes, one "
                     "pipeline_step; the loss, every gradient and every module's output (microbatches "
                     "joined) compared (default 1)")
    ver.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                     help="the shrunk model's dtype; in float64 rounding moves results by ~1e-16, so "
                     "with --tol 1e-10 a mismatch is the split's, not the summation order's (default float32)")
    # Test hook (see the README): perturb one module's output on one rank after transform.
    ver.add_argument("--inject-fault", metavar="MODULE", help=argparse.SUPPRESS)
    ver.set_defaults(handler=_cmd_verify)


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


# ---------------------------------------------------------------------------------
# dump-plan: building the model
# ---------------------------------------------------------------------------------


class _UsageError(Exception):
    """A mistake in what the user asked for; printed without a traceback."""


def _fail(message: str) -> int:
    print(f"tpcompile: error: {message}", file=sys.stderr)
    return _EXIT_USAGE


def _config_with_layers(config: PreTrainedConfig, layers: int) -> PreTrainedConfig:
    """``config`` rebuilt with ``layers`` layers.

    Rebuilt from its dict rather than mutated, so derived per-layer fields stay
    consistent; ``layer_types`` is truncated (keeping the published pattern) or dropped
    so the config regenerates it for a deeper model.
    """
    data = config.to_dict()
    key = (type(config).attribute_map or {}).get("num_hidden_layers", "num_hidden_layers")
    data[key] = layers
    types = data.get("layer_types")
    if isinstance(types, list):
        if len(types) >= layers:
            data["layer_types"] = types[:layers]
        else:
            data.pop("layer_types")
    return type(config).from_dict(data)


def _build_model(args: argparse.Namespace) -> nn.Module:
    """The meta-device model the user named (preset or local config)."""
    from . import presets

    if args.name and not args.model and Path(args.name).expanduser().exists():
        args.model, args.name = args.name, None  # a local directory or config.json, as verify takes it
    if args.model:
        if args.name:
            print(f"tpcompile: note: --model given, preset {args.name!r} ignored", file=sys.stderr)
        try:
            config = presets.load_config_path(args.model)
        except (FileNotFoundError, ValueError) as exc:
            raise _UsageError(str(exc)) from None
        if args.layers:
            config = _config_with_layers(config, args.layers)
        return presets.build_meta_model_from_config(config)
    if not args.name:
        raise _UsageError("dump-plan needs a preset NAME or --model DIR_OR_CONFIG_JSON; "
                          f"presets: {', '.join(presets.list_presets())}")
    try:
        preset = presets.get_preset(args.name)
    except KeyError as exc:
        raise _UsageError(str(exc.args[0])) from None
    overrides = {"num_hidden_layers": args.layers} if args.layers else {}
    return presets.build_meta_model(preset, **overrides)


def _cmd_dump_plan(args: argparse.Namespace) -> int:
    from ..plan import plan_model

    t0 = time.perf_counter()
    conflict = auto_conflicts(args)
    if conflict:
        return _fail(conflict)
    if args.auto:  # the layout search: tp, pp, cp, ... chosen, not given
        from .cli_layout import run_auto

        try:
            return run_auto(_build_model(args), args.name or args.model, args)
        except _UsageError as exc:
            return _fail(str(exc))
    args.tp = args.tp or 8
    try:
        _check_pipeline_flags(args)  # before the model is built: a bad flag fails fast
        model = _build_model(args)
        t_built = time.perf_counter()
        plan = plan_model(model, args.tp, sequence_parallel=args.sequence_parallel and args.tp > 1)
    except _UsageError as exc:
        return _fail(str(exc))
    except TPError as exc:
        return _fail(str(exc))
    t_planned = time.perf_counter()
    for warning in plan.warnings:
        print(f"tpcompile: warning: {warning}", file=sys.stderr)
    if args.table:
        from ..plan import build_table

        table = build_table(model, plan)
        _write(table.to_json(indent=2) if args.format == "json" else _render_translation(table))
        return _EXIT_OK
    from .cost import estimate_cost

    try:  # what one training step costs per rank (collectives as executed, memory)
        cost = estimate_cost(model, plan, batch=args.batch, seq=args.seq, dp_shard=args.dp_shard, fp8=args.fp8,
                             cp=args.cp)
        pipe = _estimate_pipeline(model, plan, args)
    except TPError as exc:
        return _fail(str(exc))
    if args.format == "json":
        extra = {"pipeline": pipe} if pipe is not None else {}
        print(json.dumps({**plan.to_dict(), "cost": cost, **extra}, indent=2))
        return _EXIT_OK
    timing = {"build_s": t_built - t0, "plan_s": t_planned - t_built}
    dtypes = {name: p.dtype.itemsize for name, p in model.named_parameters(remove_duplicate=False)}
    text = _render_table(plan, dtypes, timing, start=t0, cost=cost)
    if pipe is not None:
        from .cost_pipeline import render_pipeline

        text += "\n\n" + "\n".join(render_pipeline(pipe))
    _write(text)
    return _EXIT_OK


def _check_pipeline_flags(args: argparse.Namespace) -> None:
    """The pipeline flags name a pipeline ``parallelize`` would build."""
    given = [f for f, v in (("--pp-schedule", args.pp_schedule), ("--pp-microbatches", args.pp_microbatches),
                            ("--pp-virtual", args.pp_virtual)) if v is not None]
    if args.pp == 1:
        if given:
            raise _UsageError(f"{', '.join(given)}: pipeline options need --pp P (P >= 2) as well")
        return
    if args.table:
        raise _UsageError("--table prints the HF ⇄ per-rank translation table; drop --pp or --table")
    if args.pp_schedule is not None:
        from ..plan.stages import schedule_spec

        try:
            schedule_spec(args.pp_schedule)
        except TPError as exc:
            raise _UsageError(f"--pp-schedule: {exc}") from None


def _estimate_pipeline(model: nn.Module, plan: Plan, args: argparse.Namespace) -> dict[str, Any] | None:
    """The pipeline section (``--pp > 1``), or None."""
    if args.pp == 1:
        return None
    from .cost_pipeline import estimate_pipeline

    return estimate_pipeline(model, plan, pp=args.pp, schedule=args.pp_schedule, microbatches=args.pp_microbatches,
                             virtual=args.pp_virtual or 2, batch=args.batch, seq=args.seq,
                             dp_shard=args.dp_shard, fp8=args.fp8, cp=args.cp)


def _write(text: str) -> None:
    """Print, falling back to ASCII arrows on terminals that cannot encode them."""
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except UnicodeEncodeError:
        text = text.replace("→", "->")
    print(text)


# ---------------------------------------------------------------------------------
# dump-plan: collapsing repeated layers
# ---------------------------------------------------------------------------------

# The layer index is the first purely numeric component of a dotted name.
_INDEX_RE = re.compile(r"(?:^|(?<=\.))(\d+)(?=\.|$)")


def _split_index(fqn: str) -> tuple[str, int | None]:
    """``model.layers.3.mlp`` → (``model.layers.{}.mlp``, 3); no index → (fqn, None)."""
    match = _INDEX_RE.search(fqn)
    if match is None:
        return fqn, None
    skeleton = fqn[: match.start()] + "{}" + fqn[match.end():]
    return skeleton, int(match.group(1))


def _format_indices(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5] → ``{0..2,5}``: runs of consecutive indices become ranges."""
    parts: list[str] = []
    ordered = sorted(set(indices))
    start = prev = ordered[0]
    for value in [*ordered[1:], None]:
        if value is not None and value == prev + 1:
            prev = value
            continue
        parts.append(str(start) if start == prev else f"{start}..{prev}")
        if value is not None:
            start = prev = value
    return "{" + ",".join(parts) + "}"


@dataclass
class _Group:
    """Items whose names differ only by the layer index and whose signature matches."""

    skeleton: str
    first: str
    indices: list[int]
    members: list[str]

    def label(self) -> str:
        if len(self.members) == 1:
            return self.first
        return self.skeleton.replace("{}", _format_indices(self.indices), 1)


def _collapse(items: Iterable[tuple[str, Any]]) -> list[_Group]:
    """Group ``(fqn, signature)`` pairs, keeping first-seen order."""
    groups: dict[tuple[str, Any], _Group] = {}
    for fqn, signature in items:
        skeleton, index = _split_index(fqn)
        # Unindexed names never collapse: key them by the full name.
        key = (skeleton if index is not None else fqn, signature)
        group = groups.get(key)
        if group is None:
            groups[key] = _Group(skeleton, fqn, [] if index is None else [index], [fqn])
        else:
            group.members.append(fqn)
            if index is not None:
                group.indices.append(index)
    return list(groups.values())


# ---------------------------------------------------------------------------------
# dump-plan: the table
# ---------------------------------------------------------------------------------


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _param_rows(plan: Plan, dtypes: dict[str, int]) -> tuple[list[list[str]], int]:
    """One row per collapsed parameter group, and the per-rank byte total."""

    def signature(fqn: str) -> tuple[Any, ...]:
        p = plan.params[fqn]
        return (p.role.value, tuple(p.global_shape), tuple(p.local_shape), p.layout,
                dtypes.get(fqn, 4), len(p.tied_to), tuple(p.compute_shape()))

    rows: list[list[str]] = []
    total = 0
    for group in _collapse((fqn, signature(fqn)) for fqn in plan.params):
        p = plan.params[group.first]
        # plan.params holds each tied tensor once (its aliases in tied_to): bytes once.
        size = _numel(p.local_shape) * dtypes.get(group.first, 4)
        total += size * len(group.members)
        name = group.label()
        if p.tied_to:
            name += f" (tied: {', '.join(p.tied_to)})"
        shapes = f"{_shape(p.global_shape)} → {_shape(p.local_shape)}"
        layout = p.layout
        if p.expand is not None:  # KV heads held once, read once per query head that uses them
            layout += f", read as {p.compute_shape()[p.shard_dim]}"
        rows.append([name, p.role.value, shapes, layout, human_bytes(size)])
    return rows, total


def _render_table(plan: Plan, dtypes: dict[str, int], timing: dict[str, float], *,
                  start: float, cost: dict[str, Any]) -> str:
    from .cost_context import context_summary
    from .cost_render import kept_whole_lines, render_eval, render_modules, render_summary

    rows, total_bytes = _param_rows(plan, dtypes)
    header = ["parameter", "role", "global → per-rank shape", "layout", "per-rank bytes"]
    out = [f"{plan.model_class} at tp={plan.tp}", "", *_table(header, rows), ""]
    out += ["collectives (per module call, as executed):", *[f"  {x}" for x in render_modules(cost, plan.blocks)]]
    if plan.experts:  # the MoE layers expert parallelism would split (parallelize(ep=...))
        first = next(iter(plan.experts.values()))
        out += ["", f"experts (from the dataflow): {len(plan.experts)} modules like {first.fqn}: "
                    f"{first.num_experts} experts, stacked params {first.params}"]
    stats = plan.stats
    out += [
        "",
        f"parameters per rank: {human_bytes(total_bytes)} ({total_bytes:,} bytes), "
        f"{plan.over_ideal():.2f}x the ideal (all parameters / tp)",
        *kept_whole_lines(plan.kept_whole()),
        f"tp: {plan.tp}",
        f"time: build (incl. imports) {timing['build_s']:.2f} s, capture {stats.get('capture_s', 0.0):.2f} s, "
        f"analysis {stats.get('analysis_s', 0.0):.2f} s, "
        f"total {time.perf_counter() - start:.2f} s",
        render_summary(cost),
        render_eval(cost),
        *context_summary(cost),
    ]
    return "\n".join(out)


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(args)


def _cmd_verify(args: argparse.Namespace) -> int:
    from .verify import render_report, resolve_config, verify

    try:
        config, task = resolve_config(args.model)
    except TPError as exc:
        return _fail(str(exc))
    report = verify(config, tp=args.tp, task=task, tol=args.tol, layers=args.layers,
                    generate=not args.no_generate, attn=args.attn, fault=args.inject_fault,
                    sequence_parallel=args.sequence_parallel, cp=args.cp, pp=args.pp, dtype=args.dtype)
    _write(json.dumps(report.to_dict(), indent=2) if args.format == "json" else render_report(report))
    return _EXIT_OK if report.ok else _EXIT_MISMATCH


def _runs_text(runs: Sequence[Sequence[int]]) -> str:
    return " ".join(f"pad×{b}" if a == -1 else f"{a}:{b}" for a, b in runs)


def _render_translation(table: Any) -> str:
    """One row per distinct tensor (layers collapsed): HF shape, layout, HF rows per rank."""
    header = ["tensor", "HF shape", "dim", "layout", *[f"rank {r} ← HF rows" for r in range(table.tp)],
              "saved as"]
    groups = _collapse(
        (key, (tuple(t.shape), t.shard_dim, t.layout, json.dumps(t.runs),
               _split_index(t.saved_as)[0] if t.saved_as != key else ""))
        for key, t in table.tensors.items()
    )
    rows = []
    for g in groups:
        t = table.tensors[g.members[0]]
        runs = [_runs_text(r) for r in t.runs] if t.runs else ["all"] * table.tp
        rows.append([g.label(), _shape(t.shape), "-" if t.shard_dim is None else str(t.shard_dim),
                     t.layout, *runs, t.saved_as if t.saved_as != t.key else ""])
    return "\n".join([f"{table.model_class}: HF ⇄ tp={table.tp} translation table", "",
                      *_table(header, rows)])


def _cmd_translate(args: argparse.Namespace) -> int:
    from ..checkpoint.translate import translate_checkpoint

    try:
        info = translate_checkpoint(args.src, args.out, dtype=_DTYPES.get(args.dtype),
                                    max_shard_size=args.max_shard_size, progress=not args.quiet,
                                    overwrite=args.overwrite)
    except TPError as exc:
        return _fail(str(exc))
    print(f"translate: {info['kind']} checkpoint {args.src} → {info['out']}: {info['tensors']} tensors, "
          f"{info['files']} file(s), {human_bytes(info['bytes'])} in {info['seconds']:.1f} s")
    return _EXIT_OK
