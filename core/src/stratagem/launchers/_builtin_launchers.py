"""The launcher that ships with the core, registered like any plugin's."""

from __future__ import annotations

from collections.abc import Callable

from stratagem.hookspecs import hookimpl
from stratagem.registry.capabilities import LauncherCapabilities


@hookimpl
def register_launchers(register: Callable[..., None]) -> None:
    register(
        "elastic",
        "stratagem.launchers.elastic:ElasticLauncher",
        description="torch's elastic agent: workers on this node, other nodes through a rendezvous (the default)",
        capabilities=LauncherCapabilities(accelerators={"cpu", "cuda"}, multi_node=True),
    )
