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
import threading
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
_WRITE_PIECE = 1 << 20  # summed then written while it is in the core's cache
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


#: A buffer at least this large is summed in parts on as many threads as the process may run on (a load
#: verifying a file waits for the sum: a pass at the CRC's speed of one core, about 60 ms for 500 MB, shared
#: out). Each part is at least half of it.
SPLIT_BYTES = 64 << 20
_POLY = 0x82F63B78  # CRC32C's polynomial, bits reflected


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo CRC32C's polynomial, both in the reflected representation (x^0 the top bit)."""
    product, bit = 0, 1 << 31
    while a:
        if a & bit:
            product ^= b
            a ^= bit
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        bit >>= 1
    return product


def combine(first: int, second: int, length: int) -> int:
    """The CRC32C of two byte strings joined, from the CRC32C of each and the second's length in bytes: the
    first's CRC moved past ``length`` zero bytes (times x^(8 length)), then the second's added."""
    power, square, n = 1 << 31, 1 << 30, 8 * length  # x^0 and x^1
    while n:
        if n & 1:
            power = _multiply(power, square)
        square = _multiply(square, square)
        n >>= 1
    return _multiply(power, first) ^ second


def _parts() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def extend_parallel(value: int, data: Any) -> int:
    """:func:`extend` over a large buffer summed in parts on several threads at once (the native function
    releases the GIL), the parts' checksums combined; the same value as :func:`extend`."""
    import numpy as np

    array = np.frombuffer(data, dtype=np.uint8)
    parts = min(_parts(), 8, array.size // max(1, SPLIT_BYTES // 2))
    if _EXTEND is None or parts < 2 or array.size < SPLIT_BYTES:
        return extend(value, array)
    import threading

    bounds = [array.size * i // parts for i in range(parts + 1)]
    sums = [0] * parts
    address = array.ctypes.data

    def run(i: int) -> None:
        sums[i] = int(_EXTEND(0, address + bounds[i], bounds[i + 1] - bounds[i]))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(1, parts)]
    for thread in threads:
        thread.start()
    run(0)
    for thread in threads:
        thread.join()
    total = value
    for i in range(parts):
        total = combine(total, sums[i], bounds[i + 1] - bounds[i])
    return total


def hexdigest(value: int) -> str:
    """A CRC32C as checkpoints record it: 8 lowercase hex digits."""
    return f"{value:08x}"


def crc_bytes(data: bytes | memoryview, value: int = 0) -> int:
    return extend_parallel(value, data)


_HELPER: Any = None
_HELPER_LOCK = threading.Lock()


def _helper() -> Any:
    """The threads that sum large writes while they are written (one per core; DCP writes from several threads).
    The native sum releases the GIL, as does the write."""
    global _HELPER
    with _HELPER_LOCK:
        if _HELPER is None:
            from concurrent.futures import ThreadPoolExecutor

            _HELPER = ThreadPoolExecutor(max_workers=_parts(), thread_name_prefix="stratagem-crc32c")
        return _HELPER


def _forget_helper() -> None:
    """In a forked child: its parent's threads are not in it, and the lock may have been held when it forked."""
    global _HELPER, _HELPER_LOCK
    _HELPER, _HELPER_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helper)


class Summing:
    """A binary stream that computes the CRC32C of what is written through it (no second pass over the data).

    Only sequential writes: anything that seeks back would invalidate the checksum, and is refused."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.value = 0
        self.length = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes <= _WRITE_PIECE:
            self.value = extend(self.value, view)
            self.length += view.nbytes
            return self.raw.write(view)
        if _parts() > 1:
            # A tensor's bytes come in one write: summed on another core while this thread writes them, the sum
            # costs the save next to nothing of its time (the write into the page cache is most of it).
            summed = _helper().submit(extend, self.value, view)
            try:
                self._write_all(view)
            finally:
                value = summed.result()  # the helper reads ``view``: never let the caller free it first
            self.value = value
            self.length += view.nbytes
            return view.nbytes
        # One core: summed a piece at a time, each piece is still in the core's cache when it is written (read
        # from memory once, not twice). benchmarks/checkpoint_integrity.py measures both ways.
        for start in range(0, view.nbytes, _WRITE_PIECE):
            piece = view[start : start + _WRITE_PIECE]
            self.value = extend(self.value, piece)
            self.length += piece.nbytes
            self._write_all(piece)
        return view.nbytes

    def _write_all(self, piece: memoryview) -> None:
        while piece.nbytes:
            written = self.raw.write(piece)
            piece = piece[written if written is not None else piece.nbytes :]

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
            return extend_parallel(0, view[:length])
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
