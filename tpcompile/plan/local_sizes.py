"""The localized model proven before a weight moves: sizes made rank-local, then traced.

Three kinds of sizes make a rank's model code run on its local tensors: attributes set to
local values (:mod:`~tpcompile.analysis.fixups`), attributes two sizes share, settled by
tracing each assignment, and sizes read off a tensor at run time, rewritten at their
reshape's line (:mod:`~tpcompile.analysis.shape_sites`).  :func:`local_fixups` finds them
and the self-check (:mod:`~tpcompile.analysis.selfcheck`) proves them on rank 0's shadow.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from ..analysis.fixups import find_fixups, graph_signature, verify_fixups
from ..analysis.roles import Analyzed
from ..analysis.selfcheck import (
    Mismatch,
    check_local,
    raise_mismatches,
    resolve_compared,
    resolve_fixups,
    resolve_sites,
)
from ..analysis.shape_sites import sites_for
from ..capture import Capture, capture
from ..capture.export import cut_to_traced
from ..capture.fake import shape_trace

__all__ = ["local_fixups", "size_signature"]


def size_signature(model: nn.Module, example_inputs: dict[str, Any] | None) -> Callable[[], Any]:
    """How the fix-ups tell a size that reaches a shape: a fake forward's ops and shapes
    (a fifth of a trace's time), or the retraced graph's where a fake forward of the
    model fails (a check only a real trace skips).  Decided at the first call, made on the
    model as it is (the baseline) before any attribute is changed."""
    fast: list[bool] = []

    def signature() -> Any:
        if not fast:
            try:
                baseline = shape_trace(model, example_inputs)
            except Exception:  # noqa: BLE001 - the capture ran this model: its graph answers
                fast.append(False)
            else:
                fast.append(True)
                return baseline
        if fast[0]:
            return shape_trace(model, example_inputs)
        return graph_signature(capture(model, example_kwargs=example_inputs).graph)

    return signature


def local_fixups(model: nn.Module, cap: Capture, a: Analyzed, tp: int,
                  example_inputs: dict[str, Any] | None, *, gathered: bool) -> dict[str, dict[str, list[int]]]:
    """Hard-coded sizes made rank-local, proven by tracing rank 0's localized model.

    Candidates whose local value does not change the traced graph are dropped; sizes
    two attributes share globally are resolved by trying assignments; whatever remains
    inconsistent (or crashes) raises a :class:`TPError` naming module, op and shapes."""
    # the capture's own inputs: built again from a localized copy (or from the model with
    # a trial attribute), a vision-language model's placeholders could no longer be counted
    # and its vision side would go unchecked (Janus crashed at run time so)
    traced = example_inputs if example_inputs is not None else cap.example_kwargs or None
    signature = size_signature(model, traced)
    fixups, ambiguous = find_fixups(a, model, gathered=gathered)
    if fixups:
        fixups = verify_fixups(model, fixups, signature)

    def trace(shadow: nn.Module) -> fx.Graph:
        inputs = None if traced is None else {
            k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in traced.items()}
        # traced as the plan's graph was: a plan captured whole (a sharded value crossed a
        # cut block) is compared with a whole local trace, not one cut to fewer blocks
        return capture(shadow, example_kwargs=inputs, cut_stacks=bool(cap.stacks.members)).graph

    def check(trial: dict[str, dict[str, list[int]]]) -> list[Mismatch]:
        with cut_to_traced(model, cap.stacks):  # the shadow copies the traced blocks only
            return check_local(model, a, cap.graph, trial, trace=trace, expand=cap.stacks.expand,
                               representative=cap.stacks.representative, gathered=gathered)

    def shaping(amb: dict[str, dict[str, list]]) -> dict[str, dict[str, list]]:
        """Only the attributes the forward turns into a shape (each costs a trace, so this
        runs for the modules the local trace fails in only)."""
        probe = {m: {k: [g, locs[0]] for k, (g, locs) in attrs.items()} for m, attrs in amb.items()}
        kept = verify_fixups(model, probe, signature)
        return {m: {k: amb[m][k] for k in attrs} for m, attrs in kept.items()}

    problems = check(fixups)
    while problems:
        first = (problems[0].module, problems[0].lines)
        # attributes an assert compares with the input's size stay global, sizes read
        # off a tensor at run time are made local at their reshapes' lines (one trace a
        # line), then attributes two sizes share (up to a trace per assignment)
        fixups, problems = resolve_compared(fixups, problems, check)
        fixups, problems = resolve_sites(fixups, problems, check, lambda lines: sites_for(a, lines))
        fixups, problems = resolve_fixups(fixups, ambiguous, check, problems, tp, shaping=shaping)
        if problems and (problems[0].module, problems[0].lines) == first:
            break
    raise_mismatches(problems, model, tp)
    return fixups
