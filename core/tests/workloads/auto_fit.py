"""``strategy="auto"`` at 2 processes, fitting a small model: ``python auto_fit.py OUT.json`` with
``STRATAGEM_DEVICE_MEMORY`` set by the caller. Rank 0 writes which strategy the workers trained under and the
loss of each step to OUT.json; the launching process prints the choice (or fails when nothing fits)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg

WIDTH, DEPTH, STEPS = 64, 4, 12


class Stack(sg.Module):
    """Four square layers: ddp holds all of them per process, fsdp half."""

    def __init__(self) -> None:
        super().__init__()
        self.losses: list[torch.Tensor] = []  # read after fit: a step that reads a value cannot be planned

    def configure_model(self) -> None:
        self.layers = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(DEPTH)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.detach())
        self.log("loss", loss)  # nothing without a Trainer: the plan steps a copy of the module
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def loader() -> DataLoader:
    # The same 8 samples in every step of the 2 ranks (4 each): a dozen steps learn them.
    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0)).repeat(STEPS, 1)
    return DataLoader(TensorDataset(x, 0.5 * x), batch_size=4)


def main(out: str) -> None:
    trainer = sg.Trainer(
        strategy="auto",
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        seed=3,
        enable_progress_bar=False,
        loggers=[],
        default_root_dir=str(Path(out).parent / "runs"),
    )
    model = Stack()
    trainer.fit(model, loader())
    if trainer.is_global_zero:
        with open(out, "w") as f:
            json.dump(
                {"strategy": trainer.strategy.registered_name, "losses": [float(x) for x in model.losses]}, f
            )


if __name__ == "__main__":
    main(sys.argv[1])
