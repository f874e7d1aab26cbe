"""The composer: every parallelism applied to the model from outside, in one fixed order.

Each step is a small function over ``(job)``; :func:`tensor_parallel` runs steps 1-3
(that is ``transform``) and :func:`compose` runs them all (that is ``parallelize``)::

    0. pp           pipeline parallelism: keep this rank's stages, drop the rest; every
                    later step sees only the stages' modules
    1. tp           shard parameters as DTensors, hook the collectives, HF state dicts
    2. loss         the model's loss reads this rank's vocab shard (or loss-parallel)
    3. sp           sequence parallelism: split / gather the residual stream per block
       fp8          FP8 matmuls in the split projections, scales of whole tensors
    4. cp           context parallelism: each sequence split over the CP group
    5. ep           keep this rank's experts, all-to-all dispatch around their forward
    6. activations  checkpoint / offload per block (inside FSDP, outside TP)
       compile      each block's forward torch.compile'd, the hooks inside it traced
    7. fsdp         FSDP2 units: each block, then the root
       fp8 gather   FP8 weights' scales at each forward, before FSDP2's FP8 all-gathers
    8. materialise  a meta model's shards: init / rank 0's weights / an HF checkpoint
    9. mark         the attributes the HF Trainer and accelerate read; the tree guard

The order is torchtitan's: TP's hooks end up innermost and FSDP2's outermost, and every
step after 1 reads only the plan and the meshes of :class:`~tpcompile.runtime.mesh.ParallelDims`.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .analysis.boundaries import Boundaries
from .checkpoint.hf_methods import bind_refused_methods, bind_save_pretrained, route_peft_saves
from .checkpoint.pretrained import CheckpointLoader, scatter_from_rank0
from .config import ParallelConfig
from .errors import TPError
from .integrations.hf import support_trainers
from .plan import Plan, build_table
from .plan.stages import StagePlan
from .plan.types import renamed_fqn
from .runtime import activations
from .runtime.adapters import adopt_plan, global_twin, size_adapters_globally
from .runtime.apply import apply_plan, install_root_hooks
from .runtime.context import install_context_parallel
from .runtime.experts import shard_experts
from .runtime.fsdp import fully_shard_model, shard_added_modules
from .runtime.guard import planned_names, watch_tree
from .runtime.loss import install_local_loss, install_loss_parallel
from .runtime.markers import mark_model
from .runtime.materialize import Materializer, keep_present
from .runtime.mesh import ParallelDims, data_parallel_rank
from .runtime.pipeline import PipelineRun, split_model
from .runtime.sequence import install_sequence_parallel

__all__ = ["Job", "compose", "tensor_parallel"]


@dataclass(kw_only=True)
class Job:
    """What the steps share: the model, its plan, the meshes and the runtime pieces."""

    model: nn.Module
    plan: Plan
    tp_mesh: DeviceMesh | None  # None: tp == 1, nothing is split
    backend: Any = None
    mesh: DeviceMesh | None = None  # parallelize's (dp_replicate, dp_shard, tp) mesh
    cfg: ParallelConfig | None = None
    device: str = "cpu"
    rank0_weights: bool = False  # transform(load_state_dict_from_rank0=True)
    pending: Materializer | CheckpointLoader | None = None
    experts: list[nn.Module] = field(default_factory=list)
    # plans a model the way this job's plan was made (transform's options): modules added
    # after transform (PEFT adapters) are planned with it, from the adapted model's dataflow
    replan: Callable[[nn.Module], Plan] | None = None
    names: dict[int, str] = field(default_factory=dict)  # id(module) -> its name when planned
    fp8: Any = None  # None: off; True / "tensorwise" / "rowwise" / a torchao Float8LinearConfig
    fp8_filter: Callable[[nn.Module, str], bool] | None = None
    # pipeline parallelism: the stages (plan/stages.py), the boundaries they cut at, the
    # whole (pp, dp_replicate, dp_shard, tp) mesh and, once split, the run driving them
    stages: StagePlan | None = None
    bounds: Boundaries | None = None
    whole_mesh: DeviceMesh | None = None
    twin: nn.Module | None = None
    pipeline: PipelineRun | None = None

    @property
    def fsdp(self) -> bool:
        """Whether FSDP2 wraps the model: under ``parallelize`` when there is something
        for it to do — more than one data-parallel rank (``dp_replicate x dp_shard x
        cp``), a pipeline (each stage reduces its gradients once per step through it), or
        a mixed-precision or CPU-offload policy (FSDP2 implements them).  With one
        data-parallel rank and none of those, FSDP2 would only copy every parameter into
        its all-gather buffer and every gradient out of its reduce-scatter, each step
        (torchtitan skips it there too): a tp=2 step on 2 cores measured 2.75-3.10 s with
        it, 2.09-2.15 s without."""
        cfg = self.cfg
        if cfg is None:
            return False
        return (cfg.dp_replicate * cfg.dp_shard * cfg.cp > 1 or self.stages is not None
                or cfg.mixed_precision is not None or cfg.cpu_offload)


# ---------------------------------------------------------------------------- steps


def apply_pp(job: Job) -> None:
    """0. Pipeline parallelism: this rank keeps the modules of its stages under their HF
    names (runtime/pipeline.py); the plan, the blocks and the pending init shrink to them."""
    if job.stages is None:
        return
    model = job.model
    run = split_model(model, job.stages, job.bounds, job.whole_mesh, job.twin)
    present = {n for n, _ in model.named_modules()}
    job.plan = _tied_under_present_names(job.plan, present).renamed(lambda n: n if n in present else None,
                                                                   job.plan.model_class)
    if isinstance(job.pending, Materializer | CheckpointLoader):
        field_name = "tensors" if isinstance(job.pending, Materializer) else "buffers"
        setattr(job.pending, field_name, keep_present(getattr(job.pending, field_name), model))
    if job.cfg is not None and job.cfg.mixed_precision is not None:
        run.hidden_dtype = job.cfg.mixed_precision.param_dtype
    model.tpcompile_pipeline = job.pipeline = run


def _tied_under_present_names(plan: Plan, present: set[str]) -> Plan:
    """A tied parameter planned under a name whose module this stage dropped (GPT-2's
    ``wte.weight`` on the last stage) is planned under its first name still here
    (``lm_head.weight``): the same role and layout, so both copies hold the same shard."""
    params = dict(plan.params)
    for pp in plan.params.values():
        if pp.module in present or not pp.tied_to:
            continue
        alias = next((a for a in pp.tied_to if a.rpartition(".")[0] in present), None)
        if alias is not None:
            params[alias] = replace(pp, fqn=alias, module=alias.rpartition(".")[0],
                                    tied_to=[a for a in pp.tied_to if a != alias])
    return replace(plan, params=params)


def apply_tp(job: Job) -> None:
    """1. Shard every parameter per the plan and install the backend's hooks."""
    model, plan = job.model, job.plan
    # the translation table is taken while names and shapes are still the HF ones
    table = build_table(model, plan if job.tp_mesh is not None else None)
    full = None
    if job.tp_mesh is not None:
        if job.rank0_weights and dist.get_rank() == 0:
            full = dict(model.state_dict())  # the real tensors, released one by one while sent
        apply_plan(model, plan, job.backend)
        model.tpcompile_mesh = job.tp_mesh
    model.tpcompile_plan = plan
    model.tpcompile_table = table
    if job.tp_mesh is not None and job.rank0_weights:
        scatter_from_rank0(model, table, full)
    bind_save_pretrained(model)  # transformers' own would gather the model onto one rank
    if job.tp_mesh is not None:
        bind_refused_methods(model)


def apply_loss(job: Job) -> None:
    """2. The model's own loss computed from this rank's vocab shard."""
    if job.tp_mesh is None:
        return
    (install_loss_parallel if job.plan.loss_parallel else install_local_loss)(job.model, job.plan, job.backend)


def apply_sp(job: Job) -> None:
    """3. Sequence parallelism between the tensor-parallel regions."""
    if job.tp_mesh is not None and job.plan.sequence:
        install_sequence_parallel(job.model, job.plan.sequence, job.backend)


def apply_fp8(job: Job) -> None:
    """3b. FP8 matmuls (torchao float8) in the projections the plan splits, with the
    amax of every split operand reduced over the TP group (runtime/fp8.py)."""
    if job.fp8 is None or job.fp8 is False:
        return
    from .runtime.fp8 import convert_fp8  # imports torchao: only when FP8 is asked for

    job.model.tpcompile_fp8 = convert_fp8(job.model, job.plan, job.tp_mesh, job.fp8, job.fp8_filter,
                                          fsdp=job.fsdp)


def apply_fp8_gather(job: Job) -> None:
    """7b. FSDP2 all-gathers FP8 weights: their scales are computed at the start of every
    forward of the root, before FSDP2's first all-gather (runtime/fp8_gather.py)."""
    if job.fp8 is None or job.fp8 is False or not job.fsdp:
        return
    from .runtime.fp8_gather import install_gather_scales
    from .runtime.mesh import stage_group

    install_gather_scales(job.model, stage_group(job.whole_mesh))


def apply_cp(job: Job) -> None:
    """4. Context parallelism: each sequence split over the CP group, keys and values
    gathered in attention (runtime/context.py); checked first (plan/context.py)."""
    cfg = job.cfg
    if cfg is None or cfg.cp <= 1:
        return
    mesh4 = _dims(cfg).context_mesh(job.mesh)
    install_context_parallel(job.model, mesh4["cp"])


def apply_ep(job: Job) -> None:
    """5. Expert parallelism on the 4-D mesh ``(dp_replicate, efsdp, ep, tp)``: this
    rank's experts, all-to-all dispatch around the experts' forward (inside TP's hooks)."""
    cfg, model = job.cfg, job.model
    if cfg is None or cfg.ep <= 1:
        return
    if not job.plan.experts:
        raise TPError(f"ep={cfg.ep} but tpcompile found no stacked experts in {type(model).__name__} (3-D "
                      "parameters indexed by a router's top-k); expert parallelism is for MoE models: "
                      "drop ep")
    mesh4 = _dims(cfg).expert_mesh(job.mesh)
    model.tpcompile_expert_mesh = mesh4
    job.experts = shard_experts(model, job.plan.experts, mesh4)


def apply_activations(job: Job) -> None:
    """6. Activation checkpointing, then offloading, before FSDP so that FSDP's hooks end
    up outermost and TP's innermost (the nesting is explained in runtime/activations.py)."""
    cfg, blocks = job.cfg, list(job.plan.blocks)
    if cfg is None:
        return
    if cfg.activation_checkpointing:
        activations.checkpoint_blocks(job.model, blocks)
    if cfg.activation_offloading:
        job.model.tpcompile_offload = activations.offload_activations(
            job.model, blocks, loading_horizon=cfg.loading_horizon)


def apply_compile(job: Job) -> None:
    """6b. Each block's ``forward`` compiled (runtime/compiled.py): the hooks of the
    modules inside it (TP, SP, EP, FP8) are traced into its graph; the block's own hooks
    (checkpoint, offload, and FSDP2's, added next) stay outside, eager."""
    cfg = job.cfg
    if cfg is None or cfg.compile is None:
        return
    from .runtime.compiled import compile_blocks  # imports dynamo: only when compile is asked for

    present = {n for n, _ in job.model.named_modules()}
    blocks = [b for b in job.plan.blocks if b in present]
    if not blocks:
        raise TPError(f"compile=...: tpcompile found no blocks in {type(job.model).__name__} to compile")
    entry = getattr(job.backend, "forget_input", None)
    job.model.tpcompile_compiled = compile_blocks(job.model, blocks, cfg.compile, entry)


def apply_fsdp(job: Job) -> None:
    """7. FSDP2: each block is one all-gather / reduce-scatter unit, the root holds the rest
    (not with one data-parallel rank and nothing else for FSDP2 to do: :attr:`Job.fsdp`)."""
    if not job.fsdp:
        return
    # FSDP2 shards over dp_shard x cp: to it (and the experts' gradient divide factor)
    # the CP ranks are data-parallel shards
    cfg = replace(job.cfg, dp_shard=job.cfg.dp_shard * job.cfg.cp, cp=1) if job.cfg.cp > 1 else job.cfg
    # a pipelined model: each stage module is the FSDP2 root of its own units
    roots = None if job.pipeline is None else list(job.pipeline.stages)
    fully_shard_model(job.model, list(job.plan.blocks), cfg, job.mesh, job.device, job.experts,
                      getattr(job.model, "tpcompile_expert_mesh", None), roots=roots)


def materialise(job: Job) -> None:
    """8. Fill a meta model's shards (or take rank 0's weights, or read each rank's rows
    of an HF checkpoint), per tensor.  The checkpoint code finds the TP group through the
    3-D mesh, so it is attached first."""
    cfg, model = job.cfg, job.model
    if cfg is None:
        return
    model.tpcompile_mesh = job.mesh
    used_seed = cfg.seed
    if isinstance(job.pending, CheckpointLoader):
        model.tpcompile_load_stats = job.pending.run(model, job.device)
    elif job.pending is not None:
        used_seed = job.pending.run(model, job.mesh, job.device)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed + data_parallel_rank(job.mesh)[0])
    model.tpcompile_parallel = replace(cfg, seed=used_seed)


def mark(job: Job) -> None:
    """9. What the HF Trainer / accelerate read to leave the model's parallelism alone,
    and the guard that plans (or refuses) modules added after planning (runtime/guard.py)."""
    mark_model(job.model)
    support_trainers()
    size_adapters_globally()
    route_peft_saves()
    _watch(job)
    _bind_merge(job)


def _watch(job: Job) -> None:
    job.names = planned_names(job.model)
    watch_tree(job.model, adopt=lambda found: adopt_new_modules(job, found))


def adopt_new_modules(job: Job, found: list[str]) -> None:
    """Plan modules added after the composer ran (runtime/adapters.py): the adapted
    model is planned from its own dataflow with the job's options, the new parameters are
    sharded and hooked; what was planned before must keep its layout."""
    model = job.model
    now = planned_names(model)
    new_name = {old: now.get(i) for i, old in job.names.items()}
    if not found:  # planned modules only moved (PEFT's merge_and_unload put the bases back)
        if any(old != new for old, new in new_name.items()):
            cls = job.plan.model_class
            model.tpcompile_plan = job.plan = model.tpcompile_plan.renamed(new_name.get, cls)
            model.tpcompile_table = model.tpcompile_table.renamed(lambda k: renamed_fqn(k, new_name.get), cls)
        _watch(job)
        return
    if job.cfg is not None and (job.cfg.cp > 1 or job.cfg.ep > 1 or job.cfg.activation_checkpointing
                                or job.cfg.activation_offloading or job.cfg.compile is not None):
        raise TPError(f"{', '.join(found[:4])} were added after tpcompile.parallelize with cp / ep / activation "
                      "checkpointing or offloading / compile, which wrapped the blocks already. Add adapters before "
                      "parallelize (get_peft_model(model, config) first, then parallelize the PeftModel)")
    if job.tp_mesh is not None:
        if job.replan is None:
            raise TPError(f"{', '.join(found[:4])} were added after tpcompile.transform(plan=...); a given plan "
                          "cannot be extended: plan the adapted model with plan_model and apply that plan")
        if job.plan.sequence:
            raise TPError(f"{', '.join(found[:4])} were added after tpcompile.transform(sequence_parallel=True); "
                          "add adapters before transform (get_peft_model(model, config) first)")
        old = model.tpcompile_plan.renamed(new_name.get, job.plan.model_class)
        twin = global_twin(model, old)
        new = job.replan(twin)
        new.stats["replans"] = job.plan.stats.get("replans", 0) + 1  # once per PEFT injection
        adopt_plan(model, old, new, job.backend)
        model.tpcompile_table = build_table(twin, new)
        job.plan = new
    if job.fsdp:  # FSDP2 units for the new parameters, each module its own
        added = [m for m in model.modules() if not m.__dict__.get("_tpcompile_planned")
                 and any(p is not None for p in m._parameters.values())]
        shard_added_modules(model, added, job.cfg, job.mesh, job.device)
    _watch(job)


def _bind_merge(job: Job) -> None:
    """A PEFT model's ``merge_and_unload`` returns its base model with the adapters merged
    into the (sharded) base weights; the base then carries the plan under its own names."""
    model = job.model
    if not isinstance(getattr(model, "peft_config", None), dict):
        return
    merge = getattr(model, "merge_and_unload", None)  # PEFT's, found through its tuner
    if merge is None:
        return

    def merge_and_unload(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if job.fsdp:
            raise TPError("merge_and_unload() after tpcompile.parallelize is not supported (FSDP2 holds "
                          "the weights sharded): merge before parallelize, or save the adapters with "
                          "save_pretrained and merge them into an HF checkpoint")
        old = {id(m): n for n, m in self.named_modules()}
        merged = merge(*args, **kwargs)
        name = {old[id(m)]: n for n, m in merged.named_modules() if id(m) in old}
        cls = type(merged).__name__
        adopted = replace(job, model=merged, plan=self.tpcompile_plan.renamed(name.get, cls))
        merged.tpcompile_mesh = self.tpcompile_mesh
        merged.tpcompile_plan = adopted.plan
        merged.tpcompile_table = self.tpcompile_table.renamed(lambda k: renamed_fqn(k, name.get), cls)
        bind_save_pretrained(merged)
        install_root_hooks(merged, job.backend)
        apply_loss(adopted)
        mark_model(merged)
        watch_tree(merged)
        return merged

    model.merge_and_unload = types.MethodType(merge_and_unload, model)


# The fixed order.
TENSOR_PARALLEL_STEPS = (apply_tp, apply_loss, apply_sp, apply_fp8)
STEPS = (apply_pp, *TENSOR_PARALLEL_STEPS, apply_cp, apply_ep, apply_activations, apply_compile, apply_fsdp,
         apply_fp8_gather,
         materialise, mark)


def tensor_parallel(job: Job) -> nn.Module:
    """Steps 1-3 (with fp8) and the marks: what ``transform`` does."""
    for step in (*TENSOR_PARALLEL_STEPS, mark):
        step(job)
    return job.model


def compose(job: Job) -> nn.Module:
    """Every step, in order: what ``parallelize`` does."""
    for step in STEPS:
        step(job)
    return job.model


def _dims(cfg: ParallelConfig) -> ParallelDims:
    return ParallelDims(dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, tp=cfg.tp, ep=cfg.ep, cp=cfg.cp,
                        pp=cfg.pp)
