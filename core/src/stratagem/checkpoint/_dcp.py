"""Reading ``torch.distributed.checkpoint`` directories without running pickled code.

DCP keeps its index (``.metadata``) as a pickle and reads non-tensor entries with ``weights_only=False``;
either would run whatever a crafted checkpoint asks. Here the index goes through an unpickler that builds
only DCP's own metadata classes and a few torch value types, and non-tensor entries through
``torch.load(weights_only=True)``. Tensor data DCP already reads with ``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _checksum
from stratagem.errors import CheckpointError

#: A manifest's file checksums (name -> CRC32C), or None for a checkpoint written before they were recorded.
Checksums = dict[str, str] | None


def _errors() -> tuple[type[BaseException], ...]:
    # DCP's CheckpointException derives from BaseException, so ``except Exception`` lets it through.
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


ERRORS = _errors()


def describe(error: BaseException) -> str:
    """One line per failing rank for DCP's exception (its own text is every rank's full traceback)."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict):
        return f"{type(error).__name__}: {error}"
    parts = []
    for rank, pair in sorted(failures.items()):
        exc = pair[0] if isinstance(pair, tuple) else pair
        parts.append(f"rank {rank} failed in torch.distributed.checkpoint: {type(exc).__name__}: {exc}")
    return "; ".join(parts)


def checksum_failure(error: BaseException) -> _checksum.ChecksumError | None:
    """The checksum mismatch that made DCP fail on some rank, if that is why it failed."""
    if isinstance(error, _checksum.ChecksumError):
        return error
    failures = getattr(error, "failures", None)
    for pair in (failures or {}).values() if isinstance(failures, dict) else ():
        exc = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(exc, _checksum.ChecksumError):
            return exc
    return None


_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"LoadItemType", "WriteItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f"refusing {module}.{name}: a torch.distributed.checkpoint index holds only its metadata classes"
        )


def _join(path: Path | str, name: str) -> Path | str:
    return f"{path.rstrip('/')}/{name}" if isinstance(path, str) else path / name


def read_metadata(path: Path | str, rank: int | None = None, checksums: Checksums = None) -> Any:
    """The DCP index of directory (or store prefix) ``path``, read with the restricted unpickler; with
    ``checksums`` (a manifest's), its bytes are verified first."""
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    name = ".metadata" if rank is None else f"__{rank}.metadata"
    try:
        with _checksum.open_file(_join(path, name)) as stream:
            raw = stream.read()
    except FileNotFoundError as error:
        raise CheckpointError(
            path, "has no torch.distributed.checkpoint index (.metadata): the directory is incomplete."
        ) from error
    if checksums is not None:
        _verify_bytes(path, name, raw, checksums)
    try:
        meta = _MetadataUnpickler(io.BytesIO(raw)).load()
    except FileNotFoundError as error:
        raise CheckpointError(
            path, "has no torch.distributed.checkpoint index (.metadata): the directory is incomplete."
        ) from error
    except Exception as error:
        raise CheckpointError(
            path, f"its torch.distributed.checkpoint index (.metadata) is unreadable or unsafe: {error}"
        ) from error
    if not isinstance(meta, Metadata):
        raise CheckpointError(path, f".metadata holds a {type(meta).__name__}, not a DCP Metadata.")
    if getattr(meta, "storage_meta", None) is None:
        meta.storage_meta = StorageMeta()
    return meta


def safe_reader(path: Path | str, checksums: Checksums = None) -> Any:
    """A ``FileSystemReader`` (``FsspecReader`` for a store URL) whose index is read by :func:`read_metadata`;
    with ``checksums``, each rank verifies every file its plan reads from before reading it."""
    if isinstance(path, str):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader as Reader
    else:
        from torch.distributed.checkpoint import FileSystemReader as Reader

    class SafeReader(Reader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            meta = read_metadata(path, kwargs.get("rank"), checksums)
            meta.storage_meta.load_id = self.load_id
            return meta

        def read_data(self, plan: Any, planner: Any) -> Any:
            if checksums is not None:
                names = {self.storage_data[item.storage_index].relative_path for item in plan.items}
                for name in sorted(names):
                    verify_file(path, name, checksums)
            return super().read_data(plan, planner)

    return SafeReader(str(path))


def _verify_bytes(path: Path | str, name: str, raw: bytes, checksums: dict[str, str]) -> None:
    expected = checksums.get(name, "(not recorded)")
    found = _checksum.hexdigest(_checksum.crc_bytes(raw))
    if found != expected:
        raise _checksum.ChecksumError(path, name, expected, found)


def verify_file(path: Path | str, name: str, checksums: dict[str, str]) -> None:
    """Refuse the file ``name`` of ``path`` unless its bytes have the checksum the manifest records."""
    expected = checksums.get(name, "(not recorded)")
    try:
        found = _checksum.crc_of(_join(path, name))
    except FileNotFoundError:
        found = "(file missing)"
    if found != expected:
        raise _checksum.ChecksumError(path, name, expected, found)


def writer(path: Path | str) -> Any:
    """DCP's writer for a directory, or ``FsspecWriter`` for a store prefix (an object is durable once its
    upload completes, so no fsync), computing each file's checksum as it is written (see :mod:`._dcp_sums`)."""
    from stratagem.checkpoint import _dcp_sums

    return _dcp_sums.writer(path)


def _load_plain(value: io.BytesIO) -> Any:
    try:
        return torch.load(value, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(
            "(sharded entry)", f"a non-tensor entry is not plain data (refused, nothing was run): {error}"
        ) from error


def safe_load_planner(**kwargs: Any) -> Any:
    """DCP's default load planner, except that non-tensor entries are read with ``weights_only=True``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = _load_plain(value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded
                self.original_state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner(**kwargs)


def tensor_shapes(meta: Any) -> dict[str, tuple[int, ...]]:
    """Flattened key -> global shape of every tensor in a DCP index."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {
        key: tuple(item.size)
        for key, item in meta.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
