"""What a rank holds, in bytes, counted from its tensors: parameters, buffers, gradients and optimizer state
as they live on that rank (a distributed tensor's local shard). ``Strategy.memory_held`` uses it; the plan
(:mod:`stratagem.planning`) counts a simulated rank with the same method that the contract suite uses to count a
real one."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


def local_bytes(tensor: torch.Tensor | None) -> int:
    """Bytes of the part of ``tensor`` this rank holds: a ``DTensor``'s local shard, a plain tensor whole."""
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") and hasattr(tensor, "placements") else tensor
    return local.numel() * local.element_size()


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def parameter_bytes(model: torch.nn.Module) -> int:
    return sum(local_bytes(p) for p in _unique(model.parameters()))


def buffer_bytes(model: torch.nn.Module) -> int:
    return sum(local_bytes(b) for b in _unique(model.buffers()))


def gradient_bytes(model: torch.nn.Module) -> int:
    return sum(local_bytes(p.grad) for p in _unique(model.parameters()) if p.grad is not None)


def optimizer_bytes(optimizer: Any) -> int:
    """Bytes of every tensor in the optimizer's per-parameter state (moments, step counts, momentum)."""
    inner = getattr(optimizer, "optimizer", optimizer)
    state = getattr(optimizer, "state", None) or getattr(inner, "state", {})
    return sum(
        local_bytes(value)
        for per_param in state.values()
        if isinstance(per_param, dict)
        for value in per_param.values()
        if isinstance(value, torch.Tensor)
    )


def counts(model: torch.nn.Module, optimizer: Any) -> dict[str, int]:
    """``{"parameters", "buffers", "gradients", "optimizer"}`` in bytes, as this rank holds them now."""
    return {
        "parameters": parameter_bytes(model),
        "buffers": buffer_bytes(model),
        "gradients": gradient_bytes(model),
        "optimizer": optimizer_bytes(optimizer),
    }
