"""How an Engine starts its workers when nothing launched them: the launcher chosen by name, a script re-run in
every worker (:meth:`Launching.supervise`), or a function run there (:meth:`Launching.launch`)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from stratagem.engine._defaults import DEFAULT_LAUNCHER, LAUNCHER_ENV
from stratagem.errors import ConfigurationError, WorkerFailedError
from stratagem.launchers import _rerun, _worker_start
from stratagem.registry._manager import get_registry


class Launching:
    """The Engine's launch methods; the Engine holds the request they read (devices, nodes, accelerator)."""

    devices: int
    num_nodes: int
    accelerator: str
    max_restarts: int
    world_size_requested: int
    _config: dict[str, Any]
    _source: str | None
    _launcher: Any

    def setup_environment(self) -> None:  # the Engine's
        raise NotImplementedError

    def teardown(self) -> None:  # the Engine's
        raise NotImplementedError

    @property
    def rank(self) -> int:  # the Engine's
        raise NotImplementedError

    def _resolve_launcher(self, launcher: Any, options: dict[str, Any]) -> Any:
        from stratagem.launchers.launcher import Launcher

        registry = get_registry()
        if isinstance(launcher, Launcher):
            if options:
                raise ConfigurationError(
                    f"launcher_options={options!r} with a Launcher instance: give the options to its constructor."
                )
            info = _registration(launcher)
            if info is not None:
                registry.check_launcher(info.name, accelerator=self.accelerator, num_nodes=self.num_nodes)
            return launcher
        if not isinstance(launcher, str):
            raise ConfigurationError(f"launcher={launcher!r}: give a registered name or a Launcher instance.")
        name = os.environ.get(LAUNCHER_ENV) or DEFAULT_LAUNCHER if launcher == "auto" else launcher
        info = registry.check_launcher(name, accelerator=self.accelerator, num_nodes=self.num_nodes)
        try:
            return info.create(**options)
        except TypeError as error:  # an option the launcher's constructor does not take
            raise ConfigurationError(f"launcher_options for launcher {name!r}: {error}.") from error

    def _launcher_starts_all_nodes(self) -> bool:
        info = _registration(self._launcher)
        return info is not None and bool(info.capabilities.starts_all_nodes)

    def _run_job(self, job: Any) -> dict[int, Any]:
        from stratagem.registry._manager import LauncherHooks

        return LauncherHooks(self._launcher).launch_workers(job)

    def _job(self, kind: str, **fields: Any) -> Any:
        from stratagem.launchers import LaunchJob

        return LaunchJob(
            kind=kind,
            nproc_per_node=self.devices,
            nnodes=self.num_nodes,
            accelerator=self.accelerator,
            env=_worker_start.worker_environment(self.accelerator, fields.pop("env", None), self.devices),
            max_restarts=self.max_restarts,
            **fields,
        )

    def supervise(self, **job: Any) -> None:
        """Re-run this very command in the workers, then end this process with their status (it only
        supervises: the rest of the script ran in the workers). ``job``: more fields of the
        :class:`~stratagem.launchers.LaunchJob` (the Trainer's preemption settings)."""
        try:
            self._run_job(self._job("script", command=_worker_start.current_command(), **job))
        except WorkerFailedError as error:
            raise SystemExit(f"stratagem: {error}") from None
        raise SystemExit(0)

    @property
    def needs_launch(self) -> bool:
        """True in the process the user started when more than one process is wanted and none exist yet."""
        return self._source is None and self.world_size_requested > 1

    def launch(self, fn: Callable[..., Any] | None = None, *args: Any) -> Any:
        """Run ``fn(engine, *args)`` in every process and return rank 0's result.

        With nothing launched yet and ``devices > 1``, starts the workers with torch's elastic agent. A
        function that pickles (defined at module level) is sent to them with its arguments. Any other callable
        (a lambda, a closure, a ``functools.partial`` of a local) works from a script: the workers run the
        script again and call ``fn`` when they reach this ``launch``, so the script must reach its ``launch``
        calls in the same order on every run. Either way the workers end after ``fn``, and this process
        continues with rank 0's result. Under torchrun, SLURM or ``stratagem run`` the processes exist already
        and ``fn`` runs here. Without ``fn``, the script itself is re-run in the workers and this process exits
        with their status when they are done.
        """
        if self.needs_launch:
            if self.num_nodes > 1 and not self._launcher_starts_all_nodes():
                raise ConfigurationError(
                    "num_nodes > 1: start one launcher per node with torchrun or "
                    "`stratagem run --nnodes N --node-rank R --rdzv-endpoint host:port script.py`."
                )
            if fn is None:
                self.supervise()
            return self._launch_function(fn, args)
        target = _rerun.target_call()
        if fn is not None and target is not None:
            return self._run_relaunched_call(target, fn, args)
        self.setup_environment()
        return None if fn is None else fn(self, *args)

    def _launch_function(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        call = _rerun.next_call()
        problem = _rerun.why_not_spawnable(fn, (self._config, args))
        if problem is None:
            result = self._run_job(
                self._job("function", function=_worker_main, args=(type(self), self._config, fn, args))
            ).get(0)
        else:
            started = _rerun.how_started()
            if started != "script":
                where = "pytest would re-run the test session" if started == "pytest" else "none is running"
                raise ConfigurationError(
                    f"Engine.launch({getattr(fn, '__qualname__', fn)!r}): the function cannot be sent to worker "
                    f"processes ({problem}), and there is no script for them to re-run ({where}). Define the "
                    "function at module level of an importable module and pass its arguments to launch(), or run "
                    "this code as a script (python script.py)."
                )
            result = _rerun.run_script_for(
                call,
                lambda env: self._run_job(
                    self._job("script", command=_worker_start.current_command(), env=env)
                ),
            )
        _rerun.record(result)
        return result

    def _run_relaunched_call(self, target: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
        """In a worker that re-runs the script for launch call ``target``: pass earlier calls, run this one."""
        call = _rerun.next_call()
        if call < target:
            return _rerun.replayed_result(call)
        self.setup_environment()
        result = fn(self, *args)
        if self.rank == 0:
            _rerun.send_result(result, call)
        self.teardown()
        # The rest of the script is the launching process's to run.
        raise SystemExit(0)


def _worker_main(
    engine_class: type[Launching], config: dict[str, Any], fn: Callable[..., Any], args: tuple[Any, ...]
) -> Any:
    engine = engine_class(**config)
    engine.setup_environment()
    # No teardown on error: its barrier would wait for peers that the agent is about to stop anyway.
    result = fn(engine, *args)
    engine.teardown()
    return result


def _registration(launcher: Any) -> Any:
    """The registry's entry for a launcher object: the name it was created under, else its class's (an instance
    built by hand, ``RayLauncher(address=...)``, has no name but declares what its class does)."""
    launchers = get_registry().launchers
    name = getattr(launcher, "registered_name", None)
    if name and name in launchers:
        return launchers[name]
    cls = type(launcher)
    path = f"{cls.__module__}:{cls.__qualname__}"
    return next((info for info in launchers.values() if info.factory in (cls, path)), None)
