"""What crosses the boundary between two blocks: read off one meta-device forward.

Pipeline parallelism cuts the model between blocks of its one stack.  Which values cross
a cut is a fact of the model's dataflow, found here by running a meta copy of the model
(fake tensors: no weights, no memory) on the step's input shapes with every block's call recorded:

* the **hidden state**: the block's first tensor argument (or ``hidden_states=``); each
  block returns it (alone, or first of a tuple whose other entries carry no tensor).  It
  is the one value a stage sends to the next, and its gradient the one sent back.
* **side inputs**: every other argument of a block call (masks, rotary tables, position
  ids, the cache).  Each stage recomputes them from the batch by running the model's own
  code before the first block, so they never cross — which is exact only when they carry
  no gradient.  A side input that depends on a parameter (T5's relative position bias made
  by its first block, an encoder's output read by decoder blocks, Gemma-3n's per-layer
  embeddings) would need its gradient sent back across stages: it is refused, naming it.
* the **modules outside the blocks** that own parameters, in call order: those called
  before the first block (embeddings) join the first stage, those called after the last
  (final norm, head) the last stage.

Example:
    >>> b = probe_boundaries(model, {"input_ids": torch.zeros(2, 16, dtype=torch.long)})  # doctest: +SKIP
    >>> b.stack, b.pre, b.post, b.hidden_shape
    ('model.layers', ['model.embed_tokens'], ['model.norm', 'lm_head'], (2, 16, 64))
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from ..capture.fake import as_if_exporting, fake_copy
from ..errors import TPError

__all__ = ["Boundaries", "CarriedEntry", "meta_copy", "probe_boundaries", "recorded_outputs", "stack_of"]


@dataclass
class Boundaries:
    """The block boundaries of one model at one input shape."""

    stack: str  # the container holding the blocks ("model.layers")
    blocks: list[str]
    pre: list[str]  # parameter-owning modules run before the first block, in call order
    post: list[str]  # ... and after the last block
    hidden_arg: int | str  # where a block takes the hidden state: a position or a keyword
    hidden_shape: tuple[int, ...]
    hidden_dtype: torch.dtype
    returns_tuple: bool  # the block returns (hidden, *rest) instead of the hidden state
    rest: tuple[Any, ...] = ()  # the tuple's other (tensor-free) entries
    side_inputs: list[str] = field(default_factory=list)  # recomputed on every stage
    # outputs transformers' output capture records inside blocks that the code after the
    # stack reads (MoE router logits for the load-balancing loss): they cross with the
    # hidden state, each stage sending the entries recorded so far, in block order
    carried: list[CarriedEntry] = field(default_factory=list)

    def carried_before(self, block: str) -> list[CarriedEntry]:
        """The carried entries recorded by the blocks before ``block``."""
        i = self.blocks.index(block)
        return [e for e in self.carried if self.blocks.index(e.block) < i]


@dataclass(frozen=True)
class CarriedEntry:
    """One recorded value that crosses stage boundaries: its capture key, the block that
    recorded it, its shape and dtype at the probe's microbatch."""

    key: str
    block: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` on the meta device: same modules and attributes, no storage."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        memo[id(p)] = nn.Parameter(torch.empty(local.shape, dtype=p.dtype, device="meta"),
                                   requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)


def stack_of(blocks: list[str], model_class: str) -> str:
    """The one container of ``blocks``; a model with two stacks (an encoder and a decoder)
    cannot be cut into one chain of stages."""
    stacks = sorted({b.rpartition(".")[0] for b in blocks})
    if not blocks:
        raise TPError(f"pp > 1 needs the repeated blocks of {model_class}, and the capture found none")
    if len(stacks) > 1:
        raise TPError(f"pp > 1 splits one stack of blocks into stages, but {model_class} has {len(stacks)} "
                      f"({', '.join(stacks)}): an encoder-decoder's decoder blocks read the encoder's output, "
                      "whose gradient would have to cross stages. Train it without pp (tp / FSDP2 / cp)")
    return stacks[0]


def _hidden_slot(args: tuple, kwargs: dict, block: str) -> tuple[int | str, torch.Tensor]:
    for i, a in enumerate(args):
        if isinstance(a, torch.Tensor):
            return i, a
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states", kwargs["hidden_states"]
    raise TPError(f"pp > 1: block {block} is called without a tensor argument or hidden_states=, so the "
                  "value crossing its boundary is unknown")


def _owning_modules(model: nn.Module, blocks: set[str]) -> dict[str, nn.Module]:
    """Modules outside the blocks that own a parameter directly, by name."""
    out = {}
    for name, mod in model.named_modules():
        if any(name == b or name.startswith(b + ".") for b in blocks):
            continue
        if any(p is not None for p in mod._parameters.values()):
            if any(b.startswith(name + ".") or not name for b in blocks):
                raise TPError(f"pp > 1: {name or type(model).__name__} owns parameters directly and also "
                              "holds the blocks, so no stage can own it alone")
            out[name] = mod
    return out


def _where(err: BaseException, twin: nn.Module) -> str:
    """The innermost module of ``twin`` (name and class) whose code raised ``err``, and the
    source line."""
    names = {id(m): n for n, m in twin.named_modules()}
    tb, found = err.__traceback__, "the forward"
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names:
            code = tb.tb_frame.f_code
            found = (f"{names[id(owner)] or '<root>'} ({type(owner).__name__}, "
                     f"{code.co_filename.rpartition('/')[2]}:{tb.tb_lineno})")
        tb = tb.tb_next
    return found


def probe_boundaries(model: nn.Module, inputs: dict[str, Any], blocks: list[str]) -> Boundaries:
    """Run a fake-tensor copy of ``model`` on ``inputs``' shapes and record what enters
    and leaves each of ``blocks``; refuse a side input with a gradient."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    # a shape environment, as torch.export's: a data-dependent value (an expert loop's
    # index) becomes a symbol instead of an error; the boundaries' shapes stay concrete
    mode = FakeTensorMode(shape_env=ShapeEnv())
    twin = fake_copy(model, mode)
    stack = stack_of(blocks, type(model).__name__)
    owners = _owning_modules(twin, set(blocks))
    order: list[str] = []
    calls: dict[str, tuple[tuple, dict, Any]] = {}
    first_block: list[int] = []
    reads = _Reads()
    handles = []
    for name, mod in owners.items():
        handles.append(mod.register_forward_pre_hook(lambda *_, _n=name: order.append(_n)))
    recorded: list[tuple[str, str, torch.Tensor]] = []  # (key, block, value) in record order
    before: dict[str, int] = {}
    for name in blocks:
        def pre(mod: nn.Module, args: tuple, kwargs: dict, _n: str = name) -> None:
            if not first_block:
                first_block.append(len(order))
            calls[_n] = (args, kwargs, None)
            before.clear()
            before.update({k: len(v) for k, v in recorded_outputs().items()})

        def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any, _n: str = name) -> None:
            calls[_n] = (args, kwargs, out)
            order.append(f"<block {_n}>")
            reads.watch(out)
            for key, values in recorded_outputs().items():
                for v in values[before.get(key, 0):]:
                    if isinstance(v, torch.Tensor):
                        recorded.append((key, _n, v))
                        reads.watch_value(v)

        block = twin.get_submodule(name)
        handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(block.register_forward_hook(post, with_kwargs=True))
    with mode:
        fake_inputs = tree_map_only(torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype), dict(inputs))
    try:
        try:
            with mode, as_if_exporting(), reads:
                twin(**fake_inputs)
        except Exception as err:
            from ..capture.branches import data_dependent, every_position_nonzero

            if not data_dependent(err):
                raise
            # a data-dependent shape (an expert loop over ``nonzero``): as the capture does,
            # run it over every position; what crosses a block boundary keeps its shape

            order.clear(), calls.clear(), first_block.clear(), recorded.clear()
            reads.seen.clear(), reads.watched.clear()
            try:
                with mode, as_if_exporting(), reads, every_position_nonzero():
                    twin(**fake_inputs)
            except Exception as again:
                if not data_dependent(again):
                    raise
                raise TPError(f"pp > 1: {type(model).__name__}'s forward cannot run on shapes alone, so the values "
                              f"crossing its block boundaries cannot be read off: {_where(again, twin)} uses a "
                              "value only real data has. Train this model without pp"
                              ) from again
    finally:
        for h in handles:
            h.remove()
    missing = [b for b in blocks if b not in calls]
    if missing:
        raise TPError(f"pp > 1: blocks {missing[:4]} did not run in {type(model).__name__}'s forward")
    last_block = max(i for i, n in enumerate(order) if n.startswith("<block "))
    start = first_block[0]
    pre = list(dict.fromkeys(n for n in order[:start] if not n.startswith("<")))
    post = list(dict.fromkeys(n for n in order[last_block + 1:] if not n.startswith("<") and n not in pre))
    between = sorted({n for n in order[start:last_block] if not n.startswith("<")} - set(pre) - set(post))
    if between:
        raise TPError(f"pp > 1: {between[:4]} run between the blocks of {stack} (not inside one), so no "
                      "stage boundary can be drawn around them")
    unused = sorted(set(owners) - set(pre) - set(post))
    pre += unused  # parameters the forward never reads: kept (and saved) by the first stage
    args, kwargs, out = calls[blocks[0]]
    slot, hidden = _hidden_slot(args, kwargs, blocks[0])
    side = _side_inputs(args, kwargs, slot, blocks)
    for name in blocks[1:]:
        a, k, _ = calls[name]
        _side_inputs(a, k, slot, [name])
    returns_tuple, rest = _block_output(out, blocks[0], reads.seen)
    read_keys = {key for key, _, v in recorded if id(v) in reads.seen}
    carried = [CarriedEntry(key=key, block=b, shape=tuple(v.shape), dtype=v.dtype)
               for key, b, v in recorded if key in read_keys]
    return Boundaries(stack=stack, blocks=list(blocks), pre=pre, post=post, hidden_arg=slot,
                      hidden_shape=tuple(hidden.shape), hidden_dtype=hidden.dtype, returns_tuple=returns_tuple,
                      rest=rest, side_inputs=side, carried=carried)


def recorded_outputs() -> dict[str, list[Any]]:
    """What transformers' output capture (``output_router_logits=True``, ...) has recorded
    in the forward running now, by key (empty outside one)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output capture records nothing
        return {}
    got = _active_collector.get()
    return {k: v for k, v in (got or {}).items() if isinstance(v, list) and not k.startswith("_")}


def _side_inputs(args: tuple, kwargs: dict, slot: int | str, blocks: list[str]) -> list[str]:
    """The names of a block call's other inputs; a tensor among them with a gradient is refused."""
    named = {f"argument {i}": a for i, a in enumerate(args) if i != slot}
    named.update({k: v for k, v in kwargs.items() if k != slot})
    for name, value in named.items():
        leaves, _ = tree_flatten(value)
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
            raise TPError(f"pp > 1: {name} passed to block {blocks[0]} depends on parameters (it carries a "
                          "gradient). Pipeline stages recompute a block's side inputs from the batch and send "
                          "only the hidden state, so this value's gradient could not reach its parameters: "
                          "train this model without pp")
    return sorted(named)


def _block_output(out: Any, block: str, read: set[int]) -> tuple[bool, tuple[Any, ...]]:
    """Whether the block returns a tuple, and what a pass-through returns after the
    hidden state: its other entries, a tensor among them as ``None`` where no op read it
    (BLOOM's attention weights, only collected with ``output_attentions``)."""
    if isinstance(out, torch.Tensor):
        return False, ()
    if isinstance(out, tuple | list) and out and isinstance(out[0], torch.Tensor):
        rest = tuple(out[1:])
        leaves = [t for t in tree_flatten(rest)[0] if isinstance(t, torch.Tensor)]
        if not any(id(t) in read for t in leaves):
            return True, tuple(tree_map_only(torch.Tensor, lambda _: None, rest))
    raise TPError(f"pp > 1: block {block} returns {type(out).__name__} with tensors besides its hidden state that "
                  "later code reads; a stage boundary passes one tensor. Train this model without pp")


class _Reads(TorchDispatchMode):
    """Which watched tensors an op reads after they were watched: a block's extra outputs,
    watched from the moment the block returns, need not cross a stage boundary when no
    later op reads them."""

    def __init__(self) -> None:
        super().__init__()
        self.watched: list[torch.Tensor] = []  # held, so their ids stay theirs
        self.seen: set[int] = set()

    def watch(self, out: Any) -> None:
        if isinstance(out, tuple | list):
            self.watched += [t for t in tree_flatten(tuple(out[1:]))[0] if isinstance(t, torch.Tensor)]

    def watch_value(self, t: torch.Tensor) -> None:
        self.watched.append(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        ids = {id(t) for t in self.watched}
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, torch.Tensor) and id(t) in ids:
                self.seen.add(id(t))
        return func(*args, **(kwargs or {}))
