"""Seeding and capturing/restoring every RNG a training step draws from (python, numpy, torch, CUDA)."""

from __future__ import annotations

import os
import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int, *, rank: int = 0, offset_by_rank: bool = False) -> int:
    """Seed python, numpy and torch (and CUDA). With ``offset_by_rank`` each rank gets ``seed + rank``.

    Returns the seed used. Data order stays identical across ranks either way: samplers take their own seed.
    """
    value = int(seed) + (rank if offset_by_rank else 0)
    os.environ["PYTHONHASHSEED"] = str(value)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
    return value


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as plain tensors and builtins (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
