"""A layout as data: the degrees and switches :func:`tpcompile.parallelize` applies.

* :class:`Layout` — tp, pp (schedule, microbatches, stages per rank), cp, ep, dp_shard,
  dp_replicate, sequence parallelism, activation checkpointing, FP8; what the layout
  search (:func:`tpcompile.tools.plan_layout`) ranks and ``parallelize(layout=...)``
  applies;
* :func:`layout_record` — the JSON record of the layout a model runs at
  (``model.tpcompile_layout``, and the ``tpcompile_layout`` field of a training
  checkpoint's metadata);
* :func:`check_layout_request` / :func:`layout_keywords` — what ``parallelize`` accepts
  as ``layout=``, checked before any work;
* :func:`register_layout_search` — where the search that ``layout="auto"`` runs plugs in.

Why the search plugs in rather than being imported: it prices a layout with the cost
model, which runs the runtime's own code (the vocab-parallel loss, FP8's module choice,
context-parallel attention) on fake tensors, so it cannot sit in this stage (before the
runtime) and it lives with the tools, above the front doors.  The front doors import
only what is below them; the tools package registers its search here
(:mod:`tpcompile.tools`), and a layout, once chosen, is plain data any stage can read.

Example:
    >>> lay = Layout(tp=2, dp_shard=4, activation_checkpointing=True)
    >>> lay.label(), lay.world
    ('tp2 dp_shard4 ac', 8)
    >>> layout_record(lay.record_keywords(), source="layout", world=8)["parallelize"]["dp_shard"]
    4
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..config import check_degree
from ..errors import TPError

__all__ = ["LAYOUT_KEYS", "LAYOUT_VERSION", "Layout", "LayoutSearch", "check_layout_request", "layout_keywords",
           "layout_record", "layout_search", "register_layout_search"]

LAYOUT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class Layout:
    """One layout: the degrees and switches ``tpcompile.parallelize`` takes."""

    tp: int = 1
    pp: int = 1
    pp_schedule: str | None = None
    pp_microbatches: int | None = None
    pp_virtual: int = 1
    cp: int = 1
    ep: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    sequence_parallel: bool = False
    activation_checkpointing: bool = False
    fp8: bool = False

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp_shard * self.dp_replicate

    def parallelize_kwargs(self) -> dict[str, Any]:
        """The keywords of ``tpcompile.parallelize`` that build this layout."""
        out: dict[str, Any] = {"tp": self.tp, "dp_shard": self.dp_shard, "dp_replicate": self.dp_replicate,
                               "cp": self.cp, "ep": self.ep, "sequence_parallel": self.sequence_parallel,
                               "activation_checkpointing": self.activation_checkpointing,
                               "fp8": True if self.fp8 else None, "pp": self.pp}
        if self.pp > 1:
            out.update(pp_schedule=self.pp_schedule, pp_microbatches=self.pp_microbatches)
            if self.pp_virtual > 1:
                out["pp_virtual"] = self.pp_virtual
        return out

    def record_keywords(self) -> dict[str, Any]:
        """Every one of :data:`LAYOUT_KEYS`, as :func:`layout_record` stores them."""
        return _normalized(asdict(self))

    def label(self) -> str:
        """``tp8 pp4:1f1b/m16 dp_shard2 sp ac fp8``: the degrees above 1 and the switches on."""
        parts = [f"tp{self.tp}"]
        if self.pp > 1:
            v = f"x{self.pp_virtual}" if self.pp_virtual > 1 else ""
            parts.append(f"pp{self.pp}:{self.pp_schedule}{v}/m{self.pp_microbatches}")
        parts += [f"{k}{v}" for k, v in (("cp", self.cp), ("ep", self.ep), ("dp_shard", self.dp_shard),
                                         ("dp_rep", self.dp_replicate)) if v > 1]
        parts += [k for k, on in (("sp", self.sequence_parallel), ("ac", self.activation_checkpointing),
                                  ("fp8", self.fp8)) if on]
        return " ".join(parts)


# the parallelize keywords a layout sets: a record stores every one of them
LAYOUT_KEYS = tuple(f.name for f in fields(Layout))
# what the search prices as given: with layout="auto" these are its to choose
_SEARCH_CHOOSES = (*LAYOUT_KEYS, "sharding_strategy")
_SEARCH_OPTIONS = ("hardware", "seq", "batch")


def _fp8_value(value: Any) -> bool | str:
    """FP8 as JSON: off, on, or the recipe's name (a torchao config object is "on")."""
    if value is None or value is False:
        return False
    return value if isinstance(value, str) else True


def _normalized(values: Mapping[str, Any]) -> dict[str, Any]:
    out = {k: values[k] for k in LAYOUT_KEYS}
    out["fp8"] = _fp8_value(out["fp8"])
    if out["pp"] == 1:  # no pipeline: nothing to schedule, one stage per rank
        out.update(pp_schedule=None, pp_microbatches=None, pp_virtual=1)
    return out


def layout_record(values: Mapping[str, Any], *, source: str, world: int,
                  search: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON record of an applied layout (``model.tpcompile_layout``).

    Args:
        values: every one of :data:`LAYOUT_KEYS`, as applied (resolved degrees, the
            pipeline schedule the stages were planned for).
        source: ``"auto"`` (the layout search chose it), ``"layout"`` (``layout=`` a
            stored one), ``"transform"``, or the dialect the keywords came in
            (``"keywords"``, an SMP or accelerate config).
        world: the ranks of the job.
        search: for ``"auto"``: the search's inputs and prediction (``hardware``,
            ``gpus``, ``gpus_per_node``, ``seq``, ``batch``, ``dtype``, ``predicted``).
    """
    kw = _normalized(values)
    label = Layout(**{**kw, "fp8": bool(kw["fp8"])}).label()
    out: dict[str, Any] = {"version": LAYOUT_VERSION, "label": label, "source": source, "world": world,
                           "parallelize": kw}
    out.update({k: v for k, v in (search or {}).items() if k not in out})
    return out


def layout_keywords(layout: Layout | Mapping[str, Any]) -> dict[str, Any]:
    """The ``parallelize`` keywords of a stored layout: a :class:`Layout`, a dict of its
    keywords (``model.tpcompile_layout["parallelize"]``) or a whole record."""
    if isinstance(layout, Layout):
        kw: dict[str, Any] = layout.record_keywords()
    else:
        kw = dict(layout["parallelize"] if "parallelize" in layout else layout)
        unknown = sorted(set(kw) - set(LAYOUT_KEYS))
        if unknown:
            raise TPError(f"layout= holds {', '.join(map(repr, unknown))}, which a layout does not set; its "
                          f"keys are {', '.join(LAYOUT_KEYS)} (pass the other options as keywords)")
    if kw.get("fp8") is False:
        kw["fp8"] = None  # parallelize's "off"
    return kw


def check_layout_request(layout: Any, *, explicit: Mapping[str, Any], options: Mapping[str, Any],
                         plan_given: bool) -> None:
    """Refuse what ``parallelize(layout=...)`` cannot honour, naming the keywords.

    ``explicit``: the parallelize keywords given away from their defaults; ``options``:
    ``hardware`` / ``seq`` / ``batch`` (read by the search only)."""
    searched = [f"{k}=" for k in _SEARCH_OPTIONS if options.get(k) is not None]
    if layout is None or not (isinstance(layout, str) and layout == "auto"):
        if searched:
            one = len(searched) == 1
            raise TPError(f"{', '.join(searched)} {'is' if one else 'are'} read only with layout='auto' (the "
                          f"layout search's job description): add layout='auto', or drop {'it' if one else 'them'}")
    if layout is None:
        return
    if isinstance(layout, str) and layout == "auto":
        if options.get("seq") is None:
            raise TPError("layout='auto' needs seq= (tokens per sequence): the layout search prices the "
                          "activations and the step at that length")
        for key in ("seq", "batch"):
            value = options.get(key)
            if value is not None:
                check_degree(key, value)
        conflicts = [f"{k}=" for k in _SEARCH_CHOOSES if k in explicit] + (["plan="] if plan_given else [])
        if conflicts:
            raise TPError(f"layout='auto' chooses the layout itself, but {', '.join(conflicts)} "
                          f"{'was' if len(conflicts) == 1 else 'were'} given: drop "
                          f"{'it' if len(conflicts) == 1 else 'them'}, or drop layout='auto'")
        return
    if not isinstance(layout, (Layout, Mapping)):
        raise TPError(f"layout must be 'auto', a Layout or a dict of parallelize keywords (a stored "
                      f"model.tpcompile_layout['parallelize']), got {layout!r}")
    layout_keywords(layout)  # its keys, checked before any work
    conflicts = [f"{k}=" for k in LAYOUT_KEYS if k in explicit]
    if conflicts:
        raise TPError(f"layout= sets the degrees, but {', '.join(conflicts)} "
                      f"{'was' if len(conflicts) == 1 else 'were'} given too: drop one of them")


# ---- where the layout search plugs in ------------------------------------------------

# ``search(model, *, gpus, gpus_per_node, hardware, batch, seq, device)`` returns the
# chosen layout's record fields: ``parallelize`` (its keywords), ``label``, and what
# :func:`layout_record` stores as ``search``; it raises TPError when no layout fits
LayoutSearch = Callable[..., dict[str, Any]]
_search: list[LayoutSearch] = []


def register_layout_search(search: LayoutSearch | None) -> LayoutSearch | None:
    """Install the search ``parallelize(layout="auto")`` runs (``None`` removes it);
    returns the one it replaces.  :mod:`tpcompile.tools` installs
    :func:`~tpcompile.tools.layout.choose_layout` when imported, which ``import tpcompile`` does."""
    old = _search[0] if _search else None
    _search[:] = [search] if search is not None else []
    return old


def layout_search() -> LayoutSearch:
    """The installed search, or a TPError saying how to install it."""
    if not _search:
        raise TPError("layout='auto' runs the layout search of tpcompile.tools, which `import tpcompile` "
                      "installs (the library modules never import the tools, which sit above them): import "
                      "tpcompile, or pass layout=tpcompile.tools.plan_layout(...).best.layout")
    return _search[0]
