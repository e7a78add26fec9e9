"""``stratagem.Engine``: the strategy's operations for a hand-written loop (the Trainer is built on it)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, ContextManager

import torch

from stratagem import _rerun
from stratagem import cluster as cluster_mod
from stratagem import launcher as agent
from stratagem._manager import StrategyHooks, get_registry, installed_plugins
from stratagem.checkpoint import _atomic, _store
from stratagem.errors import CapabilityError, CheckpointError, ConfigurationError, WorkerFailedError
from stratagem.precision import normalize
from stratagem.seed import seed_everything
from stratagem.strategies.base import Strategy

#: ``stratagem run --strategy S`` sets this; it replaces ``strategy="auto"``.
STRATEGY_ENV = "STRATAGEM_STRATEGY"
#: Names the launcher for ``launcher="auto"`` (``stratagem run --launcher L`` sets it too).
LAUNCHER_ENV = "STRATAGEM_LAUNCHER"
DEFAULT_LAUNCHER = "elastic"
DEFAULT_TIMEOUT_S = 1800.0


def _default_format(strategy: Strategy) -> str:
    return getattr(strategy, "checkpoint_format", "full")


class StrategyOptimizer:
    """The user's optimizer, stepped through the strategy (loss scaling, ZeRO, ...). Everything else
    (``param_groups``, ``zero_grad``, ``state``) reaches the wrapped optimizer."""

    def __init__(self, optimizer: Any, hooks: StrategyHooks, model: torch.nn.Module) -> None:
        self.__dict__.update(optimizer=optimizer, _hooks=hooks, _model=model)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            closure()
        self._hooks.optimizer_step(self.optimizer, self._model)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["optimizer"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.optimizer, name, value)

    def __repr__(self) -> str:
        return f"StrategyOptimizer({self.optimizer!r})"


def _unwrap(optimizer: Any) -> Any:
    return optimizer.optimizer if isinstance(optimizer, StrategyOptimizer) else optimizer


def _strategy_objects(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as the strategy knows it: the optimizers its ``setup_optimizers`` returned, not the Engine's
    wrappers around them. Hooks never see an Engine class."""
    return {key: _unwrap(value) for key, value in state.items()}


_WRAPPER_NAMES = frozenset({"_orig_mod", "module", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def _clean_name(name: str) -> str:
    # Wrappers add path components to parameter names; drop them to match a parameter before and after
    # wrapping. Whole components only: "_checkpoint_wrapped_module." or "submodule." must not lose "module.".
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_NAMES)


def _rebind_optimizer(optimizer: Any, names: dict[int, str], model: torch.nn.Module) -> None:
    """Point an optimizer built before wrapping at the wrapped model's parameters (FSDP replaces them)."""
    current = {_clean_name(n): p for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        rebound = []
        for param in group["params"]:
            name = names.get(id(param))
            if name is None or name not in current:
                raise ConfigurationError(
                    "An optimizer passed to Engine.setup() holds a parameter that is not in the model. Build the "
                    "optimizer over model.parameters(), or call setup_module() first and build it afterwards."
                )
            rebound.append(current[name])
        group["params"] = rebound


class Engine:
    """Run a training loop under a strategy chosen by name.

    :param strategy: a registered name (``"ddp"``, ``"fsdp"``, ...), ``"auto"``, or a ``Strategy`` instance.
    :param accelerator: ``"auto"``, ``"cpu"`` or ``"cuda"``.
    :param devices: processes per node.
    :param num_nodes: nodes.
    :param precision: ``"32-true"``, ``"bf16-mixed"``, ``"bf16-true"`` or ``"16-mixed"`` (CUDA only).
    :param timeout: process-group timeout in seconds: a rank that waits longer on a peer fails.
    :param max_restarts: when a worker fails (raises, is killed, or hangs past ``timeout`` under the Trainer),
        torch's elastic agent restarts all the workers up to this many times (the Trainer resumes from the
        newest complete checkpoint); 0 ends the run at the first failure.
    :param launcher: how workers start when this process must launch them: ``"auto"`` (``STRATAGEM_LAUNCHER``,
        else ``"elastic"``, torch's elastic agent), a registered launcher name (``"ray"`` with stratagem-ray), or
        a ``stratagem.launchers.Launcher`` instance. Checked before anything starts.
    :param launcher_options: options for the launcher named by ``launcher`` (its constructor's arguments, e.g.
        ``{"partition": "gpu", "time": "1:00:00"}`` for ``"slurm"``).
    :param addons: add-on plugins (``@hookimpl(wrapper=True)`` around strategy operations) for this engine
        only, registered after the installed ones. They travel to launched workers, so they must pickle.
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        accelerator: str = "auto",
        devices: int = 1,
        num_nodes: int = 1,
        precision: str | int = "32-true",
        timeout: float = DEFAULT_TIMEOUT_S,
        addons: list[object] | tuple[object, ...] = (),
        max_restarts: int = 0,
        launcher: Any = "auto",
        launcher_options: Mapping[str, Any] | None = None,
    ) -> None:
        if not isinstance(devices, int) or devices < 1:
            raise ConfigurationError(f"devices={devices!r}: give a positive number of processes per node.")
        if not isinstance(num_nodes, int) or num_nodes < 1:
            raise ConfigurationError(f"num_nodes={num_nodes!r}: give a positive number of nodes.")
        self._config = dict(
            strategy=strategy,
            accelerator=accelerator,
            devices=devices,
            num_nodes=num_nodes,
            precision=precision,
            timeout=timeout,
            addons=tuple(addons),
            max_restarts=max_restarts,
            launcher=launcher,
            launcher_options=dict(launcher_options or {}),
        )
        agent.check_max_restarts(max_restarts)
        self.max_restarts = max_restarts
        self.accelerator = cluster_mod.resolve_accelerator(accelerator)
        self.precision = normalize(precision)
        self.devices, self.num_nodes, self.timeout = devices, num_nodes, float(timeout)
        self._source = cluster_mod.launched_externally()
        if self._source is not None:
            # Record an uncaught exception for the launcher from the start, not only once training begins.
            agent.install_worker_excepthook()
        self._check_devices()
        self.world_size_requested = self._expected_world_size()
        if self._source == "slurm":
            agent.set_task_threads(self.accelerator)
        self._addons = tuple(addons)
        self._strategy_info, self._strategy = self._resolve_strategy(strategy)
        self._launcher_choice = launcher
        if self.needs_launch:
            # Checked before anything starts: the name exists, and it can run this request.
            self._launcher = self._resolve_launcher(launcher, dict(launcher_options or {}))
        self._hooks_cache: StrategyHooks | None = None
        if not self.needs_launch:
            # A process that only launches workers never uses the strategy: importing it (a plugin and
            # what it imports) would only delay the workers' start.
            _ = self._hooks
        self._environment_ready = False
        self._models: list[torch.nn.Module] = []
        self._pending_save: Any = None

    # construction ----------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # Workers rebuild the engine from its arguments; the plugin manager does not travel.
        return {"config": self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["config"])  # type: ignore[misc]

    def _check_devices(self) -> None:
        if self.accelerator == "cuda" and self._source is None:
            available = torch.cuda.device_count()
            if self.devices > available:
                raise ConfigurationError(
                    f"devices={self.devices} but this machine has {available} CUDA device(s). "
                    f"Use devices<={available}, or accelerator='cpu' to run {self.devices} CPU processes."
                )

    def _expected_world_size(self) -> int:
        if self._source is not None:
            env = cluster_mod.detect(
                accelerator=self.accelerator,
                devices=self.devices,
                num_nodes=self.num_nodes,
                timeout_s=self.timeout,
            )
            return env.world_size
        return self.devices * self.num_nodes

    @property
    def strategy(self) -> Strategy:
        if self._strategy is None:
            self._strategy = self._strategy_info.create()
        return self._strategy

    @property
    def strategy_name(self) -> str:
        """The strategy's name, without creating it."""
        return self._strategy.name if self._strategy is not None else self._strategy_info.name

    @property
    def _hooks(self) -> StrategyHooks:
        if self._hooks_cache is None:
            addons = [*installed_plugins(), *self._addons] if self._addons else None
            self._hooks_cache = StrategyHooks(self.strategy, addons=addons)
        return self._hooks_cache

    def _resolve_strategy(self, strategy: str | Strategy) -> tuple[Any, Strategy | None]:
        """The registry's entry for the strategy (checked against the request) and the instance, if given."""
        registry = get_registry()
        if isinstance(strategy, Strategy):
            info = self._info_for_instance(strategy)
            if info is not None:
                self._check(info.name)
            return info, strategy
        if not isinstance(strategy, str):
            raise ConfigurationError(f"strategy={strategy!r}: give a registered name or a Strategy instance.")
        name = strategy
        if name == "auto":
            name = os.environ.get(STRATEGY_ENV) or self._auto_name(registry)
        return self._check(name), None

    def _auto_name(self, registry: Any) -> str:
        if self.world_size_requested == 1:
            return "single_device"
        if "ddp" in registry:
            return "ddp"
        raise ConfigurationError(
            f"strategy='auto' with {self.world_size_requested} processes needs a multi-process strategy. "
            "Install one: pip install stratagem-ddp (or stratagem-fsdp), or name a strategy."
        )

    def _check(self, name: str) -> Any:
        return get_registry().check_request(
            name, accelerator=self.accelerator, precision=self.precision, world_size=self.world_size_requested
        )

    @staticmethod
    def _info_for_instance(strategy: Strategy) -> Any:
        registry = get_registry()
        if strategy.registered_name in registry:
            return registry.get(strategy.registered_name)
        target = f"{type(strategy).__module__}:{type(strategy).__qualname__}"
        for info in registry:
            if info.factory is type(strategy) or info.factory == target:
                return info
        return None

    @property
    def capabilities(self) -> Any:
        info = (
            self._strategy_info if self._strategy_info is not None else self._info_for_instance(self.strategy)
        )
        return None if info is None else info.capabilities

    # launching -------------------------------------------------------------------------------------
    def _resolve_launcher(self, launcher: Any, options: dict[str, Any]) -> Any:
        from stratagem.launchers.base import Launcher

        registry = get_registry()
        if isinstance(launcher, Launcher):
            if options:
                raise ConfigurationError(
                    f"launcher_options={options!r} with a Launcher instance: give the options to its constructor."
                )
            name = launcher.registered_name
            if name is not None and name in registry.launchers:
                registry.check_launcher(name, accelerator=self.accelerator, num_nodes=self.num_nodes)
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
        name = getattr(self._launcher, "registered_name", None)
        registry = get_registry()
        return name in registry.launchers and registry.launchers[name].capabilities.starts_all_nodes

    def _run_job(self, job: Any) -> dict[int, Any]:
        from stratagem._manager import LauncherHooks

        return LauncherHooks(self._launcher).launch_workers(job)

    def _job(self, kind: str, **fields: Any) -> Any:
        from stratagem.launchers import LaunchJob

        return LaunchJob(
            kind=kind,
            nproc_per_node=self.devices,
            nnodes=self.num_nodes,
            accelerator=self.accelerator,
            env=agent.worker_environment(self.accelerator, fields.pop("env", None), self.devices),
            max_restarts=self.max_restarts,
            **fields,
        )

    def supervise(self) -> None:
        """Re-run this very command in the workers, then end this process with their status (it only
        supervises: the rest of the script ran in the workers)."""
        try:
            self._run_job(self._job("script", command=agent.current_command()))
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
                self._job("function", function=_worker_main, args=(self._config, fn, args))
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
                lambda env: self._run_job(self._job("script", command=agent.current_command(), env=env)),
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

    def setup_environment(self) -> None:
        """Join the process group and select the device (done on first use otherwise)."""
        if self._environment_ready:
            return
        if self.needs_launch:
            raise ConfigurationError(
                f"This Engine wants {self.world_size_requested} processes but runs in one. Call "
                "engine.launch(fn) (or engine.launch() to re-run this script), or start it with torchrun or "
                "`stratagem run --devices N script.py`."
            )
        agent.install_worker_excepthook()
        env = cluster_mod.detect(
            accelerator=self.accelerator,
            devices=self.devices,
            num_nodes=self.num_nodes,
            timeout_s=self.timeout,
        )
        if self._source is not None and env.local_world_size != self.devices and self.devices != 1:
            warnings.warn(
                f"devices={self.devices}, but the launcher started {env.local_world_size} processes per node; "
                "using the launcher's count.",
                stacklevel=3,
            )
        self._hooks.setup_environment(env, self.precision)
        self._environment_ready = True

    # properties ------------------------------------------------------------------------------------
    @property
    def cluster(self) -> cluster_mod.ClusterEnvironment:
        self.setup_environment()
        return self.strategy.cluster

    @property
    def rank(self) -> int:
        return self.cluster.rank

    global_rank = rank

    @property
    def local_rank(self) -> int:
        return self.cluster.local_rank

    @property
    def node_rank(self) -> int:
        return self.cluster.node_rank

    @property
    def world_size(self) -> int:
        return self.cluster.world_size

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return (
            self.strategy.device
            if self._environment_ready
            else torch.device("cuda" if self.accelerator == "cuda" else "cpu")
        )

    @property
    def device_mesh(self) -> Any:
        """The strategy's ``DeviceMesh`` (``hsdp``, ``tp``, ``fsdp_tp`` own one), or ``None`` for a strategy
        without a mesh. The core only hands it on; what its dimensions mean is the strategy's to document."""
        self.setup_environment()
        return getattr(self.strategy, "device_mesh", None)

    # model -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def init_module(self, empty_init: bool = False) -> Iterator[None]:
        """Build the model in here: on the device, in the parameter dtype, on the meta device if
        ``empty_init`` and the strategy materialises it, with ``stratagem.wrap`` sharding submodules."""
        self.setup_environment()
        with self._hooks.model_init_context(empty_init), self._hooks.model_sharded_context():
            yield

    def setup(self, model: torch.nn.Module, *optimizers: Any) -> Any:
        """Wrap the model and its optimizers; return ``model`` or ``(model, *optimizers)``."""
        names = {id(p): _clean_name(n) for n, p in model.named_parameters()}
        wrapped = self.setup_module(model)
        if not optimizers:
            return wrapped
        for optimizer in optimizers:
            if getattr(optimizer, "state", None) and any(optimizer.state.values()):
                raise ConfigurationError(
                    "Engine.setup() got an optimizer that has taken steps already; set up before training."
                )
            if any(
                id(p) not in {id(q) for q in wrapped.parameters()}
                for group in optimizer.param_groups
                for p in group["params"]
            ):
                _rebind_optimizer(optimizer, names, wrapped)
        return (wrapped, *self.setup_optimizers(wrapped, *optimizers))

    def setup_module(self, model: torch.nn.Module) -> torch.nn.Module:
        self.setup_environment()
        wrapped = self._hooks.wrap_model(model)
        self._models.append(wrapped)
        return wrapped

    def setup_optimizers(self, model: torch.nn.Module, *optimizers: Any) -> list[StrategyOptimizer]:
        if not optimizers:
            raise ConfigurationError("setup_optimizers() needs at least one optimizer.")
        prepared = self._hooks.setup_optimizers(model, list(optimizers))
        return [StrategyOptimizer(opt, self._hooks, model) for opt in prepared]

    def setup_dataloaders(self, *loaders: Any, use_distributed_sampler: bool = True, seed: int = 0) -> Any:
        """Give each loader a ``DistributedSampler`` (unless it has a custom sampler); return them."""
        from stratagem.data import distribute_loader

        self.setup_environment()
        kwargs = self._hooks.distributed_sampler_kwargs()
        result = [
            distribute_loader(loader, kwargs, seed=seed) if use_distributed_sampler else loader
            for loader in loaders
        ]
        return result[0] if len(result) == 1 else result

    def forward_context(self) -> ContextManager[None]:
        return self._hooks.forward_context()

    autocast = forward_context

    # optimization ----------------------------------------------------------------------------------
    def _model_for(self, model: torch.nn.Module | None) -> torch.nn.Module:
        if model is not None:
            return model
        if len(self._models) != 1:
            raise ConfigurationError("Several models are set up: pass the one this call is for (model=...).")
        return self._models[0]

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None = None) -> None:
        self._hooks.backward(loss, self._model_for(model))

    def clip_gradients(self, model: torch.nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        return self._hooks.clip_gradients(model, _unwrap(optimizer), float(max_norm))

    def no_sync(self, model: torch.nn.Module | None = None, enabled: bool = True) -> ContextManager[None]:
        """Skip gradient synchronisation inside the block (accumulation steps) when ``enabled``."""
        if not enabled:
            return contextlib.nullcontext()
        return self._hooks.no_sync(self._model_for(model))

    # checkpoints -----------------------------------------------------------------------------------
    def save(
        self,
        path: str | os.PathLike[str],
        state: dict[str, Any],
        format: str | None = None,
        *,
        blocking: bool = True,
        _on_published: Callable[[], None] | None = None,
    ) -> None:
        """Save ``state`` from every rank (``format``: ``full`` or ``sharded``; default: the strategy's).

        ``path``: a local path or an object-store URL (``s3://``, ``gs://``, ``az://``, ``memory://``; see
        docs/checkpoints.md). ``blocking=False`` returns before the state is written, and what is written is the
        state at the call: parameters and optimizer state are copied in the background while the next forward
        and backward run (every optimizer's ``step`` waits for that copy), the rest before returning (sharded:
        ``torch.distributed.checkpoint.async_save``; full: rank 0 writes in a background thread). At
        most one save is in flight: the next save, a load, :meth:`wait_for_checkpoint` or :meth:`teardown` waits
        for it and raises its failure, naming the path, on every rank.
        """
        self.setup_environment()
        _store.location(path)  # an unknown URL scheme fails here, on every rank, before any collective
        self.wait_for_checkpoint()
        fmt = format or _default_format(self.strategy)
        caps = self.capabilities
        if caps is not None and fmt not in caps.checkpoint_formats:
            alternatives = [i.name for i in get_registry() if fmt in i.capabilities.checkpoint_formats]
            raise CapabilityError(self.strategy.name, "checkpoint format", fmt, alternatives)
        own_layout = type(self.strategy).save_checkpoint is not Strategy.save_checkpoint
        if blocking or own_layout:
            if not blocking:
                warnings.warn(
                    f"strategy {self.strategy.name!r} writes checkpoints its own way; saving synchronously.",
                    stacklevel=2,
                )
            self._hooks.save_checkpoint(os.fspath(path), _strategy_objects(state), fmt)
            if _on_published is not None:
                _on_published()
            return
        from stratagem.checkpoint import _io

        self._pending_save = _io.save(
            self.strategy,
            os.fspath(path),
            _strategy_objects(state),
            fmt,
            blocking=False,
            on_published=_on_published,
        )

    def checkpoint_in_flight(self) -> bool:
        """True while this rank's part of a ``blocking=False`` save is still being written."""
        return self._pending_save is not None and not self._pending_save.done()

    def wait_for_checkpoint(self) -> None:
        """Wait for the save in flight (``blocking=False``), on every rank; raise its failure with the path."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            from stratagem.checkpoint import _io

            _io.finish(self.strategy, pending)

    def load(
        self, path: str | os.PathLike[str], state: dict[str, Any], strict: bool = True
    ) -> dict[str, Any]:
        """Fill ``state``'s modules, optimizers and stateful objects in place; return the other saved entries."""
        self.setup_environment()
        self.wait_for_checkpoint()
        target = _store.location(path)
        if isinstance(target, Path) and not target.exists() and not _atomic.old_sibling(target).exists():
            raise CheckpointError(target, "does not exist. Pass the path of a checkpoint file or directory.")
        return self._hooks.load_checkpoint(os.fspath(path), _strategy_objects(state), strict)

    # collectives -----------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        self.setup_environment()
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.tensor(tensor, dtype=torch.float64)
        return self._hooks.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.setup_environment()
        return self._hooks.all_gather(tensor)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        self.setup_environment()
        return self._hooks.broadcast(obj, src)

    def barrier(self, name: str | None = None) -> None:
        self.setup_environment()
        self._hooks.barrier(name)

    # utilities -------------------------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if not self._environment_ready or self.rank == 0:
            print(*args, **kwargs)

    def seed_everything(self, seed: int, offset_by_rank: bool = False) -> int:
        rank = self.rank if self._environment_ready else 0
        return seed_everything(seed, rank=rank, offset_by_rank=offset_by_rank)

    def teardown(self) -> None:
        """Leave the process group. Call once at the end; the engine cannot be used after."""
        if self._environment_ready:
            self.wait_for_checkpoint()
            from stratagem.checkpoint import _io

            _io.release_async_resources(self.strategy)
            self._hooks.teardown()
            self._environment_ready = False


def _worker_main(config: dict[str, Any], fn: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    engine = Engine(**config)
    engine.setup_environment()
    # No teardown on error: its barrier would wait for peers that the agent is about to stop anyway.
    result = fn(engine, *args)
    engine.teardown()
    return result
