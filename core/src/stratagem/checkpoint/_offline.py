"""Offline work on checkpoints, in one process without a process group: inspect and consolidate.

Consolidation turns a sharded checkpoint into a full one without holding the model in memory: every output
tensor is backed by a file-mapped storage in a scratch directory beside the output, DCP reads the shards
into them chunk by chunk, and ``torch.save`` streams them into the output file. Anonymous memory stays near
the largest chunk; the mapped pages are page cache that the kernel can write back and drop.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _dcp, _publish, _read, _store, _write
from stratagem.checkpoint._state_layout import FORMAT_VERSION
from stratagem.errors import CheckpointError

# -------------------------------------------------------------------------------------------------
# inspect
# -------------------------------------------------------------------------------------------------


def _tensors(value: Any, prefix: str) -> list[tuple[str, tuple[int, ...], str, int]]:
    if isinstance(value, torch.Tensor):
        return [(prefix, tuple(value.shape), str(value.dtype).replace("torch.", ""), _nbytes(value))]
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            found += _tensors(item, f"{prefix}.{i}" if prefix else str(i))
    return found


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _step(state: dict[str, Any]) -> Any:
    for key in ("step", "global_step"):
        value = state.get(key)
        if isinstance(value, (int, float)):
            return value
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value.item()
    for key in ("trainer", "progress"):  # "progress": what Trainer.save_checkpoint writes
        nested = state.get(key)
        if isinstance(nested, dict) and (found := _step(nested)) is not None:
            return found
    return None


def inspect(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds: format, strategy, world size, step, tensors (name, shape, dtype), sizes."""
    source = _read.source(path)
    fmt = source.format()
    if fmt == "full":
        payload = source.read_full()
        meta = payload["stratagem"]
        state = payload.get("state", {})
        tensors = _tensors(
            {"model": payload.get("model", {}), "optimizers": payload.get("optimizers", {})}, ""
        )
        tensors += _tensors(state, "state")
        on_disk = source.bytes_on_disk()
    else:
        meta = source.metadata()
        data = source.data(meta)
        index = _dcp.read_metadata(data.location)
        state = data.read_state()
        tensors = []
        for key, item in sorted(index.state_dict_metadata.items()):
            if hasattr(item, "size"):
                dtype = item.properties.dtype
                nbytes = math.prod(item.size) * torch.empty((), dtype=dtype).element_size()
                tensors.append((key, tuple(item.size), str(dtype).replace("torch.", ""), nbytes))
        tensors += _tensors(state, "state")
        on_disk = source.bytes_on_disk(data)
    return {
        "path": str(source.location),
        "format": fmt,
        "format_version": meta.get("format_version"),
        "strategy": meta.get("strategy"),
        "world_size": meta.get("world_size"),
        "torch_version": meta.get("torch_version"),
        "stratagem_version": meta.get("stratagem_version"),
        "step": _step(state) if isinstance(state, dict) else None,
        "tensors": [{"name": n, "shape": list(s), "dtype": d, "bytes": b} for n, s, d, b in tensors],
        "tensor_bytes": sum(b for *_, b in tensors),
        "bytes_on_disk": on_disk,
    }


# -------------------------------------------------------------------------------------------------
# consolidate
# -------------------------------------------------------------------------------------------------


def _mapped_empty(file: Path, size: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    numel = math.prod(size)
    if numel == 0:
        return torch.empty(size, dtype=dtype)
    # shared=True: pages are the file's, written back by the kernel, not anonymous memory of this process.
    return torch.from_file(str(file), shared=True, size=numel, dtype=dtype).view(size)


def consolidate(source: str | Path, output: str | Path, scratch_dir: str | Path | None = None) -> Path | str:
    """Write the sharded checkpoint ``source`` as a full checkpoint file ``output``.

    :param scratch_dir: where the file-mapped tensors live while the output is written (default: beside
        the output, on the same file system; for an object-store output, the system's temporary directory;
        it needs about the checkpoint's size, freed at the end). Either path may be an object-store URL.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from stratagem.registry._version import __version__

    sharded, output = _read.source(source), _store.location(output)
    source = sharded.location
    if sharded.format() != "sharded":
        raise CheckpointError(source, "is a file (a full checkpoint already); consolidate takes a directory.")
    meta = sharded.metadata()
    data = sharded.data(meta)
    index = _dcp.read_metadata(data.location)
    if isinstance(output, str):
        if _store.exists(_store.join(output, "stratagem.json")):
            raise CheckpointError(
                output, "holds a sharded checkpoint; give the URL of the full object to write."
            )
        scratch_parent = scratch_dir
    else:
        if output.is_dir():
            raise CheckpointError(
                output, "is a directory; give the path of the full checkpoint file to write."
            )
        output.parent.mkdir(parents=True, exist_ok=True)
        scratch_parent = scratch_dir or output.parent
    name = _store.name_of(output)
    scratch = Path(tempfile.mkdtemp(prefix=f".{name}.scratch-", dir=scratch_parent))
    try:
        flat: dict[str, Any] = {}
        for i, (key, item) in enumerate(index.state_dict_metadata.items()):
            if isinstance(item, TensorStorageMetadata):
                flat[key] = _mapped_empty(scratch / str(i), tuple(item.size), item.properties.dtype)
            else:
                flat[key] = None  # a non-tensor entry; the planner fills it, read as plain data
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(
                    flat,
                    storage_reader=_dcp.safe_reader(data.location),
                    planner=_dcp.safe_load_planner(flatten_state_dict=False, flatten_sharded_tensors=False),
                    no_dist=True,
                )
        except CheckpointError as error:
            raise CheckpointError(source, error.problem) from error
        except _dcp.ERRORS as error:
            raise CheckpointError(source, f"could not be read: {_dcp.describe(error)}") from error
        mapping = index.planner_data or {key: (key,) for key in flat}
        nested = unflatten_state_dict(flat, mapping)
        payload = {
            "stratagem": {
                **meta,
                "format_version": FORMAT_VERSION,
                "format": "full",
                "torch_version": str(torch.__version__),
                "stratagem_version": __version__,
                "consolidated_from": {"path": str(source), "format": "sharded", **_versions(meta)},
            },
            "model": nested.get("model", {}),
            "optimizers": nested.get("optimizers", {}),
            "state": data.read_state(),
        }
        try:
            _write.full(_publish.destination(output), payload)
        except Exception as error:
            raise CheckpointError(output, f"could not be written: {type(error).__name__}: {error}") from error
        del payload, nested, flat
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return output


def _versions(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: meta[k] for k in ("torch_version", "stratagem_version") if k in meta}
