"""Errors tpcompile raises: each names what is wrong and how to fix it."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["TPError", "listed"]


class TPError(ValueError):
    """A model, option or environment tpcompile cannot parallelize as asked."""


def listed(names: Sequence[str], shown: int) -> str:
    """``a, b, c and 4 more``: the first ``shown`` of ``names`` for an error message."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
