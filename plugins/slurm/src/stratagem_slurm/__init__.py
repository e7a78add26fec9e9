"""stratagem-slurm: SLURM as a stratagem launcher. Importing this package imports neither torch nor the
launcher."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from stratagem_slurm.launcher import SlurmLauncher

__all__ = ["SlurmLauncher"]


def __getattr__(name: str) -> Any:
    if name == "SlurmLauncher":
        from stratagem_slurm.launcher import SlurmLauncher

        return SlurmLauncher
    raise AttributeError(f"module 'stratagem_slurm' has no attribute {name!r}")
