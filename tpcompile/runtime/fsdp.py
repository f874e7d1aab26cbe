"""FSDP2 over the data-parallel dims: each block one unit, the root the rest.

Parameters end up as DTensors over ``(dp..., tp)``: FSDP2 shards each TP shard further
along dim 0 over ``dp_shard`` and replicates it over ``dp_replicate``.  Experts modules
(expert parallelism) are units of their own over the ``efsdp`` dim.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

from ..config import ParallelConfig
from .adapters import is_peft_model
from .apply import feature_methods, has_gradient_hooks
from .mesh import ParallelDims

__all__ = ["fully_shard_model", "shard_added_modules"]


def _shard_kwargs(cfg: ParallelConfig, mesh: DeviceMesh, device: str) -> dict[str, Any]:
    # a 2-D (replicate, shard) mesh is HSDP; NO_SHARD is HSDP with shard groups of 1
    dp_mesh = ParallelDims.data_mesh(mesh, cfg.dp_replicate > 1)
    kwargs: dict[str, Any] = {"mesh": dp_mesh, "reshard_after_forward": cfg.reshard_after_forward}
    if cfg.mixed_precision is not None:
        kwargs["mp_policy"] = cfg.mixed_precision
    if cfg.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device == "cuda")  # pinning needs CUDA
    return kwargs


def shard_added_modules(model: nn.Module, modules: list[nn.Module], cfg: ParallelConfig, mesh: DeviceMesh,
                        device: str) -> None:
    """FSDP2 units for modules added after ``parallelize`` (adapters, planned on the fly):
    each one owning parameters becomes a unit of its own inside its block's.  Only before
    the first forward: FSDP2 collects its units then."""
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    if state is not None and getattr(state, "_is_root", None) is not None:
        from ..errors import TPError

        raise TPError("modules were added to a parallelized model after its first forward; FSDP2 has fixed its "
                      "units by then: add adapters right after tpcompile.parallelize, before training")
    kwargs = _shard_kwargs(cfg, mesh, device)
    for module in modules:
        _refuse_gradient_hooks(module)
        fully_shard(module, **kwargs)


def _refuse_gradient_hooks(module: nn.Module) -> None:
    """FSDP2 replaces every parameter with its shard: hooks registered on the parameter
    (``register_hook``: PEFT OSF's gradient projection) would silently not run."""
    hooked = [n for n, p in module.named_parameters() if has_gradient_hooks(p)]
    if hooked:
        from ..errors import TPError

        raise TPError(f"{', '.join(hooked[:3])} {'has' if len(hooked) == 1 else 'have'} gradient hooks "
                      "(register_hook): FSDP2 replaces every parameter with its shard, and the hooks would not "
                      "run. Register them on the parallelized model's parameters (they see gradient shards), "
                      "or pass dp_shard=1")


def fully_shard_model(model: nn.Module, blocks: list[str], cfg: ParallelConfig, mesh: DeviceMesh,
                      device: str, experts: list[nn.Module] = (), expert_mesh: DeviceMesh | None = None,
                      roots: list[nn.Module] | None = None) -> None:
    """Wrap ``blocks`` (then the root) with ``fully_shard`` on ``mesh``'s data-parallel dims.

    ``roots``: a pipelined model's stage modules (runtime/pipeline.py) instead of the
    model: each is the root of its blocks' units and holds its modules outside them
    (embeddings; final norm and head), as the unsplit model's root does — a root keeps
    its parameters gathered from forward to backward, which the head's local-vocabulary
    loss needs (it reads the head's shard past the module's output); ``PipelineStage``
    then reduce-scatters once per step.  Under a pipeline every unit keeps its parameters
    gathered from a microbatch's forward to the step's last backward (torchtitan's choice
    for pp): one all-gather per step instead of one per microbatch, and the split-backward
    schedules (zero bubble, ZBV, DualPipeV) need it — their weight-gradient pass looks the
    stage's parameters up after the input-gradient pass, and a unit resharded in between
    hands it the sharded tensors the graph never used (measured: those gradients lost)."""
    _refuse_gradient_hooks(model)
    kwargs = _shard_kwargs(cfg, mesh, device)
    if roots is not None:
        kwargs["reshard_after_forward"] = False
    if experts:
        # each experts module is its own unit, sharded over efsdp only (ep already split
        # it), inside its block's unit (torchtitan's nesting). Its gradient sums every
        # token of the EP group; divided by the whole dp degree it matches the mean the
        # dense parameters get
        emesh = expert_mesh["dp_replicate", "efsdp"] if cfg.dp_replicate > 1 else expert_mesh["efsdp"]
        for module in experts:
            fully_shard(module, **{**kwargs, "mesh": emesh})
            module.set_gradient_divide_factor(float(cfg.dp_replicate * cfg.dp_shard))
            if cfg.dp_shard // cfg.ep > 1:
                # sum, then divide once (gloo has no PREMUL_SUM; a power of two divides
                # exactly). Not with one efsdp rank: FSDP2 then divides by the factor
                # while copying and would divide again after
                module.set_force_sum_reduction_for_comms(True)
    shared = _held_by_several(model, blocks)
    for fqn in blocks:
        block = model.get_submodule(fqn)
        ignored = {p for p in block.parameters() if id(p) in shared}
        fully_shard(block, **kwargs, **({"ignored_params": ignored} if ignored else {}))
    for root in roots if roots is not None else [model]:
        fully_shard(root, **kwargs)
        _generate_through_root(root)
    unsharded = [name for name, p in model.named_parameters() if id(p) in shared and not _dp_sharded(p)]
    if unsharded:
        from ..errors import TPError

        raise TPError(f"{', '.join(unsharded[:3])} is held by several blocks and by no module outside them: "
                      "FSDP2 shards a parameter in one unit, so none can own it. Pass dp_shard=1 "
                      "(tensor parallelism alone), or register it on a module outside the blocks too")


def _held_by_several(model: nn.Module, blocks: list[str]) -> set[int]:
    """The parameters held in more than one block, or in a block and outside every block
    (VBLoRA's vector bank: one ParameterDict every adapted layer holds, and its tuner
    too).  A block's unit would shard it, and the next unit holding it refuse the shard:
    the root's unit holds them instead (gathered for the whole forward)."""
    places: dict[int, set[str | None]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        block = next((b for b in blocks if name.startswith(b + ".")), None)
        places.setdefault(id(p), set()).add(block)
    return {pid for pid, where in places.items() if len(where) > 1}


def _dp_sharded(p: nn.Parameter) -> bool:
    """Does an FSDP2 unit manage ``p`` (a DTensor over a data-parallel mesh dim)?"""
    names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
    return any(n.startswith("dp") or n == "efsdp" for n in names)


def _generate_through_root(root: nn.Module) -> None:
    """A ``PeftModel``'s ``generate`` calls the model it wraps directly, past its own
    ``forward`` and so past FSDP2's root hooks: the blocks gather their own parameters,
    but the root's (embeddings, final norm, head) would stay sharded DTensors.  So does
    transformers' ``generate`` of a multimodal model, which encodes the images before the
    first forward by calling the base model's ``get_image_features`` (the patch
    embedding and the projector are the root's).  Their ``generate`` gathers the root's
    parameters first (the root initialised as at a first forward, so a ``generate``
    before any forward leaves the blocks units of this root) and frees them after."""
    if not hasattr(root, "generate") or not (
            is_peft_model(root) or any(feature_methods(m) for m in root.modules())):
        return
    generate = root.generate

    def gathered_generate(*args: Any, **kwargs: Any) -> Any:
        root._get_fsdp_state()._lazy_init()  # FSDP2's root-finding, which a forward would run
        root.unshard()
        try:
            return generate(*args, **kwargs)
        finally:
            root.reshard()

    root.generate = gathered_generate
