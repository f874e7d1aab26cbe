"""transformers' own ``model.save_pretrained`` on a transformed / parallelized model.

transformers' implementation reads ``model.state_dict()`` and writes it from the main
process: on a tensor-parallel model that would gather every tensor onto one rank (and
crashes today on DTensor storages).  :func:`bind_save_pretrained` replaces the method *on
the instance* by one that routes to tpcompile's gather-free writer
(:func:`tpcompile.save_pretrained`): every rank writes the HF rows it owns.  So, as with
``tpcompile.save_pretrained``, **every rank must call it** (the HF ``Trainer`` does, for
a model tpcompile marks as self-distributing).

Arguments, against transformers' signature:

* ``max_shard_size`` — honoured (default ``"50GB"``, transformers' default);
* ``is_main_process`` — accepted; it only says which rank writes the config, and
  tpcompile decides writers itself (rank 0 writes headers and configs);
* ``safe_serialization`` — ``True`` only (safetensors is the only format written);
* ``state_dict`` — ``None`` only: the model's own weights are written, gather-free.
  To save other tensors, load them first (``model.load_state_dict(sd)``);
* ``token``, ``save_peft_format``, ``save_original_format`` — accepted, no effect (no
  hub, not a PEFT model; tensors are written under the names transformers 5 uses in
  memory, which every transformers 5 ``from_pretrained`` loads);
* ``push_to_hub``, ``variant``, ``distributed_checkpoint`` and any other keyword raise a
  :class:`~tpcompile.errors.TPError` naming the alternative.

Like transformers, the weights go *into* ``save_directory``: files already there (a
tokenizer, training arguments) stay, old weight files are replaced.  The weights are
first written to a hidden sibling directory and moved in once every rank has finished.

Example (every rank)::

    model = tpcompile.transform(model, tp=2)
    model.save_pretrained("out/final")            # AutoModel*.from_pretrained loads it

A PEFT model (a ``PeftModel`` with its adapters, transformed as a whole) saves in PEFT's
own format instead: its trainable tensors (the adapters, ``modules_to_save`` copies) are
gathered one at a time to rank 0 in their HF shapes, and PEFT's own ``save_pretrained``
writes ``adapter_config.json`` + ``adapter_model.safetensors`` from them; the frozen base
is never gathered.  Plain ``PeftModel.from_pretrained(base, dir)`` loads it.
"""

from __future__ import annotations

import os
import re
import shutil
import types
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from ..errors import TPError
from ..runtime.adapters import is_peft_model, when_imported
from ..runtime.shards import lookup, world

__all__ = ["bind_refused_methods", "bind_save_pretrained", "route_peft_saves"]

_NO_EFFECT = ("token", "save_peft_format", "save_original_format")
# weight files a previous save may have left; replaced like transformers replaces them
_WEIGHT_FILE = re.compile(r"^(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?$")


def bind_save_pretrained(model: nn.Module) -> None:
    """Make ``model.save_pretrained(...)`` write through tpcompile (instance attribute)."""
    if is_peft_model(model):  # its save_pretrained writes adapters picked from a state dict
        model.save_pretrained = types.MethodType(_save_adapters, model)
    elif hasattr(type(model), "save_pretrained"):
        model.save_pretrained = types.MethodType(_save_pretrained, model)


# transformers' methods that change a shape the plan split (the vocabulary's rows); they
# crashed deep in DTensor dispatch
_RESHAPING = {
    "resize_token_embeddings": "resizes the vocabulary, whose rows the plan split",
}


def bind_refused_methods(model: nn.Module) -> None:
    """``model.resize_token_embeddings(...)`` on a split model raises a
    :class:`~tpcompile.errors.TPError` saying what to do instead."""
    for name, why in _RESHAPING.items():
        if callable(getattr(type(model), name, None)):
            setattr(model, name, types.MethodType(_refused(name, why), model))


def _refused(name: str, why: str) -> Any:
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise TPError(f"{name}() on a transformed model {why}: call it on the model before tpcompile.transform "
                      "/ parallelize (or save_pretrained, change the plain model, and transform it again)")

    return method


def route_peft_saves() -> None:
    """``PeftModel.save_pretrained`` of a PeftModel wrapped around a transformed model
    (``get_peft_model`` after ``transform``) writes through :func:`_save_adapters` too.
    PEFT's own would hand DTensor shards to safetensors.  Done when PEFT is imported;
    idempotent."""
    when_imported("peft.peft_model", _patch_peft_save)


def _patch_peft_save(peft_model: Any) -> None:
    cls = getattr(peft_model, "PeftModel", None)
    if cls is None or hasattr(cls.save_pretrained, "_tpcompile_original"):
        return
    original = cls.save_pretrained

    def save_pretrained(self: nn.Module, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        if not args and getattr(self.get_base_model(), "tpcompile_table", None) is not None:
            return _save_adapters(self, save_directory, **kwargs)
        return original(self, save_directory, *args, **kwargs)

    save_pretrained._tpcompile_original = original
    cls.save_pretrained = save_pretrained


def _save_adapters(self: nn.Module, save_directory: str | os.PathLike, **kwargs: Any) -> None:
    """PEFT's ``save_pretrained`` from the trainable tensors, gathered to rank 0 in HF shapes."""
    from .hf import iter_hf_tensors, table_of, transformed_part

    if kwargs.pop("state_dict", None) is not None:
        raise TPError("save_pretrained(state_dict=...) is not supported on a tpcompile PEFT model: the "
                      "adapters are gathered from the model itself")
    kwargs.pop("is_main_process", None)  # tpcompile decides: rank 0 writes
    part, prefix = transformed_part(self)
    keys = [k for k in table_of(part).saved_keys() if getattr(lookup(part, k)[2], "requires_grad", False)]
    full = {prefix + k: v for k, v in iter_hf_tensors(part, keys, rank0_only=True, copy=True) if v is not None}
    if world()[0] == 0:
        save = type(self).save_pretrained
        save = getattr(save, "_tpcompile_original", save)
        save(self, os.fspath(save_directory), state_dict=full, is_main_process=True, **kwargs)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank returns once the directory is complete


def _check_arguments(state_dict: Any, push_to_hub: bool, max_shard_size: Any, variant: Any,
                     distributed_checkpoint: bool, kwargs: dict[str, Any]) -> None:
    if push_to_hub:
        raise TPError("model.save_pretrained(push_to_hub=True) is not supported on a tpcompile model: save to "
                      "a directory (every rank calls save_pretrained), then upload it from one process with "
                      "huggingface_hub.upload_folder")
    if state_dict is not None:
        raise TPError("model.save_pretrained(state_dict=...) is not supported on a tpcompile model: the "
                      "model's own weights are written without gathering; load other tensors into the model "
                      "first (model.load_state_dict(sd)) and pass state_dict=None")
    if variant is not None:
        raise TPError(f"model.save_pretrained(variant={variant!r}) is not supported on a tpcompile model; "
                      "save without a variant")
    if distributed_checkpoint:
        raise TPError("model.save_pretrained(distributed_checkpoint=True) is not supported on a tpcompile "
                      "model: use tpcompile.checkpoint.save(dir, model, kind='sharded') or torch DCP with "
                      "get_model_state_dict(model)")
    if kwargs.pop("safe_serialization", True) is not True:
        raise TPError("model.save_pretrained(safe_serialization=False) is not supported on a tpcompile model: "
                      "only safetensors files are written")
    for name in _NO_EFFECT:
        kwargs.pop(name, None)
    if kwargs:
        raise TPError(f"model.save_pretrained() got arguments a tpcompile model does not support: "
                      f"{sorted(kwargs)}; supported: max_shard_size, is_main_process, safe_serialization=True, "
                      f"{', '.join(_NO_EFFECT)} (no effect)")
    if not isinstance(max_shard_size, int | str):
        raise TPError(f"max_shard_size must be an int (bytes) or a size like '5GB', got {max_shard_size!r}")


def _save_pretrained(self: nn.Module, save_directory: str | os.PathLike, is_main_process: bool = True,
                     state_dict: dict | None = None, push_to_hub: bool = False,
                     max_shard_size: int | str = "50GB", variant: str | None = None,
                     distributed_checkpoint: bool = False, **kwargs: Any) -> None:
    """transformers' ``save_pretrained``, written by every rank without gathering."""
    from .hf import save_pretrained

    _check_arguments(state_dict, push_to_hub, max_shard_size, variant, distributed_checkpoint, kwargs)
    out = Path(save_directory)
    if out.exists() and not out.is_dir():
        raise TPError(f"save_pretrained: {out} exists and is not a directory")
    staging = out.parent / f".{out.name}.tpcompile-save"
    save_pretrained(self, staging, max_shard_size=max_shard_size, overwrite=True)
    if world()[0] == 0:
        _move_into(staging, out)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # every rank returns once the directory is complete


def _move_into(staging: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    new = {p.name for p in staging.iterdir()}
    for old in out.iterdir():
        if old.is_file() and _WEIGHT_FILE.match(old.name) and old.name not in new:
            old.unlink()  # a stale shard of a previous save would confuse the loader
    for name in sorted(new):
        os.replace(staging / name, out / name)
    shutil.rmtree(staging, ignore_errors=True)
