"""``torch.sagemaker.distributed.checkpoint.filesystem``: DCP file storage."""

from __future__ import annotations

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

__all__ = ["DistributedFileSystemReader", "DistributedFileSystemWriter"]


class DistributedFileSystemReader(FileSystemReader):
    """SMP's reader of a checkpoint directory; here torch's ``FileSystemReader`` (every
    rank reads the metadata file itself from the shared filesystem).

    Example:
        >>> load(state_dict, storage_reader=DistributedFileSystemReader(path))  # doctest: +SKIP
    """


class DistributedFileSystemWriter(FileSystemWriter):
    """SMP's writer; here torch's ``FileSystemWriter``."""
