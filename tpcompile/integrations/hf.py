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
* :class:`TPTrainerCallback` (pass it in ``Trainer(callbacks=[...])``) gives accelerate
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
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[tpcompile.integrations.TPTrainerCallback()])
    trainer.train()                      # or train(resume_from_checkpoint=True)
    trainer.save_model("out/final")      # an HF directory plain transformers loads
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import TPError
from ..runtime.markers import mark_model, mesh_degrees

try:  # transformers is a dependency; the callback base class comes from it
    from transformers import TrainerCallback
except ImportError:  # pragma: no cover
    TrainerCallback = object  # type: ignore[assignment,misc]

__all__ = ["STATE_DIR", "TPTrainerCallback", "TrainerSupport", "data_mesh", "mark_model", "prepare",
           "support_trainers"]

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


# ---------------------------------------------------------------- Trainer


def _unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer


class TrainerSupport(TrainerCallback):
    """What makes ``transformers.Trainer`` (and TRL's trainers, built on it) train,
    checkpoint and resume a tpcompile model with no extra lines: it is added to every
    Trainer's default callbacks once a model is transformed (:func:`support_trainers`), and
    does nothing for other models.

    * ``on_init_end``: accelerate learns the model's parallelism the way it knows its own
      TP: the model's mesh (data sharded over the data-parallel ranks only, every rank of
      a TP group sees the same batch) and a ``ParallelismConfig`` of the same degrees,
      which the Trainer and TRL read to count each TP group's batch once (logged token
      counts, throughput).  accelerate's own ``ParallelismConfig`` route would build a
      second mesh and refuses CPU processes, so the config is attached, not built.
    * ``on_save`` (every rank): beside the model the Trainer saved, writes the optimizer
      and scheduler state into ``checkpoint-<step>/tpcompile-state`` (a ``sharded``
      tpcompile checkpoint: reloads at any tp / dp) and each rank's RNG state in the
      Trainer's own ``rng_state_<rank>.pth`` format.
    * ``on_train_begin`` after ``resume_from_checkpoint``: restores the optimizer and
      scheduler (the Trainer restores the weights, its state and the RNG itself).
    * ``on_step_end``: the Trainer's ``num_input_tokens_seen`` counts each TP group's
      batch once.

    transformers refuses optimizer checkpoints for models that shard themselves (its
    ``optimizer.pt`` is one process's ``torch.save``), so pass ``save_only_model=True``:
    the Trainer then writes the model and its state, and this callback the rest.
    """

    def __init__(self) -> None:
        self._tokens_seen = 0  # the Trainer's count after the last step, corrected

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                    **kwargs: Any) -> None:
        model = _transformed(model)
        if model is not None:
            _set_accelerate_mesh(model)
        else:  # a plain model after a tpcompile one in this process: accelerate's own view
            _forget_degrees()

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        self._tokens_seen = state.num_input_tokens_seen
        model = _transformed(model)
        if model is None or state.global_step == 0:
            return  # not ours, or a fresh run (a resumed one starts at the checkpoint's step)
        from ..checkpoint import training

        folder = _resume_folder(args, state.global_step)
        extra = training.load(folder / STATE_DIR, model, _unwrap_optimizer(optimizer))
        if extra.get("global_step") != state.global_step:
            raise TPError(f"{folder / STATE_DIR} holds step {extra.get('global_step')}, the Trainer resumed at "
                          f"step {state.global_step}")
        if lr_scheduler is not None and "scheduler" in extra:
            lr_scheduler.load_state_dict(extra["scheduler"])

    def on_step_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                    **kwargs: Any) -> None:
        model = _transformed(model)
        if model is not None and state.num_input_tokens_seen != self._tokens_seen:
            # gathered over every process: each TP group's batch was counted tp times
            seen = state.num_input_tokens_seen - self._tokens_seen
            state.num_input_tokens_seen = self._tokens_seen + seen // mesh_degrees(model)[2]
        self._tokens_seen = state.num_input_tokens_seen

    def on_save(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                optimizer: Any = None, lr_scheduler: Any = None, **kwargs: Any) -> None:
        model = _transformed(model)
        if model is None:
            return
        from ..checkpoint import training

        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        extra = {"global_step": state.global_step}
        if lr_scheduler is not None:
            extra["scheduler"] = _jsonable(lr_scheduler.state_dict(), type(lr_scheduler).__name__)
        training.save(folder / STATE_DIR, model, _unwrap_optimizer(optimizer), kind="sharded", extra=extra)
        _save_rng(folder, args)


def _forget_degrees() -> None:
    """Drop the degrees a tpcompile model left in accelerate's (process-wide) state."""
    try:
        from accelerate.state import AcceleratorState
    except ImportError:  # pragma: no cover
        return
    state = AcceleratorState()
    if _is_ours(state):
        state.parallelism_config = None


class TPTrainerCallback(TrainerCallback):
    """Kept so existing ``Trainer(callbacks=[TPTrainerCallback()])`` lines still run: the
    Trainer now supports tpcompile models by itself (:class:`TrainerSupport`), so this
    callback does nothing."""


def support_trainers() -> None:
    """Add :class:`TrainerSupport` to the callbacks every ``transformers.Trainer`` starts
    with (its ``DEFAULT_CALLBACKS``).  Idempotent; called by ``transform`` / ``parallelize``."""
    try:
        from transformers import trainer
    except ImportError:  # pragma: no cover - transformers is a dependency
        return
    if not any(cb is TrainerSupport or isinstance(cb, TrainerSupport) for cb in trainer.DEFAULT_CALLBACKS):
        trainer.DEFAULT_CALLBACKS.append(TrainerSupport)


def _transformed(model: nn.Module | None) -> nn.Module | None:
    """The tpcompile model the Trainer trains (itself, or the base a PEFT model wraps)."""
    from ..checkpoint.hf import transformed_part

    for _ in range(4):  # through a wrapper's ``.module``
        if model is None:
            return None
        part = transformed_part(model)[0]
        if "tpcompile_mesh" in part.__dict__:
            return part
        model = getattr(model, "module", None)
    return None


def _resume_folder(args: Any, step: int) -> Path:
    """The checkpoint the Trainer resumed from: ``args.resume_from_checkpoint`` if it
    names a directory, else ``<output_dir>/checkpoint-<step>`` (where the Trainer and
    ``resume_from_checkpoint=True`` put and find it)."""
    given = getattr(args, "resume_from_checkpoint", None)
    candidates = [Path(given)] if isinstance(given, str) and given else []
    candidates.append(Path(args.output_dir) / f"checkpoint-{step}")
    for folder in candidates:
        if (folder / STATE_DIR).is_dir():
            return folder
    raise TPError(
        f"the Trainer resumed at step {step} but {candidates[-1] / STATE_DIR} does not exist: the checkpoint was "
        "saved without TPTrainerCallback, or lives outside output_dir (then set "
        "TrainingArguments(resume_from_checkpoint=<that directory>) too)")


def _jsonable(value: dict[str, Any], what: str) -> dict[str, Any]:
    try:
        return json.loads(json.dumps(value))
    except TypeError as err:
        raise TPError(f"the {what} learning-rate scheduler's state_dict is not JSON-serializable ({err}); "
                      "TPTrainerCallback stores it with the checkpoint's metadata") from err


def _save_rng(folder: Path, args: Any) -> None:
    """Each rank's RNG state, as the Trainer's own ``_save_rng_state`` writes it (the
    Trainer loads these files itself when it resumes)."""
    import numpy as np

    states: dict[str, Any] = {"python": random.getstate(), "numpy": np.random.get_state(),
                              "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.random.get_rng_state_all()
    name = "rng_state.pth" if args.world_size <= 1 else f"rng_state_{args.process_index}.pth"
    os.makedirs(folder, exist_ok=True)
    torch.save(states, folder / name)
