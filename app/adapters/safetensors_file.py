"""A safetensors file read the way the engine needs it: the header parsed and checked on its own, so a
registration refuses a malformed, padded or truncated file before reading its data, and the data in one read
at load time (the format: an 8-byte little-endian header size, a JSON header {key: {dtype, shape,
data_offsets}}, then the data section)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from app.errors import AdapterFormatError, AdapterNonFinite

WEIGHTS_NAME = "adapter_model.safetensors"


@dataclass(frozen=True)
class StoredTensor:
    """One tensor of a safetensors file: where its bytes lie in the data section, and what they hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte offsets into the data section
    end: int

    @property
    def ndim(self) -> int:
        return len(self.shape)


class AdapterFile:
    """A safetensors file read whole with one read, the header parsed by hand.

    The safetensors package hands out tensors one call at a time; every call gives up and retakes the
    GIL, and on a replica whose engine thread holds the GIL most of the time each retake waits behind it,
    which stretches an adapter's read many times over. Here the bytes arrive in one `readinto`, and `flat`
    gives 1-D slices (plain indexing, which keeps the GIL), so packing needs one multi-tensor copy. The format:
    an 8-byte little-endian header size, a JSON header {key: {dtype, shape, data_offsets}}, then the data section.
    """

    def __init__(self, data: torch.Tensor, entries: dict[str, StoredTensor]):
        self.data = data  # uint8, the data section
        self.entries = entries
        self._typed: dict[torch.dtype, torch.Tensor] = {}

    def flat(self, key: str) -> torch.Tensor:
        """The tensor as a 1-D slice of the file's bytes (a copy only when its offset is misaligned)."""
        entry = self.entries[key]
        size = entry.dtype.itemsize
        if entry.start % size:
            return self.data[entry.start : entry.end].clone().view(entry.dtype)
        typed = self._typed.get(entry.dtype)
        if typed is None:
            usable = len(self.data) - len(self.data) % size
            typed = self._typed[entry.dtype] = self.data[:usable].view(entry.dtype)
        return typed[entry.start // size : entry.end // size]

    def tensor(self, key: str) -> torch.Tensor:
        return self.flat(key).view(self.entries[key].shape)


_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the limit the safetensors library enforces


@dataclass(frozen=True)
class AdapterHeader:
    """A safetensors file's header, checked: its tensors tile the data section exactly."""

    entries: dict[str, StoredTensor]
    data_offset: int  # 8 + the header's size
    data_nbytes: int


def _bad_file(adapter_id: str):
    # `why` never quotes what the file's framing decodes to (its header size, a byte that is not UTF-8, an entry):
    # the file may be something else entirely, whose bytes the client must not see.
    def bad(why: str) -> AdapterFormatError:
        return AdapterFormatError(f"adapter '{adapter_id}': {WEIGHTS_NAME} is not readable safetensors: {why}")
    return bad


def read_header(adapter_id: str, f, total: int | None = None) -> AdapterHeader:
    """Parse and check the header of the open file `f` from its first bytes, without reading the data, so a
    padded or truncated file is refused before its size costs anything. `f` needs only `read`, given the
    file's size in `total` (a remote file's ranged reads)."""
    bad = _bad_file(adapter_id)
    prefix = f.read(8)
    if len(prefix) < 8:
        raise bad("shorter than its 8-byte header size")
    header_size = int.from_bytes(prefix, "little")
    if total is None:
        total = os.fstat(f.fileno()).st_size
    if header_size > min(_MAX_HEADER_BYTES, total - 8):
        raise bad("not a safetensors file (its first 8 bytes give no header size that fits the file)")
    try:
        header = json.loads(f.read(header_size))
    except RecursionError as e:
        raise bad("header nests too deeply") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad("not a safetensors file (its header is not JSON)") from e
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    header.pop("__metadata__", None)
    entries = {key: _entry(key, value, bad) for key, value in header.items()}
    data_nbytes = total - 8 - header_size
    covered = 0
    for entry in sorted(entries.values(), key=lambda e: e.start):
        if entry.start != covered:
            raise bad("tensor data overlaps or leaves gaps")
        covered = entry.end
    if covered != data_nbytes:
        raise bad(f"tensors cover {covered} of {data_nbytes} data bytes (truncated or padded file)")
    return AdapterHeader(entries, 8 + header_size, data_nbytes)


def read_adapter_file(adapter_id: str, weights_file: Path) -> AdapterFile:
    """Read and parse a safetensors file; anything malformed raises AdapterFormatError, I/O errors OSError."""
    with open(weights_file, "rb") as f:
        header = read_header(adapter_id, f)
        # Not bytearray(n): it zero-fills n bytes (and faults in their pages) holding the GIL, a wait over a
        # whole adapter's bytes for the engine thread. torch.empty leaves the pages untouched, and readinto
        # touches them with the GIL released.
        data = torch.empty(header.data_nbytes, dtype=torch.uint8)
        if data.numel() and f.readinto(data.numpy()) != data.numel():
            raise _bad_file(adapter_id)("the file changed while it was read")
    return AdapterFile(data, header.entries)


def _entry(key: str, value, bad) -> StoredTensor:
    try:
        dtype = _DTYPES[value["dtype"]]
        shape = tuple(value["shape"])
        start, end = value["data_offsets"]
        if not all(isinstance(n, int) and n >= 0 for n in (*shape, start, end)):
            raise ValueError
    except (KeyError, TypeError, ValueError) as e:
        raise bad(f"tensor {key!r} has a malformed header entry") from e
    if end - start != math.prod(shape) * dtype.itemsize:
        raise bad(f"tensor {key!r}: {end - start} bytes for shape {list(shape)} of {value['dtype']}")
    return StoredTensor(dtype, shape, start, end)


def check_values_finite(adapter_id: str, key: str, values: torch.Tensor) -> None:
    finite = torch.isfinite(values)
    if not finite.all():
        raise AdapterNonFinite(
            f"adapter '{adapter_id}': tensor {key!r} has {int((~finite).sum())} NaN/Inf values of {values.numel()}"
        )


_FINITE_CHUNK_BYTES = 16 * 1024 * 1024


def check_finite_on_disk(adapter_id: str, f, header: AdapterHeader) -> None:
    """Every value of every tensor is finite, read in chunks of at most 16 MiB: registration checks files of up
    to max_adapter_bytes without holding one in memory."""
    buffer = bytearray(_FINITE_CHUNK_BYTES)
    for key, entry in sorted(header.entries.items(), key=lambda item: item[1].start):
        f.seek(header.data_offset + entry.start)
        step = _FINITE_CHUNK_BYTES - _FINITE_CHUNK_BYTES % entry.dtype.itemsize
        for start in range(entry.start, entry.end, step):
            n = min(step, entry.end - start)
            view = memoryview(buffer)[:n]
            if f.readinto(view) != n:
                raise _bad_file(adapter_id)("the file changed while it was read")
            check_values_finite(adapter_id, key, torch.frombuffer(view, dtype=torch.uint8).view(entry.dtype))
