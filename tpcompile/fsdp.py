"""FSDP2 composition: ``parallelize`` = tensor parallelism + FSDP2 on one 3-D mesh.

The mesh is ``(dp_replicate, dp_shard, tp)`` over the default process group, TP
innermost so a TP group is ranks ``r*tp .. r*tp + tp-1`` (on GPUs: one node's NVLink
island). The steps run in torchtitan's order, each commented where it happens::

    transform(model, tp, mesh=mesh["tp"])      # 1. TP: DTensor params over "tp", hooks
    checkpoint_blocks / offload_activations    # 2. activation memory, per block
    fully_shard(block) for block; fully_shard(model)   # 3. FSDP2 over the dp dims
    to_empty + per-tensor init / rank-0 weights /      # 4. only for meta / rank-0 /
        each rank's rows of an HF checkpoint           #    load_from= loading

Parameters end up as DTensors over ``(dp..., tp)``: FSDP2 shards each TP shard further
along dim 0 over ``dp_shard`` and replicates it over ``dp_replicate``.

**Delayed load** (``load_from=<HF directory>``). The model is built on the meta device,
sharded, ``to_empty`` allocates only this rank's shards, and
:func:`~tpcompile.checkpoint.hf.load_hf_weights` fills them: each rank reads (``pread``) only
the rows of its TP shard and keeps its FSDP piece of them, one tensor at a time. Buffers
no checkpoint stores (rotary tables) are recomputed by the model's own init. No random
init runs. Peak memory per rank: its shards plus one TP shard of the largest tensor.

**Delayed init.** A model built on the meta device is sharded first and materialized
after: ``to_empty`` allocates only this rank's shards, then each tensor's *full* value is
computed on the CPU, one tensor at a time (memory bounded by the largest tensor), and
this rank keeps its slice. The value of tensor ``T`` is what the model's own init code
writes into ``T`` — the owner module's init, then each ancestor's, as Hugging Face's
``initialize_weights`` orders them (``_init_weights`` of the nearest ``PreTrainedModel``,
else ``reset_parameters``) — run on a meta copy of the module tree where only ``T`` is
real, from a generator seeded with ``(seed, T's name)``. So the values depend on the seed
and the names only: every layout (any tp, dp, strategy, world size) gets the same full
tensors, and every rank of a TP group the same shards.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from .config import ParallelConfig, resolve_config
from .errors import TPError

__all__ = ["MESH_DIMS", "data_parallel_rank", "parallelize"]

MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def parallelize(
    model: nn.Module,
    *,
    tp: int = 1,
    dp_shard: int = -1,
    dp_replicate: int = 1,
    ep: int = 1,
    sequence_parallel: bool = False,
    sharding_strategy: str = "FULL_SHARD",
    mixed_precision: Any = None,
    cpu_offload: bool = False,
    activation_checkpointing: bool = False,
    activation_offloading: bool = False,
    loading_horizon: int = 2,
    seed: int | None = None,
    config: Any = None,
    load_from: str | os.PathLike | None = None,
) -> nn.Module:
    """Tensor-parallel + FSDP2 (+ activation checkpointing/offloading) in one call, in place.

    Args:
        model: a Hugging Face (or any token-in) model, materialized or on the meta device.
        tp: tensor-parallel degree (1: FSDP2 only).
        dp_shard: FSDP2 sharding degree; ``-1`` = the rest of the world.
        dp_replicate: replicas (HSDP) across which each shard group is copied.
        ep: expert-parallel degree for MoE models: each rank holds ``1/ep`` of the
            experts, tokens are routed to them with all-to-all. Carved from the
            ``dp_shard`` ranks (``dp_shard = efsdp x ep``); see
            :mod:`tpcompile.expert_parallel`.
        sequence_parallel: between tensor-parallel regions each rank keeps only its
            slice of the tokens (:mod:`tpcompile.sequence`); needs ``tp > 1``.
        sharding_strategy: ``FULL_SHARD`` (reshard after forward), ``SHARD_GRAD_OP`` (keep
            params gathered until backward), ``NO_SHARD`` (pure replication),
            ``HYBRID_SHARD`` / ``HYBRID_SHARD_ZERO2`` (shard within ``dp_shard``,
            replicate across ``dp_replicate``); names, accelerate's ints 1-5 or the enum.
        mixed_precision: ``None``, ``"bf16"`` / ``"fp16"``, a torch dtype (params in that
            dtype, gradients reduced in fp32) or a ``MixedPrecisionPolicy``.
        cpu_offload: keep sharded params, grads and optimizer state in host memory.
        activation_checkpointing: recompute each block in backward.
        activation_offloading: keep what each block saves for backward in host memory,
            loading ``loading_horizon`` blocks ahead in backward.
        seed: seeds delayed init of a meta model, then this process's RNG with
            ``seed + dp rank`` (equal within a TP group, so dropout on replicated
            activations agrees; different across data-parallel ranks).
        config: an SMP v2 or accelerate config (dict, JSON string, .json/.yaml path) or a
            dict of these keywords. A keyword left at its default defers to the config;
            one set to a different value than the config raises.
        load_from: a Hugging Face checkpoint directory (safetensors, as ``save_pretrained``
            writes it) to load instead of initializing: build the model on the meta device
            (``from_config`` of the checkpoint's config) and every rank reads only the rows
            of its own shards after sharding; no rank ever holds the model and no random
            init runs. It supersedes rank-0 loading (``fsdp_cpu_ram_efficient_loading`` /
            ``fsdp_sync_module_states``): every rank reads the files itself. A materialized
            model is overwritten in place. A *training* checkpoint
            (``tpcompile.checkpoint.save``, kind sharded/local) is not an HF directory:
            parallelize first (``seed=`` initializes a meta model, shards only), then
            ``tpcompile.checkpoint.load(path, model, optimizer)``.

    Returns the model, with ``model.tpcompile_mesh`` (the 3-D mesh) and
    ``model.tpcompile_parallel`` (the resolved :class:`~tpcompile.config.ParallelConfig`);
    with ``load_from``, ``model.tpcompile_load_stats`` holds this rank's
    ``{"bytes_read", "tensors"}``. ``model.tpcompile_table`` (the HF translation table every
    checkpoint function reads) exists at ``tp=1`` too.

    Example:
        >>> dist.init_process_group("gloo")                       # doctest: +SKIP
        >>> with torch.device("meta"):
        ...     model = AutoModelForCausalLM.from_config(cfg)
        >>> model = tpcompile.parallelize(model, tp=2, seed=0)   # world 8: dp_shard=4
        >>> model.tpcompile_mesh.shape, model.tpcompile_parallel.sharding_strategy.value
        ((1, 4, 2), 'FULL_SHARD')
        >>> with torch.device("meta"):                           # load, never initialize
        ...     model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        >>> model = tpcompile.parallelize(model, tp=2, load_from=path)
    """
    given = dict(tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate, ep=ep, sequence_parallel=sequence_parallel,
                 sharding_strategy=sharding_strategy,
                 mixed_precision=mixed_precision, cpu_offload=cpu_offload,
                 activation_checkpointing=activation_checkpointing,
                 activation_offloading=activation_offloading, loading_horizon=loading_horizon, seed=seed)
    defaults = {k: p.default for k, p in inspect.signature(parallelize).parameters.items()}
    explicit = {k: v for k, v in given.items() if not _is_default(v, defaults[k])}
    if not dist.is_available() or not dist.is_initialized():
        raise TPError("tpcompile.parallelize needs an initialized process group: launch with torchrun "
                      "and call torch.distributed.init_process_group() first")
    if hasattr(model, "tpcompile_parallel") or hasattr(model, "tpcompile_plan"):
        raise TPError("this model is already parallelized or transformed; pass the original model "
                      "(parallelize applies tensor parallelism itself)")
    cfg = resolve_config(config, world_size=dist.get_world_size(), **explicit)
    if load_from is not None:
        _check_checkpoint_dir(load_from)  # collective: fail on every rank before any work
        # every rank reads its own rows: a rank-0 broadcast would only add a full copy
        cfg = replace(cfg, load_from_rank0=False)
    device = _device_type(model)
    mesh = init_device_mesh(device, cfg.mesh_shape, mesh_dim_names=MESH_DIMS)
    # record what delayed init / rank-0 / checkpoint loading needs before any module is
    # rewritten
    pending: _Materializer | _CheckpointLoader | None = (
        _Materializer.prepare(model, cfg) if load_from is None
        else _CheckpointLoader.prepare(model, load_from))

    # 1. tensor parallelism; the analysis also names the transformer blocks (wrap units)
    if cfg.tp > 1:
        from .api import transform

        transform(model, cfg.tp, mesh=mesh["tp"], ep=cfg.ep, sequence_parallel=cfg.sequence_parallel)
        plan = model.tpcompile_plan
    else:
        from .api import plan_model
        from .translate import build_table

        plan = plan_model(model, 1, ep=cfg.ep)
        # the tp=1 translation table (every tensor whole), taken while names and shapes
        # are still the HF ones: load_hf_weights, hf_state_dict, save_pretrained and
        # the training checkpoints need one, and transform only builds it for tp > 1
        model.tpcompile_table = build_table(model, None)
        from .checkpoint.hf_methods import bind_save_pretrained

        bind_save_pretrained(model)  # transform binds it for tp > 1
    blocks = list(plan.blocks)
    _check_wrap_classes(model, blocks, cfg.wrap_classes)
    # 1b. expert parallelism: this rank's experts, all-to-all dispatch around the experts'
    #     forward (inside TP's hooks), on the 4-D mesh (dp_replicate, efsdp, ep, tp)
    experts: list[nn.Module] = []
    if cfg.ep > 1:
        experts = _shard_experts(model, plan, mesh, cfg.ep)

    # 2. activation checkpointing, then offloading, before FSDP so that FSDP's hooks end
    #    up outermost and TP's innermost (the nesting is explained in activations.py)
    if cfg.activation_checkpointing or cfg.activation_offloading:
        from . import activations

        if cfg.activation_checkpointing:
            activations.checkpoint_blocks(model, blocks)
        if cfg.activation_offloading:
            model.tpcompile_offload = activations.offload_activations(
                model, blocks, loading_horizon=cfg.loading_horizon)

    # 3. FSDP2: each block is one all-gather / reduce-scatter unit, the root holds the rest
    _fully_shard(model, blocks, cfg, mesh, device, experts)

    # 4. materialize a meta model (or take rank 0's weights, or read each rank's rows of
    #    an HF checkpoint): shards only, per tensor. The checkpoint code finds the TP
    #    group through the 3-D mesh, so it is attached first.
    model.tpcompile_mesh = mesh
    used_seed = cfg.seed
    if isinstance(pending, _CheckpointLoader):
        model.tpcompile_load_stats = pending.run(model, device)
    elif pending is not None:
        used_seed = pending.run(model, mesh, device)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed + data_parallel_rank(mesh)[0])
    model.tpcompile_parallel = replace(cfg, seed=used_seed)
    from .integrations import mark_model

    mark_model(model)  # the data-parallel degrees too, for the HF Trainer / accelerate
    return model


def data_parallel_rank(mesh: DeviceMesh | nn.Module) -> tuple[int, int]:
    """``(dp rank, dp size)`` of this process on a ``parallelize`` mesh (or model):
    which slice of the global batch this rank should load.

    Example:
        >>> rank, size = data_parallel_rank(model)              # doctest: +SKIP
        >>> local_batch = global_batch.chunk(size)[rank]
    """
    if isinstance(mesh, nn.Module):
        if not hasattr(mesh, "tpcompile_mesh"):
            raise TPError("this model was not parallelized: call tpcompile.parallelize(model, ...) first")
        mesh = mesh.tpcompile_mesh
    rep, shard, _ = mesh.get_coordinate()
    return rep * mesh.size(1) + shard, mesh.size(0) * mesh.size(1)


def _is_default(value: Any, default: Any) -> bool:
    if value is None or default is None:
        return value is default
    return type(value) is type(default) and value == default


def _device_type(model: nn.Module) -> str:
    dev = next(itertools.chain(model.parameters(), model.buffers()), torch.empty(0)).device.type
    if dev == "meta":  # nothing to read off the model: follow the process group's backend
        return "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return "cuda" if dev == "cuda" else os.environ.get("TPCOMPILE_DEVICE", "cpu")


def _check_wrap_classes(model: nn.Module, blocks: list[str], wanted: tuple[str, ...]) -> None:
    """accelerate's ``fsdp_transformer_layer_cls_to_wrap`` must name the blocks found."""
    if not wanted:
        return
    found = sorted({type(model.get_submodule(b)).__name__ for b in blocks})
    if sorted(wanted) != found:
        raise TPError(f"fsdp_transformer_layer_cls_to_wrap={list(wanted)} but the blocks tpcompile found "
                      f"(its FSDP units) are of class {found}; set it to {','.join(found)} or drop it")


def _shard_experts(model: nn.Module, plan: Any, mesh: DeviceMesh, ep: int) -> list[nn.Module]:
    from .expert_parallel import expert_mesh, shard_experts

    if not plan.experts:
        raise TPError(f"ep={ep} but tpcompile found no stacked experts in {type(model).__name__} (3-D "
                      "parameters indexed by a router's top-k); expert parallelism is for MoE models: "
                      "drop ep")
    mesh4 = expert_mesh(mesh, ep)
    model.tpcompile_expert_mesh = mesh4
    return shard_experts(model, plan.experts, mesh4)


def _fully_shard(model: nn.Module, blocks: list[str], cfg: ParallelConfig, mesh: DeviceMesh,
                 device: str, experts: list[nn.Module] = ()) -> None:
    # a 2-D (replicate, shard) mesh is HSDP; NO_SHARD is HSDP with shard groups of 1
    dp_mesh = mesh["dp_replicate", "dp_shard"] if cfg.dp_replicate > 1 else mesh["dp_shard"]
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.mixed_precision is not None:
        kwargs["mp_policy"] = cfg.mixed_precision
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda")  # pinning needs CUDA
    if experts:
        # each experts module is its own unit, sharded over efsdp only (ep already split
        # it), inside its block's unit (torchtitan's nesting). Its gradient sums every
        # token of the EP group; divided by the whole dp degree it matches the mean the
        # dense parameters get
        mesh4 = model.tpcompile_expert_mesh
        emesh = mesh4["dp_replicate", "efsdp"] if cfg.dp_replicate > 1 else mesh4["efsdp"]
        for module in experts:
            fully_shard(module, **{**kwargs, "mesh": emesh})
            module.set_gradient_divide_factor(float(cfg.dp_replicate * cfg.dp_shard))
            if cfg.dp_shard // cfg.ep > 1:
                # sum, then divide once (gloo has no PREMUL_SUM; a power of two divides
                # exactly). Not with one efsdp rank: FSDP2 then divides by the factor
                # while copying and would divide again after
                module.set_force_sum_reduction_for_comms(True)
    for fqn in blocks:
        fully_shard(model.get_submodule(fqn), **kwargs)
    fully_shard(model, **kwargs)


# ------------------------------------------------------------------ delayed loading


def _checkpoint_dir_error(path: str | os.PathLike) -> str | None:
    """Why ``path`` cannot be read as an HF checkpoint on this rank (``None``: it can)."""
    import json

    from .checkpoint import hf

    meta = Path(path) / hf.META_NAME
    if meta.exists():
        try:
            fmt = json.loads(meta.read_text()).get("format")
        except ValueError:
            fmt = None
        if fmt in ("tpcompile-sharded", "tpcompile-local"):  # training.SHARDED/LOCAL_FORMAT
            return (f"{path} is a tpcompile training checkpoint ({fmt}), not an HF directory: "
                    "parallelize the model first (seed= initializes a meta model, shards only), "
                    "then tpcompile.checkpoint.load(path, model, optimizer); or export it with "
                    "`python -m tpcompile translate` and pass that directory as load_from")
    try:
        hf.checkpoint_files(path)  # every file's header and size: truncated files fail here
    except (TPError, OSError) as err:
        return str(err)
    return None


def _check_checkpoint_dir(path: str | os.PathLike) -> None:
    """Raise on every rank if any rank cannot read ``path`` (a rank raising alone would
    leave the others waiting in the next collective)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, _checkpoint_dir_error(path))
    bad = [r for r, e in enumerate(errors) if e is not None]
    if bad:
        raise TPError(f"load_from: cannot read the checkpoint on ranks {bad}: {errors[bad[0]]}")


class _CheckpointLoader:
    """Fills a sharded model from an HF checkpoint directory after ``fully_shard``.

    Parameters and the buffers the checkpoint stores are read shard-on-read; the other
    buffers keep their real values (``to_empty`` wipes them, so they are recorded here
    first) or, if built on meta, are recomputed by the model's own init.
    """

    def __init__(self, path: str | os.PathLike, buffers: list[_Tensor]) -> None:
        self.path, self.buffers = path, buffers

    @classmethod
    def prepare(cls, model: nn.Module, path: str | os.PathLike) -> _CheckpointLoader:
        records = _records(model, lambda t, is_param: not is_param)  # keep real buffers only
        return cls(path, [r for r in records if not r.is_param])

    def run(self, model: nn.Module, device: str) -> dict[str, Any]:
        """Load; returns this rank's ``{"bytes_read", "tensors"}``."""
        from .checkpoint.hf import checkpoint_files, load_hf_weights
        from .checkpoint.pretrained import materialize_buffers
        from .checkpoint.shards import lookup

        wiped = any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
        if wiped:
            model.to_empty(device=device)  # allocates this rank's FSDP shards only
        stats = load_hf_weights(model, self.path)
        if not wiped:
            return stats  # a materialized model: loaded in place, its buffers untouched
        stored = set(checkpoint_files(self.path))
        for rec in self.buffers:
            if rec.fqn in stored:
                continue  # read from the checkpoint, as transformers does
            # real before to_empty: that value; built on meta: back to meta, so that
            # materialize_buffers recomputes it (to_empty left uninitialized memory)
            value = rec.value.to(device) if rec.value is not None else \
                torch.empty(rec.shape, dtype=rec.dtype, device="meta")
            for name in [rec.fqn, *rec.aliases]:
                owner, attr, _ = lookup(model, name)
                owner._buffers[attr] = value
        materialize_buffers(model, device)
        return stats


# ------------------------------------------------------------------ delayed materialization


@dataclass
class _Tensor:
    """One parameter or buffer to fill after sharding, by its first name."""

    fqn: str
    module: str
    attr: str
    is_param: bool
    shape: torch.Size
    dtype: torch.dtype
    aliases: list[str]
    value: torch.Tensor | None  # the real tensor before rewriting (rank 0's weights, real buffers)


def _meta_status(model: nn.Module) -> list[str]:
    """Per rank: ``"meta"``, ``"real"`` or ``"mixed"`` parameters (gathered)."""
    meta = [p.is_meta for p in model.parameters()]
    mine = "mixed" if any(meta) and not all(meta) else "meta" if any(meta) else "real"
    status = [mine] * dist.get_world_size()
    dist.all_gather_object(status, mine)
    return status


def _records(model: nn.Module, keep: Callable[[torch.Tensor, bool], bool]) -> list[_Tensor]:
    """Every parameter and buffer once (tied ones under their first name), in module order."""
    tensors: list[_Tensor] = []
    seen: dict[int, _Tensor] = {}
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
            seen[id(t)] = _Tensor(fqn=fqn, module=mname, attr=attr, is_param=is_param, shape=t.shape,
                                  dtype=t.dtype, aliases=[], value=t.detach() if real else None)
            tensors.append(seen[id(t)])
    return tensors


def _derived_seed(seed: int, fqn: str) -> int:
    digest = hashlib.sha256(f"{seed}/{fqn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _meta_tree(model: nn.Module) -> dict[str, nn.Module]:
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


class _Materializer:
    """Fills a sharded model's tensors, one full tensor at a time, after ``fully_shard``."""

    def __init__(self, tensors: list[_Tensor], tree: dict[str, nn.Module], cfg: ParallelConfig) -> None:
        self.tensors, self.tree, self.cfg = tensors, tree, cfg
        self.inits = _init_functions(tree)

    @classmethod
    def prepare(cls, model: nn.Module, cfg: ParallelConfig) -> _Materializer | None:
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
        return cls(_records(model, lambda t, is_param: rank0 if cfg.load_from_rank0 else not is_param),
                   _meta_tree(model), cfg)

    def run(self, model: nn.Module, mesh: DeviceMesh, device: str) -> int | None:
        """Materialize and fill; returns the seed used for initialization (or ``None``)."""
        from .checkpoint.shards import assign_tp_local

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

    def initial_value(self, rec: _Tensor, seed: int) -> torch.Tensor:
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
                    torch.manual_seed(_derived_seed(seed, rec.fqn))
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
