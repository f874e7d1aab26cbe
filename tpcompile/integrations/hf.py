"""Hugging Face ``Trainer`` and ``accelerate`` with a transformed / parallelized model.

A tpcompile model already does its own distribution: TP collectives inside the forward,
FSDP2 gradient reduce-scatters after ``parallelize``.  What the HF tools must not do is
distribute it *again* (accelerate wraps a multi-process model in DDP over every rank,
which crashes on DTensor parameters) or feed the ranks of one TP group different
batches (accelerate shards data over every process).  Three pieces make them fit:

* :func:`~tpcompile.runtime.markers.mark_model` runs at the end of ``transform`` / ``parallelize`` and sets what
  transformers 5 already honours for a model it sharded itself (``DistributedConfig``
  loading): ``_is_distributed_loading_by_transformers`` (the ``Trainer`` prepares the
  model without a DDP wrapper, builds the optimizer on the sharded parameters, lets every
  rank into ``save_pretrained`` and defers FSDP2's gradient sync during gradient
  accumulation) and ``config.distributed_config`` (the tp / FSDP / replica degrees; never
  serialized into ``config.json``).  It also installs a guard that raises a
  :class:`~tpcompile.errors.TPError` if the ranks of a TP group receive different batches
  in their first training forwards (tensor parallelism needs identical inputs; without
  the guard a mis-sharded loader trains a silently wrong model).
  ``model.tp_size`` is deliberately left unset: the ``Trainer`` would turn it into an
  accelerate ``ParallelismConfig``, which accelerate refuses on CPU (``MULTI_CPU``) and
  which would build a second device mesh.
* :class:`~tpcompile.integrations.trainer.TrainerSupport` joins every Trainer's default
  callbacks once a model is transformed (:func:`support_trainers`): it gives accelerate
  the model's mesh so the training data is sharded over the data-parallel ranks only,
  and completes every checkpoint: the Trainer writes the model (``save_pretrained``) and
  its state; the callback adds the optimizer and learning-rate scheduler (a ``sharded``
  :mod:`tpcompile.checkpoint`, so it reloads at any layout) and each rank's RNG state,
  and restores them on ``trainer.train(resume_from_checkpoint=...)``.
* :func:`prepare` is ``accelerator.prepare`` for a custom loop under ``accelerate
  launch``: the data loaders are sharded over data-parallel ranks, the model is
  registered but not wrapped.

Example (``torchrun --nproc-per-node 2 script.py``)::

    model = tpcompile.transform(AutoModelForCausalLM.from_config(cfg), tp=2)
    args = TrainingArguments("out", save_only_model=True, save_steps=100, ...)
    trainer = Trainer(model=model, args=args, train_dataset=ds)   # no callback to add
    trainer.train()                      # or train(resume_from_checkpoint=True)
    trainer.save_model("out/final")      # an HF directory plain transformers loads
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import TPError
from ..runtime.markers import mark_model, mesh_degrees

__all__ = ["STATE_DIR", "data_mesh", "mark_model", "prepare", "support_trainers"]

STATE_DIR = "tpcompile-state"  # inside each Trainer checkpoint: optimizer + scheduler


# ---------------------------------------------------------------- accelerate


def data_mesh(model: nn.Module) -> DeviceMesh:
    """The mesh accelerate should shard data by: its ``"tp"`` dim gets the same batch,
    ``"dp_replicate"`` x ``"dp_shard"`` distinct ones (accelerate reads these names).

    A ``transform``-ed model has no data-parallel mechanism of its own, so it needs one
    TP group spanning the world; data parallelism comes from ``parallelize``.
    """
    if not hasattr(model, "tpcompile_mesh"):
        raise TPError("this model was not transformed: call tpcompile.transform(model, tp=...) or "
                      "tpcompile.parallelize(model, ...) before handing it to the Trainer / accelerate")
    mesh: DeviceMesh = model.tpcompile_mesh
    if getattr(model, "tpcompile_context", None) is not None:
        raise TPError("a context-parallel model (cp > 1) under the HF Trainer / accelerate is not supported yet: "
                      "their loaders would hand the ranks of a CP group different batches. Use your own loop "
                      "and load the slice tpcompile.data_parallel_rank(model) names")
    if mesh.ndim == 1 and dist.get_world_size() != mesh.size():
        raise TPError(
            f"a transform()-ed model at tp={mesh.size()} in a world of {dist.get_world_size()}: nothing would "
            "average its gradients over the other data-parallel ranks. Use tpcompile.parallelize(model, "
            f"tp={mesh.size()}) (FSDP2 over the data-parallel ranks) or launch {mesh.size()} processes")
    return mesh


def _set_accelerate_mesh(model: nn.Module) -> None:
    from accelerate.state import AcceleratorState

    state = AcceleratorState()
    mesh = data_mesh(model)
    existing = getattr(state, "device_mesh", None)
    if existing is not None and not getattr(existing, "_tpcompile_data_mesh", False):
        raise TPError("accelerate already has a device mesh (a ParallelismConfig); a tpcompile model brings "
                      "its own parallelism: drop parallelism_config / the accelerate parallelism settings")
    mesh._tpcompile_data_mesh = True  # ours: a later Trainer / model in this process may replace it
    state.device_mesh = mesh  # prepare_data_loader: process index // tp, dp processes
    rep, shard, tp = mesh_degrees(model)
    if tp > 1 and (getattr(state, "parallelism_config", None) is None or _is_ours(state)):
        state.parallelism_config = _degrees_config(rep, shard, tp, mesh)


def _is_ours(state: Any) -> bool:
    return getattr(getattr(state, "parallelism_config", None), "_tpcompile", False)


def _degrees_config(rep: int, shard: int, tp: int, mesh: DeviceMesh) -> Any:
    """A ``ParallelismConfig`` that reports the model's degrees to the Trainer and TRL (they
    read ``tp_size`` to count a TP group's batch once) but is falsy, so accelerate itself
    (``if accelerator.parallelism_config:``) neither validates it against a CPU run nor
    prepares the model as one of its own TP models."""
    from accelerate import ParallelismConfig

    class AttachedParallelism(ParallelismConfig):
        _tpcompile = True

        def __bool__(self) -> bool:
            return False

    config = AttachedParallelism(dp_replicate_size=rep, dp_shard_size=shard, tp_size=tp)
    config.device_mesh = mesh  # the model's: accelerate builds none of its own
    return config


def prepare(accelerator: Any, model: nn.Module, *objects: Any) -> tuple[Any, ...]:
    """``accelerator.prepare`` for a tpcompile model in a custom loop.

    accelerate's own ``prepare(model, ...)`` wraps any multi-process model in DDP (which
    fails on DTensor parameters and would average over TP ranks too).  Here the model is
    registered with ``accelerator`` unwrapped (``evaluation_mode=True`` is accelerate's
    "do not wrap" switch), and data loaders are sharded over data-parallel ranks only.
    Optimizers, schedulers and loaders go through ``accelerator.prepare`` unchanged, so
    ``accelerator.backward`` / ``clip_grad_norm_`` / ``accumulate`` work as usual.

    Example (``accelerate launch --config_file cfg.yaml script.py``):
        >>> accelerator = Accelerator()                                   # doctest: +SKIP
        >>> model = tpcompile.transform(model, tp=2)
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        >>> model, opt, dl = tpcompile.integrations.prepare(accelerator, model, opt, dl)
    """
    _set_accelerate_mesh(model)
    model = accelerator.prepare_model(model, device_placement=False, evaluation_mode=True)
    if not objects:
        return (model,)
    rest = accelerator.prepare(*objects)
    return (model, *(rest if isinstance(rest, tuple) else (rest,)))


def support_trainers() -> None:
    """Add :class:`TrainerSupport` to the callbacks every ``transformers.Trainer`` starts
    with (its ``DEFAULT_CALLBACKS``) — now if the Trainer is imported, else right after it
    is: importing the Trainer stack (accelerate and the rest) costs ~85 MB resident per
    rank, which a job that never trains with it should not pay.  Idempotent; called by
    ``transform`` / ``parallelize``."""
    from ..runtime.adapters import when_imported

    when_imported("transformers.trainer", _add_trainer_callback)


def _add_trainer_callback(trainer: Any) -> None:
    from .trainer import TrainerSupport

    if not any(cb is TrainerSupport or isinstance(cb, TrainerSupport) for cb in trainer.DEFAULT_CALLBACKS):
        trainer.DEFAULT_CALLBACKS.append(TrainerSupport)
