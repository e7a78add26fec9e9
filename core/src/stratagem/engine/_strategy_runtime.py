"""What an Engine runs on: the request (devices, nodes, accelerator, precision, where this process was started)
checked when the Engine is made, and the strategy chosen by name: its registry entry checked against the
request at once, the instance and its hooks created on first use (a process that only launches workers never
imports the plugin), and this process's place in the process group once the strategy has joined it."""

from __future__ import annotations

import os
import warnings
from typing import Any

import attrs
import torch

from stratagem.engine._defaults import STRATEGY_ENV
from stratagem.errors import ConfigurationError
from stratagem.launchers import _worker_start
from stratagem.launchers import cluster as cluster_mod
from stratagem.registry._labels import parse_label
from stratagem.registry._manager import StrategyHooks, get_registry, installed_plugins
from stratagem.strategies.base import Strategy
from stratagem.strategies.precision import normalize


@attrs.frozen(kw_only=True)
class Request:
    """What an Engine was asked for, and where this process runs: ``source`` names the launcher that started
    it (``None``: the user started it), ``world_size`` the processes wanted in all."""

    accelerator: str
    precision: str
    devices: int
    num_nodes: int
    timeout: float
    max_restarts: int
    source: str | None
    world_size: int
    #: The launcher declares ``always_launches``: one process per node is launched through it too.
    always_launch: bool = False

    @property
    def needs_launch(self) -> bool:
        """More than one process is wanted and none exist yet, or the launcher always launches (it starts
        more than one world: replica groups): this process starts the workers."""
        return self.source is None and (self.world_size > 1 or self.always_launch)


def make_request(
    accelerator: str, precision: str | int, devices: int, num_nodes: int, timeout: float, max_restarts: int
) -> Request:
    """The Engine's arguments checked, resolved (``"auto"``) and placed: refused before anything starts."""
    if not isinstance(devices, int) or devices < 1:
        raise ConfigurationError(f"devices={devices!r}: give a positive number of processes per node.")
    if not isinstance(num_nodes, int) or num_nodes < 1:
        raise ConfigurationError(f"num_nodes={num_nodes!r}: give a positive number of nodes.")
    _worker_start.check_max_restarts(max_restarts)
    accelerator = cluster_mod.resolve_accelerator(accelerator)
    precision = normalize(precision)
    timeout = float(timeout)
    source = cluster_mod.launched_externally()
    if source is not None:
        # Record an uncaught exception for the launcher from the start, not only once training begins.
        _worker_start.install_worker_excepthook()
    if accelerator == "cuda" and source is None:
        available = torch.cuda.device_count()
        if devices > available:
            raise ConfigurationError(
                f"devices={devices} but this machine has {available} CUDA device(s). "
                f"Use devices<={available}, or accelerator='cpu' to run {devices} CPU processes."
            )
    world_size = devices * num_nodes
    if source is not None:
        env = cluster_mod.detect(
            accelerator=accelerator, devices=devices, num_nodes=num_nodes, timeout_s=timeout
        )
        world_size = env.world_size
    if source == "slurm":
        _worker_start.set_task_threads(accelerator)
    return Request(
        accelerator=accelerator,
        precision=precision,
        devices=devices,
        num_nodes=num_nodes,
        timeout=timeout,
        max_restarts=max_restarts,
        source=source,
        world_size=world_size,
    )


class StrategyRuntime:
    """The strategy of one Engine, and the process group it joins: what every other part of the Engine calls
    the strategy's hooks through."""

    def __init__(self, strategy: str | Strategy, request: Request, addons: tuple[object, ...]) -> None:
        self.request = request
        self._addons = addons
        self._options: dict[str, Any] = {}  # a name's options, "fsdp_tp[tensor_parallel_size=2]"
        self._info, self.created = self._resolve(strategy)
        self._named = self.created is None
        self._hooks: StrategyHooks | None = None
        auto = isinstance(strategy, str) and strategy == "auto"
        #: ``strategy="auto"`` on several processes, not chosen yet: planned at ``fit`` (docs/planning.md).
        self.plans_auto = auto and request.world_size > 1 and not os.environ.get(STRATEGY_ENV)
        #: Whether this process has joined the process group (``setup_environment``) and not left it.
        self.ready = False

    # the strategy ------------------------------------------------------------------------------------
    @property
    def strategy(self) -> Strategy:
        if self.created is None:
            self.created = self._info.create(**self._options)
        return self.created

    @property
    def name(self) -> str:
        return self.created.name if self.created is not None else self._info.name

    @property
    def hooks(self) -> StrategyHooks:
        if self._hooks is None:
            addons = [*installed_plugins(), *self._addons] if self._addons else None
            self._hooks = StrategyHooks(self.strategy, addons=addons)
        return self._hooks

    @property
    def capabilities(self) -> Any:
        info = self._info if self._info is not None else _info_for_instance(self.strategy)
        return None if info is None else info.capabilities

    def choose(self, workload: Any, engine_arguments: dict[str, Any]) -> Any:
        """``strategy="auto"`` planned: the strategy chosen for ``workload`` replaces the registry's pick, in this
        process and in the workers (built from ``engine_arguments``, or re-running the script)."""
        from stratagem.engine import _strategy_choice

        choice = _strategy_choice.choose(workload, self.request)
        name = choice.strategy.name
        engine_arguments["strategy"] = name
        if (
            self.request.needs_launch
        ):  # workers re-running the script take it as `stratagem run --strategy` does
            os.environ[STRATEGY_ENV] = name
        self._options = {}
        self._info, self.created = self._resolve(name)
        self._hooks, self.plans_auto = None, False
        return choice

    def _resolve(self, strategy: str | Strategy) -> tuple[Any, Strategy | None]:
        """The registry's entry for the strategy (checked against the request) and the instance, if given."""
        registry = get_registry()
        if isinstance(strategy, Strategy):
            info = _info_for_instance(strategy)
            if info is not None:
                self._check(info.name)
            return info, strategy
        if not isinstance(strategy, str):
            raise ConfigurationError(f"strategy={strategy!r}: give a registered name or a Strategy instance.")
        name = strategy
        if name == "auto":
            request = dict(accelerator=self.request.accelerator, precision=self.request.precision)
            name = (
                os.environ.get(STRATEGY_ENV)
                or registry.auto(world_size=self.request.world_size, **request).name
            )
        if "[" in name:
            name, self._options = parse_label(name, f"strategy={name!r}")
        return self._check(name), None

    def job_strategy(self) -> dict[str, Any]:
        """The strategy's name and options for a launch job, when it was given by name (an instance does not
        say its options)."""
        if not self._named or self._info is None:
            return {}
        return {"strategy": self._info.name, "strategy_options": dict(self._options)}

    def _check(self, name: str) -> Any:
        request = self.request
        return get_registry().check_request(
            name, accelerator=request.accelerator, precision=request.precision, world_size=request.world_size
        )

    # the process group -------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Join the process group and select the device, once."""
        if self.ready:
            return
        request = self.request
        if request.needs_launch:
            raise ConfigurationError(
                f"This Engine wants {request.world_size} processes but runs in one. Call "
                "engine.launch(fn) (or engine.launch() to re-run this script), or start it with torchrun or "
                "`stratagem run --devices N script.py`."
            )
        _worker_start.install_worker_excepthook()
        env = cluster_mod.detect(
            accelerator=request.accelerator,
            devices=request.devices,
            num_nodes=request.num_nodes,
            timeout_s=request.timeout,
        )
        if request.source is not None and env.local_world_size != request.devices and request.devices != 1:
            warnings.warn(
                f"devices={request.devices}, but the launcher started {env.local_world_size} processes per node; "
                "using the launcher's count.",
                stacklevel=4,
            )
        self.hooks.setup_environment(env, request.precision)
        self.ready = True

    def joined(self) -> StrategyHooks:
        """The hooks, once this process has joined the process group (what collectives and loaders need)."""
        self.setup_environment()
        return self.hooks

    @property
    def device(self) -> torch.device:
        if self.ready:
            return self.strategy.device
        return torch.device("cuda" if self.request.accelerator == "cuda" else "cpu")

    def distribute(self, loaders: tuple[Any, ...], use_distributed_sampler: bool, seed: int) -> Any:
        """``Engine.setup_dataloaders`` once this process has joined: each loader with its share of the data."""
        from stratagem.engine.data import distribute_loader

        kwargs = self.hooks.distributed_sampler_kwargs()
        result = [
            distribute_loader(loader, kwargs, seed=seed) if use_distributed_sampler else loader
            for loader in loaders
        ]
        return result[0] if len(result) == 1 else result

    @property
    def rank(self) -> int:
        self.setup_environment()
        return self.strategy.cluster.rank

    def leave(self) -> None:
        """The strategy's teardown: this process leaves the process group."""
        self.hooks.teardown()
        self.ready = False


def _info_for_instance(strategy: Strategy) -> Any:
    """The registry's entry for a strategy built by hand: the name it was created under, else its class's."""
    registry = get_registry()
    if strategy.registered_name in registry:
        return registry.get(strategy.registered_name)
    target = f"{type(strategy).__module__}:{type(strategy).__qualname__}"
    for info in registry:
        if info.factory is type(strategy) or info.factory == target:
            return info
    return None
