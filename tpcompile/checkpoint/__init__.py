"""Checkpoints of transformed models.

* HF format in and out: :func:`hf_state_dict`, :func:`save_pretrained`,
  :func:`load_hf_weights`, :func:`from_pretrained`;
* training checkpoints (model + optimizer): :func:`save` / :func:`load` with
  ``kind="sharded"`` (reshards to any layout), ``"local"`` (same layout) or ``"full"``
  (HF directory + optimizer), optionally asynchronous.

Every write is atomic; every read checks what it reads.
"""

from __future__ import annotations

from .hf import hf_state_dict, load_hf_weights, save_pretrained
from .pretrained import from_pretrained
from .training import SaveHandle, latest, load, save

__all__ = [
    "SaveHandle", "from_pretrained", "hf_state_dict", "latest", "load", "load_hf_weights",
    "save", "save_pretrained",
]
