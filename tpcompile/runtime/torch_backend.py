"""The pure-PyTorch backend: DTensor parameters, local compute, explicit collectives.

The model's own ``forward`` code runs unchanged.  Parallelism is wrapped around modules
from outside with hooks:

* every parameter is stored as a ``DTensor`` over the TP mesh (``Shard(dim)`` of its
  tpcompile layout, or ``Replicate()``), so ``state_dict``, optimizers (foreach kernels
  included), gradient clipping and FSDP2 see global shapes; during the owning module's
  forward it is swapped for its local tensor (``to_local`` is differentiable, so
  gradients land on the DTensor);
* column-parallel modules see their inputs through ``copy_to_tp`` (identity forward,
  all-reduce of the input gradient backward): ``Y_r = X · W_r``;
* row-parallel modules all-reduce their partial output, ``Y = Σ_r X_r · W_r``, and add
  their bias once, after the reduce;
* a vocab-parallel embedding looks up only ids in its row range (others read row 0 and
  are zeroed), then all-reduces;
* the LM head all-gathers its vocab-sharded logits (or keeps them sharded for the
  loss-parallel cross-entropy);
* a replicated parameter applied to sharded features (Qwen3's ``q_norm``) is used through
  ``all_reduce_grad`` so its gradient sums every rank's heads;
* a statistic over split features (OLMo-2's ``q_norm`` over all heads) is computed, while
  its module runs, from local partial sums all-reduced forward and backward
  (:mod:`tpcompile.runtime.stats`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import TPError
from ..plan.modules import (
    EnterRegion,
    GatherOutput,
    GradSum,
    ModulePlan,
    ReduceOutput,
    SliceBuffers,
    SliceInputs,
    SplitStats,
    VocabEmbedding,
    WholeMasks,
)
from ..plan.types import ParamPlan, select_rows
from . import comm
from .masks import WholeMaskMode, may_drop
from .rows import LocalRows, padding_masks, shared_rows, zero_padding
from .stats import SplitStatMode

__all__ = ["HANDLERS", "OpHooks", "TorchBackend", "handler_for"]


def _leading_tensor(out: Any) -> tuple[Any, Callable[[Any], Any]]:
    """The value a module's exit ops act on, and how to put it back: the output itself,
    or the first entry of a tuple whose other entries carry no tensor (I-BERT's quantized
    modules return ``(values, None)`` outside quant mode)."""
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and not hasattr(out, "_fields") \
            and not any(isinstance(t, torch.Tensor) for t in tree_flatten(list(out[1:]))[0]):
        return out[0], lambda value: (value, *out[1:])
    return out, lambda value: value


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_map_tensors(o, fn) for o in obj))
    if isinstance(obj, list | tuple):
        return type(obj)(_map_tensors(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


class TorchBackend:
    """Applies a :class:`~tpcompile.plan.Plan` with DTensor parameters and hooks."""

    name = "torch"

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.group = mesh.get_group()
        self.rank = mesh.get_local_rank()
        self.tp = mesh.size()
        # the last input that entered the TP region, its version and its copy_to_tp view
        self._last: tuple[torch.Tensor, int, torch.Tensor] | None = None
        # the LM head's last gathered logits and the local shard they came from
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def reset(self) -> None:
        """Forget the shared input (each top-level forward starts a new autograd graph)."""
        self._last = None
        self._gathered = None

    def forget_input(self) -> None:
        """Forget the shared input only: a compiled block starts from nothing it did not
        make, so what it reads of this object is the same at every call (no recompile)."""
        self._last = None

    @staticmethod
    def leave_with(module: nn.Module, leave: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
        """How row-parallel ``module``'s partial output leaves the region instead of the
        all-reduce, when ``leave`` returns a tensor (sequence parallelism's reduce-scatter,
        :mod:`tpcompile.plan.sequence`). Kept on the module: a compiled block reads it as
        an attribute, the same function on every block, not from a dict keyed by id."""
        module._tpcompile_leave = leave

    def gathered(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The local vocab shard behind ``logits`` if they are the LM head's gathered output."""
        g = self._gathered
        return g[1] if g is not None and g[0] is logits else None

    def copy_in(self, t: torch.Tensor, parameter_view: bool | None = None) -> torch.Tensor:
        """``copy_to_tp(t)``, shared by consecutive column modules that read the same ``t``.

        q, k and v (or gate and up) read one normed activation: entering the TP region
        once makes autograd sum their input gradients *before* the single backward
        all-reduce, instead of one all-reduce per projection (Megatron's fused "f").
        Only the last input is remembered, so nothing outlives the next column module's
        call; an in-place change of ``t`` (version bump) makes a fresh copy.
        ``parameter_view``: whether ``t`` is a parameter seen through views, when the
        caller knows it (a compiled block cannot walk autograd nodes; see
        :class:`_EnterHooks`).
        """
        if parameter_view is None:
            parameter_view = _parameter_view(t)
        if not t.is_floating_point() or parameter_view:
            return t
        if not torch.is_grad_enabled():
            return comm.copy_to_tp(t, self.group)
        # traced code has no version counters: inside a compiled block the functional
        # graph orders the reads (an in-place change between two projections' reads of
        # one input is not seen there)
        version = -1 if torch.compiler.is_compiling() else t._version
        last = self._last
        if last is not None and last[0] is t and last[1] == version:
            return last[2]
        if last is not None and last[2] is t:
            # the copy itself, passed on by a module that entered the region to a module
            # it calls (AdaLoRA's projection reads ``x`` beside its base layer): entering
            # twice would sum the base layer's input gradient twice
            return t
        out = comm.copy_to_tp(t, self.group)
        self._last = (t, version, out)
        return out

    def mark_entered(self, t: torch.Tensor) -> None:
        """``t`` already entered the TP region (its backward sums the partial gradients,
        as :func:`~tpcompile.runtime.comm.enter_tp` does): column modules use it as it is."""
        self._last = (t, -1 if torch.compiler.is_compiling() else t._version, t)

    # ---- parameters ---------------------------------------------------------------
    def local_shard(self, full: torch.Tensor, plan: ParamPlan, rank: int | None = None) -> torch.Tensor:
        """This rank's shard of a full (HF-layout) tensor, per the plan's index map."""
        rank = self.rank if rank is None else rank
        return select_rows(full, plan.shard_dim, plan.index()[rank])

    def make_param(self, local: torch.Tensor, plan: ParamPlan, requires_grad: bool) -> nn.Parameter:
        if self.tp == 1:  # nothing is split: DTensors would only add dispatch overhead
            return nn.Parameter(local, requires_grad=requires_grad)
        if plan.shard_dim is None:
            dt = DTensor.from_local(local, self.mesh, [Replicate()], run_check=False)
            return nn.Parameter(dt, requires_grad=requires_grad)
        global_shape = list(local.shape)
        global_shape[plan.shard_dim] *= self.tp
        dt = DTensor.from_local(
            local, self.mesh, [Shard(plan.shard_dim)], run_check=False,
            shape=torch.Size(global_shape), stride=_contiguous_stride(global_shape),
        )
        return nn.Parameter(dt, requires_grad=requires_grad)

    # ---- hooks ----------------------------------------------------------------------
    def install(
        self,
        module: nn.Module,
        mplan: ModulePlan,
        swaps: list[str],
        vocab_range: tuple[int, int] | None,
        replicas: dict[str, ParamPlan] | None = None,
    ) -> None:
        """Wrap ``module``'s forward with the collectives ``mplan.ops`` list, one handler
        per op type (:data:`HANDLERS`), in the plan's hook order.

        ``swaps`` names the DTensor parameters used locally; ``replicas`` those whose
        rows several ranks hold (replicated KV heads): their gradients are summed over
        the copies so every copy takes the same optimizer step — and those with padding
        rows (heads dealt unevenly): a padding row's gradient is zero, so it stays zero
        and its head adds nothing (a padding head's output reaches the model's output only
        through the zero columns of the row-parallel weight, which would otherwise learn).
        """
        replicas = replicas or {}
        if (vocab_range is not None) != (mplan.op(VocabEmbedding) is not None):
            raise ValueError(f"{mplan.fqn}: a vocab range is given exactly for vocab-parallel embeddings")
        handlers = [handler_for(op)(self, op, vocab_range) for op in mplan.ops]
        for h in handlers:
            h.fqn = mplan.fqn  # named in the errors a handler raises
        local_rows = {name: LocalRows.of(pp, self.rank) for name, pp in replicas.items()}
        group = self.group
        state: dict[str, Any] = {}
        # a padding head's features are zeroed where a column-parallel linear makes them
        # (they are zero: this cuts their backward) and where they enter the row-parallel
        # one: whatever the head computes in between (even a non-finite value, forward or
        # backward) meets zeros
        padding_in, padding_out = padding_masks(module, replicas.get("weight"), local_rows.get("weight"))

        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            saved: dict[str, Any] = {}
            state["saved"] = saved  # filled as we go: restore() undoes a partial swap too
            for name in swaps:
                p = mod._parameters[name]
                saved[name] = p
                local = _local(p)
                if name in local_rows:
                    local = shared_rows(local, replicas[name], local_rows[name], group)
                mod._parameters[name] = local
            for h in handlers:
                h.swap(mod, saved)
            # FSDP1 (use_orig_params) also sets its unsharded views as plain instance
            # attributes, which attribute lookup finds before _parameters: swap those too
            shadowed = {n: mod.__dict__[n] for n in saved if n in mod.__dict__}
            for n in shadowed:
                mod.__dict__[n] = mod._parameters[n]
            state["shadowed"] = shadowed
            if padding_in is not None and args:
                args = (zero_padding(args[0], padding_in), *args[1:])
            for h in handlers:
                args, kwargs = h.pre(args, kwargs, state)
            return args, kwargs

        def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
            value, rebuild = _leading_tensor(out)
            value = zero_padding(value, padding_out)
            for h in handlers:
                value = h.post(mod, value, state)
            return rebuild(value)

        def restore(mod: nn.Module, args: tuple, out: Any) -> None:
            # always_call: also when the forward (or ``post``) raised, so an exception
            # never leaves local tensors or zeroed row biases in place of the parameters
            for h in handlers:
                h.cleanup(state)
            for name, p in state.pop("saved", {}).items():
                if isinstance(name, tuple):  # a buffer a handler narrowed: (submodule, leaf)
                    name[0]._buffers[name[1]] = p
                else:
                    mod._parameters[name] = p
            mod.__dict__.update(state.pop("shadowed", {}))
            state.pop("mask", None)

        module.register_forward_pre_hook(pre, with_kwargs=True)
        module.register_forward_hook(post, with_kwargs=True)
        module.register_forward_hook(restore, always_call=True)  # after post: it reads "saved"


# ---------------------------------------------------------------- one handler per op type


class OpHooks:
    """What one :class:`~tpcompile.plan.modules.ModuleOp` does around a module's forward:
    ``swap`` (parameters, before the forward), ``pre`` (inputs), ``post`` (outputs)."""

    fqn = ""  # the module's name, set by install

    def __init__(self, backend: TorchBackend, op: Any, vocab_range: tuple[int, int] | None) -> None:
        self.backend, self.op, self.group, self.vocab_range = backend, op, backend.group, vocab_range

    def swap(self, mod: nn.Module, saved: dict[str, Any]) -> None:
        return None

    def pre(self, args: tuple, kwargs: dict, state: dict[str, Any]) -> tuple[tuple, dict]:
        return args, kwargs

    def post(self, mod: nn.Module, out: Any, state: dict[str, Any]) -> Any:
        return out

    def cleanup(self, state: dict[str, Any]) -> None:
        """After the forward, also when it raised: undo what ``pre`` left active."""
        return None


class _GradSumHooks(OpHooks):
    def swap(self, mod: nn.Module, saved: dict[str, Any]) -> None:
        for name in self.op.params:
            if "." in name:  # a descendant's, read by this module's code: its scoped swap sums it
                continue
            saved.setdefault(name, mod._parameters[name])
            mod._parameters[name] = comm.all_reduce_grad(mod._parameters[name], self.group)


class _EnterHooks(OpHooks):
    """Activations enter the TP region; parameters seen through views (DBRX's experts)
    do not. Which arguments are which is found by walking autograd nodes in eager calls
    and remembered per argument position: a compiled block (``parallelize(compile=...)``
    runs each block's first call eagerly) reads the memo, it cannot walk the nodes."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.views: dict[int, bool] = {}  # argument position (flattened) -> a parameter view?

    def pre(self, args: tuple, kwargs: dict, state: dict[str, Any]) -> tuple[tuple, dict]:
        copy_in, views, compiling = self.backend.copy_in, self.views, torch.compiler.is_compiling()
        flat, spec = tree_flatten((args, kwargs))
        out = []
        for i, t in enumerate(flat):
            if isinstance(t, torch.Tensor):
                if not compiling:
                    views[i] = _parameter_view(t)
                # no memo (a user's own torch.compile, no probe): walk the nodes all the
                # same, a graph break rather than a guess
                t = copy_in(t, views.get(i))
            out.append(t)
        return tree_unflatten(out, spec)


class _VocabHooks(OpHooks):
    def pre(self, args: tuple, kwargs: dict, state: dict[str, Any]) -> tuple[tuple, dict]:
        start, end = self.vocab_range
        ids = args[0] if args else kwargs["input"]
        check_ids(ids, self.op.vocab_size, self.fqn)
        mask = (ids < start) | (ids >= end)
        local_ids = (ids - start).masked_fill(mask, 0)
        state["mask"] = mask
        if args:
            return (local_ids, *args[1:]), kwargs
        return args, {**kwargs, "input": local_ids}

    def post(self, mod: nn.Module, out: Any, state: dict[str, Any]) -> Any:
        out = out.masked_fill(state.pop("mask").unsqueeze(-1), 0)
        return comm.reduce_from_tp(out, self.group)


def check_ids(ids: torch.Tensor, vocab: int | None, fqn: str) -> None:
    """Refuse ids outside ``[0, vocab)``, as the unsplit embedding does: split over the
    vocabulary, every rank would mask such an id and the model would run on a zero vector.
    The ids a TP group sees are the same on every rank, so no collective is needed; on
    CUDA the check is asynchronous (no host sync in the step)."""
    if vocab is None or ids.numel() == 0:
        return
    bad = (ids < 0) | (ids >= vocab)
    if ids.is_cuda:
        torch._assert_async(~bad.any(), f"{fqn}: a token id is outside the vocabulary [0, {vocab})")
        return
    if bool(bad.any()):
        where = tuple(int(i) for i in bad.nonzero()[0])
        raise TPError(f"{fqn or 'the embedding'}: token id {int(ids[where])} at position {list(where)} is outside "
                      f"the vocabulary [0, {vocab}) (the unsplit model raises IndexError here). A tokenizer with "
                      "added tokens needs model.resize_token_embeddings(len(tokenizer)) before tpcompile")


class _ReduceHooks(OpHooks):
    def swap(self, mod: nn.Module, saved: dict[str, Any]) -> None:
        for name in self.op.row_biases:
            saved.setdefault(name, mod._parameters[name])
            # the bias is added once, after the all-reduce (post)
            mod._parameters[name] = torch.zeros_like(_local(mod._parameters[name]))
        for name in self.op.addends:
            saved.setdefault(name, mod._parameters[name])
            # added to the partial sum inside the forward: once, by the first rank
            mod._parameters[name] = comm.on_first_rank(_local(mod._parameters[name]), self.group)

    def post(self, mod: nn.Module, out: Any, state: dict[str, Any]) -> Any:
        leave = getattr(mod, "_tpcompile_leave", None)
        split = []

        def reduce(t: torch.Tensor) -> torch.Tensor:
            if not t.is_floating_point():
                return t
            if self.op.reenter:  # whole after the sum (no token split): re-entered below
                return comm.reduce_from_tp(t, self.group)
            left = leave(t) if leave is not None else None
            split.append(left is not None)
            return left if left is not None else comm.reduce_from_tp(t, self.group)
        out = _map_tensors(out, reduce)
        saved = state.get("saved", {})
        for name in self.op.row_biases:
            bias = _local(saved[name])
            # added to this rank's tokens only: its gradient sums the group's
            out = out + (comm.all_reduce_grad(bias, self.group) if any(split) else bias)
        if self.op.reenter:  # split code reads the sum (and bias): its gradient is summed here
            out = _map_tensors(out, lambda t: comm.copy_to_tp(t, self.group) if t.is_floating_point() else t)
        return out


class _SplitStatHooks(OpHooks):
    """The module's forward runs under a mode that computes its statistics over the
    split features from partial sums (entered in ``pre``, left in ``post``)."""

    def pre(self, args: tuple, kwargs: dict, state: dict[str, Any]) -> tuple[tuple, dict]:
        mode = SplitStatMode(self.op, self.group, self.fqn)
        mode.__enter__()
        state["stat_mode"] = mode
        return args, kwargs

    def post(self, mod: nn.Module, out: Any, state: dict[str, Any]) -> Any:
        mode = state.pop("stat_mode")
        mode.__exit__(None, None, None)
        mode.check()
        return out

    def cleanup(self, state: dict[str, Any]) -> None:
        mode = state.pop("stat_mode", None)
        if mode is not None:  # the forward raised: leave the mode all the same
            mode.__exit__(None, None, None)


class _WholeMaskHooks(OpHooks):
    """A training forward draws its dropout masks over split features whole and keeps
    this rank's rows (:mod:`tpcompile.runtime.masks`; entered in ``pre``, left in
    ``post``).  Not in eval or where every probability is zero (no mask is drawn), nor
    inside a compiled block, whose tracer takes no dispatch mode, nor in a block
    transformers' gradient checkpointing recomputes: there each rank draws its own rows'
    mask."""

    whole = False  # this call draws its masks whole

    def swap(self, mod: nn.Module, saved: dict[str, Any]) -> None:
        # a module whose ``forward`` transformers' gradient checkpointing recomputes
        # without its hooks (a block) keeps its own rows' masks: the recomputation must
        # draw what the forward drew
        # (nothing is read inside a compiled block: each read module would be a guard, and
        # one graph could no longer serve every block)
        if not torch.compiler.is_compiling():
            self.whole = mod.training and may_drop(mod) and not getattr(mod, "gradient_checkpointing", False)

    def pre(self, args: tuple, kwargs: dict, state: dict[str, Any]) -> tuple[tuple, dict]:
        if not torch.compiler.is_compiling() and self.whole:
            mode = WholeMaskMode(self.op, self.backend.rank)
            mode.__enter__()
            state["mask_mode"] = mode
        return args, kwargs

    def post(self, mod: nn.Module, out: Any, state: dict[str, Any]) -> Any:
        self.cleanup(state)
        return out

    def cleanup(self, state: dict[str, Any]) -> None:
        mode = state.pop("mask_mode", None)
        if mode is not None:
            mode.__exit__(None, None, None)


class _SliceInputHooks(OpHooks):
    """Replicated arguments without gradient narrowed to this rank's rows (no collective)."""

    def pre(self, args: tuple, kwargs: dict, state: dict[str, Any]) -> tuple[tuple, dict]:
        return self.op.apply(args, kwargs, self.backend.rank, self.fqn)


class _SliceBufferHooks(OpHooks):
    """Buffers applied to split features narrowed to this rank's rows for the call; the
    whole buffer goes back after it (``saved``, keyed by ``(submodule, leaf)``).  A
    forward that updates its rows in place (BatchNorm's running statistics in training)
    has them written back: every rank's rows are all-gathered into the whole buffer, so
    each rank holds the same, complete statistics (``state_dict``, eval, checkpoints)."""

    def __init__(self, *a: Any) -> None:
        super().__init__(*a)
        self.live: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # this call's updated buffers

    def swap(self, mod: nn.Module, saved: dict[Any, Any]) -> None:
        self.live = []
        for i, (path, *_) in enumerate(self.op.slices):
            owner, _, leaf = path.rpartition(".")
            sub = mod.get_submodule(owner) if owner else mod
            whole = saved.setdefault((sub, leaf), sub._buffers[leaf])
            sub._buffers[leaf] = local = self.op.local(whole, i, self.backend.rank, self.fqn)
            # the update of running statistics bumps no version counter: the plan names them,
            # and training mode (the same on every rank) says whether this call updates them
            if path in self.op.updated and sub.training:
                self.live.append((i, whole, local))

    def post(self, mod: nn.Module, out: Any, state: dict[str, Any]) -> Any:
        for i, whole, local in self.live:
            self._write_back(i, whole, local)
        self.live = []
        return out

    def _write_back(self, i: int, whole: torch.Tensor, local: torch.Tensor) -> None:
        dim = self.op.slices[i][1]
        rows = torch.as_tensor(np.concatenate(self.op._rows[i]))  # every rank's rows, in gather order
        keep = rows >= 0  # padding rows hold nothing
        with torch.no_grad():
            gathered = comm.gather_from_tp(local.detach(), self.group, dim=dim)
            whole.index_copy_(dim, rows[keep].to(whole.device),
                              gathered.index_select(dim, torch.nonzero(keep).flatten().to(gathered.device)))


class _GatherHooks(OpHooks):
    def post(self, mod: nn.Module, out: Any, state: dict[str, Any]) -> Any:
        vocab = self.op.vocab_size

        def gather(t: torch.Tensor) -> torch.Tensor:
            full = comm.gather_from_tp(t, self.group, dim=-1)
            full = full[..., :vocab] if vocab else full
            self.backend._gathered = (full, t)  # lets the model's loss use the local shard
            return full
        return _map_tensors(out, gather)


# op type -> its handler; a new collective kind is one ModuleOp subclass plus one entry
HANDLERS: dict[type, type[OpHooks]] = {
    GradSum: _GradSumHooks, EnterRegion: _EnterHooks, VocabEmbedding: _VocabHooks,
    ReduceOutput: _ReduceHooks, GatherOutput: _GatherHooks, SplitStats: _SplitStatHooks,
    SliceInputs: _SliceInputHooks, SliceBuffers: _SliceBufferHooks, WholeMasks: _WholeMaskHooks,
}


def handler_for(op: Any) -> type[OpHooks]:
    """The handler of ``op``'s type, looked up along its class hierarchy."""
    for cls in type(op).__mro__:
        if cls in HANDLERS:
            return HANDLERS[cls]
    raise TypeError(f"the torch backend has no handler for module op {type(op).__name__}; "
                    f"registered: {sorted(c.__name__ for c in HANDLERS)}")


# autograd nodes of views: a tensor reached only through them is its base, seen differently
_VIEWS = ("ViewBackward", "UnsafeViewBackward", "SelectBackward", "SliceBackward", "TransposeBackward",
          "PermuteBackward", "TBackward", "UnsqueezeBackward", "SqueezeBackward", "AliasBackward",
          "ExpandBackward", "AsStridedBackward", "_ToTorchTensorBackward")


def _parameter_view(t: torch.Tensor) -> bool:
    """Is ``t`` a parameter (its local shard) seen through views?  DBRX's experts hand
    ``w1.view(E, F, H)[e]`` to the module that runs them: a column module's argument
    that is not an activation entering the TP region.  Its gradient is this rank's own
    features' (a split parameter) or summed by the parameter's own gradient sum (a
    replicated one), never all-reduced at the module's entry."""
    if isinstance(t, nn.Parameter):
        return True
    fn = t.grad_fn
    for _ in range(32):
        if fn is None:
            return False
        name = type(fn).__name__
        if name == "AccumulateGrad":
            return isinstance(fn.variable, nn.Parameter)
        if not name.rstrip("0123456789").endswith(_VIEWS):
            return False
        inputs = [f for f, _ in fn.next_functions if f is not None]
        if len(inputs) != 1:
            return False
        fn = inputs[0]
    return False


def _local(p: torch.Tensor) -> torch.Tensor:
    """This rank's tensor behind a (possibly DTensor) parameter; differentiable."""
    return p.to_local() if isinstance(p, DTensor) else p


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        stride[i] = stride[i + 1] * shape[i + 1]
    return tuple(stride)
