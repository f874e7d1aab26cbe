"""Errors tpcompile raises: each names what is wrong and how to fix it."""

from __future__ import annotations

__all__ = ["TPError"]


class TPError(ValueError):
    """A model, option or environment tpcompile cannot parallelize as asked."""
