"""Hugging Face exports: from a stratagem checkpoint offline (one process, tensor by tensor), or from a running
model's sharded state (every rank writing the parts it holds, nothing gathered).

Offline, memory holds one group of tensors at a time: one tensor of a full checkpoint (read from a mapped
file), a group of at most one output shard's size from a sharded one (one ``torch.distributed.checkpoint``
read per group), the whole module of a DeepSpeed-layout checkpoint (DeepSpeed's merge of its partitions is
all-or-nothing). The optimizer state is not exported: a Hugging Face folder holds weights.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _dcp, _read, _store
from stratagem.checkpoint._hf_names import resolve_adapter, transformers_prefix, with_prefix
from stratagem.checkpoint._hf_progress import Progress, agree
from stratagem.checkpoint._hf_shards import WeightShard, transfers
from stratagem.checkpoint._hf_write import (
    ExportPlan,
    Files,
    Held,
    companions,
    plan_export,
    publish,
    staging_dir,
    storage_of,
)
from stratagem.checkpoint._read import LocalSource, Source, StoreSource
from stratagem.checkpoint._safetensors import nbytes, parse_size
from stratagem.checkpoint._weights import _layout_weights, layout_strategy, read_plain_state
from stratagem.errors import CheckpointError


def import_adapter(path: str) -> Any:
    """``module:name`` (a function, an object, or a class made without arguments)."""
    module, _, name = path.partition(":")
    try:
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError) as error:
        raise CheckpointError(path, f"cannot be imported as an adapter (module:name): {error}") from error
    return target() if isinstance(target, type) else target


def _names(record: dict[str, Any], adapter: Any, prefix: str | None) -> Callable[[str], Any]:
    if isinstance(adapter, str):
        adapter = import_adapter(adapter)
    if adapter is None and record.get("adapter"):
        adapter = import_adapter(record["adapter"])
    if adapter is not None:
        return resolve_adapter(None, adapter)[0]
    return with_prefix(record.get("prefix", "") if prefix is None else prefix)


# -------------------------------------------------------------------------------------------------
# offline, from a checkpoint
# -------------------------------------------------------------------------------------------------


def export_checkpoint(
    checkpoint: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    module: str = "model",
    adapter: Any = None,
    prefix: str | None = None,
    config_from: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write module ``module`` of a stratagem checkpoint (full or sharded, any strategy, local or on a store) as
    a Hugging Face folder at ``output`` (a directory or a store prefix), in one process.

    The names go through ``adapter`` (a function, an object with ``to_hf``, or its ``module:name``), else the
    one the run recorded when it loaded Hugging Face weights, else the ``prefix`` dropped (default: the one
    recorded). The config and tokenizer files are copied from ``config_from``, else the folder the run started
    from. Returns what was written: files, tensors, bytes; ``peak_bytes``, the most bytes of tensors it held in
    memory at once (a full checkpoint's are mapped from its file, not counted: ``mapped``).
    """
    source = _read.source(checkpoint)
    target = _store.location(output)
    record = dict(read_plain_state(source.location).get("hf") or {})
    to_hf = _names(record, adapter, prefix)
    tensors = _TensorsOf(source, module)
    with tensors as (listing, groups):
        plan = plan_export(listing, to_hf, dict(record.get("tied") or {}), _bytes(max_shard_size))
        staging = staging_dir(target, overwrite)
        try:
            held = Held(foreign=tensors.mapped)
            files = Files(staging, plan.output, held)
            files.create()
            progress = Progress("export", plan.output.total_size, enabled=True)
            for group in groups(plan, held):
                for name in list(group):
                    tensor = group.pop(name)  # let go once written: the next group is read in its place
                    _write_whole(files, plan, name, tensor)
                    progress.advance(tensor.numel() * tensor.element_size())
                    del tensor
            files.close()
            progress.close()
            folder = str(config_from) if config_from is not None else record.get("source")
            extra = companions(folder, None, {p.dtype for p in plan.output.tensors.values()})
            publish(staging, target, plan.output, extra)
        except BaseException:
            if isinstance(target, Path):
                shutil.rmtree(staging, ignore_errors=True)
            raise
    return {
        "output": str(target),
        "files": sorted(plan.output.files),
        "tensors": len(plan.output.tensors),
        "bytes": plan.output.total_size,
        "peak_bytes": held.peak,
        "mapped": bool(tensors.mapped),
        "copied": sorted(extra),
    }


def _bytes(max_shard_size: int | str) -> int:
    try:
        return parse_size(max_shard_size)
    except ValueError as error:
        raise CheckpointError("(export)", str(error)) from error


def _write_whole(files: Files, plan: ExportPlan, name: str, tensor: torch.Tensor) -> None:
    shard = WeightShard(name, tuple(tensor.shape), tensor.contiguous(), offsets=(0,) * tensor.dim())
    for link in plan.links.get(name, []):
        for transfer in transfers(shard, link, plan.output.tensors[link.hf].shape):
            files.write(transfer)


class _TensorsOf:
    """``(listing, groups)``: the module's tensors ``(name, shape, dtype)`` in order, and a function
    ``groups(plan, held)`` that yields them in groups ``{name: tensor}``, counting in ``held`` what it reads
    into memory; a context manager, for the scratch copy of a full checkpoint on a store."""

    def __init__(self, source: Source, module: str) -> None:
        self.source, self.module, self.scratch = source, module, None
        #: The memory of a full checkpoint's tensors, mapped from its file: paged in as each is written.
        self.mapped: set[int] = set()

    def __enter__(self) -> tuple[list[Any], Callable[[ExportPlan, Held], Iterator[dict[str, torch.Tensor]]]]:
        source = self.source
        if source.format() == "full":
            if isinstance(source, StoreSource):  # mapped from a local copy, never read whole into memory
                self.scratch = tempfile.mkdtemp(prefix="stratagem-export-")
                local = Path(self.scratch) / "checkpoint"
                fs, path = _store.filesystem(source.location)
                fs.get_file(path, str(local))
                source = LocalSource(local)
            models = source.read_full().get("model", {})
            if self.module not in models:
                raise CheckpointError(
                    self.source.location, f"has no module {self.module!r}; it holds {sorted(models)}."
                )
            tensors = {k: v for k, v in models[self.module].items() if isinstance(v, torch.Tensor)}
            self.mapped = {storage_of(v) for v in tensors.values()}
            return _listing(tensors), lambda plan, held: ({k: v} for k, v in tensors.items())
        strategy = layout_strategy(source)
        if strategy is not None:
            tensors = _layout_weights(strategy, source.location, self.module)  # type: ignore[arg-type]
            return _listing(tensors), lambda plan, held: iter([_counted(held, tensors)])
        return _dcp_tensors(source, self.module)

    def __exit__(self, *exc: Any) -> None:
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)


def _counted(held: Held, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    for tensor in tensors.values():
        held.add(tensor)
    return dict(tensors)


def _listing(tensors: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    return [(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]


def _dcp_tensors(sharded: Source, module: str) -> tuple[list[Any], Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source, data = sharded.location, sharded.data(sharded.metadata()).location
    index = _dcp.read_metadata(data)
    prefix = f"model.{module}."
    listing = [
        (key[len(prefix) :], tuple(item.size), item.properties.dtype)
        for key, item in index.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    ]
    if not listing:
        raise CheckpointError(source, f"has no module {module!r}.")

    def groups(plan: ExportPlan, held: Held) -> Iterator[dict[str, torch.Tensor]]:
        # One DCP read per group of at most one output shard's size: few reads of the index, bounded memory.
        limit = max(size for _, size in plan.output.files.values())
        group: list[Any] = []
        for item in listing:
            if group and sum(nbytes(s, d) for _, s, d in group) + nbytes(item[1], item[2]) > limit:
                yield _counted(held, _read_group(source, data, prefix, group))
                group = []
            group.append(item)
        if group:
            yield _counted(held, _read_group(source, data, prefix, group))

    return listing, groups


def _read_group(source: Any, data: Any, prefix: str, group: list[Any]) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    flat = {prefix + name: torch.empty(shape, dtype=dtype) for name, shape, dtype in group}
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                flat,
                storage_reader=_dcp.safe_reader(data),
                planner=_dcp.safe_load_planner(
                    flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True
                ),
                no_dist=True,
            )
    except _dcp.ERRORS as error:
        raise CheckpointError(source, f"could not be read: {_dcp.describe(error)}") from error
    return {name[len(prefix) :]: value for name, value in flat.items()}


# -------------------------------------------------------------------------------------------------
# from a running model: every rank writes what it holds
# -------------------------------------------------------------------------------------------------


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a wrapper that only holds it as ``.module`` (DDP, DeepSpeed's)."""
    while set(model._modules) == {"module"} and not model._parameters and not model._buffers:
        model = model.module  # type: ignore[assignment]
    return model


def save_live(
    strategy: Any,
    shards: list[WeightShard],
    module: torch.nn.Module,
    output: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
) -> dict[str, Any]:
    """Every rank: write the running model's weights as a Hugging Face folder, each part by one rank that holds
    it (collective). ``module``: the user's unwrapped module (its names, adapter, config, record)."""
    import torch.distributed as dist

    from stratagem.checkpoint._hf_match import tied_names

    target = _store.location(output)
    to_hf, _ = resolve_adapter(module, None)
    mine = {s.name: (s.shape, s.tensor.dtype) for s in shards}
    # Every rank plans the same files from what all ranks hold (a pipeline stage holds its tensors only).
    held_here = (mine, [s.key for s in shards], tied_names(module))
    gathered: list[Any] = [held_here]
    if strategy.world_size > 1:
        gathered = [None] * strategy.world_size
        dist.all_gather_object(gathered, held_here)
    listing: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    writer: dict[Any, int] = {}
    tied: dict[str, str] = {}
    for rank, (names, held, aliases) in enumerate(gathered):
        for name, value in names.items():
            listing.setdefault(name, value)
        for key in held:
            writer.setdefault(key, rank)  # the lowest rank that holds a part writes it
        tied.update(aliases)
    tensors = [(n, s, d) for n, (s, d) in listing.items()]
    plan = plan_export(tensors, to_hf, tied, parse_size(max_shard_size))
    staging, error = None, None
    started = time.monotonic()
    if strategy.is_global_zero:
        try:
            staging = staging_dir(target, overwrite)
            Files(staging, plan.output).create()
        except Exception as exc:
            error = exc
    agree(strategy, target, error, "starting the Hugging Face export")
    staging = Path(strategy.broadcast(str(staging), 0))
    # The shards are the model's own memory; what the export holds beyond them is its casts and copies.
    files = Files(staging, plan.output, Held(foreign={storage_of(s.tensor) for s in shards}))
    try:
        _write_held(strategy, shards, writer, plan, files, staging)
    except Exception as exc:
        error = exc
    files.close()
    agree(strategy, target, error, "writing the Hugging Face export")
    written = time.monotonic()
    if strategy.is_global_zero:
        try:
            publish(staging, target, plan.output, _live_companions(module, plan))
        except Exception as exc:
            error = exc
    agree(strategy, target, error, "publishing the Hugging Face export")
    return {
        "output": str(target),
        "files": sorted(plan.output.files),
        "bytes": plan.output.total_size,
        "bytes_written": files.bytes_written,
        "peak_bytes": files.held.peak,
        # Seconds on this rank: planning and writing its parts; rank 0 publishing (with its fsyncs).
        "seconds_writing": written - started,
        "seconds_publishing": time.monotonic() - written,
    }


def _write_held(
    strategy: Any,
    shards: list[WeightShard],
    writer: dict[Any, int],
    plan: ExportPlan,
    files: Files,
    staging: Path,
) -> None:
    if not staging.is_dir():
        raise CheckpointError(
            staging,
            "is not visible from this rank: export to a file system every rank sees (or save a checkpoint and "
            "export it offline with `stratagem checkpoint export`).",
        )
    progress = Progress(
        "export", plan.output.total_size // strategy.world_size, enabled=strategy.is_global_zero
    )
    for shard in shards:
        if writer[shard.key] != strategy.rank:
            continue
        for link in plan.links.get(shard.name, []):
            for transfer in transfers(shard, link, plan.output.tensors[link.hf].shape):
                files.write(transfer)
                progress.advance(transfer.local.numel() * transfer.local.element_size())
    progress.close()


def _live_companions(module: torch.nn.Module, plan: ExportPlan) -> dict[str, bytes]:
    """The files the run started from, else the ``transformers`` model's config."""
    from stratagem.checkpoint._hf_load import RECORD

    record = module.__dict__.get(RECORD) or {}
    prefix, _ = transformers_prefix(module)
    hf = None if prefix is None else (module.get_submodule(prefix[:-1]) if prefix else module)
    dtypes = {p.dtype for p in plan.output.tensors.values()}
    return companions(record.get("source"), getattr(hf, "config", None), dtypes)
