"""``Module.save_hyperparameters`` and ``Module.load_from_checkpoint`` in one process (single_device, full and
sharded checkpoints); the multi-process strategies' checkpoints and S3 are tests/seed_examples'."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import stratagem as sg
from stratagem.errors import CheckpointError, ConfigurationError


class Net(sg.Module):
    def __init__(
        self, width: int = 8, activation: str = "tanh", *, sizes: tuple = (1, 2), **extra: Any
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def configure_model(self) -> None:
        act = torch.nn.Tanh() if self.hparams.activation == "tanh" else torch.nn.ReLU()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, self.hparams.width), act, torch.nn.Linear(self.hparams.width, 1)
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)), batch_size=4
    )


def _fit(tmp_path: Path, model: sg.Module, fmt: str = "full") -> sg.Trainer:
    trainer = sg.Trainer(
        max_steps=3,
        enable_progress_bar=False,
        default_root_dir=tmp_path,
        checkpoint_every_n_steps=3,
        checkpoint_format=fmt,
        loggers=[],
    )
    trainer.fit(model, _loader())
    return trainer


def test_save_hyperparameters_keeps_the_constructor_arguments() -> None:
    net = Net(16, sizes=(3, 4), dropout=0.1, names=["a", "b"], table={"k": None})
    assert dict(net.hparams) == {
        "width": 16,
        "activation": "tanh",
        "sizes": (3, 4),
        "dropout": 0.1,
        "names": ["a", "b"],
        "table": {"k": None},
    }
    assert net.hparams.width == 16
    with pytest.raises(AttributeError, match="no hyperparameter 'depth'"):
        _ = net.hparams.depth


def test_save_hyperparameters_by_name_and_ignore() -> None:
    class Picky(sg.Module):
        def __init__(self, a: int, b: int, c: Any = None) -> None:
            super().__init__()
            self.save_hyperparameters("a", "b")

    class Ignoring(sg.Module):
        def __init__(self, a: int, layer: torch.nn.Module) -> None:
            super().__init__()
            self.save_hyperparameters(ignore="layer")

    assert dict(Picky(1, 2, c=torch.nn.ReLU()).hparams) == {"a": 1, "b": 2}
    assert dict(Ignoring(1, torch.nn.ReLU()).hparams) == {"a": 1}
    assert dict(sg.Module().hparams) == {}


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (torch.nn.ReLU(), "width is a torch.nn.modules.activation.ReLU"),
        (torch.ones(2), "width is a torch.Tensor"),
        ([1, {"x": object()}], "width[1]['x'] is a builtins.object"),
    ],
)
def test_values_that_are_not_plain_are_refused(value: Any, where: str) -> None:
    with pytest.raises(ConfigurationError) as error:
        Net(value)
    assert where in str(error.value)
    assert "save_hyperparameters(ignore=['width'])" in str(error.value)


def test_misuse_says_what_to_do() -> None:
    class Outside(sg.Module):
        def setup(self) -> None:
            self.save_hyperparameters()

    class Unknown(sg.Module):
        def __init__(self, a: int = 1) -> None:
            super().__init__()
            self.save_hyperparameters("b")

    class StarArgs(sg.Module):
        def __init__(self, *layers: int) -> None:
            super().__init__()
            self.save_hyperparameters()

    with pytest.raises(ConfigurationError, match=r"called from setup\(\); call it in your module's __init__"):
        Outside().setup()
    with pytest.raises(
        ConfigurationError, match=r"'b' is not an argument of __init__; its arguments are \['a'\]"
    ):
        Unknown()
    with pytest.raises(ConfigurationError, match=r"positional \*layers"):
        StarArgs(1, 2)
    with pytest.raises(ConfigurationError, match=r"\{1: 2\} has the key|has the key 1"):
        Net(8, table={1: 2})


@pytest.mark.parametrize("fmt", ["full", "sharded"])
def test_checkpoints_hold_them_as_plain_data_and_load_from_checkpoint_rebuilds(
    tmp_path: Path, fmt: str
) -> None:
    net = Net(16, "relu", sizes=(5,), note="x")
    trainer = _fit(tmp_path, net, fmt)
    path = tmp_path / "checkpoints" / ("step-000003.ckpt" if fmt == "full" else "step-000003")
    plain = path if fmt == "full" else path / "state.pt"
    saved = torch.load(plain, weights_only=True)
    state = saved["state"] if fmt == "full" else saved
    assert state["hyperparameters"] == {"width": 16, "activation": "relu", "sizes": (5,), "note": "x"}

    loaded = Net.load_from_checkpoint(path)
    assert type(loaded) is Net and dict(loaded.hparams) == dict(net.hparams)
    assert isinstance(loaded.net[1], torch.nn.ReLU)
    for name, value in trainer.model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    # The Trainer does not build the layers again (which would replace the loaded weights).
    again = sg.Trainer(enable_progress_bar=False, default_root_dir=tmp_path / "again", loggers=[])
    weights = {k: v.clone() for k, v in loaded.state_dict().items()}
    again.validate(loaded, _loader())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())


def test_overrides_and_missing_arguments(tmp_path: Path) -> None:
    class Required(Net):
        def __init__(self, width: int, scale: float) -> None:
            sg.Module.__init__(self)
            self.save_hyperparameters("width")

        def configure_model(self) -> None:
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, self.hparams.width), torch.nn.Linear(self.hparams.width, 1)
            )

    _fit(tmp_path, Required(8, 2.0))
    path = tmp_path / "checkpoints" / "step-000003.ckpt"
    assert Required.load_from_checkpoint(path, scale=3.0).hparams.width == 8
    with pytest.raises(ConfigurationError) as error:
        Required.load_from_checkpoint(path)
    message = str(error.value)
    assert "Required(**['width']) failed" in message and "scale" in message
    assert (
        "The checkpoint stores ['width']" in message and "load_from_checkpoint(path, name=value)" in message
    )
    # Weights that do not fit the module built with the overrides: named, not loaded.
    with pytest.raises(CheckpointError, match=r"shape of net.0.weight: checkpoint \(8, 4\), model \(4, 4\)"):
        Required.load_from_checkpoint(path, width=4, scale=1.0)


def test_load_from_checkpoint_inside_init_module_with_empty_init(tmp_path: Path) -> None:
    trained = _fit(tmp_path, Net(8))
    trainer = sg.Trainer(
        precision="bf16-true", enable_progress_bar=False, default_root_dir=tmp_path / "b", loggers=[]
    )
    with trainer.init_module(empty_init=True):
        loaded = Net.load_from_checkpoint(tmp_path / "checkpoints" / "step-000003.ckpt")
    # Built on the meta device, then the loaded tensors in the parameters' dtype.
    for name, value in loaded.state_dict().items():
        assert not value.is_meta and value.dtype == torch.bfloat16
        assert torch.equal(value, trained.model.state_dict()[name].to(torch.bfloat16)), name


def test_without_save_hyperparameters_and_a_missing_checkpoint(tmp_path: Path) -> None:
    class Plain(sg.Module):
        def __init__(self) -> None:
            super().__init__()
            # Assigned by hand: what loggers record, not what checkpoints keep (that is save_hyperparameters').
            self.hparams = {"note": object()}

        def configure_model(self) -> None:
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    plain = Plain()
    assert set(plain.hparams) == {"note"}
    trainer = _fit(tmp_path, plain)
    path = tmp_path / "checkpoints" / "step-000003.ckpt"
    assert "hyperparameters" not in torch.load(path, weights_only=True)["state"]
    loaded = Plain.load_from_checkpoint(path)
    assert torch.equal(loaded.net.weight, trainer.model.net.weight)
    with pytest.raises(CheckpointError, match="does not exist"):
        Plain.load_from_checkpoint(tmp_path / "nothing.ckpt")
