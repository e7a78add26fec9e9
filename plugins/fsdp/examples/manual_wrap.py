"""The Lightning docs' manual-wrapping example (Fully Sharded Training, "Manual Wrapping"), in stratagem.

``stratagem.wrap`` in ``configure_model`` shards each wrapped layer as it is built; under any other strategy
it returns the layer unchanged. The docs train on 4 GPUs at precision 16; this runs on CPU processes in
float32 (16-mixed is CUDA-only) on random regression data::

    python manual_wrap.py --devices 2 --root runs/manual_wrap
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import stratagem as sg


class MyModel(sg.Module):
    def configure_model(self):
        self.linear_layer = nn.Linear(32, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))

        # Modules get sharded across processes as soon as they are wrapped with `wrap`.
        linear_layer = sg.wrap(self.linear_layer)
        for i, layer in enumerate(self.block):
            self.block[i] = sg.wrap(layer)

        self.model = nn.Sequential(linear_layer, nn.ReLU(), self.block)

    def forward(self, x):
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)


def dataset(n: int = 512) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    teacher = torch.randn(32, 32, generator=g) / 32**0.5
    return torch.utils.data.TensorDataset(x, torch.tanh(x @ teacher))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--max-steps", type=int, default=30)
    parser.add_argument("--root", default="runs/manual_wrap")
    args = parser.parse_args()

    model = MyModel()
    trainer = sg.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=args.strategy,
        max_steps=args.max_steps,
        log_every_n_steps=1,
        enable_progress_bar=False,
        default_root_dir=args.root,
        seed=0,
    )
    trainer.fit(model, torch.utils.data.DataLoader(dataset(), batch_size=16, shuffle=True))
