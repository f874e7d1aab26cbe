"""Delayed initialization: fill a sharded meta model, one full tensor at a time.

A model built on the meta device is sharded first and materialized after: ``to_empty``
allocates only this rank's shards, then each tensor's *full* value is computed on the
CPU, one tensor at a time (memory bounded by the largest tensor), and this rank keeps its
slice. The value of tensor ``T`` is what the model's own init code writes into ``T`` —
the owner module's init, then each ancestor's, as Hugging Face's ``initialize_weights``
orders them (``_init_weights`` of the nearest ``PreTrainedModel``, else
``reset_parameters``) — run on a meta copy of the module tree where only ``T`` is real,
from a generator seeded with ``(seed, T's name)``. So the values depend on the seed and
the names only: every layout (any tp, dp, strategy, world size) gets the same full
tensors, and every rank of a TP group the same shards.  With ``load_from_rank0`` rank 0's
real tensors are broadcast instead.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..config import ParallelConfig
from ..errors import TPError
from .shards import assign_tp_local

__all__ = ["Materializer", "TensorRecord", "keep_present", "meta_tree", "records"]


@dataclass
class TensorRecord:
    """One parameter or buffer to fill after sharding, by its first name."""

    fqn: str
    module: str
    attr: str
    is_param: bool
    shape: torch.Size
    dtype: torch.dtype
    aliases: list[str]
    value: torch.Tensor | None  # the real tensor before rewriting (rank 0's weights, real buffers)
    seed_name: str | None = None  # the name its init is seeded by, when fqn is not the first name


def keep_present(tensors: list[TensorRecord], model: nn.Module) -> list[TensorRecord]:
    """The records of tensors ``model`` still holds (a pipeline stage keeps only its own),
    each under its first name still present; the init seed keeps the original name, so a
    tensor gets the same value whichever stage holds it."""
    present = {n for n, _ in model.named_parameters(remove_duplicate=False)} | \
        {n for n, _ in model.named_buffers(remove_duplicate=False)}
    out = []
    for rec in tensors:
        names = [n for n in (rec.fqn, *rec.aliases) if n in present]
        if not names:
            continue
        rec.seed_name = rec.seed_name or rec.fqn
        rec.fqn, rec.aliases = names[0], names[1:]
        out.append(rec)
    return out


def _meta_status(model: nn.Module) -> list[str]:
    """Per rank: ``"meta"``, ``"real"`` or ``"mixed"`` parameters (gathered)."""
    meta = [p.is_meta for p in model.parameters()]
    mine = "mixed" if any(meta) and not all(meta) else "meta" if any(meta) else "real"
    status = [mine] * dist.get_world_size()
    dist.all_gather_object(status, mine)
    return status


def records(model: nn.Module, keep: Callable[[torch.Tensor, bool], bool]) -> list[TensorRecord]:
    """Every parameter and buffer once (tied ones under their first name), in module order."""
    tensors: list[TensorRecord] = []
    seen: dict[int, TensorRecord] = {}
    for mname, mod in model.named_modules():
        owned = [(n, t, True) for n, t in mod._parameters.items()] + \
                [(n, t, False) for n, t in mod._buffers.items()]
        for attr, t, is_param in owned:
            if t is None:
                continue
            fqn = f"{mname}.{attr}" if mname else attr
            if id(t) in seen:  # tied: one value, written through every name
                seen[id(t)].aliases.append(fqn)
                continue
            real = not t.is_meta and keep(t, is_param)
            seen[id(t)] = TensorRecord(fqn=fqn, module=mname, attr=attr, is_param=is_param, shape=t.shape,
                                  dtype=t.dtype, aliases=[], value=t.detach() if real else None)
            tensors.append(seen[id(t)])
    return tensors


def _derived_seed(seed: int, fqn: str) -> int:
    digest = hashlib.sha256(f"{seed}/{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def meta_tree(model: nn.Module) -> dict[str, nn.Module]:
    """A shallow copy of every module with every tensor on meta: init code runs on it
    without touching the real (sharded) model. Keyed by module FQN."""
    memo: dict[int, nn.Module] = {}

    def copy_module(mod: nn.Module) -> nn.Module:
        if id(mod) not in memo:
            shadow = copy.copy(mod)
            memo[id(mod)] = shadow
            shadow._parameters = {k: None if v is None else nn.Parameter(v.to("meta"), v.requires_grad)
                                  for k, v in mod._parameters.items()}
            shadow._buffers = {k: None if v is None else v.to("meta") for k, v in mod._buffers.items()}
            shadow._modules = {k: None if c is None else copy_module(c) for k, c in mod._modules.items()}
        return memo[id(mod)]

    root = copy_module(model)
    return dict(root.named_modules(remove_duplicate=False))


def _init_functions(tree: dict[str, nn.Module]) -> dict[str, Callable[[nn.Module], None] | None]:
    """Per module: the ``_init_weights`` of its nearest ``PreTrainedModel`` (HF's
    ``smart_apply`` dispatch), or ``None`` outside Hugging Face models."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        PreTrainedModel = ()  # type: ignore[assignment]  # noqa: N806
    out: dict[str, Callable[[nn.Module], None] | None] = {}
    for name, mod in tree.items():  # parents come before children
        parent = out.get(name.rpartition(".")[0]) if name else None
        out[name] = mod._init_weights if isinstance(mod, PreTrainedModel) else parent
    return out


class Materializer:
    """Fills a sharded model's tensors, one full tensor at a time, after ``fully_shard``."""

    def __init__(self, tensors: list[TensorRecord], tree: dict[str, nn.Module], cfg: ParallelConfig) -> None:
        self.tensors, self.tree, self.cfg = tensors, tree, cfg
        self.inits = _init_functions(tree)

    @classmethod
    def prepare(cls, model: nn.Module, cfg: ParallelConfig) -> Materializer | None:
        """``None`` when there is nothing to do (a materialized model, no rank-0 loading)."""
        status = _meta_status(model)  # collective: every rank decides the same way
        if "mixed" in status:
            raise TPError(f"on ranks {[r for r, s in enumerate(status) if s == 'mixed']} some parameters "
                          "are on the meta device and some are not; build the model entirely on meta "
                          "(delayed init) or entirely for real")
        if cfg.load_from_rank0 and status[0] == "meta":
            raise TPError("load_from_rank0 (fsdp_sync_module_states / cpu_ram_efficient_loading): "
                          "rank 0 must hold the real weights, but its model is on the meta device")
        if not cfg.load_from_rank0 and len(set(status)) > 1:
            raise TPError(f"ranks {[r for r, s in enumerate(status) if s == 'meta']} built the model on "
                          "the meta device and the others did not; build it the same way everywhere, or "
                          "take rank 0's weights (fsdp_sync_module_states / load_from_rank0)")
        if status[0] == "real" and not cfg.load_from_rank0:
            return None
        # keep a real tensor only where it is the source: rank 0's when loading from rank
        # 0, else real buffers (to_empty wipes them)
        rank0 = dist.get_rank() == 0
        return cls(records(model, lambda t, is_param: rank0 if cfg.load_from_rank0 else not is_param),
                   meta_tree(model), cfg)

    def run(self, model: nn.Module, mesh: DeviceMesh, device: str) -> int | None:
        """Materialize and fill; returns the seed used for initialization (or ``None``)."""
        if any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers())):
            model.to_empty(device=device)  # allocates this rank's FSDP shards only
        seed = self.cfg.seed
        needs_init = not self.cfg.load_from_rank0 and any(t.value is None for t in self.tensors)
        if needs_init and seed is None:  # every rank must draw the same values: rank 0's seed
            box = [torch.initial_seed() % (1 << 63)]
            dist.broadcast_object_list(box, src=0)
            seed = int(box[0])
        table = getattr(model, "tpcompile_table", None)
        tp_rank = mesh["tp"].get_local_rank()
        for rec in self.tensors:  # the same order on every rank: broadcasts pair up
            if self.cfg.load_from_rank0:  # on the mesh's device: NCCL broadcasts device tensors
                full = rec.value if dist.get_rank() == 0 else torch.empty(rec.shape, dtype=rec.dtype)
                full = full.to(device)
                dist.broadcast(full, src=0)
            elif rec.value is not None:
                full = rec.value  # a real buffer to_empty wiped
            else:
                full = self.initial_value(rec, seed)
            tmap = table.tensors.get(rec.fqn) if table is not None else None
            local = tmap.to_local(full, tp_rank) if tmap is not None and tmap.sharded else full
            assign_tp_local(model, rec.fqn, local, rec.aliases)
            rec.value = None  # release rank 0's full tensor as soon as it is sent
        return seed

    def initial_value(self, rec: TensorRecord, seed: int) -> torch.Tensor:
        """``rec``'s full value from the model's own init code, seeded by ``(seed, name)``."""
        full = torch.empty(rec.shape, dtype=rec.dtype)
        owner = self.tree[rec.module]
        store = owner._parameters if rec.is_param else owner._buffers
        meta = store[rec.attr]
        chain = [rec.module]
        while chain[-1]:
            chain.append(chain[-1].rpartition(".")[0])
        try:
            for fallback in (False, True):
                _fill_sentinel(full)
                store[rec.attr] = nn.Parameter(full, requires_grad=False) if rec.is_param else full
                with torch.random.fork_rng(devices=[]), torch.no_grad():
                    torch.manual_seed(_derived_seed(seed, rec.seed_name or rec.fqn))
                    if fallback:  # no HF init wrote it: the module's own reset_parameters
                        if hasattr(owner, "reset_parameters"):
                            owner.reset_parameters()
                    else:
                        for name in chain:  # owner first, then ancestors: HF's post-order
                            fn = self.inits.get(name)
                            if fn is not None:
                                fn(self.tree[name])
                if _written(full):
                    return full
        finally:
            store[rec.attr] = meta
        raise TPError(
            f"no initializer writes {'parameter' if rec.is_param else 'buffer'} {rec.fqn!r} "
            f"({type(owner).__name__}): give the module reset_parameters() or an _init_weights branch, "
            "or build the model with tpcompile.checkpoint.pretrained.params_on_meta() so buffers stay "
            "real, or load weights instead of initializing")


def _fill_sentinel(t: torch.Tensor) -> None:
    if t.is_floating_point() or t.is_complex():
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(False)
    else:
        t.fill_(torch.iinfo(t.dtype).min)


def _written(t: torch.Tensor) -> bool:
    """Did init code write every element (floats) / anything (integers) of ``t``?"""
    if t.is_floating_point() or t.is_complex():
        return not bool(torch.isnan(t).any())
    if t.dtype == torch.bool:
        return True  # cannot tell: a bool buffer of all False is plausible
    return not bool((t == torch.iinfo(t.dtype).min).all())
