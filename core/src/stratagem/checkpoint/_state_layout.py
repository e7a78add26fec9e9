"""How a live ``state`` dict maps onto a checkpoint, and the checks on what is stored.

``state`` holds modules, optimizers, stateful objects (anything with ``state_dict``/``load_state_dict``:
LR schedulers, a gradient scaler, a sampler) and plain values. A checkpoint stores:

- ``model``: ``{key: module state dict}`` for every module of ``state``;
- ``optimizers``: ``{key: optimizer state dict}`` keyed by parameter name (not by id), so it loads under any
  strategy;
- ``state``: the state dicts of stateful objects and the plain values, plain tensors and builtins only.
"""

from __future__ import annotations

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
#: On an object store a sharded checkpoint's files are under ``<checkpoint>/<DATA_PREFIX><id>/``, and its
#: ``stratagem.json`` (the manifest, written last) names the one in use.
DATA_PREFIX = "data-"
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
