"""Loading a checkpoint for any strategy, full or sharded, local or on an object store, never running pickled
code: keys and shapes are checked against the model (``strict``), and the strategy converts the saved state
into its own. Every function here runs on every rank."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _dcp, _read
from stratagem.checkpoint._ranks import _distributed, _single_process_quiet
from stratagem.checkpoint._read import Source
from stratagem.checkpoint._state_layout import (
    Parts,
    classify,
    describe_mismatch,
    mismatch_message,
    owner_of,
    unpack_per_rank,
)
from stratagem.errors import CheckpointError


def load(strategy: Any, path: str | Path, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Load on every rank: fill ``state``'s modules, optimizers and stateful objects; return the rest."""
    source = _read.source(path)
    parts = classify(state)
    if source.format() == "full":
        return _load_full(strategy, source, parts, strict)
    return _load_sharded(strategy, source, parts, strict)


def _expected_shapes(strategy: Any, module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """The keys and shapes the model has on any rank: a rank may hold only some of them (a pipeline stage
    holds its own layers), and a key is missing or unexpected only if no rank has it."""
    # A DTensor's shape is the global one, so the sharded state dict gives full shapes without gathering.
    mine = {
        k: tuple(v.shape)
        for k, v in strategy.module_state_dict(module, full=False).items()
        if hasattr(v, "shape")
    }
    if not _distributed() or strategy.world_size == 1:
        return mine
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    union: dict[str, tuple[int, ...]] = {}
    for shapes in every:
        for key, shape in shapes.items():
            union.setdefault(key, shape)
    return union


def _reconcile(
    strategy: Any,
    key: str,
    module: torch.nn.Module,
    saved: dict[str, tuple[int, ...]],
    strict: bool,
    path: Path,
) -> set[str]:
    """Check saved keys and shapes against the model; return the saved keys to drop (``strict=False``)."""
    missing, unexpected, mismatched = describe_mismatch(_expected_shapes(strategy, module), saved)
    if not (missing or unexpected or mismatched):
        return set()
    message = mismatch_message(key, missing, unexpected, mismatched)
    if strict:
        raise CheckpointError(path, message)
    if strategy.is_global_zero:
        warnings.warn(
            f"Checkpoint {path}: loaded what fits; {message.splitlines()[0]}\n"
            + "\n".join(message.splitlines()[1:-1]),
            stacklevel=4,
        )
    return set(unexpected) | {name for name, _, _ in mismatched}


def _restore_plain(
    strategy: Any, parts: Parts, saved_state: dict[str, Any], strict: bool, path: Path
) -> dict[str, Any]:
    """Load the stateful objects' saved state into them; return the rest, with this rank's per-rank values."""
    for key, obj in parts.stateful.items():
        if key not in saved_state:
            if strict:
                raise CheckpointError(
                    path, f"has no state for {key!r}; pass strict=False to keep its current state."
                )
            continue
        _apply(path, f"the state of {key!r}", obj.load_state_dict, saved_state[key])
    return {
        key: unpack_per_rank(value, strategy.rank)
        for key, value in saved_state.items()
        if key not in parts.stateful
    }


def _apply(path: Path, what: str, function: Any, *args: Any, **kwargs: Any) -> None:
    """Run a strategy's conversion, turning its failure into a CheckpointError that says what failed."""
    try:
        function(*args, **kwargs)
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(path, f"could not load {what}: {type(error).__name__}: {error}") from error


def _fitting_optimizer_state(
    strategy: Any, owner: Any, optimizer: Any, saved: dict[str, Any], dropped: set[str], full: bool
) -> dict[str, Any]:
    """With ``strict=False``: the saved optimizer state, except that parameters whose saved state does not
    fit (dropped from the model's load) or is missing keep the optimizer's current state."""
    current = strategy.optimizer_state_dict(owner, optimizer, full=full)
    if not isinstance(saved.get("state"), dict) or not isinstance(current.get("state"), dict):
        return saved
    state = {k: v for k, v in saved["state"].items() if k not in dropped and k in current["state"]}
    for name, value in current["state"].items():
        state.setdefault(name, value)
    groups = current.get("param_groups", [])
    if len(saved.get("param_groups", [])) == len(groups):
        # The current groups' keys (a scheduler adds some), the saved values where the checkpoint has them.
        groups = [
            {**c, **{k: v for k, v in s.items() if k in c and k != "params"}}
            for s, c in zip(saved["param_groups"], groups)
        ]
    return {**saved, "state": state, "param_groups": groups}


def _load_full(strategy: Any, source: Source, parts: Parts, strict: bool) -> dict[str, Any]:
    path = source.location
    payload = source.read_full()
    models, optimizers = payload.get("model", {}), payload.get("optimizers", {})
    dropped: dict[int, set[str]] = {}
    for key, module in parts.modules.items():
        if key not in models:
            if strict:
                raise CheckpointError(path, f"has no module {key!r}; it holds {sorted(models)}.")
            warnings.warn(f"Checkpoint {path}: has no module {key!r}; it keeps its weights.", stacklevel=3)
            continue
        saved = dict(models[key])
        drop = _reconcile(strategy, key, module, {k: tuple(v.shape) for k, v in saved.items()}, strict, path)
        dropped[id(module)] = drop
        for name in drop:
            saved.pop(name, None)
        _apply(
            path, f"module {key!r}", strategy.load_module_state_dict, module, saved, full=True, strict=strict
        )
    for key, optimizer in parts.optimizers.items():
        if key not in optimizers:
            if strict:
                raise CheckpointError(path, f"has no optimizer {key!r}; it holds {sorted(optimizers)}.")
            continue
        owner = owner_of(optimizer, parts.modules)
        osd = optimizers[key]
        if not strict:
            osd = _fitting_optimizer_state(
                strategy, owner, optimizer, osd, dropped.get(id(owner), set()), True
            )
        _apply(
            path, f"optimizer {key!r}", strategy.load_optimizer_state_dict, owner, optimizer, osd, full=True
        )
    return _restore_plain(strategy, parts, payload.get("state", {}), strict, path)


def saved_tensor_shapes(path: Path | str) -> dict[str, tuple[int, ...]]:
    """Flattened key -> global shape of every tensor in a DCP directory, from its index alone."""
    return _dcp.tensor_shapes(_dcp.read_metadata(path))


def _load_sharded(strategy: Any, source: Source, parts: Parts, strict: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    path = source.location
    data = source.data(source.metadata())
    shapes = saved_tensor_shapes(data.location)
    target: dict[str, Any] = {"model": {}, "optimizers": {}}
    dropped: dict[int, set[str]] = {}
    kept: dict[str, dict[str, Any]] = {}
    for key, module in parts.modules.items():
        prefix = f"model.{key}."
        saved = {k[len(prefix) :]: v for k, v in shapes.items() if k.startswith(prefix)}
        if not saved:
            if strict:
                raise CheckpointError(path, f"has no module {key!r}.")
            warnings.warn(f"Checkpoint {path}: has no module {key!r}; it keeps its weights.", stacklevel=3)
            continue
        drop = _reconcile(strategy, key, module, saved, strict, path)
        dropped[id(module)] = drop
        sd = strategy.module_state_dict(module, full=False)
        target["model"][key] = {k: v for k, v in sd.items() if k not in drop and k in saved}
    for key, optimizer in parts.optimizers.items():
        if not any(k.startswith(f"optimizers.{key}.") for k in shapes):
            if strict:
                raise CheckpointError(path, f"has no optimizer {key!r}.")
            continue
        owner = owner_of(optimizer, parts.modules)
        osd = strategy.optimizer_state_dict(owner, optimizer, full=False)
        drop = dropped.get(id(owner), set())
        if drop and isinstance(osd.get("state"), dict):
            # Read the saved state only of parameters that fit; the others keep their current state.
            kept[key] = {k: v for k, v in osd["state"].items() if k in drop}
            osd = {**osd, "state": {k: v for k, v in osd["state"].items() if k not in drop}}
        target["optimizers"][key] = osd
    try:
        with _single_process_quiet():
            dcp.load(
                target,
                storage_reader=_dcp.safe_reader(data.location),
                planner=_dcp.safe_load_planner(allow_partial_load=not strict),
                no_dist=not _distributed(),
            )
    except CheckpointError as error:
        raise CheckpointError(path, error.problem) from error
    except _dcp.ERRORS as error:
        raise CheckpointError(path, f"could not be read: {_dcp.describe(error)}") from error
    for key, module in parts.modules.items():
        if key in target["model"]:
            _apply(
                path,
                f"module {key!r}",
                strategy.load_module_state_dict,
                module,
                target["model"][key],
                full=False,
                strict=strict,
            )
    for key, state in kept.items():
        target["optimizers"][key]["state"].update(state)
    for key, optimizer in parts.optimizers.items():
        if key in target["optimizers"]:
            _apply(
                path,
                f"optimizer {key!r}",
                strategy.load_optimizer_state_dict,
                owner_of(optimizer, parts.modules),
                optimizer,
                target["optimizers"][key],
                full=False,
            )
    return _restore_plain(strategy, parts, data.read_state(), strict, path)
