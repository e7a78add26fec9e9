"""A Hugging Face weights source: a model folder, one or more ``.safetensors`` files or their
``model.safetensors.index.json``, on a local disk or at an object-store URL; and reading byte runs from it.

Only safetensors are read. Pickled weights (``pytorch_model.bin``, ``.pt``) can run code when they are
loaded, so a source that has only those is refused with the way to convert them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _store
from stratagem.checkpoint._safetensors import Entry, as_bytes, parse_header
from stratagem.errors import CheckpointError

INDEX_SUFFIX = ".safetensors.index.json"
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_EXPECTS = (
    "init_weights takes a Hugging Face model folder (config.json and *.safetensors), a .safetensors file, or a "
    "model.safetensors.index.json, on a local disk or at an s3://, gs:// or az:// URL"
)
CONVERT = (
    'Convert them once, where you trust the file: python -c "from transformers import AutoModel; '
    "AutoModel.from_pretrained('IN').save_pretrained('OUT')\" (transformers writes safetensors), or "
    "safetensors.torch.save_file(torch.load('pytorch_model.bin', weights_only=True), 'model.safetensors')."
)


def _refuse_pickled(where: Any, names: list[str]) -> CheckpointError:
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    return CheckpointError(
        where,
        f"holds pickled PyTorch weights ({shown}) and no .safetensors: stratagem does not load pickled files, "
        f"which can run code when they are read. {CONVERT}",
    )


class Source:
    """The tensors of a safetensors source, by name, read from each file's header; and a reader of byte runs.

    ``bytes_read`` counts the tensor bytes this process read (its shards), for reports and tests.
    """

    def __init__(self, where: str | os.PathLike[str]) -> None:
        self.where = _location(where)
        self.remote = isinstance(self.where, str)
        self.folder, self.files = self._find_files()
        self.entries: dict[str, Entry] = {}
        for file in self.files:
            for entry in self._read_header(file):
                if entry.name in self.entries:
                    raise CheckpointError(
                        self.where,
                        f"tensor {entry.name!r} is in both {self.entries[entry.name].file} and {file}.",
                    )
                self.entries[entry.name] = entry
        self.bytes_read = 0
        self._fds: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"Source({str(self.where)!r}, {len(self.files)} files, {len(self.entries)} tensors)"

    # discovery -----------------------------------------------------------------------------------
    def _list(self, folder: Path | str) -> list[str]:
        if isinstance(folder, Path):
            return sorted(p.name for p in folder.iterdir() if p.is_file())
        return [name for name in _store.children(folder) if "." in name]

    def _is_dir(self) -> bool:
        if isinstance(self.where, Path):
            if not self.where.exists():
                hint = ""
                if not str(self.where).startswith(("/", ".")) and str(self.where).count("/") == 1:
                    hint = (
                        " (a Hub id? stratagem reads local or object-store copies: huggingface-cli download "
                        f"{self.where} --local-dir DIR)"
                    )
                raise CheckpointError(self.where, f"does not exist{hint}. {_EXPECTS}.")
            return self.where.is_dir()
        try:
            if _store.is_file(self.where):
                return False
            if _store.children(self.where):
                return True
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(
                self.where, f"cannot be read: {_store.describe_error(self.where, error)}"
            ) from error
        raise CheckpointError(self.where, f"does not exist. {_EXPECTS}.")

    def _find_files(self) -> tuple[Path | str, list[str]]:
        if not self._is_dir():
            name = _store.name_of(self.where)
            folder = self.where.parent if isinstance(self.where, Path) else self.where.rsplit("/", 1)[0]
            if name.endswith(INDEX_SUFFIX):
                return folder, self._from_index(self.where)
            if name.endswith(".safetensors"):
                return folder, [str(self.where)]
            if name.endswith(PICKLED):
                raise _refuse_pickled(self.where, [name])
            raise CheckpointError(self.where, f"is not a .safetensors file. {_EXPECTS}.")
        names = self._list(self.where)
        indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
        if "model.safetensors.index.json" in indexes:
            indexes = ["model.safetensors.index.json"]
        if len(indexes) == 1:
            return self.where, self._from_index(_store.join(self.where, indexes[0]))
        tensors = [n for n in names if n.endswith(".safetensors")]
        if tensors:
            return self.where, [str(_store.join(self.where, n)) for n in tensors]
        pickled = [n for n in names if n.endswith(PICKLED)]
        if pickled:
            raise _refuse_pickled(self.where, pickled)
        raise CheckpointError(self.where, f"holds no .safetensors files. {_EXPECTS}.")

    def _from_index(self, index: Path | str) -> list[str]:
        try:
            raw = index.read_bytes() if isinstance(index, Path) else _store.read_bytes(index)
            weight_map = json.loads(raw)["weight_map"]
        except Exception as error:
            raise CheckpointError(index, f"is not a readable safetensors index: {error}") from error
        folder = index.parent if isinstance(index, Path) else index.rsplit("/", 1)[0]
        files = sorted(set(weight_map.values()))
        pickled = [f for f in files if f.endswith(PICKLED)]
        if pickled:
            raise _refuse_pickled(index, pickled)
        return [str(_store.join(folder, f)) for f in files]

    # reading --------------------------------------------------------------------------------------
    def _read_header(self, file: str) -> list[Entry]:
        try:
            if not self.remote:
                with open(file, "rb") as stream:
                    return parse_header(stream.read(8), stream.read, file, os.fstat(stream.fileno()).st_size)
            fs, path = _store.filesystem(file)
            with fs.open(path, "rb") as stream:
                return parse_header(stream.read(8), stream.read, file, int(fs.size(path)))
        except CheckpointError:
            raise
        except FileNotFoundError as error:
            raise CheckpointError(file, "is named by the index but does not exist.") from error
        except Exception as error:
            raise CheckpointError(file, f"cannot be read: {type(error).__name__}: {error}") from error

    def read_runs(self, entry: Entry, starts: torch.Tensor, length: int, out: torch.Tensor) -> None:
        """Read the runs ``starts`` (element offsets in ``entry``, each ``length`` elements) into the contiguous
        tensor ``out`` of ``entry``'s dtype, one after the other."""
        if length == 0 or starts.numel() == 0:
            return
        item = out.element_size()
        run_bytes = length * item
        view = as_bytes(out)
        offsets = (starts * item + entry.start).tolist()
        if self.remote:
            self._read_remote(entry.file, offsets, run_bytes, view)
        else:
            fd = self._fds.get(entry.file)
            if fd is None:
                fd = self._fds[entry.file] = os.open(entry.file, os.O_RDONLY)
            for i, offset in enumerate(offsets):
                part = view[i * run_bytes : (i + 1) * run_bytes]
                got = os.preadv(fd, [part], offset)
                if got != run_bytes:
                    raise CheckpointError(
                        entry.file, f"ended early while reading {entry.name!r} (truncated?)."
                    )
        self.bytes_read += run_bytes * len(offsets)

    def _read_remote(self, file: str, offsets: list[int], run_bytes: int, view: memoryview) -> None:
        fs, path = _store.filesystem(file)
        # One request per run would be thousands for a tensor split along its columns: runs closer than 1 MiB
        # are read as one range and the bytes between them dropped.
        spans: list[list[int]] = []
        for i, offset in enumerate(offsets):
            if spans and offset - (spans[-1][1]) <= 1 << 20 and offset >= spans[-1][1]:
                spans[-1][1] = offset + run_bytes
                spans[-1][2].append(i)
            else:
                spans.append([offset, offset + run_bytes, [i]])
        blobs = fs.cat_ranges([path] * len(spans), [s[0] for s in spans], [s[1] for s in spans])
        for (begin, _end, members), blob in zip(spans, blobs):
            if isinstance(blob, Exception):
                raise CheckpointError(file, f"cannot be read: {_store.describe_error(file, blob)}")
            for i in members:
                local = offsets[i] - begin
                view[i * run_bytes : (i + 1) * run_bytes] = blob[local : local + run_bytes]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # the folder's other files (config, tokenizer) ---------------------------------------------------
    def companion_files(self) -> list[str]:
        """The files beside the weights that an export copies: configuration, tokenizer, chat template,
        generation settings; never weights (safetensors, pickles, their indexes) or hidden files."""
        weights = (".safetensors", INDEX_SUFFIX, ".bin.index.json", ".h5", ".msgpack", ".gguf", *PICKLED)
        return [n for n in self._list(self.folder) if not n.startswith(".") and not n.endswith(weights)]


def _location(where: str | os.PathLike[str]) -> Path | str:
    scheme = _store.scheme_of(where)
    if scheme in ("http", "https"):
        # A web server has no listing to find a folder's files by: the URLs read are object stores'.
        raise CheckpointError(
            os.fspath(where),
            f"is an {scheme}:// URL, which init_weights does not read. Download the folder first "
            "(huggingface-cli download ID --local-dir DIR, or curl each file), or copy it to an object store. "
            f"{_EXPECTS}.",
        )
    return _store.location(where)


def check_exists(where: str | os.PathLike[str]) -> None:
    """Refuse a local source that does not exist, before anything launches (URLs are checked where read)."""
    location = _location(where)
    if isinstance(location, Path) and not location.exists():
        Source(location)  # raises with the full explanation
