"""Hugging Face ``Trainer`` and ``accelerate`` with a transformed / parallelized model
(:mod:`tpcompile.integrations.hf`, :mod:`tpcompile.integrations.trainer`)."""

from __future__ import annotations

import warnings
from typing import Any

from .hf import STATE_DIR, data_mesh, prepare, support_trainers

__all__ = ["STATE_DIR", "TPTrainerCallback", "TrainerSupport", "data_mesh", "prepare", "support_trainers"]


def __getattr__(name: str) -> Any:
    if name in ("TrainerSupport", "TPTrainerCallback"):  # loads transformers' Trainer stack: on first use
        from . import trainer

        return getattr(trainer, name)
    if name == "mark_model":  # the composer's last step sets the marks now
        warnings.warn("tpcompile.integrations.mark_model is deprecated; it is "
                      "tpcompile.runtime.markers.mark_model", DeprecationWarning, stacklevel=2)
        from ..runtime.markers import mark_model

        return mark_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
