"""Plans kept on disk: one capture per model and arguments, shared by ranks and restarts.

Planning traces the model with ``torch.export`` several times (the capture, then one
trace per hard-coded size that may have to become rank-local): a second or two for a
tiny model, several seconds for a 405B one on the meta device, on every rank.  Every
rank of a job plans the same model with the same arguments to the same plan, so with
``TPCOMPILE_PLAN_CACHE=<dir>`` the first rank to plan writes ``<dir>/<key>.json`` (under
a file lock, atomically) and the other ranks of the host, the next restart and the next
job read it instead of tracing.

The key is everything a plan is computed from:

- the versions of torch, transformers and Python, and a hash of tpcompile's own source
  (an edited rule invalidates every entry);
- the model: its classes and a hash of the source files that define them (the forward
  code), each module's plain attributes (sizes, flags, ``training``), every
  parameter's and buffer's name, shape, dtype and device type, which names share a
  tensor, small buffers' values, and the config (every attribute, private ones such as
  the attention implementation included);
- the arguments: ``tp``, ``ep``, ``loss_parallel``, ``sequence_parallel``,
  ``overrides``, ``strict`` and the example inputs (shapes, dtypes and values).

Parameter values do not enter a plan (the capture reads shapes; data-dependent
branches are traced over every index).  Nothing is cached when the key cannot be
complete: extra ``rules`` (code), forward hooks, a ``forward`` replaced on an instance,
a class without a source file; nor a plan whose planning warned (the warning must be
seen again).  A process that patches library functions the forward calls (not the
model's own classes) must not set the variable.

Example::

    TPCOMPILE_PLAN_CACHE=/local/plans torchrun --nproc-per-node 8 train.py
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import inspect
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import TPError
from .types import Plan

__all__ = ["ENV", "cached_plan", "plan_key"]

ENV = "TPCOMPILE_PLAN_CACHE"
_SMALL_BUFFER = 1 << 16  # elements: buffers up to this size enter the key by value
_PLAIN = (bool, int, float, str, type(None))
_file_hashes: dict[str, str] = {}
_own_source: list[str] = []


def _hash_file(path: str) -> str:
    if path not in _file_hashes:
        _file_hashes[path] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return _file_hashes[path]


def _source_hash() -> str:
    """tpcompile's own code (with its rules, which may live apart from the package)."""
    if not _own_source:
        package = Path(__file__).resolve().parents[1]
        rules = importlib.util.find_spec("tpcompile.rules")  # may live apart from the package
        roots = {package} | ({Path(rules.origin).resolve().parent} if rules and rules.origin else set())
        h = hashlib.sha256()
        for root in sorted(roots):
            for path in sorted(root.rglob("*.py")):
                h.update(str(path.relative_to(root)).encode())
                h.update(_hash_file(str(path)).encode())
        _own_source.append(h.hexdigest())
    return _own_source[0]


def _class_sources(cls: type) -> list[str] | None:
    """Hashes of the files defining ``cls`` and its bases (torch's own: by version)."""
    out = []
    for klass in cls.__mro__:
        module = klass.__module__ or ""
        if klass is object or module.split(".")[0] == "torch":
            continue
        try:
            path = inspect.getsourcefile(klass)
        except (TypeError, OSError):
            path = None
        if path is None or not os.path.exists(path):
            return None  # defined interactively: its code cannot enter the key
        out.append(f"{module}.{klass.__qualname__}:{_hash_file(path)}")
    return out


def _plain(value: Any) -> Any:
    """``value`` if it is plain data (nested tuples and lists of scalars), else ``None``."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, tuple | list) and all(isinstance(v, _PLAIN) for v in value):
        return tuple(value)
    if isinstance(value, torch.dtype | torch.device):
        return str(value)
    return None


def _config_items(config: Any, depth: int = 0) -> list:
    """Every attribute of a config (and of its sub-configs), private ones included: the
    attention and experts implementations live there."""
    items = []
    for k, v in sorted(vars(config).items()):
        if depth < 4 and hasattr(v, "to_dict") and hasattr(v, "__dict__") and not isinstance(v, type):
            items.append((k, _config_items(v, depth + 1)))
        else:
            items.append((k, repr(v)))
    return items


def _tensor_entry(t: torch.Tensor, *, values: bool) -> tuple:
    entry: tuple = (tuple(t.shape), str(t.dtype), t.device.type)
    if values and t.device.type != "meta" and t.numel() <= _SMALL_BUFFER:
        data = t.detach().cpu().contiguous().reshape(-1)  # 0-d too: a byte view needs a dim
        if data.dtype.is_complex:
            data = torch.view_as_real(data).reshape(-1)
        entry += (hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest(),)
    return entry


def _model_items(model: nn.Module) -> list | None:
    items: list = []
    classes: dict[type, list[str] | None] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        cls = type(module)
        if cls not in classes:
            classes[cls] = _class_sources(cls)
        if classes[cls] is None or "forward" in vars(module):
            return None
        if module._forward_hooks or module._forward_pre_hooks:
            return None
        plain = ((k, _plain(v)) for k, v in vars(module).items() if not k.startswith("_"))
        attrs = sorted((k, v) for k, v in plain if v is not None)  # ``training`` among them
        items.append((name, f"{cls.__module__}.{cls.__qualname__}", attrs))
    items.append(sorted(s for sources in classes.values() for s in sources or ()))
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
        items.append((name, _tensor_entry(p, values=False), p.requires_grad))
    items.append(sorted(names for names in owners.values() if len(names) > 1))
    for name, b in model.named_buffers(remove_duplicate=False):
        items.append((name, _tensor_entry(b, values=True)))
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "__dict__"):
        items.append(_config_items(config))
    return items


def _inputs_items(example_inputs: dict[str, Any] | None) -> list | None:
    if example_inputs is None:
        return []
    items = []
    for k, v in sorted(example_inputs.items()):
        if isinstance(v, torch.Tensor):
            items.append((k, _tensor_entry(v, values=True)))
        elif _plain(v) is not None:
            items.append((k, _plain(v)))
        else:
            return None  # an object whose content the key cannot see
    return items


def _global_hooks() -> bool:
    from torch.nn.modules import module as m

    return bool(m._global_forward_hooks or m._global_forward_pre_hooks)


def plan_key(model: nn.Module, arguments: dict[str, Any], rules: Any = None) -> str | None:
    """The cache key of planning ``model`` with ``arguments`` (``None``: not cacheable)."""
    if rules or _global_hooks():
        return None
    inputs = _inputs_items(arguments.get("example_inputs"))
    model_items = _model_items(model)
    if inputs is None or model_items is None:
        return None
    try:
        import transformers

        hf_version = transformers.__version__
    except ImportError:
        hf_version = ""
    rest = sorted((k, repr(sorted(v.items()) if isinstance(v, dict) else v))
                  for k, v in arguments.items() if k != "example_inputs")
    text = repr((torch.__version__, hf_version, sys.version_info[:3], _source_hash(),
                 type(model).__qualname__, model_items, inputs, rest))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Exclusive across the processes of a host (POSIX ``flock``; elsewhere no lock, and
    two ranks may both plan: the result is the same)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _read(path: Path) -> Plan | None:
    """The stored plan (a stored refusal is raised again), ``None`` when there is none."""
    try:
        entry = json.loads(path.read_text())
        if "refused" in entry:
            raise TPError(entry["refused"])
        plan = Plan.from_dict(entry["plan"])
    except (OSError, ValueError, TypeError, KeyError) as err:
        if type(err) is TPError:
            raise
        return None  # absent, or an entry an older tpcompile wrote: plan again
    plan.stats = {**plan.stats, "cached": True}
    return plan


def _write(path: Path, entry: dict[str, Any]) -> None:
    """Atomically: a reader sees the whole entry or none."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _plan_and_store(make: Callable[[], Plan], path: Path) -> Plan:
    """``make()``'s plan, stored unless planning warned (its warnings are re-issued as they
    came, so a later reader would miss them); a refusal (:class:`TPError`) is stored too,
    so every rank after the first refuses without tracing."""
    error: BaseException | None = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            plan = make()
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the warnings
            error = err
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    if error is not None:
        if type(error) is TPError and not caught:
            _write(path, {"refused": str(error)})
        raise error
    if not caught:
        _write(path, {"plan": plan.to_dict()})
    return plan


def cached_plan(key: str | None, make: Callable[[], Plan]) -> Plan:
    """The plan stored under ``key`` in ``$TPCOMPILE_PLAN_CACHE``, else ``make()``'s (then
    stored).  Ranks asking for one key at once wait for the first."""
    root = os.environ.get(ENV)
    if not root or key is None:
        return make()
    folder = Path(root)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{key}.json"
    plan = _read(path)
    if plan is not None:
        return plan
    with _locked(folder / f".{key}.lock"):
        return _read(path) or _plan_and_store(make, path)
