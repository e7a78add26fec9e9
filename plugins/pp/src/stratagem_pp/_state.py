"""Full state dicts of a pipeline: each rank holds its stages only, so a full checkpoint gathers every stage to
rank 0, and loading one keeps the keys of this rank's stages.

Parameter names are those of the whole model on every rank (the stages keep them), so the stages' dicts merge
by key without renaming, and a full checkpoint written here loads under any strategy (and the reverse).
Sharded checkpoints need nothing of this: each rank writes its own keys through DCP, and the core checks a
checkpoint's keys against the union of every rank's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from stratagem.errors import CheckpointError
from stratagem.strategies.base import Strategy


def _gather_to_zero(mine: dict[str, Any], sends: bool) -> list[dict[str, Any]] | None:
    """Every rank's ``mine`` on global rank 0 (``{}`` from ranks that do not send: copies of a stage on other
    data- or tensor-parallel ranks); ``None`` elsewhere."""
    every: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine if sends else {}, every, dst=0)
    return every


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value


def in_model_order(names: Any, order: list[str]) -> list[str]:
    """``names`` in the whole model's order (``order``: its state-dict keys), others after them as given.

    Ranks hold stages out of model order (stages 0 and 2 on rank 0 of an interleaved schedule), so names
    merged rank by rank would list ``blocks.1`` before ``blocks.0``; an optimizer state's ``params`` lists
    are matched by position, so they must read as the whole model's."""
    position = {name: index for index, name in enumerate(order)}
    return sorted(names, key=lambda name: position.get(name, len(position)))


def full_module_state(stage_state: dict[str, Any], sends: bool, order: list[str]) -> dict[str, Any]:
    """Rank 0: the whole model's state from each rank's whole (gathered over dp and tp) stage state."""
    every = _gather_to_zero(_to_cpu(stage_state), sends)
    if every is None:
        return {}
    merged: dict[str, Any] = {}
    for part in every:
        merged.update(part)
    return {name: merged[name] for name in in_model_order(merged, order)}


def full_optimizer_state(stage_state: dict[str, Any], sends: bool, order: list[str]) -> dict[str, Any]:
    """Rank 0: the optimizer state keyed by parameter name over every stage; each parameter group's
    ``params`` lists the names of all stages, its other settings are the first stage's (the same on all)."""
    every = _gather_to_zero(_to_cpu(stage_state), sends)
    if every is None:
        return {}
    parts = [p for p in every if p]
    state: dict[str, Any] = {}
    for part in parts:
        state.update(part.get("state", {}))
    counts = {len(part.get("param_groups", [])) for part in parts}
    if len(counts) > 1:
        raise CheckpointError(
            "(full optimizer state)",
            f"the pipeline's stages have different numbers of optimizer parameter groups ({sorted(counts)}); "
            "a full checkpoint merges them group by group. Give every stage the same groups (an empty group "
            "where a stage has none of its parameters), or save sharded.",
        )
    groups = [dict(g) for g in parts[0].get("param_groups", [])] if parts else []
    for index, group in enumerate(groups):
        names = [name for part in parts for name in part["param_groups"][index]["params"]]
        group["params"] = in_model_order(names, order)
    return {"state": {name: state[name] for name in in_model_order(state, order)}, "param_groups": groups}


def local_module_state(full: dict[str, Any], local_keys: set[str]) -> dict[str, Any]:
    """The entries of a whole model's state that this rank's stages hold."""
    return {k: v for k, v in full.items() if k in local_keys}


def local_optimizer_state(full: dict[str, Any], local_names: set[str]) -> dict[str, Any]:
    """A whole model's optimizer state cut to the parameters of this rank's stages."""
    state = {k: v for k, v in full.get("state", {}).items() if k in local_names}
    groups = [
        {**g, "params": [n for n in g.get("params", []) if n in local_names]}
        for g in full.get("param_groups", [])
    ]
    return {**full, "state": state, "param_groups": groups}


# The strategy's four conversions (see ``stratagem.strategies.base.Strategy``) ----------------------------


def module_state_dict(strategy: Any, module: torch.nn.Module, full: bool) -> dict[str, Any]:
    if not full:
        return Strategy.module_state_dict(strategy, module, full=False)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # Whole over dp and tp on every rank of the stage; one of them sends it.
    stage = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return full_module_state(stage, strategy.sends_stage(), strategy.applied.get("order", []))


def optimizer_state_dict(
    strategy: Any, module: torch.nn.Module, optimizer: torch.optim.Optimizer, full: bool
) -> dict[str, Any]:
    if not full:
        return _with_every_stage_in_groups(
            Strategy.optimizer_state_dict(strategy, module, optimizer, full=False),
            strategy.applied.get("order", []),
        )
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    stage = get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True))
    return full_optimizer_state(stage, strategy.sends_stage(), strategy.applied.get("order", []))


def _local_keys(strategy: Any, module: torch.nn.Module) -> set[str]:
    # The sharded state dict's keys: this rank's names, cleaned as torch cleans them, without gathering.
    return set(Strategy.module_state_dict(strategy, module, full=False))


def load_module_state_dict(
    strategy: Any, module: torch.nn.Module, state_dict: dict[str, Any], full: bool, strict: bool
) -> Any:
    if full:
        state_dict = local_module_state(state_dict, _local_keys(strategy, module))
    return Strategy.load_module_state_dict(strategy, module, state_dict, full=full, strict=strict)


def load_optimizer_state_dict(
    strategy: Any,
    module: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    full: bool,
) -> None:
    # Full or sharded, the parameter groups name every stage's parameters (see _with_every_stage_in_groups).
    state_dict = local_optimizer_state(state_dict, _local_keys(strategy, module))
    Strategy.load_optimizer_state_dict(strategy, module, optimizer, state_dict, full=full)


def _with_every_stage_in_groups(state_dict: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """A sharded optimizer state whose parameter groups list the names of every stage's parameters.

    DCP keeps one copy of a value that is not a tensor (a group's settings and its ``params`` list), whichever
    rank wrote it; with each rank's own names a checkpoint would keep one stage's, and a whole-model load
    (``single_device`` after consolidation, ``fsdp``) would find the other stages' parameters in no group.
    Loading cuts the lists back to this rank's names."""
    groups = state_dict.get("param_groups", [])
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, [list(g.get("params", [])) for g in groups])
    if len({len(names) for names in every}) > 1:
        raise CheckpointError(
            "(sharded optimizer state)",
            "the pipeline's stages have different numbers of optimizer parameter groups; a checkpoint lists "
            "every stage's parameters group by group. Give every stage the same groups (an empty group where a "
            "stage has none of its parameters).",
        )
    merged = []
    for index, group in enumerate(groups):
        names = in_model_order(
            dict.fromkeys(name for rank_groups in every for name in rank_groups[index]), order
        )
        merged.append({**group, "params": names})
    return {**state_dict, "param_groups": merged}
