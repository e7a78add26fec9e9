"""The models of the seed examples (shared/seeds/ 000, 001 and 004) as stratagem Modules, their data, and the
one-process references the tests compare with.

Where a seed writes ``...`` (the training step, the data) the adaptation is the smallest that trains: an MSE
regression on random data with a fixed teacher.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
from torch.distributed.fsdp.wrap import wrap
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import stratagem as sg

WORLD = 2
FEATURES = 32
#: The test/predict dataset: 37 samples, so that a 2-process DistributedSampler repeats one to even the shares.
EVAL_SAMPLES = 37
MICRO = 4
#: Training data for the examples compared with one process: 8 samples per optimizer step, 2 x 4.
TRAIN_SAMPLES = 64


def dataset(samples: int, features: int = FEATURES, outputs: int = FEATURES, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=g)
    teacher = torch.randn(features, outputs, generator=g) / features**0.5
    return TensorDataset(x, torch.tanh(x @ teacher))


class Regression(sg.Module):
    """The model every strategy fits, tests and predicts with (seed 004's "trainer.fit(model); trainer.test();
    trainer.predict()"), built in ``configure_model`` as seed 004's stage-3 example builds its layers."""

    #: For tp: the first layer split by columns, the second by rows.
    tp_plan = {"net.0": "colwise", "net.2": "rowwise"}

    def __init__(self, width: int = 64, lr: float = 1e-2, optimizer: str = "adamw") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.seen_dtypes: set[str] = set()

    def configure_model(self) -> None:
        width = self.hparams.width
        self.net = nn.Sequential(nn.Linear(FEATURES, width), nn.Tanh(), nn.Linear(width, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        out = self(x)
        self.seen_dtypes.add(str(out.dtype))
        return F.mse_loss(out, y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        if self.hparams.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def eval_dataset() -> TensorDataset:
    return dataset(EVAL_SAMPLES, outputs=2, seed=1)


# -------------------------------------------------------------------------------------------------
# seeds 000 / 001: FSDP auto-wrap, activation checkpointing, manual wrap
# -------------------------------------------------------------------------------------------------


class MyTransformerBlock(nn.Module):
    """Seed 000's ``MyTransformerBlock`` (it names the class only): a residual MLP block."""

    def __init__(self, width: int = FEATURES) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1  # twice per step when checkpointed: forward, then the recomputation in backward
        return x + self.fc2(F.gelu(self.fc1(x)))


class _Regression(sg.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.model.parameters(), lr=1e-2)


class BlockModel(_Regression):
    """Seed 000's auto-wrap and activation-checkpointing examples: a model of ``MyTransformerBlock``s."""

    def configure_model(self) -> None:
        self.model = nn.Sequential(
            nn.Linear(FEATURES, FEATURES),
            MyTransformerBlock(),
            MyTransformerBlock(),
            nn.Linear(FEATURES, FEATURES),
        )


class EncoderDecoder(_Regression):
    """Seed 001's policy ``{nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}``, on a model made of them
    (a sequence of 4 tokens of 8 features per sample; no dropout, so that the run can match one process)."""

    def configure_model(self) -> None:
        d = FEATURES // 4
        self.encoder = nn.TransformerEncoderLayer(d, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.decoder = nn.TransformerDecoderLayer(d, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.view(x.shape[0], 4, FEATURES // 4)
        return self.head(self.decoder(tokens, self.encoder(tokens))).reshape(x.shape[0], FEATURES)

    def configure_optimizers(self) -> Any:
        # SGD: the attention's key bias has no true gradient (softmax ignores it), and AdamW would turn the
        # rounding noise in its place into lr-sized steps that no two summation orders agree on.
        return torch.optim.SGD(self.parameters(), lr=0.1)


class MyModel(_Regression):
    """Seed 000's manual-wrapping example as written there (``from torch.distributed.fsdp.wrap import wrap``),
    with ``apply_activation_checkpointing`` of its "Activation Checkpointing" section when ``checkpointing``."""

    def __init__(self, checkpointing: bool = False) -> None:
        super().__init__()
        self.checkpointing = checkpointing

    def configure_model(self):
        self.linear_layer = nn.Linear(32, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))

        # modules are sharded across processes
        # as soon as they are wrapped with `wrap`.
        # During the forward/backward passes, weights get synced across processes
        # and de-allocated once computation is complete, saving memory.

        # Wraps the layer in a Fully Sharded Wrapper automatically
        linear_layer = wrap(self.linear_layer)

        for i, layer in enumerate(self.block):
            self.block[i] = wrap(layer)

        self.model = nn.Sequential(linear_layer, nn.ReLU(), self.block)
        if self.checkpointing:
            apply_activation_checkpointing(self.model)


# -------------------------------------------------------------------------------------------------
# references
# -------------------------------------------------------------------------------------------------


def initial(factory: Any, dtype: torch.dtype | None = None) -> sg.Module:
    """The model as the Trainer's ``seed=0`` builds it on every rank (``dtype``: under a ``*-true``
    precision, whose layers are created in that dtype: float16 initialisation draws other values than a
    float32 one cast)."""
    from stratagem.strategies.precision import default_dtype

    torch.manual_seed(0)
    model = factory()
    with default_dtype(dtype):
        model.configure_model()
    return model


def reference(factory: Any, steps: int) -> dict[str, torch.Tensor]:
    """One process on the global batch (2 x ``MICRO`` samples, in order, epoch after epoch), the same
    optimizer: the parameters after ``steps`` steps."""
    model = initial(factory)
    optimizer = model.configure_optimizers()
    loader = DataLoader(dataset(TRAIN_SAMPLES), batch_size=WORLD * MICRO)
    batches = [batch for _ in range(-(-steps // len(loader))) for batch in loader][:steps]
    for x, y in batches:
        model.training_step((x, y), 0).backward()
        optimizer.step()
        optimizer.zero_grad()
    return {plain_name(name): p.detach().clone() for name, p in model.named_parameters()}


def plain_name(name: str) -> str:
    """A parameter's name without the checkpoint wrappers' prefix (as state dicts name it)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def train_loader() -> DataLoader:
    return DataLoader(dataset(TRAIN_SAMPLES), batch_size=MICRO)


def expected_test_loss(model: nn.Module, replicas: int) -> float:
    """``test_loss`` as the Trainer reduces it: each data-parallel rank's mean over its batches of the
    ``DistributedSampler`` split (padding included), then the mean over ranks."""
    data = eval_dataset()
    means = []
    with torch.no_grad():
        for rank in range(replicas):
            sampler = DistributedSampler(data, num_replicas=replicas, rank=rank, shuffle=False)
            losses = [
                F.mse_loss(model(x), y).item() for x, y in DataLoader(data, batch_size=MICRO, sampler=sampler)
            ]
            means.append(sum(losses) / len(losses))
    return sum(means) / len(means)
