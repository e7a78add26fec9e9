"""``stratagem.Engine``: the strategy's operations for a hand-written loop (the Trainer is built on it)."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, ContextManager

import torch

from stratagem.engine import _strategy_choice
from stratagem.engine._checkpoint_io import Checkpoints
from stratagem.engine._defaults import DEFAULT_TIMEOUT_S, STRATEGY_ENV
from stratagem.engine._init_weights import wrap_and_load
from stratagem.engine._launching import Launching
from stratagem.engine._model_setup import Compiling
from stratagem.engine._strategy_optimizer import StrategyOptimizer, _clean_name, _rebind_optimizer
from stratagem.engine._training_steps import Steps
from stratagem.engine.seed import seed_everything
from stratagem.errors import ConfigurationError
from stratagem.launchers import _worker_start
from stratagem.launchers import cluster as cluster_mod
from stratagem.registry._labels import parse_label
from stratagem.registry._manager import StrategyHooks, get_registry, installed_plugins
from stratagem.strategies.base import Strategy
from stratagem.strategies.precision import normalize


class Engine(Launching, Checkpoints, Compiling, Steps):
    """Run a training loop under a strategy chosen by name.

    :param strategy: a registered name (``"ddp"``, ``"fsdp"``, ...), the same with options
        (``"fsdp_tp[tensor_parallel_size=2]"``, ``"fsdp[SHARD_GRAD_OP]"``), ``"auto"``, or a ``Strategy`` instance.
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
        _worker_start.check_max_restarts(max_restarts)
        self.max_restarts = max_restarts
        self.accelerator = cluster_mod.resolve_accelerator(accelerator)
        self.precision = normalize(precision)
        self.devices, self.num_nodes, self.timeout = devices, num_nodes, float(timeout)
        self._source = cluster_mod.launched_externally()
        if self._source is not None:
            # Record an uncaught exception for the launcher from the start, not only once training begins.
            _worker_start.install_worker_excepthook()
        self._check_devices()
        self.world_size_requested = self._expected_world_size()
        if self._source == "slurm":
            _worker_start.set_task_threads(self.accelerator)
        self._addons = tuple(addons)
        self._strategy_options: dict[str, Any] = {}  # a name's options, "fsdp_tp[tensor_parallel_size=2]"
        self._strategy_info, self._strategy = self._resolve_strategy(strategy)
        auto = strategy == "auto" if isinstance(strategy, str) else False  # planned at fit: choose_strategy
        self.plans_auto = auto and self.world_size_requested > 1 and not os.environ.get(STRATEGY_ENV)
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
            self._strategy = self._strategy_info.create(**self._strategy_options)
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
            info = _strategy_choice.info_for_instance(strategy)
            if info is not None:
                self._check(info.name)
            return info, strategy
        if not isinstance(strategy, str):
            raise ConfigurationError(f"strategy={strategy!r}: give a registered name or a Strategy instance.")
        name = strategy
        if name == "auto":
            name = os.environ.get(STRATEGY_ENV) or self._auto_name(registry)
        if "[" in name:
            name, self._strategy_options = parse_label(name, f"strategy={name!r}")
        return self._check(name), None

    def choose_strategy(self, workload: Any) -> Any:
        """``strategy="auto"`` on several processes, before set-up: the strategy a plan of ``workload`` (a
        ``stratagem.planning.Workload``) finds fitting with the least communication, said in one line."""
        choice = _strategy_choice.choose(workload, self)
        self._config["strategy"] = choice.strategy.name  # what workers built from this engine run
        if self.needs_launch:  # workers that re-run the script take it as `stratagem run --strategy` gives it
            os.environ[STRATEGY_ENV] = choice.strategy.name
        self._strategy_info, self._strategy = self._resolve_strategy(choice.strategy.name)
        self._hooks_cache, self.plans_auto = None, False
        return choice

    def _auto_name(self, registry: Any) -> str:
        request = dict(accelerator=self.accelerator, precision=self.precision)
        return registry.auto(world_size=self.world_size_requested, **request).name

    def _check(self, name: str) -> Any:
        return get_registry().check_request(
            name, accelerator=self.accelerator, precision=self.precision, world_size=self.world_size_requested
        )

    @property
    def capabilities(self) -> Any:
        info = (
            self._strategy_info
            if self._strategy_info is not None
            else _strategy_choice.info_for_instance(self.strategy)
        )
        return None if info is None else info.capabilities

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
        _worker_start.install_worker_excepthook()
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
    def data_parallel_size(self) -> int:
        """Replicas the data is dealt among (the sampler's ``num_replicas``): the world size, or fewer where
        ranks share their batches (tensor-parallel, pipeline)."""
        self.setup_environment()
        return int(self._hooks.distributed_sampler_kwargs()["num_replicas"])

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

    def setup(
        self, model: torch.nn.Module, *optimizers: Any, compile: Any = None, init_weights: Any = None
    ) -> Any:
        """Wrap the model and its optimizers; return ``model`` or ``(model, *optimizers)``.

        ``compile``: ``True``, or a dict of ``backend``, ``mode``, ``fullgraph``, ``dynamic`` and ``regional``
        (:class:`~stratagem.strategies.compiling.CompileOptions`), compiles the model with ``torch.compile``
        in the framework's place: after tensor parallelism and activation checkpointing, before data-parallel
        wrapping; each repeated block once by default. ``None`` takes ``STRATAGEM_COMPILE`` (``stratagem run
        --compile``), if set. A model wrapped by ``torch.compile`` already is unwrapped and compiled there.
        """
        names = {id(p): _clean_name(n) for n, p in model.named_parameters()}
        wrapped = self.setup_module(model, compile=compile, init_weights=init_weights)
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

    def setup_module(
        self, model: torch.nn.Module, compile: Any = None, init_weights: Any = None
    ) -> torch.nn.Module:
        """Wrap the model alone (``compile`` as in :meth:`setup`). ``init_weights``: Hugging Face weights to fill
        it with, each rank reading only its parts (a path, URL or ``HFWeights``; docs/hugging-face.md)."""
        self.setup_environment()
        wrapped = wrap_and_load(self, model, init_weights, lambda: self._wrap(model, compile))
        self._models.append(wrapped)
        return wrapped

    def setup_optimizers(self, model: torch.nn.Module, *optimizers: Any) -> list[StrategyOptimizer]:
        if not optimizers and not getattr(self.strategy, "provides_optimizer", False):
            raise ConfigurationError(
                "setup_optimizers() needs at least one optimizer (none only where the strategy's own "
                "configuration defines it)."
            )
        prepared = self._hooks.setup_optimizers(model, list(optimizers))
        return [StrategyOptimizer(opt, self._hooks, model) for opt in prepared]

    def setup_dataloaders(self, *loaders: Any, use_distributed_sampler: bool = True, seed: int = 0) -> Any:
        """Give each loader that takes its data in order or shuffled an
        :class:`~stratagem.engine.sampler.EpochSampler` (this rank's share of one order per epoch, drawn from
        ``seed`` and the epoch); return them. A sampler of the user's own is left alone."""
        from stratagem.engine.data import distribute_loader

        self.setup_environment()
        kwargs = self._hooks.distributed_sampler_kwargs()
        result = [
            distribute_loader(loader, kwargs, seed=seed) if use_distributed_sampler else loader
            for loader in loaders
        ]
        return result[0] if len(result) == 1 else result

    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """This process's share of the data: ``{"num_replicas": ..., "rank": ...}`` over the data-parallel
        ranks (tensor-parallel peers share one)."""
        self.setup_environment()
        return dict(self._hooks.distributed_sampler_kwargs())

    def forward_context(self) -> ContextManager[None]:
        return self._hooks.forward_context()

    autocast = forward_context

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
            from stratagem.checkpoint import _async

            _async.release_async_resources(self.strategy)
            self._hooks.teardown()
            self._environment_ready = False
