"""``verify``: check a model's tensor-parallel split on local CPU processes.

Before spending GPU hours, a user runs ``python -m tpcompile verify MODEL --tp 8`` on a
laptop.  The model (a preset, a local HF directory or a ``config.json``) is shrunk with
:func:`~tpcompile.tools.shrink.shrink_config` -- same classes, same head / expert structure,
every size keeping its relation to ``tp`` -- then ``tp`` gloo processes each build the
same seeded model, keep an unsharded copy, ``transform`` the other, run one forward and
backward on both and compare, per module: the module's forward output, every parameter
gradient (the TP shard mapped back to the HF rows it holds), the model outputs and loss,
and greedy ``generate`` tokens where the model generates.  ``--cp C`` runs
``parallelize(tp, cp=C)`` on ``tp x C`` processes instead
(:mod:`tpcompile.tools.verify_context`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedConfig

from ..capture import example_inputs
from ..errors import TPError
from ..integrations.hf_classes import model_class
from ..plan.modules import VocabEmbedding
from ..plan.types import Role
from .cost_render import kept_whole_lines
from .launch import WorkerFailed, spawn_local
from .shrink import shrink_config

__all__ = ["Check", "VerifyReport", "build_small_model", "render_report", "resolve_config", "verify"]

DTYPES = ("float32", "float64")  # what verify builds the shrunk model in
_SEED = 0
_BATCH = 2
_SEQ = 12  # longer than shrunk sliding windows (8), so windowed attention is exercised
_PROMPT = 6
_NEW_TOKENS = 6
_FAULT = 1e-2  # what --inject-fault adds to the module's output on one rank
_NOT_OUTPUTS = ("past_key_values", "cache_params", "encoder_past_key_values")


@dataclass
class Check:
    """Worst difference of one compared item (a module or a model output), over ranks.

    ``abs`` is the largest absolute difference, ``rel`` that divided by the largest
    reference magnitude; the item passes when either is within the tolerance.
    """

    abs: float = 0.0
    rel: float = 0.0

    def passes(self, tol: float) -> bool:
        return self.abs <= tol or self.rel <= tol

    def worst(self, other: Check) -> Check:
        return Check(abs=max(self.abs, other.abs), rel=max(self.rel, other.rel))

    def describe(self, tol: float) -> str:
        """``abs 3.1e-07`` / ``rel 2.0e-06``: the criterion it passes by, or both if it fails."""
        if self.abs <= tol:
            return f"abs {self.abs:.1e}"
        if self.rel <= tol:
            return f"rel {self.rel:.1e}"
        return f"abs {self.abs:.1e} rel {self.rel:.1e}"


@dataclass
class VerifyReport:
    """What ``verify`` measured; ``ok`` only when every check passes."""

    model_class: str
    tp: int
    tol: float
    cp: int = 1  # context parallelism (verify --cp): tp x cp processes
    pp: int = 1  # pipeline parallelism (verify --pp): tp x pp processes
    dtype: str = "float32"
    config: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    forward: dict[str, Check | None] = field(default_factory=dict)  # per module; None: not comparable
    grads: dict[str, Check] = field(default_factory=dict)  # per module owning parameters
    outputs: dict[str, Check] = field(default_factory=dict)  # model outputs and loss
    generate: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # one rank's parameter elements over the ideal (all / tp), and the largest kept whole
    split: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def failing(self) -> list[str]:
        """Names of every failing module / output / check."""
        bad = [m for m, c in self.forward.items() if c is not None and not c.passes(self.tol)]
        bad += [m for m, c in self.grads.items() if not c.passes(self.tol) and m not in bad]
        bad += [f"output {n}" for n, c in self.outputs.items() if not c.passes(self.tol)]
        if self.generate.get("status") == "mismatch":
            bad.append("generate")
        return bad

    def first_divergence(self) -> str | None:
        """Where the TP model first departs from the reference: the first module (in
        execution order) whose forward output differs; else, since gradient errors flow
        backward, the last module whose gradients differ; else the first bad output."""
        tol = self.tol
        for name, c in self.forward.items():
            if c is not None and not c.passes(tol):
                return f"{name} (forward)"
        for name in reversed(list(self.forward) + [m for m in self.grads if m not in self.forward]):
            c = self.grads.get(name)
            if c is not None and not c.passes(tol):
                return f"{name} (gradients)"
        bad = self.failing()
        return bad[0] if bad else None

    @property
    def ok(self) -> bool:
        return self.error is None and not self.failing()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["failing"] = self.failing()
        out["first_divergence"] = self.first_divergence()
        return out


# ---------------------------------------------------------------------------------
# Which model, which class
# ---------------------------------------------------------------------------------


def resolve_config(model: str) -> tuple[PreTrainedConfig, str | None]:
    """The config (and preset task, if any) of a preset name, a local HF dir or a
    config.json.  Raises :class:`TPError` naming what was tried."""
    from pathlib import Path

    from . import presets

    if Path(model).expanduser().exists():
        try:
            return presets.load_config_path(model), None
        except (FileNotFoundError, ValueError) as exc:
            raise TPError(str(exc)) from None
    try:
        preset = presets.get_preset(model)
    except KeyError as exc:
        raise TPError(f"{exc.args[0]}; or pass a local model directory or config.json") from None
    return presets.build_config(preset), preset.task


def build_small_model(config: PreTrainedConfig, *, tp: int, layers: int = 2, task: str | None = None,
                      attn: str | None = None, dtype: str = "float32") -> nn.Module:
    """The shrunk model ``verify`` checks: ``shrink_config(config, tp)`` instantiated
    with the current torch seed, in eval mode (no dropout), in ``dtype`` (float32, or
    float64 to tell a real difference from a summation order's rounding); ``attn`` is the
    attention implementation (default: the model's own default)."""
    small = shrink_config(config, tp, layers=layers)
    cls = model_class(small, task)
    kwargs = {"attn_implementation": attn} if attn else {}
    try:
        model = cls._from_config(small, dtype=getattr(torch, dtype), **kwargs)
    except ValueError as exc:
        if attn and attn in str(exc) or "attention implementation" in str(exc):
            raise TPError(f"{cls.__name__} does not support attention {attn!r}; "
                          "use --attn eager or leave --attn out") from None
        raise
    return model.eval()


# ---------------------------------------------------------------------------------
# Inputs and loss
# ---------------------------------------------------------------------------------


def _inputs(model: nn.Module, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """One random batch built from the model itself (main input, decoder inputs,
    labels where the forward takes them): the same builder capture uses."""
    return example_inputs(model, batch=_BATCH, seq=_SEQ, generator=gen, labels=True)


def _output_tensors(out: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """The float tensors a model returns, by name; those nested in a tuple or list (MGP-STR's
    three heads' ``logits``) as ``name.i``."""
    items = out.items() if hasattr(out, "items") else enumerate(out if isinstance(out, tuple | list) else [out])
    found: dict[str, torch.Tensor] = {}
    for k, v in items:
        if str(k) in _NOT_OUTPUTS:
            continue
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            found[f"{prefix}{k}"] = v
        elif isinstance(v, tuple | list) and not prefix:
            found.update(_output_tensors(v, f"{k}."))
    return found


def _loss(out: Any) -> torch.Tensor:
    """The model's own loss, else a fixed function of every output (mean of squares,
    so every output element gets a distinct gradient)."""
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    tensors = [t for k, t in _output_tensors(out).items() if k != "loss"]
    return sum(t.pow(2).mean() for t in tensors)


# ---------------------------------------------------------------------------------
# Comparisons (each rank compares what it holds against its own full reference)
# ---------------------------------------------------------------------------------


def _check(got: torch.Tensor, want: torch.Tensor) -> Check:
    if got.shape != want.shape:
        return Check(abs=float("inf"), rel=float("inf"))
    got, want = got.detach().double(), want.detach().double()
    if got.numel() == 0:
        return Check()
    diff = (got - want).abs().max().item()
    return Check(abs=diff, rel=diff / max(want.abs().max().item(), 1e-30))


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _grad_check(p: torch.Tensor, ref: torch.Tensor, plan: Any, rank: int) -> Check:
    """This rank's gradient shard against the reference rows it stands for."""
    got, want = p.grad, ref.grad
    if got is None or want is None:
        return Check() if got is None and want is None else Check(abs=float("inf"), rel=float("inf"))
    got = _local(got)
    index = plan.index() if plan is not None and plan.shard_dim is not None else None
    if index is None or tuple(got.shape) == tuple(want.shape) and plan.layout == "replicated":
        return _check(got, want)
    rows = torch.as_tensor(index[rank])
    keep = rows >= 0  # -1: zero padding rows (non-divisible vocabulary)
    dim = plan.shard_dim
    if got.shape[dim] != rows.numel():
        return Check(abs=float("inf"), rel=float("inf"))
    return _check(got.index_select(dim, torch.nonzero(keep).flatten()),
                  want.index_select(dim, rows[keep]))


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if hasattr(out, "values") else out if isinstance(out, (tuple, list)) else []
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v
    return None


class _Recorder:
    """Forward hooks recording the first float output of every module, call by call."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        self.outputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        self.order: list[str] = []  # modules in the order of their first call
        modules = dict(model.named_modules())
        self.handles = [modules[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(_mod: nn.Module, _args: Any, out: Any) -> None:
            t = _first_tensor(out)
            if not self.outputs[name]:
                self.order.append(name)
            if t is not None:
                self.outputs[name].append(_local(t).detach().clone())
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _run_recorded(model: nn.Module, ref: nn.Module, batch: dict[str, Any], names: list[str],
                  who: tuple[str, str]) -> tuple[tuple[Any, Any], list[_Recorder]] | str:
    """One forward and backward of ``ref`` then ``model`` with every named module's
    output recorded: ``((model's output, ref's), [model's recorder, ref's])``, or what
    failed (a crash is a finding, reported like a mismatch). ``who`` names the two."""
    recorders = [_Recorder(m, names) for m in (model, ref)]
    outs: dict[str, Any] = {}
    try:
        for name, m in ((who[1], ref), (who[0], model)):
            try:
                outs[name] = m(**batch)
                _loss(outs[name]).backward()
            except Exception as exc:
                return f"forward/backward of {name} failed: {type(exc).__name__}: {exc}"
    finally:
        for r in recorders:
            r.remove()
    return (outs[who[0]], outs[who[1]]), recorders


def _sharded_rows(module: str, plan: Any, rank: int) -> dict[tuple[int, int], torch.Tensor]:
    """``(global, local) size -> HF rows this rank holds`` for every sharded parameter
    of ``module``: a column-parallel module's local output features are the rows of its
    weight's shard dim (dim 0 of a Linear, dim 1 of GPT-2's Conv1D), as its forward reads
    them (a KV head read by several local query heads: once per query head)."""
    out: dict[tuple[int, int], torch.Tensor] = {}
    for pp in plan.params.values():
        if pp.module == module and pp.shard_dim is not None and (index := pp.compute_index()) is not None:
            sizes = (pp.global_shape[pp.shard_dim], pp.compute_shape()[pp.shard_dim])
            out.setdefault(sizes, torch.as_tensor(index[rank]))
    return out


def _token_slice(g: torch.Tensor, w: torch.Tensor, rank: int, tp: int) -> torch.Tensor | None:
    """Under sequence parallelism a module between regions outputs this rank's tokens:
    the matching slice of the unsharded output (padded as the split pads)."""
    diff = [d for d in range(w.dim()) if g.shape[d] != w.shape[d]] if g.dim() == w.dim() else []
    if len(diff) != 1 or g.shape[diff[0]] * tp < w.shape[diff[0]]:
        return None
    from ..runtime.sequence import pad_tokens

    d = diff[0]
    return pad_tokens(w, tp, d).narrow(d, rank * g.shape[d], g.shape[d])


def _forward_check(got: list[torch.Tensor], want: list[torch.Tensor],
                   rows_by_size: dict[tuple[int, int], torch.Tensor],
                   tokens: tuple[int, int] | None = None) -> Check | None:
    """Module outputs call by call; column-parallel outputs compared on the features
    this rank holds, token-split ones (``tokens=(rank, tp)``) on this rank's tokens.
    ``None`` when nothing is comparable."""
    result: Check | None = None
    for g, w in zip(got, want, strict=False):
        rows = rows_by_size.get((w.shape[-1], g.shape[-1])) if g.dim() and w.dim() else None
        # the same width is not the same features: 5 KV heads read by a rank's 5 query
        # heads are copies of 2 of the 5 global ones (query heads straddling KV groups)
        if rows is not None and g.shape[:-1] == w.shape[:-1] and (
                g.shape != w.shape or not torch.equal(rows, torch.arange(rows.numel()))):
            keep = rows >= 0
            g, w = g[..., torch.nonzero(keep).flatten()], w[..., rows[keep]]
        elif g.shape != w.shape and tokens is not None:
            w = _token_slice(g, w, *tokens)
            if w is None:
                continue
        if g.shape != w.shape:
            continue
        c = _check(g, w)
        result = c if result is None else result.worst(c)
    if len(got) != len(want) and want:
        return Check(abs=float("inf"), rel=float("inf"))
    return result


# ---------------------------------------------------------------------------------
# The per-rank job
# ---------------------------------------------------------------------------------


def _inject_fault(model: nn.Module, module: str, rank: int, world: int) -> None:
    """Test hook: perturb ``module``'s output on one rank only (rank 1, or 0 at tp=1)."""
    modules = dict(model.named_modules())
    if module not in modules:
        raise TPError(f"--inject-fault: no module {module!r} in {type(model).__name__}")
    if rank != min(1, world - 1):
        return

    def hook(_mod: nn.Module, _args: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return out + _FAULT
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (out[0] + _FAULT, *out[1:])
        raise TPError(f"--inject-fault: {module!r} returns no tensor to perturb")

    modules[module].register_forward_hook(hook)


def _generate(model: nn.Module, ref: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    if not ref.can_generate():
        return {"status": "skipped: the model does not generate"}
    name = ref.main_input_name
    prompt = batch[name][:1, :_PROMPT] if name == "input_ids" else batch[name][:1]
    config = ref.config
    pad = getattr(config, "pad_token_id", None)  # not every config declares one (CodeGen)
    pad = pad if pad is not None else getattr(config, "eos_token_id", None)
    kwargs = {name: prompt, "max_new_tokens": _NEW_TOKENS, "do_sample": False, "pad_token_id": pad}
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        kwargs["decoder_start_token_id"] = pad if pad is not None else 0  # T5/BART's convention
    with torch.no_grad():
        try:
            want = ref.generate(**kwargs)
        except Exception as exc:  # the unsharded model itself cannot: not a TP finding
            return {"status": f"skipped: the unsharded model's generate fails ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:120]})"}
        got = model.generate(**kwargs)
    same = got.shape == want.shape and bool(torch.equal(got, want))
    return {"status": "match" if same else "mismatch", "tp": got[0].tolist(), "reference": want[0].tolist()}


def _partial_outputs(plan: Any) -> set[str]:
    """The modules returning each rank's partial sum, reduced by a module around them
    (row-parallel projections whose caller all-reduces what they return)."""
    rows = {n.rpartition(".")[0] for n, p in plan.params.items() if p.role is Role.ROW}
    return {m for m in rows if m not in plan.modules or not plan.modules[m].reduces}


def _worker(rank: int, world: int, config: PreTrainedConfig, task: str | None, opts: dict[str, Any]) -> dict:
    """One rank: build, copy, transform, forward + backward both, compare."""
    from transformers.utils import logging as hf_logging

    from ..api import transform

    hf_logging.set_verbosity_error()
    torch.manual_seed(_SEED)  # same seed on every rank: identical full weights
    model = build_small_model(config, tp=world, layers=opts["layers"], task=task, attn=opts["attn"],
                              dtype=opts.get("dtype", "float32"))
    ref = copy.deepcopy(model)
    batch = _inputs(ref, torch.Generator().manual_seed(_SEED + 1))
    names = [n for n, m in ref.named_modules() if n and any(True for _ in m.parameters(recurse=False))]
    result: dict[str, Any] = {"model_class": type(model).__name__, "config": model.config.to_diff_dict()}
    try:
        transform(model, tp=world, sequence_parallel=opts.get("sequence_parallel", False))
    except Exception as exc:  # reported, not raised: the user wants to know why
        result["error"] = f"transform failed: {type(exc).__name__}: {exc}"
        return result
    if opts.get("fault"):
        _inject_fault(model, opts["fault"], rank, world)
    result["warnings"] = list(model.tpcompile_plan.warnings)
    result["split"] = {"over_ideal": model.tpcompile_plan.over_ideal(),
                       "kept_whole": model.tpcompile_plan.kept_whole()}
    if opts.get("sequence_parallel"):
        seq = model.tpcompile_plan.sequence
        regions, stacks = (seq.regions, seq.stacks) if seq is not None else ({}, {})
        result["warnings"].append(f"sequence parallelism: {len(regions)} regions in "
                                  f"{sorted(stacks) or 'no stack'}")
    ran = _run_recorded(model, ref, batch, names, ("the transformed model", "the unsharded model"))
    if isinstance(ran, str):
        result["error"] = ran
        return result
    outs_tp_ref, recorders = ran
    losses = [_loss(o) for o in outs_tp_ref]
    plan = model.tpcompile_plan
    order = list(dict.fromkeys([*recorders[1].order, *names]))  # execution order first
    tokens = (rank, world) if plan.sequence else None
    # a module inside a vocab-parallel embedding's forward (Inkling's embed_norm) sees each
    # rank's masked rows by design; they are compared where the embedding returns
    lookups = [f"{m}." for m, mp in plan.modules.items() if mp.op(VocabEmbedding) is not None]
    partial = _partial_outputs(plan)
    for n in order:  # a row module its caller reduces (called twice, both sums in one): its sum
        for t in recorders[0].outputs[n] if n in partial else ():
            torch.distributed.all_reduce(t)
    result["forward"] = {n: None if any(n.startswith(v) for v in lookups) else _forward_check(
        recorders[0].outputs[n], recorders[1].outputs[n], _sharded_rows(n, plan, rank), tokens) for n in order}
    ref_params = dict(ref.named_parameters())
    grads = {n: Check() for n in order}
    for pname, p in model.named_parameters():
        owner = pname.rpartition(".")[0]
        c = _grad_check(p, ref_params[pname], plan.params.get(pname), rank)
        grads[owner] = grads.get(owner, Check()).worst(c)
    result["grads"] = grads
    got, want = (_output_tensors(o) for o in outs_tp_ref)
    result["outputs"] = {k: _check(got[k], v) if k in got else Check(abs=float("inf"), rel=float("inf"))
                         for k, v in want.items()}
    result["outputs"]["loss"] = _check(losses[0], losses[1])
    result["generate"] = _generate(model, ref, batch) if opts["generate"] else {"status": "skipped (--no-generate)"}
    return result


def _merge(results: list[dict], tp: int, tol: float, cp: int = 1) -> VerifyReport:
    """Worst over ranks of every check."""
    first = results[0]
    report = VerifyReport(model_class=first["model_class"], tp=tp, tol=tol, cp=cp, config=first["config"])
    errors = [r["error"] for r in results if r.get("error")]
    if errors:
        report.error = errors[0]
        return report
    report.warnings = first["warnings"]
    report.split = first.get("split", {})
    for key in ("forward", "grads", "outputs"):
        merged: dict[str, Check | None] = {}
        for r in results:
            for name, c in r[key].items():
                prev = merged.get(name)
                merged[name] = c if prev is None else prev if c is None else prev.worst(c)
        setattr(report, key, merged)
    statuses = [r["generate"] for r in results]
    report.generate = next((g for g in statuses if g["status"] == "mismatch"), statuses[0])
    return report


def verify(config: PreTrainedConfig, *, tp: int, task: str | None = None, tol: float = 1e-5,
           layers: int = 2, generate: bool = True, attn: str | None = None,
           fault: str | None = None, sequence_parallel: bool = False, cp: int = 1, pp: int = 1,
           dtype: str = "float32") -> VerifyReport:
    """Check ``transform(tp=tp)`` of a shrunk copy of ``config``'s model on ``tp`` local
    CPU processes against the unsharded copy (with ``cp > 1``: ``parallelize(tp=tp,
    cp=cp)`` on ``tp x cp`` processes, :mod:`tpcompile.tools.verify_context`).

    Args:
        config: the real model's config (its sizes are shrunk, its structure kept).
        tp: number of processes / tensor-parallel degree.
        task: ``"causal-lm"`` / ``"masked-lm"`` to force the head (presets pass theirs).
        tol: pass when the absolute or the relative difference is within it.
        layers: layers of the shrunk model (at least one of each kind is kept).
        generate: also compare greedy ``generate`` tokens.
        attn: ``"eager"`` or ``"sdpa"`` attention (default: the model's default).
        fault: test hook -- add a constant to this module's output on one rank after
            ``transform`` (the report must then name it).
        sequence_parallel: transform with ``sequence_parallel=True``; modules between
            regions are compared on this rank's tokens.
        cp: context parallelism: each sequence split over ``cp`` ranks; modules are
            compared on this rank's positions, outputs put back in order.
        pp: pipeline parallelism: ``parallelize(tp, pp)`` on ``tp x pp`` processes, one
            ``pipeline_step``; the loss and every gradient compared
            (:mod:`tpcompile.tools.verify_pipeline`).
        dtype: ``"float32"`` or ``"float64"``: in float64 an all-reduce's summation order
            moves results by ~1e-16, so a difference above ``tol=1e-10`` is the split's,
            not rounding's.

    Example:
        >>> report = verify(presets.build_config("llama"), tp=2)    # doctest: +SKIP
        >>> report.ok, report.failing()
        (True, [])
    """
    t0 = time.perf_counter()
    if dtype not in DTYPES:
        raise TPError(f"verify dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    opts = {"layers": layers, "generate": generate, "attn": attn, "fault": fault,
            "sequence_parallel": sequence_parallel, "dtype": dtype}
    worker: Callable[..., dict] = _worker
    if cp > 1 and pp > 1:
        raise TPError("verify checks one of --cp and --pp at a time")
    if cp > 1:
        from .verify_context import cp_worker

        worker, opts = cp_worker, {**opts, "tp": tp, "cp": cp}
    if pp > 1:
        from .verify_pipeline import pp_worker

        worker, opts = pp_worker, {**opts, "tp": tp, "pp": pp}
    try:
        results = spawn_local(worker, tp * cp * pp, config, task, opts)
    except WorkerFailed as exc:
        report = VerifyReport(model_class=type(config).__name__, tp=tp, tol=tol, cp=cp, pp=pp, error=str(exc))
    else:
        report = _merge(results, tp, tol, cp)
        report.pp = pp
    report.dtype = dtype
    report.seconds = time.perf_counter() - t0
    return report


# ---------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------


def _cell(c: Check | None, tol: float) -> str:
    return "-" if c is None else c.describe(tol)


def render_report(report: VerifyReport) -> str:
    """The report as text: one row per module (worst forward / gradient difference over
    ranks), then model outputs, generate and a summary line."""
    where = f"tp={report.tp}" + (f" x cp={report.cp}" if report.cp > 1 else "") + \
        (f" x pp={report.pp}" if report.pp > 1 else "")
    dtype = "" if report.dtype == "float32" else f"{report.dtype}; "
    head = f"verify {report.model_class} at {where} (shrunk copy; {dtype}tol {report.tol:g}, abs or rel)"
    if report.error:
        return f"{head}\n\nFAILED: {report.error}"
    tol = report.tol
    rows = []
    for name in dict.fromkeys([*report.forward, *report.grads]):
        fwd, grad = report.forward.get(name), report.grads.get(name)
        ok = all(c is None or c.passes(tol) for c in (fwd, grad))
        rows.append([name, _cell(fwd, tol), _cell(grad, tol), "ok" if ok else "MISMATCH"])
    rows += [[f"<output {n}>", _cell(c, tol), "-", "ok" if c.passes(tol) else "MISMATCH"]
             for n, c in report.outputs.items()]
    header = ["module", "forward", "grads", "status"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [head, ""]
    for r in [header, ["-" * w for w in widths], *rows]:
        lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    gen = report.generate
    lines += ["", f"generate (greedy): {gen.get('status', 'skipped')}"]
    if "tp" in gen:
        lines += [f"  tp        {gen['tp']}", f"  reference {gen['reference']}"]
    if report.split:
        lines += ["", f"parameters per rank: {report.split['over_ideal']:.2f}x the ideal (all / tp)"]
        lines += kept_whole_lines(report.split["kept_whole"])
    for w in report.warnings:
        lines.append(f"warning: {w}")
    bad = report.failing()
    n_mod = len(rows) - len(report.outputs)
    summary = (f"OK: {n_mod} modules, {len(report.outputs)} outputs match" if not bad
               else f"FAILED: first divergence at {report.first_divergence()}; "
                    f"{len(bad)} mismatching: {', '.join(bad)}")
    lines += ["", f"{summary} ({report.seconds:.1f} s)"]
    return "\n".join(lines)
