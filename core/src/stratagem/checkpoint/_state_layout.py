"""How a live ``state`` dict maps onto a checkpoint, and the checks on what is stored.

``state`` holds modules, optimizers, stateful objects (anything with ``state_dict``/``load_state_dict``:
LR schedulers, a gradient scaler, a sampler) and plain values. A checkpoint stores:

- ``model``: ``{key: module state dict}`` for every module of ``state``;
- ``optimizers``: ``{key: optimizer state dict}`` keyed by parameter name (not by id), so it loads under any
  strategy;
- ``state``: the state dicts of stateful objects and the plain values, plain tensors and builtins only.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

import attrs
import torch

from stratagem.errors import CheckpointError

#: The version of the checkpoint format, recorded in every checkpoint's metadata.
FORMAT_VERSION = 1
#: The JSON metadata file of a sharded checkpoint directory (format, strategy, world size, versions).
METADATA_FILE = "stratagem.json"
#: The file of a sharded checkpoint directory that holds its plain state (step, RNG states, extras).
STATE_FILE = "state.pt"
_PER_RANK = "__stratagem_per_rank__"


@attrs.frozen
class PerRank:
    """A value that differs between ranks (RNG states): every rank's is saved, each rank gets its own back.

    On load at another world size, rank ``r`` gets the value saved by rank ``r % saved_world_size``.
    """

    value: Any


@attrs.define
class Parts:
    """A checkpoint's ``state`` sorted by what each entry is: modules, optimizers, objects with a
    ``state_dict``, and plain values."""

    modules: dict[str, torch.nn.Module] = attrs.field(factory=dict)
    optimizers: dict[str, Any] = attrs.field(factory=dict)
    stateful: dict[str, Any] = attrs.field(factory=dict)
    plain: dict[str, Any] = attrs.field(factory=dict)


def _is_optimizer(obj: Any) -> bool:
    return isinstance(obj, torch.optim.Optimizer) or (
        hasattr(obj, "param_groups") and hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")
    )


def classify(state: dict[str, Any]) -> Parts:
    """Sort ``state`` into :class:`Parts`; keys must be strings."""
    parts = Parts()
    for key, value in state.items():
        if not isinstance(key, str):
            raise CheckpointError("(state)", f"state keys must be strings, got {key!r}")
        if isinstance(value, torch.nn.Module):
            parts.modules[key] = value
        elif _is_optimizer(value):
            parts.optimizers[key] = value
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            parts.stateful[key] = value
        else:
            parts.plain[key] = value
    return parts


def owner_of(optimizer: Any, modules: dict[str, torch.nn.Module]) -> torch.nn.Module:
    """The module of ``state`` whose parameters the optimizer updates."""
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for module in modules.values():
        if any(id(p) in ids for p in module.parameters()):
            return module
    raise CheckpointError(
        "(state)",
        "an optimizer in the state updates none of the state's modules' parameters; put its model in the "
        "state too (state = {'model': model, 'optimizer': optimizer}).",
    )


_ALLOWED_LEAVES = (
    torch.Tensor,
    int,
    float,
    bool,
    str,
    bytes,
    type(None),
    torch.dtype,
    torch.device,
    torch.Size,
)


def check_plain(value: Any, where: str, *, whole: bool = False) -> None:
    """Refuse what ``torch.load(weights_only=True)`` could not read back, naming the place.

    ``whole``: tensors must be whole plain tensors (a full checkpoint), not shards (``DTensor``) or other
    tensor subclasses.
    """
    if isinstance(value, torch.Tensor):
        if whole and type(value) not in (torch.Tensor, torch.nn.Parameter):
            raise CheckpointError(
                "(state)",
                f"{where} is a {type(value).__qualname__}, not a whole tensor; a full checkpoint holds gathered "
                "plain tensors (the strategy's module_state_dict/optimizer_state_dict with full=True must "
                "return them).",
            )
        return
    if isinstance(value, _ALLOWED_LEAVES):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]", whole=whole)
        return
    if isinstance(value, dict):
        for k, item in value.items():
            if not isinstance(k, (str, int)):
                raise CheckpointError(
                    "(state)", f"{where} has a key {k!r} of type {type(k).__name__}; use str or int"
                )
            check_plain(item, f"{where}[{k!r}]", whole=whole)
        return
    raise CheckpointError(
        "(state)",
        f"{where} is a {type(value).__module__}.{type(value).__qualname__}; checkpoints hold only tensors and "
        "builtins (so that loading never runs pickled code). Convert it, or give it state_dict/load_state_dict.",
    )


def pack_per_rank(value: Any, gathered: list[Any] | None) -> Any:
    return {_PER_RANK: gathered} if isinstance(value, PerRank) else value


def unpack_per_rank(value: Any, rank: int) -> Any:
    if isinstance(value, dict) and _PER_RANK in value:
        values = value[_PER_RANK]
        return values[rank % len(values)]
    return value


def metadata(strategy: Any, fmt: str, parts: Parts, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metadata every checkpoint records (format, strategy, world size, versions, what it holds)."""
    from stratagem.registry._version import __version__

    return {
        "format_version": FORMAT_VERSION,
        "format": fmt,
        "strategy": strategy.name,
        "world_size": strategy.world_size,
        # str(): torch.__version__ is a TorchVersion, which weights_only loading refuses.
        "torch_version": str(torch.__version__),
        "stratagem_version": __version__,
        "python_version": platform.python_version(),
        "modules": sorted(parts.modules),
        "optimizers": sorted(parts.optimizers),
        **(extra or {}),
    }


def check_metadata(meta: Any, path: Path) -> dict[str, Any]:
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise CheckpointError(path, "has no stratagem metadata; it was not written by stratagem.")
    version = meta["format_version"]
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            path,
            f"uses checkpoint format version {version}, newer than this stratagem reads ({FORMAT_VERSION}). "
            "Upgrade stratagem to load it.",
        )
    return meta


def read_json_metadata(directory: Path | str) -> dict[str, Any]:
    """The ``stratagem.json`` of a sharded checkpoint (on a store: its manifest, written last)."""
    from stratagem.checkpoint import _store

    kind = "prefix" if isinstance(directory, str) else "directory"
    missing = CheckpointError(
        directory,
        f"is a {kind} without {METADATA_FILE}: not a complete stratagem sharded checkpoint (an interrupted "
        "save never publishes one under the final name; check the path).",
    )
    try:
        if isinstance(directory, str):
            text = _store.read_bytes(_store.join(directory, METADATA_FILE)).decode()
        else:
            file = directory / METADATA_FILE
            if not file.is_file():
                raise missing
            text = file.read_text()
    except FileNotFoundError as error:
        raise missing from error
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(directory, f"{METADATA_FILE} is unreadable: {error}") from error
    try:
        meta = json.loads(text)
    except ValueError as error:
        raise CheckpointError(directory, f"{METADATA_FILE} is unreadable: {error}") from error
    return check_metadata(meta, directory)


def sharded_data(directory: Path | str, meta: dict[str, Any]) -> Path | str:
    """Where a sharded checkpoint's DCP files are: the directory itself, or on a store the data prefix that
    its manifest names."""
    if not isinstance(directory, str):
        return directory
    from stratagem.checkpoint import _store

    data = meta.get("data")
    if not isinstance(data, str) or not data.startswith(_store.DATA_PREFIX) or "/" in data:
        raise CheckpointError(
            directory, f"its {METADATA_FILE} names no data prefix; it is not a stratagem manifest."
        )
    return _store.join(directory, data)


def detect_format(path: Path | str) -> str:
    if isinstance(path, str):
        return _detect_remote_format(path)
    if path.is_dir():
        return "sharded"
    if path.is_file():
        return "full"
    raise CheckpointError(path, "does not exist. Pass the path of a checkpoint file or directory.")


def _detect_remote_format(url: str) -> str:
    from stratagem.checkpoint import _store

    try:
        if _store.is_file(url):
            return "full"
        if _store.exists(_store.join(url, METADATA_FILE)):
            return "sharded"
        present = _store.exists(url)
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(url, f"cannot be read: {_store.describe_error(url, error)}") from error
    if present:
        raise CheckpointError(
            url,
            f"holds objects but no {METADATA_FILE} manifest: not a complete checkpoint (a save that did not "
            "finish publishes nothing). Pass the URL of a published checkpoint.",
        )
    raise CheckpointError(url, "does not exist. Pass the URL of a checkpoint object or prefix.")


def describe_mismatch(
    expected: dict[str, tuple[int, ...]], saved: dict[str, tuple[int, ...]]
) -> tuple[list, list, list]:
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    mismatched = sorted(
        (k, saved[k], expected[k])
        for k in set(expected) & set(saved)
        if tuple(saved[k]) != tuple(expected[k])
    )
    return missing, unexpected, mismatched


def mismatch_message(key: str, missing: list, unexpected: list, mismatched: list) -> str:
    lines = [f"the module {key!r} does not match the checkpoint:"]
    if missing:
        lines.append(f"  missing from the checkpoint: {', '.join(missing)}")
    if unexpected:
        lines.append(f"  in the checkpoint but not the model: {', '.join(unexpected)}")
    for name, got, want in mismatched:
        lines.append(f"  shape of {name}: checkpoint {tuple(got)}, model {tuple(want)}")
    lines.append("Pass strict=False to load what fits and report the rest.")
    return "\n".join(lines)
