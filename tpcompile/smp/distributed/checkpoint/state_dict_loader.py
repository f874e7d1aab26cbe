"""``torch.sagemaker.distributed.checkpoint.state_dict_loader``: DCP loads, in place."""

from __future__ import annotations

import json
from typing import Any

import torch.distributed as dist

from ....checkpoint.hf import reject_partial
from ....errors import TPError
from .state_dict_saver import LAYOUT_FILE, _path, group_ranks
from .state_dict_utils import LocalStateDict

__all__ = ["load"]


def load(state_dict: dict[str, Any], checkpoint_id: Any = None, storage_reader: Any = None,
         planner: Any = None, process_group: Any = None, check_keys_matched: bool = True,
         coordinator_rank: int = 0) -> None:
    """Load a checkpoint into ``state_dict``'s tensors, in place (every rank of
    ``process_group`` calls it). An ``SM_LOCAL_STATE_DICT`` entry must come from the
    layout that saved it: another one raises, naming both.

    Example:
        >>> load(state_dict, storage_reader=DistributedFileSystemReader(path),  # doctest: +SKIP
        ...      process_group=group, coordinator_rank=min(get_global_ranks(group)))
    """
    import torch.distributed.checkpoint as dcp

    if planner is not None:
        raise TPError("a custom planner is not supported; the default DCP planner is used")
    path = _path(checkpoint_id, storage_reader)
    ranks = group_ranks(process_group, coordinator_rank)
    reject_partial(path)
    if not (path / ".metadata").exists():
        raise TPError(f"{path} is not a complete checkpoint (no .metadata); an interrupted save leaves only "
                      "a hidden .partial directory")
    saved = json.loads((path / LAYOUT_FILE).read_text()) if (path / LAYOUT_FILE).exists() else {}
    for key, value in state_dict.items():
        if not isinstance(value, LocalStateDict):
            continue
        if key not in saved:
            raise TPError(f"{path} holds no SM_LOCAL_STATE_DICT under {key!r}")
        was, now = saved[key], value.layout
        if (was["world"], was["mesh"], was["tensors"]) != (now["world"], now["mesh"], now["tensors"]):
            raise TPError(f"{path} is an SM_LOCAL_STATE_DICT of layout world={was['world']} mesh={was['mesh']}, "
                          f"this job runs world={now['world']} mesh={now['mesh']}"
                          + ("" if was["mesh"] != now["mesh"] else " with other shard sizes")
                          + "; local checkpoints reload only at the layout that wrote them: save with "
                          "StateDictType.SHARDED_STATE_DICT to change the data-parallel degree")
    dcp.load(state_dict, checkpoint_id=None if storage_reader is not None else path,
             storage_reader=storage_reader, process_group=process_group,
             no_dist=len(ranks) == 1 or not dist.is_initialized())
