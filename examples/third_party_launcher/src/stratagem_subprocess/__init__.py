"""stratagem-subprocess-launcher: registers the ``subprocess`` launcher. Imports nothing heavy (the listing and
every Trainer import this module; the launcher's own module is imported only when someone picks it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from stratagem import hookimpl
from stratagem.launchers import LauncherCapabilities

if TYPE_CHECKING:
    from stratagem_subprocess.launcher import SubprocessLauncher

__all__ = ["SubprocessLauncher", "register_launchers"]


@hookimpl
def register_launchers(register: Callable[..., None]) -> None:
    register(
        "subprocess",
        # A string: the class is imported only when someone picks this launcher.
        "stratagem_subprocess.launcher:SubprocessLauncher",
        description="The workers as plain child processes of the launching one, on this machine",
        # One machine: the core refuses num_nodes > 1 before anything starts.
        capabilities=LauncherCapabilities(accelerators={"cpu", "cuda"}, multi_node=False),
    )


def __getattr__(name: str) -> Any:
    if name == "SubprocessLauncher":
        from stratagem_subprocess.launcher import SubprocessLauncher

        return SubprocessLauncher
    raise AttributeError(f"module 'stratagem_subprocess' has no attribute {name!r}")
