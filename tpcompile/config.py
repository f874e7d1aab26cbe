"""Parallel settings: one resolved dataclass, from keywords or an SMP v2 / accelerate config.

``resolve_config(config, **keywords)`` reads ``config`` in one of three dialects:
**tpcompile** (the keyword names of :func:`tpcompile.parallelize`), **SMP v2** (SageMaker
model parallelism v2's keys, flat as HyperPod JSON or nested as the SageMaker SDK writes
them), or **accelerate** (an ``accelerate config`` YAML, or just its ``fsdp_config``).

Every key of every dialect is in a table below with what it sets. Keys accepted but
without effect under FSDP2 are listed too, each with the reason (:class:`NoEffect`); any
other key raises :class:`~tpcompile.errors.TPError` naming the key, the nearest known
keys and the supported ones, as does a config value that disagrees with an explicitly
passed keyword. Nothing is silently ignored.
"""

from __future__ import annotations

import difflib
import enum
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import TPError

if TYPE_CHECKING:  # FSDP2 (with DTensor, sympy) is imported when a policy is made: planning needs neither
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = [
    "ACCELERATE_KEYS", "SMP_KEYS", "CheckpointKind", "NoEffect", "Only", "ParallelConfig", "Sets",
    "Sharding", "mixed_precision_policy", "resolve_config",
]


class Sharding(str, enum.Enum):
    """accelerate's / FSDP1's sharding strategies, as FSDP2 realizes them."""

    FULL_SHARD = "FULL_SHARD"  # shard over all dp ranks, reshard after forward (ZeRO-3)
    SHARD_GRAD_OP = "SHARD_GRAD_OP"  # keep params unsharded from forward to backward (ZeRO-2)
    NO_SHARD = "NO_SHARD"  # replicate (DDP): every dp rank is a replica
    HYBRID_SHARD = "HYBRID_SHARD"  # shard within dp_shard, replicate across dp_replicate
    HYBRID_SHARD_ZERO2 = "HYBRID_SHARD_ZERO2"  # the same, no reshard after forward

    @property
    def reshard_after_forward(self) -> bool:
        return self in (Sharding.FULL_SHARD, Sharding.HYBRID_SHARD)

    @classmethod
    def parse(cls, value: Any) -> Sharding:
        """A name (any case, FSDP1's ``_HYBRID_SHARD_ZERO2`` too), an accelerate legacy
        integer 1-5 (its ``FSDP_SHARDING_STRATEGY`` order) or a torch ``ShardingStrategy``."""
        if isinstance(value, cls):
            return value
        if isinstance(value, enum.Enum):  # torch.distributed.fsdp.ShardingStrategy
            value = value.name
        order = list(cls)
        if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= len(order):
            return order[value - 1]
        if isinstance(value, str):
            text = value.strip().upper().lstrip("_")
            if text.isdigit():
                return cls.parse(int(text))
            if text in cls.__members__:
                return cls[text]
        raise TPError(
            f"unknown sharding strategy {value!r}; use one of {[s.value for s in cls]} "
            "(or accelerate's integers 1-5 in that order)"
        )

    @property
    def is_hybrid(self) -> bool:
        return self in (Sharding.HYBRID_SHARD, Sharding.HYBRID_SHARD_ZERO2)

    def hybrid_form(self) -> Sharding:
        """The strategy once a replicate dim exists: sharded strategies become hybrid."""
        return {Sharding.FULL_SHARD: Sharding.HYBRID_SHARD,
                Sharding.SHARD_GRAD_OP: Sharding.HYBRID_SHARD_ZERO2}.get(self, self)


class CheckpointKind(str, enum.Enum):
    """The default checkpoint kind (accelerate's ``fsdp_state_dict_type``)."""

    FULL = "full"  # one HF-layout state dict (FULL_STATE_DICT)
    SHARDED = "sharded"  # per-rank DTensor shards via torch.distributed.checkpoint
    LOCAL = "local"  # each rank's own tensors, same layout only (LOCAL_STATE_DICT)


_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
           "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
_FULL_PRECISION = ("no", "fp32", "float32", "none")


def mixed_precision_policy(value: Any) -> MixedPrecisionPolicy | None:
    """``None``/``"no"``/fp32 → none; ``"bf16"``/``"fp16"`` or a dtype → that param dtype with
    fp32 gradient reduction; a ``MixedPrecisionPolicy`` as is."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if value is None or isinstance(value, MixedPrecisionPolicy):
        return value
    if isinstance(value, str):
        key = value.strip().lower()
        if key in _FULL_PRECISION:
            return None
        if key not in _DTYPES:
            raise TPError(f"mixed_precision {value!r} is not supported; use None/'no', 'bf16', 'fp16', "
                          "a torch dtype or a torch.distributed.fsdp.MixedPrecisionPolicy (FP8 matmuls are fp8=True, "
                          "through torchao)")
        value = _DTYPES[key]
    if isinstance(value, torch.dtype):
        if value == torch.float32:
            return None
        if value not in (torch.bfloat16, torch.float16):
            raise TPError(f"mixed_precision dtype {value} is not supported; use torch.bfloat16 or torch.float16")
        # reduce in fp32: summing many low-precision gradients loses the small ones
        return MixedPrecisionPolicy(param_dtype=value, reduce_dtype=torch.float32)
    raise TPError(f"mixed_precision must be None, a string, a torch dtype or a MixedPrecisionPolicy, got {value!r}")


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """The resolved layout and options :func:`tpcompile.parallelize` applies.

    The mesh is ``(dp_replicate, dp_shard, tp)``; ``-1`` in ``dp_shard`` or
    ``dp_replicate`` means "the rest of the world" until :meth:`for_world` fixes it.

    Example:
        >>> cfg = resolve_config({"tensor_parallel_degree": 2}, world_size=8)
        >>> cfg.mesh_shape, cfg.sharding_strategy.value
        ((1, 4, 2), 'FULL_SHARD')
    """

    tp: int = 1
    dp_shard: int = -1
    dp_replicate: int = 1
    ep: int = 1  # expert parallelism: carved from dp_shard (dp_shard = efsdp x ep)
    # context parallelism: each sequence split over cp ranks; FSDP2 shards over dp_shard x cp
    cp: int = 1
    sequence_parallel: bool = False  # the residual stream split by tokens over tp
    # pipeline parallelism (runtime/pipeline.py): the outermost mesh dim; the schedule's
    # name (None: interleaved 1F1B where it applies, else 1F1B), microbatches per step
    # (None: 2 x pp) and stages per rank of the interleaved / V-shaped schedules
    pp: int = 1
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    pp_virtual: int = 2
    sharding_strategy: Sharding = Sharding.FULL_SHARD
    mixed_precision: MixedPrecisionPolicy | None = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    activation_offloading: bool = False
    loading_horizon: int = 2
    seed: int | None = None
    # FP8 matmuls through torchao (runtime/fp8.py): True / "tensorwise" / "rowwise" / a
    # torchao Float8LinearConfig; None: off
    fp8: Any = None
    # each block's forward torch.compile'd (runtime/compiled.py): None off, else the
    # torch.compile keywords ({} for the defaults)
    compile: dict[str, Any] | None = None
    checkpoint: CheckpointKind = CheckpointKind.SHARDED
    load_from_rank0: bool = False  # every rank takes rank 0's weights (other ranks may be meta)
    wrap_classes: tuple[str, ...] = ()  # if given, must be the classes of the blocks found
    num_processes: int | None = None  # if given, checked against the world size
    # where the settings came from, and the keys accepted without effect (not compared)
    source: str = field(default="keywords", compare=False)
    no_effect: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "sharding_strategy", Sharding.parse(self.sharding_strategy))
        object.__setattr__(self, "checkpoint", CheckpointKind(self.checkpoint))
        object.__setattr__(self, "mixed_precision", mixed_precision_policy(self.mixed_precision))
        object.__setattr__(self, "wrap_classes", tuple(self.wrap_classes))
        _check_int("tp", self.tp, minimum=1)
        _check_int("ep", self.ep, minimum=1)
        _check_int("cp", self.cp, minimum=1)
        _check_int("pp", self.pp, minimum=1)
        _check_int("pp_virtual", self.pp_virtual, minimum=1)
        if self.pp_microbatches is not None:
            _check_int("pp_microbatches", self.pp_microbatches, minimum=1)
        if self.pp_schedule is not None and not isinstance(self.pp_schedule, str):
            # the names are checked against the schedules' table (plan/stages.py) by parallelize
            raise TPError(f"pp_schedule must be a schedule's name, got {self.pp_schedule!r}")
        _check_int("dp_shard", self.dp_shard, minimum=-1, forbid=0)
        _check_int("dp_replicate", self.dp_replicate, minimum=-1, forbid=0)
        _check_int("loading_horizon", self.loading_horizon, minimum=1)
        object.__setattr__(self, "fp8", _fp8(self.fp8))
        object.__setattr__(self, "compile", compile_options(self.compile))
        if self.dp_shard == -1 and self.dp_replicate == -1:
            raise TPError("only one of dp_shard and dp_replicate can be -1 ('the rest of the world')")
        for name in ("cpu_offload", "activation_checkpointing", "activation_offloading", "load_from_rank0",
                     "sequence_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise TPError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, minimum=0)
        if self.num_processes is not None:
            _check_int("num_processes", self.num_processes, minimum=1)

    @property
    def reshard_after_forward(self) -> bool:
        return self.sharding_strategy.reshard_after_forward

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        """``(dp_replicate, dp_shard, tp)``; call on a :meth:`for_world` result."""
        if -1 in (self.dp_shard, self.dp_replicate):
            raise TPError("the mesh is not resolved yet: call config.for_world(world_size) first")
        return (self.dp_replicate, self.dp_shard, self.tp)

    def for_world(self, world_size: int) -> ParallelConfig:
        """Fix ``-1`` degrees for ``world_size`` ranks and normalize the strategy.

        NO_SHARD makes every data-parallel rank a replica (``dp_shard=1``); FULL_SHARD /
        SHARD_GRAD_OP with ``dp_replicate > 1`` become HYBRID_SHARD / HYBRID_SHARD_ZERO2
        (what FSDP2 does with a 2-D data-parallel mesh); HYBRID_* without an explicit
        split shard within a node (``LOCAL_WORLD_SIZE``, as FSDP1 does).
        """
        _check_int("world_size", world_size, minimum=1)
        if self.num_processes is not None and self.num_processes != world_size:
            raise TPError(f"the config says num_processes={self.num_processes} but the world has "
                          f"{world_size} ranks; launch {self.num_processes} processes or fix the config")
        if world_size % self.tp:
            ok = [t for t in range(1, world_size + 1) if world_size % t == 0]
            raise TPError(f"world size {world_size} is not divisible by tp={self.tp}; tp values that work: {ok}")
        if world_size % (self.tp * self.cp * self.pp):
            raise TPError(f"world size {world_size} is not divisible by tp={self.tp} x cp={self.cp} x pp={self.pp}")
        dp = world_size // (self.tp * self.cp * self.pp)
        shard, rep, strategy = self.dp_shard, self.dp_replicate, self.sharding_strategy
        if strategy is Sharding.NO_SHARD:
            if shard not in (1, -1):
                raise TPError(f"NO_SHARD replicates every dp rank: dp_shard must be 1, got {shard}")
            shard, rep = 1, (dp if rep in (1, -1) else rep)
        elif strategy.is_hybrid and shard == -1 and rep == 1:
            shard, rep = _node_shard_degree(self.tp, dp, strategy), -1  # within a node, as FSDP1
        if shard == -1:
            shard = _divide("dp_shard", dp, rep)
        if rep == -1:
            rep = _divide("dp_replicate", dp, shard)
        if rep * shard * self.cp * self.tp * self.pp != world_size:
            raise TPError(f"pp={self.pp} x dp_replicate={rep} x dp_shard={shard} x cp={self.cp} x tp={self.tp} = "
                          f"{rep * shard * self.cp * self.tp * self.pp} ranks, but the world has {world_size}; use "
                          "-1 for one of the dp degrees")
        carved = shard * self.cp  # the mesh's shard dim holds the CP ranks too
        if carved % self.ep:
            ok = [e for e in range(1, carved + 1) if carved % e == 0]
            raise TPError(f"ep={self.ep} must divide dp_shard={shard} x cp={self.cp} (expert-parallel ranks are "
                          f"carved from the data-parallel shard and context ranks that share a tp rank); ep "
                          f"values that work: {ok}, or raise dp_shard")
        if rep > 1:
            strategy = strategy.hybrid_form()
        return replace(self, dp_shard=shard, dp_replicate=rep, sharding_strategy=strategy)


def check_degree(name: str, value: Any) -> None:
    """A degree or count given to a front door: an integer >= 1 (not a bool, not a string)."""
    _check_int(name, value, minimum=1)


def _check_int(name: str, value: Any, *, minimum: int, forbid: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or value == forbid:
        lo, extra = (1, " (-1 = the rest of the world)") if minimum == -1 else (minimum, "")
        raise TPError(f"{name} must be an integer >= {lo}{extra}, got {value!r}")


def _divide(name: str, total: int, other: int) -> int:
    if total % other:
        raise TPError(f"cannot pick {name}: {total} data-parallel ranks are not divisible by {other}")
    return total // other


def _node_shard_degree(tp: int, dp: int, strategy: Sharding) -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local and local.isdigit() and int(local) % tp == 0 and dp % (int(local) // tp) == 0:
        return int(local) // tp
    raise TPError(f"{strategy.value} needs the split of the {dp} data-parallel ranks: pass dp_replicate=N "
                  "(replicas) or dp_shard=N (ranks per shard group); LOCAL_WORLD_SIZE is not set to infer it")


# ------------------------------------------------------------------------ key tables


@dataclass(frozen=True)
class Sets:
    """A key that sets ParallelConfig fields: ``fn(value) -> {field: value}``."""

    fn: Callable[[Any], dict[str, Any]]


@dataclass(frozen=True)
class NoEffect:
    """A key accepted for compatibility that changes nothing; ``reason`` says why."""

    reason: str
    check: Callable[[Any], Any] | None = None  # still validate the value when given


@dataclass(frozen=True)
class Only:
    """A key whose only supported value is ``value`` (a feature tpcompile lacks)."""

    value: Any
    reason: str


Rule = Sets | NoEffect | Only


def _int(v: Any) -> int:
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TPError(f"expected an integer, got {v!r}")
    return v


_TRUE, _FALSE = ("y", "yes", "t", "true", "on", "1"), ("n", "no", "f", "false", "off", "0")


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE:  # accelerate's str_to_bool
        return v.strip().lower() in _TRUE
    raise TPError(f"expected true or false, got {v!r}")


def _to(name: str, conv: Callable[[Any], Any] = lambda v: v) -> Sets:
    return Sets(lambda v: {name: conv(v)})


def _hybrid_shard_degree(v: Any) -> dict[str, Any]:
    # SMP: 0 = the largest degree tp allows (all dp ranks), 1 = NO_SHARD, N = shard over N
    # ranks and replicate across the rest (HYBRID_SHARD unless the strategy says ZERO2).
    n = _int(v)
    if n < 0:
        raise TPError(f"expected an integer >= 0, got {v!r}")
    if n == 0:
        return {}
    if n == 1:
        return {"sharding_strategy": Sharding.NO_SHARD, "dp_shard": 1}
    return {"dp_shard": n, "dp_replicate": -1}


def _state_dict_type(v: Any) -> dict[str, Any]:
    # LOCAL_STATE_DICT: FSDP1 saves its flat-parameter shards; tpcompile's "local" kind saves
    # each rank's own tensors; both reload only at the layout that wrote them
    kinds = {"FULL_STATE_DICT": CheckpointKind.FULL, "SHARDED_STATE_DICT": CheckpointKind.SHARDED,
             "LOCAL_STATE_DICT": CheckpointKind.LOCAL}
    key = str(v).strip().upper()
    if key not in kinds:
        raise TPError(f"expected one of {sorted(kinds)}, got {v!r}")
    return {"checkpoint": kinds[key]}


def _must_be(expected: str, why: str) -> Sets:
    def check(v: Any) -> dict[str, Any]:
        if str(v).strip().upper() != expected:
            raise TPError(f"only {expected} is supported: {why}")
        return {}
    return Sets(check)


def _layer_classes(v: Any) -> dict[str, Any]:
    names = v.split(",") if isinstance(v, str) else list(v)
    return {"wrap_classes": tuple(sorted({str(n).strip() for n in names if str(n).strip()}))}


def _reshard(v: Any) -> dict[str, Any]:
    # FSDP2 configs write a bool (combined with the strategy once keywords are in, see
    # _apply_reshard), FSDP1 configs a strategy name
    if isinstance(v, bool) or (isinstance(v, str) and v.strip().lower() in _TRUE + _FALSE):
        return {_RESHARD: _bool(v)}
    return {"sharding_strategy": Sharding.parse(v)}


def _prefetch(v: Any) -> None:
    if str(v).strip().upper() not in ("BACKWARD_PRE", "BACKWARD_POST", "NO_PREFETCH"):
        raise TPError(f"expected BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH, got {v!r}")


def _fsdp_version(v: Any) -> dict[str, Any]:
    if _int(v) not in (1, 2):
        raise TPError(f"expected 1 or 2, got {v!r}")
    return {}  # both map onto FSDP2: an FSDP1 strategy name means the same reshard choice


def _fp8(v: Any) -> Any:
    """``fp8`` as given (checked): off, a recipe name, or torchao's config object."""
    if v is None or v is False:
        return None
    if v is True or (isinstance(v, str) and v.strip().lower() in ("tensorwise", "rowwise", "true")):
        return True if v is True or v.strip().lower() == "true" else v.strip().lower()
    if type(v).__name__ == "Float8LinearConfig":
        return v
    raise TPError(f"fp8 must be True, 'tensorwise', 'rowwise' or a torchao.float8.Float8LinearConfig, got {v!r}")


# the torch.compile keywords a block's compile takes; fullgraph is ours (always False:
# a break is counted and reported, never an error mid-step)
COMPILE_KEYS = ("backend", "mode", "dynamic", "options")


def compile_options(v: Any) -> dict[str, Any] | None:
    """``compile`` as given (checked): ``None`` off, else ``torch.compile``'s keywords.

    ``True`` is the defaults (inductor), a string a backend's name, a mapping the keywords
    themselves (:data:`COMPILE_KEYS`)."""
    if v is None or v is False:
        return None
    if v is True:
        return {}
    if isinstance(v, str) and v.strip():
        return {"backend": v.strip()}
    if isinstance(v, Mapping):
        unknown = sorted(set(v) - set(COMPILE_KEYS))
        if unknown:
            raise TPError(f"compile: unknown torch.compile keywords {unknown}; tpcompile passes on {list(COMPILE_KEYS)} "
                          "(each block is compiled on its own, fullgraph=False)")
        return dict(v)
    raise TPError(f"compile must be True, False, a torch.compile backend's name or a dict of {list(COMPILE_KEYS)}, "
                  f"got {v!r}")


_DYNAMO_KEYS = {"dynamo_backend": "backend", "dynamo_mode": "mode", "dynamo_use_dynamic": "dynamic"}


def _dynamo_config(v: Any) -> dict[str, Any]:
    """accelerate's ``dynamo_config`` section: its backend (``NO`` is off), mode and
    dynamic flag; regional compilation is what tpcompile does anyway (each block), and
    ``dynamo_use_fullgraph`` is refused: tpcompile compiles blocks, never the whole model."""
    if not v:
        return {}
    if not isinstance(v, Mapping):
        raise TPError(f"dynamo_config must be a mapping, got {v!r}")
    unknown = sorted(set(v) - set(_DYNAMO_KEYS) - {"dynamo_use_fullgraph", "dynamo_use_regional_compilation"})
    if unknown:
        raise TPError(f"dynamo_config: unknown keys {unknown}; tpcompile reads {sorted(_DYNAMO_KEYS)} "
                      "and dynamo_use_regional_compilation")
    if v.get("dynamo_use_fullgraph") and _bool(v["dynamo_use_fullgraph"]):
        raise TPError("dynamo_config: dynamo_use_fullgraph is not supported: tpcompile compiles each block "
                      "(regional compilation), never the whole model; drop dynamo_use_fullgraph")
    backend = str(v.get("dynamo_backend", "INDUCTOR")).strip().lower()
    if backend == "no":
        return {}
    out: dict[str, Any] = {"backend": backend}
    if v.get("dynamo_mode") not in (None, "default"):
        out["mode"] = str(v["dynamo_mode"])
    if "dynamo_use_dynamic" in v:
        out["dynamic"] = _bool(v["dynamo_use_dynamic"])
    return {"compile": out}


def _accelerate_precision(v: Any) -> dict[str, Any]:
    """accelerate's ``mixed_precision``: ``fp8`` is tpcompile's FP8 matmuls (torchao),
    the rest a parameter dtype for FSDP2."""
    if isinstance(v, str) and v.strip().lower() == "fp8":
        return {"fp8": True}
    return {"mixed_precision": mixed_precision_policy(v)}


_FP8_BACKENDS = ("AO",)


def _fp8_config(v: Any) -> dict[str, Any]:
    """accelerate's ``fp8_config``: only the torchao backend (``AO``) exists here."""
    if not v:
        return {}
    if not isinstance(v, dict):
        raise TPError(f"fp8_config must be a mapping, got {v!r}")
    backend = str(v.get("backend", "AO")).upper()
    if backend not in _FP8_BACKENDS:
        raise TPError(f"fp8_config backend {backend!r} is not supported: tpcompile's FP8 is torchao's float8 "
                      "training (backend: AO); Transformer Engine and MS-AMP cannot be used here")
    return {}


def _empty(what: str) -> Sets:
    def check(v: Any) -> dict[str, Any]:
        if v:
            raise TPError(f"{what} is not supported by tpcompile.parallelize; remove this section")
        return {}
    return Sets(check)


_RESHARD = "_reshard_after_forward"  # private: resolved against the final strategy
_LAUNCHER = "a launcher setting read by `accelerate launch`, not by the model"

SMP_KEYS: dict[str, Rule] = {
    "tensor_parallel_degree": _to("tp", _int),
    "hybrid_shard_degree": Sets(_hybrid_shard_degree),
    "sm_activation_offloading": _to("activation_offloading", _bool),
    "activation_loading_horizon": _to("loading_horizon", _int),
    "random_seed": _to("seed", _int),
    "tensor_parallel_seed": NoEffect("SMP seeds dropout inside TP regions per TP rank from it; "
                                     "tpcompile keeps one RNG stream per TP group (random_seed) and "
                                     "draws masks over sharded activations at their whole shape, each "
                                     "rank keeping its rows: the masks one process draws", _int),
    "expert_parallel_degree": _to("ep", _int),
    "context_parallel_degree": _to("cp", _int),
    "pipeline_parallel_degree": _to("pp", _int),
    "pp_schedule": _to("pp_schedule", str),
    "microbatches": _to("pp_microbatches", _int),
    "fsdp_cache_flush_warnings": NoEffect("SMP's warnings about CUDA cache flushes inside its FSDP; "
                                          "tpcompile adds no allocator logging", _bool),
    "allow_empty_shards": NoEffect("FSDP2 pads uneven shards and allows empty ones already", _bool),
}

ACCELERATE_KEYS: dict[str, Rule] = {
    # top level of an `accelerate config` YAML
    "distributed_type": _must_be("FSDP", "tpcompile.parallelize applies FSDP2; use distributed_type: FSDP"),
    "mixed_precision": Sets(_accelerate_precision),
    "num_processes": _to("num_processes", _int),
    "deepspeed_config": _empty("deepspeed_config"),
    "megatron_lm_config": _empty("megatron_lm_config"),
    "fp8_config": Sets(_fp8_config),
    "dynamo_config": Sets(_dynamo_config),
    **{k: NoEffect(_LAUNCHER) for k in (
        "compute_environment", "debug", "downcast_bf16", "enable_cpu_affinity", "gpu_ids",
        "machine_rank", "main_process_ip", "main_process_port", "main_training_function",
        "num_machines", "rdzv_backend", "same_network", "use_cpu", "mpirun_config", "tpu_env",
        "tpu_name", "tpu_zone", "tpu_use_cluster", "tpu_use_sudo", "tpu_vm", "commands",
        "command_file")},
    # fsdp_config
    "fsdp_version": Sets(_fsdp_version),
    "fsdp_sharding_strategy": _to("sharding_strategy", Sharding.parse),
    "fsdp_reshard_after_forward": Sets(_reshard),
    "fsdp_offload_params": _to("cpu_offload", _bool),
    "fsdp_auto_wrap_policy": _must_be("TRANSFORMER_BASED_WRAP", "tpcompile wraps the transformer blocks "
                                      "its analysis finds; NO_WRAP and SIZE_BASED_WRAP are not supported"),
    "fsdp_transformer_layer_cls_to_wrap": Sets(_layer_classes),
    "fsdp_state_dict_type": Sets(_state_dict_type),
    "fsdp_activation_checkpointing": _to("activation_checkpointing", _bool),
    # accelerate requires sync_module_states with cpu_ram_efficient_loading; sync alone also
    # means "every rank takes rank 0's weights"
    "fsdp_cpu_ram_efficient_loading": Sets(lambda v: {"load_from_rank0": True} if _bool(v) else {}),
    "fsdp_sync_module_states": _to("load_from_rank0", _bool),
    "fsdp_use_orig_params": NoEffect("FSDP2 always keeps the original parameters (one DTensor "
                                     "each, no FlatParameter)", _bool),
    "fsdp_backward_prefetch": NoEffect("FSDP2 prefetches the next block's all-gather in backward "
                                       "by itself (BACKWARD_PRE behaviour)", _prefetch),
    "fsdp_backward_prefetch_policy": NoEffect("the older spelling of fsdp_backward_prefetch that "
                                              "accelerate still reads; FSDP2 prefetches by itself "
                                              "(BACKWARD_PRE behaviour)", _prefetch),
    "fsdp_forward_prefetch": NoEffect("FSDP2 overlaps the next all-gather with forward compute by "
                                      "itself", _bool),
    "fsdp_min_num_params": NoEffect("only read by SIZE_BASED_WRAP; tpcompile wraps the blocks "
                                    "its analysis finds", _int),
    "fsdp_ignored_modules": _empty("fsdp_ignored_modules"),
    # parallelism_config
    "parallelism_config_dp_replicate_size": _to("dp_replicate", _int),
    "parallelism_config_dp_shard_size": _to("dp_shard", _int),
    "parallelism_config_tp_size": _to("tp", _int),
    "parallelism_config_cp_size": _to("cp", _int),
    "parallelism_config_pp_size": _to("pp", _int),
    "parallelism_config_sp_size": Only(1, "accelerate's sp_size is DeepSpeed-Ulysses sequence parallelism "
                                          "(attention heads all-to-all), not implemented; tpcompile's "
                                          "Megatron-style split is the sequence_parallel=True keyword"),
    **{k: NoEffect("only read when context/sequence parallelism is on (cp_size/sp_size > 1)")
       for k in ("parallelism_config_cp_backend", "parallelism_config_cp_comm_strategy",
                 "parallelism_config_sp_backend", "parallelism_config_sp_seq_length",
                 "parallelism_config_sp_seq_length_is_variable",
                 "parallelism_config_sp_attn_implementation")},
}

# the keyword names of parallelize, plus the settings only configs reach
_KEYWORDS = tuple(f.name for f in fields(ParallelConfig) if f.name not in ("source", "no_effect"))
_NORMALIZE: dict[str, Callable[[Any], Any]] = {
    "sharding_strategy": Sharding.parse, "mixed_precision": mixed_precision_policy,
    "checkpoint": CheckpointKind, "wrap_classes": tuple, "fp8": _fp8,
    "compile": compile_options,
}
NATIVE_KEYS: dict[str, Rule] = {name: _to(name, _NORMALIZE.get(name, lambda v: v)) for name in _KEYWORDS}

# keys people carry over from elsewhere: say where the setting lives instead
_HINTS = {
    "delayed_param_initialization": "SMP v2 has no such key (its delayed init is "
        "torch.sagemaker.delayed_param.DelayedParamIniter); parallelize initializes a model built "
        "on the meta device by itself, seeded by seed=/random_seed",
    "cpu_offload": "SMP v2 has no such key; pass cpu_offload=True or fsdp_offload_params: true",
    "sharded_data_parallel_degree": "that is SMP v1; SMP v2 calls it hybrid_shard_degree",
}


@dataclass(frozen=True)
class _Dialect:
    name: str
    keys: dict[str, Rule]
    unwrap: Callable[[dict[str, Any]], dict[str, Any]]


def _unwrap_smp(d: dict[str, Any]) -> dict[str, Any]:
    if "smdistributed" not in d:
        return d
    mp = d["smdistributed"].get("modelparallel", {}) if isinstance(d["smdistributed"], Mapping) else {}
    if not mp.get("enabled", True):
        raise TPError("smdistributed.modelparallel.enabled is false: this config turns SMP off")
    # the SDK's distribution= also names the launcher (torch_distributed), which SMP v2 requires
    # and tpcompile does not read
    rest = sorted(set(d) - {"smdistributed", "torch_distributed"}) + sorted(set(mp) - {"enabled", "parameters"})
    if rest:
        raise TPError(f"unexpected keys {rest} beside smdistributed.modelparallel.parameters")
    return dict(mp.get("parameters", {}))


def _unwrap_accelerate(d: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in d.items() if k not in ("fsdp_config", "parallelism_config")}
    for section in ("fsdp_config", "parallelism_config"):
        inner = d.get(section) or {}
        if not isinstance(inner, Mapping):
            raise TPError(f"{section} must be a mapping, got {inner!r}")
        out.update(inner)  # the sections' keys are prefixed, so they cannot collide
    return out


_DIALECTS = (
    _Dialect("tpcompile", NATIVE_KEYS, dict),
    _Dialect("smp", SMP_KEYS, _unwrap_smp),
    _Dialect("accelerate", ACCELERATE_KEYS, _unwrap_accelerate),
)


def _load(config: Any) -> dict[str, Any]:
    """A dict from a mapping, a JSON string, or a .json / .yaml / .yml path."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, str) and config.lstrip().startswith("{"):
        try:
            return json.loads(config)
        except json.JSONDecodeError as e:
            raise TPError(f"config is not valid JSON: {e}") from None
    if not isinstance(config, str | os.PathLike):
        raise TPError(f"config must be a dict, a JSON string or a path, got {type(config).__name__}")
    path = Path(config)
    if not path.is_file():
        raise TPError(f"config file {str(path)!r} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise TPError("reading a YAML config needs PyYAML: pip install pyyaml") from None
        data = yaml.safe_load(text)
    else:
        data = json.loads(text)
    if not isinstance(data, Mapping):
        raise TPError(f"config file {str(path)!r} does not hold a mapping")
    return dict(data)


def _pick_dialect(raw: dict[str, Any]) -> tuple[_Dialect | None, dict[str, Any]]:
    scored = []
    for d in _DIALECTS:
        flat = d.unwrap(raw)
        scored.append((sum(k in d.keys for k in flat), d, flat))
    best, dialect, flat = max(scored, key=lambda s: s[0])
    for _, other, f in scored:
        stray = sorted(k for k in f if k in other.keys and k not in dialect.keys)
        if best and other is not dialect and stray:
            raise TPError(f"the config mixes {dialect.name} keys with {other.name} keys {stray}; "
                          "use one dialect")
    return (dialect if best else None), flat


def _unknown(key: str, dialect: _Dialect | None) -> TPError:
    pool = sorted(dialect.keys) if dialect else sorted({k for d in _DIALECTS for k in d.keys})
    close = difflib.get_close_matches(key, pool, n=3)
    hint = f" ({_HINTS[key]})" if key in _HINTS else ""
    near = f"; did you mean {close}?" if close else ""
    if dialect is None:
        listing = "; ".join(f"{d.name}: {sorted(d.keys)}" for d in _DIALECTS)
        return TPError(f"config key {key!r} belongs to no supported dialect{hint}{near} "
                       f"Supported keys by dialect: {listing}")
    return TPError(f"unknown {dialect.name} config key {key!r}{hint}{near} "
                   f"Supported {dialect.name} keys: {pool}")


def _read(config: Any) -> tuple[dict[str, Any], dict[str, str], str, tuple[str, ...]]:
    """``(settings, field -> the key that set it, dialect name, no-effect keys)``."""
    if config is None:
        return {}, {}, "keywords", ()
    dialect, flat = _pick_dialect(_load(config))
    settings: dict[str, Any] = {}
    origin: dict[str, str] = {}
    ignored: list[str] = []
    for key, value in flat.items():
        rule = dialect.keys.get(key) if dialect else None
        if rule is None:
            raise _unknown(key, dialect)
        try:
            if isinstance(rule, NoEffect):
                if rule.check is not None and value is not None:
                    rule.check(value)
                ignored.append(key)
                continue
            if isinstance(rule, Only):
                if _int(value) != rule.value:
                    raise TPError(f"only {rule.value} is supported: {rule.reason}")
                continue
            updates = rule.fn(value)
        except TPError as e:
            raise TPError(f"config key {key!r}={value!r}: {e}") from None
        for name, v in updates.items():
            if name in settings and settings[name] != v:
                raise TPError(f"config keys {origin[name]!r} and {key!r} disagree about {name} "
                              f"({settings[name]!r} vs {v!r})")
            settings[name], origin[name] = v, key
    return settings, origin, dialect.name if dialect else "keywords", tuple(ignored)


def _apply_reshard(settings: dict[str, Any], origin: dict[str, str]) -> None:
    """Turn accelerate's boolean ``fsdp_reshard_after_forward`` into a strategy."""
    reshard = settings.pop(_RESHARD, None)
    if reshard is None:
        return
    strategy = settings.get("sharding_strategy")
    if strategy is None:
        settings["sharding_strategy"] = Sharding.FULL_SHARD if reshard else Sharding.SHARD_GRAD_OP
    elif strategy is not Sharding.NO_SHARD and strategy.reshard_after_forward != reshard:
        raise TPError(f"fsdp_reshard_after_forward={reshard} contradicts sharding_strategy="
                      f"{strategy.value} (from {origin.get('sharding_strategy', 'the keywords')!r})")


def resolve_config(config: Any = None, *, world_size: int | None = None, **keywords: Any) -> ParallelConfig:
    """Merge ``config`` (any dialect) with explicitly passed ``keywords``.

    Args:
        config: ``None``, a dict, a JSON string, or a path to a .json / .yaml / .yml file
            holding tpcompile keywords, an SMP v2 config or an accelerate (FSDP) config.
        world_size: if given, ``-1`` degrees are resolved (:meth:`ParallelConfig.for_world`).
        keywords: :func:`tpcompile.parallelize` keywords; one that disagrees with a config
            key raises.

    Example:
        >>> smp = resolve_config({"tensor_parallel_degree": 2, "hybrid_shard_degree": 2}, world_size=8)
        >>> smp == resolve_config(tp=2, dp_shard=2, dp_replicate=2, world_size=8)
        True
    """
    unknown = sorted(set(keywords) - set(_KEYWORDS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], _KEYWORDS, n=3)
        raise TPError(f"unknown keyword {unknown[0]!r}" + (f"; did you mean {close}?" if close else "")
                      + f" Keywords: {sorted(_KEYWORDS)}")
    settings, origin, source, ignored = _read(config)
    for name, value in keywords.items():
        value = _NORMALIZE.get(name, lambda v: v)(value)
        if name in settings and settings[name] != value:
            raise TPError(f"{name}={value!r} conflicts with the config's {origin[name]!r}, which sets "
                          f"{name}={settings[name]!r}; drop one of them")
        settings[name] = value
    _apply_reshard(settings, origin)
    cfg = ParallelConfig(**settings, source=source, no_effect=ignored)
    return cfg if world_size is None else cfg.for_world(world_size)
