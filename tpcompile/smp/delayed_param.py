"""``torch.sagemaker.delayed_param``: initialize meta tensors when FSDP1 asks for them.

``DelayedParamIniter(model).get_param_init_fn()`` is FSDP1's ``param_init_fn``: FSDP1
calls it on each module whose tensors are still on the meta device, before it flattens
and shards them, so no rank ever holds more than the module in hand. The values come from
the model's own init code, one tensor at a time, seeded by ``(random_seed, tensor name)``
exactly as :func:`tpcompile.parallelize`'s delayed init (so every TP rank computes the
same full tensor and keeps its own rows). Tensors that already hold data — everything
after ``transform(..., load_state_dict_from_rank0=True)``, and real buffers — are left
alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from ..errors import TPError
from .core import DEFAULT_SEED, state

__all__ = ["DelayedParamIniter"]


class DelayedParamIniter:
    """Fills the meta tensors of ``model`` (a ``tsm.transform``-ed model or a plain one).

    Example:
        >>> initer = DelayedParamIniter(model)                        # doctest: +SKIP
        >>> with initer.validate_params_and_buffers_inited():
        ...     model = FSDP(model, param_init_fn=initer.get_param_init_fn(), ...)
    """

    def __init__(self, model: nn.Module, init_method_using_config: Callable | None = None,
                 verbose: bool = False) -> None:
        from ..config import ParallelConfig
        from ..runtime.materialize import Materializer, meta_tree, records

        if init_method_using_config is not None:
            raise TPError("init_method_using_config is not supported: tpcompile runs the model's own "
                          "_init_weights / reset_parameters for every tensor")
        self.model, self.verbose = model, verbose
        saved = getattr(model, "_tpcompile_smp_delayed", None)
        records, tree = saved if saved is not None else (
            records(model, lambda t, is_param: not is_param), meta_tree(model))
        self.records = {r.fqn: r for r in records}
        for r in records:
            for alias in r.aliases:
                self.records[alias] = r
        seed = state.cfg.seed if state.cfg is not None and state.cfg.seed is not None else DEFAULT_SEED
        self._materializer = Materializer(records, tree, ParallelConfig(seed=seed))
        self.seed = seed
        # module object -> its name, taken now: FSDP1 renames the path when it wraps blocks
        self._names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
        self._done: dict[str, torch.Tensor] = {}

    def _value(self, fqn: str, device: torch.device) -> torch.Tensor:
        rec = self.records.get(fqn)
        if rec is None:
            raise TPError(f"DelayedParamIniter: {fqn!r} was not part of the model it was created for")
        if rec.fqn in self._done:  # a tied alias: the very same tensor
            return self._done[rec.fqn]
        full = rec.value if rec.value is not None else self._materializer.initial_value(rec, self.seed)
        table = getattr(self.model, "tpcompile_table", None)
        tmap = table.tensors.get(rec.fqn) if table is not None else None
        local = tmap.to_local(full, state.tp_rank) if tmap is not None and tmap.sharded else full
        self._done[rec.fqn] = local.to(device)
        return self._done[rec.fqn]

    def get_param_init_fn(self) -> Callable[[nn.Module], None]:
        """FSDP1's ``param_init_fn``: materialize ``module``'s own meta tensors."""
        def init(module: nn.Module) -> None:
            prefix = self._names.get(id(module))
            if prefix is None:
                raise TPError(f"DelayedParamIniter: a {type(module).__name__} that is not part of the model")
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
                else torch.device("cpu")
            for store, is_param in ((module._parameters, True), (module._buffers, False)):
                for attr, t in list(store.items()):
                    if t is None or not t.is_meta:
                        continue
                    fqn = f"{prefix}.{attr}" if prefix else attr
                    with torch.no_grad():
                        value = self._value(fqn, device)
                    if list(value.shape) != list(t.shape):
                        raise TPError(f"{fqn}: initialized shard {list(value.shape)} does not fit "
                                      f"{list(t.shape)}")
                    store[attr] = nn.Parameter(value, requires_grad=t.requires_grad) if is_param else value
        return init

    def get_post_param_init_fn(self) -> Callable[[nn.Module], None]:
        """FSDP1's ``post_param_init_fn`` (tied weights): tied names already share one tensor."""
        def post(module: nn.Module) -> None:
            return None
        return post

    def count_num_params(self, module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    @contextlib.contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True) -> Iterator[None]:
        """Raise on exit if any parameter or buffer of the model is still on meta."""
        yield
        if not enabled:
            return
        left = [n for n, t in [*self.model.named_parameters(), *self.model.named_buffers()] if t.is_meta]
        if left:
            raise TPError(f"{len(left)} tensors are still on the meta device after FSDP, e.g. {left[:3]}: "
                          "pass param_init_fn=DelayedParamIniter(model).get_param_init_fn() to FSDP")
