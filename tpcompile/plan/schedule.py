"""A pipeline schedule as it runs: each rank's actions in torch's order, and their timing.

torch's schedules (``torch.distributed.pipelining``) run, on every pp rank, one list of
compute actions — a stage's forward ``F`` of a microbatch, its backward ``B``, or, for
the split-backward schedules, the input gradients ``I`` (sent on at once) and the weight
gradients ``W`` (run later, where the bubble would be).  :func:`schedule_order` gives that
list, replayed from torch's own code for the multi-stage schedules; :func:`simulate` runs
it against the stages' times: an action starts when its rank is free and what it reads
has arrived (the microbatch's forward from the stage before, its gradient from the stage
after, plus a hop between ranks), so the idle time it finds is the bubble of this
schedule on these stages — the fill and drain, and any stage heavier than the others
(a large-vocabulary head) — not the balanced-stage formula ``(pp - 1) / (v M + pp - 1)``,
which it reproduces for equal stages.

Example:
    >>> order, _ = timed_order("1f1b", 2, 1, 4)
    >>> runs = simulate(order, forward={0: 1.0, 1: 1.0}, backward={0: 2.0, 1: 2.0}, rank_of={0: 0, 1: 1})
    >>> round(idle_share(runs), 3)
    0.2
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import SimpleNamespace
from typing import Any

from ..errors import TPError
from .stages import SCHEDULES

__all__ = ["RankRun", "idle_share", "rank_of_stage", "schedule_order", "simulate", "simulate_stages",
           "stage_idle_share", "timed_order", "weight_share"]

Action = tuple[int, str]  # (stage, "F" | "B" | "I" | "W")
Order = dict[int, list[Action]]  # pp rank -> its actions in the order it runs them


def rank_of_stage(name: str, pp: int, stage: int) -> int:
    """The pp rank running ``stage``: looped (``s % pp``) or V-shaped (``zbv``, ``dualpipev``)."""
    if SCHEDULES[name].style == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def _torch_actions(name: str, pp: int, virtual: int, microbatches: int) -> dict[int, list[Any]]:
    """Each rank's compute actions in the order torch's multi-stage schedule class computes
    them (its ``_calculate_single_rank_operations``, called with the attributes its
    ``__init__`` sets; no stages or process group): torch's action objects."""
    from torch.distributed.pipelining import schedules

    cls = getattr(schedules, SCHEDULES[name].torch_class)
    rounds = max(1, microbatches // pp)
    state = SimpleNamespace(pp_group_size=pp, n_local_stages=virtual, _n_microbatches=microbatches,
                            num_stages=pp * virtual, _num_stages=pp * virtual, number_of_rounds=rounds,
                            microbatches_per_round=microbatches // rounds)

    return {r: [op for op in cls._calculate_single_rank_operations(state, r) if op is not None] for r in range(pp)}


def _parts(action: Any) -> list[Any]:
    """A torch action's compute parts (DualPipeV's overlapped forward + backward: two)."""
    return [p for sub in action.sub_actions for p in _parts(sub)] if action.sub_actions else [action]


def _rule_order(name: str, pp: int, virtual: int, microbatches: int) -> tuple[Order, str]:
    """Each rank's ``(stage, kind)`` actions by rule, where torch's order is not replayed."""
    if SCHEDULES[name].style == "single":
        out = {}
        for s in range(pp):
            warm = microbatches if name == "gpipe" else min(microbatches, pp - s)
            steady = [a for _ in range(microbatches - warm) for a in ((s, "B"), (s, "F"))]
            out[s] = [(s, "F")] * warm + steady + [(s, "B")] * warm
        return out, "all M" if name == "gpipe" else "min(M, pp - s) (torch Schedule1F1B's warm-up)"
    n = pp * virtual
    stages = {r: [s for s in range(n) if rank_of_stage(name, pp, s) == r] for r in range(pp)}
    order = {r: [(s, "F") for s in mine for _ in range(microbatches)] +
             [(s, "B") for s in reversed(mine) for _ in range(microbatches)] for r, mine in stages.items()}
    return order, "upper bound: all M per stage (torch's schedule order unavailable)"


@lru_cache(maxsize=256)  # a layout search asks for the same few schedules thousands of times
def timed_order(name: str, pp: int, virtual: int, microbatches: int) -> tuple[
        dict[int, list[list[tuple[int, str, int]]]], str]:
    """Each pp rank's compute actions ``(stage, kind, microbatch)`` in the order it runs
    them, grouped as it runs them (one action a group; DualPipeV's overlapped forward +
    backward two), and the rule they come from.

    GPipe runs every forward, then every backward.  1F1B's stage ``s`` of ``P`` runs
    ``min(M, P - s)`` forwards (torch's ``Schedule1F1B`` warm-up), then one backward and
    one forward at a time.  The multi-stage schedules (interleaved, zero-bubble, ZBV,
    DualPipeV) are replayed from torch's own action order and microbatch indices; should
    that private method be unavailable, every stage runs all ``M`` forwards, then all
    backwards (GPipe's order: an upper bound of what is held, and of the bubble).  The
    answer is cached: read it, do not change it.
    """
    if SCHEDULES[name].style != "single":
        try:
            actions = _torch_actions(name, pp, virtual, microbatches)
            return ({r: [[(p.stage_index, p.computation_type.value, p.microbatch_index) for p in _parts(op)]
                         for op in ops] for r, ops in actions.items()},
                    f"replayed from torch {SCHEDULES[name].torch_class}")
        except (AttributeError, TypeError, KeyError, ValueError):  # torch's private schedule IR changed
            pass
    order, rule = _rule_order(name, pp, virtual, microbatches)
    out: dict[int, list[list[tuple[int, str, int]]]] = {}
    for r, acts in order.items():
        count: dict[tuple[int, str], int] = {}
        out[r] = []
        for stage, kind in acts:  # each stage takes its microbatches in order
            out[r].append([(stage, kind, count.get((stage, kind), 0))])
            count[(stage, kind)] = count.get((stage, kind), 0) + 1
    return out, rule


def schedule_order(name: str, pp: int, virtual: int, microbatches: int) -> tuple[Order, str]:
    """:func:`timed_order` as each rank's flat list of ``(stage, kind)``, and its rule.

    Example:
        >>> schedule_order("1f1b", 2, 1, 3)[0][1]
        [(1, 'F'), (1, 'B'), (1, 'F'), (1, 'B'), (1, 'F'), (1, 'B')]
    """
    timed, rule = timed_order(name, pp, virtual, microbatches)
    return {r: [(s, k) for group in groups for s, k, _ in group] for r, groups in timed.items()}, rule


@dataclass(frozen=True)
class RankRun:
    """One pp rank's step in :func:`simulate`: the time it computed and when it finished."""

    busy: float
    finish: float


def _duration(stage: int, kind: str, forward: dict[int, float], backward: dict[int, float],
              weight: dict[int, float] | None) -> float:
    """An action's time: a split backward's halves are the input gradients ``I`` and the
    weight gradients ``W`` (``weight[stage]``: the weight pass's time, default half the
    backward; the input pass takes the rest, attention's products of activations included);
    the first stage has no input gradient, so its weight pass runs the whole backward (as
    torch's ``backward_weight_one_chunk`` does)."""
    if kind == "F":
        return forward[stage]
    if kind == "B":
        return backward[stage]
    if stage == 0:
        return 0.0 if kind == "I" else backward[stage]
    w = backward[stage] / 2 if weight is None else min(weight[stage], backward[stage])
    return w if kind == "W" else backward[stage] - w


@dataclass(frozen=True)
class _Graph:
    """A schedule's actions as a dependency graph, independent of the stages' times: the
    actions in an order where every input comes first, each with what it waits on (the
    rank's previous action and its inputs) and how many of those cross ranks."""

    actions: tuple[tuple[int, str, int], ...]  # (stage, kind, microbatch), in dependency order
    waits: tuple[tuple[int, ...], ...]  # per action: indices (into ``actions``) it starts after
    far: tuple[int, ...]  # per action: inputs that come from another rank (a hop each)
    ranks: dict[int, tuple[int, ...]]  # rank -> indices of its actions
    work: dict[int, dict[tuple[int, str], int]]  # rank -> how many actions of each (stage, kind) it runs


def _needs(stage: int, kind: str, last: int) -> tuple[tuple[int, str], ...]:
    """What an action reads: ``(stage, kinds)`` of the same microbatch (see :func:`simulate`)."""
    if kind == "F":
        return ((stage - 1, "F"),) if stage > 0 else ()
    if kind == "W":
        return ((stage, "I"),)
    return ((stage, "F"), (stage + 1, "BI")) if stage < last else ((stage, "F"),)


def _graph(order: dict[int, list[list[tuple[int, str, int]]]], rank_of: dict[int, int]) -> _Graph:
    """The dependency graph of ``order`` (see :func:`simulate` for what reads what).  Found
    in one pass driven by what is computed: a rank runs until an input is missing, then
    waits on the action that computes it (``O(A)`` for ``A`` actions, not a sweep of every
    rank per action).  A group (DualPipeV's overlapped forward + backward) is taken whole:
    torch schedules it once every part's input is in, runs the parts one by one and posts
    their sends after the last, so what a part computes is read from the group's end.  A
    schedule that cannot finish is a ``TPError``."""
    last = max(rank_of)
    index: dict[tuple[int, str, int], int] = {}  # an output -> the action after which it is sent
    actions: list[tuple[int, str, int]] = []
    waits: list[tuple[int, ...]] = []
    far: list[int] = []
    mine: dict[int, list[int]] = {r: [] for r in order}
    pos = dict.fromkeys(order, 0)
    waiting: dict[tuple[int, int], list[int]] = {}  # (stage, microbatch) -> ranks waiting on it
    todo = list(order)
    while todo:
        r = todo.pop()
        groups = order[r]
        while pos[r] < len(groups):
            group = groups[pos[r]]
            inside = {(s, kd, k) for s, kd, k in group}
            found: list[list[int]] = []
            hops: list[int] = []
            missing = None
            for stage, kind, k in group:
                found.append([])
                hops.append(0)
                for s_, kinds in _needs(stage, kind, last):
                    if any((s_, kd, k) in inside for kd in kinds):
                        continue  # computed earlier in this group, on this rank
                    i = next((index[(s_, kd, k)] for kd in kinds if (s_, kd, k) in index), None)
                    if i is None:
                        missing = (s_, k)
                        break
                    found[-1].append(i)
                    hops[-1] += rank_of[s_] != rank_of[stage]
                if missing is not None:
                    break
            if missing is not None:
                waiting.setdefault(missing, []).append(r)
                break
            for (stage, kind, k), reads, hop in zip(group, found, hops, strict=True):
                waits.append(tuple(([mine[r][-1]] if mine[r] else []) + reads))
                far.append(hop)
                mine[r].append(len(actions))
                actions.append((stage, kind, k))
            for stage, kind, k in group:
                index[(stage, kind, k)] = len(actions) - 1
                todo.extend(waiting.pop((stage, k), ()))
            pos[r] += 1
    stuck = {r: order[r][pos[r]] for r in order if pos[r] < len(order[r])}
    if stuck:
        raise TPError(f"pipeline schedule cannot finish: every rank waits ({stuck})")
    work: dict[int, dict[tuple[int, str], int]] = {r: {} for r in order}
    for r, ids in mine.items():
        for i in ids:
            sk = actions[i][:2]
            work[r][sk] = work[r].get(sk, 0) + 1
    return _Graph(tuple(actions), tuple(waits), tuple(far), {r: tuple(v) for r, v in mine.items()}, work)


def _run(graph: _Graph, forward: dict[int, float], backward: dict[int, float], hop: float,
         weight: dict[int, float] | None = None) -> dict[int, RankRun]:
    """Time ``graph``: each action starts when the last thing it waits on finished, plus a
    hop per input from another rank."""
    took = {(s, kd): _duration(s, kd, forward, backward, weight) for s in forward for kd in "FBIW"}
    dur = [took[(s, kd)] for s, kd, _ in graph.actions]
    fin = [0.0] * len(dur)
    for i, (waits, hops) in enumerate(zip(graph.waits, graph.far, strict=True)):
        start = max([fin[j] for j in waits]) if waits else 0.0
        fin[i] = start + hops * hop + dur[i]
    return {r: RankRun(busy=sum(n * took[sk] for sk, n in graph.work[r].items()), finish=fin[mine[-1]] if mine else 0.0)
            for r, mine in graph.ranks.items()}


def simulate(order: dict[int, list[list[tuple[int, str, int]]]], *, forward: dict[int, float],
             backward: dict[int, float], rank_of: dict[int, int], hop: float = 0.0,
             weight: dict[int, float] | None = None) -> dict[int, RankRun]:
    """Run ``order`` (:func:`timed_order`'s) against the stages' times per microbatch
    (``forward`` / ``backward`` by stage; ``weight``: the split backward's weight pass by
    stage, default half the backward; ``hop``: one point-to-point transfer between
    ranks).  A forward of microbatch ``k`` reads the previous stage's forward of ``k``; a
    backward (or input-gradient pass) its own forward and the next stage's backward or
    input pass of ``k``; a weight pass its input pass.  Each rank runs its actions one
    after another, each as soon as the rank is free and its inputs are in (an overlapped
    group's actions in their order: torch's runtime performs DualPipeV's sub-actions one
    by one, and sends what they computed after the last); an input from another rank costs the receiver a ``hop`` once both sides are
    there (the transfer completes when the receive is posted: a hidden state exceeds a
    socket's buffer), idle time, not busy.  A schedule that cannot finish is a ``TPError``.
    """
    return _run(_graph(order, rank_of), forward, backward, hop, weight)


@lru_cache(maxsize=160)
def _stage_graph(schedule: str, pp: int, virtual: int, microbatches: int) -> _Graph:
    """:func:`_graph` of a named schedule (cached: a layout search times the same few
    schedules on thousands of stage times)."""
    rank_of = {s: rank_of_stage(schedule, pp, s) for s in range(pp * virtual)}
    return _graph(timed_order(schedule, pp, virtual, microbatches)[0], rank_of)


def idle_share(runs: dict[int, RankRun]) -> float:
    """The step's idle share, mean over the ranks: ``1 - busy / span`` with the span the
    last rank's finish (every rank's step ends together, at the loss broadcast)."""
    span = max(run.finish for run in runs.values())
    if span <= 0:
        return 0.0
    return sum(1 - run.busy / span for run in runs.values()) / len(runs)


def simulate_stages(schedule: str, pp: int, virtual: int, microbatches: int, per_microbatch: dict[int, float],
                    hop: float = 0.0, weight_shares: dict[int, float] | None = None) -> dict[int, RankRun]:
    """:func:`simulate` of ``schedule`` on stages taking ``per_microbatch[s]`` for one
    microbatch's forward and backward (a third forward, two thirds backward);
    ``weight_shares[s]``: the weight pass's share of stage ``s``'s backward (default a half,
    see :func:`weight_share`)."""
    v = 1 if SCHEDULES[schedule].style == "single" else virtual
    backward = {s: 2 * t / 3 for s, t in per_microbatch.items()}
    weight = None if weight_shares is None else {s: b * weight_shares[s] for s, b in backward.items()}
    return _run(_stage_graph(schedule, pp, v, microbatches), {s: t / 3 for s, t in per_microbatch.items()},
                backward, hop, weight)


def weight_share(weight_flops: float, flops: float, recompute: bool = False) -> float:
    """The weight pass's share of a backward, from the forward's FLOPs and the part of them
    that multiplies parameters: the weight gradients repeat exactly those products, while
    the input gradients repeat them too and carry every product of two activations
    (attention's scores and values: no weight to differentiate) twice over; a recomputed
    forward (activation checkpointing) runs in the input pass."""
    if flops <= 0:
        return 0.5
    return min(weight_flops, flops) / ((3 if recompute else 2) * flops)


def stage_idle_share(schedule: str, pp: int, virtual: int, microbatches: int, per_microbatch: dict[int, float],
                     weight: dict[int, float] | None = None) -> float:
    """The idle share of a step of ``schedule`` on these stages (:func:`idle_share`;
    ``weight``: the weight passes' shares, :func:`simulate_stages`)."""
    return idle_share(simulate_stages(schedule, pp, virtual, microbatches, per_microbatch, weight_shares=weight))
