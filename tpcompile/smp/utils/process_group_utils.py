"""``torch.sagemaker.utils.process_group_utils``."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["get_global_ranks"]


def get_global_ranks(process_group: Any = None) -> list[int]:
    """The global ranks of ``process_group`` (``None``: the world), in group-rank order.

    Example:
        >>> coordinator = min(get_global_ranks(group))            # doctest: +SKIP
    """
    if process_group is None or process_group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(process_group)
