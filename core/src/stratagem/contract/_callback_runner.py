"""Running the callback section of the contract for one callback or logger: one launch of :data:`WORLD` CPU
workers, each running the fits of :mod:`stratagem.contract._callback_workloads`. The checks in
``stratagem.contract.test_callback`` assert on the :class:`EventPluginRun` this returns."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import attrs

WORLD = 2
#: The Trainer's hang watchdog in the workers: a plugin that leaves a rank behind in a collective ends the
#: launch with that rank named, rather than hanging the suite.
TIMEOUT_S = 60.0


@attrs.define
class EventPluginRun:
    kind: str
    name: str
    info: Any
    #: Why nothing could run (a requirement not installed), or ``None``.
    unavailable: str | None = None
    results: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    launch_error: str | None = None
    seconds: float = 0.0


def run(kind: str, name: str, directory: Path) -> EventPluginRun:
    from stratagem.contract._callback_workloads import run_section
    from stratagem.errors import WorkerFailedError
    from stratagem.launchers import _worker_start
    from stratagem.registry._manager import get_registry

    info = get_registry().get_callback(name, kind)
    found = EventPluginRun(kind=kind, name=name, info=info)
    missing = info.missing_requirements()
    if missing:
        found.unavailable = f"the {kind} {name} requires {', '.join(missing)}, which is not installed"
        return found
    spec = {"kind": kind, "name": name, "world_size": WORLD, "timeout": TIMEOUT_S, "workdir": str(directory)}
    start = time.perf_counter()
    try:
        found.results = _worker_start.launch_function(
            run_section, (spec,), nproc_per_node=WORLD, accelerator="cpu", env={"OMP_NUM_THREADS": "1"}
        )
    except WorkerFailedError as error:
        found.launch_error = str(error)
    found.seconds = time.perf_counter() - start
    return found
