"""Writing a Hugging Face export: the plan of its files (names through the adapter, shards of at most the
size asked), the files written in place part by part, the index, the config and tokenizer files, and
publication: a local directory appears whole (written beside it, then renamed), an object-store prefix is
complete once its index is uploaded, last.

Every file is created at its final size with its header first, so any process may then write any tensor's
bytes at their place: a single process exporting a checkpoint tensor by tensor, or every rank of a run
writing the parts it holds at once (:mod:`._hf_export`).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import shutil
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import torch

from stratagem.checkpoint import _atomic, _store
from stratagem.checkpoint._hf_names import Link, hf_shapes, links_for
from stratagem.checkpoint._hf_shards import Transfer
from stratagem.checkpoint._safetensors import OutputPlan, as_bytes, plan_output
from stratagem.errors import CheckpointError

INDEX = "model.safetensors.index.json"


@attrs.frozen
class ExportPlan:
    """Each model tensor's links to the exported tensors, and the output files."""

    links: dict[str, list[Link]]
    output: OutputPlan


def plan_export(
    tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
    to_hf: Callable[[str], Any],
    tied: dict[str, str],
    max_shard_bytes: int,
) -> ExportPlan:
    """The export of model tensors ``(name, shape, dtype)`` (in order): a tied alias is written once (under
    its first name, as ``save_pretrained`` does), names go through ``to_hf``."""
    present = {name for name, _, _ in tensors}
    shapes = {name: shape for name, shape, _ in tensors}
    links: dict[str, list[Link]] = {}
    dtypes: dict[str, torch.dtype] = {}
    order: list[str] = []
    for name, shape, dtype in tensors:
        if tied.get(name) in present:
            continue
        try:
            mine = links_for(name, shape, to_hf(name), lambda _n: None)
        except (TypeError, ValueError) as error:
            raise CheckpointError("(export)", f"the adapter cannot map {name!r}: {error}") from error
        links[name] = mine
        for link in mine:
            if dtypes.setdefault(link.hf, dtype) != dtype:
                raise CheckpointError(
                    "(export)", f"{link.hf} would be made of tensors of dtypes {dtypes[link.hf]} and {dtype}."
                )
            if link.hf not in order:
                order.append(link.hf)
    exported = hf_shapes([link for ls in links.values() for link in ls], shapes)
    # In natural order of the names (layers.2 before layers.10), whatever order the ranks held them in: the
    # same weights make the same files, from any strategy, live or from a checkpoint.
    order.sort(key=natural)
    output = plan_output([(hf, dtypes[hf], exported[hf]) for hf in order], max_shard_bytes)
    return ExportPlan(links=links, output=output)


def natural(name: str) -> list[Any]:
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


def storage_of(tensor: torch.Tensor) -> int:
    """The address of the memory under ``tensor`` (the same for all its views)."""
    return tensor.untyped_storage().data_ptr()


class Held:
    """The bytes of the tensors an export holds at once: each memory block (storage) counts from when the
    export makes it (:meth:`add` where it reads tensors) or, made elsewhere, first writes from it, until it is
    freed. Blocks in ``foreign`` (the running model's own tensors, a mapped checkpoint file) are not the
    export's and are not counted."""

    def __init__(self, foreign: Iterable[int] = ()) -> None:
        self.foreign = set(foreign)
        self.current = self.peak = 0
        self._alive: set[int] = set()

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
        if address in self.foreign or address in self._alive or storage.nbytes() == 0:
            return
        self._alive.add(address)
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        # Fired when the memory itself is freed (not a view of it): storages keep one Python object.
        weakref.finalize(storage, self._freed, address, storage.nbytes())

    def _freed(self, address: int, n: int) -> None:
        self._alive.discard(address)
        self.current -= n


class Files:
    """The output files of a plan in ``directory``: created (:meth:`create`, once), then written in place.

    :param held: where the tensors written from are counted (``held.peak``: the most bytes held at once).
    """

    def __init__(self, directory: Path, plan: OutputPlan, held: Held | None = None) -> None:
        self.directory, self.plan = directory, plan
        self._fds: dict[str, int] = {}
        #: Bytes written by this process.
        self.bytes_written = 0
        self.held = Held() if held is None else held

    def create(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for name, (header, size) in self.plan.files.items():
            with open(self.directory / name, "wb") as stream:
                stream.write(header)
                stream.flush()
                allocate(stream.fileno(), size)

    def write(self, transfer: Transfer) -> None:
        """Write ``transfer.local`` at its place in its tensor's file."""
        planned = self.plan.tensors[transfer.hf]
        data = transfer.local.detach()
        self.held.add(data)
        if data.device.type != "cpu" or not data.is_contiguous() or data.dtype != planned.dtype:
            data = data.to("cpu", planned.dtype).contiguous()
            self.held.add(data)
        fd = self._fds.get(planned.file)
        if fd is None:
            fd = self._fds[planned.file] = os.open(self.directory / planned.file, os.O_WRONLY)
        item = data.element_size()
        run_bytes = transfer.length * item
        view = as_bytes(data)
        starts = (transfer.starts * item + planned.start).tolist()
        for i, start in enumerate(starts):
            os.pwritev(fd, [view[i * run_bytes : (i + 1) * run_bytes]], start)
        self.bytes_written += run_bytes * len(starts)
        if starts:
            start_writeback(fd, min(starts), max(starts) + run_bytes - min(starts))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def allocate(fd: int, size: int) -> None:
    """Give the file ``fd`` its ``size`` in blocks reserved now, where the file system can (Linux's
    ``fallocate``): parts that several processes write at scattered offsets then land in extents laid out at
    once, and the publishing fsync flushes them about as fast as one sequential write (measured on ext4: a
    sparse file's blocks are allocated piece by piece at writeback). Elsewhere the file is only extended
    (sparse); glibc's ``posix_fallocate`` is not used, as it falls back to writing every block."""
    if _fallocate is not None and _fallocate(fd, 0, 0, size) == 0:
        return
    code = ctypes.get_errno() if _fallocate is not None else 0
    if code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        raise OSError(code, os.strerror(code))
    os.ftruncate(fd, size)


_fallocate = _atomic.libc_function("fallocate", ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes ``offset:offset + nbytes`` of ``fd`` to disk now, without waiting
    (Linux's ``sync_file_range`` with ``SYNC_FILE_RANGE_WRITE``; elsewhere nothing). The publishing fsync then
    waits for writes under way since each part was written, where it would start them all itself: the disk
    works while the ranks still copy. Not a durability guarantee (no metadata, no disk cache flush): the fsync
    still makes the export durable."""
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a refusal only loses the head start


_sync_file_range = _atomic.libc_function(
    "sync_file_range", ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint
)


# -------------------------------------------------------------------------------------------------
# the files beside the weights
# -------------------------------------------------------------------------------------------------


def companions(folder: str | None, model_config: Any, dtypes: set[torch.dtype]) -> dict[str, bytes]:
    """The config, tokenizer and generation files to put beside the weights: copied from the Hugging Face
    folder the run started from, else the config of the ``transformers`` model (``model_config``). The
    config's ``dtype`` is set to the exported tensors' when they have one floating dtype (``from_pretrained``
    would cast them to the config's otherwise)."""
    files: dict[str, bytes] = {}
    if folder:
        from stratagem.checkpoint._hf_source import Source

        try:
            source = Source(folder)
        except CheckpointError:
            source = None
        if source is not None:
            for name in source.companion_files():
                path = _store.join(source.folder, name)
                files[name] = path.read_bytes() if isinstance(path, Path) else _store.read_bytes(path)
    if "config.json" not in files and model_config is not None and hasattr(model_config, "to_json_string"):
        files["config.json"] = model_config.to_json_string().encode()
    floating = {d for d in dtypes if d.is_floating_point}
    if "config.json" in files and len(floating) == 1:
        files["config.json"] = _with_dtype(files["config.json"], floating.pop())
    return files


def _with_dtype(raw: bytes, dtype: torch.dtype) -> bytes:
    try:
        config = json.loads(raw)
    except ValueError:
        return raw
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    if all(config.get(k) == name for k in keys):
        return raw
    for key in keys:
        config[key] = name
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


# -------------------------------------------------------------------------------------------------
# publication
# -------------------------------------------------------------------------------------------------


def staging_dir(output: Path | str, overwrite: bool) -> Path:
    """Where the export is written before publication: beside a local output, in the temporary directory for a
    store. An existing non-empty output is refused unless ``overwrite``."""
    if isinstance(output, Path):
        if output.exists() and (not output.is_dir() or any(output.iterdir())) and not overwrite:
            raise CheckpointError(output, "exists and is not empty; choose a new directory, or overwrite it.")
        output.parent.mkdir(parents=True, exist_ok=True)
        _atomic.remove_stale_temporaries(output)
        return _atomic.temporary_sibling(output)
    _store.check_bucket(output)
    if _store.children(output) and not overwrite:
        raise CheckpointError(output, "holds objects already; choose a new prefix, or overwrite it.")
    from stratagem.checkpoint import _scratch

    return _scratch.make_dir("hf-export")


def publish(staging: Path, output: Path | str, plan: OutputPlan, extra: dict[str, bytes]) -> None:
    """Add the index and ``extra`` files and make the export visible at ``output`` (see the module's note)."""
    (staging / INDEX).write_bytes(plan.index())
    for name, data in extra.items():
        (staging / name).write_bytes(data)
    if isinstance(output, Path):
        _atomic.publish_directory(staging, output)
        return
    try:
        fs, root = _store.filesystem(output)
        stale = set(_store.children(output)) - set(plan.files) - set(extra) - {INDEX}
        for name in [*plan.files, *extra]:
            fs.put_file(str(staging / name), f"{root}/{name}")
        # The index names the files: uploaded last, it publishes them; files of an older export go after.
        fs.put_file(str(staging / INDEX), f"{root}/{INDEX}")
        for name in stale:
            if name.endswith(".safetensors"):
                _store.remove_object(_store.join(output, name))
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(
            output, f"could not be written: {_store.describe_error(output, error)}"
        ) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
