"""The entry point: registers the ``slurm`` launcher without importing anything of it."""

from __future__ import annotations

from collections.abc import Callable

from stratagem import hookimpl
from stratagem.registry.capabilities import LauncherCapabilities


@hookimpl
def register_launchers(register: Callable[..., None]) -> None:
    register(
        "slurm",
        "stratagem_slurm.launcher:SlurmLauncher",
        description="The workers as the tasks of one SLURM batch job, submitted from a login node (sbatch)",
        capabilities=LauncherCapabilities(
            accelerators={"cpu", "cuda"}, multi_node=True, starts_all_nodes=True
        ),
    )
