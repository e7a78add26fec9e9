"""Checksums of a checkpoint's files: CRC32C (google-crc32c, hardware-accelerated), computed from the bytes as
they are written, and checked when a file is read.

Where each is recorded:

- a sharded checkpoint's files (every DCP shard, ``.metadata``, ``state.pt``) in its ``stratagem.json``, which
  publication writes last, under ``"checksums"``; the manifest carries a checksum of its own text as well
  (``"manifest_crc32c"``), so a flipped bit in it is not read as another strategy or another checksum;
- a full checkpoint, one file, in a trailer of :data:`TRAILER_SIZE` bytes appended after torch's zip archive
  (zip readers find the archive from its end record, so ``torch.load`` reads the file as before). Its metadata
  says a trailer was written (``"checksum"``), so a file whose trailer is lost is not taken for an old one.

CRC32C is the checksum S3 verifies on receipt (``x-amz-checksum-crc32c``), so the value recorded here is the
value an upload can send.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import google_crc32c

from stratagem.errors import CheckpointError

ALGORITHM = "crc32c"
#: What a full checkpoint's metadata records under ``"checksum"`` once its trailer is written.
TRAILER_KIND = "crc32c-trailer"
_MAGIC = b"STRATAGEM-CRC32C"
#: The trailer: magic, the CRC32C of everything before it (8 hex digits), that length (8 bytes, big-endian).
TRAILER_SIZE = len(_MAGIC) + 8 + 8
_CHUNK = 8 << 20
MANIFEST_KEY = "manifest_crc32c"


class ChecksumError(CheckpointError):
    """A file of a checkpoint does not hold the bytes its checksum was computed from (or is missing)."""

    def __init__(self, path: object, file: str, expected: str, found: str, advice: str = "") -> None:
        self.file, self.expected, self.found = file, expected, found
        problem = (
            f"{file} fails verification: CRC32C expected {expected}, found {found} (the file was corrupted, "
            "truncated or replaced after it was written)."
        )
        super().__init__(path, problem + (f" {advice}" if advice else ""))


def _native() -> Any:
    """``crc32c_extend`` of the crc32c library that google-crc32c bundles, called through ctypes: it takes any
    buffer without a copy (google-crc32c's own ``extend`` takes only ``bytes``, and a tensor's memory would be
    copied first), and ctypes releases the GIL around it, so DCP's writer threads sum in parallel."""
    import ctypes
    import glob

    root = Path(google_crc32c.__file__).parent
    for library in sorted(glob.glob(str(root.parent / "google_crc32c.libs" / "libcrc32c*"))):
        try:
            function = ctypes.CDLL(library).crc32c_extend
        except (OSError, AttributeError):
            continue
        function.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
        function.restype = ctypes.c_uint32
        return function
    return None


_EXTEND = _native()


def extend(value: int, data: Any) -> int:
    """The CRC32C ``value`` extended by the bytes of ``data`` (any buffer)."""
    if _EXTEND is None:
        return int(google_crc32c.extend(value, bytes(data)))
    import numpy as np

    array = np.frombuffer(data, dtype=np.uint8)
    if array.size == 0:
        return value
    return int(_EXTEND(value, array.ctypes.data, array.size))


def hexdigest(value: int) -> str:
    """A CRC32C as checkpoints record it: 8 lowercase hex digits."""
    return f"{value:08x}"


def crc_bytes(data: bytes | memoryview, value: int = 0) -> int:
    return extend(value, data)


class Summing:
    """A binary stream that computes the CRC32C of what is written through it (no second pass over the data).

    Only sequential writes: anything that seeks back would invalidate the checksum, and is refused."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.value = 0
        self.length = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.value = extend(self.value, view)
        self.length += view.nbytes
        return self.raw.write(view)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        self.raw.close()

    @property
    def closed(self) -> bool:
        return bool(getattr(self.raw, "closed", False))

    def __enter__(self) -> Summing:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def trailer(value: int, length: int) -> bytes:
    return _MAGIC + hexdigest(value).encode() + struct.pack(">Q", length)


def parse_trailer(tail: bytes, size: int) -> str | None:
    """The checksum a full file's trailer records, or None if the file ends in no trailer. A trailer whose
    length is not the file's (truncated, or bytes appended) records no checksum of this file: ``"?"``."""
    if len(tail) != TRAILER_SIZE or not tail.startswith(_MAGIC):
        return None
    digest = tail[len(_MAGIC) : len(_MAGIC) + 8].decode("ascii", "replace")
    (length,) = struct.unpack(">Q", tail[-8:])
    return digest if length == size - TRAILER_SIZE else f"?{digest}"


def chunks(stream: IO[bytes], limit: int | None = None) -> Iterator[bytes]:
    left = limit
    while left is None or left > 0:
        block = stream.read(_CHUNK if left is None else min(_CHUNK, left))
        if not block:
            return
        if left is not None:
            left -= len(block)
        yield block


def crc_of_stream(stream: IO[bytes], limit: int | None = None) -> tuple[int, int]:
    """(CRC32C, bytes read) of ``stream`` from where it is, up to ``limit`` bytes."""
    value, length = 0, 0
    for block in chunks(stream, limit):
        value = extend(value, block)
        length += len(block)
    return value, length


def open_file(location: Path | str) -> IO[bytes]:
    if isinstance(location, str):
        from stratagem.checkpoint import _store

        fs, path = _store.filesystem(location)
        return fs.open(path, "rb", block_size=_CHUNK)
    return open(location, "rb")


def size_of(location: Path | str) -> int:
    if isinstance(location, str):
        from stratagem.checkpoint import _store

        return _store.size(location)
    return os.stat(location).st_size


def _crc_mapped(path: Path | str, length: int) -> int:
    """The CRC32C of the first ``length`` bytes of a local file, summed from a read-only mapping of it: no copy
    out of the page cache, which a load then reads from again."""
    import mmap

    if length == 0:
        return 0
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        view = memoryview(mapped)
        try:
            return extend(0, view[:length])
        finally:
            view.release()


def crc_of(location: Path | str) -> str:
    """The CRC32C of a whole file or object (a local file mapped, an object read in chunks)."""
    if not isinstance(location, str) and _EXTEND is not None:
        return hexdigest(_crc_mapped(location, os.stat(location).st_size))
    with open_file(location) as stream:
        return hexdigest(crc_of_stream(stream)[0])


def full_file_status(location: Path | str) -> tuple[str | None, str | None]:
    """``(expected, found)`` for a full checkpoint: the checksum its trailer records and the one its bytes have;
    ``(None, None)`` for a file without a trailer."""
    size = size_of(location)
    if size < TRAILER_SIZE:
        return None, None
    with open_file(location) as stream:
        stream.seek(size - TRAILER_SIZE)
        expected = parse_trailer(stream.read(TRAILER_SIZE), size)
        if expected is None:
            return None, None
        if isinstance(location, str) or _EXTEND is None:
            stream.seek(0)
            found, _ = crc_of_stream(stream, size - TRAILER_SIZE)
            return expected, hexdigest(found)
    return expected, hexdigest(_crc_mapped(location, size - TRAILER_SIZE))


def seal(meta: dict[str, Any]) -> dict[str, Any]:
    """The manifest with a checksum of its own content (every key but that one, in a canonical form)."""
    body = {k: v for k, v in meta.items() if k != MANIFEST_KEY}
    return {**body, MANIFEST_KEY: hexdigest(crc_bytes(_canonical(body)))}


def check_seal(location: Path | str, meta: dict[str, Any], name: str) -> None:
    """Refuse a manifest whose content is not what its own checksum was computed from."""
    expected = meta.get(MANIFEST_KEY)
    if expected is None:
        if "checksums" in meta:  # a manifest that records checksums is sealed: its seal's name was altered
            raise ChecksumError(location, name, "a manifest checksum", "none")
        return
    body = {k: v for k, v in meta.items() if k != MANIFEST_KEY}
    found = hexdigest(crc_bytes(_canonical(body)))
    if found != expected:
        raise ChecksumError(location, name, str(expected), found)


def _canonical(meta: dict[str, Any]) -> bytes:
    return json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
