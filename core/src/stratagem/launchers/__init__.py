"""Launchers: how the worker processes of a run start, restart and report, chosen by name like strategies.

``elastic`` (torch's elastic agent) is built in and the default; other launchers come from plugins
(``stratagem-ray``: ``ray``). A process that is already a worker (torchrun, SLURM, a launcher's worker)
launches nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stratagem.registry._lazy import lazy_getattr

if TYPE_CHECKING:
    from stratagem.launchers._job import LauncherCapabilities, LaunchJob
    from stratagem.launchers.base import Launcher
    from stratagem.launchers.elastic import ElasticLauncher

__all__ = ["ElasticLauncher", "LaunchJob", "Launcher", "LauncherCapabilities"]

_LAZY = {
    "LaunchJob": "stratagem.launchers._job",
    "LauncherCapabilities": "stratagem.registry.capabilities",
    "Launcher": "stratagem.launchers.base",
    "ElasticLauncher": "stratagem.launchers.elastic",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())
