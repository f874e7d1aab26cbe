"""``init``, ``state`` and ``transform``: SMP v2's entry points over tpcompile.

SMP v2 (``torch.sagemaker``) keeps each TP rank's shard of a weight as a plain local
parameter and lets PyTorch FSDP1 shard each TP rank's model over the data-parallel ranks.
:func:`transform` does the same on top of :func:`tpcompile.transform`: the TP shards it
places become plain parameters, so ``FullyShardedDataParallel`` and its state-dict types
see an ordinary model per TP rank, as under SMP.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ..config import ParallelConfig, resolve_config
from ..errors import TPError
from ..runtime.mesh import ParallelDims

__all__ = ["Ranker", "State", "init", "state", "transform"]

SAGEMAKER_ENV = "SM_HP_MP_PARAMETERS"  # where the SageMaker SDK passes SMP's parameters
DEFAULT_SEED = 12345  # SMP v2's documented default random_seed
_HF_STATE_DICT_HOOKS = "tpcompile.runtime.state_dict"  # the module whose hooks make state_dict() HF-shaped


class Ranker:
    """Rank arithmetic over the ``(dp_replicate, dp_shard, tp)`` mesh."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self._ranks = mesh.mesh  # (replicate, shard, tp) tensor of global ranks

    def get_rep_groups(self) -> list[list[int]]:
        """Ranks holding the same shard of the model (one group per (shard, tp) position):
        SMP's replication groups, which save one copy of a local checkpoint."""
        r = self._ranks
        return [r[:, s, t].tolist() for s in range(r.shape[1]) for t in range(r.shape[2])]

    def get_tp_groups(self) -> list[list[int]]:
        return self._ranks.reshape(-1, self._ranks.shape[2]).tolist()

    def get_dp_groups(self) -> list[list[int]]:
        """The data-parallel ranks of each TP position (replicas and shards together)."""
        r = self._ranks
        return [r[:, :, t].flatten().tolist() for t in range(r.shape[2])]


class State:
    """``tsm.state``: this process's place in the layout (valid after :func:`init`)."""

    def __init__(self) -> None:
        self.cfg: ParallelConfig | None = None
        self.mesh: DeviceMesh | None = None
        self._dp_group: Any = None

    def _need(self) -> DeviceMesh:
        if self.mesh is None:
            raise TPError("tpcompile.smp is not initialized: call tsm.init(config) first "
                          "(after torch.distributed.init_process_group, or let init start it)")
        return self.mesh

    @property
    def initialized(self) -> bool:
        return self.mesh is not None

    @property
    def rank(self) -> int:
        self._need()
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        self._need()
        return dist.get_world_size()

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.rank))

    @property
    def tp_size(self) -> int:
        return self._need()["tp"].size()

    @property
    def tp_rank(self) -> int:
        return self._need()["tp"].get_local_rank()

    @property
    def ep_size(self) -> int:
        """``expert_parallel_degree``: EP groups are consecutive ``dp_shard`` ranks of one
        tp rank, as :func:`tpcompile.parallelize` (``config=`` the same dict) lays them out."""
        self._need()
        return self.cfg.ep

    @property
    def ep_rank(self) -> int:
        _, shard, _ = self._need().get_coordinate()
        return shard % self.cfg.ep

    @property
    def dp_size(self) -> int:
        mesh = self._need()
        return mesh.size(0) * mesh.size(1)

    @property
    def dp_rank(self) -> int:
        rep, shard, _ = self._need().get_coordinate()
        return rep * self.mesh.size(1) + shard

    @property
    def tp_process_group(self) -> Any:
        return self._need()["tp"].get_group()

    @property
    def dp_process_group(self) -> Any:
        """Every data-parallel rank of this TP position (what FSDP1 shards over)."""
        self._need()
        return self._dp_group

    @property
    def fsdp_process_group(self) -> Any:
        """The ``process_group=`` for FSDP1: the dp group, or ``(shard, replicate)`` groups
        for ``HYBRID_SHARD`` when ``hybrid_shard_degree`` splits the dp ranks."""
        mesh = self._need()
        if mesh.size(0) == 1:
            return self._dp_group
        return mesh["dp_shard"].get_group(), mesh["dp_replicate"].get_group()

    @property
    def world_process_group(self) -> Any:
        self._need()
        return dist.group.WORLD

    @property
    def ranker(self) -> Ranker:
        return Ranker(self._need())


state = State()


def _read_config(config: Any) -> Any:
    if config is not None:
        return config
    text = os.environ.get(SAGEMAKER_ENV)
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TPError(f"{SAGEMAKER_ENV} is not valid JSON: {e}") from None


def init(config: Any = None) -> State:
    """Set up the ``(dp_replicate, dp_shard, tp)`` mesh from an SMP v2 config.

    Args:
        config: a dict, a JSON string or a .json path holding SMP v2 keys (flat or the
            SDK's nested form); ``None`` reads SageMaker's ``SM_HP_MP_PARAMETERS`` and
            falls back to the defaults (no tensor parallelism, all dp ranks shard).

    Starts ``torch.distributed`` (env:// rendezvous, nccl on GPUs, else gloo) if it is
    not running, and seeds every process with ``random_seed`` (default 12345, as SMP),
    so models built after ``init`` agree across ranks.

    Example:
        >>> import tpcompile.smp as tsm                           # doctest: +SKIP
        >>> tsm.init({"tensor_parallel_degree": 2})
        >>> tsm.state.tp_rank, tsm.state.dp_rank
    """
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    cfg = resolve_config(_read_config(config), world_size=dist.get_world_size())
    if cfg.cp > 1:  # SMP runs CP through Transformer Engine on its own FSDP; ours needs FSDP2
        raise TPError(f"context_parallel_degree={cfg.cp} is applied by tpcompile.parallelize(model, "
                      "config=<the same SMP config>) (FSDP2 over dp_shard x cp); tsm.init / tsm.transform "
                      "with FSDP1 cannot split sequences: set context_parallel_degree to 1 there")
    if state.cfg is not None:
        if cfg != state.cfg:
            raise TPError(f"tpcompile.smp is already initialized with another layout "
                          f"{state.cfg.mesh_shape}; call init once per process")
        return state
    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    mesh = ParallelDims(dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, tp=cfg.tp, ep=cfg.ep).build(device)
    groups = Ranker(mesh).get_dp_groups()
    mine, _ = dist.new_subgroups_by_enumeration(groups)  # every rank creates every group
    torch.manual_seed(DEFAULT_SEED if cfg.seed is None else cfg.seed)
    state.cfg, state.mesh, state._dp_group = cfg, mesh, mine
    return state


def transform(model: nn.Module, *, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
              config: Any = None, load_state_dict_from_rank0: bool = False) -> nn.Module:
    """``tsm.transform``: tensor parallelism over ``state``'s TP group, in place.

    Args:
        model: a Hugging Face model; with ``load_state_dict_from_rank0`` only rank 0
            needs real weights (build it under ``accelerate.init_empty_weights()``
            elsewhere) and every rank receives its shards from rank 0.
        device: move the transformed model there.
        dtype: cast the model first.
        config: must resolve to the layout given to :func:`init`, if passed.

    Each TP shard becomes a plain local parameter, as in SMP: wrap the result with
    PyTorch FSDP1 over ``tsm.state.fsdp_process_group``, or pass the untransformed model
    to :func:`tpcompile.parallelize` for FSDP2.

    Example:
        >>> model = tsm.transform(model, load_state_dict_from_rank0=True)  # doctest: +SKIP
    """
    from ..api import transform as tp_transform
    from ..runtime.materialize import meta_tree, records

    mesh = state._need()
    if config is not None and resolve_config(config, world_size=dist.get_world_size()) != state.cfg:
        raise TPError("transform(config=...) differs from the config given to tsm.init; pass it to init only")
    if state.cfg.ep > 1:  # FSDP1 over plain local parameters cannot hold experts split over ep
        raise TPError(f"expert_parallel_degree={state.cfg.ep} is applied by tpcompile.parallelize(model, "
                      "config=<the same SMP config>) (FSDP2); tsm.transform + FSDP1 splits each expert "
                      "over tp instead: set expert_parallel_degree to 1 there")
    if dtype is not None:
        model.to(dtype)
    if any(p.is_meta for p in model.parameters()) and not load_state_dict_from_rank0:
        # delayed init needs the untransformed tree (names, HF shapes, init code)
        model._tpcompile_smp_delayed = (records(model, lambda t, is_param: not is_param), meta_tree(model))
    tp_transform(model, mesh["tp"].size(), mesh=mesh["tp"], load_state_dict_from_rank0=load_state_dict_from_rank0)
    localize(model)
    if device is not None:
        model.to(device)
    return model


def localize(model: nn.Module) -> nn.Module:
    """Replace every DTensor parameter/buffer by a plain one holding this rank's shard
    (tied tensors stay tied). The TP hooks read either kind.

    Under SMP each TP rank's model is an ordinary model of its shards, so the hooks that
    make ``state_dict()`` speak HF tensors are removed too: FSDP1's state dicts are per TP
    rank, and ``translate_on_save`` produces the HF state dict.
    """
    done: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for hooks in (mod._state_dict_hooks, mod._load_state_dict_pre_hooks):
            for key, hook in list(hooks.items()):
                if getattr(getattr(hook, "hook", hook), "__module__", None) == _HF_STATE_DICT_HOOKS:
                    del hooks[key]
        for store in (mod._parameters, mod._buffers):
            for name, t in list(store.items()):
                if not isinstance(t, DTensor):
                    continue
                if id(t) not in done:
                    local = t.to_local().detach()
                    done[id(t)] = nn.Parameter(local, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else local
                store[name] = done[id(t)]
    return model
