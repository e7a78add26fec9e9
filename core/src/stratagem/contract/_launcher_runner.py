"""Running the launcher section of the contract: three launches through the ``launch_workers`` hook.

- a function job on :data:`WORLD` workers that reports the rank environment and sums over a gloo group;
- a function job in which rank 1 raises while the others wait for it in a barrier;
- a script job (``python -m ...``) that writes each worker's environment to a file.

Each launch records its result or the exception it raised; the checks in
``stratagem.contract.test_launcher`` assert on them.
"""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path
from typing import Any

import attrs

WORLD = 2


@attrs.define
class Launch:
    result: Any = None
    error: BaseException | None = None
    seconds: float = 0.0


@attrs.define
class LauncherRun:
    name: str
    info: Any
    token: str
    script_dir: Path
    ok: Launch
    failing: Launch
    script: Launch


def _launch(launcher: Any, job: Any) -> Launch:
    from stratagem.registry._manager import LauncherHooks

    start = time.perf_counter()
    try:
        result = LauncherHooks(launcher).launch_workers(job)
    except BaseException as error:  # recorded; the checks say what was expected
        if isinstance(error, KeyboardInterrupt):
            raise
        return Launch(error=error, seconds=time.perf_counter() - start)
    return Launch(result=result, seconds=time.perf_counter() - start)


def run(name: str, directory: Path) -> LauncherRun:
    """Create the launcher ``name`` with its registered options and make the three launches."""
    from stratagem.contract import _launcher_workloads as workloads
    from stratagem.launchers import LaunchJob
    from stratagem.registry._manager import get_registry

    info = get_registry().get_launcher(name)
    launcher = info.create()
    token = uuid.uuid4().hex[:12]
    env = {workloads.MARKER: token}
    common = dict(nproc_per_node=WORLD, accelerator="cpu", env=env)
    ok = _launch(launcher, LaunchJob(kind="function", function=workloads.report, args=(token,), **common))
    failing = _launch(
        launcher, LaunchJob(kind="function", function=workloads.fail_on_rank_one, args=(token,), **common)
    )
    script_dir = directory / "script-job"
    command = (sys.executable, "-m", "stratagem.contract._launcher_workloads", str(script_dir))
    script = _launch(launcher, LaunchJob(kind="script", command=command, **common))
    return LauncherRun(
        name=name, info=info, token=token, script_dir=script_dir, ok=ok, failing=failing, script=script
    )
