"""Checkpoints of transformed models: HF format in and out (and, per kind, sharded or
local training checkpoints).  Every write is atomic; every read checks what it reads."""

from __future__ import annotations

from .hf import hf_state_dict, load_hf_weights, save_pretrained
from .pretrained import from_pretrained

__all__ = ["from_pretrained", "hf_state_dict", "load_hf_weights", "save_pretrained"]
