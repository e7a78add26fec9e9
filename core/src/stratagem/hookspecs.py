"""Every hook of stratagem, grouped by phase.

Strategy operations are ``firstresult``: the chosen strategy is the only plain implementation of each, and
add-on plugins (compile, profiling, ...) may only wrap them with ``@hookimpl(wrapper=True)``; the plugin
manager refuses anything else, so "the first non-``None`` result" is always the strategy's.

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

    from stratagem.cluster import ClusterEnvironment
    from stratagem.launchers._job import LaunchJob

PROJECT_NAME = "stratagem"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
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
def wrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Wrap the model for this strategy (move, shard, replicate) and return the module to train.

    Stops at the first non-``None`` result.

    :param model: the user's module, possibly built under :func:`model_init_context`.
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
# data
# -------------------------------------------------------------------------------------------------


@hookspec(firstresult=True)
def distributed_sampler_kwargs() -> dict[str, int]:
    """Return ``{"num_replicas": ..., "rank": ...}`` for a ``DistributedSampler``.

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
