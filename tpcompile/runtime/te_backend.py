"""Transformer Engine backend boundary.

A backend receives the same :class:`~tpcompile.plan.Plan` as the torch backend and must
provide ``local_shard``, ``make_param`` and ``install`` (see
:class:`~tpcompile.runtime.torch_backend.TorchBackend`).  Transformer Engine is imported
only here, only when ``backend="te"`` is chosen: it cannot even be imported without CUDA.

The TE kernels (``te.pytorch.Linear(parallel_mode=...)``, ``LayerNormMLP``) are not wired
in yet; until they are, choosing ``"te"`` fails with an explanation instead of silently
running something else.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from ..errors import TPError

__all__ = ["TEBackend", "te_available"]


def te_available() -> tuple[bool, str]:
    """(usable, reason) for Transformer Engine on this machine."""
    import torch

    if not torch.cuda.is_available():
        return False, "no CUDA device is visible"
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as err:  # ImportError, or OSError for missing cuDNN/CUDA libraries
        return False, f"transformer_engine does not import ({type(err).__name__}: {err})"
    return True, ""


class TEBackend:
    name = "te"

    def __init__(self, mesh: DeviceMesh) -> None:
        ok, why = te_available()
        if not ok:
            raise TPError(
                f"backend='te' needs NVIDIA Transformer Engine on a CUDA GPU, but {why}. "
                "Use backend='torch' (or 'auto'), which runs everywhere."
            )
        raise TPError(
            "backend='te': Transformer Engine kernels are not wired into this release yet; "
            "use backend='torch' (or 'auto')"
        )
