"""One strategy as one simulated rank: its own hooks, in the order a run calls them, on fake tensors.

``setup_environment`` (finding the simulated process group already formed, as under torchrun, it joins it),
the model built inside ``model_init_context`` and ``model_sharded_context`` on the meta device (so that a
strategy sharding submodules as they are built does it at no cost), its tensors then made fake ones on the
strategy's device, ``wrap_model``, ``setup_optimizers``; then one micro-batch through the loop's ordinary path
(``forward_context``, the model, the loss, ``backward``) under torch's memory tracker, and ``optimizer_step``,
which creates the optimizer's state by its own rules. The collectives of the step are traced.

A strategy that runs the step itself (``owns_step``: a pipeline schedule) cannot be stepped by one simulated
rank: its schedule agrees on tensor shapes with the neighbouring stages over point-to-point messages, and they
are not there. Its set-up runs all the same; its gradients are made as autograd makes them (one tensor like
each trainable parameter) and its optimizer state by ``optimizer_step``; activations and communication are
left unestimated.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

from stratagem.planning import _count
from stratagem.planning._workload import Workload, World
from stratagem.planning._world import BACKEND, fake_tensors, simulated_world

VALUE_NOTE = (
    "its step reads the value of a tensor, and the simulated world's tensors have shapes but no values: "
    "gradients as autograd makes them, activations and communication not estimated"
)
OWNS_STEP_NOTE = (
    "the strategy runs its own step (a pipeline schedule), which one simulated rank cannot run: gradients as "
    "autograd makes them, activations and communication not estimated"
)


@attrs.frozen(kw_only=True)
class RankMemory:
    """What one rank holds, in bytes, and what it sends per step.

    ``activations`` and ``communication`` are ``None`` when not estimated (``note`` says why).
    """

    rank: int
    parameters: int
    buffers: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int | None = None
    communication: int | None = None
    collectives: dict[str, dict[str, int]] = attrs.field(factory=dict)
    stepped: bool = False
    note: str = ""
    seconds: float = 0.0

    @property
    def total(self) -> int:
        """Everything counted: parameters, buffers, gradients, optimizer state and activations (an upper bound of
        the step's peak: gradients are whole here, while at the peak some are still to come)."""
        return self.parameters + self.buffers + self.gradients + self.optimizer + (self.activations or 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "parameters": self.parameters,
            "buffers": self.buffers,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "activations": self.activations,
            "total": self.total,
            "communication": self.communication,
            "collectives": self.collectives,
            "note": self.note,
        }


@attrs.frozen
class Facts:
    """What the set-up showed of the strategy: its device mesh's shape (``None`` without one) and how many
    process groups it formed beyond the world's."""

    mesh: tuple[int, ...] | None
    groups: int


def _build(hooks: Any, workload: Workload) -> torch.nn.Module:
    # The strategy's contexts (its dtype, its stratagem.wrap), on the meta device whatever device they name.
    with hooks.model_init_context(True), torch.device("meta"), hooks.model_sharded_context():
        return workload.build()


def simulate_rank(
    info: Any, options: dict[str, Any], workload: Workload, world: World, rank: int, step: bool = True
) -> tuple[RankMemory, Facts]:
    """Set ``info``'s strategy up as rank ``rank`` of ``world`` (and step it, when ``step``); return what the
    rank holds and what the set-up showed."""
    import torch.distributed as dist

    from stratagem.registry._manager import StrategyHooks
    from stratagem.strategies.compiling import Compiler

    start = time.perf_counter()
    with simulated_world(rank, world.size) as trace:
        strategy = info.create(**options)
        hooks = StrategyHooks(strategy, addons=[])
        hooks.setup_environment(world.cluster(rank, BACKEND), world.precision)
        # A mesh numbers its ranks with index tensors that must hold values: built before the fake tensors.
        mesh = getattr(strategy, "device_mesh", None)
        model = _build(hooks, workload)
        with fake_tensors():
            model.to_empty(device=strategy.device)
            wrapped = hooks.wrap_model(model, Compiler(None))
            optimizer = hooks.setup_optimizers(wrapped, [world.make_optimizer(wrapped.parameters())])[0]
            held = strategy.memory_held(wrapped, optimizer)
            groups = len(dist.distributed_c10d._world.pg_map) - 1
            result: dict[str, Any] = {}
            if step:
                with trace.in_phase("step"):
                    result = _step(hooks, strategy, wrapped, model, optimizer, workload, world, trace)
                result["communication"] = trace.sent("step") if result.get("stepped") else None
                result["collectives"] = trace.summary("step") if result.get("stepped") else {}
                held = strategy.memory_held(wrapped, optimizer)
        hooks.teardown()
    shape = tuple(mesh.mesh.shape) if mesh is not None and hasattr(mesh, "mesh") else None
    memory = RankMemory(rank=rank, seconds=time.perf_counter() - start, **held, **result)
    return memory, Facts(mesh=shape, groups=groups)


def mesh_of(info: Any, options: dict[str, Any], world: World) -> tuple[int, ...] | None:
    """The shape of the device mesh ``info``'s strategy forms as rank 0 of ``world`` (``None`` without one): its
    ``setup_environment`` alone, which is where a strategy forms its mesh, before it sees the model."""
    from stratagem.registry._manager import StrategyHooks

    with simulated_world(0, world.size):
        strategy = info.create(**options)
        hooks = StrategyHooks(strategy, addons=[])
        hooks.setup_environment(world.cluster(0, BACKEND), world.precision)
        mesh = getattr(strategy, "device_mesh", None)
        hooks.teardown()
    return tuple(mesh.mesh.shape) if mesh is not None and hasattr(mesh, "mesh") else None


def _step(
    hooks: Any,
    strategy: Any,
    wrapped: torch.nn.Module,
    model: torch.nn.Module,
    optimizer: Any,
    workload: Workload,
    world: World,
    trace: Any,
) -> dict[str, Any]:
    if getattr(strategy, "owns_step", False) or not workload.steps:
        why = OWNS_STEP_NOTE if getattr(strategy, "owns_step", False) else _no_batch_note(workload)
        return _step_by_rule(hooks, wrapped, optimizer, why)
    assert workload.batch is not None and workload.step is not None
    batch = workload.batch(model, world.batch_size, world.sequence_length)
    meter = _count.ActivationMeter(wrapped, optimizer, trace=trace)
    try:
        _count.one_step(
            lambda: workload.step(model, wrapped, batch),  # type: ignore[misc]
            hooks.forward_context,
            lambda loss: hooks.backward(loss, wrapped),
            meter,
        )
    except DataDependentOutputException:
        # Something in the step reads a tensor's value (DDP's find_unused_parameters reads which parameters
        # took part, in C++): fake tensors have none. What the set-up made is counted all the same.
        for param in wrapped.parameters():
            param.grad = None
        return _step_by_rule(hooks, wrapped, optimizer, VALUE_NOTE)
    hooks.optimizer_step(optimizer, wrapped)
    return {"stepped": True, "activations": meter.peak}


def _step_by_rule(hooks: Any, wrapped: torch.nn.Module, optimizer: Any, why: str) -> dict[str, Any]:
    """Gradients as autograd makes them (one like each trainable parameter), then the strategy's optimizer
    step, which makes the optimizer's state by its own rules."""
    for param in wrapped.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    hooks.optimizer_step(optimizer, wrapped)
    return {"stepped": False, "note": why}


def _no_batch_note(workload: Workload) -> str:
    return (
        f"{workload.name}: the plan has no batch to step it with (a model class gives one with "
        "example_batch(batch_size, generator)): gradients as autograd makes them, activations and "
        "communication not estimated"
    )
