"""``Trainer.test``, ``predict`` and ``validate(ckpt_path=...)`` in one process, their errors, the putting back
in order of predictions from several data-parallel ranks (``_predictions``), and ``precision="16-true"``.
The same under ddp, fsdp, tp and deepspeed_stage_3 on 2 processes is tests/seed_examples'."""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import stratagem as sg
from stratagem.callbacks import ModelCheckpoint
from stratagem.errors import CapabilityError, CheckpointError, ConfigurationError, PrecisionKernelError
from stratagem.trainer import _predictions

Pair = collections.namedtuple("Pair", ["mean", "scale"])


class Model(sg.Module):
    def configure_model(self) -> None:
        self.net = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", torch.nn.functional.mse_loss(self(x), y))
        self.log("test_max", (self(x) - y).abs().max(), reduce="max")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2)


def _data(n: int = 22) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, x[:, :2] * 2 + 1)


def _trainer(tmp_path: Path, **options: Any) -> sg.Trainer:
    options.setdefault("default_root_dir", tmp_path)
    return sg.Trainer(enable_progress_bar=False, loggers=[], **options)


def test_test_and_predict_after_fit_from_best_and_last(tmp_path: Path) -> None:
    checkpoint = ModelCheckpoint(
        monitor="val_loss", mode="max"
    )  # "best" = the worst weights, distinct from last
    trainer = _trainer(
        tmp_path, max_steps=6, val_check_interval=2, checkpoint_every_n_steps=6, callbacks=[checkpoint]
    )
    model = Model()
    data = _data()
    trainer.fit(model, DataLoader(data, batch_size=4, shuffle=True), DataLoader(data, batch_size=4))

    def loss_of(weights: dict[str, torch.Tensor]) -> tuple[float, float]:
        net = torch.nn.Linear(4, 2)
        net.load_state_dict({k.removeprefix("net."): v for k, v in weights.items()})
        with torch.no_grad():
            losses = [
                torch.nn.functional.mse_loss(net(x), y).item() for x, y in DataLoader(data, batch_size=4)
            ]
            return sum(losses) / len(losses), float((net(data.tensors[0]) - data.tensors[1]).abs().max())

    last = {k: v.clone() for k, v in model.state_dict().items()}
    got = trainer.test(dataloaders=DataLoader(data, batch_size=4))
    assert (got["test_loss"], got["test_max"]) == pytest.approx(loss_of(last), rel=1e-6)
    # The default predict_step: the module called on the batch (here the inputs alone).
    predictions = trainer.predict(model, DataLoader(data.tensors[0], batch_size=4, shuffle=True))
    assert [p.shape for p in predictions] == [(4, 2)] * 5 + [(2, 2)]  # dataset order, as the loader batches
    torch.testing.assert_close(torch.cat(predictions), model(data.tensors[0]).detach())

    best = torch.load(checkpoint.best_checkpoint(trainer), weights_only=True)["model"]["model"]
    assert trainer.test(dataloaders=DataLoader(data, batch_size=4), ckpt_path="best")[
        "test_loss"
    ] == pytest.approx(loss_of(best)[0], rel=1e-6)
    assert loss_of(best)[0] > loss_of(last)[0] * 1.05  # so the load above mattered
    assert trainer.validate(dataloaders=DataLoader(data, batch_size=4), ckpt_path="last")[
        "val_loss"
    ] == pytest.approx(loss_of(last)[0], rel=1e-6)
    # A path, in a Trainer that never trained.
    fresh = _trainer(tmp_path / "fresh")
    path = checkpoint.best_checkpoint(trainer)
    assert fresh.test(Model(), DataLoader(data, batch_size=4), ckpt_path=path)["test_loss"] == pytest.approx(
        loss_of(best)[0], rel=1e-6
    )


def test_evaluation_errors_say_what_to_do(tmp_path: Path) -> None:
    loader = DataLoader(_data(), batch_size=4)
    trainer = _trainer(tmp_path)
    with pytest.raises(
        ConfigurationError, match=r"test\(\) needs a model: trainer.test\(model, dataloaders\)"
    ):
        trainer.test(dataloaders=loader)
    with pytest.raises(ConfigurationError, match=r"predict\(\) needs dataloaders"):
        trainer.predict(Model())

    class NoTestStep(sg.Module):
        pass

    with pytest.raises(ConfigurationError, match=r"NoTestStep has no test_step\(batch, batch_idx\)"):
        trainer.test(NoTestStep(), loader)
    with pytest.raises(
        ConfigurationError, match=r'test\(ckpt_path="best"\) needs a ModelCheckpoint callback'
    ):
        trainer.test(Model(), loader, ckpt_path="best")
    with pytest.raises(ConfigurationError, match=r"predict\(ckpt_path=3\): give None, 'last', 'best', or a"):
        trainer.predict(Model(), loader, ckpt_path=3)
    with pytest.raises(CheckpointError, match="does not exist"):
        trainer.validate(Model(), loader, ckpt_path=tmp_path / "missing.ckpt")
    with pytest.raises(CheckpointError, match=r'holds no complete checkpoint for test\(ckpt_path="last"\)'):
        trainer.test(Model(), loader, ckpt_path="last")
    with_callback = _trainer(tmp_path / "cb", callbacks=[ModelCheckpoint(monitor="val_loss")])
    with pytest.raises(CheckpointError, match="has kept no checkpoint yet"):
        with_callback.test(Model(), loader, ckpt_path="best")


def test_predictions_of_two_ranks_come_back_in_dataset_order() -> None:
    data = _data(11)
    per_rank = []
    for rank in range(2):
        loader, indices = _predictions.prediction_loader(
            DataLoader(data, batch_size=2, shuffle=True), 2, rank
        )
        assert isinstance(loader.sampler, DistributedSampler) and not loader.sampler.shuffle
        outputs = [{"x": x, "pair": Pair(x.sum(1), x[:, :1] * 2)} for x, _ in loader]
        assert indices is not None and [len(i) for i in indices] == [2, 2, 2]
        per_rank.append(list(zip(indices, outputs)))
    assert per_rank[1][-1][0] == [9, 0]  # the sampler repeats sample 0 to give rank 1 as many
    batches = _predictions.in_dataset_order(per_rank, batch_size=2)
    assert [b["x"].shape[0] for b in batches] == [2, 2, 2, 2, 2, 1]
    x = data.tensors[0]
    torch.testing.assert_close(torch.cat([b["x"] for b in batches]), x)
    assert isinstance(batches[0]["pair"], Pair)
    torch.testing.assert_close(torch.cat([b["pair"].scale for b in batches]), x[:, :1] * 2)


def test_predictions_without_a_batch_dimension_are_refused_for_several_ranks() -> None:
    with pytest.raises(ConfigurationError, match=r"shape \(\) for a batch of 2 samples"):
        _predictions.in_dataset_order([[([0, 1], torch.tensor(1.0))]], batch_size=2)
    with pytest.raises(ConfigurationError, match="predict_step returned a str"):
        _predictions.in_dataset_order([[([0, 1], "text")]], batch_size=2)


# -------------------------------------------------------------------------------------------------
# 16-true
# -------------------------------------------------------------------------------------------------


class Recorder(Model):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, _ = batch
        self.seen = (x.dtype, self.net.weight.dtype, self(x).dtype)
        return super().training_step(batch, batch_idx)


def test_sixteen_true_keeps_parameters_and_computation_in_float16(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = Recorder()
    trainer = _trainer(tmp_path, precision="16-true", max_steps=3)
    trainer.fit(model, DataLoader(_data(), batch_size=4))
    assert model.seen == (torch.float16, torch.float16, torch.float16)
    # The same three SGD steps in float16 by hand.
    torch.manual_seed(0)
    reference = Recorder()
    reference.configure_model()
    reference.half()
    optimizer = reference.configure_optimizers()
    for _, (x, y) in zip(range(3), DataLoader(_data(), batch_size=4)):
        reference.training_step((x.half(), y.half()), 0).backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, value in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name
    predictions = trainer.predict(dataloaders=DataLoader(_data().tensors[0], batch_size=4))
    assert predictions[0].dtype == torch.float16
    with trainer.init_module():  # seed 004's efficient initialisation: layers made here are float16
        layer = torch.nn.Linear(4, 2)
    assert layer.weight.dtype == torch.float16


def test_sixteen_true_names_an_op_without_a_float16_kernel(tmp_path: Path) -> None:
    class Distances(Model):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, _ = batch
            return torch.cdist(self(x), self(x)).mean()

    trainer = _trainer(tmp_path, precision="16-true", max_steps=1)
    with pytest.raises(PrecisionKernelError) as error:
        trainer.fit(Distances(), DataLoader(_data(), batch_size=4))
    message = str(error.value)
    assert "precision='16-true' on cpu" in message and "no float16 kernel for 'cdist'" in message
    assert "precision='bf16-true'" in message and isinstance(error.value, CapabilityError)


def test_sixteen_true_where_a_strategy_does_not_declare_it() -> None:
    pytest.importorskip("stratagem_deepspeed")
    # Refused when the Trainer is made, before anything launches (DeepSpeed's fp16 is 16-mixed).
    with pytest.raises(CapabilityError) as error:
        sg.Trainer(strategy="deepspeed_stage_3", accelerator="cpu", devices=2, precision="16-true")
    assert "does not support precision '16-true'" in str(error.value)
    assert "ddp" in error.value.alternatives and "fsdp" in error.value.alternatives
    with pytest.raises(ConfigurationError, match=r"precision='16-truee' is not one of .*'16-true'"):
        sg.Trainer(precision="16-truee")
