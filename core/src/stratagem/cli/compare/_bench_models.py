"""The models ``stratagem compare`` trains when given a size instead of a class: residual MLPs.

A block is LayerNorm, Linear(width -> hidden), GELU, Linear(hidden -> width) with a residual connection, the
shape of a transformer's feed-forward half. Nearly all parameters sit in the blocks, so the per-rank state of a
sharding strategy is close to ``1 / world_size`` of a replica's, and each block is its own shard unit
(``stratagem.wrap``) when the model is built under the strategy's sharded context. The models carry a
``tp_plan`` (each block's pair of linear layers split by columns then by rows), so that strategies which split
layers split them; the others ignore it.

A model for ``stratagem compare`` (these, or a class of your own given as ``PATH:Class``) provides:

- ``example_batch(batch_size, generator)``: one batch, drawn from ``generator`` only (same data for every
  strategy);
- ``training_step(batch, batch_idx)`` returning the loss (a :class:`stratagem.Module`), or else a ``forward``
  that takes the batch's items and returns the loss;
- optionally ``configure_model()`` to build its layers under the strategy's init and sharded contexts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import stratagem as sg


class ResidualBlock(torch.nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, hidden)
        self.down = torch.nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class ResidualMLP(sg.Module):
    """``depth`` residual blocks, a final norm and a classifier head."""

    #: Module-name globs to tensor-parallel styles (plain data): ``up`` split on its outputs, ``down`` on its
    #: inputs, one all-reduce per block. The norms, ``down``'s bias and the small head stay whole.
    tp_plan = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self, width: int, hidden: int, depth: int, classes: int = 16) -> None:
        super().__init__()
        self.width, self.hidden, self.depth, self.classes = width, hidden, depth, classes

    def configure_model(self) -> None:
        if hasattr(self, "blocks"):
            return
        self.blocks = torch.nn.ModuleList(
            sg.wrap(ResidualBlock(self.width, self.hidden)) for _ in range(self.depth)
        )
        self.norm = torch.nn.LayerNorm(self.width)
        self.head = torch.nn.Linear(self.width, self.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)

    def example_batch(self, batch_size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(batch_size, self.width, generator=generator)
        y = torch.randint(0, self.classes, (batch_size,), generator=generator)
        return x, y


def small() -> ResidualMLP:
    """About 0.07 M parameters: for tests and a quick look (seconds)."""
    return ResidualMLP(width=64, hidden=256, depth=2)


def medium() -> ResidualMLP:
    """About 50 M parameters (200 MB in fp32; with gradients and AdamW state 800 MB per replica)."""
    return ResidualMLP(width=1024, hidden=4096, depth=6)


MODELS = {"small": small, "medium": medium}
