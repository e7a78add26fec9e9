"""Saving and loading checkpoints for any strategy, through the strategy's state-dict conversions.

Every function here runs on every rank. A failure on any rank fails the call on all of them with that rank's
error, and the previous checkpoint under the target path stays whole.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import _atomic
from stratagem.checkpoint._layout import (
    METADATA_FILE,
    STATE_FILE,
    Parts,
    PerRank,
    check_metadata,
    check_plain,
    classify,
    describe_mismatch,
    detect_format,
    metadata,
    mismatch_message,
    owner_of,
    pack_per_rank,
    read_json_metadata,
    unpack_per_rank,
)
from stratagem.errors import CheckpointError

# -------------------------------------------------------------------------------------------------
# agreement between ranks
# -------------------------------------------------------------------------------------------------


def _agree(strategy: Any, path: Path, error: BaseException | None) -> None:
    """Raise the same CheckpointError on every rank if any rank failed."""
    failed = strategy.all_reduce(torch.tensor([1.0 if error is not None else 0.0]), "max")
    if float(failed[0]) == 0.0:
        return
    mine = None if error is None else f"{type(error).__name__}: {error}"
    messages = [strategy.broadcast(mine, src) for src in range(strategy.world_size)]
    detail = "; ".join(f"rank {r}: {m}" for r, m in enumerate(messages) if m is not None)
    if isinstance(error, CheckpointError) and strategy.world_size == 1:
        raise error
    raise CheckpointError(
        path, f"failed ({detail}). The previous checkpoint at this path is untouched."
    ) from error


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    # DCP warns on every single-process call that it assumes a single process; that is the intent here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _gather_per_rank(strategy: Any, parts: Parts) -> dict[str, Any]:
    plain = {}
    for key, value in parts.plain.items():
        if isinstance(value, PerRank):
            gathered = [strategy.broadcast(value.value, src) for src in range(strategy.world_size)]
            plain[key] = pack_per_rank(value, gathered)
        else:
            plain[key] = value
    return plain


def _plain_state(strategy: Any, parts: Parts) -> dict[str, Any]:
    state = {key: obj.state_dict() for key, obj in parts.stateful.items()}
    state.update(_gather_per_rank(strategy, parts))
    check_plain(state, "state")
    return state


# -------------------------------------------------------------------------------------------------
# save
# -------------------------------------------------------------------------------------------------


def save(strategy: Any, path: str | Path, state: dict[str, Any], fmt: str) -> None:
    target = Path(path)
    if fmt not in ("full", "sharded"):
        raise CheckpointError(target, f"unknown format {fmt!r}; use 'full' or 'sharded'.")
    parts = classify(state)
    if fmt == "full":
        _save_full(strategy, target, parts)
    else:
        _save_sharded(strategy, target, parts)


def _save_full(strategy: Any, target: Path, parts: Parts) -> None:
    error: BaseException | None = None
    payload: dict[str, Any] = {}
    try:
        payload = {
            "model": {k: strategy.module_state_dict(m, full=True) for k, m in parts.modules.items()},
            "optimizers": {
                k: strategy.optimizer_state_dict(owner_of(o, parts.modules), o, full=True)
                for k, o in parts.optimizers.items()
            },
            "state": _plain_state(strategy, parts),
        }
    except Exception as exc:  # reported on every rank by _agree
        error = exc
    _agree(strategy, target, error)
    if strategy.is_global_zero:
        try:
            payload["stratagem"] = metadata(strategy, "full", parts)
            _atomic.remove_stale_temporaries(target)
            if target.is_dir():
                raise CheckpointError(
                    target, "is a directory; a full checkpoint is one file. Choose another path."
                )
            with _atomic.atomic_file(target) as tmp:
                torch.save(payload, tmp)
        except Exception as exc:
            error = exc
    _agree(strategy, target, error)


def _save_sharded(strategy: Any, target: Path, parts: Parts) -> None:
    import torch.distributed.checkpoint as dcp

    error: BaseException | None = None
    tmp = None
    try:
        tmp = Path(strategy.broadcast(str(_atomic.temporary_sibling(target)), 0))
        if strategy.is_global_zero:
            if target.is_file():
                raise CheckpointError(
                    target, "is a file; a sharded checkpoint is a directory. Choose another path."
                )
            _atomic.remove_stale_temporaries(target)
            tmp.mkdir(parents=True)
    except Exception as exc:
        error = exc
    _agree(strategy, target, error)
    try:
        tensors = {
            "model": {k: strategy.module_state_dict(m, full=False) for k, m in parts.modules.items()},
            "optimizers": {
                k: strategy.optimizer_state_dict(owner_of(o, parts.modules), o, full=False)
                for k, o in parts.optimizers.items()
            },
        }
        plain = _plain_state(strategy, parts)
        with _single_process_quiet():
            dcp.save(tensors, checkpoint_id=str(tmp), no_dist=not _distributed())
        if strategy.is_global_zero:
            torch.save(plain, tmp / STATE_FILE)
            (tmp / METADATA_FILE).write_text(json.dumps(metadata(strategy, "sharded", parts), indent=2))
    except Exception as exc:
        error = exc
    try:
        _agree(strategy, target, error)
    except CheckpointError:
        if strategy.is_global_zero and tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if strategy.is_global_zero:
        try:
            _atomic.publish_directory(tmp, target)
        except Exception as exc:
            error = exc
    _agree(strategy, target, error)


# -------------------------------------------------------------------------------------------------
# load
# -------------------------------------------------------------------------------------------------


def read_full(path: Path) -> dict[str, Any]:
    """Read a full checkpoint file without running any pickled code."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise CheckpointError(
            path, f"cannot be read as a stratagem checkpoint (truncated, corrupt, or not one): {error}"
        ) from error
    if not isinstance(payload, dict):
        raise CheckpointError(path, "holds no stratagem checkpoint (the top level is not a dict).")
    check_metadata(payload.get("stratagem"), path)
    return payload


def load(strategy: Any, path: str | Path, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    source = _atomic.recover(Path(path))
    fmt = detect_format(source)
    parts = classify(state)
    if fmt == "full":
        return _load_full(strategy, source, parts, strict)
    return _load_sharded(strategy, source, parts, strict)


def _expected_shapes(strategy: Any, module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    # A DTensor's shape is the global one, so the sharded state dict gives full shapes without gathering.
    return {
        k: tuple(v.shape)
        for k, v in strategy.module_state_dict(module, full=False).items()
        if hasattr(v, "shape")
    }


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
    for key, obj in parts.stateful.items():
        if key not in saved_state:
            if strict:
                raise CheckpointError(
                    path, f"has no state for {key!r}; pass strict=False to keep its current state."
                )
            continue
        obj.load_state_dict(saved_state[key])
    return {
        key: unpack_per_rank(value, strategy.rank)
        for key, value in saved_state.items()
        if key not in parts.stateful
    }


def _load_full(strategy: Any, path: Path, parts: Parts, strict: bool) -> dict[str, Any]:
    payload = read_full(path)
    models, optimizers = payload.get("model", {}), payload.get("optimizers", {})
    for key, module in parts.modules.items():
        if key not in models:
            raise CheckpointError(path, f"has no module {key!r}; it holds {sorted(models)}.")
        saved = dict(models[key])
        drop = _reconcile(strategy, key, module, {k: tuple(v.shape) for k, v in saved.items()}, strict, path)
        for name in drop:
            saved.pop(name, None)
        strategy.load_module_state_dict(module, saved, full=True, strict=strict)
    for key, optimizer in parts.optimizers.items():
        if key not in optimizers:
            if strict:
                raise CheckpointError(path, f"has no optimizer {key!r}; it holds {sorted(optimizers)}.")
            continue
        strategy.load_optimizer_state_dict(
            owner_of(optimizer, parts.modules), optimizer, optimizers[key], full=True
        )
    return _restore_plain(strategy, parts, payload.get("state", {}), strict, path)


def _safe_load_planner(**kwargs: Any) -> Any:
    """DCP's default load planner, except that non-tensor entries are read with ``weights_only=True``.

    The stock planner unpickles them with ``weights_only=False``, which could run code from a checkpoint.
    """
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafeLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return SafeLoadPlanner(**kwargs)


def saved_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Flattened key -> global shape of every tensor in a DCP directory, from its metadata alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(path)).read_metadata()
    return {
        key: tuple(item.size)
        for key, item in meta.state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }


def _load_sharded(strategy: Any, path: Path, parts: Parts, strict: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    read_json_metadata(path)
    try:
        shapes = saved_tensor_shapes(path)
    except Exception as error:
        raise CheckpointError(
            path, f"its torch.distributed.checkpoint metadata is unreadable: {error}"
        ) from error
    target: dict[str, Any] = {"model": {}, "optimizers": {}}
    for key, module in parts.modules.items():
        prefix = f"model.{key}."
        saved = {k[len(prefix) :]: v for k, v in shapes.items() if k.startswith(prefix)}
        if not saved:
            raise CheckpointError(path, f"has no module {key!r}.")
        drop = _reconcile(strategy, key, module, saved, strict, path)
        sd = strategy.module_state_dict(module, full=False)
        target["model"][key] = {k: v for k, v in sd.items() if k not in drop and k in saved}
    for key, optimizer in parts.optimizers.items():
        if not any(k.startswith(f"optimizers.{key}.") for k in shapes) and not strict:
            continue
        target["optimizers"][key] = strategy.optimizer_state_dict(
            owner_of(optimizer, parts.modules), optimizer, full=False
        )
    try:
        with _single_process_quiet():
            dcp.load(
                target,
                checkpoint_id=str(path),
                planner=_safe_load_planner(allow_partial_load=not strict),
                no_dist=not _distributed(),
            )
    except Exception as error:
        raise CheckpointError(path, f"could not be read: {error}") from error
    for key, module in parts.modules.items():
        strategy.load_module_state_dict(module, target["model"][key], full=False, strict=strict)
    for key, optimizer in parts.optimizers.items():
        if key in target["optimizers"]:
            strategy.load_optimizer_state_dict(
                owner_of(optimizer, parts.modules), optimizer, target["optimizers"][key], full=False
            )
    state_file = path / STATE_FILE
    saved_state: dict[str, Any] = {}
    if state_file.exists():
        try:
            saved_state = torch.load(state_file, map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointError(path, f"{STATE_FILE} is unreadable: {error}") from error
    return _restore_plain(strategy, parts, saved_state, strict, path)
