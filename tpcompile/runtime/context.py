"""Context parallelism: each sequence split over the ranks of a CP group, exact.

Every rank of a CP group is handed the same full batch (as with TP); the model splits
the sequence itself, around its own forward:

* **Split** (root pre-hook): the length is padded to a multiple of ``2·cp`` with masked
  positions, cut into ``2·cp`` chunks, and rank ``r`` keeps chunks ``r`` and
  ``2·cp-1-r`` (mirrored: under a causal mask every rank has the same work).  The ids, the
  *global* ``position_ids`` (rotary and absolute position embeddings see true positions)
  and the labels, shifted globally first (``shift_labels``: a chunk's last token is
  trained on the next chunk's first), are cut the same way; the loss is normalised by the
  whole batch's label count (``num_items_in_batch``).
* **Attention** across the split: the model's attention modules call transformers'
  attention interface, which is pointed at :func:`cp_attention`.  It all-gathers the
  keys and values over the CP group (before ``repeat_kv``: only the KV heads move;
  backward reduce-scatters their gradients) and attends the local queries to every key
  with the mask rebuilt from global positions: causal, the layer's sliding window, the
  padding ``attention_mask``, packed sequences (as transformers reads them: without an
  ``attention_mask`` or cache, a new document wherever the positions do not go up by one);
  softcapping and attention sinks as the layer passes them.  Causal attention over plain
  positions (no padding, no packed documents, no softcap, sinks or dropout) never builds
  that ``[s_local, S]`` mask: it runs as flash blocks merged by log-sum-exp
  (:mod:`tpcompile.runtime.context_attention`), so the saved bytes stay ``O(s_local)``
  beyond the gathered keys.
* **Loss** (root post-hook): the local sums, each over this rank's tokens divided by the
  global count, are all-reduced into the loss of the whole sequence.  Its backward scales
  by ``cp``: FSDP2 averages gradients over ``dp_shard x cp`` and each rank holds the
  gradient of its own tokens only, so the average of ``cp·g_r`` is their sum.

The logits stay split by sequence, in the mirrored chunk order; :func:`gather_sequence`
puts them (or any per-position output) back in order.  Which other ops may run on a slice
of the sequence is checked at parallelize time (:mod:`tpcompile.plan.context`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..errors import TPError
from ..plan.context import attention_configs
from . import comm
from .context_attention import block_attention, block_layout, eager_attention
from .markers import GuardWindow, differing_ranks

__all__ = ["ContextParallel", "cp_attention", "gather_sequence", "install_context_parallel"]

ATTENTION_KEY = "tpcompile_cp"  # the name under transformers' attention interface
_ACTIVE: list[ContextParallel | None] = [None]  # the model whose forward (or recompute) runs


class ContextParallel:
    """One model's CP group and the positions of its last forward."""

    def __init__(self, group: Any, size: int, rank: int, implementation: str) -> None:
        self.group, self.size, self.rank = group, size, rank
        # the model's own attention ("eager" / "sdpa"...): whose semantics a query with no
        # key to attend to follows
        self.implementation = implementation
        self.use_cache = True  # the model config's default (packed sequences need it off)
        self.q_pos: torch.Tensor | None = None  # [b, s_local] global positions of local queries
        self.k_pos: torch.Tensor | None = None  # [b, S] positions of the gathered keys
        self.k_valid: torch.Tensor | None = None  # [b, S] keys that are not padding
        self.k_real: torch.Tensor | None = None  # [S] keys inside the caller's length
        # packed sequences (position ids restarting at 0): which document each position is in
        self.q_doc: torch.Tensor | None = None
        self.k_doc: torch.Tensor | None = None
        self.order: torch.Tensor | None = None  # gathered index -> global position index
        self.inverse: torch.Tensor | None = None  # global position index -> gathered index
        self.length = 0  # the caller's sequence length (before padding)
        self.padded = 0  # the length split (a multiple of 2·cp)
        # plain positions (0, 1, ...), no padding or packed documents: causal attention
        # runs as blocks, without the [s_local, S] mask
        self.plain = False
        self.paths: Counter[str] = Counter()  # eager attention calls per core ("blocks" / "mask")
        self.window = GuardWindow()  # forwards whose batch is compared over the group

    def index(self, length: int, rank: int, device: torch.device) -> torch.Tensor:
        """The positions rank ``rank`` holds of a padded length: chunks r and 2cp-1-r."""
        chunk = length // (2 * self.size)
        first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
        last = torch.arange((2 * self.size - 1 - rank) * chunk, (2 * self.size - rank) * chunk, device=device)
        return torch.cat([first, last])

    def split(self, args: tuple, kwargs: dict, training: bool | None) -> tuple[tuple, dict]:
        """The local slice of one call's inputs (every rank holds the same full batch);
        ``training``: the model's mode, whose first forwards compare the batch over the
        group (``None``: a probe that checks nothing)."""
        kwargs = dict(kwargs)
        if args:
            kwargs.setdefault("input_ids", args[0])
            args = args[1:]
            if args:
                raise TPError("context parallelism: pass the model's inputs as keywords beyond input_ids")
        ids = kwargs.get("input_ids")
        if ids is None:
            raise TPError("context parallelism needs input_ids (inputs_embeds alone is not split)")
        if kwargs.get("past_key_values") is not None or kwargs.get("use_cache"):
            raise TPError("context parallelism splits whole sequences: a KV cache (generate's decode steps) is "
                          "not supported on a CP model; generate on the model saved and loaded without cp")
        if kwargs.get("output_router_logits"):
            raise TPError("context parallelism: output_router_logits=True asks for a load-balancing loss over the "
                          "whole sequence, but each rank routes only its positions; call without it")
        if training is not None:
            self._same_batch(ids, kwargs.get("labels"), training)
        b, length = ids.shape
        padded = -(-length // (2 * self.size)) * (2 * self.size)
        pad = padded - length
        mask = kwargs.pop("attention_mask", None)
        valid = torch.ones(b, length, dtype=torch.bool, device=ids.device) if mask is None else mask.bool()
        pos = kwargs.pop("position_ids", None)
        if pos is None:
            pos = torch.arange(length, device=ids.device).expand(b, length)
        labels = kwargs.pop("labels", None)
        shift = kwargs.pop("shift_labels", None)
        if labels is not None and shift is None:  # the global shift, before the split
            shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
        if pad:
            ids = F.pad(ids, (0, pad))
            valid = F.pad(valid, (0, pad), value=False)
            pos = torch.cat([pos, pos[:, -1:] + torch.arange(1, pad + 1, device=pos.device)], dim=1)
            if shift is not None:
                shift = F.pad(shift, (0, pad), value=-100)
        mine = self.index(padded, self.rank, ids.device)
        order = torch.cat([self.index(padded, r, ids.device) for r in range(self.size)])
        self.q_pos, self.k_pos = pos[:, mine], pos[:, order]
        self.k_valid, self.order, self.length, self.padded = valid[:, order], order, length, padded
        self.inverse = torch.empty_like(order)
        self.inverse[order] = torch.arange(order.numel(), device=order.device)
        self.k_real = order < length
        # packed sequences, as transformers reads them (no attention_mask, no cache): a new
        # document wherever the positions do not go up by one
        use_cache = kwargs.get("use_cache")
        packed = mask is None and not (self.use_cache if use_cache is None else use_cache)
        doc = torch.diff(pos, prepend=pos[:, :1] - 1, dim=1).ne(1).cumsum(1) if packed else torch.zeros_like(pos)
        self.q_doc, self.k_doc = doc[:, mine], doc[:, order]
        # positions 0, 1, ... never restart: one document, packed or not
        self.plain = bool(valid[:, :length].all()) and torch.equal(
            pos, torch.arange(padded, device=pos.device).expand_as(pos))
        kwargs["input_ids"] = ids[:, mine]
        kwargs["position_ids"] = self.q_pos
        if shift is not None:
            if kwargs.get("num_items_in_batch") is None:
                kwargs["num_items_in_batch"] = (shift != -100).sum()
            kwargs["shift_labels"] = kwargs["labels"] = shift[:, mine]
        _ACTIVE[0] = self
        return args, kwargs

    def _same_batch(self, ids: torch.Tensor, labels: torch.Tensor | None, training: bool) -> None:
        """Every rank of the group must hold the same sequences (a loader that shards by
        process would train a silently wrong model, an evaluation loop would report a wrong
        loss): compared in the first forwards after every switch between training and eval
        mode, one small all-gather each."""
        if not self.window.due(training):
            return
        if differing_ranks([t for t in (ids, labels) if t is not None], self.group):
            raise TPError("the ranks of a context-parallel group received different batches: every rank of a CP "
                          "group must be handed the same whole sequences (the model splits them itself); load "
                          "the slice tpcompile.data_parallel_rank(model) names")

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, h_kv, s_local, d]`` keys or values of every rank of the group, ``[b, h_kv,
        S, d]`` in gathered order (all-gather forward, reduce-scatter of the gradient)."""
        return comm.enter_tp(t, self.group, 2)

    def allowed(self, causal: bool, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``[b, 1, s_local, S]``: which gathered keys each local query attends to, and
        ``[b, 1, s_local, 1]``: the queries no key is allowed for (a left-padded row's pads)."""
        q, k = self.q_pos[:, :, None], self.k_pos[:, None, :]
        ok = self.k_valid[:, None, :].expand(-1, q.shape[1], -1)
        if causal:
            ok = ok & (k <= q) & (self.k_doc[:, None, :] == self.q_doc[:, :, None])
        if window:
            ok = ok & (q - k < window)
        return ok[:, None], ~ok.any(dim=-1, keepdim=True)[:, None]


class _ScaledSum(torch.autograd.Function):
    """All-reduce(sum) forward; backward ``cp · dy`` (FSDP2 then averages over cp)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scale: float) -> torch.Tensor:
        ctx.scale = scale
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad * ctx.scale, None, None


def _count(cp: Any, path: str) -> None:
    # eager calls only: a compiled graph would guard on the count and recompile per block
    if not torch.compiler.is_compiling():
        cp.paths[path] += 1


def cp_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None,
                 s_aux: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface signature: local queries ``[b, h, s, d]``
    against the keys and values of the whole CP group.  The mask the model built for
    its local slice is not used: it is rebuilt from global positions."""
    cp = _ACTIVE[0]
    if cp is None:
        raise TPError("a context-parallel attention ran outside its model's forward")
    key, value = cp.gather(key), cp.gather(value)
    causal = bool(getattr(module, "is_causal", True))
    p = dropout if module.training else 0.0
    if cp.plain and causal and softcap is None and s_aux is None and p == 0.0 and query.device.type == "cpu":
        # no row without keys here, so eager's and sdpa's semantics agree
        _count(cp, "blocks")
        blocks = block_layout(cp.rank, cp.size, cp.padded, sliding_window, query.dtype, query.device)
        key, value = key.index_select(2, cp.inverse), value.index_select(2, cp.inverse)  # global order
        return block_attention(query, key, value, blocks, scaling).transpose(1, 2).contiguous(), None
    _count(cp, "mask")
    allowed, empty = cp.allowed(causal, sliding_window)
    if cp.implementation == "sdpa" and softcap is None and s_aux is None:
        # a row without keys is left to torch's sdpa, as transformers' sdpa path leaves it
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=p, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
    else:
        outside = empty & ~cp.k_real.view(1, 1, 1, -1)  # CP's padding keys, for rows without keys
        out = eager_attention(query, key, value, allowed, outside, p, scaling, softcap, s_aux)
    return out.transpose(1, 2).contiguous(), None


def gather_sequence(model: nn.Module, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """A per-position output of a CP model's last forward (its ``logits``), whole and in
    order (the caller's length, padding removed).  Collective over the CP group.

    Example:
        >>> out = model(input_ids=ids, labels=ids)                  # doctest: +SKIP
        >>> logits = tpcompile.runtime.gather_sequence(model, out.logits)
    """
    cp = getattr(model, "tpcompile_context", None)
    if cp is None or cp.order is None:
        return t
    parts = [torch.empty_like(t.contiguous()) for _ in range(cp.size)]
    dist.all_gather(parts, t.contiguous(), group=cp.group)
    gathered = torch.cat(parts, dim=dim)
    return gathered.index_select(dim, cp.inverse[: cp.length])


def install_context_parallel(model: nn.Module, cp_mesh: Any) -> ContextParallel:
    """Split every forward of ``model`` over ``cp_mesh`` (a 1-D mesh), in place."""
    register_attention(ATTENTION_KEY, cp_attention)
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None) or "sdpa"
    for config in attention_configs(model):
        config._attn_implementation_internal = ATTENTION_KEY
    cp = ContextParallel(cp_mesh.get_group(), cp_mesh.size(), cp_mesh.get_local_rank(), implementation)

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return cp.split(args, kwargs, bool(mod.training))

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        loss = getattr(out, "loss", None)
        if loss is not None:
            out.loss = _ScaledSum.apply(loss, cp.group, float(cp.size))
        return out

    model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    model.register_forward_hook(post, with_kwargs=True)
    run = getattr(model, "tpcompile_pipeline", None)
    if run is not None:  # a pipeline's boundary carries this rank's slice of the sequence
        run.localize.append(lambda mb: _local_view(cp, mb))
    cp.use_cache = bool(getattr(getattr(model, "config", None), "use_cache", True))
    model.tpcompile_context = cp
    return cp


def _local_view(cp: ContextParallel, microbatch: dict[str, Any]) -> dict[str, Any]:
    """``microbatch`` as this rank's model sees it after the split (shapes for the
    pipeline's stage metadata; no collective: the batch is checked in the model's forwards)."""
    with torch.no_grad():
        return cp.split((), microbatch, None)[1]


def register_attention(key: str, fn: Any) -> None:
    """``fn`` under ``key`` in transformers' attention interface, with no mask built for
    it (the CP attention rebuilds its own from global positions)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(key, fn)
    AttentionMaskInterface.register(key, _no_mask)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The mask transformers would build for the local slice: none (rebuilt globally)."""
    return None
