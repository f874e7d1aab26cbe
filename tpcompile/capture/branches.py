"""Control flow on data: the answers capture gives where only real values could decide.

A graph traced on shapes alone cannot follow code that asks its data a question.  Two
kinds of question are answered here, so that such a model is captured at all:

* **where** (``nonzero``, one-argument ``where``): an MoE layer looping over the experts
  its router picked (``for e in mask.sum(...).nonzero()``).  Answered "every position":
  the loop runs over every expert, the dataflow the plan must cover.
* **whether** (``bool(t)``, ``t.item()`` of one boolean): FSMT's ``if not
  padding_mask.any(): padding_mask = None``.  Answered by the *side* in force
  (:func:`branch_side`), ``True`` unless said otherwise; every line asked is recorded
  (:func:`asked_branches`).  A plan must hold on both sides of such a branch, so the
  planner captures the model once per side and compares the two plans
  (:mod:`tpcompile.plan.build`): the runtime then runs whichever side the real data takes.

Only traces use these answers; nothing here is active while a transformed model runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["asked_branches", "branch_answer", "branch_side", "data_dependent", "every_position_nonzero", "model_code"]

_SKIP = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
_SIDE: contextvars.ContextVar[bool] = contextvars.ContextVar("tpcompile_branch_side", default=True)
_ASKED: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("tpcompile_branches_asked", default=None)


def model_code(filename: str) -> bool:
    """Is ``filename`` the model's code (neither torch's nor tpcompile's)?  Failing lines,
    shape sites and the branches asked are all named by it: one test for all."""
    return not filename.startswith(_SKIP)


def data_dependent(err: BaseException | None) -> bool:
    """Did ``err`` (or what caused it) come from a value only real data has: a guard on an
    unbacked symbol (``nonzero``'s length, ``item``), or a fake-tensor op refusing to
    invent one?"""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
    )
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    kinds = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
    while err is not None:
        if isinstance(err, kinds):
            return True
        err = err.__cause__ or err.__context__
    return False


@contextlib.contextmanager
def branch_side(answer: bool) -> Iterator[None]:
    """Trace with every boolean question on data answered ``answer``.

    Example:
        >>> with branch_side(False):                    # doctest: +SKIP
        ...     cap = capture(fsmt)   # FSMT's ``padding_mask.any()`` is False: no mask
    """
    token = _SIDE.set(answer)
    try:
        yield
    finally:
        _SIDE.reset(token)


def branch_answer() -> bool:
    """The side in force: what a boolean question on data is answered."""
    return _SIDE.get()


@contextlib.contextmanager
def asked_branches() -> Iterator[list[str]]:
    """Collect the ``"file.py:line"`` of every boolean question answered inside."""
    asked: list[str] = []
    token = _ASKED.set(asked)
    try:
        yield asked
    finally:
        _ASKED.reset(token)


def _asker() -> str:
    f = sys._getframe(2)
    while f is not None and not model_code(f.f_code.co_filename):
        f = f.f_back
    return "" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def _all_positions(t: torch.Tensor) -> torch.Tensor:
    """What ``nonzero`` returns for an all-true ``t``: every index, ``[numel, ndim]``."""
    if t.dim() == 0:
        return torch.zeros(1, 0, dtype=torch.long, device=t.device)
    grids = torch.meshgrid(*[torch.arange(n, device=t.device) for n in t.shape], indexing="ij")
    return torch.stack(grids, dim=-1).reshape(-1, t.dim())


@contextlib.contextmanager
def every_position_nonzero(ints: bool = False) -> Iterator[None]:
    """``nonzero`` (and one-argument ``where``) as if every entry were true; with ``ints``
    the two-dimensional form is a list of index lists (Python ints), so that code iterating
    over it picks plain values instead of tensors that only real data could compare.  A
    boolean read off data (``bool(t)``, ``t.item()``) gets the :func:`branch_side` answer."""
    originals = (torch.nonzero, torch.Tensor.nonzero, torch.where, torch.Tensor.__bool__, torch.Tensor.item)
    plain_where, plain_bool, plain_item = torch.where, torch.Tensor.__bool__, torch.Tensor.item

    def nonzero(t: torch.Tensor, *, as_tuple: bool = False, **_: Any) -> Any:
        if ints and not as_tuple:
            return [list(i) for i in itertools.product(*(range(int(n)) for n in t.shape))]
        idx = _all_positions(t)
        return tuple(idx.unbind(-1)) if as_tuple else idx

    def where(cond: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        return plain_where(cond, *rest, **kwargs) if rest or kwargs else nonzero(cond, as_tuple=True)

    def answer(read: Any, t: torch.Tensor) -> Any:
        try:
            value = read(t)
            # ``item`` under export gives a symbol: a question only the ``if`` asks
            return bool(value) if isinstance(value, torch.SymBool) else value
        except Exception as err:
            if t.dtype != torch.bool or t.numel() != 1 or not data_dependent(err):
                raise
        asked = _ASKED.get()
        if asked is not None:
            asked.append(_asker())
        return _SIDE.get()

    torch.nonzero, torch.Tensor.nonzero, torch.where = nonzero, nonzero, where
    torch.Tensor.__bool__ = lambda t: answer(plain_bool, t)  # type: ignore[method-assign]
    torch.Tensor.item = lambda t: answer(plain_item, t)  # type: ignore[method-assign]
    try:
        yield
    finally:
        (torch.nonzero, torch.Tensor.nonzero, torch.where, torch.Tensor.__bool__,
         torch.Tensor.item) = originals
