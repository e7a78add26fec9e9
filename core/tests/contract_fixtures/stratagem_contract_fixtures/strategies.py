"""The test-only strategies (imported only when one is chosen: they import torch)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from stratagem import hookimpl
from stratagem.strategies import TorchDistributedStrategy


class GradientAveraging(TorchDistributedStrategy):
    """Averages gradients over the ranks after each backward outside ``no_sync``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._sync = True

    def average(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.flatten() for g in grads])
        dist.all_reduce(flat)
        flat /= self.world_size
        self.scatter(flat, grads)

    @staticmethod
    def scatter(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    @hookimpl
    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        loss.backward()
        if self._sync:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            if grads:
                self.average(grads)

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> Any:
        @contextlib.contextmanager
        def skipping() -> Iterator[None]:
            self._sync = False
            try:
                yield
            finally:
                self._sync = True

        return skipping()


class BrokenAllReduce(GradientAveraging):
    @hookimpl
    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        ops = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        result = tensor.detach().clone().float()
        dist.all_reduce(result, op=ops.get(op, dist.ReduceOp.SUM))
        return result  # the bug: "mean" returns the sum


class DropsOptimizerState(GradientAveraging):
    def optimizer_state_dict(self, module: Any, optimizer: Any, *, full: bool) -> dict[str, Any]:
        state = super().optimizer_state_dict(module, optimizer, full=full)
        return {**state, "state": {}}  # the bug: moments and step counts are lost


class LossyResume(GradientAveraging):
    """All-reduces gradients in fixed point and feeds the rounding error into the next step (error feedback).

    Training stays within its declared tolerance of the reference, and checkpoints restore model and
    optimizer exactly; but the residual lives only in this object, so a resumed run differs.
    """

    contract_tolerance = 1e-4
    scale = 2.0**22

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.residual: torch.Tensor | None = None

    def average(self, grads: list[torch.Tensor]) -> None:
        flat = torch.cat([g.flatten() for g in grads]).double()
        if self.residual is not None:
            flat += self.residual
        sent = torch.round(flat * self.scale).to(torch.int64)
        self.residual = flat - sent.double() / self.scale  # the bug: never saved in a checkpoint
        dist.all_reduce(sent)
        self.scatter((sent.double() / self.scale / self.world_size).float(), grads)
