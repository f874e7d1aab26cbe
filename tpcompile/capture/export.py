"""Capture: turn a Hugging Face ``nn.Module`` into an ATen-level ``torch.fx`` graph.

The graph comes from ``torch.export.export(..., strict=False)``: it works on modern HF
attention code (``torch.fx.symbolic_trace`` does not) and every node carries
``nn_module_stack`` so each op maps back to the module that ran it.  Parameters become
placeholders whose names map to their fully-qualified names (FQNs).

Two things keep capture cheap:

* weights are never copied: export fakifies the parameters it sees, and a model built on
  the meta device is exported as-is;
* repeated blocks are analysed once.  A ``ModuleList`` of structurally identical blocks
  (same classes, same parameter shapes) is temporarily cut down to the shortest prefix
  that still holds one block of every distinct structure, so a 126-layer model is traced
  as if it had one or two layers.  :class:`LayerStacks` maps the analysed block back to
  every block of the same structure.

Code whose control flow depends on data (an MoE layer looping over the experts its
router picked: ``for e in mask.sum(...).nonzero()``) cannot be exported on fake tensors.
Such a model is traced a second time with ``nonzero`` answering "every position": the
loop then runs over every expert, which is the dataflow the plan must cover.  The graph
is only analysed, never run.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import CaptureError
from .branches import asked_branches, branch_answer, data_dependent, every_position_nonzero
from .canonical import canonical_aliases, canonical_module_paths
from .inputs import _EXAMPLE_BATCH, _EXAMPLE_SEQ, _example_inputs, text_only  # noqa: F401 - re-exported

__all__ = ["Capture", "LayerStacks", "capture", "cut_to_traced", "data_dependent", "every_position_nonzero", "layer_stacks",
           "quiet_traces", "structural_signature"]  # data_dependent, every_position_nonzero: from .branches


def structural_signature(module: nn.Module) -> tuple:
    """Identity of a block's structure: classes and parameter shapes, not names' meaning."""
    parts: list[tuple] = []
    for name, sub in module.named_modules():
        params = tuple(
            (pname, tuple(p.shape), str(p.dtype)) for pname, p in sub.named_parameters(recurse=False)
        )
        parts.append((name, type(sub).__qualname__, params))
    return tuple(parts)


# A block's own position, which only its cache slot reads: equal blocks differ in it
# everywhere, so it must not make each of a 126-layer stack a structure of its own.
_POSITION_ATTRS = frozenset({"layer_idx", "layer_id", "layer_index", "layer_number", "block_idx", "block_id",
                             "i_layer", "idx"})


def _settings(block: nn.Module) -> tuple:
    """The plain settings a block's forward branches on: its modules' int, bool and
    string attributes (Swin's ``shift_size``: a shifted block rolls its input and masks
    its windows, the block before it does neither; Gemma's ``attention_type``).  Blocks
    of one structure with other settings run other code, so each needs a trace of its
    own.  Floats (drop-path rates, which grow block by block) and a block's position are
    left out."""
    parts = []
    for name, sub in block.named_modules():
        values = tuple((k, v) for k, v in sorted(vars(sub).items())
                       if not k.startswith("_") and k != "training" and k not in _POSITION_ATTRS
                       and (v is None or isinstance(v, int | str)))
        if values:
            parts.append((name, values))
    return tuple(parts)


@dataclass
class LayerStacks:
    """Repeated-block stacks found in the model and how the traced prefix maps to them.

    ``members[stack_fqn]`` lists, for every block index ``i``, the index of the traced
    representative whose structure block ``i`` shares.
    """

    members: dict[str, list[int]] = field(default_factory=dict)
    traced_len: dict[str, int] = field(default_factory=dict)

    def expand(self, fqn: str) -> list[str]:
        """All FQNs of the full model that ``fqn`` (from the traced prefix) stands for."""
        for stack, reps in self.members.items():
            prefix = stack + "."
            if fqn.startswith(prefix):
                idx_str, _, rest = fqn[len(prefix):].partition(".")
                if not idx_str.isdigit():
                    continue
                rep = int(idx_str)
                tail = "." + rest if rest else ""
                return [f"{prefix}{i}{tail}" for i, r in enumerate(reps) if r == rep]
        return [fqn]

    def representative(self, fqn: str) -> str:
        """The traced FQN standing for ``fqn`` of the full model."""
        for stack, reps in self.members.items():
            prefix = stack + "."
            if fqn.startswith(prefix):
                idx_str, _, rest = fqn[len(prefix):].partition(".")
                if idx_str.isdigit():
                    tail = "." + rest if rest else ""
                    return f"{prefix}{reps[int(idx_str)]}{tail}"
        return fqn


@dataclass
class Capture:
    """The traced graph plus the maps the analysis needs."""

    graph: torch.fx.Graph
    param_of_placeholder: dict[str, str]  # placeholder node name -> parameter FQN
    buffer_of_placeholder: dict[str, str]
    user_inputs: list[str]
    stacks: LayerStacks
    seconds: float
    # module FQN -> its call signature (graph nodes of its inputs and outputs, and how
    # they map to the forward's arguments), for the modules capture was asked to keep
    signatures: dict[str, Any] = field(default_factory=dict)
    # the keyword inputs traced (built from the model when none were given): every later
    # trace that must match this one (the self-check's localized copy) takes the same
    example_kwargs: dict[str, Any] = field(default_factory=dict)
    # "file.py:line" of each boolean the forward read off data (``if mask.any()``), which
    # the trace answered by the branch side in force (:mod:`.branches`)
    branches: tuple[str, ...] = ()


def _find_stacks(model: nn.Module) -> dict[str, tuple[nn.ModuleList, list[int]]]:
    """Each ``ModuleList`` that repeats a block structure, with the index of the first
    block of each member's structure."""
    stacks: dict[str, tuple[nn.ModuleList, list[int]]] = {}
    for fqn, mod in model.named_modules():
        if not isinstance(mod, nn.ModuleList) or len(mod) < 2:
            continue
        if not any(True for block in mod for _ in block.children()):
            # a list of single layers (StableLM's per-head norms, zipped with the heads they
            # normalise) is data, not a stack of blocks: cut, the forward would run fewer
            # heads; whole, it costs little to trace
            continue
        first: dict[tuple, int] = {}
        reps = [first.setdefault((structural_signature(block), _settings(block)), i) for i, block in enumerate(mod)]
        if len(first) < len(mod):
            stacks[fqn] = (mod, reps)
    return stacks


# set by transformers on a model once its output-capture hooks are installed (on the
# modules present at its first forward)
_HOOKED = "_output_capturing_hooks_installed"


@contextlib.contextmanager
def _truncated(model: nn.Module, stacks: dict[str, tuple[nn.ModuleList, list[int]]]) -> Iterator[None]:
    """Temporarily cut each stack to the prefix holding one block of every structure.

    A forward of the cut model must leave no trace on the whole one: transformers installs
    its output-capture hooks (``output_router_logits``, ``output_hidden_states``...) at a
    model's first forward, on the modules present then, and marks the model done, so a
    first forward while cut would leave the later blocks unhooked and every later
    forward recording a few layers' router logits (a silently different MoE loss).  The
    hooks added while cut are removed and the marks restored."""
    saved: list[tuple[nn.ModuleList, dict]] = []
    modules = list(model.modules())
    hooks = [(m, set(m._forward_hooks), set(m._forward_pre_hooks)) for m in modules]
    marks = [(m, m.__dict__.get(_HOOKED, _HOOKED)) for m in modules]
    try:
        for mod, reps in stacks.values():
            keep = max(reps) + 1
            saved.append((mod, dict(mod._modules)))
            mod._modules = {k: v for k, v in list(mod._modules.items())[:keep]}
        yield
    finally:
        for mod, children in saved:
            mod._modules = children
        for m, post, pre in hooks:
            for key in set(m._forward_hooks) - post:
                del m._forward_hooks[key]
            for key in set(m._forward_pre_hooks) - pre:
                del m._forward_pre_hooks[key]
        for m, mark in marks:
            if mark is _HOOKED:  # not set before
                m.__dict__.pop(_HOOKED, None)
            else:
                m.__dict__[_HOOKED] = mark


def _layer_stacks(stacks: dict[str, tuple[nn.ModuleList, list[int]]]) -> LayerStacks:
    return LayerStacks(
        members={fqn: reps for fqn, (_, reps) in stacks.items()},
        traced_len={fqn: max(reps) + 1 for fqn, (_, reps) in stacks.items()},
    )


@contextlib.contextmanager
def cut_to_traced(model: nn.Module, stacks: LayerStacks) -> Iterator[None]:
    """``model`` cut, for the duration, to the prefix of each stack a capture with these
    ``stacks`` traced (nothing cut when ``stacks`` is empty): a copy made inside holds
    only the traced blocks (the self-check's localized shadow of a 126-layer model copies
    one block, not 126)."""
    mods = dict(model.named_modules())
    with _truncated(model, {fqn: (mods[fqn], reps) for fqn, reps in stacks.members.items()}):
        yield


def layer_stacks(model: nn.Module) -> LayerStacks:
    """The repeated-block stacks :func:`capture` would cut ``model`` to (no tracing)."""
    return _layer_stacks(_find_stacks(model))


def _export(model: nn.Module, args: tuple, kwargs: dict,
            preserve: tuple[str, ...] = ()) -> tuple[torch.export.ExportedProgram, tuple[str, ...]]:
    with asked_branches() as asked:
        ep = _export_retrying(model, args, kwargs, preserve)
    canonical_module_paths(ep.graph, model)  # while a cut stack is still cut
    return ep, tuple(dict.fromkeys(asked))


def _export_retrying(model: nn.Module, args: tuple, kwargs: dict,
                     preserve: tuple[str, ...]) -> torch.export.ExportedProgram:
    told = io.StringIO()  # export prints the graph of a failed trace to stderr
    try:
        with contextlib.redirect_stderr(told), quiet_traces():
            ep = _export_once(model, args, kwargs, preserve)
    except Exception as err:
        if not data_dependent(err):
            sys.stderr.write(told.getvalue())
            raise
        # data-dependent: what export printed is only the question the retry answers
    else:
        sys.stderr.write(told.getvalue())  # what the model itself printed while traced
        return ep
    # data-dependent loops run over every position: first as Python ints (a loop that
    # compares the index it picked, ``if expert_idx == num_experts``, reads a plain
    # value), then as a tensor (code that reshapes what ``nonzero`` returned)
    try:
        with contextlib.redirect_stderr(io.StringIO()), quiet_traces(), every_position_nonzero(ints=True):
            return _export_once(model, args, kwargs, preserve)
    except Exception:  # noqa: BLE001 - the tensor form below raises what is left
        pass
    with quiet_traces(), every_position_nonzero():
        return _export_once(model, args, kwargs, preserve)


def _export_once(model: nn.Module, args: tuple, kwargs: dict,
                 preserve: tuple[str, ...]) -> torch.export.ExportedProgram:
    attempts: list[dict] = [dict(kwargs, use_cache=False), dict(kwargs)]
    last: Exception | None = None
    for kw in attempts:
        try:
            return torch.export.export(model, args, kwargs=kw, strict=False,
                                       preserve_module_call_signature=preserve)
        except TypeError as err:  # the model takes no ``use_cache`` keyword
            last = err
    assert last is not None
    raise last


def _restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    """Each module's own training flag back, not the root's for all: a model may mix them
    (a PEFT model in training mode around a base in eval mode, its dropout off), and
    ``model.train(root_flag)`` would switch the base's dropout on."""
    for module, training in modes:
        module.training = training


@contextlib.contextmanager
def quiet_traces() -> Iterator[None]:
    """Silence torch's fake-tensor error log (a trace that fails is an answer here) and
    its shape log's word on the unused symbol a boolean question left (:mod:`.branches`);
    and let model code open ``torch.autocast`` on the device of a meta tensor."""
    logs = [logging.getLogger(name) for name in ("torch._subclasses.fake_tensor",
                                                 "torch.fx.experimental.symbolic_shapes")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.CRITICAL)
    try:
        with autocast_on_meta():
            yield
    finally:
        for log, level in zip(logs, levels, strict=True):
            log.setLevel(level)


@contextlib.contextmanager
def autocast_on_meta() -> Iterator[None]:
    """``torch.autocast(device_type="meta")`` opens CPU's autocast instead: torch refuses
    the meta device ("unsupported scalarType"), and PEFT's LoRA on parameters (MoE experts,
    ``target_parameters``) opens it on its weight's device, which is meta in every trace
    here.  Nothing runs on the meta device, so whose autocast it is does not matter."""
    cls = torch.amp.autocast_mode.autocast
    original = cls.__init__

    def init(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        original(self, "cpu" if device_type == "meta" else device_type, *args, **kwargs)

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original


# the size a dim only real data sizes gets in the captured graph (the tokens one of
# JetMoE's experts receives, ``split`` by counts read with ``tolist()``): a count of
# positions, never of features, which the analysis only needs to be some fixed int
DATA_DEPENDENT_SIZE = 7919


def size_data_dependent(graph: torch.fx.Graph) -> None:
    """Give every unbacked size in ``graph``'s fake values :data:`DATA_DEPENDENT_SIZE`, so
    the analysis reads ``int(size)`` as for any other dim instead of guarding on data
    (the graph is already exported: nothing is specialized by it)."""
    import sympy

    for node in graph.nodes:
        val = node.meta.get("val")
        for size in val.shape if isinstance(val, torch.Tensor) else ():
            if not isinstance(size, torch.SymInt):
                continue
            env = size.node.shape_env
            unbacked = [x for x in size.node.expr.free_symbols if x not in env.backed_var_to_val]
            if not unbacked:
                continue
            if env.real_tensor_prop_unbacked_vals is None:
                env.real_tensor_prop_unbacked_vals = {}
            for x in unbacked:
                env.real_tensor_prop_unbacked_vals.setdefault(x, sympy.Integer(DATA_DEPENDENT_SIZE))


def _with_mask_of_ones(model: nn.Module, kwargs: dict | None) -> dict | None:
    """``kwargs`` with an all-ones ``attention_mask`` where the forward takes one and the
    example has token ids but no mask; else ``None``."""
    from .inputs import forward_params

    ids = (kwargs or {}).get("input_ids")
    if not isinstance(ids, torch.Tensor) or "attention_mask" in kwargs or "attention_mask" not in forward_params(model):
        return None
    return {**kwargs, "attention_mask": torch.ones_like(ids)}


def capture(
    model: nn.Module,
    *,
    example_args: tuple | None = None,
    example_kwargs: dict | None = None,
    cut_stacks: bool = True,
    preserve: tuple[str, ...] = (),
) -> Capture:
    """Trace ``model`` into an ATen FX graph without materializing weights.

    Args:
        model: any ``nn.Module`` whose forward takes token ids (HF models do); real,
            meta or fake parameters.
        example_args / example_kwargs: inputs to trace with; default: one batch built
            from the model itself (:func:`tpcompile.capture.example_inputs`: ``input_ids``,
            ``pixel_values``, ``input_features``, ``decoder_input_ids`` ...).
        cut_stacks: analyse one block per distinct structure of each repeated stack.
        preserve: module FQNs (of the cut model) whose call signatures to record.

    Example:
        >>> cap = capture(model)                                    # doctest: +SKIP
        >>> cap.stacks.expand("model.layers.0.mlp.up_proj.weight")  # all 32 layers
    """
    start = time.perf_counter()
    default = example_args is None and not example_kwargs and not preserve
    memo_key = _memo_key(model, cut_stacks) if default else None
    if memo_key is not None and (hit := _MEMO.get(model)) is not None and hit[0] == memo_key:
        return hit[1]
    if example_args is None and not example_kwargs:
        example_args, example_kwargs = _example_inputs(model)
    example_args = example_args or ()
    stacks = _find_stacks(model) if cut_stacks else {}
    if stacks and not example_args:
        # a block stands for those the model calls the same way, not only those built alike
        from .calls import split_by_calls

        reps = split_by_calls(model, stacks, example_kwargs or {})
        stacks = {fqn: (mod, reps[fqn]) for fqn, (mod, _) in stacks.items() if len(set(reps[fqn])) < len(mod)}
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # dropout off: it would only add noise nodes to the graph
    try:
        try:
            with _truncated(model, stacks), torch.no_grad():
                ep, branches = _export(model, example_args, example_kwargs or {}, preserve)
        except Exception:
            if not stacks:
                raise
            # a forward that walks the blocks beside a per-layer list (Ergo's
            # ``zip(config.layer_types, self.layers, strict=True)``, XLM's per-layer
            # norms indexed by block) cannot run cut: trace every block instead
            stacks = {}
            with torch.no_grad():
                ep, branches = _export(model, example_args, example_kwargs or {}, preserve)
    except Exception as err:
        if default and text_only(model, err):
            _restore_modes(modes)
            return capture(model, cut_stacks=cut_stacks)
        masked = _with_mask_of_ones(model, example_kwargs) if default else None
        if masked is not None:
            # code that builds a missing mask only when not traced (LongT5's local attention
            # blocks ``attention_mask`` without a None check under torch.export): the mask
            # it would have built
            _restore_modes(modes)
            try:
                return capture(model, example_kwargs=masked, cut_stacks=cut_stacks)
            except CaptureError:
                pass
        raise CaptureError(
            f"tpcompile could not capture {type(model).__name__} with torch.export "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
            "Pass one batch the model accepts: transform(..., example_inputs=dict(...))."
        ) from err
    finally:
        _restore_modes(modes)
    size_data_dependent(ep.graph)
    canonical_aliases(ep.graph)
    sig = ep.graph_signature
    layer_stacks = _layer_stacks(stacks)
    cap = Capture(
        graph=ep.graph,
        param_of_placeholder=dict(sig.inputs_to_parameters),
        buffer_of_placeholder=dict(sig.inputs_to_buffers),
        user_inputs=list(sig.user_inputs),
        stacks=layer_stacks,
        seconds=time.perf_counter() - start,
        signatures={e.fqn: e.signature for e in ep.module_call_graph if e.fqn in preserve},
        example_kwargs=dict(example_kwargs or {}),
        branches=branches,
    )
    if memo_key is not None:
        _MEMO[model] = (memo_key, cap)
    return cap


# The last default capture of each meta model. Planning, the cost model and the layout
# search each capture the same meta model with its default inputs (dump-plan did so three
# times); the graph is read, never changed, after capture, so one serves them all. Real
# models are not kept: their capture ends in transform, which replaces their weights.
_MEMO: weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Capture]] = weakref.WeakKeyDictionary()


def _memo_key(model: nn.Module, cut_stacks: bool) -> tuple | None:
    """What the default capture of ``model`` depends on, or None to capture afresh.

    Module classes, parameter and buffer shapes, every module's plain attributes and
    hooks, and the config (attention implementation included): a change to any of them
    changes the key."""
    tensors = list(model.parameters()) + list(model.buffers())
    if not tensors or any(t.device.type != "meta" for t in tensors):
        return None
    config = getattr(model, "config", None)
    settings = None
    if config is not None:
        to_json = getattr(config, "to_json_string", None)
        settings = (to_json(use_diff=False) if callable(to_json) else repr(config),
                    getattr(config, "_attn_implementation", None))
    return (cut_stacks, branch_answer(), structural_signature(model), tuple((n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()),
            tuple(_module_state(m) for m in model.modules()), settings)


_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.Size)


def _module_state(module: nn.Module) -> tuple:
    """A module's plain attributes as the forward may read them: scalar values (a head
    count the fix-ups make rank-local), containers by content, the identity of anything
    else (a patched method), and its hooks."""
    out: list[Any] = [len(module._forward_hooks), len(module._forward_pre_hooks)]
    for key, value in module.__dict__.items():
        if key in ("_parameters", "_buffers", "_modules") or key.endswith("hooks"):
            continue
        out.append((key, _plain(value)))
    return tuple(out)


def _plain(value: Any, depth: int = 4) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if depth and isinstance(value, tuple | list | set | frozenset):
        items = [_plain(v, depth - 1) for v in value]
        return (type(value).__name__, *(sorted(items, key=repr) if isinstance(value, set | frozenset) else items))
    if depth and isinstance(value, dict):
        return ("dict", *((repr(k), _plain(v, depth - 1)) for k, v in value.items()))
    return id(value)
