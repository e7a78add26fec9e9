"""How an Engine starts its workers when nothing launched them: the launcher chosen by name, a script re-run in
every worker, or a function run there."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from stratagem.engine._defaults import DEFAULT_LAUNCHER, LAUNCHER_ENV
from stratagem.errors import ConfigurationError, WorkerFailedError
from stratagem.launchers import _rerun, _worker_start
from stratagem.registry._manager import get_registry

if TYPE_CHECKING:
    from stratagem.engine._strategy_runtime import Request, StrategyRuntime


class Launching:
    """Starting one Engine's workers from the process the user started: the launcher checked when the Engine is
    made, the job it runs (:meth:`stratagem.Engine.supervise`, :meth:`stratagem.Engine.launch` document both)."""

    def __init__(
        self,
        request: Request,
        engine_arguments: dict[str, Any],
        *,
        engine_class: type,
        runtime: StrategyRuntime | None = None,
    ) -> None:
        self._request = request
        #: The strategy's name and options, for a launcher whose launch depends on them (replica groups).
        self._strategy = runtime.job_strategy() if runtime is not None else {}
        #: What a worker builds its own Engine from, when a function is sent to it.
        self._engine = (engine_class, engine_arguments)
        self.launcher: Any = None
        if request.needs_launch:
            # Checked before anything starts: the name exists, and it can run this request.
            options = dict(engine_arguments["launcher_options"])
            self.launcher = _resolve_launcher(engine_arguments["launcher"], options, request)

    def _starts_all_nodes(self) -> bool:
        info = _registration(self.launcher)
        return info is not None and bool(info.capabilities.starts_all_nodes)

    def _run_job(self, job: Any) -> dict[int, Any]:
        from stratagem.registry._manager import LauncherHooks

        return LauncherHooks(self.launcher).launch_workers(job)

    def _job(self, kind: str, **fields: Any) -> Any:
        from stratagem.launchers import LaunchJob

        request = self._request
        return LaunchJob(
            kind=kind,
            nproc_per_node=request.devices,
            nnodes=request.num_nodes,
            accelerator=request.accelerator,
            env=_worker_start.worker_environment(
                request.accelerator, fields.pop("env", None), request.devices
            ),
            max_restarts=request.max_restarts,
            **self._strategy,
            **fields,
        )

    def supervise(self, **job: Any) -> None:
        try:
            self._run_job(self._job("script", command=_worker_start.current_command(), **job))
        except WorkerFailedError as error:
            raise SystemExit(f"stratagem: {error}") from None
        raise SystemExit(0)

    def launch(self, fn: Callable[..., Any] | None, args: tuple[Any, ...]) -> Any:
        """Start the workers: re-run the script in them (``fn`` None), or have them run ``fn``."""
        if self._request.num_nodes > 1 and not self._starts_all_nodes():
            raise ConfigurationError(
                "num_nodes > 1: start one launcher per node with torchrun or "
                "`stratagem run --nnodes N --node-rank R --rdzv-endpoint host:port script.py`."
            )
        if fn is None:
            self.supervise()
        call = _rerun.next_call()
        engine_class, arguments = self._engine
        problem = _rerun.why_not_spawnable(fn, (arguments, args))
        if problem is None:
            result = self._run_job(
                self._job("function", function=_worker_main, args=(engine_class, arguments, fn, args))
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


def _resolve_launcher(launcher: Any, options: dict[str, Any], request: Request) -> Any:
    from stratagem.launchers.launcher import Launcher

    registry = get_registry()
    where = dict(accelerator=request.accelerator, num_nodes=request.num_nodes)
    if isinstance(launcher, Launcher):
        if options:
            raise ConfigurationError(
                f"launcher_options={options!r} with a Launcher instance: give the options to its constructor."
            )
        info = _registration(launcher)
        if info is not None:
            registry.check_launcher(info.name, **where)
        return launcher
    if not isinstance(launcher, str):
        raise ConfigurationError(f"launcher={launcher!r}: give a registered name or a Launcher instance.")
    name = os.environ.get(LAUNCHER_ENV) or DEFAULT_LAUNCHER if launcher == "auto" else launcher
    info = registry.check_launcher(name, **where)
    try:
        return info.create(**options)
    except TypeError as error:  # an option the launcher's constructor does not take
        raise ConfigurationError(f"launcher_options for launcher {name!r}: {error}.") from error


def with_launcher(request: Request, launcher: Any) -> Request:
    """``request``, launched even for one process per node when nothing launched this process and its launcher
    declares ``always_launches`` (its launch starts more than one world: replica groups)."""
    if request.source is None and _always_launches(launcher):
        return attrs.evolve(request, always_launch=True)
    return request


def _always_launches(launcher: Any) -> bool:
    from stratagem.launchers.launcher import Launcher

    if isinstance(launcher, Launcher):
        info = _registration(launcher)
    elif isinstance(launcher, str):
        name = os.environ.get(LAUNCHER_ENV) or DEFAULT_LAUNCHER if launcher == "auto" else launcher
        info = get_registry().launchers.get(name)  # an unknown name is refused where it is resolved
    else:
        return False
    return info is not None and bool(info.capabilities.always_launches)


def run_here(engine: Any, fn: Callable[..., Any] | None, args: tuple[Any, ...]) -> Any:
    """``Engine.launch`` in a process that was launched: ``fn`` runs here, and a worker re-running the script
    for one launch call passes the calls before it and ends after it."""
    target = _rerun.target_call()
    if fn is not None and target is not None:
        call = _rerun.next_call()
        if call < target:
            return _rerun.replayed_result(call)
        engine.setup_environment()
        result = fn(engine, *args)
        if engine.rank == 0:
            _rerun.send_result(result, call)
        engine.teardown()
        raise SystemExit(0)  # the rest of the script is the launching process's to run
    engine.setup_environment()
    return None if fn is None else fn(engine, *args)


def _worker_main(
    engine_class: type, config: dict[str, Any], fn: Callable[..., Any], args: tuple[Any, ...]
) -> Any:
    """A worker's side of a function sent to it: an Engine of its own, made from the same arguments."""
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
