"""Every hook of stratagem, grouped by phase.

Strategy operations are ``firstresult``: the chosen strategy is the only plain implementation of each, and
add-on plugins (compile, profiling, ...) may only wrap them with ``@hookimpl(wrapper=True)``; the plugin
manager refuses anything else, so "the first non-``None`` result" is always the strategy's.

Trainer events (the last group) are a second kind: broadcast hooks that every callback and logger registered
for one Trainer implements as it likes; every implementation runs, and none returns anything.

Hooks are called with keyword arguments only, and an implementation may accept fewer arguments than the spec
offers, so a spec can grow without breaking plugins. This module imports nothing heavy: the types below are
for readers and type checkers only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ContextManager

import pluggy

if TYPE_CHECKING:
    import torch

    from stratagem.checkpoint._hf_shards import WeightShard
    from stratagem.launchers._job import LaunchJob
    from stratagem.launchers.cluster import ClusterEnvironment
    from stratagem.planning import MemoryEstimate, World
    from stratagem.strategies.compiling import Compiler
    from stratagem.strategies.step import StepOutput

PROJECT_NAME = "stratagem"

#: Marks a hook specification: every function below carries it.
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
#: Marks a plugin's implementation of a hook: ``@hookimpl`` on a function or method named after the hook, or
#: ``@hookimpl(wrapper=True)`` for an add-on that wraps a strategy operation.
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# -------------------------------------------------------------------------------------------------
# discovery
# -------------------------------------------------------------------------------------------------


@hookspec
def register_strategies(register: Callable[..., None]) -> None:
    """Register the strategies a plugin provides.

    Called once per plugin when the registry is first built; every implementation runs.
    Must not import heavy modules (torch, deepspeed): pass a ``"pkg.module:Class"`` string as factory.

    :param register: ``register(name, factory, *, description, capabilities, **preset_options)``.
    """


@hookspec
def register_install_hints(register: Callable[..., None]) -> None:
    """Say which distributions provide names this plugin does not register.

    That is the hint a user gets when one of those names is asked for and not installed (``Unknown launcher
    'ray'. It comes with stratagem-ray: pip install stratagem-ray.``). The core names no plugin package, so
    what to install comes from the plugins that are installed: a family of packages names its siblings. Called once per plugin when the registry is built; every implementation
    runs. Must not import heavy modules.

    :param register: ``register(distribution, *, strategies=(), launchers=(), callbacks=(), loggers=(),
        install=None)``: the names of each kind that ``distribution`` registers; ``install`` is what to
        ``pip install`` (default: the distribution).
    """


# -------------------------------------------------------------------------------------------------
# environment
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def setup_environment(cluster: ClusterEnvironment, precision: str) -> None:
    """Prepare this process: initialise the process group, select the device.

    Stops at the first non-``None`` result.

    :param cluster: where this process runs (ranks, world size, master address, device, backend).
    :param precision: the requested precision, e.g. ``"32-true"`` or ``"bf16-mixed"``.
    """


# -------------------------------------------------------------------------------------------------
# model
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def model_init_context(empty_init: bool) -> ContextManager[None]:
    """Return the context in which the user builds the model.

    Stops at the first non-``None`` result.

    :param empty_init: when true, parameters need not be initialised (meta device where the strategy can
        materialise them later).
    """


@hookspec(firstresult=True)
def model_sharded_context() -> ContextManager[None]:
    """Return the context in which ``stratagem.wrap(module)`` shards a submodule (a no-op elsewhere).

    Stops at the first non-``None`` result.
    """


@hookspec(firstresult=True)
def wrap_model(model: torch.nn.Module, compiler: Compiler) -> torch.nn.Module:
    """Wrap the model for this strategy (move, shard, replicate) and return the module to train.

    Stops at the first non-``None`` result.

    Where compile goes: the framework's order is tensor parallelism, activation checkpointing, compile, then
    data-parallel wrapping. An implementation that does not take ``compiler`` gets the model compiled before
    this hook is called (right when it only replicates or shards for data parallelism). One that takes it
    calls ``compiler(module)`` itself, after its own tensor-parallel and activation-checkpointing steps and
    before its data-parallel wrapping; the Engine checks that it did.

    :param model: the user's module, possibly built under :func:`model_init_context`.
    :param compiler: compiles a module in place (each repeated block once, or the whole module) with the
        run's ``compile=`` options; a no-op when the run does not compile (``compiler.enabled`` says which).
    """


@hookspec(firstresult=True)
def forward_context() -> ContextManager[None]:
    """Return the context around forward and loss (autocast for mixed precision).

    Stops at the first non-``None`` result.
    """


# -------------------------------------------------------------------------------------------------
# optimization
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def setup_optimizers(
    model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]
) -> list[torch.optim.Optimizer]:
    """Return the optimizers the loop must use (the strategy may replace or wrap them).

    Stops at the first non-``None`` result.

    :param model: the wrapped model returned by :func:`wrap_model`.
    :param optimizers: the user's optimizers, built over the wrapped model's parameters.
    """


@hookspec(firstresult=True)
def backward(loss: torch.Tensor, model: torch.nn.Module) -> None:
    """Compute gradients of ``loss``.

    Stops at the first non-``None`` result.

    :param loss: the scalar loss of this micro-batch.
    :param model: the wrapped model.
    """


@hookspec(firstresult=True)
def optimizer_step(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
    """Apply the accumulated gradients and clear them.

    Stops at the first non-``None`` result.

    :param optimizer: one of the optimizers returned by :func:`setup_optimizers`.
    :param model: the wrapped model.
    """


@hookspec(firstresult=True)
def clip_gradients(model: torch.nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Clip the gradients to a total norm of ``max_norm``; return the total norm before clipping.

    Stops at the first non-``None`` result.

    :param model: the wrapped model.
    :param optimizer: the optimizer whose parameters are clipped.
    :param max_norm: the largest total 2-norm allowed.
    """


@hookspec(firstresult=True)
def no_sync(model: torch.nn.Module) -> ContextManager[None]:
    """Return a context in which backward skips gradient synchronisation (gradient accumulation).

    Stops at the first non-``None`` result.

    :param model: the wrapped model.
    """


# -------------------------------------------------------------------------------------------------
# step: a strategy that runs forward and backward itself (a pipeline); the others return None
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def check_batch_size(batch_size: int) -> None:
    """Refuse a per-process batch size this strategy cannot run (raise ``ConfigurationError`` saying what fits).

    Stops at the first non-``None`` result. The Trainer calls it on every rank once the model is set up,
    before the first batch, with the train loader's per-process batch size (when it has a fixed one).

    :param batch_size: samples per process in one batch.
    """


@hookspec(firstresult=True)
def run_training_batch(
    model: torch.nn.Module,
    batch: Any,
    batch_idx: int,
    split_batch: Callable[[Any], tuple[tuple[Any, ...], Any]],
    compute_loss: Callable[[Any, Any], torch.Tensor],
    loss_scale: float,
) -> StepOutput | None:
    """Run forward and backward of one batch, or return ``None`` to let the loop do it its ordinary way.

    Stops at the first non-``None`` result. A strategy that owns the step (a pipeline, where forward and
    backward of the micro-batches interleave inside a schedule) returns a :class:`StepOutput` whose ``loss``
    is the batch's mean loss, detached and unscaled, the same on every rank that ran the batch. It leaves the
    gradients of ``loss_scale`` times that loss added to the parameters' ``.grad``. On ``None`` (the base
    class) the Trainer runs ``forward_context``, ``training_step`` and ``backward``, and ``Engine.train_batch``
    runs ``forward_context``, the model, the loss function and ``backward``.

    :param model: the module :func:`wrap_model` returned.
    :param batch: the batch, on the device.
    :param batch_idx: its index in the epoch.
    :param split_batch: ``split_batch(batch)`` -> ``(inputs, targets)``: ``inputs`` the model's positional
        arguments (their first dimension the batch), ``targets`` what ``compute_loss`` compares outputs with.
    :param compute_loss: ``compute_loss(outputs, targets)`` -> the mean loss of a batch (or micro-batch), a
        scalar tensor.
    :param loss_scale: the factor of the loss whose gradients backward computes (``1 / accumulate_grad_batches``).
    """


@hookspec(firstresult=True)
def run_evaluation_batch(
    model: torch.nn.Module,
    batch: Any,
    batch_idx: int,
    split_batch: Callable[[Any], tuple[tuple[Any, ...], Any]],
    compute_loss: Callable[[Any, Any], torch.Tensor] | None,
    stage: str,
) -> StepOutput | None:
    """Run forward only on one batch, or return ``None`` to let the loop call its ``*_step`` method.

    Stops at the first non-``None`` result. Runs under ``torch.no_grad()`` with the model in eval mode. A
    strategy that owns the step returns a :class:`StepOutput`: ``loss`` as for :func:`run_training_batch`
    (``None`` without ``compute_loss`` or targets), ``outputs`` the model's outputs on the ranks that hold
    them (the last stage's) and ``None`` elsewhere.

    :param model: the module :func:`wrap_model` returned.
    :param batch: the batch, on the device.
    :param batch_idx: its index in the loader.
    :param split_batch: as for :func:`run_training_batch`.
    :param compute_loss: as for :func:`run_training_batch`, or ``None`` when no loss is wanted.
    :param stage: ``"validation"``, ``"test"`` or ``"predict"``.
    """


# -------------------------------------------------------------------------------------------------
# data
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def distributed_sampler_kwargs() -> dict[str, int]:
    """Return ``{"num_replicas": ..., "rank": ...}`` for the sampler that deals the data to the ranks.

    Stops at the first non-``None`` result.
    """


# -------------------------------------------------------------------------------------------------
# checkpoint
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def save_checkpoint(path: str, state: dict[str, Any], format: str) -> None:
    """Save ``state`` (live modules, optimizers, stateful objects and plain values) to ``path``.

    Called on every rank. Stops at the first non-``None`` result.

    :param path: the target file (``full``) or directory (``sharded``).
    :param state: ``{"model": module, "optimizer": opt, "step": 10, ...}``.
    :param format: ``"full"`` or ``"sharded"``, one the strategy declares.
    """


@hookspec(firstresult=True)
def load_checkpoint(path: str, state: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Fill the live objects of ``state`` from ``path`` in place; return the remainder.

    Called on every rank. Stops at the first non-``None`` result.

    :param path: a full checkpoint file or a sharded checkpoint directory (the format is detected).
    :param state: the live objects to fill, keyed as when saved.
    :param strict: when true, missing or unexpected keys are an error.
    :returns: the saved entries that are neither modules, optimizers nor stateful objects of ``state``.
    """


@hookspec(firstresult=True)
def weight_shards(model: torch.nn.Module, purpose: str) -> list[WeightShard]:
    """This rank's part of every tensor of the model's state dict, as live views, for Hugging Face weights.

    Called on every rank. Stops at the first non-``None`` result. Loading safetensors (``init_weights``) writes
    into each shard's tensor and reads only the checkpoint bytes it covers; an export reads each shard and
    writes it in place in the output files, one replica of each part. The base class takes the sharded state
    dict (``module_state_dict(full=False)``), whose tensors share memory with the model's: DTensors as
    rectangles of their global tensors, plain tensors whole. A strategy that keeps tensors another way returns
    its own (ranges of flattened tensors for ZeRO-3 partitions).

    :param model: the module ``wrap_model`` returned.
    :param purpose: ``"load"`` (before the optimizers are set up: writing the shards must be all it takes) or
        ``"export"`` (reading them).
    :returns: a list of :class:`~stratagem.checkpoint.hf.WeightShard`, named as in the unwrapped model's state
        dict; together the ranks' shards cover every tensor.
    """


# -------------------------------------------------------------------------------------------------
# collectives
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """Reduce ``tensor`` across all ranks and return the result (the input is left unchanged).

    Stops at the first non-``None`` result.

    :param tensor: a tensor of the same shape on every rank.
    :param op: ``"sum"``, ``"mean"``, ``"max"`` or ``"min"``.
    """


@hookspec(firstresult=True)
def all_gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Gather ``tensor`` from every rank; shapes may differ between ranks.

    Stops at the first non-``None`` result.

    :param tensor: this rank's tensor.
    :returns: one tensor per rank, in rank order.
    """


@hookspec(firstresult=True)
def broadcast(obj: Any, src: int) -> Any:
    """Send a picklable object from rank ``src`` to every rank and return it.

    Stops at the first non-``None`` result.

    :param obj: the object (only ``src``'s value matters).
    :param src: the sending rank.
    """


@hookspec(firstresult=True)
def barrier(name: str | None) -> None:
    """Wait until every rank reaches this point.

    Stops at the first non-``None`` result.

    :param name: a label for logs and debugging.
    """


# -------------------------------------------------------------------------------------------------
# teardown
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def teardown() -> None:
    """Release what :func:`setup_environment` acquired (process group, devices, memory).

    Stops at the first non-``None`` result.
    """


# -------------------------------------------------------------------------------------------------
# planning: asked by `stratagem plan` and strategy="auto" before any run, never during one
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def estimate_memory(model: torch.nn.Module, world: World) -> MemoryEstimate | None:
    """Estimate what each rank of this strategy holds, for a strategy the plan cannot simulate.

    Stops at the first non-``None`` result. The plan asks before simulating: ``None`` (the base class) lets it
    set the strategy up through its own hooks on a simulated world of fake tensors; a strategy whose hooks
    cannot run there (its own engine, a runtime that needs devices) returns a
    :class:`stratagem.planning.MemoryEstimate`.

    :param model: the user's model, built on the meta device (shapes and dtypes, no values).
    :param world: the simulated world: devices, nodes, precision, optimizer, micro-batch and sequence length.
    """


# -------------------------------------------------------------------------------------------------
# launchers: how worker processes start (a second kind of plugin, registered in the same group)
# -------------------------------------------------------------------------------------------------


@hookspec
def register_launchers(register: Callable[..., None]) -> None:
    """Register the launchers a plugin provides.

    Called once per plugin when the registry is first built; every implementation runs. Must not import
    heavy modules (ray, torch): pass a ``"pkg.module:Class"`` string as factory.

    :param register: ``register(name, factory, *, description, capabilities, **preset_options)``, with
        :class:`stratagem.launchers.LauncherCapabilities`.
    """


@hookspec(firstresult=True)
def launch_workers(job: LaunchJob) -> dict[int, Any]:
    """Start the workers of ``job``, wait for them, and return this node's results by global rank.

    Stops at the first non-``None`` result: the chosen launcher answers. Each worker gets the rank
    environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``,
    ``MASTER_ADDR``, ``MASTER_PORT``, ``STRATAGEM_WORKER=1``) plus ``job.env``. A script job re-runs
    ``job.command`` in every worker; a function job calls ``job.function(*job.args)``. A worker that fails
    raises :class:`stratagem.WorkerFailedError` here naming its rank, after the launcher's restarts
    (``job.max_restarts``; restarted workers see ``STRATAGEM_RESTART_COUNT``) are used up.

    :param job: what to run and where (:class:`stratagem.launchers.LaunchJob`).
    """


# -------------------------------------------------------------------------------------------------
# callbacks and loggers: discovery (a third kind of plugin, registered in the same group)
# -------------------------------------------------------------------------------------------------


@hookspec
def register_callbacks(register: Callable[..., None]) -> None:
    """Register the callbacks a plugin provides, by name.

    Called once per plugin when the registry is first built; every implementation runs. A registered callback
    is only ever used when a Trainer names it (``Trainer(callbacks=["name"])``): installing a plugin activates
    nothing. Must not import heavy modules: pass a ``"pkg.module:Class"`` string as factory.

    :param register: ``register(name, factory, *, description, requires=(), install=None, **preset_options)``.
    """


@hookspec
def register_loggers(register: Callable[..., None]) -> None:
    """Register the loggers (experiment trackers) a plugin provides, by name.

    Called once per plugin when the registry is first built; every implementation runs. A registered logger is
    used only when a Trainer names it (``Trainer(loggers=["name"])``).

    :param register: ``register(name, factory, *, description, requires=(), install=None, **preset_options)``;
        ``requires`` names the distributions it needs (checked before anything launches), ``install`` what
        to tell the user to ``pip install`` when one is missing.
    """


# -------------------------------------------------------------------------------------------------
# Trainer events: implemented by the callbacks and loggers of one Trainer (every implementation runs)
# -------------------------------------------------------------------------------------------------
# In the order a run meets them; docs/hooks.md gives the exact sequence. Every training event runs on every
# rank (a callback decides what is rank-0 only); the two logging events run on global rank 0 only.


@hookspec
def on_fit_start(trainer: Any) -> None:
    """Training is about to begin: the model is set up and any checkpoint has been loaded.

    Every implementation runs, on every rank.

    :param trainer: the Trainer (``global_step``, ``engine``, ``logged_metrics``, ``should_stop``, ...).
    """


@hookspec
def on_train_epoch_start(trainer: Any, epoch: int) -> None:
    """An epoch of the training data begins (also a resumed epoch that continues from its middle).

    Every implementation runs, on every rank.

    :param trainer: the Trainer.
    :param epoch: the epoch, counted from 0.
    """


@hookspec
def on_train_batch_start(trainer: Any, batch: Any, batch_idx: int) -> None:
    """A batch is about to be trained on (every batch, also those of an accumulation).

    Every implementation runs, on every rank.

    :param trainer: the Trainer.
    :param batch: the batch, on the device.
    :param batch_idx: its index in the epoch.
    """


@hookspec
def on_before_optimizer_step(trainer: Any, optimizer: Any, step: int) -> None:
    """The gradients of an accumulation are complete and about to be applied (before clipping).

    Every implementation runs, on every rank, once per optimizer at each optimizer step.

    :param trainer: the Trainer.
    :param optimizer: the optimizer about to step; its parameters' ``.grad`` hold the gradients.
    :param step: optimizer steps taken so far (this one not counted yet).
    """


@hookspec
def on_train_batch_end(trainer: Any, outputs: Any, batch: Any, batch_idx: int, step: int) -> None:
    """A batch is done: after its backward and, at the end of an accumulation, the optimizer step.

    Every implementation runs, on every rank. Values a callback logs here with ``trainer.log`` join this
    step's metrics when it is a logging step.

    :param trainer: the Trainer.
    :param outputs: what ``training_step`` returned (the loss, or a dict with ``"loss"``); under a strategy
        that runs the step itself (:func:`run_training_batch`), the batch's loss.
    :param batch: the batch.
    :param batch_idx: its index in the epoch.
    :param step: optimizer steps taken, including this batch's if it completed an accumulation.
    """


@hookspec
def on_validation_start(trainer: Any) -> None:
    """Validation is about to run (``val_check_interval``, the end of an epoch, or ``Trainer.validate``).

    Every implementation runs, on every rank.

    :param trainer: the Trainer.
    """


@hookspec
def on_validation_end(trainer: Any, metrics: dict[str, float]) -> None:
    """Validation is done and its metrics are reduced across ranks (the same values on every rank).

    Every implementation runs, on every rank. Early stopping and best-k checkpoints decide here.

    :param trainer: the Trainer.
    :param metrics: the validation metrics, reduced across ranks.
    """


@hookspec
def on_save_checkpoint(trainer: Any, path: str, state: dict[str, Any]) -> None:
    """A checkpoint is being written: put this callback's own state into ``state``.

    Every implementation runs, on every rank, each with a dict of its own (plain tensors, numbers, strings,
    lists and dicts only: checkpoints load with ``weights_only=True``). It comes back in
    :func:`on_load_checkpoint` when training resumes.

    :param trainer: the Trainer.
    :param path: where the checkpoint goes.
    :param state: this callback's entry in the checkpoint, empty; fill it.
    """


@hookspec
def on_load_checkpoint(trainer: Any, path: str, state: dict[str, Any]) -> None:
    """Training resumes from a checkpoint: restore what :func:`on_save_checkpoint` stored.

    Every implementation runs, on every rank, each with its own entry (not called for a callback the
    checkpoint holds nothing for).

    :param trainer: the Trainer.
    :param path: the checkpoint being loaded.
    :param state: what this callback stored.
    """


@hookspec
def on_train_epoch_end(trainer: Any, epoch: int) -> None:
    """An epoch of the training data is done (after the validation that ends it, if any).

    Every implementation runs, on every rank.

    :param trainer: the Trainer.
    :param epoch: the epoch that ended, counted from 0.
    """


@hookspec
def on_fit_end(trainer: Any) -> None:
    """Training is done (the last step, or a stop requested through ``trainer.should_stop``).

    Every implementation runs, on every rank. Loggers close their runs here.

    :param trainer: the Trainer.
    """


@hookspec
def on_exception(trainer: Any, exception: BaseException) -> None:
    """An error escaped the training loop on this rank; it is raised again after the callbacks have run.

    Every implementation runs, on the failing rank only (its peers fail when the launcher stops them), for an
    error between ``on_fit_start`` and ``on_fit_end`` (an error while loading a checkpoint comes before). A
    preemption calls it on every rank with :class:`stratagem.Preempted`, after its checkpoint is written.

    :param trainer: the Trainer.
    :param exception: the error.
    """


@hookspec
def log_hyperparams(trainer: Any, params: dict[str, Any]) -> None:
    """Record the run's hyperparameters, once per ``fit``, before the first step.

    Every implementation runs, on global rank 0 only.

    :param trainer: the Trainer.
    :param params: ``{"trainer/max_steps": 100, "strategy/name": "ddp", "model/lr": 0.1, ...}``; values are
        numbers, booleans, strings or ``None``.
    """


@hookspec
def log_metrics(trainer: Any, metrics: dict[str, float], step: int) -> None:
    """Record metrics reduced across ranks, at the Trainer's logging steps and after each validation.

    Every implementation runs, on global rank 0 only.

    :param trainer: the Trainer.
    :param metrics: metric name to value, reduced across ranks.
    :param step: the optimizer step they belong to.
    """


#: The Trainer's events, in the order docs/hooks.md describes them.
TRAINER_EVENTS = (
    "on_fit_start",
    "on_train_epoch_start",
    "on_train_batch_start",
    "on_before_optimizer_step",
    "on_train_batch_end",
    "on_validation_start",
    "on_validation_end",
    "on_save_checkpoint",
    "on_load_checkpoint",
    "on_train_epoch_end",
    "on_fit_end",
    "on_exception",
    "log_hyperparams",
    "log_metrics",
)
