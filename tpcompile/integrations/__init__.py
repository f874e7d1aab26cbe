"""Hugging Face ``Trainer`` and ``accelerate`` with a transformed / parallelized model
(:mod:`tpcompile.integrations.hf`)."""

from __future__ import annotations

from .hf import STATE_DIR, TPTrainerCallback, data_mesh, prepare

__all__ = ["STATE_DIR", "TPTrainerCallback", "data_mesh", "prepare"]
