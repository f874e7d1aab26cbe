"""The runtime stage: applying a plan to a model and running it.

* :mod:`~tpcompile.runtime.apply` shards parameters and installs the backend's hooks
  (:mod:`~tpcompile.runtime.backend`: the protocol; the torch/DTensor backend installs
  one handler per :mod:`~tpcompile.plan.modules` op type; :mod:`~tpcompile.runtime.comm`:
  the differentiable collectives);
* :mod:`~tpcompile.runtime.loss` (vocab-parallel cross-entropy),
  :mod:`~tpcompile.runtime.sequence` (sequence-parallel hooks),
  :mod:`~tpcompile.runtime.experts` (expert-parallel dispatch),
  :mod:`~tpcompile.runtime.activations` (checkpointing / offloading per block),
  :mod:`~tpcompile.runtime.fsdp` (FSDP2 units);
* :mod:`~tpcompile.runtime.state_dict` (HF tensors from ``state_dict()``),
  :mod:`~tpcompile.runtime.materialize` (delayed init), :mod:`~tpcompile.runtime.mesh`
  (:class:`ParallelDims`: every mesh), :mod:`~tpcompile.runtime.markers`.

Public here: the per-block activation tools, for models you compose yourself.

Example:
    >>> from tpcompile.runtime import checkpoint_blocks, offload_activations  # doctest: +SKIP
    >>> checkpoint_blocks(model, model.tpcompile_plan.blocks)
"""

from __future__ import annotations

from .activations import OffloadHandle, OffloadStats, checkpoint_blocks, offload_activations
from .context import gather_sequence
from .mesh import ParallelDims, data_parallel_rank

__all__ = ["OffloadHandle", "OffloadStats", "ParallelDims", "checkpoint_blocks", "data_parallel_rank", "gather_sequence",
           "offload_activations"]
