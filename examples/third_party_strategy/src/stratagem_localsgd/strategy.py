"""Local SGD over ``torch.distributed``, written against stratagem's public API only."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ContextManager

import torch

from stratagem import hookimpl
from stratagem.strategies import TorchDistributedStrategy


class LocalSGDStrategy(TorchDistributedStrategy):
    """Every rank keeps a full replica and steps its own optimizer; replicas are averaged periodically.

    :param sync_every: optimizer steps between averagings. ``1`` (the default, and the registered
        ``local_sgd``) averages the *gradients* before every step: synchronous data parallel, identical to one
        process on the global batch for any optimizer. ``k > 1`` takes ``k`` local steps, then averages the
        *parameters*. Optimizer state (Adam's moments) stays local and drifts apart between ranks, so this
        mode is not equivalent to synchronous training and claims no equivalence tolerance.
    :param kwargs: ``process_group_backend`` and ``timeout`` of :class:`TorchDistributedStrategy`.
    """

    def __init__(self, *, sync_every: int = 1, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not isinstance(sync_every, int) or isinstance(sync_every, bool) or sync_every < 1:
            raise ValueError(
                f"LocalSGDStrategy(sync_every={sync_every!r}): give a whole number of optimizer steps >= 1 "
                "(1 averages gradients every step)."
            )
        self.sync_every = sync_every
        self._steps = 0
        self._synchronising = True

    @property
    def contract_tolerance(self) -> float | None:
        """What the contract suite may expect of training equivalence (``None``: none is claimed)."""
        return 1e-5 if self.sync_every == 1 else None

    # optimization ----------------------------------------------------------------------------------
    @hookimpl
    def backward(self, loss: torch.Tensor, model: torch.nn.Module) -> None:
        TorchDistributedStrategy.backward(self, loss, model)
        if self.sync_every == 1 and self._synchronising:
            self._average([p.grad for p in model.parameters() if p.grad is not None])

    @hookimpl
    def no_sync(self, model: torch.nn.Module) -> ContextManager[None]:
        @contextlib.contextmanager
        def accumulate() -> Iterator[None]:
            self._synchronising = False
            try:
                yield
            finally:
                self._synchronising = True

        return accumulate()

    @hookimpl
    def optimizer_step(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        TorchDistributedStrategy.optimizer_step(self, optimizer, model)
        self._steps += 1
        if self.sync_every > 1 and self._steps % self.sync_every == 0:
            with torch.no_grad():
                self._average([p.data for p in model.parameters()])

    def _average(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by its mean over the ranks, in one collective over a flat buffer."""
        if self.world_size == 1 or not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        mean = self.all_reduce(flat, "mean").to(flat.dtype)
        offset = 0
        for t in tensors:
            t.copy_(mean[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
