"""Checkpoints of transformed models.

* HF format in and out: :func:`hf_state_dict`, :func:`save_pretrained`,
  :func:`load_hf_weights` (and ``tpcompile.from_pretrained``, which transforms too);
* training checkpoints (model + optimizer): :func:`save` / :func:`load` with
  ``kind="sharded"`` (reshards to any layout), ``"local"`` (same layout) or ``"full"``
  (HF directory + optimizer), optionally asynchronous; :func:`saved_layout` reads back
  the layout a checkpoint's model ran at.

Every write is atomic; every read checks what it reads.
"""

from __future__ import annotations

import warnings
from typing import Any

from .hf import hf_state_dict, load_hf_weights, save_pretrained
from .training import SaveHandle, latest, load, save, saved_layout

__all__ = ["SaveHandle", "hf_state_dict", "latest", "load", "load_hf_weights", "save", "save_pretrained",
           "saved_layout"]


def __getattr__(name: str) -> Any:
    if name == "from_pretrained":  # a front door now (it transforms): tpcompile.from_pretrained
        warnings.warn("tpcompile.checkpoint.from_pretrained is deprecated; use tpcompile.from_pretrained",
                      DeprecationWarning, stacklevel=2)
        from ..api import from_pretrained  # deprecated alias: the only upward import, lazy

        return from_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
