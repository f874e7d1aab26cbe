"""What an embedding module computes after its own lookup.

A vocab-parallel table is looked up masked on every rank and the partial rows are summed
where the *module* returns (:class:`~tpcompile.plan.modules.VocabEmbedding`'s hooks wrap
the module's call): the runtime cannot reach into the forward to sum right after
``F.embedding``.  Most embeddings return the lookup itself, but a subclass may go on
(Inkling's ``InklingNormedEmbedding``: ``embed_norm(super().forward(ids))``, Gemma's
scaled embedding: ``super().forward(ids) * scale``).  What runs there, the *tail*, sees
each rank's masked rows: the row of an id held elsewhere is row 0 of the local shard, and
the hooks zero those rows after the forward.  So:

* the forward is exact exactly when every output row depends on its own input row (a
  norm, a scale, a projection of each token); the tail is checked with the token rules
  sequence parallelism uses (:mod:`.tokens`), and a tail that mixes tokens keeps the table
  whole (:func:`tail_mixes`);
* a parameter the tail reads (the norm's weight) gets, on each rank, the gradient of the
  tokens whose ids that rank holds: a partial gradient, summed over the ranks
  (:func:`tail_params`).  Left alone it was silently wrong, as every other replicated
  parameter on partial values would be.
"""

from __future__ import annotations

import torch.fx as fx

from .propagate import Analysis, module_path, params_feeding
from .state import EmbeddingUse
from .tokens import Mixes, Tokens, propagate_tokens

__all__ = ["tail_mixes", "tail_params"]


def _tail(use: EmbeddingUse) -> list[fx.Node]:
    """The nodes inside ``use.module`` computed from the lookup, in graph order."""
    if not use.module:
        return []
    seen: set[fx.Node] = set()
    todo = list(use.node.users)
    while todo:
        n = todo.pop()
        if n in seen or use.module not in module_path(n):
            continue
        seen.add(n)
        todo.extend(n.users)
    order = {n: i for i, n in enumerate(use.node.graph.nodes)}
    return sorted(seen, key=order.__getitem__)


def tail_mixes(an: Analysis, use: EmbeddingUse) -> str | None:
    """Why the tail of ``use`` mixes tokens (its op named), or ``None`` when each output
    row is computed from its own row alone."""
    tail = _tail(use)
    if not tail:
        return None
    ndim = an.ndim(use.node)
    tags: dict[fx.Node, Tokens] = {use.node: Tokens(dim=max(ndim - 2, 0))}
    for node in tail:
        try:
            tag = propagate_tokens(node, tags, an.rules)
        except Mixes as why:
            return f"{node.target} after the lookup mixes tokens ({why})"
        if tag is not None:
            tags[node] = tag
    return None


def tail_params(an: Analysis, use: EmbeddingUse) -> set[str]:
    """The parameters (the table aside) the tail of ``use`` reads, through values not
    computed from the lookup (``1 + weight.float()`` as much as ``weight``)."""
    tail = _tail(use)
    return params_feeding(tail, {use.node, *tail}, an._params) - {use.fqn}
