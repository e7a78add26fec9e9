"""``stratagem.Engine``: the strategy's operations for a hand-written loop (the Trainer is built on it), each
done by a part that the Engine makes with what it needs (see docs/architecture.md); no part calls the Engine."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any, ContextManager

import torch

from stratagem.engine._batch_steps import BatchSteps
from stratagem.engine._checkpoint_io import CheckpointIO
from stratagem.engine._defaults import DEFAULT_TIMEOUT_S
from stratagem.engine._launching import Launching, run_here, with_launcher
from stratagem.engine._model_setup import ModelSetup
from stratagem.engine._strategy_optimizer import StrategyOptimizer, _unwrap
from stratagem.engine._strategy_runtime import StrategyRuntime, make_request
from stratagem.engine.seed import seed_everything
from stratagem.launchers import cluster as cluster_mod
from stratagem.strategies.base import Strategy
from stratagem.strategies.compiling import CompileOptions
from stratagem.strategies.step import StepOutput


class Engine:
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
        # What workers rebuild this Engine from: the arguments (read first, while locals() holds only them).
        self._config = {name: value for name, value in locals().items() if name != "self"}
        self._config.update(addons=tuple(addons), launcher_options=dict(launcher_options or {}))
        request = with_launcher(
            make_request(accelerator, precision, devices, num_nodes, timeout, max_restarts), launcher
        )
        self.accelerator, self.precision = request.accelerator, request.precision
        self.devices, self.num_nodes, self.timeout = request.devices, request.num_nodes, request.timeout
        self.max_restarts, self.world_size_requested = max_restarts, request.world_size
        self._runtime = StrategyRuntime(strategy, request, tuple(addons))
        self._launching = Launching(request, self._config, engine_class=type(self), runtime=self._runtime)
        if not request.needs_launch:
            # A process that only launches workers never uses the strategy: importing it (a plugin and
            # what it imports) would only delay the workers' start.
            _ = self._runtime.hooks
        self._models = ModelSetup(self._runtime)
        self._batches = BatchSteps(self._runtime, self._models)
        self._checkpoints = CheckpointIO(self._runtime)

    # construction ----------------------------------------------------------------------------------
    def __getstate__(self) -> dict[str, Any]:
        # The arguments alone: the plugin manager does not travel.
        return {"config": self._config}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state["config"])  # type: ignore[misc]

    @property
    def strategy(self) -> Strategy:
        return self._runtime.strategy

    @property
    def strategy_name(self) -> str:
        """The strategy's name, without creating it."""
        return self._runtime.name

    @property
    def capabilities(self) -> Any:
        return self._runtime.capabilities

    @property
    def plans_auto(self) -> bool:
        """``strategy="auto"`` on several processes: the strategy is chosen at ``fit``, by a plan of the model."""
        return self._runtime.plans_auto

    def choose_strategy(self, workload: Any) -> Any:
        """For :attr:`plans_auto`, before set-up: the strategy a plan of ``workload`` (a
        ``stratagem.planning.Workload``) finds fitting with the least communication, said in one line."""
        return self._runtime.choose(workload, self._config)

    def setup_environment(self) -> None:
        """Join the process group and select the device (done on first use otherwise)."""
        self._runtime.setup_environment()

    # launching -------------------------------------------------------------------------------------
    @property
    def needs_launch(self) -> bool:
        """True in the user's process when it starts the workers (several wanted, or ``always_launches``)."""
        return self._runtime.request.needs_launch

    def supervise(self, **job: Any) -> None:
        """Re-run this very command in the workers, then end this process with their status (it only
        supervises: the rest of the script ran in the workers). ``job``: more fields of the
        :class:`~stratagem.launchers.LaunchJob` (the Trainer's preemption settings)."""
        self._launching.supervise(**job)

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
            return self._launching.launch(fn, args)
        return run_here(self, fn, args)

    # properties ------------------------------------------------------------------------------------
    @property
    def cluster(self) -> cluster_mod.ClusterEnvironment:
        self.setup_environment()
        return self._runtime.strategy.cluster

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
        return self._runtime.device

    @property
    def data_parallel_size(self) -> int:
        """Replicas the data is dealt among (the sampler's ``num_replicas``): the world size, or fewer where
        ranks share their batches (tensor-parallel, pipeline)."""
        return int(self._runtime.joined().distributed_sampler_kwargs()["num_replicas"])

    @property
    def device_mesh(self) -> Any:
        """The strategy's ``DeviceMesh`` (``hsdp``, ``tp``, ``fsdp_tp`` own one), or ``None`` for a strategy
        without a mesh. The core only hands it on; what its dimensions mean is the strategy's to document."""
        self.setup_environment()
        return getattr(self._runtime.strategy, "device_mesh", None)

    # model -----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def init_module(self, empty_init: bool = False) -> Iterator[None]:
        """Build the model in here: on the device, in the parameter dtype, on the meta device if
        ``empty_init`` and the strategy materialises it, with ``stratagem.wrap`` sharding submodules."""
        hooks = self._runtime.joined()
        with hooks.model_init_context(empty_init), hooks.model_sharded_context():
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
        return self._models.setup(model, optimizers, compile, init_weights)

    def setup_module(
        self, model: torch.nn.Module, compile: Any = None, init_weights: Any = None
    ) -> torch.nn.Module:
        """Wrap the model alone (``compile`` as in :meth:`setup`). ``init_weights``: Hugging Face weights to fill
        it with, each rank reading only its parts (a path, URL or ``HFWeights``; docs/hugging-face.md)."""
        return self._models.setup_module(model, compile, init_weights)

    def setup_optimizers(self, model: torch.nn.Module, *optimizers: Any) -> list[StrategyOptimizer]:
        return self._models.setup_optimizers(model, optimizers)

    def resolve_compile(self, compile: Any) -> CompileOptions | None:
        """``compile=`` checked (``None``: ``STRATAGEM_COMPILE`` if set, else no compile), and allowed by the
        strategy's declared capabilities."""
        return self._models.resolve_compile(compile)

    @property
    def compiled_regions(self) -> list[str]:
        """The regions the last ``setup``/``setup_module`` compiled ("" for a whole module); empty without
        compile."""
        return self._models.compiled_regions

    def setup_dataloaders(self, *loaders: Any, use_distributed_sampler: bool = True, seed: int = 0) -> Any:
        """Give each loader that takes its data in order or shuffled an
        :class:`~stratagem.engine.sampler.EpochSampler` (this rank's share of one order per epoch, drawn from
        ``seed`` and the epoch); return them. A sampler of the user's own is left alone."""
        self.setup_environment()
        return self._runtime.distribute(loaders, use_distributed_sampler, seed)

    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """This process's share of the data: ``{"num_replicas": ..., "rank": ...}`` over the data-parallel
        ranks (tensor-parallel peers share one)."""
        return dict(self._runtime.joined().distributed_sampler_kwargs())

    # steps -----------------------------------------------------------------------------------------
    def forward_context(self) -> ContextManager[None]:
        return self._runtime.hooks.forward_context()

    autocast = forward_context

    def backward(self, loss: torch.Tensor, model: torch.nn.Module | None = None) -> None:
        self._runtime.hooks.backward(loss, self._models.model_for(model))

    def clip_gradients(self, model: torch.nn.Module, optimizer: Any, max_norm: float) -> torch.Tensor:
        return self._runtime.hooks.clip_gradients(model, _unwrap(optimizer), float(max_norm))

    def no_sync(self, model: torch.nn.Module | None = None, enabled: bool = True) -> ContextManager[None]:
        """Skip gradient synchronisation inside the block (accumulation steps) when ``enabled``."""
        if not enabled:
            return contextlib.nullcontext()
        return self._runtime.hooks.no_sync(self._models.model_for(model))

    def train_batch(
        self,
        model: torch.nn.Module | None,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        *,
        loss_scale: float = 1.0,
    ) -> StepOutput:
        """Forward and backward of one batch under any strategy; returns its loss (detached).

        ``inputs``: the model's positional arguments (a tuple; anything else is the only argument), their
        first dimension the batch. ``loss_fn(outputs, targets)`` returns the batch's mean loss. Gradients are
        those of ``loss_scale`` times the loss (``1 / accumulation`` when accumulating), added to ``.grad``.
        Under a pipeline, pass the same batch on every rank of the pipeline: the first stage reads the
        inputs, the last the targets, and the loss comes back on every rank. ``outputs`` of the result are
        the model's outputs where this rank has them (under a pipeline, on the last stage only).
        """
        return self._batches.train_batch(model, inputs, targets, loss_fn, loss_scale)

    def eval_batch(
        self,
        model: torch.nn.Module | None,
        inputs: Any,
        targets: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> StepOutput:
        """Forward only (no gradients) of one batch under any strategy; the loss when ``loss_fn`` and
        ``targets`` are given. The model's train/eval mode is the caller's to set."""
        return self._batches.eval_batch(model, inputs, targets, loss_fn)

    # the hooks themselves, for loops with an ordinary path of their own (the Trainer) -------------
    def check_batch_size(self, batch_size: int) -> None:
        """Let the strategy refuse a per-process batch size before the first batch."""
        self._runtime.hooks.check_batch_size(batch_size)

    def run_training_batch(
        self,
        model: torch.nn.Module,
        batch: Any,
        batch_idx: int,
        split_batch: Callable[[Any], tuple[tuple[Any, ...], Any]],
        compute_loss: Callable[[Any, Any], torch.Tensor],
        loss_scale: float = 1.0,
    ) -> StepOutput | None:
        """The strategy's own forward and backward of ``batch``, or ``None``: run the ordinary path then."""
        return self._runtime.hooks.run_training_batch(
            model, batch, batch_idx, split_batch, compute_loss, loss_scale
        )

    def run_evaluation_batch(
        self,
        model: torch.nn.Module,
        batch: Any,
        batch_idx: int,
        split_batch: Callable[[Any], tuple[tuple[Any, ...], Any]],
        compute_loss: Callable[[Any, Any], torch.Tensor] | None,
        stage: str,
    ) -> StepOutput | None:
        """The strategy's own forward-only run of ``batch``, or ``None``: call the ``*_step`` then."""
        return self._runtime.hooks.run_evaluation_batch(
            model, batch, batch_idx, split_batch, compute_loss, stage
        )

    def weight_shards(self, model: torch.nn.Module, purpose: str) -> list[Any]:
        """The parts of ``model``'s tensors this rank holds (the ``weight_shards`` hook, through any add-ons), for
        Hugging Face weights read into it (``purpose="load"``) or written from it (``"export"``)."""
        return self._runtime.hooks.weight_shards(model, purpose)

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
        self._checkpoints.save(path, state, format, blocking=blocking, on_published=_on_published)

    def checkpoint_in_flight(self) -> bool:
        """True while this rank's part of a ``blocking=False`` save is still being written."""
        return self._checkpoints.in_flight()

    def wait_for_checkpoint(self) -> None:
        """Wait for the save in flight (``blocking=False``), on every rank; raise its failure with the path."""
        self._checkpoints.wait()

    def load(
        self, path: str | os.PathLike[str], state: dict[str, Any], strict: bool = True
    ) -> dict[str, Any]:
        """Fill ``state``'s modules, optimizers and stateful objects in place; return the other saved entries."""
        return self._checkpoints.load(path, state, strict)

    # collectives -----------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor | float, op: str = "mean") -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            tensor = torch.tensor(tensor, dtype=torch.float64)
        return self._runtime.joined().all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self._runtime.joined().all_gather(tensor)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._runtime.joined().broadcast(obj, src)

    def barrier(self, name: str | None = None) -> None:
        self._runtime.joined().barrier(name)

    # utilities -------------------------------------------------------------------------------------
    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on rank 0 only."""
        if not self._runtime.ready or self.rank == 0:
            print(*args, **kwargs)

    def seed_everything(self, seed: int, offset_by_rank: bool = False) -> int:
        rank = self.rank if self._runtime.ready else 0
        return seed_everything(seed, rank=rank, offset_by_rank=offset_by_rank)

    def teardown(self) -> None:
        """Leave the process group. Call once at the end; the engine cannot be used after."""
        if self._runtime.ready:
            self._checkpoints.close()
            self._runtime.leave()
