"""stratagem-ray: Ray as a stratagem launcher. Importing this package imports neither ray nor torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stratagem_ray.launcher import RayLauncher

__all__ = ["RayLauncher"]


def __getattr__(name: str) -> Any:
    if name == "RayLauncher":
        from stratagem_ray.launcher import RayLauncher

        return RayLauncher
    raise AttributeError(f"module 'stratagem_ray' has no attribute {name!r}")
