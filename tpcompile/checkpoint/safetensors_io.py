"""Streaming safetensors: write one tensor at a time, read only the rows a rank owns.

The safetensors format is an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``
and the raw row-major bytes.  Because every shape and dtype is known from the plan
before any data exists, :class:`StreamWriter` writes the header first and then each
tensor as it is gathered: a rank never holds more than one full tensor.

:class:`SliceReader` reads with ``pread`` instead of a memory map.  A column slice of a
row-major tensor read through ``mmap`` faults in every page of the tensor, so a rank
loading its half of a row-parallel weight would touch all of it; ``pread`` of each
row's segment touches only the bytes asked for, and the reader counts them so tests can
assert each rank read only its slices.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from ..errors import TPError

__all__ = ["DTYPES", "SliceReader", "StreamWriter", "dtype_name", "file_layout", "read_header"]

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_HEADER_LIMIT = 100 * 1024 * 1024  # the format's own cap: a larger header is corruption


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TPError(f"dtype {dtype} cannot be stored in safetensors") from None


def read_header(path: str | Path) -> tuple[dict[str, Any], int]:
    """``(header, data_start)`` of a safetensors file, checked against the file's size.

    Raises ``TPError`` naming the file when it is truncated or not safetensors.
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise TPError(f"{path} is truncated ({size} bytes): not a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > _HEADER_LIMIT or 8 + n > size:
            raise TPError(f"{path} is truncated or corrupt: header of {n} bytes, file has {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            raise TPError(f"{path} has an unreadable safetensors header ({err})") from None
    data_start = 8 + n
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if data_start + end > size:
        raise TPError(
            f"{path} is truncated: its header needs {data_start + end} bytes, the file has {size} "
            "(an interrupted write?); re-save or re-download it"
        )
    return header, data_start


class SliceReader:
    """Read whole tensors, or chosen index ranges along one dim, from one file.

    Example:
        >>> with SliceReader("model.safetensors") as r:                  # doctest: +SKIP
        ...     w = r.read("lm_head.weight", dim=0, runs=[(0, 1000)])
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.header, self._start = read_header(self.path)
        self.metadata: dict[str, str] = self.header.pop("__metadata__", None) or {}
        self._fd = os.open(self.path, os.O_RDONLY)
        self.bytes_read = 0

    def __enter__(self) -> SliceReader:
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def keys(self) -> list[str]:
        return list(self.header)

    def info(self, name: str) -> tuple[torch.dtype, list[int]]:
        entry = self._entry(name)
        return DTYPES[entry["dtype"]], list(entry["shape"])

    def _entry(self, name: str) -> dict[str, Any]:
        try:
            return self.header[name]
        except KeyError:
            raise TPError(f"tensor {name!r} is not in {self.path}") from None

    def _pread_into(self, view: memoryview, offset: int) -> None:
        # preadv fills the destination directly: no intermediate bytes object
        got = os.preadv(self._fd, [view], self._start + offset)
        if got != len(view):
            raise TPError(f"{self.path} is truncated: short read at data offset {offset}")
        self.bytes_read += got

    def read(self, name: str, dim: int | None = None,
             runs: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
        """The tensor, or the concatenation of ``[a, b)`` ranges along ``dim``."""
        entry = self._entry(name)
        dtype, shape = DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = entry["data_offsets"]
        if dim is None or runs is None:
            buf = bytearray(end - begin)
            if buf:
                self._pread_into(memoryview(buf), begin)
            return _from_bytes(buf, dtype, shape)
        item = torch.empty(0, dtype=dtype).element_size()
        outer = math.prod(shape[:dim])
        inner = math.prod(shape[dim + 1:]) * item  # bytes of one index along ``dim``
        rows = sum(b - a for a, b in runs)
        buf = bytearray(outer * rows * inner)
        view = memoryview(buf)
        pos = 0
        for o in range(outer):
            base = begin + o * shape[dim] * inner
            for a, b in runs:
                if not 0 <= a <= b <= shape[dim]:
                    raise TPError(f"{name}: rows [{a}, {b}) outside its dim {dim} of size {shape[dim]}")
                n = (b - a) * inner
                if n:
                    self._pread_into(view[pos:pos + n], base + a * inner)
                pos += n
        out_shape = list(shape)
        out_shape[dim] = rows
        return _from_bytes(buf, dtype, out_shape)


def _from_bytes(buf: bytearray, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if len(buf) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def file_layout(entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                metadata: dict[str, str] | None = None) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The bytes before the data (length + JSON header, padded to 8) and each tensor's
    ``[begin, end)`` byte range in the file: everything a writer needs before any data."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    ranges: dict[str, tuple[int, int]] = {}
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        header[name] = {"dtype": dtype_name(dtype), "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        ranges[name] = (offset, offset + nbytes)
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as the format asks
    prefix = struct.pack("<Q", len(raw)) + raw
    return prefix, {k: (a + len(prefix), b + len(prefix)) for k, (a, b) in ranges.items()}


class StreamWriter:
    """Write a safetensors file whose tensors arrive one at a time, in header order.

    Example:
        >>> with StreamWriter(path, [("w", torch.float32, [2, 3])]) as w:   # doctest: +SKIP
        ...     w.write("w", torch.zeros(2, 3))
    """

    def __init__(self, path: str | Path, entries: Sequence[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        prefix, offsets = file_layout(entries, metadata)
        self._order = [(name, dtype, list(shape), offsets[name][1] - offsets[name][0])
                       for name, dtype, shape in entries]
        self._f = open(self.path, "wb")  # noqa: SIM115 - closed by close()/__exit__
        self._f.write(prefix)
        self._next = 0
        self.bytes_written = 0

    def __enter__(self) -> StreamWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        self.close(complete=exc_type is None)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise TPError(f"{self.path}: unexpected tensor {name!r}, every tensor was written")
        want, dtype, shape, nbytes = self._order[self._next]
        if name != want or tensor.dtype != dtype or list(tensor.shape) != shape:
            raise TPError(
                f"{self.path}: expected {want} {dtype} {shape}, got {name} {tensor.dtype} {list(tensor.shape)}"
            )
        data = tensor.detach().to("cpu").contiguous()
        if nbytes:
            self._f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
        self.bytes_written += nbytes
        self._next += 1

    def close(self, complete: bool = True) -> None:
        if self._f.closed:
            return
        try:
            if complete:
                if self._next != len(self._order):
                    missing = [n for n, *_ in self._order[self._next:]][:3]
                    raise TPError(f"{self.path}: closed before writing {missing}")
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self._f.close()
