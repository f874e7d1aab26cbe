"""The front doors: ``plan_model``, ``transform``, ``parallelize``, ``from_pretrained``.

Each validates its arguments, builds the meshes (:class:`~tpcompile.runtime.mesh.ParallelDims`),
plans (or checks a given plan) and hands a :class:`~tpcompile.compose.Job` to the composer,
which applies the parallelisms in one fixed order (:mod:`tpcompile.compose`).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .analysis.propagate import Rule, RuleSet
from .analysis.tokens import TokenRule
from .checkpoint.hf import load_hf_weights
from .checkpoint.pretrained import CheckpointLoader, check_checkpoint_dir, materialize_buffers
from .compose import Job, compose, tensor_parallel
from .config import check_degree, resolve_config
from .errors import TPError
from .integrations.hf_classes import model_class as default_model_class
from .plan import Plan, check_plan, plan_model
from .plan.context import check_context
from .plan.layout import (
    LAYOUT_KEYS,
    Layout,
    check_layout_request,
    layout_keywords,
    layout_record,
    layout_search,
)
from .rules import default_rules
from .runtime.adapters import refuse_cache_prefixes
from .runtime.backend import BACKENDS as _BACKENDS
from .runtime.backend import make_backend
from .runtime.materialize import Materializer
from .runtime.mesh import ParallelDims, data_parallel_rank, device_type
from .runtime.mesh import tp_mesh as tp_mesh_of

__all__ = ["data_parallel_rank", "from_pretrained", "parallelize", "plan_model", "transform"]

_log = logging.getLogger("tpcompile")


def transform(
    model: nn.Module,
    tp: int,
    *,
    mesh: DeviceMesh | None = None,
    backend: str = "auto",
    loss_parallel: bool = False,
    rules: Iterable[Rule | TokenRule] | None = None,
    overrides: dict[str, str] | None = None,
    strict: bool = True,
    load_state_dict_from_rank0: bool = False,
    example_inputs: dict[str, Any] | None = None,
    sequence_parallel: bool = False,
    ep: int = 1,
    plan: Plan | None = None,
    fp8: Any = None,
    fp8_filter: Callable[[nn.Module, str], bool] | None = None,
) -> nn.Module:
    """Rewrite ``model`` in place into a tensor-parallel model over ``tp`` ranks.

    The model is traced with ``torch.export`` (no weights copied), every module's role is
    read off the dataflow, parameters are sharded as DTensors and collectives are hooked
    around the modules. The result is a drop-in: same forward signature, outputs, loss,
    ``generate()`` and gradients.

    Args:
        model: a Hugging Face (or any token-in) model, on CPU, GPU or meta.
        tp: tensor-parallel degree; the world size must be a multiple of it.
        mesh: a 1-D TP ``DeviceMesh``; default: the ``tp`` dim of a (1, world/tp, tp) mesh over
            the default process group.
        backend: ``"auto"`` / ``"torch"`` (DTensor, everywhere) or ``"te"`` (Transformer
            Engine, GPU).
        loss_parallel: keep logits vocab-sharded and compute the LM loss with a
            vocab-parallel cross-entropy (no full-logit gather).
        rules: extra propagation rules (see ``tpcompile.rules``): feature rules, and token
            rules for ``sequence_parallel``.
        overrides: ``{fqn or "re:<regex>": "replicated"}`` to keep parameters replicated.
        strict: raise on ops no rule can place; ``False`` replicates them with a warning.
        load_state_dict_from_rank0: rank 0 holds the real weights, the other ranks may
            have built the model on the meta device; rank 0 sends each rank its shards.
        example_inputs: one batch of keyword arguments the forward accepts, to trace
            with; default: built from the model (``main_input_name`` and config sizes).
        sequence_parallel: between tensor-parallel regions (norms, residual adds) each
            rank keeps only its slice of the tokens (:mod:`tpcompile.plan.sequence`).
        ep: the expert-parallel degree to plan for (``plan.experts``); the experts are
            split over ep ranks by :func:`tpcompile.parallelize`, transform keeps every
            expert and splits each over tp.
        plan: apply this :class:`Plan` (``plan_model``'s, saved with ``to_json`` and
            perhaps edited) instead of planning; it is checked against the model first.
            The planning options (``rules``, ``overrides``, ``strict``,
            ``example_inputs``) must then be left unset; ``loss_parallel``,
            ``sequence_parallel`` and ``ep`` are read from the plan.
        fp8: FP8 matmuls through torchao's float8 training (``pip install -e ".[fp8]"``):
            ``True`` / ``"tensorwise"``, ``"rowwise"`` (tp=1 only) or a
            ``torchao.float8.Float8LinearConfig``; the amax of every split operand is
            reduced over the TP group, so the result equals single-process torchao FP8.
            Default choice: the linears the plan splits, dims multiples of 16 (not the LM
            head, not routers); ``fp8_filter(module, fqn)`` chooses instead.

    The result carries ``model.tpcompile_plan`` (the :class:`Plan`),
    ``model.tpcompile_table`` (the :class:`~tpcompile.plan.TranslationTable`
    between HF and per-rank layouts, used by every checkpoint function) and
    ``model.tpcompile_layout`` (the layout as JSON, ``source`` ``"transform"``; see
    :func:`parallelize`).

    Example:
        >>> dist.init_process_group("gloo")                       # doctest: +SKIP
        >>> model = tpcompile.transform(AutoModelForCausalLM.from_config(cfg), tp=2)
        >>> model.tpcompile_plan.params["lm_head.weight"].role.value
        'lm_head'
    """
    check_degree("tp", tp)  # before anything is traced or meshed
    check_degree("ep", ep)
    _refuse_transformed(model)
    refuse_cache_prefixes(model)
    if backend not in _BACKENDS:
        raise TPError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    tp_mesh = tp_mesh_of(model, tp, mesh)
    be = make_backend(backend, tp_mesh)
    given = plan is not None
    plan = _resolve_plan(model, tp, plan, loss_parallel=loss_parallel, rules=rules, overrides=overrides,
                         strict=strict, example_inputs=example_inputs, sequence_parallel=sequence_parallel,
                         ep=ep)
    def replan(adapted: nn.Module) -> Plan:  # modules added later are planned the same way
        return plan_model(adapted, tp, loss_parallel=loss_parallel, rules=rules, overrides=overrides, strict=strict,
                          example_inputs=example_inputs, sequence_parallel=sequence_parallel, ep=ep)

    out = tensor_parallel(Job(model=model, plan=plan, tp_mesh=tp_mesh, backend=be,
                              rank0_weights=load_state_dict_from_rank0, replan=None if given else replan,
                              fp8=fp8, fp8_filter=fp8_filter))
    # no FSDP: the ranks outside a TP group are the caller's data parallelism
    values = {**Layout().record_keywords(), "tp": tp, "ep": plan.ep, "sequence_parallel": bool(plan.sequence),
              "fp8": fp8}
    model.tpcompile_layout = layout_record(values, source="transform", world=_world())
    return out


def _resolve_plan(model: nn.Module, tp: int, plan: Plan | None, *, loss_parallel: bool, sequence_parallel: bool,
                  ep: int, **planning: Any) -> Plan:
    """The plan to apply: ``plan`` checked against the model, or a new one."""
    if plan is None:
        return plan_model(model, tp, loss_parallel=loss_parallel, sequence_parallel=sequence_parallel, ep=ep,
                          **planning)
    given = [k for k, v in planning.items() if v is not None and v is not True]  # strict defaults to True
    if given:
        raise TPError(f"plan= applies a finished plan: {', '.join(sorted(given))} only matter while planning; "
                      "pass them to plan_model instead")
    if loss_parallel and not plan.loss_parallel:
        raise TPError("loss_parallel=True but the plan was made with loss_parallel=False: re-plan with "
                      "plan_model(..., loss_parallel=True)")
    if sequence_parallel and not plan.sequence and tp > 1:
        raise TPError("sequence_parallel=True but the plan has no sequence plan: re-plan with "
                      "plan_model(..., sequence_parallel=True)")
    if ep != 1 and ep != plan.ep:
        raise TPError(f"ep={ep} but the plan was made for ep={plan.ep}: re-plan with plan_model(..., ep={ep})")
    check_plan(plan, model, tp)
    return plan


def parallelize(
    model: nn.Module,
    *,
    tp: int = 1,
    dp_shard: int = -1,
    dp_replicate: int = 1,
    ep: int = 1,
    cp: int = 1,
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
    plan: Plan | None = None,
    fp8: Any = None,
    fp8_filter: Callable[[nn.Module, str], bool] | None = None,
    pp: int = 1,
    pp_schedule: str | None = None,
    pp_microbatches: int | None = None,
    pp_virtual: int = 2,
    compile: Any = False,
    layout: str | Layout | Mapping[str, Any] | None = None,
    hardware: Any = None,
    seq: int | None = None,
    batch: int | None = None,
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
            :mod:`tpcompile.runtime.experts`.
        cp: context-parallel degree: each sequence split over ``cp`` ranks (two mirrored
            chunks each), keys and values all-gathered in attention
            (:mod:`tpcompile.runtime.context`); every rank of a CP group gets the same
            batch; FSDP2 shards over ``dp_shard x cp``. Checked at parallelize time: an op
            other than attention that mixes positions raises naming it.
        sequence_parallel: between tensor-parallel regions each rank keeps only its
            slice of the tokens (:mod:`tpcompile.plan.sequence`); needs ``tp > 1``.
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
        plan: apply this :class:`Plan` instead of planning (as in :func:`transform`);
            made by ``plan_model`` at the same ``tp`` and ``ep``.
        fp8, fp8_filter: FP8 matmuls through torchao, as in :func:`transform`. With
            ``fp8=True`` FSDP2 all-gathers the FP8 projections' weights in FP8, scaled by
            the whole weight's amax (computed at each forward; a ``Float8LinearConfig``
            keeps its own ``enable_fsdp_float8_all_gather``).
        pp: pipeline-parallel degree, the outermost mesh dim: the blocks are cut into
            stages balanced by FLOPs (embeddings join the first, final norm, head and loss
            the last); each rank keeps only its stages' modules, under their HF names.
            Train with :func:`tpcompile.pipeline_step` (:mod:`tpcompile.runtime.pipeline`).
        pp_schedule: ``gpipe``, ``1f1b``, ``interleaved_1f1b``, ``zero_bubble``, ``zbv`` or
            ``dualpipev``; ``None``: interleaved 1F1B where the blocks and microbatches
            allow, else 1F1B.
        pp_microbatches: microbatches per step (``None``: ``2 x pp``); the batch size
            must divide by it.
        pp_virtual: stages per rank of the interleaved and zero-bubble schedules.
        compile: ``torch.compile`` each block's forward (regional compilation;
            :mod:`tpcompile.runtime.compiled`): ``True`` (inductor), a backend's name
            (``"aot_eager"``), or a dict of ``backend`` / ``mode`` / ``dynamic`` /
            ``options``. TP's, SP's, EP's and FP8's hooks and collectives inside a block
            are traced into its graph (one graph per block class, no graph break);
            checkpointing and FSDP2 stay eager around it. Each block's first call also
            runs eagerly once; calls with a KV cache and no grad (``generate``) run
            eagerly, with grad the cache is dropped (warned). Breaks and graphs are
            counted in ``model.tpcompile_compiled``.
        layout: ``"auto"``: apply the fastest layout that fits this job (tp, pp and its
            schedule and microbatches, cp, ep, dp_shard, dp_replicate, sequence
            parallelism, activation checkpointing), as
            :func:`tpcompile.tools.plan_layout` ranks them for the world size, on
            ``hardware`` at ``batch`` x ``seq``; rank 0 searches, every rank applies its
            choice, logged at info level on the ``tpcompile`` logger (``import tpcompile``
            installs the search from :mod:`tpcompile.tools`). Leaves the degree keywords
            (and ``sharding_strategy``, ``plan``) unset. Or a stored layout to apply
            again: a ``Layout``, or a dict of its keywords
            (``model.tpcompile_layout["parallelize"]``, or the whole record).
        hardware: with ``layout="auto"``: a built-in profile (``h100-80gb``, ``h200``,
            ``a100-80gb``, ``b200``, ``cpu``), a profile JSON file or a
            ``HardwareProfile``; default: the CUDA device's profile (an unknown GPU
            raises), ``cpu`` without CUDA. Nodes hold ``LOCAL_WORLD_SIZE`` ranks when it
            is set, else the profile's ``gpus_per_node``.
        seq: with ``layout="auto"`` (required): tokens per sequence.
        batch: with ``layout="auto"``: sequences per optimizer step over the whole job
            (default: the world size).

    Returns the model, with ``model.tpcompile_mesh`` (the 3-D mesh),
    ``model.tpcompile_parallel`` (the resolved :class:`~tpcompile.config.ParallelConfig`)
    and ``model.tpcompile_layout``: the layout applied as JSON (``parallelize`` — every
    degree keyword as applied, pass it back as ``layout=`` — ``label``, ``source``,
    ``world``; with ``"auto"`` also ``hardware``, ``gpus``, ``gpus_per_node``, ``seq``,
    ``batch``, ``dtype`` and ``predicted`` step seconds and memory bytes per rank), which
    ``tpcompile.checkpoint.save`` stores too. With ``load_from``,
    ``model.tpcompile_load_stats`` holds this rank's ``{"bytes_read", "tensors"}``.
    ``model.tpcompile_table`` (the HF translation table every checkpoint function reads)
    exists at ``tp=1`` too.

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
        >>> model = tpcompile.parallelize(llama_70b, layout="auto", seq=8192)   # on 64 H100s
        >>> model.tpcompile_layout["label"], round(model.tpcompile_layout["predicted"]["step_seconds"], 1)
        ('tp2 pp8:1f1b/m64 cp4 sp', 10.0)
        >>> twin = tpcompile.parallelize(twin, layout=model.tpcompile_layout["parallelize"])  # the same again
    """
    given = dict(tp=tp, dp_shard=dp_shard, dp_replicate=dp_replicate, ep=ep, cp=cp, sequence_parallel=sequence_parallel,
                 sharding_strategy=sharding_strategy,
                 mixed_precision=mixed_precision, cpu_offload=cpu_offload,
                 activation_checkpointing=activation_checkpointing,
                 activation_offloading=activation_offloading, loading_horizon=loading_horizon, seed=seed,
                 fp8=fp8, pp=pp, pp_schedule=pp_schedule, pp_microbatches=pp_microbatches, pp_virtual=pp_virtual,
                 compile=compile)
    defaults = {k: p.default for k, p in inspect.signature(parallelize).parameters.items()}
    explicit = {k: v for k, v in given.items() if not _is_default(v, defaults[k])}
    check_layout_request(layout, explicit=explicit, options={"hardware": hardware, "seq": seq, "batch": batch},
                         plan_given=plan is not None)
    if layout is None:  # degrees, strategy and config are checked before the group is required
        resolve_config(config, **explicit)
    _refuse_transformed(model)
    refuse_cache_prefixes(model)
    if not dist.is_available() or not dist.is_initialized():
        raise TPError("tpcompile.parallelize needs an initialized process group: launch with torchrun "
                      "and call torch.distributed.init_process_group() first")
    search = None
    if isinstance(layout, str):  # "auto": the only string check_layout_request lets through
        search = _choose_layout(model, hardware=hardware, seq=seq, batch=batch)
    if layout is not None:  # every degree passed, defaults too: a config setting another one raises
        explicit.update(layout_keywords(search if search is not None else layout))
    cfg = resolve_config(config, world_size=dist.get_world_size(), **explicit)
    if load_from is not None:
        check_checkpoint_dir(load_from)  # collective: fail on every rank before any work
        # every rank reads its own rows: a rank-0 broadcast would only add a full copy
        cfg = replace(cfg, load_from_rank0=False)
    device = device_type(model)
    dims = ParallelDims(dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, tp=cfg.tp, ep=cfg.ep, cp=cfg.cp,
                        pp=cfg.pp)
    _check_pipeline_options(cfg)
    mesh, whole_mesh = dims.build_pipeline(device)
    # record what delayed init / rank-0 / checkpoint loading needs before any module is
    # rewritten
    pending: Materializer | CheckpointLoader | None = (
        Materializer.prepare(model, cfg) if load_from is None
        else CheckpointLoader.prepare(model, load_from))
    # the analysis also names the transformer blocks (the FSDP and checkpoint units)
    given = plan is not None
    plan = _resolve_plan(model, cfg.tp, plan, loss_parallel=False, sequence_parallel=cfg.sequence_parallel,
                         ep=cfg.ep) if plan is not None else plan_model(
        model, cfg.tp, ep=cfg.ep, sequence_parallel=cfg.sequence_parallel and cfg.tp > 1)
    _check_wrap_classes(model, list(plan.blocks), cfg.wrap_classes)
    stages = bounds = twin = None
    if cfg.pp > 1:  # before any module changes: the boundaries are read off the whole model
        from .analysis.boundaries import meta_copy
        from .plan.stages import plan_pipeline

        twin = meta_copy(model)
        stages, bounds = plan_pipeline(twin, list(plan.blocks), pp=cfg.pp, schedule=cfg.pp_schedule,
                                       virtual=cfg.pp_virtual, microbatches=cfg.pp_microbatches)
    if cfg.cp > 1:  # before any module changes: a model CP cannot split is refused as it is
        check_context(model, RuleSet().add(default_rules()))
    tp_mesh = mesh["tp"] if cfg.tp > 1 else None
    backend = make_backend("auto", tp_mesh) if tp_mesh is not None else None
    def replan(adapted: nn.Module) -> Plan:  # modules added later (adapters) are planned the same way
        return plan_model(adapted, cfg.tp, ep=cfg.ep, sequence_parallel=cfg.sequence_parallel and cfg.tp > 1)

    out = compose(Job(model=model, plan=plan, tp_mesh=tp_mesh, backend=backend, mesh=mesh, cfg=cfg,
                      device=device, pending=pending, fp8=cfg.fp8, fp8_filter=fp8_filter,
                      replan=None if given else replan, stages=stages, bounds=bounds, whole_mesh=whole_mesh,
                      twin=twin))
    values = {k: getattr(cfg, k) for k in LAYOUT_KEYS}
    if stages is not None:  # the schedule the stages were planned for (None given: the default one)
        values.update(pp_schedule=stages.schedule, pp_microbatches=stages.microbatches, pp_virtual=stages.virtual)
    source = "auto" if search is not None else "layout" if layout is not None else cfg.source
    model.tpcompile_layout = layout_record(values, source=source, world=dist.get_world_size(), search=search)
    return out


def _choose_layout(model: nn.Module, *, hardware: Any, seq: int | None, batch: int | None) -> dict[str, Any]:
    """``layout="auto"``: rank 0 runs the installed search and broadcasts its choice.

    Every rank must build the same layout or the first collective deadlocks; each rank
    searching for itself would agree only if their profiles, environments and library
    versions do, so one rank decides.  Its failure travels the same way: every rank
    raises, none waits in a collective for a rank that gave up."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None and not local.strip().isdigit():
        raise TPError(f"LOCAL_WORLD_SIZE={local!r} is not a rank count; layout='auto' reads it as the ranks "
                      "per node")
    job = {"gpus": dist.get_world_size(), "gpus_per_node": int(local) if local else None, "hardware": hardware,
           "batch": batch, "seq": seq, "device": device_type(model)}
    box: list[Any] = [None]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = ("chosen", layout_search()(model, **job))
        except Exception as exc:  # noqa: BLE001 - reported to every rank, then re-raised here
            failure = exc
            box[0] = ("failed", str(exc) if isinstance(exc, TPError) else f"{type(exc).__name__}: {exc}")
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if failure is not None:
        raise failure
    if kind == "failed":
        raise TPError(value)
    pred = value["predicted"]
    _log.info("parallelize(layout='auto'): %s on %d x %s at batch %d x seq %d: predicted step %.4g s, "
              "%.3g GiB per rank", value["label"], job["gpus"], value["hardware"], value["batch"], seq,
              pred["step_seconds"], pred["memory_bytes"] / 2**30)
    return value


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _refuse_transformed(model: nn.Module) -> None:
    """A transformed model's parameters are shards already: planning it again would shard
    the shards."""
    plan = getattr(model, "tpcompile_plan", None)
    if plan is not None or hasattr(model, "tpcompile_parallel"):
        at = f" at tp={plan.tp}" if plan is not None else ""
        raise TPError(f"this model is already transformed{at}; to change the layout, save it "
                      "(save_pretrained, or tpcompile.checkpoint.save) and load it at the new one "
                      "(tpcompile.from_pretrained / parallelize(load_from=...)), or pass the original model")


def _check_pipeline_options(cfg: Any) -> None:
    """What pipeline parallelism does not compose with yet, refused before any work."""
    if cfg.pp == 1:
        return
    unsupported = {"activation_offloading": cfg.activation_offloading,
                   "load_from_rank0 (fsdp_sync_module_states)": cfg.load_from_rank0}
    if cfg.pp_schedule is not None:
        from .plan.stages import schedule_spec

        schedule_spec(cfg.pp_schedule)  # an unknown name, before any work
    bad = [name for name, on in unsupported.items() if on]
    if bad:
        raise TPError(f"pp={cfg.pp} with {', '.join(bad)} is not supported yet: pipeline parallelism composes "
                      "with tp, sequence parallelism, cp, ep, FSDP2 / HSDP, activation checkpointing and FP8; drop " + " and ".join(bad))


def _is_default(value: Any, default: Any) -> bool:
    if value is None or default is None:
        return value is default
    return type(value) is type(default) and value == default


def _check_wrap_classes(model: nn.Module, blocks: list[str], wanted: tuple[str, ...]) -> None:
    """accelerate's ``fsdp_transformer_layer_cls_to_wrap`` must name the blocks found."""
    if not wanted:
        return
    found = sorted({type(model.get_submodule(b)).__name__ for b in blocks})
    if sorted(wanted) != found:
        raise TPError(f"fsdp_transformer_layer_cls_to_wrap={list(wanted)} but the blocks tpcompile found "
                      f"(its FSDP units) are of class {found}; set it to {','.join(found)} or drop it")


def from_pretrained(path: str | os.PathLike, tp: int, *, model_class: type | None = None,
                    transform_kwargs: dict[str, Any] | None = None, **hf_kwargs: Any) -> nn.Module:
    """Load an HF checkpoint directory straight into a tensor-parallel model.

    Every rank builds the model with parameters on the meta device, transforms it and
    reads only its own slices of each tensor: peak memory per rank is its shard plus
    one slice, never the model.

    Args:
        path: a local directory with ``config.json`` and safetensors weights.
        tp: tensor-parallel degree.
        model_class: default: ``config.architectures[0]`` from ``transformers``, else
            the richest head the model type has (seq2seq, causal / masked LM, bare).
        transform_kwargs: passed to :func:`tpcompile.transform` (``mesh``,
            ``loss_parallel``, ``overrides``, ...).
        hf_kwargs: passed to ``AutoConfig.from_pretrained`` / ``from_config``
            (``dtype``, ``attn_implementation``, ...).

    Example:
        >>> dist.init_process_group("gloo")                              # doctest: +SKIP
        >>> model = tpcompile.from_pretrained("Llama-3-8B/", tp=2, dtype=torch.bfloat16)
    """
    from transformers import AutoConfig, GenerationConfig

    check_degree("tp", tp)  # before any file is read

    dtype = hf_kwargs.pop("dtype", None) or hf_kwargs.pop("torch_dtype", None)
    config = AutoConfig.from_pretrained(path, **{k: v for k, v in hf_kwargs.items()
                                                 if k not in ("attn_implementation",)})
    cls = model_class or default_model_class(config)
    build_kwargs: dict[str, Any] = {}
    if "attn_implementation" in hf_kwargs:
        build_kwargs["attn_implementation"] = hf_kwargs["attn_implementation"]
    if dtype is not None and dtype != "auto":
        build_kwargs["dtype"] = dtype
    elif dtype == "auto" and getattr(config, "dtype", None) is not None:
        build_kwargs["dtype"] = config.dtype
    with torch.device("meta"):  # no weight memory, no init time
        model = cls._from_config(config, **build_kwargs) if hasattr(cls, "_from_config") \
            else cls.from_config(config, **build_kwargs)
    transform(model, tp, **(transform_kwargs or {}))
    model.tpcompile_load_stats = load_hf_weights(model, path)
    materialize_buffers(model)
    if os.path.exists(os.path.join(path, "generation_config.json")) and hasattr(model, "generation_config"):
        model.generation_config = GenerationConfig.from_pretrained(path)
    model.eval()  # as transformers' from_pretrained returns it
    return model
