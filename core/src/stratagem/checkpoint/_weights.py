"""Reading one module's whole weights and the plain state out of any checkpoint, offline, in one process
without a process group: a full file, a sharded DCP directory (resharded into whole tensors, whatever world
size or mesh wrote it), or a strategy's own layout (through the strategy's class), local or on a store."""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _dcp, _read
from stratagem.checkpoint._read import LocalSource, Source
from stratagem.errors import CheckpointError


def layout_strategy(source: Source) -> Any:
    """The class of the strategy that wrote ``source`` in a layout of its own (``stratagem.json`` names the
    ``layout``), or ``None`` for stratagem's own formats. Such layouts live on local disks."""
    if not isinstance(source, LocalSource) or not source.location.is_dir():
        return None
    meta = source.metadata()
    layout = meta.get("layout")
    if not layout:
        return None
    from stratagem.registry._manager import get_registry

    strategy = meta.get("strategy")
    try:
        return get_registry().get(strategy).resolve_factory()
    except Exception as error:
        raise CheckpointError(
            source.location,
            f"is a {layout!r}-layout checkpoint of strategy {strategy!r}, which cannot be loaded here to read "
            f"it: {error}",
        ) from error


def read_plain_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The plain entries of a checkpoint's state (``progress``, ``hyperparameters``, ...)."""
    source = _read.source(path)
    if source.format() == "full":
        state = source.read_full().get("state", {})
        return state if isinstance(state, dict) else {}
    meta = source.metadata()
    if meta.get("layout"):
        return source.read_state()
    return source.data(meta).read_state()


def read_module_weights(path: str | os.PathLike[str], key: str = "model") -> dict[str, torch.Tensor]:
    """The whole tensors of module ``key`` of the checkpoint at ``path``, on CPU, by parameter name."""
    source = _read.source(path)
    if source.format() == "full":
        models = source.read_full().get("model", {})
        if key not in models:
            raise CheckpointError(source.location, f"has no module {key!r}; it holds {sorted(models)}.")
        return dict(models[key])
    strategy = layout_strategy(source)
    if strategy is not None:
        return _layout_weights(strategy, source.location, key)
    return _dcp_weights(source, key)


def _dcp_weights(sharded: Source, key: str) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    source, data = sharded.location, sharded.data(sharded.metadata()).location
    index = _dcp.read_metadata(data)
    prefix = f"model.{key}."
    flat: dict[str, Any] = {
        name: torch.empty(tuple(item.size), dtype=item.properties.dtype)
        for name, item in index.state_dict_metadata.items()
        if name.startswith(prefix) and isinstance(item, TensorStorageMetadata)
    }
    if not flat:
        raise CheckpointError(source, f"has no module {key!r}.")
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
    except CheckpointError as error:
        raise CheckpointError(source, error.problem) from error
    except _dcp.ERRORS as error:
        raise CheckpointError(source, f"could not be read: {_dcp.describe(error)}") from error
    return {name[len(prefix) :]: value for name, value in flat.items()}


def _layout_weights(strategy: Any, source: Path, key: str) -> dict[str, torch.Tensor]:
    """Through the strategy's ``module_weights(source, key)`` if it has one, else its ``consolidate`` into a
    scratch file (the convention ``stratagem checkpoint consolidate`` relies on)."""
    reader = getattr(strategy, "module_weights", None)
    if callable(reader):
        return dict(reader(source, key))
    consolidate = getattr(strategy, "consolidate", None)
    if not callable(consolidate):
        raise CheckpointError(
            source,
            f"uses a layout of strategy {strategy.__name__}, which offers neither module_weights() nor "
            "consolidate() to read it.",
        )
    with tempfile.TemporaryDirectory(prefix="stratagem-weights-") as scratch:
        output = Path(scratch) / "full.ckpt"
        consolidate(source, output)
        models = LocalSource(output).read_full().get("model", {})
    if key not in models:
        raise CheckpointError(source, f"has no module {key!r}; it holds {sorted(models)}.")
    return dict(models[key])
