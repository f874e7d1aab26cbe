"""Self-check: trace the localized model before anyone runs it.

``transform`` must never return a model that crashes or computes differently.  The
analysis predicts, for every activation carrying sharded features, its shape on a rank;
the rewrite makes parameters local and fixes hard-coded sizes.  This module checks the
two agree *before* any weight moves: it builds a shadow of the model on the meta device
whose parameters have their local shapes and whose fix-ups are applied, traces it with
the same inputs, and compares each op's output shape with the prediction.

Every rank holds the same local shapes (layouts are dealt evenly; padding keeps a
non-divisible vocabulary even), so rank 0's shadow stands for all of them.  Collectives
do not change shapes (an all-reduce keeps its input's), so the shadow runs without them
and needs no process group — except the LM head's logit gather: unless the logits stay
vocab-sharded (loss-parallel), the shadow's heads return full-width logits, as the
runtime's do, and what the model computes from them after the head (BART's
``final_logits_bias``, Gemma-2's soft-capping) runs on whole, replicated values.

The same check resolves hard-coded sizes the graph leaves ambiguous: when one global
value maps to several local values in a module (``num_key_value_heads`` 2 → 1 and
``num_key_value_groups`` 2 → 2), each candidate assignment is traced and the one whose
local graph matches the prediction is kept.
"""

from __future__ import annotations

import copy
import difflib
import itertools
import re
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..errors import TPError
from .entries import narrow_args
from .fixups import Local, apply_fixups, localize_embedding, quiet_traces
from .heads import after_heads
from .partition import param_layout
from .propagate import innermost_module
from .roles import Analyzed
from .shape_sites import model_code, node_line
from .state import Feat

__all__ = ["Mismatch", "SelfCheckError", "check_local", "raise_mismatches", "resolve_compared", "resolve_fixups", "resolve_sites"]

Fixups = dict[str, dict[str, list[int]]]
_MAX_TRIALS = 32


@dataclass(frozen=True)
class Mismatch:
    """One op whose local output shape differs from the plan's prediction."""

    module: str
    op: str
    expected: tuple[int, ...]
    actual: tuple[int, ...] | None  # None: the local trace failed before this op
    detail: str = ""
    # "file.py:line" of the model code, innermost first: the op's, or the frames the trace failed in
    lines: tuple[str, ...] = ()

    def __str__(self) -> str:
        where = self.module or "<root>"
        if self.actual is None:
            return f"the localized model fails in {where}: {self.detail}"
        return (f"{where}: op {self.op} gives local shape {list(self.actual)}, the plan "
                f"expects {list(self.expected)}")


def _local_shapes(model: nn.Module, a: Analyzed, representative: Callable[[str], str]) -> dict[int, list[int]]:
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    shapes: dict[int, list[int]] = {}
    for p in model.parameters():
        shape = list(p.shape)
        for alias in names[id(p)]:
            lay = a.layouts.get(representative(alias))
            lay = param_layout(lay) if lay is not None else None
            if lay is not None:
                shape[lay.dim] = lay.local
                break
        shapes[id(p)] = shape
    return shapes


def _shadow(model: nn.Module, shapes: dict[int, list[int]]) -> nn.Module:
    """A copy of ``model`` on the meta device with local parameter shapes (no weights)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(shapes[id(p)], dtype=p.dtype, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    for m in model.modules():  # tensors a module holds as plain attributes (PEFT OSF's SVD
        for t in _plain_tensors(vars(m)):  # factors; cached tables): no data either
            if id(t) not in memo:
                memo[id(t)] = torch.empty(t.shape, dtype=t.dtype, device="meta")
    return copy.deepcopy(model, memo)


def _plain_tensors(obj: Any, depth: int = 3) -> Iterator[torch.Tensor]:
    """Tensors in ``obj``'s values, lists and dicts (not in its submodules or hooks)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth and isinstance(obj, dict):
        for k, v in obj.items():
            if k not in ("_modules", "_parameters", "_buffers") and not str(k).endswith("hooks"):
                yield from _plain_tensors(v, depth - 1)
    elif depth and isinstance(obj, list | tuple):
        for v in obj:
            yield from _plain_tensors(v, depth - 1)


@contextmanager
def _module_stack(model: nn.Module) -> Iterator[list[str]]:
    """The FQNs of the modules running right now (innermost last); after an exception,
    the modules it passed through."""
    stack: list[str] = []
    handles = []
    for name, mod in model.named_modules():
        def pre(*_: Any, _name: str = name) -> None:
            stack.append(_name)

        def post(*_: Any) -> None:
            if stack:
                stack.pop()

        handles.append(mod.register_forward_pre_hook(pre))
        # not always_call: a forward that raises leaves its module on the stack
        handles.append(mod.register_forward_hook(post))
    try:
        yield stack
    finally:
        for h in handles:
            h.remove()


def _model_frames(err: BaseException) -> tuple[tuple[str, ...], str]:
    """The lines of model code (not torch's) on the way to ``err``, innermost first, as
    ``"file.py:line"``, and the innermost with its source."""
    frames = [f for f in reversed(traceback.extract_tb(err.__traceback__)) if model_code(f.filename)]
    lines = tuple(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames)
    return lines, (f"{lines[0]} `{(frames[0].line or '').strip()}`" if frames else "")


def _gather_heads(shadow: nn.Module, a: Analyzed, expand: Callable[[str], list[str]]) -> None:
    """The runtime's logit gather, shape for shape: each head returns all ``tp`` shards,
    unpadded to the vocabulary."""
    mods = dict(shadow.named_modules())
    tp = a.part.tp
    for fqn, module in a.lm_head.items():
        vocab = int(a.layouts[fqn].size)
        for full in expand(module):
            if full in mods:
                mods[full].register_forward_hook(
                    lambda m, args, out, _v=vocab: torch.cat([out] * tp, dim=-1)[..., :_v])


def _compare(a: Analyzed, predicted: fx.Graph, local: fx.Graph, gathered: bool = False) -> list[Mismatch]:
    loc = Local(a)
    whole = after_heads(a, predicted) if gathered else set()
    want = [n for n in predicted.nodes if n.op == "call_function"]
    got = [n for n in local.nodes if n.op == "call_function"]
    # the local code may take a slightly different path (a layout copy the global shapes
    # did not need, a size-1 shortcut): compare the ops both traces agree on, in order
    keys_w = [str(n.target) for n in want]
    keys_g = [str(n.target) for n in got]
    pairs = [(want[b.a + i], got[b.b + i])
             for b in difflib.SequenceMatcher(None, keys_w, keys_g, autojunk=False).get_matching_blocks()
             for i in range(b.size)]
    out: list[Mismatch] = []
    for w, g in pairs:
        if not isinstance(a.an.value.get(w), Feat) or w in whole:
            continue
        gv = g.meta.get("val")
        if not isinstance(gv, torch.Tensor) or gv.dim() != a.an.ndim(w):
            continue
        # only dims that carry features are predicted; a broadcast dim (repeat_kv's copy
        # count) may legitimately change with a fix-up
        dims = [d for d in range(gv.dim()) if loc.carries(w, d)]
        expected = tuple(loc.size(w, d) for d in range(a.an.ndim(w)))
        if any(gv.shape[d] != expected[d] for d in dims):
            out.append(Mismatch(innermost_module(w), str(getattr(w.target, "__name__", w.target)),
                                expected, tuple(gv.shape), lines=(node_line(w) or "",)))
    return out


def check_local(
    model: nn.Module,
    a: Analyzed,
    graph: fx.Graph,
    fixups: Fixups,
    *,
    trace: Callable[[nn.Module], fx.Graph],
    expand: Callable[[str], list[str]],
    representative: Callable[[str], str],
    gathered: bool = False,
) -> list[Mismatch]:
    """Trace rank 0's localized shadow of ``model`` with ``fixups`` applied; return every
    op whose local shape disagrees with the analysis (empty: the plan is consistent).
    ``gathered``: the LM heads' logits are gathered after the head (not loss-parallel)."""
    shadow = _shadow(model, _local_shapes(model, a, representative))
    if gathered:
        _gather_heads(shadow, a, expand)
    mods = dict(shadow.named_modules())
    for fqn, users in a.embedding.items():  # the rewrite's own bookkeeping, rank 0's rows
        lay = a.layouts[fqn]
        start = int(lay.index[0][0])
        for full in (f for m in users for f in expand(m)):
            if full in mods:
                localize_embedding(mods[full], (start, start + lay.local), lay.local)
    for name, changes in fixups.items():
        for full in expand(name):
            if full in mods:
                apply_fixups(mods[full], changes)
    for name, slices in a.entry_slices.items():  # the runtime's entry slices, rank 0's rows
        rows = [es.as_tuple() for es in slices]
        for full in expand(name):
            if full in mods:
                mods[full].register_forward_pre_hook(
                    lambda m, args, kwargs, _r=rows, _n=full: narrow_args(args, kwargs, _r, 0, _n),
                    with_kwargs=True)
    for name, buffers in a.buffer_slices.items():  # the runtime's buffer slices, rank 0's rows
        for full in expand(name):
            if full in mods:
                _narrow_buffers(mods[full], {path: (lay.dim, lay.index[0]) for path, lay in buffers.items()})
    with quiet_traces():
        with _module_stack(shadow) as stack:
            try:
                local = trace(shadow)
            except Exception as err:  # the localized model does not run: say where and why
                where = stack[-1] if stack else ""
                cause = err.__cause__ or err  # capture wraps the model's own exception
                text = str(cause).strip()
                first = f"{type(cause).__name__}: {text.splitlines()[0]}" if text else type(cause).__name__
                lines, line = _model_frames(cause)
                detail = f"{first}" + (f" (at {line})" if line else "")
                return [Mismatch(where, "", (), None, detail, lines)]
    return _compare(a, graph, local, gathered)


def _narrow_buffers(module: nn.Module, rows: dict[str, tuple[int, Any]]) -> None:
    """The shadow's buffers at ``rows`` (path -> (dim, rank 0's rows)) narrowed, as the
    runtime's :class:`~tpcompile.plan.modules.SliceBuffers` narrows them for ``module``'s
    forward, the only code that reads them (the analysis checked)."""
    for path, (dim, index) in rows.items():
        owner, _, leaf = path.rpartition(".")
        sub = module.get_submodule(owner) if owner else module
        whole = sub._buffers[leaf]
        sub._buffers[leaf] = whole.index_select(dim, torch.as_tensor(index, dtype=torch.long, device=whole.device))


def resolve_fixups(
    fixups: Fixups,
    ambiguous: dict[str, dict[str, list[Any]]],
    check: Callable[[Fixups], list[Mismatch]],
    problems: list[Mismatch],
    tp: int = 0,
    *,
    shaping: Callable[[dict[str, dict[str, list[Any]]]], dict[str, dict[str, list[Any]]]] | None = None,
) -> tuple[Fixups, list[Mismatch]]:
    """Pick a local value for each ambiguous attribute so the local trace matches.

    ``ambiguous[module][attr] = [global, [local candidates]]``.  The verified fix-ups go
    first (``problems``: what their own check found).  A module's attributes shape only
    its own forward, so the module the trace fails in is resolved on its own, then the
    next one (a sum of searches, not a product: Qwen3-Next's delta-net needs four sizes
    at once); ``shaping`` first narrows that module's attributes to those its forward
    turns into shapes.  Within a module, assignments are tried with the fewest changes first, those
    that split sizes evenly over ``tp`` ranks (a head count halved at tp=2) before others.
    """
    if not problems or not ambiguous:
        return fixups, problems
    trial = {m: dict(c) for m, c in fixups.items()}
    done: set[str] = set()
    while problems:
        where = problems[0].module
        left = [m for m in ambiguous if m not in done]
        # the module it fails in (or its parents, or children); else any module left
        mods = [m for m in left if where and (m == where or where.startswith(m + ".")
                                              or m.startswith(where + "."))] or left
        if not mods:
            break
        done.update(mods)
        here = {m: ambiguous[m] for m in mods}
        if shaping is not None:  # drop the attributes the forward never turns into a shape
            here = {m: attrs for m, attrs in shaping(here).items() if attrs}
        found = _search(trial, here, check, tp, problems[0]) if here else None
        if found is None:
            break
        trial, problems = found
        if problems and problems[0].module == where:
            break
    return (trial, problems) if not problems else (fixups, problems)


def resolve_sites(fixups: Fixups, problems: list[Mismatch], check: Callable[[Fixups], list[Mismatch]],
                  propose: Callable[[tuple[str, ...]], dict[str, dict[str, list[Any]]]]) -> tuple[
                      Fixups, list[Mismatch]]:
    """Make the sizes read at run time local, one failing line at a time
    (:mod:`.shape_sites`): ``propose(lines)`` gives the shape sites of the first problem's
    innermost line that has them, in every module that runs it; they are kept while the
    trace then gets past where it failed."""
    trial = {m: dict(c) for m, c in fixups.items()}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    while problems and len(seen) < _MAX_TRIALS:
        key = (problems[0].module, problems[0].lines)
        if not any(problems[0].lines) or key in seen:
            break
        seen.add(key)
        sites = propose(problems[0].lines)
        if problems[0].module not in sites:
            break
        nxt = {m: dict(c) for m, c in trial.items()}
        for mod, site in sites.items():
            nxt.setdefault(mod, {}).update(site)
        got = check(nxt)
        if got and (got[0].module, got[0].lines) == key:
            break  # the sites did not help: report the problem as it was
        trial, problems = nxt, got
    return trial, problems


def resolve_compared(fixups: Fixups, problems: list[Mismatch],
                     check: Callable[[Fixups], list[Mismatch]]) -> tuple[Fixups, list[Mismatch]]:
    """Give back their global value to the attributes an ``assert`` compares with a size
    read off the module's input (FSMT's ``assert embed_dim == self.embed_dim``, where
    ``embed_dim = query.size(2)`` of a replicated input): such an attribute was kept
    because the local value breaks the global model's trace, but the localized model
    needs it global too; the reshape by the read size is then a shape site.  Kept only if
    the trace then gets past the assert."""
    trial = {m: dict(c) for m, c in fixups.items()}
    while problems:
        first = problems[0]
        code = first.detail.partition("`")[2]
        if first.actual is not None or not first.detail.startswith("AssertionError") or not code:
            break
        named = {attr for attr in trial.get(first.module, {}) if re.search(rf"\bself\.{re.escape(attr)}\b", code)}
        if not named:
            break
        nxt = {m: {k: v for k, v in c.items() if not (m == first.module and k in named)} for m, c in trial.items()}
        got = check(nxt)
        if got and (got[0].module, got[0].lines) == (first.module, first.lines):
            break
        trial, problems = nxt, got
    return trial, problems


def _search(base: Fixups, ambiguous: dict[str, dict[str, list[Any]]],
            check: Callable[[Fixups], list[Mismatch]], tp: int,
            failing: Mismatch) -> tuple[Fixups, list[Mismatch]] | None:
    """The first assignment of ``ambiguous`` (on top of ``base``) whose trace no longer
    fails where it did (``failing``), with what the trace then reports; ``None`` if none
    does.  A failure at the same module and line is the same failure, also where that
    module is a child of an ambiguous one (Phi-3 with sdpa: one of two head counts made
    local still fails in ``o_proj``, whose input the parent's forward shaped)."""
    where = (failing.module, failing.lines)
    slots = [(m, attr, glob, [glob, *locs]) for m, attrs in ambiguous.items()
             for attr, (glob, locs) in attrs.items()]

    def cost(combo: tuple) -> tuple[int, int]:
        changed = [(v, s[2]) for v, s in zip(combo, slots, strict=True) if v != s[2]]
        return sum(not (tp and v * tp == g) for v, g in changed), len(changed)

    options = sorted(itertools.product(*(s[3] for s in slots)), key=cost)
    for combo in options[1:_MAX_TRIALS + 1]:  # the first is "change nothing": checked already
        trial = {m: dict(c) for m, c in base.items()}
        for (m, attr, glob, _), v in zip(slots, combo, strict=True):
            if v != glob:
                trial.setdefault(m, {})[attr] = [glob, v]
        got = check(trial)
        if not got or (got[0].module not in ambiguous and (got[0].module, got[0].lines) != where):
            return trial, got
    return None


class SelfCheckError(TPError):
    """The localized model does not match the plan; ``module`` is where it first fails."""

    def __init__(self, message: str, module: str, first: str) -> None:
        super().__init__(message)
        self.module = module
        self.first = first


def raise_mismatches(problems: list[Mismatch], model: nn.Module, tp: int) -> None:
    if not problems:
        return
    listed = "; ".join(str(p) for p in problems[:3])
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    raise SelfCheckError(
        f"tpcompile cannot split {type(model).__name__} over tp={tp} exactly: {listed}{more}. "
        "A size the model code computes from a global attribute or literal could not be made "
        "rank-local. Keep the module replicated with overrides={'re:<module>\\..*': 'replicated'}, "
        "pass strict=False to do that automatically, or try another tp.",
        problems[0].module, str(problems[0]),
    )
