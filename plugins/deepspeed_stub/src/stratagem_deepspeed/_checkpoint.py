"""The ``sharded`` format of the DeepSpeed strategies: DeepSpeed's own checkpoint directory, plus stratagem's
``stratagem.json`` and ``state.pt`` (the plain entries, readable with ``weights_only=True``).

Every read of DeepSpeed's files goes through :func:`~stratagem_deepspeed._offline.weights_only_loads` (no
pickled code runs). A module loaded with its optimizer goes through DeepSpeed's own loader (same world size);
a module alone (``Trainer.test(ckpt_path=...)``, a model set up without optimizer) takes the whole weights read
offline, at any world size.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from stratagem.checkpoint import layouts
from stratagem.checkpoint.layouts import METADATA_FILE, STATE_FILE, metadata, owner_of
from stratagem.checkpoint.layouts import agree as _agree
from stratagem.checkpoint.layouts import attempt as _attempt
from stratagem.checkpoint.layouts import gather_per_rank as _gather_per_rank
from stratagem.checkpoint.layouts import local_state as _local_state
from stratagem.checkpoint.layouts import read_sharded_state as _read_state
from stratagem.checkpoint.layouts import restore_plain as _restore_plain
from stratagem.checkpoint.layouts import split_state as classify
from stratagem.errors import CheckpointError
from stratagem_deepspeed import _state
from stratagem_deepspeed._offline import (
    LAYOUT,
    _quiet,
    consolidate,
    module_weights,
    read_metadata,
    weights_only_loads,
)

__all__ = ["consolidate", "is_deepspeed_checkpoint", "load_sharded", "save_sharded", "weights_only_loads"]


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    directory = layouts.recover(Path(path))
    if not (directory / METADATA_FILE).is_file():
        return False
    try:
        return json.loads((directory / METADATA_FILE).read_text()).get("layout") == LAYOUT
    except (OSError, ValueError):
        return False


def _engines(state_parts: Any) -> dict[str, tuple[Any, str | None]]:
    """``{module key: (engine, optimizer key or None)}`` for the modules of ``state``."""
    from stratagem_deepspeed._wrappers import _optimizer_engine, _wrapper

    engines: dict[str, tuple[Any, str | None]] = {}
    for key, module in state_parts.modules.items():
        wrapper = _wrapper(module)
        if wrapper.__dict__["engine"] is None:
            raise CheckpointError(
                "(state)", f"module {key!r} has no DeepSpeed engine yet: set it up with its optimizer first."
            )
        engines[key] = (wrapper.__dict__["engine"], None)
    for key, optimizer in state_parts.optimizers.items():
        owner = owner_of(optimizer, state_parts.modules)
        module_key = next(k for k, m in state_parts.modules.items() if m is owner)
        engine = _optimizer_engine(optimizer)
        engines[module_key] = (engine, key)
    return engines


# -------------------------------------------------------------------------------------------------
# save
# -------------------------------------------------------------------------------------------------


def save_sharded(strategy: Any, path: str | Path, state: dict[str, Any]) -> None:
    if "://" in str(path) and not str(path).startswith("file://"):
        # Path("s3://b/x") is the local directory "s3:/b/x": refuse rather than write beside the script.
        raise CheckpointError(
            path,
            "DeepSpeed's own sharded layout is written to local disks only; save format='full' to an object "
            "store, or save sharded locally.",
        )
    target = Path(path)
    parts = classify(state)
    tmp = Path(strategy.broadcast(str(layouts.temporary_sibling(target)), 0))
    engines, error = _attempt(_engines, parts)
    if error is None:
        local, error = _attempt(_local_state, parts)
    if error is None and strategy.is_global_zero:

        def make_directory() -> None:
            if target.is_file():
                raise CheckpointError(
                    target, "is a file; a sharded checkpoint is a directory. Choose another path."
                )
            layouts.recover(target)
            layouts.remove_stale_temporaries(target)
            tmp.mkdir(parents=True)

        _, error = _attempt(make_directory)
    _agree(strategy, target, error)
    try:
        plain, error = _attempt(_gather_per_rank, strategy, local)
        _agree(strategy, target, error)
        for key, (engine, optimizer_key) in sorted(engines.items()):
            # Every rank writes its own partitions; DeepSpeed synchronises the ranks itself.
            _, error = _attempt(_save_engine, engine, tmp, key, optimizer_key is not None)
            _agree(strategy, target, error)

        def write_rest() -> None:
            torch.save(plain, tmp / STATE_FILE)
            extra = {
                "layout": LAYOUT,
                "deepspeed_version": _deepspeed_version(),
                "zero_stage": strategy.zero_stage,
                "engines": {
                    key: {"tag": key, "optimizer": opt_key, "zero_stage": _stage(engine)}
                    for key, (engine, opt_key) in engines.items()
                },
                "loading": "DeepSpeed's files are read weights-only, with only LossScaler, ZeroStageEnum and "
                "fragment_address allowed besides tensors and builtins.",
            }
            meta = metadata(strategy, "sharded", parts, extra)
            (tmp / METADATA_FILE).write_text(json.dumps(meta, indent=2))
            layouts.fsync_tree(tmp)
            layouts.publish_directory(tmp, target)

        if strategy.is_global_zero:
            _, error = _attempt(write_rest)
        _agree(strategy, target, error)
    except BaseException:
        if strategy.is_global_zero:
            layouts.remove(tmp)
        raise


def _save_engine(engine: Any, directory: Path, tag: str, with_optimizer: bool) -> None:
    with _quiet():
        engine.save_checkpoint(
            str(directory), tag=tag, client_state={}, save_latest=False, exclude_frozen_parameters=False
        )


def _stage(engine: Any) -> int:
    from stratagem_deepspeed._runtime import zero_stage

    return zero_stage(engine)


def _deepspeed_version() -> str:
    import deepspeed

    return str(deepspeed.__version__)


#: The only non-tensor classes DeepSpeed 0.19 pickles into its checkpoint files.
# -------------------------------------------------------------------------------------------------
# load
# -------------------------------------------------------------------------------------------------


def load_sharded(strategy: Any, path: str | Path, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    source = layouts.recover(Path(path))
    meta = read_metadata(source)
    parts = classify(state)
    plan, error = _attempt(_loading_plan, parts)
    _agree(strategy, source, error)
    saved_engines = meta.get("engines", {})
    saved_world = meta.get("world_size")
    with_optimizer = {
        key: optimizer_key is not None and (saved_engines.get(key) or {}).get("optimizer") is not None
        for key, (_, optimizer_key) in plan.items()
    }
    if any(with_optimizer.values()) and saved_world != strategy.world_size:
        raise CheckpointError(
            source,
            f"is a DeepSpeed checkpoint of {saved_world} processes; this run has {strategy.world_size}. "
            f"DeepSpeed's partitions load only at the same world size: turn it into a full checkpoint with "
            f"`stratagem checkpoint consolidate {source} FILE` and load that.",
        )
    for key, (wrapper, optimizer_key) in sorted(plan.items()):
        if key not in saved_engines:
            if strict:
                raise CheckpointError(source, f"has no module {key!r}; it holds {sorted(saved_engines)}.")
            continue
        if optimizer_key is not None and not with_optimizer[key] and strict:
            raise CheckpointError(source, f"has no optimizer state for {optimizer_key!r}.")
        if with_optimizer[key]:
            _, error = _attempt(_load_with_optimizer, wrapper.__dict__["engine"], source, key, strict)
        else:
            _, error = _attempt(_load_module_only, wrapper, source, key, strict)
        _agree(strategy, source, error)
    return _restore_plain(strategy, parts, _read_state(source), strict, source)


def _loading_plan(parts: Any) -> dict[str, tuple[Any, str | None]]:
    """``{module key: (its DeepSpeedModule, the key of its optimizer in the state, or None)}``."""
    from stratagem_deepspeed._wrappers import _wrapper

    plan: dict[str, tuple[Any, str | None]] = {key: (_wrapper(m), None) for key, m in parts.modules.items()}
    for optimizer_key, optimizer in parts.optimizers.items():
        owner = owner_of(optimizer, parts.modules)
        module_key = next(k for k, m in parts.modules.items() if m is owner)
        plan[module_key] = (plan[module_key][0], optimizer_key)
    return plan


def _load_with_optimizer(engine: Any, source: Path, key: str, strict: bool) -> None:
    with _quiet(), weights_only_loads():
        loaded, _ = engine.load_checkpoint(
            str(source),
            tag=key,
            load_module_strict=strict,
            load_optimizer_states=True,
            # A scheduler of the DeepSpeed config's own; the Trainer's are plain state entries.
            load_lr_scheduler_states=engine.lr_scheduler is not None,
        )
    if loaded is None:
        raise CheckpointError(source, f"DeepSpeed found no checkpoint under tag {key!r}.")


def _load_module_only(wrapper: Any, source: Path, key: str, strict: bool) -> None:
    """The module's whole weights (every rank reads them), written into its partitions and, when it trains,
    into DeepSpeed's fp32 master copy."""
    engine = None if wrapper.__dict__.get("evaluation_only") else wrapper.__dict__["engine"]
    _state.load_full_module_state(wrapper.module, module_weights(source, key), engine, strict)
