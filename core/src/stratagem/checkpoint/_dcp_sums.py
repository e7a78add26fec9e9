"""DCP's writers, computing the CRC32C of every file they write as it is written, and bringing every rank's
checksums to DCP's coordinator (rank 0) by DCP's own gather of the write results.

Each rank's writer opens its shard files through :class:`_SummingFileSystem`, which hands DCP a
:class:`~stratagem.checkpoint._checksum.Summing` stream; after its writes, the rank adds one result of its own
(:data:`_MARK`) holding its files' checksums to what DCP gathers. The coordinator takes those out before DCP
builds its index, which it writes through the same file system (so ``.metadata`` is checksummed too). After the
save, :attr:`checksums` of rank 0's writer names every file of the checkpoint.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from stratagem.checkpoint._checksum import Summing, hexdigest

_MARK = "__stratagem_checksums__"


def _name(path: Any) -> str:
    return str(path).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]


class _SummingFileSystem:
    """DCP's file system with the streams it opens for writing checksummed; everything else as it was."""

    def __init__(self, fs: Any, sums: dict[str, str]) -> None:
        self._fs = fs
        self._sums = sums
        self._lock = threading.Lock()  # DCP writes a rank's files from several threads

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with self._fs.create_stream(path, mode) as stream:
                yield stream
            return
        with self._fs.create_stream(path, mode) as raw:
            summing = Summing(raw)
            yield summing
        with self._lock:
            self._sums[_name(path)] = hexdigest(summing.value)

    def rename(self, path: Any, new_path: Any) -> None:
        self._fs.rename(path, new_path)
        with self._lock:
            if _name(path) in self._sums:  # DCP writes its index as .metadata.tmp, then renames it
                self._sums[_name(new_path)] = self._sums.pop(_name(path))


def _summing(base: type) -> type:
    class SummingWriter(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            #: file name -> CRC32C: this rank's files, and on the coordinator after the save every rank's.
            self.checksums: dict[str, str] = {}
            self.fs = _SummingFileSystem(self.fs, self.checksums)

        def write_data(self, plan: Any, planner: Any) -> Any:
            from torch.distributed.checkpoint.metadata import MetadataIndex
            from torch.distributed.checkpoint.storage import WriteResult
            from torch.futures import Future

            results = super().write_data(plan, planner).value()
            mark = WriteResult(index=MetadataIndex(_MARK), size_in_bytes=0, storage_data=dict(self.checksums))
            future: Future = Future()
            future.set_result([*results, mark])
            return future

        def finish(self, metadata: Any, results: list[list[Any]]) -> None:
            kept = []
            for per_rank in results:
                for result in per_rank:
                    if result.index.fqn == _MARK:
                        self.checksums.update(result.storage_data)
                kept.append([r for r in per_rank if r.index.fqn != _MARK])
            super().finish(metadata, kept)

    return SummingWriter


def writer(path: Path | str) -> Any:
    """A writer for ``path`` (a directory, or a store prefix) that records its files' checksums."""
    if isinstance(path, str):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        # Four files per rank, uploaded by four threads: one stream per rank would send its parts one by one.
        return _summing(FsspecWriter)(path, sync_files=False, thread_count=4)
    from torch.distributed.checkpoint import FileSystemWriter

    return _summing(FileSystemWriter)(str(path))
