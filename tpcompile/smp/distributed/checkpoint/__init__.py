"""``torch.sagemaker.distributed.checkpoint`` counterparts (state_dict_utils,
state_dict_saver, state_dict_loader, filesystem)."""

from __future__ import annotations

__all__: list[str] = []
