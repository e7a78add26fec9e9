"""What a replica group that heals receives from a live peer (torchft's checkpoint transport): the model's and
the optimizer's state, each rank's own part.

Rank k of a group heals from rank k of another group, and the groups shard alike (the same model on the same
number of ranks), so each rank sends and receives its local shards: sharded parameters (DTensors) travel as
their local tensors and are put back into the live DTensors' local tensors."""

from __future__ import annotations

from typing import Any

import torch


def _local(tensor: Any) -> Any:
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def _plain(value: Any) -> Any:
    """``value`` with every DTensor inside replaced by its local tensor (dicts and lists walked)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return _local(value) if isinstance(value, torch.Tensor) else value


def healing_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's state for a peer that heals from it. The tensors are the live ones, not copies: torchft
    serves them while it holds this step's state lock, which the commit waits for before anything changes."""
    return {"model": _plain(model.state_dict()), "optimizer": _plain(optimizer.state_dict())}


@torch.no_grad()
def load_healing_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> None:
    """Put a peer's :func:`healing_state` into the live model and optimizer, in place."""
    live = model.state_dict()
    missing = sorted(set(live) - set(state["model"]))
    if missing:
        raise RuntimeError(
            f"the healing state from a peer lacks {missing[:5]}: do the replica groups train one model?"
        )
    for name, tensor in live.items():
        _local(tensor).copy_(state["model"][name])
    optimizer.load_state_dict(_as_live(optimizer, state["optimizer"]))


def _as_live(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """A peer's optimizer state with each per-parameter tensor shaped like its parameter's local shard turned
    back into a DTensor of that parameter's layout (an optimizer that has not stepped yet has no state to copy
    into, so the layout comes from the parameter)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entries in saved.get("state", {}).items():
        param = params[int(index)]
        mesh = getattr(param, "device_mesh", None)
        if mesh is None:
            state[index] = entries
            continue
        from torch.distributed.tensor import DTensor

        local_shape = _local(param).shape
        state[index] = {
            key: DTensor.from_local(
                value, mesh, param.placements, shape=param.shape, stride=param.stride(), run_check=False
            )
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local_shape
            else value
            for key, value in entries.items()
        }
    return {**saved, "state": state}
