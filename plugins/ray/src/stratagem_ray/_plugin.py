"""The entry point: registers the ``ray`` launcher without importing ray."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import LauncherCapabilities


@hookimpl
def register_launchers(register: Callable[..., None]) -> None:
    register(
        "ray",
        "stratagem_ray.launcher:RayLauncher",
        description="Workers as Ray actors in a placement group, on an existing Ray cluster or a local one",
        capabilities=LauncherCapabilities(
            accelerators={"cpu", "cuda"}, multi_node=True, starts_all_nodes=True, requires=("ray",)
        ),
    )
