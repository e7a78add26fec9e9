"""The ``sharded`` format of the DeepSpeed strategies: DeepSpeed's own checkpoint directory, plus stratagem's
``stratagem.json`` and ``state.pt`` (the plain entries, readable with ``weights_only=True``).

No pickled code: DeepSpeed writes its optimizer files with three of its own classes pickled inside and reads
them back with ``torch.load(weights_only=False)``, which would run whatever a crafted file asks for. Every read
of a DeepSpeed directory here (``Engine.load``, a resume, :func:`consolidate`) runs inside
:func:`weights_only_loads`, which turns DeepSpeed's loads into ``weights_only=True`` loads with exactly those
three classes allowed; anything else in a file is refused.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import torch

import stratagem
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

#: ``stratagem.json``'s ``layout`` for a DeepSpeed directory (a stratagem DCP directory has none).
LAYOUT = "deepspeed"


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
DEEPSPEED_CHECKPOINT_CLASSES = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


@contextlib.contextmanager
def weights_only_loads() -> Any:
    """Inside this block, every ``torch.load`` (DeepSpeed's included, which ask for ``weights_only=False``)
    reads weights-only, with just :data:`DEEPSPEED_CHECKPOINT_CLASSES` allowed besides tensors and builtins.

    DeepSpeed offers no switch for this; its loaders call ``torch.load`` through the module, so the block
    replaces that one function and restores it on the way out.
    """
    import importlib

    import torch.serialization

    allowed = [getattr(importlib.import_module(m), name) for m, name in DEEPSPEED_CHECKPOINT_CLASSES]
    original = torch.load

    def load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        with torch.serialization.safe_globals(allowed):
            return original(*args, **kwargs)

    torch.load = load
    try:
        yield
    finally:
        torch.load = original


@contextlib.contextmanager
def _quiet():
    # DeepSpeed prints progress to stdout on every rank; keep a user's output readable.
    with contextlib.redirect_stdout(io.StringIO()):
        yield


# -------------------------------------------------------------------------------------------------
# load
# -------------------------------------------------------------------------------------------------


def read_metadata(path: Path) -> dict[str, Any]:
    from stratagem.checkpoint.layouts import read_json_metadata

    meta = read_json_metadata(path)
    if meta.get("layout") != LAYOUT:
        raise CheckpointError(path, "is not a DeepSpeed-format stratagem checkpoint.")
    return meta


def load_sharded(strategy: Any, path: str | Path, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    source = layouts.recover(Path(path))
    meta = read_metadata(source)
    parts = classify(state)
    saved_world = meta.get("world_size")
    if saved_world != strategy.world_size:
        raise CheckpointError(
            source,
            f"is a DeepSpeed checkpoint of {saved_world} processes; this run has {strategy.world_size}. "
            f"DeepSpeed's partitions load only at the same world size: turn it into a full checkpoint with "
            f"`stratagem checkpoint consolidate {source} FILE` and load that.",
        )
    engines, error = _attempt(_engines, parts)
    _agree(strategy, source, error)
    saved_engines = meta.get("engines", {})
    for key, (engine, optimizer_key) in sorted(engines.items()):
        if key not in saved_engines:
            if strict:
                raise CheckpointError(source, f"has no module {key!r}; it holds {sorted(saved_engines)}.")
            continue
        if optimizer_key is not None and saved_engines[key].get("optimizer") is None and strict:
            raise CheckpointError(source, f"has no optimizer state for {optimizer_key!r}.")
        load_optimizer = optimizer_key is not None and saved_engines[key].get("optimizer") is not None

        def load(engine: Any = engine, key: str = key, load_optimizer: bool = load_optimizer) -> None:
            with _quiet(), weights_only_loads():
                loaded, _ = engine.load_checkpoint(
                    str(source),
                    tag=key,
                    load_module_strict=strict,
                    load_optimizer_states=load_optimizer,
                    # A scheduler of the DeepSpeed config's own; the Trainer's are plain state entries.
                    load_lr_scheduler_states=load_optimizer and engine.lr_scheduler is not None,
                    load_module_only=not load_optimizer,
                )
            if loaded is None:
                raise CheckpointError(source, f"DeepSpeed found no checkpoint under tag {key!r}.")

        _, error = _attempt(load)
        _agree(strategy, source, error)
    return _restore_plain(strategy, parts, _read_state(source), strict, source)


# -------------------------------------------------------------------------------------------------
# offline consolidation
# -------------------------------------------------------------------------------------------------


def consolidate(source: str | Path, output: str | Path) -> Path:
    """Write a DeepSpeed-format stratagem checkpoint as one full stratagem checkpoint file, in one process.

    Consolidated: every module's fp32 weights and buffers, and the optimizer state (per-parameter tensors
    such as Adam's moments and the step count) keyed by parameter name, with the hyperparameters of each
    parameter group; plus the plain entries of ``state.pt``. Not consolidated: DeepSpeed's own bookkeeping
    (loss scaler, engine step counters), which a full checkpoint has no place for. The DeepSpeed files are
    read with DeepSpeed's loader, weights-only (see the module's note).
    """
    from stratagem.checkpoint.layouts import FORMAT_VERSION

    source, output = layouts.recover(Path(source)), Path(output)
    meta = read_metadata(source)
    if output.is_dir():
        raise CheckpointError(output, "is a directory; give the path of the full checkpoint file to write.")
    models: dict[str, Any] = {}
    optimizers: dict[str, Any] = {}
    for key, info in meta.get("engines", {}).items():
        try:
            weights, optimizer = _consolidate_engine(
                source / info["tag"], with_optimizer=bool(info.get("optimizer"))
            )
        except CheckpointError:
            raise
        except Exception as error:
            raise CheckpointError(
                source, f"could not consolidate module {key!r}: {type(error).__name__}: {error}"
            ) from error
        models[key] = weights
        if info.get("optimizer"):
            optimizers[info["optimizer"]] = optimizer
    payload = {
        "stratagem": {
            **{k: v for k, v in meta.items() if k not in ("layout", "engines", "loading")},
            "format_version": FORMAT_VERSION,
            "format": "full",
            "torch_version": str(torch.__version__),
            "stratagem_version": stratagem.__version__,
            "consolidated_from": {
                "path": str(source),
                "format": "sharded",
                "layout": LAYOUT,
                "deepspeed_version": meta.get("deepspeed_version"),
            },
        },
        "model": models,
        "optimizers": optimizers,
        "state": _read_state(source),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    with layouts.atomic_file(output) as tmp:
        torch.save(payload, tmp)
    return output


def _consolidate_engine(tag_dir: Path, *, with_optimizer: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Whole fp32 weights (+ buffers) and the name-keyed optimizer state of one engine's directory."""
    import os

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.utils import zero_to_fp32 as z

    with _quiet(), weights_only_loads():
        model_files = z.get_model_state_files(str(tag_dir))
        model_states = z.parse_model_states(model_files)
        optim_files = z.get_optim_files(str(tag_dir))
        stage, world_size, fp32_groups, paddings = z.parse_optim_states(optim_files, str(tag_dir))
        weights = _merge(z, stage, world_size, fp32_groups, model_states, paddings)
    with weights_only_loads():
        model_file = torch.load(model_files[0], map_location="cpu")
    ordered = {name: weights[name].clone() for name in model_file["module"] if name in weights}
    if not with_optimizer:
        return ordered, {}
    with weights_only_loads():
        optim = [torch.load(f, map_location="cpu")["optimizer_state_dict"] for f in optim_files]
    optimizer_state = _consolidate_optimizer(z, stage, world_size, optim, model_states, paddings, ordered)
    if model_file.get("lr_scheduler") is not None:  # the DeepSpeed config's scheduler, as _state keeps it
        optimizer_state["lr_scheduler"] = model_file["lr_scheduler"]
    return ordered, optimizer_state


def _merge(
    z: Any, stage: int, world_size: int, groups: Any, model_states: Any, paddings: Any
) -> dict[str, Any]:
    if stage <= 2:
        merged = z._get_fp32_state_dict_from_zero2_checkpoint(
            world_size, groups, model_states, False, paddings
        )
    else:
        merged = z._get_fp32_state_dict_from_zero3_checkpoint(world_size, groups, model_states, False)
    return {
        k: (v.contiguous() if hasattr(v, "contiguous") else v) for k, v in z.to_torch_tensor(merged).items()
    }


def _base_states(stage: int, optim: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rank's base optimizer state dict (``{"state": {group: {...}}, "param_groups": [...]}``)."""
    key = "base_optimizer_state" if stage <= 2 else "optimizer_state_dict"
    states = [rank_sd[key] for rank_sd in optim]
    if states and isinstance(states[0], list):  # elastic layout: one entry per group
        states = [{"state": dict(enumerate(s)), "param_groups": []} for s in states]
    return states


def _consolidate_optimizer(
    z: Any,
    stage: int,
    world_size: int,
    optim: list[dict[str, Any]],
    model_states: Any,
    paddings: Any,
    weights: dict[str, Any],
) -> dict[str, Any]:
    bases = _base_states(stage, optim)
    groups = sorted(bases[0]["state"])
    keys = sorted({k for g in groups for k in bases[0]["state"][g]})
    per_key: dict[str, dict[str, Any]] = {}
    scalars: dict[str, Any] = {}
    for key in keys:
        values = [[b["state"][g][key] for g in groups] for b in bases]
        if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values[0]):
            with _quiet():
                per_key[key] = _merge(z, stage, world_size, values, model_states, paddings)
        else:
            scalars[key] = values[0][0]
    # Parameter names per group come from the model states (param_shapes), in the optimizer's order.
    shapes = model_states[0].param_shapes
    group_names = [list(g.keys()) for g in shapes]
    state: dict[str, dict[str, Any]] = {}
    for names in group_names:
        for name in names:
            entry = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()}
            entry.update({k: merged[name].clone() for k, merged in per_key.items() if name in merged})
            state[name] = entry
    param_groups = []
    for index, names in enumerate(group_names):
        saved = bases[0]["param_groups"][index] if index < len(bases[0]["param_groups"]) else {}
        param_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": param_groups}
