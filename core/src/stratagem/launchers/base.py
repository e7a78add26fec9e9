"""``stratagem.launchers.Launcher``: the base class of launcher plugins."""

from __future__ import annotations

from typing import Any

from stratagem.hookspecs import hookimpl
from stratagem.launchers._job import LaunchJob
from stratagem.strategies.base import check_hook_overrides


class Launcher:
    """Starts the workers of a run. A subclass implements :meth:`launch_workers` with ``@hookimpl``.

    Its options are its constructor's (``RayLauncher(address=..., max_failures=...)``); the name it was
    registered under is ``registered_name``.
    """

    registered_name: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        check_hook_overrides(cls)

    @property
    def name(self) -> str:
        return self.registered_name or type(self).__name__

    @hookimpl
    def launch_workers(self, job: LaunchJob) -> dict[int, Any]:
        raise NotImplementedError(f"{type(self).__name__} does not implement launch_workers(job).")
