"""The collectives a module's tensor-parallel hooks issue: one description, two readers.

:func:`module_collectives` turns a :class:`~tpcompile.plan.ModulePlan` into the list of
:class:`Collective` records the torch backend's hooks are built from
(``TorchBackend.install`` reads this list to decide which hooks to install), and the
cost model (:mod:`tpcompile.tools.cost`) prices the same list per training step. A new
collective therefore shows up in ``dump-plan`` by construction.

Each record names the hook site and the tensor it communicates; the cost model binds
that tensor to the captured graph to get its size per token:

==================  ========  ==========  ================================================
hook                phase     op          tensor each rank passes in
==================  ========  ==========  ================================================
``ENTER``           backward  all_reduce  gradient of each floating input that requires
                                          grad (``copy_to_tp``; column modules reading
                                          the same input share one)
``EMBED_REDUCE``    forward   all_reduce  the masked embedding output
``EXIT_REDUCE``     forward   all_reduce  each floating output (row-parallel partial sum)
``EXIT_GATHER``     forward   all_gather  the vocab-sharded logits (local shard)
``GRAD_SUM``        backward  all_reduce  the replicated parameter's gradient
``REPLICA_SUM``     backward  all_reduce  the KV-replica parameter's gradient over its
                                          global rows
==================  ========  ==========  ================================================
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from ..plan.types import ModulePlan

__all__ = ["Collective", "Hook", "module_collectives"]


class Hook(str, enum.Enum):
    """Where around a module's forward a collective is hooked."""

    ENTER = "enter"  # copy_to_tp on the inputs: identity forward, all-reduce of grads
    EMBED_REDUCE = "embed_reduce"  # masked vocab-parallel lookup, then reduce_from_tp
    EXIT_REDUCE = "exit_reduce"  # reduce_from_tp of the partial-sum output
    EXIT_GATHER = "exit_gather"  # gather_from_tp of the vocab-sharded logits
    GRAD_SUM = "grad_sum"  # all_reduce_grad of a replicated parameter on sharded features
    REPLICA_SUM = "replica_sum"  # _ReplicaGradSum of a KV-replicated parameter


_PHASE_OP = {
    Hook.ENTER: ("backward", "all_reduce"),
    Hook.EMBED_REDUCE: ("forward", "all_reduce"),
    Hook.EXIT_REDUCE: ("forward", "all_reduce"),
    Hook.EXIT_GATHER: ("forward", "all_gather"),
    Hook.GRAD_SUM: ("backward", "all_reduce"),
    Hook.REPLICA_SUM: ("backward", "all_reduce"),
}


@dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective a module's hooks issue per call of the module (``tp > 1``).

    ``op`` is the ``torch.distributed`` function called over the TP group; ``param`` the
    module-local parameter name for the gradient sums.
    """

    hook: Hook
    param: str | None = None

    @property
    def phase(self) -> str:
        return _PHASE_OP[self.hook][0]

    @property
    def op(self) -> str:
        return _PHASE_OP[self.hook][1]


def module_collectives(mplan: ModulePlan, replicas: Iterable[str] = ()) -> list[Collective]:
    """The collectives one call of ``mplan.fqn`` issues, in hook order.

    ``replicas`` are the module-local names of parameters whose rows several ranks hold
    (``layout == "kv_replicated"``).

    Example:
        >>> mp = ModulePlan(fqn="model.layers.0.self_attn.o_proj", reduce_output=True)
        >>> [(c.phase, c.op) for c in module_collectives(mp)]
        [('forward', 'all_reduce')]
    """
    out = [Collective(hook=Hook.REPLICA_SUM, param=n) for n in sorted(set(replicas))]
    out += [Collective(hook=Hook.GRAD_SUM, param=n) for n in mplan.grad_allreduce]
    if mplan.copy_inputs:
        out.append(Collective(hook=Hook.ENTER))
    if mplan.vocab_parallel:
        out.append(Collective(hook=Hook.EMBED_REDUCE))
    elif mplan.reduce_output:  # the embedding's hook returns after its own reduce
        out.append(Collective(hook=Hook.EXIT_REDUCE))
    if mplan.gather_output and not mplan.vocab_parallel:
        out.append(Collective(hook=Hook.EXIT_GATHER))
    return out
