"""What ``strategy="auto"`` runs on several processes: the model planned (:mod:`stratagem.planning`) under each
installed strategy that offers itself for ``auto`` (``Capabilities(auto_priority=...)``), and the one chosen among those
that fit each device's memory, by :func:`stratagem.planning.choose`.

Each device's memory is ``STRATAGEM_DEVICE_MEMORY`` (with its unit: ``80GB``, ``24GiB``) when set, else a CUDA
device's total memory, else (CPU processes) the host's physical memory divided among the node's processes.
"""

from __future__ import annotations

import os
from typing import Any

from stratagem.errors import ConfigurationError

#: Each device's memory for ``strategy="auto"``, with its unit; overrides what the machine reports.
DEVICE_MEMORY_ENV = "STRATAGEM_DEVICE_MEMORY"


def device_memory(accelerator: str, devices: int) -> int:
    """Bytes of memory each of the node's ``devices`` processes may use (see the module docstring)."""
    from stratagem.planning import parse_bytes

    given = os.environ.get(DEVICE_MEMORY_ENV)
    if given:
        return parse_bytes(given, DEVICE_MEMORY_ENV)
    if accelerator == "cuda":
        import torch

        return int(torch.cuda.get_device_properties(0).total_memory)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // devices


def candidates(world: Any, accelerator: str) -> list[str]:
    """The installed strategies that offer themselves for ``auto`` and serve this request."""
    from stratagem.registry._manager import get_registry

    registry = get_registry()
    found = [
        info.name
        for info in registry
        if info.capabilities.auto_priority is not None
        and info.capabilities.refusal(
            accelerator=accelerator, precision=world.precision, world_size=world.size
        )
        is None
    ]
    if not found:
        # None offers itself at all: the registry's error says what the installed plugins declare to install.
        registry.auto(world_size=world.size, accelerator=accelerator, precision=world.precision)
        raise ConfigurationError(
            f"strategy='auto' with {world.size} processes: no strategy that offers itself for 'auto' serves "
            f"{accelerator} at {world.precision}. Name a strategy (`stratagem strategies` lists them)."
        )
    return sorted(found)


def choose(workload: Any, request: Any) -> Any:
    """The :class:`stratagem.planning.Choice` for ``workload`` on the world of ``request`` (the Engine's
    ``Request``), printed (by the process that launches, or rank 0); raises
    :class:`stratagem.planning.NothingFitsError` (with the plan's table) when no candidate fits."""
    from stratagem import planning

    world = planning.World(devices=request.devices, nodes=request.num_nodes, precision=request.precision)
    memory = device_memory(request.accelerator, world.devices)
    names = candidates(world, request.accelerator)
    choice = planning.choose(planning.plan(workload, world, memory=memory, strategies=names))
    if request.needs_launch or os.environ.get("RANK", "0") == "0":
        print(choice.reason, flush=True)
    return choice
