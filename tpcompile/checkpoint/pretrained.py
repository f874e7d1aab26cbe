"""Getting real weights into a transformed model without any rank holding the model.

* :func:`from_pretrained` — the front door: config → model on the meta device →
  ``transform`` → each rank reads its own rows → buffers no checkpoint stores (rotary
  tables) computed by the model's own init;
* :func:`scatter_from_rank0` — SageMaker's ``load_state_dict_from_rank0`` mode: rank 0
  built the model with real weights, the other ranks on meta; rank 0 sends every rank
  its shards, tensor by tensor.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..errors import TPError
from ..translate import TranslationTable
from .shards import assign_tp_local, lookup, tp_context, world

__all__ = ["from_pretrained", "materialize_buffers", "scatter_from_rank0"]


def materialize_buffers(model: nn.Module, device: str | torch.device = "cpu") -> list[str]:
    """Give buffers left on the meta device real values, computed by the model's own init.

    No checkpoint stores non-persistent buffers (rotary tables, position ids), so a
    model built on the meta device must recompute them.  Hugging Face models do that in
    ``_init_weights``: it runs only on the modules that own such buffers, with every
    parameter marked initialized so loaded weights are never touched.
    """
    owners: dict[str, nn.Module] = {}
    for name, buf in list(model.named_buffers()):
        if buf is not None and buf.device.type == "meta":
            mod_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(mod_name) if mod_name else model
            owner._buffers[attr] = torch.empty_like(buf, device=device)
            owners[mod_name] = owner
    if not owners:
        return []
    init = getattr(model, "_init_weights", None)
    if init is None:
        raise TPError(f"buffers {sorted(owners)} are on the meta device and {type(model).__name__} has "
                      "no _init_weights to compute them; build the model with real buffers")
    for p in model.parameters():
        p._is_hf_initialized = True  # transformers' init helpers skip flagged tensors
    with torch.no_grad():
        for owner in owners.values():
            init(owner)
    return sorted(owners)


def _model_class(config: Any) -> type:
    import transformers

    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    return transformers.AutoModelForCausalLM


def from_pretrained(path: str | os.PathLike, tp: int, *, model_class: type | None = None,
                    transform_kwargs: dict[str, Any] | None = None, **hf_kwargs: Any) -> nn.Module:
    """Load an HF checkpoint directory straight into a tensor-parallel model.

    Every rank builds the model with parameters on the meta device, transforms it and
    reads only its own slices of each tensor: peak memory per rank is its shard plus
    one slice, never the model.

    Args:
        path: a local directory with ``config.json`` and safetensors weights.
        tp: tensor-parallel degree.
        model_class: default: ``config.architectures[0]`` from ``transformers``.
        transform_kwargs: passed to :func:`tpcompile.transform` (``mesh``,
            ``loss_parallel``, ``overrides``, ...).
        hf_kwargs: passed to ``AutoConfig.from_pretrained`` / ``from_config``
            (``dtype``, ``attn_implementation``, ...).

    Example:
        >>> dist.init_process_group("gloo")                              # doctest: +SKIP
        >>> model = tpcompile.from_pretrained("Llama-3-8B/", tp=2, dtype=torch.bfloat16)
    """
    from transformers import AutoConfig, GenerationConfig

    from ..api import transform
    from .hf import load_hf_weights

    dtype = hf_kwargs.pop("dtype", None) or hf_kwargs.pop("torch_dtype", None)
    config = AutoConfig.from_pretrained(path, **{k: v for k, v in hf_kwargs.items()
                                                 if k not in ("attn_implementation",)})
    cls = model_class or _model_class(config)
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


def scatter_from_rank0(model: nn.Module, table: TranslationTable,
                       full: dict[str, torch.Tensor] | None) -> None:
    """Fill every rank's shards from rank 0's full tensors (``full`` on rank 0 only).

    Collective over the default group; one tensor in flight at a time.  Buffers are
    broadcast too, so ranks that built the model entirely on meta get them.
    """
    rank, size = world()
    ctx = tp_context(model)
    tp_rank_of = [0] * size
    dist.all_gather_object(tp_rank_of, ctx.rank)
    if rank == 0 and full is None:
        raise TPError("load_state_dict_from_rank0: rank 0 must hold the real weights")
    for key in table.saved_keys():
        t = table.tensors[key]
        _, _, cur = lookup(model, key)
        shape = t.local_shape()
        buf = torch.empty(shape, dtype=cur.dtype, device="cpu")
        if t.sharded:
            parts = None
            if rank == 0:
                src = full.pop(key)
                per_tp = [t.to_local(src.detach().cpu(), r) for r in range(table.tp)]
                parts = [per_tp[tp_rank_of[r]].to(cur.dtype) for r in range(size)]
                del src
            dist.scatter(buf, parts, src=0)
        else:
            if rank == 0:
                buf.copy_(full.pop(key))
            dist.broadcast(buf, src=0)
        assign_tp_local(model, key, buf, table.aliases(key))
    for name, b in list(model.named_buffers()):
        if name in table.tensors:
            continue  # persistent: done above
        tmp = b.detach().cpu().clone() if rank == 0 else torch.empty(b.shape, dtype=b.dtype)
        dist.broadcast(tmp, src=0)
        owner, attr, _ = lookup(model, name)
        owner._buffers[attr] = tmp
