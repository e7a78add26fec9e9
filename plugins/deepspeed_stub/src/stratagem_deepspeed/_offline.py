"""Reading a DeepSpeed-format stratagem checkpoint offline, in one process without a process group: the whole
weights of one module (``Module.load_from_checkpoint``, a module loaded without its optimizer), or the whole
checkpoint as one full stratagem file (``stratagem checkpoint consolidate``).

No pickled code: DeepSpeed writes its optimizer files with three of its own classes pickled inside and reads
them back with ``torch.load(weights_only=False)``, which would run whatever a crafted file asks for. Every read
of a DeepSpeed directory (``Engine.load``, a resume, :func:`consolidate`) runs inside
:func:`weights_only_loads`, which turns DeepSpeed's loads into ``weights_only=True`` loads with exactly those
three classes allowed; anything else in a file is refused.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any

import torch

import stratagem
from stratagem.checkpoint import layouts
from stratagem.checkpoint.layouts import read_sharded_state as _read_state
from stratagem.errors import CheckpointError

#: ``stratagem.json``'s ``layout`` for a DeepSpeed directory (a stratagem DCP directory has none).
LAYOUT = "deepspeed"


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


def read_metadata(path: Path) -> dict[str, Any]:
    from stratagem.checkpoint.layouts import read_json_metadata

    meta = read_json_metadata(path)
    if meta.get("layout") != LAYOUT:
        raise CheckpointError(path, "is not a DeepSpeed-format stratagem checkpoint.")
    return meta


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


def module_weights(source: str | Path, key: str = "model") -> dict[str, torch.Tensor]:
    """The whole fp32 weights (and buffers) of module ``key``, by parameter name (``Module.load_from_checkpoint``
    reads a DeepSpeed checkpoint through this, as does a module loaded without its optimizer)."""
    source = layouts.recover(Path(source))
    engines = read_metadata(source).get("engines", {})
    if key not in engines:
        raise CheckpointError(source, f"has no module {key!r}; it holds {sorted(engines)}.")
    try:
        weights, _ = _consolidate_engine(source / engines[key]["tag"], with_optimizer=False)
    except CheckpointError:
        raise
    except Exception as error:
        raise CheckpointError(
            source, f"could not read the weights of module {key!r}: {type(error).__name__}: {error}"
        ) from error
    return weights
