"""Errors tpcompile raises: each names what is wrong and how to fix it."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["CaptureError", "TPError", "listed"]


class TPError(ValueError):
    """A model, option or environment tpcompile cannot parallelize as asked."""


class CaptureError(TPError, RuntimeError):
    """torch.export could not trace the model's forward (on the inputs given or built):
    a :class:`TPError` at transform time like any other, and the ``RuntimeError`` it
    was before."""


def listed(names: Sequence[str], shown: int) -> str:
    """``a, b, c and 4 more``: the first ``shown`` of ``names`` for an error message."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
