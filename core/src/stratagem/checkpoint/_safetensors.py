"""The safetensors format, read and written by byte ranges, without the ``safetensors`` package.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and
``data_offsets`` into the data that follows, plus an optional ``__metadata__`` of strings), then the tensors'
bytes, row-major and back to back. That is all a rank needs to read only the bytes of its own shard of a
tensor (a rectangle of it, or a range of its flattened elements) or to write its shard of an output file in
place, which is why stratagem reads and writes the format here rather than through a whole-file API.

Byte ranges of a rectangle are computed as *runs*: the rectangle is contiguous along its last dimension that
is not whole, so it is ``prod(sizes before it)`` runs of equal length, each read into (or written from) the
next part of a contiguous buffer.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import attrs
import torch

from stratagem.errors import CheckpointError

#: safetensors' dtype names.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
}
NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
#: A header longer than this is not a safetensors header (the format's own readers cap it at 100 MB).
MAX_HEADER = 100_000_000


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@attrs.frozen
class Entry:
    """One tensor of a safetensors file: where its bytes are (absolute offsets in ``file``)."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def parse_header(raw_length: bytes, read: Any, file: str, file_size: int | None) -> list[Entry]:
    """The entries of one file, from its first 8 bytes and ``read(n)`` for the header that follows."""
    if len(raw_length) < 8:
        raise CheckpointError(file, "is shorter than a safetensors header: not a safetensors file.")
    (length,) = struct.unpack("<Q", raw_length)
    if length > MAX_HEADER or (file_size is not None and 8 + length > file_size):
        raise CheckpointError(file, "has no valid safetensors header (its length field is out of range).")
    try:
        header = json.loads(read(length))
    except ValueError as error:
        raise CheckpointError(file, f"has an unreadable safetensors header: {error}") from error
    if not isinstance(header, dict):
        raise CheckpointError(file, "has a safetensors header that is not a JSON object.")
    base = 8 + length
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except KeyError as error:
            raise CheckpointError(
                file, f"tensor {name!r} has dtype {info.get('dtype')!r}, which torch cannot hold here."
            ) from error
        except (TypeError, ValueError) as error:
            raise CheckpointError(file, f"tensor {name!r} has a malformed header entry: {info!r}") from error
        if end - begin != nbytes(shape, dtype) or (file_size is not None and base + end > file_size):
            raise CheckpointError(
                file,
                f"tensor {name!r}: its data_offsets do not fit its shape {shape} and dtype (truncated?).",
            )
        entries.append(Entry(name, file, dtype, shape, base + begin, base + end))
    return entries


def runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]
) -> tuple[torch.Tensor, int]:
    """``(starts, length)`` in elements: the contiguous runs of a rectangle of a row-major tensor, in the order
    a contiguous buffer of the rectangle holds them."""
    if math.prod(sizes) == 0:
        return torch.empty(0, dtype=torch.int64), 0
    partial = [d for d in range(len(shape)) if sizes[d] != shape[d]]
    if not partial:
        return torch.zeros(1, dtype=torch.int64), math.prod(shape)
    last = partial[-1]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    length = sizes[last] * strides[last]
    starts = torch.tensor([sum(offsets[d] * strides[d] for d in range(last + 1))], dtype=torch.int64)
    for d in range(last):  # outer dimensions first: the buffer is row-major
        steps = torch.arange(sizes[d], dtype=torch.int64) * strides[d]
        starts = (starts[:, None] + steps[None, :]).reshape(-1)
    return starts, length


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(bytearray())
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")


# -------------------------------------------------------------------------------------------------
# writing: the files of an export and their headers
# -------------------------------------------------------------------------------------------------


@attrs.frozen
class Planned:
    """Where one output tensor goes: its file and the absolute offset of its first byte."""

    name: str
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int


@attrs.frozen
class OutputPlan:
    """The files of an export: each file's header bytes and size, and every tensor's place."""

    files: dict[str, tuple[bytes, int]]
    tensors: dict[str, Planned]

    @property
    def total_size(self) -> int:
        return sum(nbytes(t.shape, t.dtype) for t in self.tensors.values())

    def index(self) -> bytes:
        """``model.safetensors.index.json``, as ``save_pretrained`` writes it (keys sorted: the same bytes
        whatever wrote it)."""
        weight_map = {name: t.file for name, t in self.tensors.items()}
        body = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        return (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()


def _header(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, list[int]]:
    """A file's header (with the ``{"format": "pt"}`` metadata ``from_pretrained`` looks for) and each
    tensor's offset in the data; the header is padded with spaces to 8 bytes, as the format's writers do."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offsets, position = [], 0
    for name, dtype, shape in tensors:
        size = nbytes(shape, dtype)
        header[name] = {
            "dtype": NAMES[dtype],
            "shape": list(shape),
            "data_offsets": [position, position + size],
        }
        offsets.append(position)
        position += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def plan_output(tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], max_shard_bytes: int) -> OutputPlan:
    """Split ``tensors`` (in order) into files of at most ``max_shard_bytes`` of data, as Hugging Face's
    sharding does (a tensor larger than the limit gets a file of its own), named
    ``model-0000X-of-0000N.safetensors``. Within a file, tensors of larger elements come first so that every
    tensor is aligned to its element size."""
    for name, dtype, _ in tensors:
        if dtype not in NAMES:
            raise CheckpointError(name, f"has dtype {dtype}, which safetensors cannot store.")
    groups: list[list[tuple[str, torch.dtype, tuple[int, ...]]]] = [[]]
    size = 0
    for item in tensors:
        item_size = nbytes(item[2], item[1])
        if groups[-1] and size + item_size > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item_size
    files: dict[str, tuple[bytes, int]] = {}
    placed: dict[str, Planned] = {}
    for number, group in enumerate(groups, start=1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        group = sorted(group, key=lambda t: -torch.empty((), dtype=t[1]).element_size())
        header, offsets = _header(group)
        data = sum(nbytes(shape, dtype) for _, dtype, shape in group)
        files[file] = (header, len(header) + data)
        for (name, dtype, shape), offset in zip(group, offsets):
            placed[name] = Planned(name, file, dtype, shape, len(header) + offset)
    order = [name for name, _, _ in tensors]
    return OutputPlan(files=files, tensors={name: placed[name] for name in order})


def parse_size(value: int | str) -> int:
    """``5GB`` (10**9 bytes, as Hugging Face counts), ``500MiB`` (2**20), or a number of bytes."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"max_shard_size={value}: give a positive number of bytes.")
        return value
    text = str(value).strip().upper().replace(" ", "")
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}
    unit = next((u for u in units if text.endswith(u)), "")
    number, factor = text[: len(text) - len(unit)], units.get(unit, 1)
    try:
        result = int(float(number) * factor)
    except ValueError:
        raise ValueError(
            f"max_shard_size={value!r}: give bytes, or a size such as '5GB' (10**9) or '500MiB' (2**20)."
        ) from None
    if result <= 0:
        raise ValueError(f"max_shard_size={value!r}: give a positive size.")
    return result
