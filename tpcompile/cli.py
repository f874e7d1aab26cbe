"""Command-line interface: ``python -m tpcompile`` / ``tpcompile``.

Subcommands:

* ``dump-plan NAME --tp 8`` plans a model built on the meta device (no weights, no
  process group) and prints the plan as a table (repeated layers collapsed into one
  row, collectives per block, per-rank bytes, timings) or as the plan's JSON.
* ``demo --tp 2`` runs the whole story on local CPU processes: a tiny Llama is
  transformed, then its logits, training losses and greedy generations are compared
  against a single-process copy of the same model.

Exit codes: 0 success, 1 demo mismatch, 2 user error (unknown preset, bad config,
a model or ``tp`` the compiler cannot split); the message is printed, not a traceback.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import re
import socket
import sys
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import PreTrainedConfig, PreTrainedModel

from .errors import TPError
from .plan import ModulePlan, Plan

__all__ = ["build_parser", "main"]

_EXIT_OK = 0
_EXIT_MISMATCH = 1
_EXIT_USAGE = 2

# Demo acceptance thresholds (float32 CPU; only the reduction order differs).
_LOGITS_ATOL = 1e-5
_LOSS_RTOL = 1e-4
_DEMO_SEED = 0
_DEMO_BATCH = (2, 16)
_DEMO_NEW_TOKENS = 8


# ---------------------------------------------------------------------------------
# Parser
# ---------------------------------------------------------------------------------


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


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
    dump.add_argument("--tp", type=_positive_int, default=8, help="tensor-parallel degree (default 8)")
    dump.add_argument("--format", choices=("table", "json"), default="table", help="output format")
    dump.add_argument("--model", metavar="DIR_OR_CONFIG_JSON",
                      help="a local model directory or config.json instead of a preset")
    dump.add_argument("--layers", type=_positive_int, help="override the number of layers")
    dump.set_defaults(handler=_cmd_dump_plan)

    demo = sub.add_parser(
        "demo",
        help="transform a tiny Llama on local CPU processes and check it against the original",
        description="Spawn --tp gloo processes, transform a tiny Llama and compare logits, "
        "training losses and greedy generations with a single-process reference.",
    )
    demo.add_argument("--tp", type=_positive_int, default=2, help="number of processes (default 2)")
    demo.add_argument("--steps", type=_positive_int, default=5, help="training steps (default 5)")
    demo.set_defaults(handler=_cmd_demo)
    return parser


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
    from .api import plan_model

    t0 = time.perf_counter()
    try:
        model = _build_model(args)
        t_built = time.perf_counter()
        plan = plan_model(model, args.tp)
    except _UsageError as exc:
        return _fail(str(exc))
    except TPError as exc:
        return _fail(str(exc))
    t_planned = time.perf_counter()
    for warning in plan.warnings:
        print(f"tpcompile: warning: {warning}", file=sys.stderr)
    if args.format == "json":
        print(plan.to_json(indent=2))
        return _EXIT_OK
    timing = {"build_s": t_built - t0, "plan_s": t_planned - t_built}
    dtypes = {name: p.dtype.itemsize for name, p in model.named_parameters(remove_duplicate=False)}
    text = _render_table(plan, dtypes, timing, start=t0)
    _write(text)
    return _EXIT_OK


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


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _numel(shape: Sequence[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, except the last (bytes), right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        out = [c.ljust(w) for c, w in zip(cells[:-1], widths[:-1], strict=True)]
        return "  ".join([*out, cells[-1].rjust(widths[-1])]).rstrip()

    return [line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]


def _param_rows(plan: Plan, dtypes: dict[str, int]) -> tuple[list[list[str]], int]:
    """One row per collapsed parameter group, and the per-rank byte total."""

    def signature(fqn: str) -> tuple[Any, ...]:
        p = plan.params[fqn]
        return (p.role.value, tuple(p.global_shape), tuple(p.local_shape), p.layout,
                dtypes.get(fqn, 4), len(p.tied_to))

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
        rows.append([name, p.role.value, shapes, p.layout, _human_bytes(size)])
    return rows, total


def _module_collectives(mp: ModulePlan) -> tuple[int, int, int]:
    """(forward all-reduces, forward all-gathers, backward all-reduces) of one module."""
    fwd_reduce = int(mp.reduce_output) + int(mp.vocab_parallel)
    fwd_gather = int(mp.gather_output)
    bwd_reduce = int(mp.copy_inputs) + len(mp.grad_allreduce)
    return fwd_reduce, fwd_gather, bwd_reduce


def _describe(counts: tuple[int, int, int]) -> str:
    fwd_reduce, fwd_gather, bwd_reduce = counts
    fwd = [f"{fwd_reduce} all-reduce"] if fwd_reduce else []
    fwd += [f"{fwd_gather} all-gather"] if fwd_gather else []
    bwd = f"{bwd_reduce} all-reduce" if bwd_reduce else "none"
    return f"fwd {', '.join(fwd) or 'none'}; bwd {bwd}"


def _add(a: tuple[int, int, int], b: tuple[int, int, int]) -> tuple[int, int, int]:
    return (a[0] + b[0], a[1] + b[1], a[2] + b[2])


def _module_section(plan: Plan) -> tuple[list[str], tuple[int, int, int]]:
    """Collectives per (collapsed) module, the per-block summary and whole-model totals."""
    # Model order (that of plan.params), not plan.modules' alphabetical order.
    order: dict[str, int] = {}
    for p in plan.params.values():
        order.setdefault(p.module, len(order))
    fqns = sorted(plan.modules, key=lambda f: (order.get(f, len(order)), f))
    active = {f: _module_collectives(plan.modules[f]) for f in fqns}
    active = {f: c for f, c in active.items() if any(c)}
    lines = [f"{g.label()}: {_describe(active[g.first])}"
             for g in _collapse(active.items())]
    total = (0, 0, 0)
    blocks: dict[str, tuple[int, int, int]] = {}
    for fqn, counts in active.items():
        total = _add(total, counts)
        skeleton, index = _split_index(fqn)
        if index is not None:
            block = fqn[: skeleton.index("{}")] + str(index)
            blocks[block] = _add(blocks.get(block, (0, 0, 0)), counts)
    if blocks:
        block, counts = next(iter(sorted(blocks.items(), key=lambda kv: _split_index(kv[0])[1])))
        summary = f"per block: fwd {counts[0]} all-reduce, bwd {counts[2]} all-reduce"
        if counts[1]:
            summary += f", fwd {counts[1]} all-gather"
        lines.append(f"{summary}   (e.g. {block}; {len(blocks)} blocks)")
    return lines, total


def _render_table(plan: Plan, dtypes: dict[str, int], timing: dict[str, float], *,
                  start: float) -> str:
    rows, total_bytes = _param_rows(plan, dtypes)
    header = ["parameter", "role", "global → per-rank shape", "layout", "per-rank bytes"]
    out = [f"{plan.model_class} at tp={plan.tp}", "", *_table(header, rows), ""]
    module_lines, totals = _module_section(plan)
    out += ["collectives (per module forward / backward):", *[f"  {x}" for x in module_lines]]
    out.append(f"  whole model per step: fwd {totals[0]} all-reduce, {totals[1]} all-gather; "
               f"bwd {totals[2]} all-reduce")
    stats = plan.stats
    out += [
        "",
        f"parameters per rank: {_human_bytes(total_bytes)} ({total_bytes:,} bytes)",
        f"tp: {plan.tp}",
        f"time: build (incl. imports) {timing['build_s']:.2f} s, capture {stats.get('capture_s', 0.0):.2f} s, "
        f"analysis {stats.get('analysis_s', 0.0):.2f} s, "
        f"total {time.perf_counter() - start:.2f} s",
    ]
    return "\n".join(out)


# ---------------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------------


def _free_port() -> int:
    """A TCP port on 127.0.0.1 free right now (the OS chooses it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    t0 = time.perf_counter()
    try:
        mp.start_processes(_demo_worker, args=(args.tp, port, args.steps, results),
                           nprocs=args.tp, join=True, start_method="spawn")
    except mp.ProcessRaisedException as exc:
        print(f"demo: a worker failed:\n{exc}", file=sys.stderr)
        return _EXIT_MISMATCH
    except mp.ProcessExitedException as exc:
        print(f"demo: a worker died: {exc}", file=sys.stderr)
        return _EXIT_MISMATCH
    verdicts = [results.get() for _ in range(args.tp)]
    ok = all(v for _, v in verdicts)
    status = "OK: the TP model matches the single-process reference" if ok else "FAILED"
    print(f"demo: {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return _EXIT_OK if ok else _EXIT_MISMATCH


def _demo_worker(rank: int, tp: int, port: int, steps: int, results: Any) -> None:
    """One spawned rank: join the group, run the checks, report ``(rank, ok)``."""
    torch.set_num_threads(1)  # tp processes share few cores; avoid oversubscription
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp, timeout=datetime.timedelta(seconds=120))
    try:
        results.put((rank, _demo_checks(rank, tp, steps)))
        dist.barrier()  # no rank tears gloo down while a peer still has traffic in flight
    finally:
        dist.destroy_process_group()


def _say(rank: int, text: str) -> None:
    if rank == 0:
        print(text, flush=True)


def _global_max(value: float) -> float:
    """Max over ranks, so every rank reaches the same verdict."""
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _demo_checks(rank: int, tp: int, steps: int) -> bool:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from . import presets
    from .api import transform

    hf_logging.set_verbosity_error()  # keep the demo's output to what it measures
    torch.manual_seed(_DEMO_SEED)  # same seed on every rank: identical full weights
    config = presets.tiny_config("llama")
    model = AutoModelForCausalLM.from_config(config)
    reference = copy.deepcopy(model)
    transform(model, tp=tp)
    _say(rank, _role_summary(model.tpcompile_plan))

    ids = torch.randint(0, config.vocab_size, _DEMO_BATCH,
                        generator=torch.Generator().manual_seed(_DEMO_SEED + 1))
    logits_ok = _check_logits(rank, model, reference, ids)
    losses_ok = _check_training(rank, model, reference, ids, steps)
    tokens_ok = _check_generate(rank, model, reference, ids[:1, :6], config)
    return logits_ok and losses_ok and tokens_ok


def _role_summary(plan: Plan) -> str:
    roles = Counter(p.role.value for p in plan.params.values())
    layouts = Counter(p.layout for p in plan.params.values())
    role_text = ", ".join(f"{n} {r}" for r, n in sorted(roles.items()))
    layout_text = ", ".join(f"{n} {k}" for k, n in sorted(layouts.items()))
    return f"plan (tp={plan.tp}, {plan.model_class}): {role_text}\n  layouts: {layout_text}"


def _check_logits(rank: int, model: nn.Module, reference: nn.Module, ids: torch.Tensor) -> bool:
    with torch.no_grad():
        diff = (model(ids).logits - reference(ids).logits).abs().max().item()
    diff = _global_max(diff)
    ok = diff < _LOGITS_ATOL
    _say(rank, f"logits: max abs diff {diff:.2e} -> {'match' if ok else 'MISMATCH'}")
    return ok


def _check_training(rank: int, model: nn.Module, reference: nn.Module, ids: torch.Tensor,
                    steps: int) -> bool:
    # Every rank trains its own identical reference copy, so no reference traffic.
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference)]
    model.train()
    reference.train()
    ok = True
    _say(rank, f"training {steps} steps of AdamW(lr=1e-3):")
    for step in range(1, steps + 1):
        tp_loss, ref_loss = (_train_step(m, opt, ids) for m, opt in zip((model, reference), opts,
                                                                            strict=True))
        rel = _global_max(abs(tp_loss - ref_loss) / max(abs(ref_loss), 1e-12))
        ok = ok and rel < _LOSS_RTOL
        _say(rank, f"  step {step}: tp loss {tp_loss:.6f}  reference {ref_loss:.6f}  "
                   f"rel diff {rel:.1e}")
    _say(rank, f"losses: {'match' if ok else 'MISMATCH'} (rel tol {_LOSS_RTOL:g})")
    return ok


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.item())


def _check_generate(rank: int, model: PreTrainedModel, reference: PreTrainedModel,
                    prompt: torch.Tensor, config: PreTrainedConfig) -> bool:
    model.eval()
    reference.eval()
    kwargs = {"max_new_tokens": _DEMO_NEW_TOKENS, "do_sample": False,
              "pad_token_id": config.eos_token_id}
    with torch.no_grad():
        got = model.generate(prompt, **kwargs)
        want = reference.generate(prompt, **kwargs)
    same = got.shape == want.shape and bool(torch.equal(got, want))
    ok = _global_max(0.0 if same else 1.0) == 0.0
    _say(rank, f"generate (greedy, {_DEMO_NEW_TOKENS} new tokens):\n"
               f"  tp        {got[0].tolist()}\n  reference {want[0].tolist()}")
    _say(rank, f"tokens: {'match' if ok else 'MISMATCH'}")
    return ok
