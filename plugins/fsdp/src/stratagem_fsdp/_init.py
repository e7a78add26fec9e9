"""Materialising a sharded model built on the meta device, initialised as one process would.

``to_empty`` allocates only each rank's shards. Running ``reset_parameters`` on them directly would not do:
on a CPU mesh, DTensor's random ops are not coordinated between ranks, so every rank draws the same numbers
for its own shard (all shards identical), and the values depend on the world size. Instead, each module in
turn gets its full-size parameters as plain tensors, ``reset_parameters`` fills them from one random
stream that every rank shares, and each rank keeps its slice. At most one module's full parameters exist at a
time, and the values equal a one-process build from the same random state, at any world size.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from stratagem.errors import ConfigurationError
from stratagem.strategies.wrapping import initializing
from stratagem_fsdp._pool import to_empty_in_one_block


def random_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


@contextlib.contextmanager
def using_random_state(state: dict[str, torch.Tensor], device: torch.device) -> Iterator[None]:
    """Draw from ``state`` inside the block; the process's own random streams are left as they were."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], device)
        yield


def materialize_sharded(model: torch.nn.Module, device: torch.device, state: dict[str, torch.Tensor]) -> None:
    """Allocate the meta tensors of ``model`` (sharded or not) on ``device`` and initialise them."""
    if not initializing():  # the weights are read from a checkpoint next, into memory allocated in one block
        to_empty_in_one_block(model, device)
        return
    model.to_empty(device=device)
    uninitialised = []
    with torch.no_grad(), using_random_state(state, device):
        for name, module in model.named_modules():
            if not [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                continue
            if not callable(getattr(module, "reset_parameters", None)):
                uninitialised.append(name or type(module).__name__)
                continue
            reset_full_then_keep_shard(module)
    if uninitialised:
        raise ConfigurationError(
            f"Modules {uninitialised} were built on the meta device (empty_init=True) but have no "
            "reset_parameters() to initialise them. Add reset_parameters(), or build them with empty_init=False."
        )


def reset_full_then_keep_shard(module: torch.nn.Module) -> None:
    """Run ``module.reset_parameters()`` on full-size stand-ins of its sharded parameters, then copy this
    rank's slice of each into the shard."""
    sharded: dict[str, Any] = {}
    for name, param in list(module._parameters.items()):
        if isinstance(param, DTensor):
            sharded[name] = param
            full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
            module._parameters[name] = torch.nn.Parameter(full, requires_grad=param.requires_grad)
    try:
        module.reset_parameters()  # type: ignore[operator]
        for name, param in sharded.items():
            full = module._parameters[name]
            # src_data_rank=None: every rank slices its own copy; no communication, no full tensor sent.
            mine = distribute_tensor(full.detach(), param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(mine.to_local())
    finally:
        for name, param in sharded.items():
            module._parameters[name] = param
