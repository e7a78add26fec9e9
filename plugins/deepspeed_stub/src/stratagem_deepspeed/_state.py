"""Whole (unpartitioned) model and optimizer state of a live DeepSpeed engine, keyed by parameter name.

Reading uses DeepSpeed's ``safe_get_full_*`` functions: collectives, so every rank calls them in the same
order, and every rank gets the whole tensor. Writing copies each rank's own part from the whole value.

DeepSpeed keeps one fp32 master copy per parameter (flattened and partitioned), separate from the module's
parameters, and the optimizer's state keyed by those flat partitions. So a load writes three places: the
module parameter (what forward uses), the master copy (what the optimizer updates) and the optimizer state.
"""

from __future__ import annotations

from typing import Any

import torch

from stratagem_deepspeed import _runtime


def _safe() -> Any:
    import deepspeed.utils as ds_utils

    return ds_utils


# -------------------------------------------------------------------------------------------------
# module
# -------------------------------------------------------------------------------------------------


def full_module_state(module: torch.nn.Module, engine: Any | None) -> dict[str, torch.Tensor]:
    """Every entry of ``module.state_dict()``, whole, on CPU, on every rank (collective)."""
    ds = _safe()
    result: dict[str, torch.Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        if not isinstance(value, torch.Tensor):
            result[name] = value
            continue
        full = None
        if engine is not None and _runtime.zero_stage(engine) and getattr(value, "requires_grad", False):
            full = ds.safe_get_full_fp32_param(value)
        if full is None:
            with _runtime.gathered([value]):
                full = value.detach().clone()
        result[name] = full.detach().to("cpu", copy=True)
    return result


def load_full_module_state(
    module: torch.nn.Module, state: dict[str, torch.Tensor], engine: Any | None, strict: bool
) -> None:
    """Write whole tensors (the same on every rank) into the module and DeepSpeed's master copy."""
    ds = _safe()
    current = module.state_dict(keep_vars=True)
    if strict:
        missing = sorted(set(current) - set(state))
        unexpected = sorted(set(state) - set(current))
        if missing or unexpected:
            raise KeyError(
                f"state dict does not match the module: missing {missing}, unexpected {unexpected}"
            )
    stage = _runtime.zero_stage(engine) if engine is not None else 0
    for name, target in current.items():
        if name not in state or not isinstance(target, torch.Tensor):
            continue
        value = state[name]
        shape = tuple(getattr(target, "ds_shape", target.shape))
        if tuple(value.shape) != shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)}, model shape {shape}")
        with torch.no_grad(), _runtime.gathered([target], modifier_rank=0):
            target.data.copy_(value.to(target.device, target.dtype))
        if not (stage and target.requires_grad):
            continue
        master = value.to(torch.float32)
        if stage == 3:
            _set_stage3_partition(engine, target, master, None)
        else:
            ds.safe_set_full_fp32_param(target, master.to(target.device))


# -------------------------------------------------------------------------------------------------
# optimizer
# -------------------------------------------------------------------------------------------------


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def full_optimizer_state(engine: Any, groups: list[list[tuple[str, Any]]]) -> dict[str, Any]:
    """``{"state": {name: {...}}, "param_groups": [...]}`` as torch's full optimizer state dict has it.

    :param groups: the user's parameter groups as ``(name, parameter)`` pairs.
    """
    ds = _safe()
    base = _runtime.base_optimizer(engine)
    flats = _runtime.flat_partitions(engine)
    if _runtime.zero_stage(engine) in (1, 2) and any(base.state.get(f) for f in flats):
        # DeepSpeed links each parameter to its slice of the state on the first step; a state loaded from
        # DeepSpeed's checkpoint into a fresh engine is not linked yet.
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    state: dict[str, dict[str, Any]] = {}
    for group_index, group in enumerate(groups):
        for name, param in group:
            flat_state = base.state.get(flats[_runtime.partition_index(engine, param, group_index)], {})
            if not flat_state:
                continue
            entry: dict[str, Any] = {}
            for key, value in flat_state.items():
                if _per_element(value):
                    full = ds.safe_get_full_optimizer_state(param, key)
                    entry[key] = full.detach().to("cpu", copy=True).reshape(_shape(param))
                else:
                    entry[key] = value.detach().clone().cpu() if isinstance(value, torch.Tensor) else value
            state[name] = entry
    param_groups = []
    for group, base_group in zip(groups, base.param_groups):
        hyper = {k: v for k, v in base_group.items() if k != "params"}
        param_groups.append({**hyper, "params": [name for name, _ in group]})
    result: dict[str, Any] = {"state": state, "param_groups": param_groups}
    if engine.lr_scheduler is not None:
        # The DeepSpeed config's scheduler belongs to the engine, not to the Trainer's state: it travels here.
        result["lr_scheduler"] = engine.lr_scheduler.state_dict()
    return result


def load_full_optimizer_state(
    engine: Any, groups: list[list[tuple[str, Any]]], saved: dict[str, Any]
) -> None:
    """Fill DeepSpeed's partitioned optimizer state from a full, name-keyed optimizer state dict."""
    ds = _safe()
    base = _runtime.base_optimizer(engine)
    flats = _runtime.flat_partitions(engine)
    saved_state = saved.get("state") or {}
    stage = _runtime.zero_stage(engine)
    # One scalar entry (the step) per flat partition: every parameter in it must agree.
    scalars: dict[int, dict[str, Any]] = {}
    for group_index, group in enumerate(groups):
        for name, param in group:
            if name not in saved_state:
                continue
            index = _runtime.partition_index(engine, param, group_index)
            for key, value in saved_state[name].items():
                if _per_element(value):
                    continue
                seen = scalars.setdefault(index, {})
                if key in seen and not _equal(seen[key], value):
                    raise ValueError(
                        f"optimizer state {key!r} differs between parameters ({seen[key]!r} vs {value!r} for "
                        f"{name}); DeepSpeed keeps one per parameter group and cannot load both."
                    )
                seen[key] = value
    _prime(engine, base, flats, groups, saved_state)
    for index, values in scalars.items():
        for key, value in values.items():
            base.state[flats[index]][key] = value.clone() if isinstance(value, torch.Tensor) else value
    for group in groups:
        for name, param in group:
            for key, value in (saved_state.get(name) or {}).items():
                if not _per_element(value):
                    continue
                if stage == 3:
                    _set_stage3_partition(engine, param, value.to(torch.float32), key)
                else:
                    ds.safe_set_full_optimizer_state(param, value.to(torch.float32).to(param.device), key)
    for base_group, saved_group in zip(base.param_groups, saved.get("param_groups") or []):
        for key, value in saved_group.items():
            if key != "params" and key in base_group:
                base_group[key] = value
    if engine.lr_scheduler is not None and saved.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(saved["lr_scheduler"])


def _prime(
    engine: Any, base: Any, flats: list[Any], groups: list[list[tuple[str, Any]]], saved: dict[str, Any]
) -> None:
    """Create optimizer state that torch creates lazily on the first step, so that it can be written."""
    keys: dict[str, Any] = {}
    for per_param in saved.values():
        for key, value in per_param.items():
            keys.setdefault(key, value)
    if not keys:
        return
    created = False
    for flat in flats:
        entry = base.state[flat]
        for key, example in keys.items():
            if key in entry:
                continue
            created = True
            if _per_element(example):
                entry[key] = torch.zeros_like(flat)
            else:
                entry[key] = example.clone() if isinstance(example, torch.Tensor) else example
    if created and _runtime.zero_stage(engine) in (1, 2):
        # Stages 1-2 map each parameter onto its slice of the state once, after the first step; do it now.
        optimizer = engine.optimizer
        optimizer._hp_optimizer_states_linked = False
        optimizer._lazy_init_hp_params_optimizer_state()


def _set_stage3_partition(engine: Any, param: Any, value: torch.Tensor, key: str | None) -> None:
    """Copy this rank's part of a whole value into a stage-3 master partition (or its optimizer state).

    DeepSpeed's own setter takes the part without the padding the last rank's partition carries, and fails
    for parameters whose size does not divide by the world size; this pads first.
    """
    optimizer = engine.optimizer
    partition, group = optimizer._get_fp32_opt_state_partition(
        param, release_swap_buffers=False, optim_state_key=key
    )
    size = partition.numel()
    rank = optimizer._get_param_partition_rank(param)
    flat = value.detach().reshape(-1).to(partition.device, partition.dtype)
    padded = torch.zeros(
        size * optimizer._get_param_partition_world_size(param), dtype=flat.dtype, device=flat.device
    )
    padded[: flat.numel()] = flat
    partition.data.copy_(padded.narrow(0, size * rank, size))
    if optimizer._swappable_optimizer_subgroup(group):
        optimizer._optimizer_states_and_gradient_swap_out(group)


def _shape(param: Any) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    return a == b
