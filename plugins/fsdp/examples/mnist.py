"""The PyTorch FSDP tutorial's MNIST ``Net``, trained with stratagem's fsdp on random MNIST-shaped data.

The tutorial downloads MNIST and wraps ``Net`` with FSDP1 and ``size_based_auto_wrap_policy``; here the
same policy selects the units of FSDP2 (``fc1`` becomes its own unit, as the tutorial prints), and the
data are random 1x28x28 images with labels from a fixed random teacher, so that nothing is downloaded::

    python mnist.py --devices 2 --root runs/mnist
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

import stratagem as sg


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = self.conv1(x)
        x = F.relu(x)
        x = self.conv2(x)
        x = F.relu(x)
        x = F.max_pool2d(x, 2)
        x = self.dropout1(x)
        x = torch.flatten(x, 1)
        x = self.fc1(x)
        x = F.relu(x)
        x = self.dropout2(x)
        x = self.fc2(x)
        output = F.log_softmax(x, dim=1)
        return output


class MNISTModule(sg.Module):
    def __init__(self, lr: float = 1.0, gamma: float = 0.7):
        super().__init__()
        self.net = Net()
        self.lr, self.gamma = lr, gamma

    def training_step(self, batch, batch_idx):
        data, target = batch
        loss = F.nll_loss(self.net(data), target)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.Adadelta(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=self.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def random_mnist(n: int = 512) -> torch.utils.data.TensorDataset:
    """Images of MNIST's shape and normalisation, labels from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(0)
    images = (torch.rand(n, 1, 28, 28, generator=g) - 0.1307) / 0.3081
    teacher = torch.randn(28 * 28, 10, generator=g)
    return torch.utils.data.TensorDataset(images, (images.flatten(1) @ teacher).argmax(1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--root", default="runs/mnist")
    args = parser.parse_args()

    from stratagem_fsdp import FSDPStrategy

    my_auto_wrap_policy = functools.partial(size_based_auto_wrap_policy, min_num_params=20000)
    trainer = sg.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=FSDPStrategy(auto_wrap_policy=my_auto_wrap_policy),
        max_epochs=args.max_epochs,
        log_every_n_steps=1,
        enable_progress_bar=False,
        default_root_dir=args.root,
        seed=1,
    )
    trainer.fit(MNISTModule(), torch.utils.data.DataLoader(random_mnist(), batch_size=64))
    if trainer.is_global_zero:
        print(trainer.model)
