"""The Hugging Face ``Trainer`` (and TRL's trainers, built on it) with a tpcompile model:
:class:`TrainerSupport`, added to every Trainer's default callbacks once a model is
transformed (:func:`tpcompile.integrations.hf.support_trainers`).

Apart from :mod:`tpcompile.integrations.hf` because importing ``TrainerCallback`` loads
transformers' whole training stack (and, with peft installed, peft and torchao): about
half a second, and torchao's warnings about kernels it cannot load, on every
``import tpcompile`` that never builds a Trainer.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from ..errors import TPError
from ..runtime.markers import mesh_degrees
from .hf import STATE_DIR, _is_ours, _set_accelerate_mesh

__all__ = ["TPTrainerCallback", "TrainerSupport"]


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
