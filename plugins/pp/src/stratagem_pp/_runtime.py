"""One rank's running pipeline: its ``PipelineStage`` objects, the schedule over them, and the two ways a
batch goes through it (forward and backward of every micro-batch, or forward only).

The schedule is built once with a loss function that reads the current step's (``loss_fn`` and scale), so
that training and evaluation share one schedule and its communication set-up. Losses exist on the rank of the
last stage only; both steps broadcast their mean over the micro-batches to every rank of the pipeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, ContextManager

import attrs
import torch
import torch.distributed as dist

from stratagem.errors import ConfigurationError
from stratagem.strategies.step import as_inputs
from stratagem_pp import _config, _schedules
from stratagem_pp._split import Split


@attrs.define
class StepResult:
    """What one batch gave: the mean loss over its micro-batches (on every rank of the pipeline; ``None``
    without a loss function) and the last stage's outputs (on its rank only, else ``None``)."""

    loss: torch.Tensor | None
    outputs: Any = None


class Pipeline:
    def __init__(
        self,
        *,
        split: Split,
        schedule: str,
        local: list[int],
        views: list[torch.nn.Module],
        microbatches: int,
        group: Any,
        device: torch.device,
        stage_ranks: dict[int, int],
        replica_group: Any = None,
    ) -> None:
        self.split, self.schedule_name, self.local, self.views = split, schedule, local, views
        self.replica_group = replica_group
        self.microbatches, self.group, self.device = microbatches, group, device
        num_stages = split.num_stages
        self.has_first = 0 in local
        self.has_last = num_stages - 1 in local
        # The global rank holding the last stage, in this rank's pipeline group.
        self.last_rank = dist.get_global_rank(group, stage_ranks[num_stages - 1])
        self._loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
        self._scale = 1.0
        self._shapes: tuple[Any, ...] | None = None
        self._build()

    def _build(self) -> None:
        stage_class = _stage_class()
        num_stages = self.split.num_stages
        self.stages = [
            stage_class(view, index, num_stages, self.device, group=self.group)
            for index, view in zip(self.local, self.views)
        ]
        self.schedule = _schedules.build(
            self.schedule_name, self.stages, self.microbatches, self._schedule_loss
        )

    def _schedule_loss(self, output: Any, target: Any) -> torch.Tensor:
        if self._loss_fn is None:
            # Forward only without a loss: the schedule still asks for one on the last stage.
            return torch.zeros((), device=self.device)
        loss = self._loss_fn(output, target)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise ConfigurationError(
                f"the loss function returned {type(loss).__name__}"
                + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                + "; return the mean loss of the micro-batch as a scalar tensor."
            )
        return loss * (self._scale / self.microbatches)

    def _begin(self, inputs: tuple[Any, ...], loss_fn: Any, scale: float, training: bool = False) -> int:
        if not isinstance(inputs, tuple):
            raise ConfigurationError(
                f"inputs must be a tuple of the model's positional arguments; got {type(inputs)}"
            )
        first = inputs[0] if inputs else None
        if not isinstance(first, torch.Tensor):
            raise ConfigurationError("the first input must be a tensor whose first dimension is the batch.")
        _config.check_batch(self.microbatches, first.shape[0])
        self._follow_shapes(inputs, training)
        self._loss_fn, self._scale = loss_fn, scale
        return first.shape[0]

    def _follow_shapes(self, inputs: tuple[Any, ...], training: bool) -> None:
        """torch's stages learn the micro-batches' shapes on their first step and keep receive buffers of those
        shapes: a batch of other shapes (a dataset's shorter last batch, another sequence length) would be
        received into them, its outputs cut or padded with stale values. On new shapes the stages and the
        schedule are made again, and learn them on their next step (one micro-batch's forward, and backward in
        training, run ahead)."""
        shapes = tuple((tuple(t.shape), t.dtype) for t in inputs if isinstance(t, torch.Tensor))
        changed = self._shapes is not None and shapes != self._shapes
        if self.replica_group is not None:
            # The stages of one pipeline see the same inputs, other replicas other ones; every replica learns
            # again or none does, since learning runs a forward that gathers FSDP's shards over the replicas.
            flag = torch.tensor([int(changed)], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.replica_group)
            changed = bool(flag.item())
        if changed and training and self._sharded_gradients_held():
            raise ConfigurationError(
                f"a training batch of shapes {[s for s, _ in shapes]} came after batches of shapes "
                f"{[s for s, _ in self._shapes or ()]} while gradients were being accumulated: the pipeline "
                "learns new shapes by running one micro-batch ahead, which under FSDP drops the gradients "
                "accumulated so far. Give every batch of an accumulation window the same shapes (a DataLoader "
                "with drop_last=True leaves out a shorter last batch)."
            )
        self._shapes = shapes
        if changed:
            self._build()

    def _sharded_gradients_held(self) -> bool:
        from torch.distributed.fsdp import FSDPModule

        return any(
            p.grad is not None
            for stage in self.stages
            for module in stage.submod.modules()
            if isinstance(module, FSDPModule)
            for p in module.parameters()
        )

    def train_step(
        self,
        inputs: tuple[Any, ...],
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        scale: float = 1.0,
    ) -> StepResult:
        """Forward and backward of every micro-batch; gradients accumulate in the stages' parameters (those
        of ``scale`` times the batch's mean loss)."""
        self._begin(inputs, loss_fn, scale, training=True)
        losses: list[torch.Tensor] = []
        try:
            with self._split_backward_config():
                outputs = self.schedule.step(*inputs, target=targets, losses=losses)
        finally:
            self._loss_fn = None
        return StepResult(loss=self._mean_loss(losses, scale), outputs=outputs)

    def eval_step(
        self,
        inputs: tuple[Any, ...],
        targets: Any = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    ) -> StepResult:
        """Forward only; the loss when ``loss_fn`` and ``targets`` are given."""
        wanted = loss_fn is not None and targets is not None
        batch = self._begin(inputs, loss_fn if wanted else None, 1.0)
        losses: list[torch.Tensor] = []
        if targets is None:
            # The schedule cuts a target for the last stage whatever happens; give it one to cut.
            targets = torch.zeros(batch, device=self.device)
        try:
            with torch.no_grad():
                outputs = self.schedule.eval(*inputs, target=targets, losses=losses)
        finally:
            self._loss_fn = None
        return StepResult(loss=self._mean_loss(losses, 1.0) if wanted else None, outputs=outputs)

    def _split_backward_config(self) -> ContextManager[Any]:
        """Zero-bubble schedules run backward twice over a stage's graph (input gradients keeping the graph,
        weight gradients later): AOTAutograd's donated buffers (``compile=``) refuse a backward that keeps the
        graph, so code compiled inside their step is compiled without them."""
        if not _schedules.SCHEDULES[self.schedule_name].splits_backward:
            return contextlib.nullcontext()
        import torch._functorch.config

        return torch._functorch.config.patch(donated_buffer=False)

    def _mean_loss(self, losses: list[torch.Tensor], scale: float) -> torch.Tensor:
        # The schedule records what the loss function returned, the scaled loss (and, on the first step, not
        # the values met while it inferred the stages' shapes).
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.has_last:
            value = torch.stack([loss.detach() for loss in losses]).double().mean() / (
                scale / self.microbatches
            )
        dist.broadcast(value, src=self.last_rank, group=self.group)
        if self.replica_group is not None:
            # Each data-parallel replica ran its share of the batch: the batch's loss is their mean, the same on
            # every rank.
            dist.all_reduce(value, group=self.replica_group)
            value /= dist.get_world_size(self.replica_group)
        return value

    def predict(self, batch: Any, split_batch: Callable[[Any], tuple[Any, Any]]) -> Any:
        """Forward only, for ``Trainer.predict``: the last stage's outputs on every rank of the pipeline (on
        CPU), so that the first rank of each data-parallel replica, a first stage, returns them as other
        strategies do. A batch of inputs alone (a tensor, or a one-item list from a ``TensorDataset``) needs no
        split. A batch that the micro-batches do not divide (a dataset's last) is predicted with its last sample
        repeated up to a multiple of them, the copies' outputs left out."""
        if isinstance(batch, torch.Tensor) or (isinstance(batch, (tuple, list)) and len(batch) == 1):
            inputs = (batch,) if isinstance(batch, torch.Tensor) else tuple(batch)
        else:
            inputs = as_inputs(split_batch(batch)[0])
        rows = inputs[0].shape[0] if inputs and isinstance(inputs[0], torch.Tensor) else 0
        short = -rows % self.microbatches
        if short:
            inputs = tuple(_map(x, lambda t: _repeat_last(t, rows, short)) for x in inputs)
        outputs = self.eval_step(inputs).outputs
        box = [_map(outputs, lambda t: _first_rows(t.detach().cpu(), rows, short)) if self.has_last else None]
        dist.broadcast_object_list(box, src=self.last_rank, group=self.group)
        return box[0]

    def clear(self) -> None:
        self.stages, self.schedule = [], None


def _map(value: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``function`` applied to each tensor of ``value`` (tuples, lists and dicts of them)."""
    if isinstance(value, torch.Tensor):
        return function(value)
    if isinstance(value, (tuple, list)):
        items = [_map(v, function) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _map(v, function) for key, v in value.items()}
    return value


def _repeat_last(tensor: torch.Tensor, rows: int, extra: int) -> torch.Tensor:
    if tensor.dim() == 0 or tensor.shape[0] != rows:
        return tensor
    return torch.cat([tensor, tensor[-1:].expand(extra, *tensor.shape[1:])])


def _first_rows(tensor: torch.Tensor, rows: int, extra: int) -> torch.Tensor:
    if not extra or tensor.dim() == 0 or tensor.shape[0] != rows + extra:
        return tensor
    return tensor[:rows]


def _stage_class() -> type:
    """torch's ``PipelineStage``, with the forward-only run of the V schedules (``zbv_zero_bubble``,
    ``dual_pipe_v``) fixed: their action lists keep the backward actions in ``eval``, and the hand-over of input
    gradients between the two stages a rank holds asserts that there is a backward (torch 2.13). Without a
    backward there is nothing to hand over."""
    from torch.distributed.pipelining import PipelineStage

    class Stage(PipelineStage):
        def get_local_bwd_output(self, mb_index: int) -> Any:
            if not self.has_backward:
                return ()
            return super().get_local_bwd_output(mb_index)

        def set_local_bwd_input(self, next_stage_bwd_outputs: Any, mb_index: int) -> None:
            if not self.has_backward:
                return
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    return Stage
