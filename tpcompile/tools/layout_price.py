"""Pricing one layout: memory per rank and step time, from the facts of layout_facts.py.

:func:`~tpcompile.tools.layout.plan_layout` documents the model; this module is its
arithmetic, kept apart so the search loop reads as a search.  Everything is per rank and
per step; ``mb`` sequences per microbatch, ``L = seq / cp`` positions of each on a rank.

Collective times over ``p`` ranks on a link of bus bandwidth ``bw`` and latency ``a`` per
step (nccl-tests' bus-bandwidth convention; latency steps as tree / recursive doubling):

    all-reduce of n bytes            2 ceil(log2 p) a + 2 (p - 1) / p  n / bw
    all-gather, each rank passes n     ceil(log2 p) a +     (p - 1)    n / bw
    reduce-scatter of an n-byte input  ceil(log2 p) a +    (p - 1) / p n / bw
    all-to-all of n bytes              ceil(log2 p) a +    (p - 1) / p n / bw
    point-to-point                                a +                  n / bw
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import TPError
from .hardware import HardwareProfile, Link
from .layout_facts import ModelFacts, TPFacts

if TYPE_CHECKING:
    from .layout import Layout

__all__ = ["Mesh", "Pricer", "collective_time"]


def collective_time(op: str, p: int, nbytes: float, link: Link) -> float:
    """Seconds of one collective (see the module docstring); 0 on one rank."""
    if p <= 1:
        return 0.0
    log = math.ceil(math.log2(p))
    bandwidth, latency = link.for_op(op)
    if op == "all_reduce":
        return 2 * log * latency + 2 * (p - 1) / p * nbytes / bandwidth
    if op in ("all_gather", "all_gather_into_tensor"):
        return log * latency + (p - 1) * nbytes / bandwidth
    if op == "p2p":
        return latency + nbytes / bandwidth
    if op == "broadcast":
        return log * latency + nbytes / bandwidth
    return log * latency + (p - 1) / p * nbytes / bandwidth  # reduce-scatter, all-to-all


@dataclass(frozen=True)
class Mesh:
    """Which link each mesh dim runs on: dims ``(pp, dp_replicate, dp_shard, cp, tp)``,
    innermost last, ranks numbered consecutively, ``gpus_per_node`` per node; a group
    stays inside a node when its span (stride x size) fits in and divides a node."""

    tp: int
    cp: int
    dp_shard: int
    dp_replicate: int
    pp: int
    ep: int
    gpus_per_node: int

    def crosses(self, stride: int, size: int) -> bool:
        span = stride * size
        return size > 1 and not (span <= self.gpus_per_node and self.gpus_per_node % span == 0)

    def dims(self) -> dict[str, bool]:
        """``{dim: crosses nodes}`` for every group the step communicates over."""
        tp, cp, ds, dr, ep = self.tp, self.cp, self.dp_shard, self.dp_replicate, self.ep
        return {"tp": self.crosses(1, tp), "cp": self.crosses(tp, cp), "fsdp": self.crosses(tp, ds * cp),
                "ep": self.crosses(tp * cp, ep), "efsdp": self.crosses(tp * cp * ep, ds * cp // ep),
                "dp_replicate": self.crosses(tp * cp * ds, dr), "pp": self.crosses(tp * cp * ds * dr, self.pp)}


def _linear(entries: list[tuple[str, str, str, float, float, float]], groups: dict[str, tuple[int, Link]]) -> dict[
        str, tuple[float, float]]:
    """``{phase: (seconds per token, seconds)}`` of a bucket's collectives: their time is
    linear in the tokens of a call (bytes = per token x tokens + fixed)."""
    out = {"forward": [0.0, 0.0], "backward": [0.0, 0.0]}
    for phase, op, group, calls, per_token, fixed in entries:
        p, link = groups.get(group, groups["tp"])
        base = collective_time(op, p, fixed, link)
        slope = collective_time(op, p, fixed + 1.0, link) - base  # seconds per byte
        out[phase][0] += calls * slope * per_token
        out[phase][1] += calls * base
    return {k: (v[0], v[1]) for k, v in out.items()}


def _sequence_parallel(entries: list[tuple[str, str, str, float, float, float]], tp: int) -> list[
        tuple[str, str, str, float, float, float]]:
    """The blocks' TP collectives as sequence parallelism runs them: each all-reduce of a
    region's output (forward) or input gradient (backward) becomes an all-gather of this
    rank's tokens where the region enters and a reduce-scatter where it leaves, the same
    bytes (on a link whose all-gather is slower than its all-reduce, as gloo's, SP costs
    more time than TP)."""
    out = []
    for phase, op, group, calls, per_token, fixed in entries:
        if op == "all_reduce" and group == "tp" and per_token and not fixed:  # activations, not gradient sums
            out += [(phase, "all_gather", group, calls, per_token / tp, fixed / tp),
                    (phase, "reduce_scatter_tensor", group, calls, per_token, fixed)]
        else:
            out.append((phase, op, group, calls, per_token, fixed))
    return out


@dataclass
class _Stage:
    """One pipeline stage: its blocks (indices), its place and its pp rank (the whole
    model when pp = 1)."""

    blocks: list[int]
    first: bool
    last: bool
    rank: int


class Pricer:
    """Prices layouts of one model on one profile; caches what repeats across layouts."""

    def __init__(self, mf: ModelFacts, facts: dict[int, TPFacts], hw: HardwareProfile, *, batch: int,
                 dtype: str, gpus: int, gpus_per_node: int, usable: float, fp8_ratio: float,
                 sp_saving: dict[int, list[float]]) -> None:
        self.mf, self.facts, self.hw = mf, facts, hw
        self.batch, self.dtype, self.gpus, self.gpn, self.usable = batch, dtype, gpus, gpus_per_node, usable
        self.fp8_ratio, self.sp_saving = fp8_ratio, sp_saving
        self.rate = hw.achievable(dtype)
        self.rate8 = hw.achievable("fp8")
        if self.rate <= 0:
            raise TPError(f"hardware {hw.name!r} has no achievable {dtype} rate")
        self._stages: dict[tuple[int, int], list[_Stage] | str] = {}
        self._orders: dict[tuple[str, int, int, int], dict[int, list[tuple[int, str]]]] = {}
        self._sims: dict[tuple, tuple[float, float]] = {}
        self._peaks: dict[tuple, tuple[float, float]] = {}
        self._lin: dict[tuple[int, int, bool], tuple[dict, ...]] = {}
        self._fit: dict[tuple[int, int], dict[str, Any]] = {}
        self._unit_cache: dict[tuple, dict[str, float]] = {}

    # ---------------------------------------------------------------- cached pieces

    def stages(self, pp: int, virtual: int) -> list[_Stage] | str:
        """The stages ``parallelize(pp=...)`` would cut (balanced by forward FLOPs), or why not."""
        key = (pp, virtual)
        if key not in self._stages:
            from ..plan.stages import plan_stages

            mf = self.mf
            if pp == 1:
                self._stages[key] = [_Stage(list(range(len(mf.blocks))), True, True, 0)]
                return self._stages[key]
            try:
                sp = plan_stages(mf.blocks, mf.block_flops, mf.block_params, pp=pp,
                                 schedule="1f1b" if virtual == 1 else "interleaved_1f1b", virtual=virtual,
                                 microbatches=pp, stack=mf.stack, pre=mf.pre, post=mf.post, pre_flops=mf.pre_flops,
                                 post_flops=mf.post_flops, pre_params=mf.pre_params, post_params=mf.post_params)
            except TPError as exc:
                self._stages[key] = str(exc)
                return self._stages[key]
            index = {b: i for i, b in enumerate(mf.blocks)}
            self._stages[key] = [_Stage([index[b] for b in s.blocks], s.first, s.last, s.rank) for s in sp.stages]
        return self._stages[key]

    def _weight_shares(self, stages: list[_Stage], recompute: bool) -> dict[int, float]:
        """Each stage's weight pass as a share of its backward, for the split-backward
        schedules (:func:`~tpcompile.plan.schedule.weight_share`): the blocks' products of
        parameters, and the head's, against all their FLOPs."""
        from ..plan.schedule import weight_share

        mf = self.mf
        out = {}
        for i, s in enumerate(stages):
            post = mf.post_flops if s.last else 0.0
            out[i] = weight_share(sum(mf.block_weight_flops[b] for b in s.blocks) + post,
                                  sum(mf.block_flops[b] for b in s.blocks) + post, recompute)
        return out

    def _simulated(self, lay: Layout, m: int, times: dict[int, float], hop: float,
                   shares: dict[int, float]) -> tuple[float, float]:
        """The busiest rank's busy time and the span of ``lay``'s schedule on these stage
        times (:func:`~tpcompile.plan.schedule.simulate_stages`).  A search prices
        thousands of pipelines whose stages differ mostly in scale: the simulation runs on
        the times relative to the slowest stage, rounded to 1%, and is cached (a long
        schedule is tens of thousands of actions)."""
        from ..plan.schedule import simulate_stages
        from ..plan.stages import SCHEDULES

        unit = max(times.values()) or 1.0
        rel = tuple(round(t / unit, 2) for t in times.values())
        # the hop to 2 significant digits: on fast links it is a tiny share of a stage, yet a
        # long schedule makes thousands of hand-offs (rounding it to 0.1% would drop it)
        split = SCHEDULES[lay.pp_schedule].split_backward
        weights = tuple(round(shares[i], 2) for i in range(len(rel))) if split else ()
        key = (lay.pp_schedule, lay.pp, lay.pp_virtual, m, rel, weights, float(f"{hop / unit:.2g}"))
        if key not in self._sims:
            runs = simulate_stages(lay.pp_schedule, lay.pp, lay.pp_virtual, m, dict(enumerate(rel)), hop=key[-1],
                                   weight_shares=dict(enumerate(weights)) if split else None)
            self._sims[key] = (max(r.busy for r in runs.values()), max(r.finish for r in runs.values()))
        busy, span = self._sims[key]
        return busy * unit, span * unit

    def order(self, schedule: str, pp: int, virtual: int, m: int) -> dict[int, list[tuple[int, str]]]:
        """Each pp rank's actions in torch's schedule order (cached)."""
        key = (schedule, pp, virtual, m)
        if key not in self._orders:
            from ..plan.schedule import schedule_order

            self._orders[key] = schedule_order(schedule, pp, virtual, m)[0]
        return self._orders[key]

    def _tp_lin(self, tp: int, world: int, world_crosses: bool, sp: bool = False) -> tuple[dict, ...]:
        key = (tp, world, world_crosses, sp)
        if key not in self._lin:
            f = self.facts[tp]
            groups = {"tp": (tp, self.hw.intra_node), "world": (world, self.hw.link(inter_node=world_crosses))}
            # (TP block, pre, post, FP8 block, pre, post)
            self._lin[key] = tuple(_linear(_sequence_parallel(getattr(b, part), tp) if sp and part == "block"
                                           else getattr(b, part), groups)
                                   for b in (f.comm, f.fp8_comm) for part in ("block", "pre", "post"))
        return self._lin[key]

    def _fitted(self, tp: int, cp: int) -> dict[str, Any]:
        """Activations per sequence of each block and part on a rank of a CP group: every
        position-local tensor and every ``queries x keys`` one (eager attention's scores:
        local queries, all keys) is ``1 / cp`` of the whole sequence's, plus the keys and
        values gathered beyond this rank's own."""
        key = (tp, cp)
        if key not in self._fit:
            f, seq = self.facts[tp], self.mf.seq
            if cp == 1:
                self._fit[key] = f.acts
            else:
                kv = f.kv_bytes or [0.0] * len(f.acts["block"])
                self._fit[key] = {"block": [a / cp + k * seq * (1 - 1 / cp) for a, k in zip(f.acts["block"], kv,
                                                                                              strict=True)],
                                  **{k: f.acts[k] / cp for k in ("pre", "post", "logits", "loss")}}
        return self._fit[key]

    # ---------------------------------------------------------------- one layout

    def price(self, lay: Layout) -> dict[str, Any]:
        """``{"memory": {...}, "time": {...}, "mfu", "tokens_per_s", "fits"}`` of ``lay``
        (a :class:`~tpcompile.tools.layout.Layout` the model admits)."""
        mf, f, hw = self.mf, self.facts[lay.tp], self.hw
        stages = self.stages(lay.pp, lay.pp_virtual)
        assert isinstance(stages, list), stages
        mesh = Mesh(lay.tp, lay.cp, lay.dp_shard, lay.dp_replicate, lay.pp, lay.ep, self.gpn)
        cross = mesh.dims()
        link = {d: hw.link(inter_node=c) for d, c in cross.items()}
        m = lay.pp_microbatches or 1
        mb = self.batch // (lay.dp_shard * lay.dp_replicate) // m
        positions = mf.seq / lay.cp
        tokens = mb * positions
        acts = self._fitted(lay.tp, lay.cp)
        world = self.gpus
        lin = self._tp_lin(lay.tp, world, world > self.gpn, lay.sequence_parallel)
        per_stage = [self._stage(lay, f, s, acts, lin, link, tokens, positions, mb) for s in stages]
        ranks: dict[int, list[dict[str, float]]] = {}
        for s, numbers in zip(stages, per_stage, strict=True):
            ranks.setdefault(s.rank, []).append(numbers)
        order = self.order(lay.pp_schedule, lay.pp, lay.pp_virtual, m) if lay.pp > 1 else None
        best: dict[str, Any] | None = None
        worst_mem: dict[str, float] | None = None
        for r, mine in ranks.items():
            idx = [i for i, s in enumerate(stages) if s.rank == r]
            busy = {k: m * sum(x[k] for x in mine) for k in ("compute", "tp", "cp", "ep")}
            units = self._units(lay, f, r, [stages[i] for i in idx])
            fsdp_total, fsdp_fixed = self._fsdp(lay, units, link)
            rest = fsdp_total - fsdp_fixed  # what prefetching may hide behind compute, as far as the hardware overlaps
            exposed = fsdp_total - hw.comm_overlap * min(rest, busy["compute"])
            mem = self._memory(lay, units, f, {i: per_stage[i] for i in idx}, stages, order, r, mb)
            if best is None or sum(busy.values()) + exposed > best["busy"] + best["fsdp"]:
                best = {"busy": sum(busy.values()), "fsdp": exposed, **busy}
            if worst_mem is None or mem["total"] > worst_mem["total"]:
                worst_mem = mem
        assert best is not None and worst_mem is not None
        t = {k: best[k] for k in ("compute", "tp", "cp", "ep")}
        t["fsdp_exposed"] = best["fsdp"]
        t["bubble"] = t["p2p"] = 0.0
        if lay.pp > 1:
            # the schedule's idle share on the busiest rank: torch's action order run
            # against each stage's time per microbatch (a heavier stage idles the others)
            times = {i: sum(n[k] for k in ("compute", "tp", "cp", "ep")) for i, n in enumerate(per_stage)}
            shares = self._weight_shares(stages, lay.activation_checkpointing)
            busy_max, span = self._simulated(lay, m, times, 0.0, shares)
            frac = 1 - busy_max / span
            # idle f of the step: busy / (1 - f) in all.  Where devices share compute (ranks
            # on one host's cores), a busy rank computes at the solo rate while its peers
            # idle, the step never shorter than the shared rate allows (solo = shared: f / (1 - f))
            comm = best["busy"] - best["compute"]
            solo = best["compute"] * self.rate / hw.solo(self.dtype)  # solo() falls back to the shared rate
            t["bubble"] = max(0.0, (solo + comm) / (1 - frac) - best["busy"])
            sent = tokens * mf.hidden_bytes_per_token / (lay.tp if lay.sequence_parallel else 1)  # as split
            hop = collective_time("p2p", 2, sent, link["pp"]) + hw.pp_handoff  # the runtime's own share
            # every hand-off the schedule makes, received as the receiver gets to it: what
            # the same order lasts longer with each transfer taking a hop
            t["p2p"] = self._simulated(lay, m, times, hop, shares)[1] - span
        t["total"] = sum(t.values())
        model_flops = 3 * mf.model_flops_per_token * self.batch * mf.seq
        peak = hw.peak(self.dtype)
        return {"memory": worst_mem, "time": t, "fits": worst_mem["total"] <= self.usable,
                "mfu": model_flops / (t["total"] * self.gpus * peak) if peak else 0.0,
                "tokens_per_s": self.batch * mf.seq / t["total"], "links": cross}

    def _stage(self, lay: Layout, f: TPFacts, s: _Stage, acts: dict[str, Any], lin: tuple, link: dict[str, Link],
               tokens: float, positions: float, mb: int) -> dict[str, float]:
        """One stage's compute and exposed collectives per microbatch, and its activations
        per sequence (held per microbatch in flight, and the one block AC recomputes)."""
        mf, ac, n = self.mf, int(lay.activation_checkpointing), len(s.blocks)
        flops = sum(f.flops[i] for i in s.blocks) * (3 + ac) + (3 * f.post_flops if s.last else 0.0)
        flops *= tokens
        if lay.fp8 and self.rate8 > 0:
            compute = flops * (f.fp8_fraction / self.rate8 + (1 - f.fp8_fraction) / self.rate)
        else:
            compute = flops / self.rate
        blk, pre, post, blk8, pre8, post8 = lin
        parts = [(blk, n), (pre, int(s.first)), (post, int(s.last))]
        if lay.fp8:
            parts += [(blk8, n), (pre8, int(s.first)), (post8, int(s.last))]
        tp = sum(k * ((c["forward"][0] * tokens + c["forward"][1]) * (1 + ac) + c["backward"][0] * tokens
                      + c["backward"][1]) for c, k in parts)
        cp = 0.0
        if lay.cp > 1 and f.kv_bytes:
            kv = sum(f.kv_bytes[i] for i in s.blocks) * mb * mf.seq  # the gathered K + V, all calls
            calls = f.kv_calls * n
            cp = (2 + ac) * (collective_time("reduce_scatter_tensor", lay.cp, kv, link["cp"])
                             + (calls - 1) * collective_time("reduce_scatter_tensor", lay.cp, 0.0, link["cp"]))
        ep = 0.0
        if lay.ep > 1 and f.moe_layers:
            layers = f.moe_layers / len(mf.blocks) * n
            rows = tokens * mf.top_k * mf.width * mf.itemsize
            ep = (4 + 2 * ac) * layers * collective_time("all_to_all_single", lay.ep, rows, link["ep"])
        block = [acts["block"][i] * (self.fp8_ratio if lay.fp8 else 1.0) for i in s.blocks]
        if lay.sequence_parallel:
            saving = self.sp_saving.get(lay.tp, [0.0] * len(mf.blocks))
            block = [b - saving[i] * positions for b, i in zip(block, s.blocks, strict=True)]
        hidden = mf.hidden_bytes_per_token * positions / (lay.tp if lay.sequence_parallel else 1)
        held = n * hidden if ac else sum(block)
        held += (acts["pre"] if s.first else 0.0) + (acts["post"] + acts["logits"] + acts["loss"] if s.last else 0.0)
        if lay.pp > 1 and not s.last:
            held += hidden  # the stage output torch keeps for backward
        return {"compute": compute, "tp": tp, "cp": cp, "ep": ep, "held": held,
                "live": max(block, default=0.0) if ac else 0.0}

    def _units(self, lay: Layout, f: TPFacts, rank: int, stages: list[_Stage]) -> dict[str, float]:
        """This rank's FSDP2 units summed: ``count``, ``gathered`` (dense bytes as
        all-gathered: FP8-gathered weights at one byte), ``dense``, ``experts`` (this
        rank's ``1 / ep``), the largest unit ``max_gathered`` / ``max_grads``, the
        ``root``'s bytes and the trainable ``tensors``; cached per rank and switches."""
        key = (lay.tp, lay.pp, lay.pp_virtual, rank, lay.ep, lay.fp8)
        if key not in self._unit_cache:
            shrink = 1 - 1 / self.mf.itemsize if lay.fp8 else 0.0
            mine = [i for s in stages for i in s.blocks]
            gathered = [f.dense_bytes[i] - f.fp8_weight_bytes[i] * shrink + f.expert_bytes[i] / lay.ep for i in mine]
            grads = [f.dense_bytes[i] + f.expert_bytes[i] / lay.ep for i in mine]
            if lay.pp == 1:
                root, tensors = f.root_bytes, f.root_tensors
            else:
                root = sum(f.pre_bytes for s in stages if s.first) + sum(f.post_bytes for s in stages if s.last)
                tensors = sum(f.pre_tensors for s in stages if s.first) + sum(f.post_tensors for s in stages if s.last)
            self._unit_cache[key] = {
                "count": len(mine), "gathered": sum(f.dense_bytes[i] - f.fp8_weight_bytes[i] * shrink for i in mine),
                "dense": sum(f.dense_bytes[i] for i in mine), "experts": sum(f.expert_bytes[i] / lay.ep for i in mine),
                "max_gathered": max(gathered, default=0.0), "second_gathered": sorted(gathered)[-2] if len(mine) > 1
                else 0.0, "max_grads": max(grads, default=0.0), "root": root,
                "tensors": tensors + sum(f.tensors[i] for i in mine)}
        return self._unit_cache[key]

    def _fsdp(self, lay: Layout, u: dict[str, float], link: dict[str, Link]) -> tuple[float, float]:
        """FSDP2 / HSDP seconds per step of a rank, and the part never hidden: the root's
        first all-gather and last reduce-scatter (and all-reduce across replicas) — under a
        pipeline every unit's reduction, run after the schedule's last backward (torch's
        ``PipelineStage`` reduces once per step) with no compute left to hide behind.
        Each collective's time is linear in its bytes, so the units are priced summed."""
        d, dr, ge = lay.dp_shard * lay.cp, lay.dp_replicate, lay.dp_shard * lay.cp // lay.ep
        gathers = 2 if lay.pp == 1 else 1  # pp: kept unsharded across the step's microbatches

        def summed(op: str, p: int, calls: float, nbytes: float, dim: str) -> float:
            base = collective_time(op, p, 0.0, link[dim])
            return calls * base + (collective_time(op, p, 1.0, link[dim]) - base) * nbytes

        n, root = u["count"] + 1, u["root"]
        gather = gathers * summed("all_gather", d, n, (u["gathered"] + root) / d, "fsdp")
        reduce = (summed("reduce_scatter_tensor", d, n, u["dense"] + root, "fsdp")
                  + summed("all_reduce", dr, n, (u["dense"] + root) / d, "dp_replicate"))
        if lay.ep > 1 and u["experts"]:  # experts: their own units over efsdp = dp_shard x cp / ep
            gather += gathers * summed("all_gather", ge, u["count"], u["experts"] / ge, "efsdp")
            reduce += (summed("reduce_scatter_tensor", ge, u["count"], u["experts"], "efsdp")
                       + summed("all_reduce", dr, u["count"], u["experts"] / ge, "dp_replicate"))
        elif u["experts"]:
            gather += gathers * summed("all_gather", d, 0, u["experts"] / d, "fsdp")
            reduce += (summed("reduce_scatter_tensor", d, 0, u["experts"], "fsdp")
                       + summed("all_reduce", dr, 0, u["experts"] / d, "dp_replicate"))
        first = collective_time("all_gather", d, root / d, link["fsdp"])
        if lay.pp > 1:
            return gather + reduce, first + reduce
        fixed = (first + collective_time("reduce_scatter_tensor", d, root, link["fsdp"])
                 + collective_time("all_reduce", dr, root / d, link["dp_replicate"]))
        return gather + reduce, fixed

    def _memory(self, lay: Layout, u: dict[str, float], f: TPFacts, numbers: dict[int, dict[str, float]],
                stages: list[_Stage], order: dict[int, list[tuple[int, str]]] | None, rank: int,
                mb: int) -> dict[str, float]:
        """Peak bytes of a rank: sharded parameters, gradients and AdamW, FSDP2's unsharded
        buffers, activations of the microbatches in flight.  Under a pipeline torch keeps a
        stage's parameters unsharded across the microbatches, and its gradients (unsharded,
        or the gradients themselves without FSDP2 sharding) from its first backward on: the
        activations and those gradients peak together where the schedule's order (replayed)
        holds the most of both, not each at its own peak (GPipe runs every forward first)."""
        from .cost_pipeline import in_flight_parts

        d = lay.dp_shard * lay.cp
        whole = u["dense"] + u["experts"] * lay.ep + u["root"]  # this rank's TP-local bytes
        shard = whole / d
        live = max(n["live"] for n in numbers.values()) * mb
        gradients = shard
        if order is None:
            buffers = 0.0 if d == 1 else u["root"] + u["max_gathered"] + u["second_gathered"] + u["max_grads"]
            held = sum(n["held"] for n in numbers.values()) * mb  # root kept gathered, a unit and the next
        else:
            grads = {i: sum(f.dense_bytes[b] + f.expert_bytes[b] / lay.ep for b in stages[i].blocks)
                     + (f.pre_bytes if stages[i].first else 0.0) + (f.post_bytes if stages[i].last else 0.0)
                     for i in numbers}
            acts = {i: n["held"] * mb for i, n in numbers.items()}
            unit = max(*acts.values(), *grads.values()) or 1.0  # cached on 0.1%-rounded relative bytes
            key = (id(order), rank, tuple(round(v / unit, 3) for v in acts.values()),
                   tuple(round(v / unit, 3) for v in grads.values()))
            if key not in self._peaks:
                rel = ({i: round(v / unit, 3) for i, v in acts.items()}, {i: round(v / unit, 3) for i, v in grads.items()})
                self._peaks[key] = in_flight_parts({rank: order[rank]}, *rel)[2][rank]
            held, unsharded = (x * unit for x in self._peaks[key])
            buffers = unsharded + (u["gathered"] + u["experts"] + u["root"] if d > 1 else 0.0)
            if d == 1:
                gradients = 0.0  # the replayed gradients are the gradients themselves
        out = {"parameters": shard, "gradients": gradients, "optimizer": 2 * shard + 4 * u["tensors"],
               "fsdp_buffers": buffers, "activations": held + live}
        out["total"] = sum(out.values())
        return out
