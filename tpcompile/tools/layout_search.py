"""The layout search: gather the facts once, enumerate what the model admits, price it.

:func:`~tpcompile.tools.layout.plan_layout` is the entry point and documents the model
of memory and time; :mod:`~tpcompile.tools.layout_price` does the arithmetic.  What a
model admits (each refusal is counted under its reason):

* ``tp`` divides ``gpus`` and a node, and the model plans at it (heads that do not divide
  may keep parts replicated: the per-rank bytes say what that costs);
* ``pp`` fits the blocks (``pp x pp_virtual`` stages) and the pipeline probe admits the
  model; schedules ``gpipe``, ``1f1b``, ``interleaved_1f1b`` and ``zero_bubble`` (2
  stages per rank; not the V-shaped ``zbv`` / ``dualpipev``, which a model with tied
  embeddings cannot take) with ``pp, 2 pp, 4 pp, 8 pp`` microbatches dividing the
  per-rank batch;
* ``cp`` splits every sequence into ``2 cp`` chunks; ``ep`` divides the experts and
  ``dp_shard``; ``batch`` divides over ``dp_shard x dp_replicate``;
* what ``parallelize`` refuses is not searched: sequence parallelism needs ``tp > 1``
  and a plan that splits a stack; FP8 needs an FP8 rate in the profile and projections
  FP8 can run.  Every parallelism composes with pp (the hidden state crosses a stage
  boundary at CP's slice, split over tp under sequence parallelism).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from ..errors import TPError
from .hardware import HardwareProfile
from .layout import Layout, LayoutReport, Prediction, _divisors
from .layout_facts import (
    TPFacts,
    context_capture_or_reason,
    fp8_activation_ratio,
    model_facts,
    sequence_parallel_refused,
    tp_facts,
)
from .layout_price import Pricer

__all__ = ["price_given", "search"]

# the V-shaped schedules (zbv, dualpipev) are left out: they hold the first and the last
# stage on one rank, which a model with tied embeddings cannot take
_SCHEDULES = (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2))
_MICROBATCHES = (1, 2, 4, 8)  # x pp


def _sp_saving(facts: dict[int, TPFacts], seq: int) -> dict[int, list[float]]:
    """Per tp, per block: bytes per token sequence parallelism saves.  The part of a
    block's saved tensors that does not shrink with tp (norms, residual stream) is
    ``R = (tp A_tp - A_1) / (tp - 1)`` from the tp and tp=1 estimates; SP keeps ``1/tp``
    of it, except the inputs entering TP regions, which column projections save whole
    after SP's all-gather."""
    base = facts.get(1)
    out: dict[int, list[float]] = {}
    for tp, f in facts.items():
        if tp == 1 or base is None:
            continue
        out[tp] = [max(0.0, (tp * a - a1) / (tp - 1) / seq - e) * (1 - 1 / tp)
                   for a, a1, e in zip(f.acts["block"], base.acts["block"], f.enter_bytes, strict=True)]
    return out


def _gather(model: nn.Module, name: str, hw: HardwareProfile, gpus: int, gpn: int, seq: int,
            fp8: bool, refused: dict[str, int], notes: list[str]) -> tuple[Any, dict[int, TPFacts], dict]:
    """The per-model and per-tp facts, and the switches the model admits."""
    mf = model_facts(model, seq=seq, name=name)
    want_cp = gpus > 1 and seq % 4 == 0
    ccap, cp_why = context_capture_or_reason(model) if want_cp else (None, "no cp > 1 divides the sequence")
    if cp_why and want_cp:
        notes.append(f"context parallelism not searched: {cp_why}")
    facts: dict[int, TPFacts] = {}
    for tp in _divisors(gpus):
        if tp > gpn or gpn % tp:
            continue
        try:
            facts[tp] = tp_facts(mf, tp, context=ccap)
        except Exception as exc:  # noqa: BLE001 - a tp the model does not plan at is a refusal, named
            refused[f"tp={tp}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"] = 1
        else:
            notes += [f"tp={tp}: {w}" for w in facts[tp].warnings]
    if not facts:
        whys = {why.partition(": ")[2] for why in refused}
        raise TPError(f"{name}: no tensor-parallel degree can be priced: "
                      + (f"every tp: {whys.pop()}" if len(whys) == 1 else "; ".join(refused)))
    if max(facts) < gpus:
        notes.append(f"tp > {max(facts)} not searched: tensor parallelism stays inside a node of {gpn}")
    sp_why = next((sequence_parallel_refused(mf, facts[t]) for t in sorted(facts) if t > 1), "needs tp > 1")
    if sp_why:
        notes.append(f"sequence parallelism not searched: {sp_why}")
    ratio, fp8_on = 1.0, False
    if fp8 and hw.achievable("fp8") > 0:
        top = facts[max(facts)]
        if top.fp8_fraction <= 0:
            notes.append("fp8 not searched: no projection FP8 can run")
        else:
            try:
                ratio, fp8_on = fp8_activation_ratio(mf, top), True
            except Exception as exc:  # noqa: BLE001 - torchao missing, or the FP8 estimate fails
                notes.append(f"fp8 not searched: {type(exc).__name__}: {exc}")
    elif fp8:
        notes.append(f"fp8 not searched: {hw.name} has no FP8 rate")
    return mf, facts, {"cp": ccap is not None, "sp": sp_why is None, "fp8": fp8_on, "fp8_ratio": ratio}


def _refuse(refused: dict[str, int], why: str) -> None:
    refused[why] = refused.get(why, 0) + 1


def _pipelines(pricer: Pricer, pp: int, per_rank: int, blocks: int) -> list[tuple[str, int, int]] | str:
    """``(schedule, virtual, microbatches)`` to price for ``pp``, or why none."""
    if pp == 1:
        return [("", 1, 1)]
    out = []
    for name, v in _SCHEDULES:
        if blocks < pp * v or isinstance(pricer.stages(pp, v), str):
            continue
        out += [(name, v, k * pp) for k in _MICROBATCHES if per_rank % (k * pp) == 0]
    if not out:
        return (f"pp={pp}: {per_rank} sequence(s) per data-parallel rank do not split into >= {pp} microbatches"
                if blocks >= pp else f"pp={pp}: more stages than the {blocks} blocks")
    return out


def _candidates(mf: Any, facts: dict[int, TPFacts], pricer: Pricer, ok: dict, *, gpus: int, batch: int,
                refused: dict[str, int]) -> Any:
    """Every admitted layout (refusals counted per degree combination)."""
    seq, blocks = mf.seq, len(mf.blocks)
    for tp, f in sorted(facts.items()):
        for pp in _divisors(gpus // tp):
            if pp > 1 and mf.pp_refused:
                _refuse(refused, f"pp > 1: {mf.pp_refused}")
                continue
            for cp in _divisors(gpus // tp // pp):
                if cp > 1 and (not ok["cp"] or seq % (2 * cp)):
                    _refuse(refused, f"cp={cp}: the sequence of {seq} does not split into 2 x cp chunks"
                            if ok["cp"] else "cp: not admitted (see notes)")
                    continue
                dp = gpus // (tp * pp * cp)
                if batch % dp:
                    _refuse(refused, f"batch {batch} does not divide over dp_shard x dp_replicate = {dp}")
                    continue
                pipes = _pipelines(pricer, pp, batch // dp, blocks)
                if isinstance(pipes, str):
                    _refuse(refused, pipes)
                    continue
                yield from _variants(f, ok, tp, pp, cp, dp, pipes)


def _variants(f: TPFacts, ok: dict, tp: int, pp: int, cp: int, dp: int, pipes: list) -> Any:
    for dr in _divisors(dp):
        ds = dp // dr
        eps = [1] + [e for e in _divisors(ds) if e > 1 and f.experts and f.experts % e == 0]
        for ep in eps:
            for sp in (False, True) if ok["sp"] and tp > 1 else (False,):
                for ac in (False, True):
                    for fp8 in (False, True) if ok["fp8"] else (False,):
                        for name, v, m in pipes:
                            yield Layout(tp=tp, pp=pp, pp_schedule=name or None, pp_microbatches=m if pp > 1
                                         else None, pp_virtual=v, cp=cp, ep=ep, dp_shard=ds, dp_replicate=dr,
                                         sequence_parallel=sp, activation_checkpointing=ac, fp8=fp8)


def _used(dim: str, lay: Layout) -> bool:
    """Whether the step communicates over mesh dim ``dim`` at all."""
    return {"tp": lay.tp, "cp": lay.cp, "fsdp": lay.dp_shard * lay.cp, "ep": lay.ep,
            "efsdp": lay.dp_shard * lay.cp // lay.ep if lay.ep > 1 else 1, "dp_replicate": lay.dp_replicate,
            "pp": lay.pp}[dim] > 1


def _structure(lay: Layout) -> tuple:
    """A layout without its pipeline schedule and its split of the data-parallel ranks
    into shards and replicas: the ranking keeps the best of each (at equal time the
    least memory, so HSDP shows where it is faster)."""
    return (lay.tp, lay.pp, lay.cp, lay.ep, lay.dp_shard * lay.dp_replicate, lay.sequence_parallel,
            lay.activation_checkpointing, lay.fp8)


def _order(p: Prediction) -> tuple[float, float]:
    """Faster first; at equal time, less memory (more room left for a larger batch)."""
    return (round(p.time["total"], 9), p.memory["total"])


def _setup(model: nn.Module, *, name: str, hw: HardwareProfile, gpus: int, gpn: int, batch: int, seq: int,
           dtype: str, usable: float, fp8: bool, refused: dict[str, int], notes: list[str]) -> tuple[Any, ...]:
    mf, facts, ok = _gather(model, name, hw, gpus, gpn, seq, fp8, refused, notes)
    pricer = Pricer(mf, facts, hw, batch=batch, dtype=dtype, gpus=gpus, gpus_per_node=gpn, usable=usable,
                    fp8_ratio=ok["fp8_ratio"], sp_saving=_sp_saving(facts, seq))
    return mf, facts, ok, pricer


def _predict(pricer: Pricer, lay: Layout) -> Prediction:
    p = pricer.price(lay)
    return Prediction(layout=lay, memory=p["memory"], time=p["time"], mfu=p["mfu"], tokens_per_s=p["tokens_per_s"],
                      fits=p["fits"], inter_node=tuple(d for d, c in p["links"].items() if c and _used(d, lay)))


def price_given(model: nn.Module, layouts: list[Layout], *, name: str, hw: HardwareProfile, gpus: int, gpn: int,
                batch: int, seq: int, dtype: str, usable: float) -> list[Prediction]:
    """The predictions of exactly ``layouts``, each one the search admits (else a
    TPError naming the layout and the reasons the search refused degrees)."""
    refused: dict[str, int] = {}
    mf, facts, ok, pricer = _setup(model, name=name, hw=hw, gpus=gpus, gpn=gpn, batch=batch, seq=seq, dtype=dtype,
                                   usable=usable, fp8=any(lay.fp8 for lay in layouts), refused=refused, notes=[])
    admitted = set(_candidates(mf, facts, pricer, ok, gpus=gpus, batch=batch, refused=refused))
    for lay in layouts:
        if lay not in admitted:
            why = "; ".join(refused) or "its degrees do not multiply to the GPUs, or a switch is not admitted"
            raise TPError(f"layout {lay.label()} is not one the search admits for {name} on {gpus} x {hw.name} at "
                          f"batch {batch} x seq {seq} ({why})")
    return [_predict(pricer, lay) for lay in layouts]


def search(model: nn.Module, *, name: str, hw: HardwareProfile, gpus: int, gpn: int, batch: int, seq: int,
           dtype: str, top: int, usable: float, fp8: bool) -> LayoutReport:
    """Gather, enumerate, price, rank (see the module docstring)."""
    refused: dict[str, int] = {}
    notes: list[str] = []
    mf, facts, ok, pricer = _setup(model, name=name, hw=hw, gpus=gpus, gpn=gpn, batch=batch, seq=seq, dtype=dtype,
                                   usable=usable, fp8=fp8, refused=refused, notes=notes)
    fits: dict[tuple, Prediction] = {}
    unfit: dict[tuple, Prediction] = {}
    priced = 0
    for lay in _candidates(mf, facts, pricer, ok, gpus=gpus, batch=batch, refused=refused):
        pred = _predict(pricer, lay)
        priced += 1
        key = _structure(lay)
        if pred.fits:
            if key not in fits or _order(pred) < _order(fits[key]):
                fits[key] = pred
        elif key not in unfit or pred.memory["total"] < unfit[key].memory["total"]:
            unfit[key] = pred  # of a layout that does not fit, the variant closest to fitting
    ranked = sorted(fits.values(), key=_order)
    losers = sorted(unfit.values(), key=_order)
    if not ranked:
        notes.append("no layout fits: raise gpus, lower batch or seq, or use a profile with more memory")
    return LayoutReport(model=name, gpus=gpus, gpus_per_node=gpn, hardware=hw.name, batch=batch, seq=seq,
                        dtype=dtype, usable_memory=usable, ranked=ranked[:top], fitting=len(ranked), priced=priced,
                        unfit=losers[:3], unfit_count=len(losers), refused=refused, notes=notes)
